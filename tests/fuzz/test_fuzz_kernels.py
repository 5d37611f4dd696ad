"""Fuzzing, GPU share: every public op family's kernels against its PyTorch reference over random
ragged batches (zero-length and one-token sequences inside a batch), G, D, dtype, K and hostile
selections (docs/reliability.md, "Fuzzing"), with FlashAttention's error rule.

    pytest -m gpu tests/fuzz --hypothesis-profile=fuzz-device     # >= 500 cases per family

Each test is one family; the profile sets the cases per test (derandomized: the same cases every
run). A failure prints hypothesis' falsifying example, a `reproduce: ...` line with the exact call,
and the `@reproduce_failure(...)` blob.
"""
import sys
from pathlib import Path

import pytest

pytest.importorskip("hypothesis")

import torch
from hypothesis import given
from hypothesis import strategies as st

from infllm_cupy import (
    BlockLayout,
    DecodeCache,
    block_sparse_attn_varlen,
    compress_k,
    naive_block_sparse_attn_varlen,
    naive_compress_k,
    naive_sparse_attn_varlen,
    naive_sparse_decode,
    sparse_attn_varlen,
    sparse_decode,
)
from infllm_cupy.patterns import local_stride, pattern_decode
from infllm_cupy.patterns.decode import pattern_topk_idx
from infllm_cupy.testing import assert_close_to_ref, check_sparse_grads, cu_seqlens_from_lengths

import fuzzlib as F

pytestmark = pytest.mark.gpu

DTYPES = st.sampled_from([torch.bfloat16, torch.float16])
HEAD_DIMS = st.sampled_from([64, 128])
KERNELS = st.sampled_from(["auto", "sm80"])


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _kernel(kernel: str) -> str:
    return kernel if kernel == "sm80" or _hopper() else "auto"


def _check_out_lse(out, lse, ref, ref_lse, lowp):
    """out by FlashAttention's rule (2x the low-precision error), lse within fp32 rounding, and rows
    with no allowed key exactly 0 with lse = +inf. `lse [HQ, total_q]`."""
    assert_close_to_ref("out", out, ref, lowp, mult=2)
    empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), empty), "lse must be +inf exactly on rows with no allowed key"
    assert not torch.isnan(lse).any()
    if (~empty).any():
        err = (lse[~empty].double() - ref_lse[~empty].double()).abs().max().item()
        assert err <= 1e-4 * max(1.0, ref_lse[~empty].abs().max().item()), f"lse error {err}"
    assert bool((out[empty.T] == 0).all()), "rows with no allowed key must be exactly 0"


# --------------------------------------------------------------------------------------------
# compression
# --------------------------------------------------------------------------------------------
@given(lk=F.lengths(700, max_batch=5), H=st.integers(1, 4), D=HEAD_DIMS, dtype=DTYPES,
       window=st.sampled_from([(32, 16), (128, 64)]), seed=st.integers(0, 2**16))
def test_fuzz_compress_kernel(lk, H, D, dtype, window, seed):
    kernel, stride = window
    F.reproducer("compress_k", lk=lk, H=H, D=D, dtype=dtype, kernel_size=kernel, kernel_stride=stride,
                 seed=seed)
    k = torch.randn(sum(lk), H, D, generator=F.gen(seed)).to("cuda", dtype)
    cu = cu_seqlens_from_lengths(lk, "cuda")
    ck, cu_c = compress_k(k, cu, kernel, stride, backend="kernels")
    ref, ref_cu = naive_compress_k(k.double(), cu, kernel, stride)
    lowp, _ = naive_compress_k(k, cu, kernel, stride)
    assert torch.equal(cu_c, ref_cu)
    assert ck.dtype == dtype and ck.shape == ref.shape
    if ck.numel():
        assert_close_to_ref("ck", ck, ref, lowp, mult=2)


# --------------------------------------------------------------------------------------------
# stage 1 (the checks of tests/stage1: scores, block scores, own top-K, contract, reference modulo ties)
# --------------------------------------------------------------------------------------------
def _stage1_checks():
    here = str(Path(__file__).resolve().parents[1] / "stage1")
    if here not in sys.path:
        sys.path.insert(0, here)
    import test_stage1_select as s1  # the module pytest imports under this same name

    return s1


@given(lq=F.lengths(900, max_batch=4, min_total=1),
       hh=st.sampled_from([(1, 1), (2, 1), (3, 1), (4, 2), (8, 1),
                                                                         (16, 2), (12, 1), (32, 2), (64, 1)]),
       D=HEAD_DIMS, dtype=DTYPES, topk=st.integers(1, 8), local=st.integers(0, 4), init=st.integers(0, 2),
       score_dtype=st.sampled_from([torch.bfloat16, torch.float32]), kernel=KERNELS,
       seed=st.integers(0, 2**16))
