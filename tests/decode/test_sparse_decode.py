"""sparse_decode: the split-KV decode kernel against naive_sparse_decode (GPU), the reference against
the stage-2 references (CPU), the plan and the launcher's input checks (CPU)."""
import math

import pytest
import torch

from infllm_cupy.decode import DecodeCache, naive_sparse_decode, plan_decode, sparse_decode
from infllm_cupy.decode.sparse_decode import (
    DecodePlan,
    check_decode_kernel_inputs,
    check_plan,
    default_merge_groups,
    weights_scratch_floats,
)
from infllm_cupy.stage2.naive import naive_dense_attn_varlen, naive_sparse_attn_varlen
from infllm_cupy.testing import (
    assert_close_to_ref,
    assert_decode_close_to_ref,
    cu_seqlens_from_lengths,
    random_topk_idx,
)


def make_cache(lengths, H, D, dtype, *, page_size=None, device="cpu", seed=0, spare=70, chunked=True):
    """A cache holding random keys/values of `lengths` (filled by a chunk, then 2 one-token steps when
    `chunked`), `spare` positions of room; paged caches get shuffled pages and a -1 tail."""
    g = torch.Generator().manual_seed(seed)
    B = len(lengths)
    cap = max(lengths) + spare
    if page_size is None:
        cache = DecodeCache.contiguous(B, cap, H, D, dtype=dtype, device=device)
    else:
        per = math.ceil(cap / page_size)
        n_pages = B * per + 3
        pg = torch.Generator().manual_seed(seed + 100)                # K/V draws independent of the layout
        perm = torch.randperm(n_pages, generator=pg)[:B * per].view(B, per).to(torch.int32)
        perm[-1, -1] = -1 if per > 1 and lengths[-1] + 2 <= (per - 1) * page_size else perm[-1, -1]
        cache = DecodeCache.paged(n_pages, page_size, H, D, perm.to(device), dtype=dtype, device=device)
    steps = 2 if chunked and min(lengths) >= 2 else 0
    first = [L - steps for L in lengths]
    k = (torch.randn(sum(first), H, D, generator=g) * 2).to(device, dtype)
    v = torch.randn(sum(first), H, D, generator=g).to(device, dtype)
    cache.append(k, v, cu_seqlens_from_lengths(first))
    for _ in range(steps):
        cache.append((torch.randn(B, H, D, generator=g) * 2).to(device, dtype),
                     torch.randn(B, H, D, generator=g).to(device, dtype))
    assert cache.lengths() == list(lengths)
    return cache


