"""Stage-2 reference (block-sparse varlen attention) against dense attention, SDPA and explicit masks (CPU)."""
import pytest
import torch
import torch.nn.functional as F

from infllm_cupy.stage2 import naive as s2
from infllm_cupy.stage2.naive import naive_dense_attn_varlen, naive_sparse_attn_varlen

HEADS = [(2, 2), (4, 2), (16, 1)]
LENGTHS = [1, 97, 200, 64, 130]          # a 1-token sequence, lengths that are not multiples of 64


def make_cu(lengths):
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    return cu


def make_qkv(lq, lk, HQ, H, D=32, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lq), HQ, D, generator=g).to(dtype)
    k = torch.randn(sum(lk), H, D, generator=g).to(dtype)
    v = torch.randn(sum(lk), H, D, generator=g).to(dtype)
    return q, k, v


def all_blocks(H, T, n_blocks):
    return torch.arange(n_blocks, dtype=torch.int32).expand(H, T, n_blocks).contiguous()


def random_selection(lq, lk, H, K, bs, seed=0):
    """Random causal-valid block indices (<= the query's block), sorted, -1 tail padded."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for Lq, Lk in zip(lq, lk):
        for r in range(Lq):
            qb = (r + Lk - Lq) // bs
            for _ in range(H):
                pick = sorted(torch.randperm(max(qb + 1, 1), generator=g)[:K].tolist()) if qb >= 0 else []
                rows.append(pick + [-1] * (K - len(pick)))
    T = sum(lq)
    return torch.tensor(rows, dtype=torch.int32).view(T, H, K).permute(1, 0, 2).contiguous()


def mask_reference(q, k, v, lq, lk, topk_idx, bs, causal=True):
    """Explicit per-token masked softmax in fp64; returns out and lse (+inf on empty rows)."""
    HQ, H, D = q.shape[1], k.shape[1], q.shape[2]
    G = HQ // H
    out = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.full((HQ, q.shape[0]), float("inf"), dtype=torch.float64)
    qs = ks = 0
    for Lq, Lk in zip(lq, lk):
        nb = -(-Lk // bs)
        kk, vv = k[ks:ks + Lk].double(), v[ks:ks + Lk].double()
        for r in range(Lq):
            allowed = torch.zeros(H, Lk, dtype=torch.bool)
            for h in range(H):
                for b in topk_idx[h, qs + r].tolist():
                    if 0 <= b < nb:
                        allowed[h, b * bs:(b + 1) * bs] = True
            if causal:
                allowed[:, max(0, r + Lk - Lq + 1):] = False
            allowed = allowed.repeat_interleave(G, 0)                      # [HQ, Lk]
            s = torch.einsum("hd,jhd->hj", q[qs + r].double(), kk.repeat_interleave(G, 1)) * D ** -0.5
            s = s.masked_fill(~allowed, float("-inf"))
            rows = allowed.any(-1)
            lse[rows, qs + r] = torch.logsumexp(s[rows], -1)
            out[qs + r, rows] = torch.einsum("hj,jhd->hd", torch.softmax(s[rows], -1),
                                             vv.repeat_interleave(G, 1)[:, rows])
        qs, ks = qs + Lq, ks + Lk
    return out, lse


def sdpa_varlen(q, k, v, lq, lk, causal=True):
    outs, qs, ks = [], 0, 0
    for Lq, Lk in zip(lq, lk):
        qq, kk, vv = (x.transpose(0, 1) for x in (q[qs:qs + Lq], k[ks:ks + Lk], v[ks:ks + Lk]))
        mask = None
        if causal:
            mask = torch.arange(Lk)[None, :] <= torch.arange(Lq)[:, None] + Lk - Lq
        outs.append(F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, enable_gqa=True).transpose(0, 1))
        qs, ks = qs + Lq, ks + Lk
    return torch.cat(outs)


@pytest.mark.parametrize("HQ,H", HEADS, ids=lambda x: str(x))
def test_all_blocks_equals_dense_and_sdpa(HQ, H):
    q, k, v = make_qkv(LENGTHS, LENGTHS, HQ, H)
    cu, T = make_cu(LENGTHS), sum(LENGTHS)
    idx = all_blocks(H, T, 4)
    out, lse = naive_sparse_attn_varlen(q, k, v, cu, cu, idx, 200, 200, return_lse=True)
    dense, dense_lse = naive_dense_attn_varlen(q, k, v, cu, cu, return_lse=True)
    torch.testing.assert_close(out, dense, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse, dense_lse, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out, sdpa_varlen(q, k, v, LENGTHS, LENGTHS), atol=2e-6, rtol=2e-5)
    torch.testing.assert_close(naive_dense_attn_varlen(q, k, v, cu, cu, causal=False),
                               sdpa_varlen(q, k, v, LENGTHS, LENGTHS, causal=False), atol=2e-6, rtol=2e-5)


def test_bf16_output_and_low_precision_twin():
    q, k, v = make_qkv(LENGTHS, LENGTHS, 4, 2, dtype=torch.bfloat16)
    cu = make_cu(LENGTHS)
    idx = random_selection(LENGTHS, LENGTHS, 2, 3, 64)
    ref = naive_sparse_attn_varlen(q.double(), k.double(), v.double(), cu, cu, idx, 200, 200)
    out = naive_sparse_attn_varlen(q, k, v, cu, cu, idx, 200, 200)
    lowp = naive_sparse_attn_varlen(q, k, v, cu, cu, idx, 200, 200, upcast=False)
    assert out.dtype == lowp.dtype == torch.bfloat16
    err, err_lowp = (out.double() - ref).abs().max().item(), (lowp.double() - ref).abs().max().item()
    # upcast output only carries the final bf16 rounding; the twin also rounds q.k and p
    assert 0 < err <= 2 ** -8 * ref.abs().max().item()
    assert err < err_lowp < 0.05


@pytest.mark.parametrize("HQ,H", HEADS, ids=lambda x: str(x))
def test_random_selection_matches_explicit_mask(HQ, H):
    lq = lk = LENGTHS
    q, k, v = make_qkv(lq, lk, HQ, H)
    cu = make_cu(lq)
    idx = random_selection(lq, lk, H, 2, 64)
    out, lse = naive_sparse_attn_varlen(q, k, v, cu, cu, idx, 200, 200, return_lse=True)
    want, want_lse = mask_reference(q, k, v, lq, lk, idx, 64)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)
    assert lse.dtype == torch.float32 and lse.shape == (HQ, sum(lq))


def test_junk_indices_are_ignored():
    lq = lk = [300, 130, 1]
    q, k, v = make_qkv(lq, lk, 4, 2)
    cu, T = make_cu(lq), sum(lq)
    clean = random_selection(lq, lk, 2, 3, 64)
    nb = torch.tensor([5] * 300 + [3] * 130 + [1])                      # blocks of each token's sequence
    qb = torch.cat([torch.arange(L) // 64 for L in lq])                 # each token's own block
    junk = torch.stack([
        torch.full((T,), -1), torch.full((T,), -7), torch.full((T,), -2 ** 31),   # negative
        nb, nb + 3, torch.full((T,), 10 ** 6),                                     # >= own block count
        qb + 1,                                                                    # future (or past the end)
        torch.zeros(T, dtype=torch.int64),                                         # duplicate of block 0
    ], dim=-1).to(torch.int32).expand(2, T, 8)
    dirty = torch.cat([junk[..., :4], clean, junk[..., 4:], clean], dim=-1)        # unsorted, duplicated
    # block 0 is a real selection: put it into the clean set so the duplicate changes nothing
    clean0 = torch.cat([clean, torch.zeros(2, T, 1, dtype=torch.int32)], dim=-1)
    # future blocks are only harmless under the causal mask, so these are causal runs
    a, la = naive_sparse_attn_varlen(q, k, v, cu, cu, clean0, 300, 300, return_lse=True)
    b, lb = naive_sparse_attn_varlen(q, k, v, cu, cu, dirty, 300, 300, return_lse=True)
    assert torch.equal(a, b) and torch.equal(la, lb)


def test_empty_rows_give_zero_and_inf_lse():
    lq = lk = [100, 70]
    q, k, v = make_qkv(lq, lk, 4, 2)
    cu = make_cu(lq)
    idx = all_blocks(2, 170, 2)
    idx[0, 5] = -1                                                    # kv head 0 of token 5 selects nothing
    idx[:, 150] = torch.tensor([5, -3], dtype=torch.int32)            # out of range for a 70-token sequence
    idx[:, 120] = torch.tensor([1, 1], dtype=torch.int32)             # row 20 of seq 1 is in block 0: future only
    out, lse = naive_sparse_attn_varlen(q, k, v, cu, cu, idx, 100, 100, return_lse=True)
    empty = [(0, 5), (1, 5), (0, 150), (1, 150), (2, 150), (3, 150), (0, 120), (1, 120), (2, 120), (3, 120)]
    for hq, t in empty:
        assert bool((out[t, hq] == 0).all()) and lse[hq, t].item() == float("inf")
    assert bool(torch.isfinite(lse[2:, 5]).all()) and not bool(torch.isnan(out).any())


def test_bottom_right_alignment_q_shorter_and_longer_than_k():
    lq, lk = [5, 64, 3, 40], [300, 130, 3, 20]                        # chunked prefill, and Lq > Lk
    q, k, v = make_qkv(lq, lk, 4, 2)
    cuq, cuk = make_cu(lq), make_cu(lk)
    idx = all_blocks(2, sum(lq), 5)
    out, lse = naive_sparse_attn_varlen(q, k, v, cuq, cuk, idx, 64, 300, return_lse=True)
    want, want_lse = mask_reference(q, k, v, lq, lk, idx, 64)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, sdpa_varlen(q, k, v, lq, lk).nan_to_num(0.0), atol=2e-6, rtol=2e-5)
    # Lq > Lk: the first Lq - Lk rows see no key at all
    assert bool((out[72:72 + 20] == 0).all()) and bool(torch.isinf(lse[:, 72:72 + 20]).all())
    sparse = random_selection(lq, lk, 2, 2, 64)
    out = naive_sparse_attn_varlen(q, k, v, cuq, cuk, sparse, 64, 300)
    torch.testing.assert_close(out.double(), mask_reference(q, k, v, lq, lk, sparse, 64)[0], atol=1e-5, rtol=1e-5)


def test_non_causal_uses_every_selected_block():
    lq, lk = [1, 1], [200, 65]                                         # decode: one query per sequence
    q, k, v = make_qkv(lq, lk, 4, 2)
    idx = torch.tensor([[[0, 3, -1]] * 2] * 2, dtype=torch.int32)
    out = naive_sparse_attn_varlen(q, k, v, make_cu(lq), make_cu(lk), idx, 1, 200, causal=False)
    want = mask_reference(q, k, v, lq, lk, idx, 64, causal=False)[0]
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


def test_query_chunking_does_not_change_output(monkeypatch):
    q, k, v = make_qkv(LENGTHS, LENGTHS, 4, 2)
    cu = make_cu(LENGTHS)
    idx = random_selection(LENGTHS, LENGTHS, 2, 2, 64)
    ref = naive_sparse_attn_varlen(q, k, v, cu, cu, idx, 200, 200)
    monkeypatch.setattr(s2, "_CHUNK_ELEMS", 1)                        # 16-row chunks
    torch.testing.assert_close(naive_sparse_attn_varlen(q, k, v, cu, cu, idx, 200, 200), ref, atol=1e-6, rtol=1e-6)


def test_gradcheck_float64():
    lq, lk = [6, 3], [9, 3]
    q, k, v = (x.requires_grad_() for x in make_qkv(lq, lk, 4, 2, D=4, dtype=torch.float64))
    idx = torch.tensor([[[0, -1], [1, 2]] * 4 + [[0, 0]]] * 2, dtype=torch.int32)[:, :9]
    idx[1, 2] = -1                                                    # one empty row (its gradient is 0)
    cuq, cuk = make_cu(lq), make_cu(lk)

    def f(q, k, v):
        return naive_sparse_attn_varlen(q, k, v, cuq, cuk, idx, 6, 9, block_size=4)

    assert torch.autograd.gradcheck(f, (q, k, v), fast_mode=True)


def test_gradients_match_sdpa():
    q, k, v = (x.requires_grad_() for x in make_qkv(LENGTHS, LENGTHS, 4, 2, dtype=torch.float64))
    cu, T = make_cu(LENGTHS), sum(LENGTHS)
    do = torch.randn(T, 4, 32, dtype=torch.float64)
    out = naive_sparse_attn_varlen(q, k, v, cu, cu, all_blocks(2, T, 4), 200, 200)
    ref = sdpa_varlen(q, k, v, LENGTHS, LENGTHS)
    for g, r in zip(torch.autograd.grad(out, (q, k, v), do), torch.autograd.grad(ref, (q, k, v), do)):
        torch.testing.assert_close(g, r, atol=1e-10, rtol=1e-8)


def _args():
    q, k, v = make_qkv([100, 30], [100, 30], 4, 2)
    cu = make_cu([100, 30])
    return {"q": q, "k": k, "v": v, "cu_seqlens_q": cu, "cu_seqlens_k": cu, "topk_idx": all_blocks(2, 130, 2),
            "max_seqlen_q": 100, "max_seqlen_k": 100}


BAD = [
    ("q", TypeError, lambda a: a["q"].long()),
    ("q", ValueError, lambda a: a["q"][None]),
    ("k", TypeError, lambda a: a["k"].half()),
    ("v", ValueError, lambda a: a["v"][..., :8]),
    ("k", ValueError, lambda a: a["k"][:, :1].expand(130, 3, 32)),   # 4 query heads over 3 kv heads
    ("cu_seqlens_q", TypeError, lambda a: a["cu_seqlens_q"].long()),
    ("cu_seqlens_k", ValueError, lambda a: torch.tensor([0, 100], dtype=torch.int32)),
    ("topk_idx", TypeError, lambda a: a["topk_idx"].long()),
    ("topk_idx", ValueError, lambda a: a["topk_idx"][:1]),
    ("topk_idx", ValueError, lambda a: a["topk_idx"][0]),
    ("max_seqlen_q", ValueError, lambda a: 99),
    ("max_seqlen_k", TypeError, lambda a: 100.0),
]


@pytest.mark.parametrize("name,exc,corrupt", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_rejects_bad_inputs(name, exc, corrupt):
    args = _args()
    args[name] = corrupt(args)
    with pytest.raises(exc, match=rf"\b{name}\b"):
        naive_sparse_attn_varlen(**args)


def test_dense_rejects_bad_inputs():
    a = _args()
    with pytest.raises(ValueError, match="cu_seqlens_k"):
        naive_dense_attn_varlen(a["q"], a["k"], a["v"], a["cu_seqlens_q"], make_cu([100, 20, 10]))