def test_fuzz_stage1_kernel(lq, hh, D, dtype, topk, local, init, score_dtype, kernel, seed):
    HQ, H = hh
    F.reproducer("stage1_select", lq=lq, HQ=HQ, H=H, D=D, dtype=dtype, topk=topk, local_blocks=local,
                 init_blocks=init, score_dtype=score_dtype, kernel=kernel, seed=seed)
    s1 = _stage1_checks()
    inputs = s1.make_inputs(lq, HQ, H, D, dtype, seed=seed)
    s1.run_and_check(*inputs, max(lq), score_dtype=score_dtype, topk=topk, local_blocks=local,
                     init_blocks=init, kernel=_kernel(kernel))


# --------------------------------------------------------------------------------------------
# stage 2 forward and backward, token level
# --------------------------------------------------------------------------------------------
STAGE2 = dict(lq=F.lengths(400, max_batch=4, min_total=1),
              extra=st.lists(st.integers(0, 200), min_size=4, max_size=4),
              hh=F.heads, D=HEAD_DIMS, dtype=DTYPES, K=st.integers(1, 16), causal=st.booleans(),
              mix=st.sampled_from(["valid", "junk", "empty", "all_neg"]), kernel=KERNELS,
              seed=st.integers(0, 2**16))


def _stage2_inputs(lq, extra, hh, D, dtype, K, mix, seed):
    lk = [L + e * (i % 2) for i, (L, e) in enumerate(zip(lq, extra))]     # longer keys in half the sequences
    HQ, H = hh
    q, k, v, do, cu_q, cu_k = F.qkv(lq, lk, HQ, H, D, dtype, seed, "cuda")
    idx = F.hostile_topk(H, lq, lk, K, seed + 1, mix=mix).cuda()
    return lk, q, k, v, do, cu_q, cu_k, idx


@given(**{**STAGE2, "lq": F.lengths(400, max_batch=4)})  # the forward also takes batches with no query at all
def test_fuzz_stage2_forward_kernel(lq, extra, hh, D, dtype, K, causal, mix, kernel, seed):
    lk, q, k, v, _do, cu_q, cu_k, idx = _stage2_inputs(lq, extra, hh, D, dtype, K, mix, seed)
    F.reproducer("sparse_attn_varlen", lq=lq, lk=lk, HQ=hh[0], H=hh[1], D=D, dtype=dtype, K=K, causal=causal,
                 mix=mix, kernel=kernel, seed=seed)
    mq, mk = max(lq), max(lk)
    out, lse = sparse_attn_varlen(q, k, v, cu_q, cu_k, idx, mq, mk, causal=causal, return_lse=True,
                                  backend="kernels", kernel=_kernel(kernel))
    ref, ref_lse = naive_sparse_attn_varlen(q.double(), k.double(), v.double(), cu_q, cu_k, idx, mq, mk,
                                            causal=causal, return_lse=True)
    lowp = naive_sparse_attn_varlen(q, k, v, cu_q, cu_k, idx, mq, mk, causal=causal, upcast=False)
    _check_out_lse(out, lse, ref, ref_lse, lowp)


@given(**STAGE2)
def test_fuzz_stage2_backward_kernel(lq, extra, hh, D, dtype, K, causal, mix, kernel, seed):
    lk, q, k, v, do, cu_q, cu_k, idx = _stage2_inputs(lq, extra, hh, D, dtype, K, mix, seed)
    F.reproducer("sparse_attn_varlen_backward", lq=lq, lk=lk, HQ=hh[0], H=hh[1], D=D, dtype=dtype, K=K,
                 causal=causal, mix=mix, kernel=kernel, seed=seed)
    mq, mk = max(lq), max(lk)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = sparse_attn_varlen(*leaves, cu_q, cu_k, idx, mq, mk, causal=causal, backend="kernels",
                             kernel=_kernel(kernel))
    grads = torch.autograd.grad(out, leaves, do)
    check_sparse_grads(grads, q, k, v, do, cu_q, cu_k, idx, mq, mk, causal, out=out.detach())


# --------------------------------------------------------------------------------------------
# layouts (BlockLayout): forward and backward
# --------------------------------------------------------------------------------------------
@given(lq=F.lengths(400, max_batch=4), hh=F.heads, D=HEAD_DIMS, dtype=DTYPES,
       q_block=st.sampled_from([64, 128]),
       per_sequence=st.booleans(), causal=st.booleans(), density=st.sampled_from([0.0, 0.2, 0.6, 1.0]),
       kernel=KERNELS, seed=st.integers(0, 2**16))