def selection(H, lengths, K, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return random_topk_idx(H, [1] * len(lengths), lengths, K, generator=g).to(device)   # [H, B, K]


def as_tuple(cache, dtype=None):
    f = (lambda t: t) if dtype is None else (lambda t: t.to(dtype))
    base = (f(cache.k), f(cache.v), cache.seqlens)
    return base + ((cache.block_table,) if cache.is_paged else ())


# ------------------------------------------------------------------------------------- reference (CPU)
@pytest.mark.parametrize("page_size", [None, 64, 256], ids=["contiguous", "page64", "page256"])
def test_reference_equals_the_stage2_references(page_size):
    lengths, H, HQ, D = [1, 63, 64, 65, 300, 129], 2, 6, 32
    cache = make_cache(lengths, H, D, torch.float64, page_size=page_size)
    q = torch.randn(len(lengths), HQ, D, dtype=torch.float64)
    k, v, cu = cache.packed()
    cu_q = cu_seqlens_from_lengths([1] * len(lengths))
    dense = naive_sparse_decode(q, cache)
    torch.testing.assert_close(dense, naive_dense_attn_varlen(q, k, v, cu_q, cu, causal=False))
    idx = selection(H, lengths, 5)
    out, lse = naive_sparse_decode(q, cache, idx, return_lse=True)
    ref, ref_lse = naive_sparse_attn_varlen(q, k, v, cu_q, cu, idx, 1, max(lengths), causal=False,
                                            return_lse=True)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(lse, ref_lse.T.float())


def test_reference_paged_equals_contiguous():
    lengths, H, HQ, D = [200, 5, 64], 2, 4, 16
    a = make_cache(lengths, H, D, torch.float32)
    b = make_cache(lengths, H, D, torch.float32, page_size=64)
    q = torch.randn(3, HQ, D)
    idx = selection(H, lengths, 4)
    for sel in (None, idx):
        ra = naive_sparse_decode(q, a, sel, return_lse=True, return_attn_weights=True)
        rb = naive_sparse_decode(q, b, sel, return_lse=True, return_attn_weights=True)
        torch.testing.assert_close(ra[0], rb[0], rtol=0, atol=0)
        torch.testing.assert_close(ra[1], rb[1], rtol=0, atol=0)
        wa, wb = ra[2], rb[2]                                    # widths 270 and 320 (5 pages of 64)
        assert wa.shape[-1] == a.capacity and wb.shape[-1] == b.capacity
        torch.testing.assert_close(wa, wb[..., :a.capacity], rtol=0, atol=0)
        assert (wb[..., a.capacity:] == 0).all()


def test_reference_weights():
    lengths, H, HQ, D = [300, 1, 130], 2, 8, 16
    cache = make_cache(lengths, H, D, torch.float64, page_size=64)
    q = torch.randn(3, HQ, D, dtype=torch.float64)
    idx = selection(H, lengths, 4)
    idx[:, 1] = -1                                                     # sequence 1 selects nothing
    out, lse, w = naive_sparse_decode(q, cache, idx, return_lse=True, return_attn_weights=True)
    assert w.shape == (3, HQ, cache.capacity) and w.dtype == torch.float32
    assert torch.isinf(lse[1]).all() and (out[1] == 0).all() and (w[1] == 0).all()
    fin = ~torch.isinf(lse)                                            # heads whose selection holds a key
    assert fin[0].all() and fin[2].any()
    torch.testing.assert_close(w.sum(-1)[fin].double(), torch.ones(int(fin.sum()), dtype=torch.float64))
    assert (w[~fin] == 0).all()
    # zero exactly where not selected or past the length; nonzero where selected
    for b, L in enumerate(lengths):
        nb = math.ceil(L / 64)
        for h in range(H):
            sel = torch.zeros(cache.capacity, dtype=torch.bool)
            for x in idx[h, b].tolist():
                if 0 <= x < nb:
                    sel[x * 64:min(L, x * 64 + 64)] = True
            rows = w[b, h * 4:(h + 1) * 4]
            assert (rows[:, ~sel] == 0).all() and (rows[:, sel] > 0).all()
    # the weights reproduce the output, and per_kv_head is their sum over the group
    vals = torch.stack([torch.cat([cache.gather(b)[1], cache.v.new_zeros(cache.capacity - L, H, D)])
                        for b, L in enumerate(lengths)])                # [B, W, H, D]
    again = torch.einsum("bhgw,bwhd->bhgd", w.view(3, H, 4, -1).double(), vals).reshape(3, HQ, D)
    torch.testing.assert_close(again, out, atol=1e-6, rtol=1e-6)
    wk = naive_sparse_decode(q, cache, idx, return_attn_weights=True, weights="per_kv_head")[1]
    torch.testing.assert_close(wk, w.view(3, H, 4, -1).sum(2))


def test_cpu_tensors_run_the_cpu_implementation_or_the_reference():
    # "auto": the selected blocks only (decode/cpu.py), fp32 rounding apart; "reference": the oracle exactly
    cache = make_cache([70, 3], 1, 16, torch.float32)
    q = torch.randn(2, 2, 16)
    want = naive_sparse_decode(q, cache)
    torch.testing.assert_close(sparse_decode(q, cache), want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sparse_decode(q, cache, backend="reference"), want, rtol=0, atol=0)


# ---------------------------------------------------------------------------------- plan and checks (CPU)
def test_plan_is_a_pure_function_of_shapes():
    p = plan_decode(1, 2, 16, 96, 132)
    assert p == plan_decode(1, 2, 16, 96, 132) and isinstance(p, DecodePlan)
    assert p.row_tiles == 1 and p.num_splits * p.per_split >= 96 and (p.num_splits - 1) * p.per_split < 96
    assert plan_decode(1, 2, 17, 96, 132).row_tiles == 2 and plan_decode(1, 2, 64, 96, 132).row_tiles == 4
    assert plan_decode(64, 8, 4, 96, 132).num_splits == 1                       # enough CTAs already
    assert plan_decode(1, 2, 16, cdiv_(131072, 64), 132).num_splits == 64  # dense 128k at batch 1: an SM each
    with pytest.raises(ValueError, match="G"):
        plan_decode(1, 1, 65, 10, 132)


def test_plan_fills_one_wave():
    # the most splits whose CTAs fit one wave at one CTA per SM, never fewer than one split and never
    # more than the entries (sparse: topk entries; dense: blocks)
    assert plan_decode(1, 2, 16, 96, 132).num_splits == 48
    assert plan_decode(8, 2, 16, 96, 132).num_splits == 8
    assert plan_decode(8, 2, 16, 512, 132).num_splits == 8
    assert plan_decode(1, 2, 16, 2048, 132).num_splits == 64
    assert plan_decode(64, 2, 16, 512, 132).num_splits == 1
    assert plan_decode(128, 2, 16, 512, 132).num_splits == 1
    assert plan_decode(1, 2, 16, 3, 132).num_splits == 3
    for b in (1, 3, 8, 16, 33, 64):
        for n in (1, 96, 2048):
            p = plan_decode(b, 2, 16, n, 132)
            assert b * 2 * p.num_splits <= 132 or p.num_splits == 1
            assert p.num_splits * p.per_split >= n and p.num_splits <= n


def test_plan_checks():
    check_plan(DecodePlan(1, 8, 12), 16, 96, 128, 96)
    for plan, match in [(DecodePlan(1, 8, 11), "fewer"), (DecodePlan(1, 8, 12), "G = 17"),
                        (DecodePlan(3, 8, 12), "row_tiles"), ((1, 8, 12), "plan")]:
        with pytest.raises(ValueError, match=match):
            check_plan(plan, 17 if match == "G = 17" else 16, 96, 128, 96)
    with pytest.raises(ValueError, match="topk_idx"):
        check_plan(DecodePlan(1, 1, 60000), 16, 60000, 128, 60000)


def test_plan_merge_groups():
    # merge groups: a power of two near S / 4, at least a warp and at most 1024 threads of D / 4
    assert default_merge_groups(16, 128) == 4 and default_merge_groups(96, 128) == 32
    assert default_merge_groups(1, 128) == 1 and default_merge_groups(1, 64) == 2
    assert default_merge_groups(256, 128) == 32 and default_merge_groups(256, 64) == 64
    for S in range(1, 300, 7):
        for D in (64, 128):
            g = default_merge_groups(S, D)
            assert g & (g - 1) == 0 and 32 <= g * D // 4 <= 1024
            assert DecodePlan(1, S, 1).merge_threads(D) == g * D // 4
    assert DecodePlan(1, 8, 12, merge_groups=8).merge_threads(128) == 256
    check_plan(DecodePlan(1, 8, 12, merge_groups=32), 16, 96, 128, 96)
    check_plan(DecodePlan(1, 8, 12, merge_groups=2), 16, 96, 64, 96)
    for plan, D in [(DecodePlan(1, 8, 12, merge_groups=3), 128), (DecodePlan(1, 8, 12, merge_groups=64), 128),
                    (DecodePlan(1, 8, 12, merge_groups=1), 64), (DecodePlan(1, 8, 12, merge_groups=-2), 128),
                    (DecodePlan(1, 8, 12, merge_groups=True), 128),
                    (DecodePlan(1, 8, 12, merge_groups=2.0), 128)]:
        with pytest.raises(ValueError, match="merge_groups"):
            check_plan(plan, 16, 96, D, 96)
    with pytest.raises(ValueError, match="pdl"):
        check_plan(DecodePlan(1, 8, 12, pdl=None), 16, 96, 128, 96)


def cdiv_(a, b):
    return -(-a // b)


def test_weights_scratch_size():
    # fp16 relative probabilities [B, HQ, W] in whole 16-byte units (so what follows stays aligned),
    # then one fp32 max per 16-key group and query head, the group padded to a multiple of 4, also
    # whole 16-byte units (docs/decode.md, 5. Attention weights)
    for B, H, G, W in [(1, 1, 1, 1), (2, 1, 3, 71), (8, 2, 16, 32768), (3, 5, 1, 130), (2, 3, 6, 64)]:
        n_p, n_m = weights_scratch_floats(B, H, G, W)
        assert n_p % 4 == 0 and 2 * n_p >= B * H * G * W > 2 * n_p - 8
        gp = -(-G // 4) * 4
        assert n_m % 4 == 0 and n_m == B * H * cdiv_(W, 16) * gp


def test_kernel_input_checks_name_the_argument():
    cache = make_cache([100, 7], 2, 64, torch.bfloat16, page_size=64)
    q = torch.randn(2, 8, 64, dtype=torch.bfloat16)
    idx = selection(2, [100, 7], 3)
    k, v, s, bt = as_tuple(cache)
    cases = [
        (dict(q=q.float()), "q"),
        (dict(q=q.half()), "k_cache"),
        (dict(q=torch.randn(2, 7, 64, dtype=torch.bfloat16)), "multiple"),
        (dict(q=torch.randn(2, 8, 32, dtype=torch.bfloat16)), "head dim"),
        (dict(topk=idx.long()), "topk_idx"),
        (dict(topk=idx[:1]), "topk_idx"),
        (dict(s=s.long()), "seqlens"),
        (dict(bt=bt[:1]), "block_table"),
        (dict(v=v[:, :, :1]), "v_cache"),
    ]
    for change, match in cases:
        args = dict(q=q, k=k, v=v, s=s, bt=bt, topk=idx)
        args.update(change)
        with pytest.raises((ValueError, TypeError), match=match):
            check_decode_kernel_inputs(args["q"], args["k"], args["v"], args["s"], args["bt"], args["topk"])
    with pytest.raises(ValueError, match="CUDA"):
        check_decode_kernel_inputs(q, k, v, s, bt, idx)
    with pytest.raises(ValueError, match="weights"):
        sparse_decode(q, cache, weights="per_query")


# ------------------------------------------------------------------------------------------ kernel (GPU)
# (lengths, HQ, H, D, dtype, page_size, K): K = 0 is dense decode. Lengths 1, 63, 64, 65, 127, 128 and
# ones that are not multiples of the page size, mixed in one batch; G from 1 to 48 (row tiles 1, 2, 4).
GPU_CASES = [
    ([1, 63, 64, 65, 127, 128], 16, 1, 128, torch.bfloat16, None, 5),
    ([1, 63, 64, 65, 127, 128], 16, 1, 128, torch.bfloat16, None, 0),
    ([300, 1000, 70], 32, 2, 128, torch.bfloat16, 64, 12),
    ([300, 1000, 70], 64, 2, 128, torch.float16, 256, 0),
    ([2049, 17], 4, 2, 64, torch.float16, 128, 20),
    ([777], 1, 1, 64, torch.bfloat16, None, 7),
    ([513, 200], 24, 1, 128, torch.float16, 64, 9),
    ([130, 4000], 48, 1, 64, torch.bfloat16, 256, 30),
    ([5000], 12, 4, 128, torch.bfloat16, 64, 0),
]
GPU_IDS = [f"L{'-'.join(map(str, c[0]))}_HQ{c[1]}_H{c[2]}_D{c[3]}_{str(c[4])[6:]}"
           f"_{'pg' + str(c[5]) if c[5] else 'contig'}_{'K' + str(c[6]) if c[6] else 'dense'}"
           for c in GPU_CASES]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=GPU_IDS)
def test_kernel_matches_reference(case):
    lengths, HQ, H, D, dtype, page_size, K = case
    cache = make_cache(lengths, H, D, dtype, page_size=page_size, device="cuda")
    q = torch.randn(len(lengths), HQ, D, generator=torch.Generator().manual_seed(1)).to("cuda", dtype)
    idx = selection(H, lengths, K, device="cuda") if K else None
    if idx is not None and len(lengths) > 1:
        idx[:, 1, :] = -1                                                 # a sequence with nothing selected
    out, lse, w = sparse_decode(q, cache, idx, return_lse=True, return_attn_weights=True)
    ref, ref_lse, ref_w = naive_sparse_decode(q.double(), as_tuple(cache, torch.float64), idx,
                                              return_lse=True, return_attn_weights=True)
    lowp, lowp_lse, lowp_w = naive_sparse_decode(q, cache, idx, return_lse=True, return_attn_weights=True,
                                                 upcast=False)
    assert_decode_close_to_ref(out, lse, w, ref, ref_lse, ref_w, lowp, lowp_lse, lowp_w)
    wk = sparse_decode(q, cache, idx, return_attn_weights=True, weights="per_kv_head")[1]
    torch.testing.assert_close(wk, w.view(len(lengths), H, HQ // H, -1).sum(2), atol=1e-5, rtol=0)
    # without weights the output is the same bits (the relative probabilities are only stored on the side)
    assert torch.equal(sparse_decode(q, cache, idx), out)


@pytest.mark.gpu
def test_kernel_refuses_misaligned_views():
    # the split kernel copies 16-byte rows of q, K and V: a view at an odd element offset is refused
    # with its name before any launch
    lengths, H, D = [300, 65], 2, 128
    cache = make_cache(lengths, H, D, torch.bfloat16, device="cuda")
    q = torch.randn(2, 8, D, device="cuda", dtype=torch.bfloat16)
    def odd(t):
        return torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)[1:].view(t.shape).copy_(t)
    with pytest.raises(ValueError, match="q must start at a 16-byte aligned address"):
        sparse_decode(odd(q), cache)
    with pytest.raises(ValueError, match="k_cache must start at a 16-byte aligned address"):
        sparse_decode(q, (odd(cache.k), cache.v, cache.seqlens))
    assert torch.equal(sparse_decode(odd(q).clone(), cache), sparse_decode(q, cache))


@pytest.mark.gpu
def test_kernel_plans_agree():
    # one split per row, and many: same result up to fp32 merge rounding
    lengths, HQ, H, D = [900, 333], 8, 2, 128
    cache = make_cache(lengths, H, D, torch.bfloat16, page_size=64, device="cuda")
    q = torch.randn(2, HQ, D, device="cuda", dtype=torch.bfloat16)
    idx = selection(H, lengths, 16, device="cuda")
    a, la = sparse_decode(q, cache, idx, return_lse=True, plan=DecodePlan(1, 1, 16))
    b, lb = sparse_decode(q, cache, idx, return_lse=True, plan=DecodePlan(1, 8, 2))
    c, lc = sparse_decode(q, cache, idx, return_lse=True, plan=DecodePlan(2, 3, 6))
    for x in (b, c):
        torch.testing.assert_close(x.float(), a.float(), atol=2e-2, rtol=0)
    for x in (lb, lc):
        torch.testing.assert_close(x, la, atol=1e-4, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [None, 64, 192], ids=["contiguous", "page64", "page192"])
@pytest.mark.parametrize("D", [64, 128])
def test_kernel_plan_variants(page_size, D):
    # merge group counts (32 to 1024 threads) change only the fp32
    # merge order; 1 to 41 splits (up to 41 per merge thread with one group); both logit store paths
    # (W % 4 == 0 or not); page sizes whose blocks per page are a power of two (64) or not (192)
    lengths, HQ, H, dtype = [1000, 333, 64, 2500], 32, 2, torch.bfloat16
    cache = make_cache(lengths, H, D, dtype, page_size=page_size, device="cuda",
                       spare=70 if page_size else 71)
    q = torch.randn(len(lengths), HQ, D, generator=torch.Generator().manual_seed(5)).to("cuda", dtype)
    idx = selection(H, lengths, 24, device="cuda")
    width = cache.capacity
    assert (width % 4 == 0) == (page_size is not None)
    for sel in (idx, None):
        n = 24 if sel is not None else cdiv_(width, 64)
        ref, ref_lse, ref_w = naive_sparse_decode(q.double(), as_tuple(cache, torch.float64), sel,
                                                  return_lse=True, return_attn_weights=True)
        lowp, lowp_lse, lowp_w = naive_sparse_decode(q, cache, sel, return_lse=True, return_attn_weights=True,
                                                     upcast=False)
        for S in (1, 5, n):
            per = cdiv_(n, S)
            for groups in (0, max(1, 128 // D), 1024 // (D // 4)):
                plan = DecodePlan(1, cdiv_(n, per), per, merge_groups=groups)
                res = sparse_decode(q, cache, sel, return_lse=True, return_attn_weights=True, plan=plan)
                name = f"S{plan.num_splits}_g{groups}_{'sparse' if sel is not None else 'dense'}"
                assert_close_to_ref("out " + name, res[0], ref, lowp)
                fin = ~torch.isinf(ref_lse)
                assert bool(torch.isinf(res[1][~fin]).all())
                assert_close_to_ref("lse " + name, res[1][fin], ref_lse[fin], lowp_lse[fin], atol_floor=1e-5)
                assert_close_to_ref("weights " + name, res[2], ref_w, lowp_w, atol_floor=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [None, 64])
def test_decode_step_replays_bit_identically_in_a_cuda_graph(page_size):
    lengths, HQ, H, D, dtype = [100, 63, 129], 16, 2, 128, torch.bfloat16
    eager = make_cache(lengths, H, D, dtype, page_size=page_size, device="cuda")
    graphed = make_cache(lengths, H, D, dtype, page_size=page_size, device="cuda")
    g = torch.Generator().manual_seed(3)
    kn, vn = (torch.randn(3, H, D, generator=g).to("cuda", dtype) for _ in range(2))
    q = torch.randn(3, HQ, D, generator=g).to("cuda", dtype)
    idx = selection(H, [L + 1 for L in lengths], 4, device="cuda")
    # warm-up (kernel compilation, allocator) outside the capture, on the stream it will use
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        sparse_decode(q, graphed, idx, return_lse=True, return_attn_weights=True)
        scratch = make_cache(lengths, H, D, dtype, page_size=page_size, device="cuda")
        scratch.append(kn, vn)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphed.append(kn, vn)
        res_g = sparse_decode(q, graphed, idx, return_lse=True, return_attn_weights=True)
    graph.replay()
    torch.cuda.synchronize()
    eager.append(kn, vn)
    res_e = sparse_decode(q, eager, idx, return_lse=True, return_attn_weights=True)
    assert graphed.sync_lengths() == eager.lengths() == [L + 1 for L in lengths]
    for a, b in zip(res_g, res_e):
        assert torch.equal(a, b)
    for name in ("k", "v", "ck1", "ck2", "seqlens"):
        assert torch.equal(getattr(graphed, name), getattr(eager, name)), name


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [None, 64], ids=["contiguous_w_odd", "page64"])
@pytest.mark.parametrize("sparse", [True, False], ids=["sparse", "dense"])
def test_weights_precision_on_peaked_rows(page_size, sparse):
    # fp16 relative probabilities (docs/decode.md, 5. Attention weights): each weight is within
    # 2^-11 (fp16 rounding) of the float64 value relative, plus the fp32 logits' own rounding (at
    # scale 1 the log2 logits reach ~100, whose fp32 ulp is ~1e-5 of an exponent): 2^-10 in all; and
    # within 2^-24 absolute where 2^(s - m) leaves fp16's normal range (subnormal, or 0 below
    # 2^-25). A large softmax scale makes the rows
    # peaked (logits spread over hundreds), so most weights sit far below the row max and many flush;
    # the running max moves often within a split, so many keys are stored relative to a smaller m.
    lengths, HQ, H, D, dtype = [3000, 700, 1025], 16, 2, 128, torch.bfloat16
    cache = make_cache(lengths, H, D, dtype, page_size=page_size, device="cuda", spare=71)
    assert (cache.capacity % 4 == 0) == (page_size is not None)      # both prel store paths
    q = torch.randn(len(lengths), HQ, D, generator=torch.Generator().manual_seed(7)).to("cuda", dtype)
    idx = selection(H, lengths, 20, device="cuda") if sparse else None
    for scale in (D ** -0.5, 0.25, 1.0):
        out, lse, w = sparse_decode(q, cache, idx, softmax_scale=scale, return_lse=True,
                                    return_attn_weights=True)
        ref, ref_w = naive_sparse_decode(q.double(), as_tuple(cache, torch.float64), idx, softmax_scale=scale,
                                         return_attn_weights=True)
        lowp, lowp_w = naive_sparse_decode(q, cache, idx, softmax_scale=scale, return_attn_weights=True,
                                           upcast=False)
        assert_close_to_ref(f"out scale {scale}", out, ref, lowp)
        assert_close_to_ref(f"weights scale {scale}", w, ref_w, lowp_w, atol_floor=1e-6)
        err = (w.double() - ref_w.double()).abs()
        bound = 2.0 ** -10 * ref_w.double().abs() + 2.0 ** -24
        assert bool((err <= bound).all()), (
            f"scale {scale}: weight error {(err - bound).max().item():.3e} past 2^-10 relative + 2^-24")
        assert bool((w[ref_w == 0] == 0).all())
        torch.testing.assert_close(w.sum(-1), torch.ones_like(lse), atol=1e-4, rtol=0)
        if scale == 1.0:   # the rows are peaked: many selected positions round to 0 or subnormal fp16
            tiny = (ref_w > 0) & (ref_w < 2.0 ** -14)
            assert int(tiny.sum()) > 1000
        wk = sparse_decode(q, cache, idx, softmax_scale=scale, return_attn_weights=True,
                           weights="per_kv_head")[1]
        torch.testing.assert_close(wk, w.view(len(lengths), H, HQ // H, -1).sum(2), atol=1e-5, rtol=0)


@pytest.mark.gpu
def test_empty_sequence_and_raw_tuple_cache():
    # a sequence with no keys yet: out 0, lse +inf, weights 0, beside a normal one
    g = torch.Generator().manual_seed(4)
    k, v = (torch.randn(2, 130, 1, 64, generator=g).to("cuda", torch.float16) for _ in range(2))
    seqlens = torch.tensor([0, 65], dtype=torch.int32, device="cuda")
    q = torch.randn(2, 4, 64, generator=g).to("cuda", torch.float16)
    for idx in (None, torch.tensor([[[0, 1], [1, 0]]], dtype=torch.int32, device="cuda")):
        out, lse, w = sparse_decode(q, (k, v, seqlens), idx, return_lse=True, return_attn_weights=True)
        assert (out[0] == 0).all() and torch.isinf(lse[0]).all() and (w[0] == 0).all()
        ref, _ref_lse = naive_sparse_decode(q.double(), (k.double(), v.double(), seqlens), idx,
                                            return_lse=True)
        lowp = naive_sparse_decode(q, (k, v, seqlens), idx, upcast=False)
        assert_close_to_ref("out", out, ref, lowp)
        torch.testing.assert_close(w[1].sum(-1), torch.ones(4, device="cuda"), atol=1e-4, rtol=0)


@pytest.mark.gpu
def test_tuple_cache_growing_by_one_key_reuses_one_plan():
    # the compat layer's decode: a contiguous cache one key longer at every step (a new [B, L, H, D] view)
    # and a given selection: one prepared plan serves every length (its row stride and width are written
    # per run), and every step matches the reference
    from infllm_cupy.decode.step import n_plans

    g = torch.Generator().manual_seed(5)
    B, H, HQ, D, dtype = 2, 2, 16, 128, torch.bfloat16
    kv = [torch.randn(B, 400, H, D, generator=g).to("cuda", dtype) for _ in range(2)]
    idx = torch.tensor([[[0, 3], [5, -1]], [[2, 0], [1, 4]]], dtype=torch.int32, device="cuda")
    sizes = []
    for L in range(320, 330):
        k, v = (t[:, :L].contiguous() for t in kv)
        seqlens = torch.full((B,), L, dtype=torch.int32, device="cuda")
        q = torch.randn(B, HQ, D, generator=g).to("cuda", dtype)
        out = sparse_decode(q, (k, v, seqlens), idx)
        sizes.append(n_plans())
        ref = naive_sparse_decode(q.double(), (k.double(), v.double(), seqlens), idx)
        lowp = naive_sparse_decode(q, (k, v, seqlens), idx, upcast=False)
        assert_close_to_ref(f"out at L={L}", out, ref, lowp)
    assert len(set(sizes)) == 1, sizes
