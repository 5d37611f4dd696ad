"""Stage 1 (scores, pooling, top-k): the PyTorch reference against brute force and slow loops
(CPU), then the kernel (all three in one launch) against the reference.

The reference and the kernels break ties between equal block scores the same way (to the lower block
index), so on planted ties (every score equal) they select the same blocks exactly. Elsewhere our
scores may differ from the reference's by one rounding of the score dtype, which can reorder
near-ties, so each result is checked three ways: (1) our indices are exactly our own top-K of our own
block scores (K largest, ties to the lower index, ascending, -1 tail); (2) our scores and block
scores equal the reference's within one unit in the last place of the score dtype; (3) against the
reference's own block scores, every block we selected scores >= every causal block we left out, up
to that rounding, and the forced blocks are present. Rows without a near-tie at the K-th value must
equal the reference exactly.
"""

import dataclasses
import math

import pytest
import torch

from infllm_cupy._rules import n_windows
from infllm_cupy.compress.naive import naive_compress_k
from infllm_cupy.stage1 import naive as s1
from infllm_cupy.stage1 import select as sel
from infllm_cupy.stage1.naive import (
    naive_pool_blocks,
    naive_select_topk,
    naive_stage1_scores,
    naive_stage1_select,
    q_block_idx_prefill,
    vis_limit,
)
from infllm_cupy.stage1.plan import (
    Stage1Plan,
    choose_tiles,
    smem_bytes,
    smem_bytes_sm90,
    stage1_plan,
)
from infllm_cupy.stage1.select import launch_select, stage1_select
from infllm_cupy.testing import cu_seqlens_from_lengths

from conftest import HOPPER

# ================================================================================================
# the reference (CPU)
# ================================================================================================

# (HQ, H): G = 1, 2, 16
HEADS = [(2, 2), (4, 2), (16, 1)]


def make_ref_inputs(lengths, HQ, H, D=32, seed=0, exact=False):
    """Random q and really compressed keys; keys scaled up so the softmax is not flat."""
    g = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    q = torch.randn(T, HQ, D, generator=g)
    k = 4 * torch.randn(T, H, D, generator=g)
    cu = cu_seqlens_from_lengths(lengths)
    ck1, cu1 = naive_compress_k(k, cu, 32, 16)
    ck2, cu2 = (ck1, cu1) if exact else naive_compress_k(k, cu, 128, 64)
    return q, ck1, ck2, cu, cu1, cu2


