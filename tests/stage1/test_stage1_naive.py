"""Stage-1 reference (scores, pooling, top-k) against brute force and slow loops (CPU)."""
import math

import pytest
import torch

from infllm_cupy.compress.naive import n_chunks, naive_compress_k
from infllm_cupy.stage1 import naive as s1
from infllm_cupy.stage1.naive import (
    naive_pool_blocks,
    naive_select_topk,
    naive_stage1_scores,
    naive_stage1_select,
    q_block_idx_decode,
    q_block_idx_prefill,
    vis_limit,
)

# (HQ, H): G = 1, 2, 16
HEADS = [(2, 2), (4, 2), (16, 1)]


def make_cu(lengths):
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    return cu


def make_inputs(lengths, HQ, H, D=32, seed=0, exact=False):
    """Random q and really compressed keys; keys scaled up so the softmax is not flat."""
    g = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    q = torch.randn(T, HQ, D, generator=g)
    k = 4 * torch.randn(T, H, D, generator=g)
    cu = make_cu(lengths)
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
            l1 = vis_limit(r, 16, n1, Lq, causal)
            l2 = vis_limit(r, stride2, n2, Lq, causal)
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
        want = [x for x in range(1, 1201) if x % s == s - 1 and n_chunks(x, 2 * s, s) >= 1]
        assert bad == want
        # under the quirk every query that sees a key in the window rule sees exactly one fewer
        quirk = (L % s == s - 1) & (brute > 0)
        assert bool((diff[quirk] == -1).all()) and bool((diff[~quirk] == 0).all())


def test_vis_limit_int_and_tensor_agree():
    for L in (1, 15, 47, 200, 335, 383, 1000):
        for s in (16, 64):
            n = n_chunks(L, 2 * s, s)
            got = vis_limit(torch.arange(L), s, n, L)
            assert got.tolist() == [vis_limit(r, s, n, L) for r in range(L)]
            assert vis_limit(L - 1, s, n, L, causal=False) == n
    # chunked prefill (q shorter than k, Lq - s + 1 < 0): C truncation, not floor
    assert vis_limit(0, 16, 10, 1) == min(10, max(0, 0 - 1 + 10 - 0))


@pytest.mark.parametrize("HQ,H", HEADS, ids=lambda x: str(x))
def test_exact_mode_is_softmax_over_fine_keys(HQ, H):
    lengths = [335, 200, 40, 17, 1]
    q, ck1, _, cu, cu1, _ = make_inputs(lengths, HQ, H, exact=True)
    got = naive_stage1_scores(q, ck1, ck1, cu, cu1, cu1, score_dtype=None)
    G, scale = HQ // H, q.shape[2] ** -0.5
    want = torch.zeros_like(got)
    t = c = 0
    for L in lengths:
        n1 = n_chunks(L, 32, 16)
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


CASES = [([335], (16, 1)), ([383], (4, 2)), ([100], (2, 2)), ([300], (16, 1)),
         ([335, 17, 130, 383, 64, 1], (2, 2)), ([335, 17, 130, 383, 64, 1], (32, 2))]


@pytest.mark.parametrize("lengths,heads", CASES, ids=lambda x: "-".join(map(str, x)))
def test_lse_mode_matches_slow_loop(lengths, heads):
    HQ, H = heads
    q, ck1, ck2, cu, cu1, cu2 = make_inputs(lengths, HQ, H)
    n1s = [n_chunks(L, 32, 16) for L in lengths]
    n2s = [n_chunks(L, 128, 64) for L in lengths]
    want = loop_stage1(q, ck1, ck2, lengths, n1s, n2s)
    got = naive_stage1_scores(q, ck1, ck2, cu, cu1, cu2, max(lengths), score_dtype=None)
    assert got.shape == (H, sum(lengths), max(n1s)) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-4)
    bf = naive_stage1_scores(q, ck1, ck2, cu, cu1, cu2)
    assert bf.dtype == torch.bfloat16
    torch.testing.assert_close(bf.double(), want, atol=1e-2, rtol=1e-2)


def test_quirk_rows_by_hand():
    # L = 335: L % 16 == 15, so no query sees the last fine key (quirk A)
    q, ck1, ck2, cu, cu1, cu2 = make_inputs([335], 2, 1)
    n1 = n_chunks(335, 32, 16)
    sc = naive_stage1_scores(q, ck1, ck2, cu, cu1, cu2, score_dtype=None)
    assert bool((sc[:, :, n1 - 1] == 0).all()) and bool((sc[:, -1, n1 - 2] > 0).all())
    q, ck1, ck2, cu, cu1, cu2 = make_inputs([336], 2, 1)
    sc = naive_stage1_scores(q, ck1, ck2, cu, cu1, cu2, score_dtype=None)
    assert bool((sc[:, -1, n_chunks(336, 32, 16) - 1] > 0).all())
    # L = 383: L % 64 == 63, the first coarse key appears only at r = 191 instead of 127 (quirk B)
    q, ck1, ck2, cu, cu1, cu2 = make_inputs([383], 2, 1)
    sc = naive_stage1_scores(q, ck1, ck2, cu, cu1, cu2, score_dtype=None)
    nz = (sc != 0).any(-1).any(0)
    assert not bool(nz[:191].any()) and bool(nz[191:].all())
    q, ck1, ck2, cu, cu1, cu2 = make_inputs([384], 2, 1)
    sc = naive_stage1_scores(q, ck1, ck2, cu, cu1, cu2, score_dtype=None)
    nz = (sc != 0).any(-1).any(0)
    assert not bool(nz[:127].any()) and bool(nz[127:].all())


