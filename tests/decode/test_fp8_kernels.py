"""The FP8 KV cache's decode kernel (`sparse_decode_split<T, D, MT, fp8_e4m3>`, docs/decode.md §16) on a GPU:
the kernel against the references on the dequantized cache, the CUDA-graph step and the custom op under
torch.compile on an FP8 cache.

These tests have NOT run yet: no GPU was at hand when the kernel was written (issue #56, item 4). The
kernel path refuses an FP8 cache until they pass (`infllm_cupy.decode.fp8.VERIFIED_ON_HARDWARE`, checked
by `fp8.check_verified`); every test here lifts the gate for itself (the `verified` fixture), so
`pytest -m gpu tests/decode/test_fp8_kernels.py` on a GPU runs them as they would run once it is lifted.
To lift the gate: run this file (and tests/decode/test_fp8_cache.py, tests/decode/test_sparse_decode.py,
tests/decode/test_decode_step.py with -m gpu) on sm_80 and sm_90 GPUs, then set
`VERIFIED_ON_HARDWARE = True` in infllm_cupy/decode/fp8.py, drop the `verified` fixture's monkeypatch and
update test_fp8_cache.py's `test_kernel_path_refuses_the_fp8_cache` (which checks the refusal).

The rule is FlashAttention's (`assert_close_to_ref`: error at most 2x the low-precision torch error)
against the float64 reference on the *dequantized* cache, which is what the kernel reads: e4m3 x scale
rounded once to the query's dtype, the open page from the 16-bit buffers. Outputs are poisoned with NaN
(`_env.override(poison=True)`), so an element the kernel never writes fails.
"""
import dataclasses

import pytest
import torch

from infllm_cupy import _env
from infllm_cupy.config import InfLLMv2Config
from infllm_cupy.decode import DecodeCache, infllmv2_decode, naive_sparse_decode, sparse_decode
from infllm_cupy.decode import fp8 as fp8_module
from infllm_cupy.decode.sparse_decode import DecodePlan
from infllm_cupy.testing import (
    assert_close_to_ref,
    assert_decode_close_to_ref,
    cu_seqlens_from_lengths,
    random_topk_idx,
)

FP8 = torch.float8_e4m3fn
CFG = InfLLMv2Config()


@pytest.fixture
def verified(monkeypatch):
    """The gate lifted for one test (the kernel path takes FP8 caches), outputs poisoned with NaN."""
    monkeypatch.setattr(fp8_module, "VERIFIED_ON_HARDWARE", True)
    with _env.override(poison=True):
        yield