def loop_stage1(q, ck1, ck2, lengths, n1s, n2s, causal=True):
    """Slow per-token reference written from spec section 13 (fp64)."""
    T, HQ, D = q.shape
    H = ck1.shape[1]
    scale = D ** -0.5
    out = torch.zeros(H, T, max(n1s, default=0), dtype=torch.float64)
    qs = c1 = c2 = 0
    for Lq, n1, n2 in zip(lengths, n1s, n2s):
        K1, K2 = ck1[c1:c1 + n1].double(), ck2[c2:c2 + n2].double()
        stride2 = 16 if n1 == n2 else 64
        for r in range(Lq):
            l1 = vis_limit(r, 16, n1, Lq, causal=causal)
            l2 = vis_limit(r, stride2, n2, Lq, causal=causal)
            if l2 == 0:
                continue
            qr = q[qs + r].double().view(H, HQ // H, D)                    # [H, G, D]
            s2 = torch.einsum("hgd,jhd->hgj", qr, K2[:l2])
            m = s2.max(-1, keepdim=True).values
            Z = torch.exp(scale * (s2 - m)).sum(-1, keepdim=True)
            p = torch.exp(scale * torch.einsum("hgd,ihd->hgi", qr, K1[:l1]) - scale * m) / Z
            out[:, qs + r, :l1] = p.sum(1)
        qs, c1, c2 = qs + Lq, c1 + n1, c2 + n2
    return out


def loop_pool(scores, lengths, n1s, cache_lens, max_seqlen_q, init_blocks=1, local_blocks=32, bs=64, w=4):
    H, T, _ = scores.shape
    out_len = math.ceil((max_seqlen_q + max(cache_lens)) / bs)
    out = torch.empty(H, T, out_len, dtype=scores.dtype)
    t = 0
    for Lq, n1, cache in zip(lengths, n1s, cache_lens):
        for r in range(Lq):
            off_bq = (r + cache) // bs
            for j in range(out_len):
                if j < init_blocks or off_bq - local_blocks <= j <= off_bq:
                    out[:, t, j] = float("inf")
                else:
                    lo, hi = max(w * j - 1, 0), min(w * j + w, n1)
                    out[:, t, j] = scores[:, t, lo:hi].amax(-1) if hi > lo else float("-inf")
            t += 1
    return out


def test_vis_limit_is_window_rule_except_quirks():
    Ls = torch.arange(1, 1201)
    L = torch.repeat_interleave(Ls, Ls)                                   # every (L, r) pair, r < L
    r = torch.arange(L.numel()) - torch.repeat_interleave(torch.cumsum(Ls, 0) - Ls, Ls)
    for s in (16, 64):
        n = torch.where(L < 2 * s, 0, (L - 2 * s) // s + 1)
        i = torch.arange(int(n.max()))
        # brute force: key i is visible iff its whole window [i*s, i*s + 2s) lies at or before r
        brute = ((i[None, :] * s + 2 * s <= r[:, None] + 1) & (i[None, :] < n[:, None])).sum(-1)
        diff = vis_limit(r, s, n, L) - brute
        assert set(diff.unique().tolist()) <= {0, -1}
        bad = sorted(set(L[diff != 0].tolist()))
        want = [x for x in range(1, 1201) if x % s == s - 1 and n_windows(x, 2 * s, s) >= 1]
        assert bad == want
        # under the quirk every query that sees a key in the window rule sees exactly one fewer
        quirk = (L % s == s - 1) & (brute > 0)
        assert bool((diff[quirk] == -1).all()) and bool((diff[~quirk] == 0).all())


def test_vis_limit_int_and_tensor_agree():
    for L in (1, 15, 47, 200, 335, 383, 1000):
        for s in (16, 64):
            n = n_windows(L, 2 * s, s)
            got = vis_limit(torch.arange(L), s, n, L)
            assert got.tolist() == [vis_limit(r, s, n, L) for r in range(L)]
            assert vis_limit(L - 1, s, n, L, causal=False) == n
    # chunked prefill (q shorter than k, Lq - s + 1 < 0): C truncation, not floor
    assert vis_limit(0, 16, 10, 1) == min(10, max(0, 0 - 1 + 10 - 0))


@pytest.mark.parametrize("HQ,H", HEADS, ids=lambda x: str(x))
def test_exact_mode_is_softmax_over_fine_keys(HQ, H):
    lengths = [335, 200, 40, 17, 1]
    q, ck1, _, cu, cu1, _ = make_ref_inputs(lengths, HQ, H, exact=True)
    got = naive_stage1_scores(q, ck1, ck1, cu, cu1, cu1, score_dtype=None)
    G, scale = HQ // H, q.shape[2] ** -0.5
    want = torch.zeros_like(got)
    t = c = 0
    for L in lengths:
        n1 = n_windows(L, 32, 16)
        for r in range(L):
            lim = vis_limit(r, 16, n1, L)
            if lim:
                qr = q[t + r].view(H, G, -1)
                logits = scale * torch.einsum("hgd,nhd->hgn", qr, ck1[c:c + lim])
                want[:, t + r, :lim] = torch.softmax(logits, -1).sum(1)
        t, c = t + L, c + n1
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # each visible row is G softmaxes summed: its total is exactly G
    nonzero = got.sum(-1) > 0
    torch.testing.assert_close(got.sum(-1)[nonzero], torch.full_like(got.sum(-1)[nonzero], float(G)))


REF_CASES = [([335], (16, 1)), ([383], (4, 2)), ([100], (2, 2)), ([300], (16, 1)),
         ([335, 17, 130, 383, 64, 1], (2, 2)), ([335, 17, 130, 383, 64, 1], (32, 2))]


@pytest.mark.parametrize("lengths,heads", REF_CASES, ids=lambda x: "-".join(map(str, x)))
def test_lse_mode_matches_slow_loop(lengths, heads):
    HQ, H = heads
    q, ck1, ck2, cu, cu1, cu2 = make_ref_inputs(lengths, HQ, H)
    n1s = [n_windows(L, 32, 16) for L in lengths]
    n2s = [n_windows(L, 128, 64) for L in lengths]
    want = loop_stage1(q, ck1, ck2, lengths, n1s, n2s)
    got = naive_stage1_scores(q, ck1, ck2, cu, cu1, cu2, max(lengths), score_dtype=None)
    assert got.shape == (H, sum(lengths), max(n1s)) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-4)
    bf = naive_stage1_scores(q, ck1, ck2, cu, cu1, cu2)
    assert bf.dtype == torch.bfloat16
    torch.testing.assert_close(bf.double(), want, atol=1e-2, rtol=1e-2)


def test_quirk_rows_by_hand():
    # L = 335: L % 16 == 15, so no query sees the last fine key (quirk A)
    q, ck1, ck2, cu, cu1, cu2 = make_ref_inputs([335], 2, 1)
    n1 = n_windows(335, 32, 16)
    sc = naive_stage1_scores(q, ck1, ck2, cu, cu1, cu2, score_dtype=None)
    assert bool((sc[:, :, n1 - 1] == 0).all()) and bool((sc[:, -1, n1 - 2] > 0).all())
    q, ck1, ck2, cu, cu1, cu2 = make_ref_inputs([336], 2, 1)
    sc = naive_stage1_scores(q, ck1, ck2, cu, cu1, cu2, score_dtype=None)
    assert bool((sc[:, -1, n_windows(336, 32, 16) - 1] > 0).all())
    # L = 383: L % 64 == 63, the first coarse key appears only at r = 191 instead of 127 (quirk B)
    q, ck1, ck2, cu, cu1, cu2 = make_ref_inputs([383], 2, 1)
    sc = naive_stage1_scores(q, ck1, ck2, cu, cu1, cu2, score_dtype=None)
    nz = (sc != 0).any(-1).any(0)
    assert not bool(nz[:191].any()) and bool(nz[191:].all())
    q, ck1, ck2, cu, cu1, cu2 = make_ref_inputs([384], 2, 1)
    sc = naive_stage1_scores(q, ck1, ck2, cu, cu1, cu2, score_dtype=None)
    nz = (sc != 0).any(-1).any(0)
    assert not bool(nz[:127].any()) and bool(nz[127:].all())


def test_rows_without_coarse_key_are_zero_and_padding_is_zero():
    lengths = [127, 40, 500]
    q, ck1, ck2, cu, cu1, cu2 = make_ref_inputs(lengths, 4, 2)
    sc = naive_stage1_scores(q, ck1, ck2, cu, cu1, cu2, score_dtype=None)
    assert bool((sc[:, :167] == 0).all())                               # L < 128: n2 = 0
    assert bool((sc[:, 167:167 + 127] == 0).all()) and bool((sc[:, 167 + 127:] != 0).any(-1).all())
    # decode (causal=False) with n2 = 0 gives zeros too; with n2 > 0 every fine key is scored
    dq = q[[126, 166, 666]]
    one = torch.arange(4, dtype=torch.int32)
    dec = naive_stage1_scores(dq, ck1, ck2, one, cu1, cu2, causal=False, score_dtype=None)
    assert bool((dec[:, :2] == 0).all())
    assert bool((dec[:, 2, :n_windows(500, 32, 16)] > 0).all())


def test_query_chunking_does_not_change_scores(monkeypatch):
    q, ck1, ck2, cu, cu1, cu2 = make_ref_inputs([383, 250], 4, 2)
    ref = naive_stage1_scores(q, ck1, ck2, cu, cu1, cu2, score_dtype=None)
    monkeypatch.setattr(s1, "CHUNK_ELEMS", 1000)
    got = naive_stage1_scores(q, ck1, ck2, cu, cu1, cu2, score_dtype=None)
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_pooling_matches_loop(dtype):
    lengths, cache_lens, n1s = [200, 1, 77, 130], [0, 500, 64, 3], [40, 31, 0, 12]
    scores = torch.randn(2, sum(lengths), 45).to(dtype)
    for t0, L, n1 in zip(cu_seqlens_from_lengths(lengths)[:-1].tolist(), lengths, n1s):
        scores[:, t0:t0 + L, n1:] = 0                                   # as stage 1 leaves them
    want = loop_pool(scores, lengths, n1s, cache_lens, 230, local_blocks=3)
    got = naive_pool_blocks(scores, cu_seqlens_from_lengths(lengths), cu_seqlens_from_lengths(n1s),
                            torch.tensor(cache_lens, dtype=torch.int32), 230, local_blocks=3)
    assert got.dtype == dtype and got.shape == want.shape == (2, sum(lengths), math.ceil(730 / 64))
    assert torch.equal(got, want)
    assert bool(torch.isneginf(got).any()) and bool(torch.isposinf(got).any())


def check_topk_contract(idx, q_blocks, out_len, K, init_blocks=1, local_blocks=32):
    H, T, k = idx.shape
    assert k == K == min(K, out_len) and idx.dtype == torch.int32
    for h in range(H):
        for t in range(T):
            row = idx[h, t].tolist()
            valid = [x for x in row if x >= 0]
            assert row == valid + [-1] * (len(row) - len(valid)), "-1 must be tail padding only"
            assert valid == sorted(set(valid)), "ascending, no duplicates"
            qb = int(q_blocks[t])
            assert all(x <= qb for x in valid)
            forced = set(range(min(init_blocks, qb + 1))) | set(range(max(0, qb - local_blocks), qb + 1))
            assert forced <= set(valid)


@pytest.mark.parametrize("topk,local_blocks", [(64, 32), (3, 2)])
def test_topk_contract_on_pipeline_scores(topk, local_blocks):
    lengths = [1000, 130, 1, 700]
    q, ck1, ck2, cu, cu1, cu2 = make_ref_inputs(lengths, 4, 2)
    idx, scores, bs = naive_stage1_select(q, ck1, ck2, cu, cu1, cu2, max(lengths), topk=topk,
                                          local_blocks=local_blocks, return_scores=True)
    out_len = math.ceil(1000 / 64)
    assert bs.shape == (2, sum(lengths), out_len) and scores.shape == (2, sum(lengths),
                                                                       n_windows(1000, 32, 16))
    check_topk_contract(idx, q_block_idx_prefill(cu, 1000), out_len, min(topk + local_blocks, out_len),
                        local_blocks=local_blocks)
    if topk == 3:
        assert bool((idx[:, :1000] == -1).any()), "a short top-k budget pads rows with -1"


def test_topk_exact_on_distinct_scores():
    H, T, out_len, K = 2, 50, 20, 7
    scores = torch.randperm(H * T * out_len).float().view(H, T, out_len)      # no ties
    q_blocks = torch.randint(0, out_len, (T,), dtype=torch.int32)
    got = naive_select_topk(scores, q_blocks, topk=5, local_blocks=2)
    for h in range(H):
        for t in range(T):
            best = sorted(sorted(range(out_len), key=lambda j: -float(scores[h, t, j]))[:K])
            want = [j for j in best if j <= q_blocks[t]]
            assert got[h, t].tolist() == want + [-1] * (K - len(want))


def test_topk_keeps_forced_blocks_when_budget_covers_them():
    H, T, out_len = 1, 3, 200
    scores = torch.randn(H, T, out_len)
    q_blocks = torch.tensor([0, 40, 199], dtype=torch.int32)
    # a 3-token sequence has no fine key: its only block is the forced init block
    bs = naive_pool_blocks(torch.zeros(H, T, 0), cu_seqlens_from_lengths([T]), cu_seqlens_from_lengths([0]),
                           None, T)
    assert bs.shape == (1, 3, 1) and bool(torch.isposinf(bs).all())
    forced = scores.clone()
    for t, qb in enumerate(q_blocks.tolist()):
        forced[:, t, [0] + list(range(max(0, qb - 32), qb + 1))] = float("inf")
    idx = naive_select_topk(forced, q_blocks)
    check_topk_contract(idx, q_blocks, out_len, 96)
    assert idx[0, 0].tolist() == [0] + [-1] * 95


def test_q_block_idx():
    cu = cu_seqlens_from_lengths([100, 200])
    plain = q_block_idx_prefill(cu, 200)
    quirk = q_block_idx_prefill(cu, 200, varlen_offset_quirk=True)
    assert plain.dtype == torch.int32
    assert plain.tolist() == [r // 64 for r in range(100)] + [r // 64 for r in range(200)]
    assert quirk.tolist() == [(r + 100) // 64 for r in range(100)] + [r // 64 for r in range(200)]
    chunked = q_block_idx_prefill(cu, 200, cache_lens=[64, 1])
    assert chunked.tolist() == [(r + 64) // 64 for r in range(100)] + [(r + 1) // 64 for r in range(200)]
    assert s1.q_block_idx_decode(torch.tensor([0, 63, 64, 4095])).tolist() == [0, 0, 1, 63]


def test_stage1_select_is_the_chain():
    lengths = [700, 300]
    q, ck1, ck2, cu, cu1, cu2 = make_ref_inputs(lengths, 4, 2)
    idx = naive_stage1_select(q, ck1, ck2, cu, cu1, cu2, 700, topk=4, local_blocks=2)
    sc = naive_stage1_scores(q, ck1, ck2, cu, cu1, cu2, 700)
    bs = naive_pool_blocks(sc, cu, cu1, None, 700, local_blocks=2)
    assert torch.equal(idx, naive_select_topk(bs, q_block_idx_prefill(cu, 700), topk=4, local_blocks=2))


def _stage1_args():
    q, ck1, ck2, cu, cu1, cu2 = make_ref_inputs([300, 200], 4, 2)
    return {"q": q, "ck1": ck1, "ck2": ck2, "cu_seqlens_q": cu, "cu_seqlens_c1": cu1, "cu_seqlens_c2": cu2}


BAD_STAGE1 = [
    ("q", TypeError, lambda a: a["q"].int()),
    ("q", ValueError, lambda a: a["q"][0]),
    ("ck1", TypeError, lambda a: a["ck1"].double()),
    ("ck2", ValueError, lambda a: a["ck2"][..., :16]),
    ("ck1", ValueError, lambda a: a["ck1"].repeat(1, 3, 1)[:, :3]),     # 4 query heads, 3 kv heads
    ("cu_seqlens_q", TypeError, lambda a: a["cu_seqlens_q"].long()),
    ("cu_seqlens_q", ValueError, lambda a: torch.tensor([0, 300, 499], dtype=torch.int32)),
    ("cu_seqlens_c1", ValueError, lambda a: a["cu_seqlens_c1"][:2]),
]


@pytest.mark.parametrize("name,exc,corrupt", BAD_STAGE1,
                         ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD_STAGE1)])
def test_stage1_scores_rejects_bad_inputs(name, exc, corrupt):
    args = _stage1_args()
    args[name] = corrupt(args)
    with pytest.raises(exc, match=rf"\b{name}\b"):
        naive_stage1_scores(**args)


def test_pool_and_topk_reject_bad_inputs():
    cu, cu1 = cu_seqlens_from_lengths([100]), cu_seqlens_from_lengths([5])
    scores = torch.rand(1, 100, 5)
    with pytest.raises(ValueError, match="max_seqlen_q"):
        naive_pool_blocks(scores, cu, cu1, None, 50)
    with pytest.raises(ValueError, match="scores"):
        naive_pool_blocks(scores[..., :3], cu, cu1, None, 100)
    with pytest.raises(ValueError, match="cache_lens"):
        naive_pool_blocks(scores, cu, cu1, [0, 1], 100)
    with pytest.raises(ValueError, match="block_size"):
        naive_pool_blocks(scores, cu, cu1, None, 100, block_size=40)
    with pytest.raises(TypeError, match="scores"):
        naive_pool_blocks(scores.long(), cu, cu1, None, 100)
    bs = torch.rand(1, 100, 2)
    with pytest.raises(ValueError, match="q_block_idx"):
        naive_select_topk(bs, torch.zeros(99, dtype=torch.int32))
    with pytest.raises(TypeError, match="q_block_idx"):
        naive_select_topk(bs, torch.zeros(100))
    with pytest.raises(ValueError, match="topk"):
        naive_select_topk(bs, torch.zeros(100, dtype=torch.int32), topk=-1)


# ================================================================================================
# the kernel
# ================================================================================================

H100 = (227 * 1024, 228 * 1024)   # (opt-in per-block, per-SM) dynamic shared memory


# GPU tests that take `kernel` run twice: with the automatic choice (the sm_90a kernel for G <= 32
# on an H100, the SM80 kernel otherwise) and with the SM80 kernel forced (`kernel="sm80"`).
def pytest_generate_tests(metafunc):
    if metafunc.definition.get_closest_marker("gpu") is not None and "kernel" in metafunc.fixturenames:
        metafunc.parametrize("kernel", ["auto", "sm80"])


def default_plan(inputs, max_seqlen_q, kernel="auto", score_dtype=torch.bfloat16, cache=0):
    """The plan `stage1_select` makes for these inputs (to change one field of it)."""
    q, ck1 = inputs[0], inputs[1]
    limits = sel._smem_limits(q.device)
    sdt = torch.float32 if score_dtype is None else score_dtype
    return stage1_plan(torch.cuda.get_device_capability(q.device), q.shape[1] // ck1.shape[1], q.shape[2],
                       q.dtype, sdt, -(-(max_seqlen_q + cache) // 64), *limits, kernel)

# one unit in the last place, relative, of each score dtype (and fp32 math in a different order)
RTOL = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10, torch.float32: 1e-4}


# --------------------------------------------------------------------------------------------
# inputs and checks (shared by the GPU tests)
# --------------------------------------------------------------------------------------------
def make_inputs(lengths_q, HQ, H, D, dtype, *, lengths_k=None, exact=False, seed=0, device="cuda"):
    """Random q and really compressed keys (keys scaled so that the softmax is not flat)."""
    lengths_k = lengths_q if lengths_k is None else lengths_k
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lengths_q), HQ, D, generator=g).to(dtype)
    k = (4 * torch.randn(sum(lengths_k), H, D, generator=g)).to(dtype)
    cu_k = cu_seqlens_from_lengths(lengths_k)
    ck1, cu1 = naive_compress_k(k, cu_k, 32, 16)
    ck2, cu2 = (ck1, cu1) if exact else naive_compress_k(k, cu_k, 128, 64)
    cu_q = cu_seqlens_from_lengths(lengths_q)
    return tuple(t.to(device) for t in (q, ck1, ck2, cu_q, cu1, cu2))


def own_topk(block_scores, q_blocks, K):
    """Our tie rule on given block scores: K largest (ties to the lower index), ascending, > q block -> -1."""
    order = torch.sort(block_scores.float(), dim=-1, descending=True, stable=True).indices[..., :K]
    idx = order.sort(dim=-1).values
    return idx.masked_fill(idx > q_blocks.long()[None, :, None], -1).to(torch.int32)


def assert_scores_close(name, got, ref, score_dtype):
    """Elementwise within one ulp of the score dtype; +-inf and zeros exactly where the reference has them."""
    assert got.shape == ref.shape and got.dtype == ref.dtype, (name, got.shape, ref.shape, got.dtype,
                                                               ref.dtype)
    assert not torch.isnan(got).any(), f"{name}: NaN (an element was never written?)"
    g, r = got.double(), ref.double()
    inf = torch.isinf(r)
    assert torch.equal(torch.isinf(g), inf) and torch.equal(g[inf], r[inf]), f"{name}: +-inf positions differ"
    fin = ~inf
    err = (g[fin] - r[fin]).abs()
    tol = RTOL[score_dtype] * r[fin].abs() + 1e-30
    bad = err > tol
    assert not bool(bad.any()), (f"{name}: {int(bad.sum())} elements off by more than one ulp; worst "
                                 f"{err.max().item():.3e} at ref {r[fin][err.argmax()].item():.6e}")


def check_contract(idx, q_blocks, off_bq, out_len, K, init_blocks, local_blocks):
    """Structure of every row: ascending, no duplicates, -1 only as tail, nothing above the query
    block, forced blocks present when the budget holds them all."""
    H, T, k = idx.shape
    assert k == K and idx.dtype == torch.int32
    assert bool((idx >= -1).all()) and bool((idx < out_len).all()), "index out of range (unwritten?)"
    valid = idx >= 0
    assert bool((valid[..., 1:] <= valid[..., :-1]).all()), "-1 must be tail padding only"
    both = valid[..., 1:] & valid[..., :-1]
    assert bool((idx[..., 1:] > idx[..., :-1])[both].all()), "indices must be ascending and distinct"
    assert bool((idx <= q_blocks.long()[None, :, None]).all()), "a future block survived"
    j = torch.arange(out_len, device=idx.device)
    ob = off_bq.long()[:, None]
    forced = (j[None] < init_blocks) | ((j[None] <= ob) & (j[None] >= ob - local_blocks))     # [T, out_len]
    fits = forced.sum(-1) <= K                                                                # [T]
    want = forced & (j[None] <= q_blocks.long()[:, None]) & fits[:, None]
    sel_mask = torch.zeros(H, T, out_len + 1, dtype=torch.bool, device=idx.device)
    sel_mask.scatter_(-1, torch.where(valid, idx.long(), out_len), True)
    assert bool((sel_mask[..., :out_len] | ~want[None]).all()), "a forced block is missing"
    return sel_mask[..., :out_len]


def check_modulo_ties(idx, ref_idx, ref_bs, q_blocks, K, score_dtype):
    """Against the reference's own block scores: selected >= thr >= unselected causal blocks (thr = the
    K-th largest reference score), up to two ulps (each side rounds once); exact equality on rows
    without a near-tie at thr."""
    H, T, out_len = ref_bs.shape
    r = ref_bs.double()
    thr = torch.sort(r, dim=-1, descending=True).values[..., K - 1:K]                         # [H, T, 1]
    tol = torch.where(torch.isfinite(thr), 2 * RTOL[score_dtype] * thr.abs() + 1e-30, torch.zeros_like(thr))
    valid = idx >= 0
    sel_mask = torch.zeros(H, T, out_len + 1, dtype=torch.bool, device=idx.device)
    sel_mask.scatter_(-1, torch.where(valid, idx.long(), out_len), True)
    sel_mask = sel_mask[..., :out_len]
    j = torch.arange(out_len, device=idx.device)
    causal = (j[None, None] <= q_blocks.long()[None, :, None]).expand(H, T, out_len)
    lo_ok = (r >= thr - tol) | ~sel_mask
    assert bool(lo_ok.all()), f"{int((~lo_ok).sum())} selected blocks score below the K-th reference score"
    hi_ok = (r <= thr + tol) | sel_mask | ~causal
    assert bool(hi_ok.all()), f"{int((~hi_ok).sum())} causal blocks left out beat the K-th reference score"
    n_sel = valid.sum(-1)
    clearly_in = (causal & (r > thr + tol)).sum(-1)
    maybe_in = (causal & (r >= thr - tol)).sum(-1)
    assert bool((n_sel >= clearly_in).all()) and bool((n_sel <= torch.maximum(maybe_in, clearly_in)).all())
    # rows whose near-ties at thr are all future blocks (masked to -1 anyway) are fully determined
    near = (r == thr) | ((r - thr).abs() <= tol)
    ambiguous = ((near & causal).sum(-1) > 0) & ((r >= thr - tol).sum(-1) > K)
    rows = ~ambiguous
    n_diff = int((idx[rows] != ref_idx[rows]).any(-1).sum())
    assert n_diff == 0, f"{n_diff} unambiguous rows differ from the reference"
    return int(rows.sum()), rows.numel()


def reference(q, ck1, ck2, cu_q, cu1, cu2, max_seqlen_q, **kw):
    return naive_stage1_select(q, ck1, ck2, cu_q, cu1, cu2, max_seqlen_q, return_scores=True, **kw)


def run_and_check(q, ck1, ck2, cu_q, cu1, cu2, max_seqlen_q, *, score_dtype=torch.bfloat16, causal=True,
                  cache_lens=None, topk=64, local_blocks=32, init_blocks=1, varlen_offset_quirk=False,
                  min_unambiguous=0.0, backend="kernels", kernel="auto", plan=None):
    """Check the kernels' selection (public `stage1_select` with `kernel`, or with a `plan` the
    launcher level `launch_select`) against the reference; returns (idx, scores, block_scores)."""
    kw = {"causal": causal, "cache_lens": cache_lens, "topk": topk, "local_blocks": local_blocks,
          "init_blocks": init_blocks, "varlen_offset_quirk": varlen_offset_quirk, "score_dtype": score_dtype}
    args = (q, ck1, ck2, cu_q, cu1, cu2, max_seqlen_q)
    if plan is None:
        def run(**extra):
            return stage1_select(*args, backend=backend, kernel=kernel, **kw, **extra)
    else:
        def run(**extra):
            return launch_select(*args, plan=plan, **kw, **extra)
    idx, sc, bs = run(return_scores=True)
    plain = run()
    assert torch.equal(plain, idx), "the default path and return_scores must select the same blocks"
    ref_idx, ref_sc, ref_bs = reference(*args, **kw)
    sdt = torch.float32 if score_dtype is None else score_dtype
    assert_scores_close("scores", sc, ref_sc, sdt)
    assert_scores_close("block_scores", bs, ref_bs, sdt)
    lengths = (cu_q[1:] - cu_q[:-1]).tolist()
    cache = (torch.zeros(len(lengths), dtype=torch.int64) if cache_lens is None
             else torch.as_tensor(cache_lens).cpu())
    out_len = ref_bs.shape[-1]
    K = min(topk + local_blocks, out_len)
    q_blocks = q_block_idx_prefill(cu_q.cpu(), max_seqlen_q, block_size=64,
                                   varlen_offset_quirk=varlen_offset_quirk, cache_lens=cache)
    off_bq = q_block_idx_prefill(cu_q.cpu(), max_seqlen_q, block_size=64, varlen_offset_quirk=False,
                                 cache_lens=cache)
    q_blocks, off_bq = q_blocks.to(idx.device), off_bq.to(idx.device)
    assert idx.shape == ref_idx.shape
    # (1) our own top-K of our own block scores, exactly
    assert torch.equal(idx, own_topk(bs, q_blocks, K)), "indices are not the top-K of the kernel's own scores"
    # structure and forced blocks
    check_contract(idx, q_blocks, off_bq, out_len, K, init_blocks, local_blocks)
    # (3) against the reference modulo ties
    n_rows, total = check_modulo_ties(idx, ref_idx, ref_bs, q_blocks, K, sdt)
    assert n_rows >= min_unambiguous * total, f"only {n_rows}/{total} rows were unambiguous"
    return idx, sc, bs


# --------------------------------------------------------------------------------------------
# GPU tests
# --------------------------------------------------------------------------------------------
# (lengths, HQ, H, D, dtype): ragged batches, both quirks (L % 16 == 15: 335, 1023; L % 64 == 63: 383,
# 1023, 191), sequences shorter than 128, G in {1, 2, 3, 4, 8, 12, 16, 32, 64, 128}
CASES = [
    ([1000], 32, 2, 128, torch.bfloat16),
    ([1023, 335, 383, 127, 64, 1, 200], 16, 1, 128, torch.bfloat16),
    ([2000, 700], 8, 1, 64, torch.float16),
    ([513, 130, 17], 4, 2, 64, torch.bfloat16),
    ([900, 40], 4, 4, 128, torch.bfloat16),
    ([777, 191], 16, 4, 64, torch.bfloat16),
    ([600, 100], 32, 1, 128, torch.bfloat16),
    ([500, 129], 64, 1, 64, torch.bfloat16),
    ([400], 128, 1, 64, torch.float16),
    ([450, 320], 24, 2, 128, torch.bfloat16),
    ([333, 1], 6, 2, 64, torch.float16),
]
IDS = [f"L{'-'.join(map(str, c[0]))}_HQ{c[1]}_H{c[2]}_D{c[3]}_{str(c[4])[6:]}" for c in CASES]


@pytest.mark.gpu
@pytest.mark.parametrize("score_dtype", [torch.bfloat16, torch.float32], ids=["bf16scores", "fp32scores"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_prefill_against_reference(case, score_dtype, kernel):
    lengths, HQ, H, D, dtype = case
    inputs = make_inputs(lengths, HQ, H, D, dtype)
    # fp32 scores have no ties among past blocks: nearly every row must equal the reference exactly
    run_and_check(*inputs, max(lengths), score_dtype=score_dtype,
                  min_unambiguous=0.9 if score_dtype == torch.float32 else 0.0, kernel=kernel)


@pytest.mark.gpu
@pytest.mark.parametrize("topk,local_blocks,init_blocks", [(64, 32, 1), (3, 2, 1), (0, 32, 1), (5, 0, 3)])
def test_budgets(topk, local_blocks, init_blocks, kernel):
    """Small budgets pad with -1; K below the forced count (topk = 0) keeps the lowest forced blocks."""
    lengths = [1500, 383, 64]
    inputs = make_inputs(lengths, 16, 2, 64, torch.bfloat16)
    run_and_check(*inputs, max(lengths), topk=topk, local_blocks=local_blocks, init_blocks=init_blocks,
                  kernel=kernel)


@pytest.mark.gpu
@pytest.mark.parametrize("score_dtype", [torch.bfloat16, torch.float16, None], ids=["bf16", "fp16", "none"])
def test_score_dtypes(score_dtype, kernel):
    lengths = [1200, 255]
    inputs = make_inputs(lengths, 16, 2, 128, torch.bfloat16)
    _, sc, bs = run_and_check(*inputs, max(lengths), score_dtype=score_dtype, kernel=kernel)
    want = torch.float32 if score_dtype is None else score_dtype
    assert sc.dtype == bs.dtype == want


@pytest.mark.gpu
@pytest.mark.parametrize("HQ,H", [(16, 1), (8, 2), (2, 2)])
def test_exact_mode(HQ, H, kernel):
    """ck2 = ck1: the coarse pass walks the fine keys with stride 16 (exact softmax over ck1)."""
    lengths = [700, 335, 31, 100]
    inputs = make_inputs(lengths, HQ, H, 64, torch.bfloat16, exact=True)
    run_and_check(*inputs, max(lengths), kernel=kernel)
    run_and_check(*inputs, max(lengths), score_dtype=torch.float32, min_unambiguous=0.9, kernel=kernel)


@pytest.mark.gpu
def test_varlen_offset_quirk(kernel):
    lengths = [1100, 300, 70]
    inputs = make_inputs(lengths, 16, 2, 64, torch.bfloat16)
    run_and_check(*inputs, max(lengths), varlen_offset_quirk=True, kernel=kernel)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_chunked_prefill(dtype, kernel):
    """Queries are the last Lq of Lk keys (cache_lens = Lk - Lq): bottom-right aligned visibility."""
    lk, lq = [1500, 700, 383], [200, 64, 383]
    q, ck1, ck2, cu_q, cu1, cu2 = make_inputs(lq, 16, 2, 128, dtype, lengths_k=lk)
    cache = torch.tensor([a - b for a, b in zip(lk, lq)], dtype=torch.int32, device="cuda")
    run_and_check(q, ck1, ck2, cu_q, cu1, cu2, max(lq), cache_lens=cache, kernel=kernel)
    run_and_check(q, ck1, ck2, cu_q, cu1, cu2, max(lq), cache_lens=cache.tolist(), score_dtype=torch.float32,
                  kernel=kernel)


@pytest.mark.gpu
@pytest.mark.parametrize("HQ,H", [(32, 2), (8, 1), (3, 3)])
def test_decode(HQ, H, kernel):
    """One query per sequence, causal=False, cache_lens = L - 1: every compressed key is visible."""
    lk = [4000, 1, 127, 128, 2047, 64 * 40 + 63]
    q, ck1, ck2, _, cu1, cu2 = make_inputs(lk, HQ, H, 128, torch.bfloat16)
    starts = cu_seqlens_from_lengths(lk)[1:].long() - 1
    qd = q[starts.to(q.device)].contiguous()                               # the last token of each sequence
    cu_q = torch.arange(len(lk) + 1, dtype=torch.int32, device="cuda")
    cache = torch.tensor([L - 1 for L in lk], dtype=torch.int32, device="cuda")
    run_and_check(qd, ck1, ck2, cu_q, cu1, cu2, 1, causal=False, cache_lens=cache, kernel=kernel)


@pytest.mark.gpu
def test_key_tensors_misaligned_or_empty(kernel):
    """Both kernels copy 16-byte rows (cp.async; TMA on sm_90a): a view at an odd element offset is
    refused with the argument's name before any launch, and its aligned clone selects as the original;
    a batch whose sequences are all shorter than the coarse window (an empty ck2) selects as the
    reference."""
    lengths = [900, 333, 70]
    q, ck1, ck2, cu_q, cu1, cu2 = make_inputs(lengths, 16, 1, 128, torch.bfloat16)

    def odd_view(t):
        buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)[1:]
        buf.copy_(t.reshape(-1))
        v = buf.view(t.shape)
        assert v.data_ptr() % 16 and v.is_contiguous()
        return v
    ref = stage1_select(q, ck1, ck2, cu_q, cu1, cu2, max(lengths), kernel=kernel)
    for name, args in [("q", (odd_view(q), ck1, ck2)), ("ck1", (q, odd_view(ck1), ck2)),
                       ("ck2", (q, ck1, odd_view(ck2)))]:
        with pytest.raises(ValueError, match=f"{name} must start at a 16-byte aligned address"):
            stage1_select(*args, cu_q, cu1, cu2, max(lengths), kernel=kernel)
    got = stage1_select(q, odd_view(ck1).clone(), ck2, cu_q, cu1, cu2, max(lengths), kernel=kernel)
    assert torch.equal(got, ref)
    short = [100, 50, 127, 1]
    inputs = make_inputs(short, 16, 1, 128, torch.bfloat16)
    assert inputs[2].shape[0] == 0, "every sequence below 128 tokens: no coarse key"
    run_and_check(*inputs, max(short), kernel=kernel)


@pytest.mark.gpu
def test_long_sequence(kernel):
    """More tiles than any other case (out_len 180), README heads."""
    lengths = [11500]
    inputs = make_inputs(lengths, 32, 2, 128, torch.bfloat16)
    run_and_check(*inputs, max(lengths), kernel=kernel)


@pytest.mark.gpu
@pytest.mark.parametrize("warps", [1, 2, 4], ids=["1warp", "2warps", "4warps"])
@pytest.mark.parametrize("in_smem", [True, False], ids=["smem", "scratch"])
def test_sm80_tile_plans(warps, in_smem):
    """Fewer warps per CTA (what long sequences at small G get) and block keys in the global scratch:
    SM80 plans the shapes below would not get, run at the launcher level."""
    plan = Stage1Plan("sm80", warps, in_smem)
    for lengths, HQ, H in (([2500, 300], 2, 2), ([1800, 63], 16, 1), ([700], 8, 1)):
        inputs = make_inputs(lengths, HQ, H, 64, torch.bfloat16)
        run_and_check(*inputs, max(lengths), plan=plan)


@pytest.mark.gpu
@pytest.mark.parametrize("forced", ["sm80", pytest.param("sm90a", marks=pytest.mark.skipif(
    not HOPPER, reason="the sm_90a kernel needs capability 9.0"))])
def test_kernel_argument_forces_the_kernel(forced, monkeypatch):
    """`kernel="sm80"` / `"sm90a"` launch that kernel (the launch's name says which), and each
    selection passes the reference checks."""
    names = []
    real = sel.launch
    monkeypatch.setattr(sel, "launch", lambda *a, **k: (names.append(k["name"]), real(*a, **k))[1])
    for lengths, HQ, H in (([1800, 63], 16, 1), ([700, 130], 32, 2)):
        inputs = make_inputs(lengths, HQ, H, 128, torch.bfloat16)
        run_and_check(*inputs, max(lengths), kernel=forced)
    assert names and all(("_sm90<" in n) == (forced == "sm90a") for n in names), names


@pytest.mark.gpu
@pytest.mark.parametrize("prefix,topk,local_blocks", [(1, 64, 32), (1, 8, 4), (100, 8, 4)])
def test_topk_whole_row_rerun(prefix, topk, local_blocks, kernel):
    """The top-K searches the blocks up to a token's own block first; a plan whose prefix is shorter
    than the visible blocks (`topk_prefix`) must fall back to the whole row, same selection."""
    lengths = [11500, 700]
    inputs = make_inputs(lengths, 16, 2, 128, torch.bfloat16)
    kw = {"topk": topk, "local_blocks": local_blocks}
    auto = stage1_select(*inputs, max(lengths), backend="kernels", kernel=kernel, **kw)
    plan = dataclasses.replace(default_plan(inputs, max(lengths), kernel), topk_prefix=prefix)
    assert torch.equal(auto, launch_select(*inputs, max(lengths), plan=plan, **kw))
    for score_dtype in (torch.bfloat16, torch.float32):
        plan = dataclasses.replace(default_plan(inputs, max(lengths), kernel, score_dtype),
                                   topk_prefix=prefix)
        idx, _, bs = launch_select(*inputs, max(lengths), return_scores=True, score_dtype=score_dtype,
                                   plan=plan, **kw)
        q_blocks = q_block_idx_prefill(inputs[3].cpu(), max(lengths)).to(idx.device)
        assert torch.equal(idx, own_topk(bs, q_blocks, idx.shape[-1]))


@pytest.mark.gpu
def test_block_keys_in_scratch(kernel):
    """The planned kernel with its block-key rows in the global scratch (very long sequences)."""
    for lengths, HQ, H in (([2500, 300], 2, 2), ([1800, 63], 16, 1)):
        inputs = make_inputs(lengths, HQ, H, 64, torch.bfloat16)
        plan = dataclasses.replace(default_plan(inputs, max(lengths), kernel), block_keys_in_smem=False)
        run_and_check(*inputs, max(lengths), plan=plan)


@pytest.mark.gpu
def test_outputs_are_fully_written(kernel):
    """With NaN/sentinel-poisoned allocations (conftest sets INFLLM_CUPY_POISON=1) nothing stays unwritten."""
    lengths = [650, 5, 129]
    inputs = make_inputs(lengths, 16, 2, 64, torch.bfloat16)
    idx, sc, bs = stage1_select(*inputs, max(lengths), return_scores=True, backend="kernels", kernel=kernel)
    assert not bool((idx == -(2**30)).any())
    assert not torch.isnan(sc).any() and not torch.isnan(bs).any()
    idx2 = stage1_select(*inputs, max(lengths), backend="kernels", kernel=kernel)
    assert not bool((idx2 == -(2**30)).any())


@pytest.mark.gpu
def test_deterministic(kernel):
    lengths = [1300, 200]
    inputs = make_inputs(lengths, 64, 1, 64, torch.bfloat16)       # G = 64: cross-warp group sums
    a = stage1_select(*inputs, max(lengths), return_scores=True, backend="kernels", kernel=kernel)
    b = stage1_select(*inputs, max(lengths), return_scores=True, backend="kernels", kernel=kernel)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.gpu
def test_large_offsets(kernel):
    """q with more than 2^31 elements: the second sequence's rows start past 2^31 (64-bit offsets).

    The first sequence has 132k queries but only 16 keys (no compressed key), so it costs only its
    top-K over the forced blocks."""
    HQ, H, D = 128, 1, 128
    lq, lk = [132072, 1500], [16, 1500]
    g = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(sum(lq), HQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
    assert q.numel() > 2**31 and lq[0] * HQ * D > 2**31
    k = (4 * torch.randn(sum(lk), H, D, device="cuda", generator=g)).to(torch.bfloat16)
    cu_k = cu_seqlens_from_lengths(lk, "cuda")
    ck1, cu1 = naive_compress_k(k, cu_k, 32, 16)
    ck2, cu2 = naive_compress_k(k, cu_k, 128, 64)
    cu_q = cu_seqlens_from_lengths(lq, "cuda")
    idx = stage1_select(q, ck1, ck2, cu_q, cu1, cu2, max(lq), backend="kernels", kernel=kernel)
    t0 = lq[0]
    sub = (q[t0:], ck1, ck2, cu_seqlens_from_lengths([lq[1]], "cuda"),
           cu_seqlens_from_lengths([int(cu1[2])], "cuda"), cu_seqlens_from_lengths([int(cu2[2])], "cuda"))
    ref_idx, _, ref_bs = reference(*sub, max(lq))
    out_len = ref_bs.shape[-1]
    qb = q_block_idx_prefill(sub[3].cpu(), max(lq)).cuda()
    check_modulo_ties(idx[:, t0:], ref_idx, ref_bs, qb, min(96, out_len), torch.bfloat16)
    # first sequence: no fine key, so every block is -inf but the forced ones (+inf); our tie rule
    # fills the budget with the lowest-index -inf blocks
    out_len = -(-max(lq) // 64)
    for t in (0, 1000, 65535, t0 - 1):
        ob = t // 64
        forced = sorted(set([0] + list(range(max(0, ob - 32), ob + 1))))
        rest = [j for j in range(out_len) if j not in forced][:96 - len(forced)]
        want = sorted(j for j in forced + rest if j <= ob)
        assert idx[0, t].tolist() == want + [-1] * (96 - len(want)), t


@pytest.mark.gpu
@pytest.mark.parametrize("bad, exc, match", [
    ({"q": lambda a: a.float(), "ck1": lambda a: a.float(), "ck2": lambda a: a.float()}, TypeError,
     "q must have dtype"),
    ({"q": lambda a: a[..., :32].contiguous(), "ck1": lambda a: a[..., :32].contiguous(),
          "ck2": lambda a: a[..., :32].contiguous()}, ValueError, "head dim 32"),
    ({"ck1": lambda a: a.half()}, TypeError, "ck1 must have dtype"),
    ({"cu_q": lambda c: c.flip(0)}, ValueError, "cu_seqlens_q must"),
    ({"cu1": lambda c: c[:2]}, ValueError, "cu_seqlens_c1"),
    ({"mq": lambda m: m - 1}, ValueError, "max_seqlen_q must be >="),
    ({"kw": lambda k: {**k, "block_size": 128}}, ValueError, "block_size"),
    ({"kw": lambda k: {**k, "kernel_stride": 8}}, ValueError, "kernel_stride"),
    ({"kw": lambda k: {**k, "coarse_kernel_stride": 32}}, ValueError, "coarse_kernel_stride"),
    ({"kw": lambda k: {**k, "score_dtype": torch.float64}}, ValueError, "score_dtype"),
    ({"kw": lambda k: {**k, "cache_lens": [0]}}, ValueError, "cache_lens"),
    ({"kw": lambda k: {**k, "topk": -1}}, ValueError, "topk"),
    ({"kw": lambda k: {**k, "softmax_scale": -1.0}}, ValueError, "softmax_scale"),
    ({"kw": lambda k: {**k, "backend": "triton"}}, ValueError, "backend"),
    ({"kw": lambda k: {**k, "kernel": "sm70"}}, ValueError, "kernel must be one of"),
])
def test_bad_inputs_raise_before_launch(bad, exc, match, monkeypatch, kernel):
    def no_launch(*a, **k):
        raise AssertionError("launched")
    monkeypatch.setattr(sel, "launch", no_launch)
    q, ck1, ck2, cu_q, cu1, cu2 = make_inputs([300, 200], 16, 2, 64, torch.bfloat16)
    args = {"q": q, "ck1": ck1, "ck2": ck2, "cu_q": cu_q, "cu1": cu1, "cu2": cu2, "mq": 300,
            "kw": {"backend": "kernels", "kernel": kernel}}
    for name, f in bad.items():
        args[name] = f(args[name])
    with pytest.raises(exc, match=match):
        stage1_select(args["q"], args["ck1"], args["ck2"], args["cu_q"], args["cu1"], args["cu2"], args["mq"],
                      **args["kw"])


@pytest.mark.gpu
def test_group_too_large_raises(kernel):
    q, ck1, ck2, cu_q, cu1, cu2 = make_inputs([100], 256, 1, 64, torch.bfloat16)
    with pytest.raises(ValueError, match="G = 256"):
        stage1_select(q, ck1, ck2, cu_q, cu1, cu2, 100, backend="kernels", kernel=kernel)


# --------------------------------------------------------------------------------------------
# CPU tests: dispatch, argument checks, launch planning
# --------------------------------------------------------------------------------------------
def test_select_cpu_tensors_run_the_reference():
    lengths = [400, 130]
    inputs = make_inputs(lengths, 8, 2, 32, torch.float32, device="cpu")
    want = naive_stage1_select(*inputs, 400, topk=4, local_blocks=2, return_scores=True)
    for backend in ("auto", "reference"):
        got = stage1_select(*inputs, 400, topk=4, local_blocks=2, return_scores=True, backend=backend)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert torch.equal(stage1_select(*inputs, 400, topk=4, local_blocks=2), want[0])


def test_own_topk_tie_rule():
    bs = torch.tensor([[[1.0, 3.0, 3.0, float("inf"), 3.0, 0.0, float("-inf")]]])
    assert own_topk(bs, torch.tensor([6]), 3).tolist() == [[[1, 2, 3]]]
    assert own_topk(bs, torch.tensor([1]), 4).tolist() == [[[1, -1, -1, -1]]]
    assert own_topk(bs, torch.tensor([6]), 6).tolist() == [[[0, 1, 2, 3, 4, 5]]]


@pytest.mark.parametrize("width", [7, 64, 300])
def test_reference_topk_breaks_ties_to_the_lower_block(width):
    # planted ties: every score one of three values, forced blocks +inf, nothing after the query's block
    g = torch.Generator().manual_seed(width)
    bs = torch.randint(0, 3, (2, 40, width), generator=g).float()
    bs[..., 0] = float("inf")
    q_blocks = torch.randint(0, width, (40,), generator=g, dtype=torch.int32)
    for K in (1, 3, 5, width):
        got = naive_select_topk(bs, q_blocks, topk=K, local_blocks=0)
        assert torch.equal(got, own_topk(bs, q_blocks, K)), K
    # written out for one row: the highest score wins, ties by index
    row = torch.tensor([[[2.0, 5.0, 2.0, 5.0, 2.0, 5.0]]])
    assert naive_select_topk(row, torch.tensor([5]), topk=4, local_blocks=0).tolist() == [[[0, 1, 3, 5]]]
    assert naive_select_topk(row, torch.tensor([5]), topk=2, local_blocks=0).tolist() == [[[1, 3]]]


def test_reference_selection_on_all_equal_scores_takes_the_lowest_blocks():
    # q = 0: every visible fine key scores the same, so every block that is not forced ties; the
    # reference takes the lowest blocks (the kernels' rule), whatever the row's width
    q, ck1, ck2, cu_q, cu1, cu2 = make_inputs([1000, 700], 8, 2, 64, torch.float32, device="cpu")
    q = torch.zeros_like(q)
    idx = naive_stage1_select(q, ck1, ck2, cu_q, cu1, cu2, 1000, topk=4, local_blocks=1)
    # last token of sequence 0 (block 15): K = 5, forced 0, 14 and 15, then the two lowest others
    assert idx[:, 999].tolist() == [[0, 1, 2, 14, 15]] * 2


@pytest.mark.gpu
@pytest.mark.parametrize("score_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_kernel_equals_reference_on_planted_ties(score_dtype, kernel):
    # q = 0: every block that is not forced ties with every other; the kernels and the reference
    # must pick the same (lowest) blocks, row for row
    inputs = make_inputs([1000, 333, 64], 32, 2, 128, torch.bfloat16)
    q = torch.zeros_like(inputs[0])
    args = (q, *inputs[1:], 1000)
    kw = dict(topk=6, local_blocks=2, score_dtype=score_dtype)
    got = stage1_select(*args, kernel=kernel, **kw)
    want = naive_stage1_select(*(t.cpu() if isinstance(t, torch.Tensor) else t for t in args), **kw)
    assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("kw, exc, match", [
    ({"block_size": 128}, ValueError, "block_size"),
    ({"kernel_stride": 8}, ValueError, "kernel_stride"),
    ({"coarse_kernel_stride": 128}, ValueError, "coarse_kernel_stride"),
    ({"score_dtype": torch.float64}, ValueError, "score_dtype"),
    ({"softmax_scale": 0.0}, ValueError, "softmax_scale"),
    ({}, ValueError, "q must be a CUDA tensor"),
])
def test_kernel_launcher_checks_on_cpu(kw, exc, match):
    # the launcher checks what its kernel cannot do before it asks for a CUDA tensor
    inputs = make_inputs([300], 4, 2, 64, torch.bfloat16, device="cpu")
    with pytest.raises(exc, match=match):
        launch_select(*inputs, 300, **kw)


@pytest.mark.parametrize("kw, match", [
    ({"backend": "cuda"}, "backend must be one of"),
    ({"backend": "kernels"}, r"q must be a CUDA tensor for backend='kernels' \(there are no CPU kernels\)"),
    ({"backend": "kernels", "block_size": 128}, "q must be a CUDA tensor for backend='kernels'"),
])
def test_backend_rule_on_cpu(kw, match):
    inputs = make_inputs([300], 4, 2, 64, torch.bfloat16, device="cpu")
    with pytest.raises(ValueError, match=match):
        stage1_select(*inputs, 300, **kw)


def test_kernel_launcher_rejects_fp32_and_odd_head_dims_on_cpu():
    with pytest.raises(TypeError, match="q must have dtype"):
        launch_select(*make_inputs([100], 4, 2, 64, torch.float32, device="cpu"), 100)
    with pytest.raises(ValueError, match="head dim 32"):
        launch_select(*make_inputs([100], 4, 2, 32, torch.bfloat16, device="cpu"), 100)
    with pytest.raises(ValueError, match="G = 256"):
        launch_select(*make_inputs([100], 256, 1, 64, torch.bfloat16, device="cpu"), 100)


def test_launch_planning():
    # README config at 128k: 4 warps (8 tokens at G = 16), block keys in shared memory, two CTAs per SM
    olp = 2048
    w, in_smem = choose_tiles(128, 2, 4, olp, 2, *H100)
    assert (w, in_smem) == (4, True) and smem_bytes(128, 2, 4, 4, olp, 2, True) <= 113 * 1024
    # G = 1 at 128k: fewer warps (fewer tokens per CTA) before falling back to the global scratch
    w, in_smem = choose_tiles(128, 2, 0, olp, 2, *H100)
    assert in_smem and w == 1
    assert choose_tiles(128, 2, 0, 8192, 2, *H100) == (4, False)
    assert choose_tiles(64, 2, 0, 8192, 2, 24 * 1024, 48 * 1024) == (1, False)
    # a token of G = 128 needs all four warps
    assert choose_tiles(64, 2, 7, 64, 2, *H100)[0] == 4
    for lgp in range(8):
        assert smem_bytes(64, 2, 4, lgp, 64, 2, False) >= 2 * 64 * 64 * 2


def test_stage1_plan():
    """The plan: sm_90a on capability 9.0 for G <= 32 (8 warps, block keys in shared memory while
    they fit), the SM80 kernel elsewhere with `choose_tiles`' shape; `kernel` forces one."""
    bf16, fp32 = torch.bfloat16, torch.float32
    # README config (G = 16, D = 128) at 128k: out_len 2048
    assert stage1_plan((9, 0), 16, 128, bf16, bf16, 2048, *H100) == Stage1Plan("sm90a", 8, True, 0)
    assert stage1_plan((9, 0), 32, 128, bf16, bf16, 2048, *H100).kernel == "sm90a"
    assert stage1_plan((9, 0), 33, 128, bf16, bf16, 2048, *H100) == Stage1Plan("sm80", 4, True)
    assert stage1_plan((8, 0), 16, 128, bf16, bf16, 2048, *H100) == Stage1Plan("sm80", 4, True)
    assert stage1_plan((9, 0), 16, 128, bf16, bf16, 2048, *H100, kernel="sm80") == Stage1Plan("sm80", 4, True)
    assert stage1_plan((9, 0), 16, 128, bf16, bf16, 2048, *H100, kernel="sm90a").kernel == "sm90a"
    # G = 1 at 128k on SM80: fewer warps before the global scratch; sm_90a: scratch past the smem
    assert stage1_plan((8, 0), 1, 128, bf16, bf16, 2048, *H100) == Stage1Plan("sm80", 1, True)
    # past the shared memory the key blocks split into ranges (the scratch stays the fallback)
    assert stage1_plan((9, 0), 1, 128, bf16, fp32, 8192, *H100) == Stage1Plan("sm90a", 8, False, 0, 192)
    for kernel, cap, G, match in (("sm90a", (8, 0), 16, "capability 9.0"), ("sm90a", (9, 0), 33, "G <= 32"),
                                  ("sm70", (9, 0), 16, "kernel must be one of"),
                                  ("SM90A", (9, 0), 16, "kernel must be one of")):
        with pytest.raises(ValueError, match=match):
            stage1_plan(cap, G, 128, bf16, bf16, 64, *H100, kernel=kernel)
    with pytest.raises(ValueError, match="warps"):
        Stage1Plan("sm90a", 4)
    with pytest.raises(ValueError, match="warps"):
        Stage1Plan("sm80", 8)
    with pytest.raises(ValueError, match="topk_prefix"):
        Stage1Plan("sm80", 4, True, -1)
    assert Stage1Plan("sm80", 1).tokens_per_cta(64) == 0 and Stage1Plan("sm80", 2).tokens_per_cta(64) == 1
    assert Stage1Plan("sm90a", 8).tokens_per_cta(16) == 8


def test_kernel_argument_checked_on_cpu():
    inputs = make_inputs([100], 4, 2, 64, torch.bfloat16, device="cpu")
    for bad in ("sm70", "", None, 90):
        with pytest.raises(ValueError, match="kernel must be one of"):
            stage1_select(*inputs, 100, kernel=bad)


def test_sm90_launch_planning():
    # README config (bf16, D = 128, G = 16) at 128k: block keys in shared memory, two CTAs per SM
    assert smem_bytes_sm90(128, 2, 4, 2048, 2, True) <= 113 * 1024
    # the layout: alignment slack + 2 Q + 2 key tiles + staging (+ block keys)
    assert smem_bytes_sm90(64, 2, 0, 64, 2, False) == 1024 + 4 * 64 * 64 * 2 + 128 * 68 * 4
    assert smem_bytes_sm90(64, 2, 0, 64, 4, True) == smem_bytes_sm90(64, 2, 0, 64, 4, False) + 128 * 64 * 4
    assert smem_bytes_sm90(64, 2, 5, 64, 2, False) == 1024 + 4 * 64 * 64 * 2 + 4 * 68 * 4 + 8 * 64 * 4


def test_every_instance_is_registered():
    from infllm_cupy import _jit
    for src, sm90a in ((sel.SOURCE, False), (sel.SOURCE_SM90, True)):
        names = {n for ks in _jit.registered() if ks.source == src and ks.sm90a == sm90a for n in ks.names}
        for dt in (torch.bfloat16, torch.float16):
            for st in (torch.bfloat16, torch.float16, torch.float32):
                for d in (64, 128):
                    assert sel.kernel_name(dt, st, d, sm90a) in names
                    assert sel.kernel_name(dt, st, d, sm90a, ranged=True) in names
                    if sm90a and st != torch.float32:     # the packed group sum, 16-bit scores only
                        assert sel.kernel_name(dt, st, d, sm90a, packed=True) in names
                        assert sel.kernel_name(dt, st, d, sm90a, ranged=True, packed=True) in names
        assert len(names) == (24 if sm90a else 16)
    assert [sel.lgp_of(G) for G in (1, 2, 3, 4, 5, 16, 17, 24, 32, 33, 64, 65, 128)] == \
        [0, 1, 2, 2, 3, 4, 5, 5, 5, 6, 6, 7, 7]


def test_stage1_inputs_name_the_key_set_whose_head_dim_differs():
    """ck1 with another head dim than q is named as ck1 (not blamed on ck2, which matches q)."""
    from infllm_cupy._checks import check_stage1_inputs

    q = torch.randn(64, 4, 64)
    ck1, ck2 = torch.randn(3, 2, 32), torch.randn(1, 2, 64)
    cu = torch.tensor([0, 64], dtype=torch.int32)
    with pytest.raises(ValueError, match="ck1 head dim 32 differs from q head dim 64"):
        check_stage1_inputs(q, ck1, ck2, cu, torch.tensor([0, 3], dtype=torch.int32),
                            torch.tensor([0, 1], dtype=torch.int32))
