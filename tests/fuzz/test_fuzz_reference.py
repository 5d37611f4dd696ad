"""Fuzzing, CPU share: each op family's PyTorch reference against a brute-force oracle written in
fuzzlib.py from the semantics alone (docs/reliability.md, "Fuzzing"). Runs in CI with the
`fuzz-ci` hypothesis profile (tests/conftest.py): derandomized, a handful of examples per family.
A failure prints hypothesis' falsifying example and a `reproduce: ...` line with the exact call.
"""
import pytest

pytest.importorskip("hypothesis")

import torch
from hypothesis import given
from hypothesis import strategies as st

from infllm_cupy import (
    BlockLayout,
    DecodeCache,
    naive_block_sparse_attn_varlen,
    naive_compress_k,
    naive_sparse_attn_varlen,
    naive_sparse_decode,
    naive_stage1_select,
)
from infllm_cupy.patterns import from_csr, local_stride, to_csr
from infllm_cupy.stage1.naive import q_block_idx_prefill
from infllm_cupy.testing import cu_seqlens_from_lengths

import fuzzlib as F

TIGHT = dict(atol=1e-9, rtol=1e-9)


def _close(name, got, want):
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    torch.testing.assert_close(got.double(), want.double(), **TIGHT, msg=lambda m: f"{name}: {m}")


def _lse_close(lse, want):
    inf = torch.isinf(want)
    assert torch.equal(torch.isinf(lse), inf), "lse must be +inf exactly on rows with no allowed key"
    torch.testing.assert_close(lse[~inf].double(), want[~inf].double(), atol=1e-5, rtol=1e-6)


# --------------------------------------------------------------------------------------------
# stage 2, token level: forward and backward
# --------------------------------------------------------------------------------------------
@given(lq=F.lengths(200), extra=st.lists(st.integers(0, 80), min_size=4, max_size=4), hh=F.heads,
       D=st.sampled_from([8, 16]), K=st.integers(1, 6), causal=st.booleans(),
       mix=st.sampled_from(["valid", "junk", "empty", "all_neg"]), seed=st.integers(0, 2**16))
def test_fuzz_stage2_reference_equals_oracle(lq, extra, hh, D, K, causal, mix, seed):
    lk = [L + e * (i % 2) for i, (L, e) in enumerate(zip(lq, extra))]   # keys >= queries in half
    HQ, H = hh
    F.reproducer("stage2_reference_case", lq=lq, lk=lk, HQ=HQ, H=H, D=D, K=K, causal=causal, mix=mix,
                 seed=seed)
    q, k, v, do, cu_q, cu_k = F.qkv(lq, lk, HQ, H, D, torch.float64, seed)
    idx = F.hostile_topk(H, lq, lk, K, seed + 1, mix=mix)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = naive_sparse_attn_varlen(*leaves, cu_q, cu_k, idx, max(lq), max(lk), causal=causal,
                                        return_lse=True)
    cq = cu_q.tolist()
    oleaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want, want_lse = F.dense_masked_attention(
        *oleaves, cu_q, cu_k, lambda b, Lq, Lk: F.token_allow(idx, slice(cq[b], cq[b + 1]), Lq, Lk, causal))
    _close("out", out, want)
    _lse_close(lse, want_lse)
    if out.numel():
        grads = torch.autograd.grad(out, leaves, do)
        ograds = torch.autograd.grad(want, oleaves, do)
        for name, g, w in zip(("dq", "dk", "dv"), grads, ograds):
            _close(name, g, w)


# --------------------------------------------------------------------------------------------
# layouts (BlockLayout) and patterns
# --------------------------------------------------------------------------------------------
@given(lq=F.lengths(260), hh=F.heads, q_block=st.sampled_from([64, 128]), per_sequence=st.booleans(),
       causal=st.booleans(), density=st.sampled_from([0.0, 0.3, 1.0]), seed=st.integers(0, 2**16))