def test_rows_without_coarse_key_are_zero_and_padding_is_zero():
    lengths = [127, 40, 500]
    q, ck1, ck2, cu, cu1, cu2 = make_inputs(lengths, 4, 2)
    sc = naive_stage1_scores(q, ck1, ck2, cu, cu1, cu2, score_dtype=None)
    assert bool((sc[:, :167] == 0).all())                               # L < 128: n2 = 0
    assert bool((sc[:, 167:167 + 127] == 0).all()) and bool((sc[:, 167 + 127:] != 0).any(-1).all())
    # decode (causal=False) with n2 = 0 gives zeros too; with n2 > 0 every fine key is scored
    dq = q[[126, 166, 666]]
    one = torch.arange(4, dtype=torch.int32)
    dec = naive_stage1_scores(dq, ck1, ck2, one, cu1, cu2, causal=False, score_dtype=None)
    assert bool((dec[:, :2] == 0).all())
    assert bool((dec[:, 2, :n_chunks(500, 32, 16)] > 0).all())


def test_query_chunking_does_not_change_scores(monkeypatch):
    q, ck1, ck2, cu, cu1, cu2 = make_inputs([383, 250], 4, 2)
    ref = naive_stage1_scores(q, ck1, ck2, cu, cu1, cu2, score_dtype=None)
    monkeypatch.setattr(s1, "_CHUNK_ELEMS", 1000)
    got = naive_stage1_scores(q, ck1, ck2, cu, cu1, cu2, score_dtype=None)
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_pooling_matches_loop(dtype):
    lengths, cache_lens, n1s = [200, 1, 77, 130], [0, 500, 64, 3], [40, 31, 0, 12]
    scores = torch.randn(2, sum(lengths), 45).to(dtype)
    for t0, L, n1 in zip(make_cu(lengths)[:-1].tolist(), lengths, n1s):
        scores[:, t0:t0 + L, n1:] = 0                                   # as stage 1 leaves them
    want = loop_pool(scores, lengths, n1s, cache_lens, 230, local_blocks=3)
    got = naive_pool_blocks(scores, make_cu(lengths), make_cu(n1s), torch.tensor(cache_lens, dtype=torch.int32),
                            230, local_blocks=3)
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
    q, ck1, ck2, cu, cu1, cu2 = make_inputs(lengths, 4, 2)
    idx, scores, bs = naive_stage1_select(q, ck1, ck2, cu, cu1, cu2, max(lengths), topk=topk,
                                          local_blocks=local_blocks, return_scores=True)
    out_len = math.ceil(1000 / 64)
    assert bs.shape == (2, sum(lengths), out_len) and scores.shape == (2, sum(lengths), n_chunks(1000, 32, 16))
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
    bs = naive_pool_blocks(torch.zeros(H, T, 0), make_cu([T]), make_cu([0]), None, T)
    assert bs.shape == (1, 3, 1) and bool(torch.isposinf(bs).all())
    forced = scores.clone()
    for t, qb in enumerate(q_blocks.tolist()):
        forced[:, t, [0] + list(range(max(0, qb - 32), qb + 1))] = float("inf")
    idx = naive_select_topk(forced, q_blocks)
    check_topk_contract(idx, q_blocks, out_len, 96)
    assert idx[0, 0].tolist() == [0] + [-1] * 95


def test_q_block_idx():
    cu = make_cu([100, 200])
    plain = q_block_idx_prefill(cu, 200)
    quirk = q_block_idx_prefill(cu, 200, varlen_offset_quirk=True)
    assert plain.dtype == torch.int32 and plain.tolist() == [r // 64 for r in range(100)] + [r // 64 for r in range(200)]
    assert quirk.tolist() == [(r + 100) // 64 for r in range(100)] + [r // 64 for r in range(200)]
    chunked = q_block_idx_prefill(cu, 200, cache_lens=[64, 1])
    assert chunked.tolist() == [(r + 64) // 64 for r in range(100)] + [(r + 1) // 64 for r in range(200)]
    assert q_block_idx_decode(torch.tensor([0, 63, 64, 4095])).tolist() == [0, 0, 1, 63]


def test_stage1_select_is_the_chain():
    lengths = [700, 300]
    q, ck1, ck2, cu, cu1, cu2 = make_inputs(lengths, 4, 2)
    idx = naive_stage1_select(q, ck1, ck2, cu, cu1, cu2, 700, topk=4, local_blocks=2)
    sc = naive_stage1_scores(q, ck1, ck2, cu, cu1, cu2, 700)
    bs = naive_pool_blocks(sc, cu, cu1, None, 700, local_blocks=2)
    assert torch.equal(idx, naive_select_topk(bs, q_block_idx_prefill(cu, 700), 4, 2))


def _stage1_args():
    q, ck1, ck2, cu, cu1, cu2 = make_inputs([300, 200], 4, 2)
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


@pytest.mark.parametrize("name,exc,corrupt", BAD_STAGE1, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD_STAGE1)])
def test_stage1_scores_rejects_bad_inputs(name, exc, corrupt):
    args = _stage1_args()
    args[name] = corrupt(args)
    with pytest.raises(exc, match=rf"\b{name}\b"):
        naive_stage1_scores(**args)


def test_pool_and_topk_reject_bad_inputs():
    cu, cu1 = make_cu([100]), make_cu([5])
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