def fp8_cache(lengths, H, D, dtype, *, page_size=None, seed=0, spare=70, steps=2):
    """A CUDA FP8 cache of `lengths` (a chunk, then `steps` one-token appends: full pages quantized, open
    pages of 1..63 tokens in the buffers), shuffled pages with a -1 tail when paged."""
    g = torch.Generator().manual_seed(seed)
    B = len(lengths)
    cap = max(lengths) + spare
    if page_size is None:
        cache = DecodeCache.contiguous(B, cap, H, D, dtype=dtype, device="cuda", kv_dtype=FP8)
    else:
        per = -(-cap // page_size)
        n_pages = B * per + 3
        table = torch.randperm(n_pages, generator=g)[:B * per].view(B, per).to(torch.int32)
        if per > 1 and lengths[-1] + steps <= (per - 1) * page_size:
            table[-1, -1] = -1
        cache = DecodeCache.paged(n_pages, page_size, H, D, table.cuda(), dtype=dtype, device="cuda",
                                  kv_dtype=FP8)
    steps = steps if min(lengths) >= steps else 0
    first = [L - steps for L in lengths]
    # keys with a per-channel offset (what per-channel scales are for) and a spread of magnitudes
    k = torch.randn(sum(first), H, D, generator=g) * 2 + torch.randn(D, generator=g) * 3
    v = torch.randn(sum(first), H, D, generator=g)
    cache.append(k.to("cuda", dtype), v.to("cuda", dtype), cu_seqlens_from_lengths(first))
    for _ in range(steps):
        cache.append((torch.randn(B, H, D, generator=g) * 2).to("cuda", dtype),
                     torch.randn(B, H, D, generator=g).to("cuda", dtype))
    assert cache.lengths() == list(lengths)
    return cache


def dequantized_tuple(cache, dtype=None):
    """The cache as the kernel reads it, a `(k, v, seqlens[, block_table])` tuple in `dtype`."""
    k, v = cache.dequantized()
    if dtype is not None:
        k, v = k.to(dtype), v.to(dtype)
    return (k, v, cache.seqlens) + ((cache.block_table,) if cache.is_paged else ())


# lengths around the page (open pages of 0, 1, 63 tokens and longer), GQA 1..32, D 64/128, both dtypes,
# contiguous and paged (64, 256), dense and sparse selections of K entries
CASES = [
    ([1, 63, 64, 65, 127, 128], 16, 1, 128, torch.bfloat16, None, 5),
    ([1, 63, 64, 65, 127, 128], 16, 1, 128, torch.float16, None, 0),
    ([300, 1000, 70], 32, 1, 128, torch.bfloat16, 64, 12),
    ([300, 1000, 70], 64, 2, 128, torch.float16, 256, 0),
    ([2049, 17, 191], 4, 2, 64, torch.float16, 128, 20),
    ([777], 1, 1, 64, torch.bfloat16, None, 7),
    ([129, 513, 200], 24, 1, 128, torch.float16, 64, 9),
    ([130, 4000], 48, 1, 64, torch.bfloat16, 256, 30),
    ([5000, 1], 12, 4, 128, torch.bfloat16, 64, 0),
    ([3, 64, 4095], 2, 2, 64, torch.float16, None, 0),
]
IDS = [f"L{'-'.join(map(str, c[0]))}_HQ{c[1]}_H{c[2]}_D{c[3]}_{str(c[4])[6:]}"
       f"_{'pg' + str(c[5]) if c[5] else 'contig'}_{'K' + str(c[6]) if c[6] else 'dense'}" for c in CASES]


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_fp8_kernel_matches_the_reference_on_the_dequantized_cache(case, verified):
    lengths, HQ, H, D, dtype, page_size, K = case
    cache = fp8_cache(lengths, H, D, dtype, page_size=page_size)
    B = len(lengths)
    q = torch.randn(B, HQ, D, generator=torch.Generator().manual_seed(1)).to("cuda", dtype)
    idx = None
    if K:
        g = torch.Generator().manual_seed(2)
        idx = random_topk_idx(H, [1] * B, lengths, K, generator=g).cuda()
        if B > 1:
            idx[:, 1, :] = -1                                    # a sequence with nothing selected
    out, lse, w = sparse_decode(q, cache, idx, return_lse=True, return_attn_weights=True)
    deq = dequantized_tuple(cache)
    ref, ref_lse, ref_w = naive_sparse_decode(q.double(), dequantized_tuple(cache, torch.float64), idx,
                                              return_lse=True, return_attn_weights=True)
    lowp, lowp_lse, lowp_w = naive_sparse_decode(q, deq, idx, return_lse=True, return_attn_weights=True,
                                                 upcast=False)
    assert_decode_close_to_ref(out, lse, w, ref, ref_lse, ref_w, lowp, lowp_lse, lowp_w)
    wk = sparse_decode(q, cache, idx, return_attn_weights=True, weights="per_kv_head")[1]
    torch.testing.assert_close(wk, w.view(B, H, HQ // H, -1).sum(2), atol=1e-5, rtol=0)
    assert torch.equal(sparse_decode(q, cache, idx), out)
    # the kernel dequantizes into the 16-bit tile the 16-bit kernel reads: on a 16-bit cache holding the
    # dequantized values, the 16-bit kernel gives the same bits
    assert torch.equal(sparse_decode(q, deq, idx), out)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [None, 64])
def test_fp8_kernel_plans_agree(page_size, verified):
    """Split counts (a direct single-split write, merges of many) and merge groups on one FP8 cache."""
    lengths, HQ, H, D, dtype = [700, 65, 1], 8, 2, 128, torch.bfloat16
    cache = fp8_cache(lengths, H, D, dtype, page_size=page_size)
    q = torch.randn(3, HQ, D, device="cuda", dtype=dtype)
    deq = dequantized_tuple(cache)
    idx = random_topk_idx(H, [1] * 3, lengths, 9, generator=torch.Generator().manual_seed(3)).cuda()
    for sel in (None, idx):
        n = 9 if sel is not None else -(-cache.capacity // 64)
        for plan in (DecodePlan(1, 1, n), DecodePlan(1, n, 1), DecodePlan(1, 3, -(-n // 3), merge_groups=1)):
            got = sparse_decode(q, cache, sel, plan=plan, return_lse=True)
            want = sparse_decode(q, deq, sel, plan=plan, return_lse=True)
            assert all(torch.equal(a, b) for a, b in zip(got, want)), plan


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [None, 64])
def test_fp8_step_equals_the_step_on_the_dequantized_cache(page_size, verified):
    """The whole step (stage 1 on the unquantized compressed keys, then the FP8 kernel), dense and sparse,
    with LSE, weights and the selection: the same selection as the reference, outputs within the rule."""
    lengths, HQ, H, D, dtype = [900, 333, 64], 16, 2, 128, torch.bfloat16
    cache = fp8_cache(lengths, H, D, dtype, page_size=page_size)
    q = torch.randn(3, HQ, D, device="cuda", dtype=dtype)
    for dense_len in (0, 10_000):
        cfg = dataclasses.replace(CFG, dense_len=dense_len)
        out, lse, w, idx = infllmv2_decode(q, cache, config=cfg, return_lse=True, return_attn_weights=True,
                                           return_topk_idx=True)
        ref, ref_lse, ref_w, ref_idx = infllmv2_decode(q, cache, config=cfg, return_lse=True,
                                                       return_attn_weights=True, return_topk_idx=True,
                                                       backend="reference")
        if idx is not None:
            assert torch.equal(idx, ref_idx)
        sel = idx if idx is not None else None
        ref64, ref64_lse = naive_sparse_decode(q.double(), dequantized_tuple(cache, torch.float64), sel,
                                               return_lse=True)
        assert_close_to_ref(f"out dense_len={dense_len}", out, ref64, ref)
        assert_close_to_ref(f"lse dense_len={dense_len}", lse, ref64_lse, ref_lse, atol_floor=1e-5)
        torch.testing.assert_close(w, ref_w, atol=2e-3, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [None, 64])
def test_fp8_cache_graphs_replay_equal_the_eager_launches(page_size, verified):
    """`DecodeCache.graphs` on FP8 caches: steps across page boundaries (pages quantized between steps,
    open pages of 1..63 tokens) and across dense_len, replays bit-identical to eager launches."""
    lengths, HQ, H, D, dtype = [500, 380], 16, 2, 128, torch.bfloat16
    cfg = dataclasses.replace(CFG, dense_len=512, score_dtype=torch.bfloat16)
    eager = fp8_cache(lengths, H, D, dtype, page_size=page_size)
    graphed = fp8_cache(lengths, H, D, dtype, page_size=page_size)
    graphed.graphs = True
    g = torch.Generator().manual_seed(9)
    for _ in range(24):                              # 500 -> 524: dense, page 8 quantized at 512, sparse
        kn, vn = (torch.randn(2, H, D, generator=g).to("cuda", dtype) for _ in range(2))
        q = torch.randn(2, HQ, D, generator=g).to("cuda", dtype)
        eager.append(kn, vn)
        graphed.append(kn, vn)
        res_e = infllmv2_decode(q, eager, config=cfg, return_lse=True, return_attn_weights=True)
        res_g = infllmv2_decode(q, graphed, config=cfg, return_lse=True, return_attn_weights=True)
        for a, b in zip(res_g, res_e):
            assert torch.equal(a, b)


@pytest.mark.gpu
def test_fp8_step_captured_with_its_append_follows_the_cache(verified):
    """A CUDA graph of append + step on an FP8 cache (the quantizing append is torch ops with device
    positions): replays across a page boundary equal the eager calls."""
    lengths, HQ, H, D, dtype = [125, 60], 8, 2, 64, torch.float16
    cfg = dataclasses.replace(CFG, dense_len=0)
    eager = fp8_cache(lengths, H, D, dtype, page_size=64)
    graphed = fp8_cache(lengths, H, D, dtype, page_size=64)
    kn = torch.zeros(2, H, D, device="cuda", dtype=dtype)
    vn, q = torch.zeros_like(kn), torch.zeros(2, HQ, D, device="cuda", dtype=dtype)

    def step(cache):
        cache.append(kn, vn)
        return infllmv2_decode(q, cache, config=cfg, return_lse=True)

    warm = fp8_cache(lengths, H, D, dtype, page_size=64)
    step(warm)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        res_g = step(graphed)
    g = torch.Generator().manual_seed(4)
    for _ in range(8):                               # 125 -> 133, 60 -> 68: both cross a page boundary
        kn.copy_(torch.randn(2, H, D, generator=g))
        vn.copy_(torch.randn(2, H, D, generator=g))
        q.copy_(torch.randn(2, HQ, D, generator=g))
        graph.replay()
        res_e = step(eager)
        for a, b in zip(res_g, res_e):
            assert torch.equal(a, b)
    assert graphed.sync_lengths() == eager.lengths()
    for name in ("k", "v", "k_scale", "v_scale", "k_recent", "v_open", "ck1", "ck2"):
        a, b = getattr(graphed, name), getattr(eager, name)
        assert torch.equal(a.view(torch.uint8) if a.dtype == FP8 else a,
                           b.view(torch.uint8) if b.dtype == FP8 else b), name


@pytest.mark.gpu
def test_fp8_kernel_op_under_compile(verified):
    """`infllm_cupy::infllmv2_decode` with an FP8 cache's tensors, traced by torch.compile (fullgraph):
    the eager kernels' bits; `backend="reference"` through the op reads the dequantized cache."""
    cfg = dataclasses.replace(CFG, dense_len=0)
    cache = fp8_cache([500, 90], 2, 64, torch.float16, page_size=64)
    q = torch.randn(2, 8, 64, device="cuda", dtype=torch.float16)
    step = torch.compile(lambda q: infllmv2_decode(q, cache, config=cfg, return_lse=True), fullgraph=True,
                         backend="eager")
    out, lse = step(q)
    ref, ref_lse = infllmv2_decode(q, cache, config=cfg, return_lse=True)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    attend = torch.compile(lambda q: sparse_decode(q, cache, return_lse=True), fullgraph=True,
                           backend="eager")
    o2, l2 = attend(q)
    e2, el2 = sparse_decode(q, cache, return_lse=True)
    assert torch.equal(o2, e2) and torch.equal(l2, el2)
    r_out = torch.compile(lambda q: infllmv2_decode(q, cache, config=cfg, backend="reference"),
                          fullgraph=True, backend="eager")(q)
    torch.testing.assert_close(out.float(), r_out.float(), atol=2e-2, rtol=0)   # another order of sums


@pytest.mark.gpu
def test_fp8_kernel_path_is_refused_until_verified():
    # the gate itself on hardware: without the fixture, a CUDA FP8 cache refuses the kernels by name
    cache = fp8_cache([70], 1, 64, torch.bfloat16)
    q = torch.randn(1, 2, 64, device="cuda", dtype=torch.bfloat16)
    if fp8_module.VERIFIED_ON_HARDWARE:
        pytest.skip("the gate is lifted")
    with pytest.raises(NotImplementedError, match="not yet verified on hardware"):
        sparse_decode(q, cache)
    assert sparse_decode(q, cache, backend="reference").shape == q.shape


# ------------------------------------------------------------------------------ the launch path (CPU)
def test_fp8_plan_shared_memory_and_input_checks():
    from infllm_cupy.decode.sparse_decode import check_fp8_tensors, check_plan, fp8_stage_bytes
    plan = DecodePlan(1, 4, 8)
    assert fp8_stage_bytes(128) == 2 * 64 * 128 + 4 * 128 + 4 * 64
    assert (plan.split_smem_bytes(128, True, 96, kv8=True) - plan.split_smem_bytes(128, True, 96)
            == 2 * fp8_stage_bytes(128))
    check_plan(plan, 16, 32, 128, 96, kv8=True)
    with pytest.raises(ValueError, match="more shared memory"):
        check_plan(DecodePlan(4, 1, 20_000), 64, 20_000, 128, 20_000, kv8=True)
    c = DecodeCache.paged(6, 128, 2, 64, torch.arange(6, dtype=torch.int32).view(2, 3), kv_dtype=FP8)
    q = torch.zeros(2, 4, 64, dtype=torch.bfloat16)
    check_fp8_tensors(q, c.k, c.fp8_tensors())
    k_scale, v_scale, k_recent, v_open = c.fp8_tensors()
    for i, (name, bad) in enumerate((("k_scale", k_scale[:, :1]), ("v_scale", v_scale.double()),
                                     ("k_recent", k_recent.half()), ("v_open", v_open[:1]))):
        kv8 = list(c.fp8_tensors())
        kv8[i] = bad
        with pytest.raises((TypeError, ValueError), match=name):
            check_fp8_tensors(q, c.k, kv8)


def test_fp8_launcher_refuses_until_verified():
    from infllm_cupy._launch import Launches
    from infllm_cupy.decode.sparse_decode import add_sparse_decode
    c = DecodeCache.contiguous(1, 128, 1, 64, kv_dtype=FP8)
    q = torch.zeros(1, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match=r"fp8_e4m3.*not yet verified on hardware"):
        add_sparse_decode(Launches("cpu"), q, c.k, c.v, c.seqlens, None, 128, None, scale=0.125,
                          plan=DecodePlan(1, 1, 2), kv8=c.fp8_tensors())


@pytest.mark.parametrize("page_size", [None, 64])
def test_op_on_cpu_reads_the_fp8_tensors_dequantized(page_size):
    """The custom op given an FP8 cache's tensors on CPU (its reference) equals the op on the dequantized
    cache, and equals the step."""
    from infllm_cupy.decode.step import infllmv2_decode_op, step_spec
    H, D, dtype = 2, 64, torch.bfloat16
    c = (DecodeCache.contiguous(2, 200, H, D, dtype=dtype, kv_dtype=FP8) if page_size is None else
         DecodeCache.paged(8, page_size, H, D, torch.arange(8, dtype=torch.int32).view(2, 4), dtype=dtype,
                           kv_dtype=FP8))
    g = torch.Generator().manual_seed(5)
    k_new, v_new = (torch.randn(200, H, D, generator=g).to(dtype) for _ in range(2))
    c.append(k_new, v_new, cu_seqlens_from_lengths([130, 70]))
    q = torch.randn(2, 4 * H, D, generator=g).to(dtype)
    cfg = dataclasses.replace(CFG, dense_len=0, topk=2)
    spec = step_spec(cfg, select="stage1", device_dense=True, return_lse=True).encode()
    k, v = c.dequantized()
    args = (c.ck1, c.ck2, c.seqlens, c.block_table, None, spec)
    got = infllmv2_decode_op(q, c.k, c.v, *args, *c.fp8_tensors())
    want = infllmv2_decode_op(q, k, v, *args)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    with pytest.raises(ValueError, match="all four"):
        infllmv2_decode_op(q, c.k, c.v, *args, c.k_scale)