def test_fuzz_layout_reference_equals_oracle(lq, hh, q_block, per_sequence, causal, density, seed):
    HQ, H = hh
    F.reproducer("layout_reference_case", lq=lq, HQ=HQ, H=H, q_block=q_block, per_sequence=per_sequence,
                 causal=causal, density=density, seed=seed)
    q, k, v, do, cu_q, cu_k = F.qkv(lq, lq, HQ, H, 16, torch.float64, seed)
    nqb, nkb = -(-max(max(lq), 1) // q_block), -(-max(max(lq), 1) // 64)
    shape = (len(lq), H, nqb, nkb) if per_sequence else (H, nqb, nkb)
    mask = torch.rand(shape, generator=F.gen(seed + 1)) < density
    layout = BlockLayout(mask, q_block)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = naive_block_sparse_attn_varlen(*leaves, cu_q, cu_k, layout, max(lq), max(lq), causal=causal,
                                              return_lse=True)
    oleaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want, want_lse = F.dense_masked_attention(*oleaves, cu_q, cu_k,
                                              lambda b, Lq,
                                              Lk: F.layout_allow(mask, q_block, b, Lq, Lk, causal))
    _close("out", out, want)
    _lse_close(lse, want_lse)
    if out.numel():
        for name, g, w in zip(("dq", "dk", "dv"), torch.autograd.grad(out, leaves, do),
                              torch.autograd.grad(want, oleaves, do)):
            _close(name, g, w)


@given(H=st.integers(1, 4), L=st.integers(1, 700), local=st.integers(1, 5), stride=st.integers(1, 6),
       homo=st.booleans(), block=st.sampled_from([64, 128, 192]))
def test_fuzz_local_stride_pattern_equals_its_rule_and_round_trips(H, L, local, stride, homo, block):
    F.reproducer("local_stride", num_heads=H, max_seqlen=L, block_size=block, local_blocks=local,
                 vert_stride=stride, homo_head=homo)
    lay = local_stride(H, L, block_size=block, local_blocks=local, vert_stride=stride, homo_head=homo)
    step = 0 if homo else max(1, stride // H)
    # the rule at token level: query token r and key token c of head h
    r = torch.arange(L)
    i, j = (r // block)[:, None], (r // block)[None, :]
    h = torch.arange(H)[:, None, None]
    want = (i >= j) & ((i - j < local) | ((j + h * step + 1) % stride == 0))   # [H, L, L]
    got = lay.mask[:, (r // lay.q_block)[:, None], (r // 64)[None, :]]
    assert torch.equal(got, want)
    crow, col = to_csr(lay)
    back = from_csr(crow, col, q_block=lay.q_block, num_kv_blocks=lay.mask.shape[-1])
    assert torch.equal(back.mask, lay.mask) and back.q_block == lay.q_block


# --------------------------------------------------------------------------------------------
# compression
# --------------------------------------------------------------------------------------------
@given(lk=F.lengths(400), H=st.integers(1, 3), window=st.sampled_from([(32, 16), (128, 64), (5, 3), (1, 1)]),
       dtype=st.sampled_from([torch.float32, torch.float64]), seed=st.integers(0, 2**16))
def test_fuzz_compress_reference_equals_oracle(lk, H, window, dtype, seed):
    kernel, stride = window
    F.reproducer("naive_compress_k", lk=lk, H=H, kernel_size=kernel, kernel_stride=stride, dtype=dtype,
                 seed=seed)
    k = torch.randn(sum(lk), H, 8, generator=F.gen(seed)).to(dtype)
    ck, cu_c = naive_compress_k(k, cu_seqlens_from_lengths(lk), kernel, stride)
    want, counts, o = [], [], 0
    for L in lk:
        n = 0
        while n * stride + kernel <= L:
            want.append(k[o + n * stride: o + n * stride + kernel].double().mean(0))
            n += 1
        counts.append(n)
        o += L
    assert torch.equal(cu_c, cu_seqlens_from_lengths(counts))
    want = torch.stack(want) if want else torch.zeros(0, H, 8, dtype=torch.float64)
    tol = 1e-6 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(ck.double(), want, atol=tol, rtol=tol)


# --------------------------------------------------------------------------------------------
# stage 1: the selection's contract on the reference's own block scores
# --------------------------------------------------------------------------------------------
@given(lq=F.lengths(700, max_batch=3), hh=F.heads, topk=st.integers(0, 6), local=st.integers(0, 3),
       init=st.integers(0, 2), seed=st.integers(0, 2**16))
def test_fuzz_stage1_reference_selects_the_top_blocks(lq, hh, topk, local, init, seed):
    HQ, H = hh
    F.reproducer("naive_stage1_select", lq=lq, HQ=HQ, H=H, topk=topk, local_blocks=local, init_blocks=init,
                 seed=seed)
    g = F.gen(seed)
    q = torch.randn(sum(lq), HQ, 16, generator=g)
    k = 4 * torch.randn(sum(lq), H, 16, generator=g)
    cu = cu_seqlens_from_lengths(lq)
    ck1, cu1 = naive_compress_k(k, cu, 32, 16)
    ck2, cu2 = naive_compress_k(k, cu, 128, 64)
    idx, _, bs = naive_stage1_select(q, ck1, ck2, cu, cu1, cu2, max(lq), topk=topk, local_blocks=local,
                                     init_blocks=init, score_dtype=None, return_scores=True)
    K = min(topk + local, bs.shape[-1])
    assert idx.shape == (H, sum(lq), K)
    qb = q_block_idx_prefill(cu, max(lq), block_size=64)                     # [total_q]
    for h in range(H):
        for t in range(sum(lq)):
            row = idx[h, t].tolist()
            valid = [x for x in row if x >= 0]
            # ascending valid blocks then a -1 tail; none after the query's own block; no repeats
            assert row == valid + [-1] * (K - len(valid)), row
            assert valid == sorted(set(valid)) and all(x <= int(qb[t]) for x in valid), row
            # the chosen blocks are the best of the visible ones (ties may go either way)
            vis = bs[h, t, : int(qb[t]) + 1]
            if valid and len(valid) < vis.numel():
                chosen = vis[valid]
                rest = torch.ones(vis.numel(), dtype=torch.bool)
                rest[valid] = False
                assert float(chosen.min()) >= float(vis[rest].max()), (h, t, row)
            # every slot holds a visible block, unless a future block ties with the K-th best score
            # (init blocks past the query's own are forced to +inf too; torch.topk may rank them first)
            ties = int((bs[h, t, int(qb[t]) + 1:] >= bs[h, t].topk(K).values.min()).sum()) if K else 0
            assert min(K, int(qb[t]) + 1) - ties <= len(valid) <= min(K, int(qb[t]) + 1), (h, t, row)


# --------------------------------------------------------------------------------------------
# decode and the cache
# --------------------------------------------------------------------------------------------
@given(lens=st.lists(st.integers(0, 300), min_size=1, max_size=3), hh=F.heads, paged=st.booleans(),
       chunks=st.integers(1, 3), K=st.integers(0, 5), mix=st.sampled_from(["valid", "junk", "empty"]),
       seed=st.integers(0, 2**16))
def test_fuzz_decode_reference_and_cache_equal_oracle(lens, hh, paged, chunks, K, mix, seed):
    HQ, H = hh
    D = 16
    F.reproducer("decode_case", lens=lens, HQ=HQ, H=H, paged=paged, chunks=chunks, K=K, mix=mix, seed=seed)
    B = len(lens)
    cap = max(lens) + 1
    if paged:
        per = -(-cap // 64)
        table = torch.randperm(B * per + 1, generator=F.gen(seed))[:B * per].view(B, per).to(torch.int32)
        cache = DecodeCache.paged(B * per + 1, 64, H, D, table, dtype=torch.float64)
    else:
        cache = DecodeCache.contiguous(B, cap, H, D, dtype=torch.float64)
    g = F.gen(seed + 1)
    kept_k, kept_v = [[] for _ in lens], [[] for _ in lens]
    # ragged chunks that add up to each sequence's length (zero-token chunks included)
    cuts = [sorted(torch.randint(0, L + 1, (chunks - 1,), generator=g).tolist()) for L in lens]
    for c in range(chunks):
        counts = [([0] + cut + [L])[c + 1] - ([0] + cut + [L])[c] for cut, L in zip(cuts, lens)]
        kn = torch.randn(sum(counts), H, D, generator=g, dtype=torch.float64)
        vn = torch.randn(sum(counts), H, D, generator=g, dtype=torch.float64)
        cache.append(kn, vn, cu_seqlens_from_lengths(counts))
        o = 0
        for b, n in enumerate(counts):
            kept_k[b].append(kn[o:o + n])
            kept_v[b].append(vn[o:o + n])
            o += n
    assert cache.lengths() == lens
    for b in range(B):
        kb, vb = cache.gather(b)
        assert torch.equal(kb, torch.cat(kept_k[b])) and torch.equal(vb, torch.cat(kept_v[b]))
    # the compressed keys the cache keeps current are those of a recompression
    kp, _, cu = cache.packed()
    c1, cu1, c2, cu2 = cache.packed_compressed()
    for (ks, ss), c, ccu in (((32, 16), c1, cu1), ((128, 64), c2, cu2)):
        want, want_cu = naive_compress_k(kp, cu, ks, ss)
        assert torch.equal(ccu, want_cu)
        torch.testing.assert_close(c, want, **TIGHT)
    # decode against the oracle: one query per sequence, non-causal over its selected blocks
    q = torch.randn(B, HQ, D, generator=g, dtype=torch.float64)
    idx = F.hostile_topk(H, [1] * B, lens, K, seed + 2, mix=mix) if K else None
    out, lse = naive_sparse_decode(q, cache, idx, return_lse=True)
    cu_q = cu_seqlens_from_lengths([1] * B)
    allow = (lambda b, Lq, Lk: F.token_allow(idx, slice(b, b + 1), 1, Lk, False)) if idx is not None else \
        (lambda b, Lq, Lk: torch.ones(H, 1, Lk, dtype=torch.bool))
    vp = cache.packed()[1]
    want, want_lse = F.dense_masked_attention(q, kp, vp, cu_q, cu, allow)
    _close("out", out, want)
    _lse_close(lse.T, want_lse)