def test_fuzz_block_layout_kernel(lq, hh, D, dtype, q_block, per_sequence, causal, density, kernel, seed):
    HQ, H = hh
    F.reproducer("block_sparse_attn_varlen", lq=lq, HQ=HQ, H=H, D=D, dtype=dtype, q_block=q_block,
                 per_sequence=per_sequence, causal=causal, density=density, kernel=kernel, seed=seed)
    q, k, v, do, cu_q, cu_k = F.qkv(lq, lq, HQ, H, D, dtype, seed, "cuda")
    m = max(max(lq), 1)
    shape = (len(lq), H, -(-m // q_block), -(-m // 64))
    mask = torch.rand(shape if per_sequence else shape[1:], generator=F.gen(seed + 1)) < density
    layout = BlockLayout(mask, q_block)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = block_sparse_attn_varlen(*leaves, cu_q, cu_k, layout, max(lq), max(lq), causal=causal,
                                        return_lse=True, backend="kernels", kernel=_kernel(kernel))
    refl = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = naive_block_sparse_attn_varlen(*refl, cu_q, cu_k, layout, max(lq), max(lq), causal=causal,
                                                  return_lse=True)
    lowl = [t.clone().requires_grad_() for t in (q, k, v)]
    lowp = naive_block_sparse_attn_varlen(*lowl, cu_q, cu_k, layout, max(lq), max(lq), causal=causal,
                                          upcast=False)
    _check_out_lse(out.detach(), lse, ref.detach(), ref_lse, lowp.detach())
    if out.numel():
        grads = torch.autograd.grad(out, leaves, do)
        rgrads = torch.autograd.grad(ref, refl, do.double())
        lgrads = torch.autograd.grad(lowp, lowl, do)
        for name, g, r, lp in zip(("dq", "dk", "dv"), grads, rgrads, lgrads):
            assert_close_to_ref(name, g, r, lp, mult=3)


# --------------------------------------------------------------------------------------------
# decode and the cache (append on the GPU: the compression kernel keeps ck1 / ck2 current)
# --------------------------------------------------------------------------------------------
def _filled_cache(lens, H, D, dtype, page_size, chunks, seed):
    B = len(lens)
    cap = max(lens) + 1
    if page_size:
        per = -(-cap // page_size)
        table = torch.randperm(B * per + 2, generator=F.gen(seed))[:B * per].view(B, per).to(torch.int32)
        cache = DecodeCache.paged(B * per + 2, page_size, H, D, table.cuda(), dtype=dtype, device="cuda")
    else:
        cache = DecodeCache.contiguous(B, cap, H, D, dtype=dtype, device="cuda")
    g = F.gen(seed + 1)
    cuts = [sorted(torch.randint(0, L + 1, (chunks - 1,), generator=g).tolist()) for L in lens]
    for c in range(chunks):
        counts = [([0] + cut + [L])[c + 1] - ([0] + cut + [L])[c] for cut, L in zip(cuts, lens)]
        kn = (2 * torch.randn(sum(counts), H, D, generator=g)).to("cuda", dtype)
        vn = torch.randn(sum(counts), H, D, generator=g).to("cuda", dtype)
        cache.append(kn, vn, cu_seqlens_from_lengths(counts, "cuda"))
    # and one-token steps, the decode loop's append
    steps = int(torch.randint(0, 2, (), generator=g))
    for _ in range(steps):
        cache.append((2 * torch.randn(B, H, D, generator=g)).to("cuda", dtype),
                     torch.randn(B, H, D, generator=g).to("cuda", dtype))
    return cache, [L + steps for L in lens]


def _as_tuple(cache, f=lambda t: t):
    base = (f(cache.k), f(cache.v), cache.seqlens)
    return base + ((cache.block_table,) if cache.is_paged else ())


@given(lens=st.lists(st.one_of(st.sampled_from([0, 1, 63, 64, 65]), st.integers(0, 900)), min_size=1,
                     max_size=5),
       hh=st.sampled_from([(1, 1), (2, 1), (4, 2), (6, 2), (8, 1), (16, 2), (32, 1), (64, 1)]), D=HEAD_DIMS,
       dtype=DTYPES, page_size=st.sampled_from([None, 64, 128, 256]), chunks=st.integers(1, 3),
       K=st.integers(0, 12), mix=st.sampled_from(["valid", "junk", "empty"]), seed=st.integers(0, 2**16))
def test_fuzz_decode_and_cache_kernel(lens, hh, D, dtype, page_size, chunks, K, mix, seed):
    HQ, H = hh
    F.reproducer("sparse_decode", lens=lens, HQ=HQ, H=H, D=D, dtype=dtype, page_size=page_size, chunks=chunks,
                 K=K, mix=mix, seed=seed)
    cache, lens = _filled_cache(lens, H, D, dtype, page_size, chunks, seed)
    assert cache.sync_lengths() == lens
    # the compressed keys kept by the append kernels equal a recompression, up to the rounding of
    # fp32 sums taken in another order (the tolerance of tests/decode/test_cache.py's GPU check)
    kp, _, cu = cache.packed()
    c1, cu1, c2, cu2 = cache.packed_compressed()
    for (ks, ss), c, ccu in (((32, 16), c1, cu1), ((128, 64), c2, cu2)):
        want, want_cu = naive_compress_k(kp, cu, ks, ss)
        assert torch.equal(ccu, want_cu)
        torch.testing.assert_close(c.float(), want.float(), atol=1e-2, rtol=1e-2)
    B = len(lens)
    q = torch.randn(B, HQ, D, generator=F.gen(seed + 3)).to("cuda", dtype)
    idx = F.hostile_topk(H, [1] * B, lens, K, seed + 2, mix=mix).cuda() if K else None
    out, lse, w = sparse_decode(q, cache, idx, return_lse=True, return_attn_weights=True)
    ref, ref_lse, ref_w = naive_sparse_decode(q.double(), _as_tuple(cache, lambda t: t.double()), idx,
                                              return_lse=True, return_attn_weights=True)
    lowp, _, lowp_w = naive_sparse_decode(q, cache, idx, return_lse=True, return_attn_weights=True,
                                          upcast=False)
    _check_out_lse(out, lse.T, ref, ref_lse.T, lowp)
    assert_close_to_ref("weights", w, ref_w, lowp_w, atol_floor=1e-6)
    assert bool((w[ref_w == 0] == 0).all()), "weights must be exactly 0 where nothing is selected"


# --------------------------------------------------------------------------------------------
# patterns: local + vertical stride through the stage-2 kernels, and decode under the pattern
# --------------------------------------------------------------------------------------------
@given(lq=F.lengths(600, max_batch=3, min_total=1), H=st.integers(1, 2), G=st.sampled_from([1, 2, 4]),
       D=HEAD_DIMS, dtype=DTYPES, block=st.sampled_from([64, 128, 192]), local=st.integers(1, 4),
       stride=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_fuzz_patterns_kernel(lq, H, G, D, dtype, block, local, stride, seed):
    F.reproducer("local_stride", lq=lq, H=H, G=G, D=D, dtype=dtype, block_size=block, local_blocks=local,
                 vert_stride=stride, seed=seed)
    HQ = H * G
    layout = local_stride(H, max(lq) + 1, block_size=block, local_blocks=local, vert_stride=stride)
    q, k, v, _do, cu_q, cu_k = F.qkv(lq, lq, HQ, H, D, dtype, seed, "cuda")
    mq = max(lq)
    out = block_sparse_attn_varlen(q, k, v, cu_q, cu_k, layout, mq, mq, backend="kernels")
    ref = naive_block_sparse_attn_varlen(q.double(), k.double(), v.double(), cu_q, cu_k, layout, mq, mq)
    lowp = naive_block_sparse_attn_varlen(q, k, v, cu_q, cu_k, layout, mq, mq, upcast=False)
    assert_close_to_ref("out", out, ref, lowp, mult=2)
    # decode: each sequence's next token under the same pattern, kernel against the reference on CPU
    lens = [L + 1 for L in lq]
    cache = DecodeCache.contiguous(len(lq), max(lens), H, D, dtype=dtype, device="cuda")
    cache.append(k, v, cu_q)
    g = F.gen(seed + 5)
    cache.append(torch.randn(len(lq), H, D, generator=g).to("cuda", dtype),
                 torch.randn(len(lq), H, D, generator=g).to("cuda", dtype))
    qd = torch.randn(len(lq), HQ, D, generator=g).to("cuda", dtype)
    got = pattern_decode(qd, cache, layout)
    tup = (cache.k.cpu().double(), cache.v.cpu().double(), cache.seqlens.cpu())
    want = pattern_decode(qd.cpu().double(), tup, layout).to(got.device)
    # the low-precision twin: the same blocks through the decode reference with upcast=False
    idx = pattern_topk_idx(layout, cache.seqlens)
    low = naive_sparse_decode(qd, cache, idx, upcast=False)
    assert_close_to_ref("pattern_decode", got, want, low, mult=2)
