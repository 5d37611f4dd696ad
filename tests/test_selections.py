"""CPU contracts of the synthetic selections (infllm_cupy/selections.py), their key counting and the
anchors' inputs built from them. The benchmark scripts themselves run in test_benchmarks.py."""
from __future__ import annotations

import pytest
import torch

from infllm_cupy.selections import (
    attended_keys,
    block_shared,
    infllm_forced,
    infllm_like,
    per_token,
    split_blocks,
    to_flex_block_mask_inputs,
    to_nsa_block_indices,
    uniform_cu_seqlens,
)

BS = 64


def check_contract(idx: torch.Tensor, B: int, T: int, K: int):
    """ascending, -1 only as a tail, block 0 and diagonal present, nothing future, all K slots used when
    possible."""
    H = idx.shape[0]
    assert idx.dtype == torch.int32 and idx.shape == (H, B * T, K)
    qb = ((torch.arange(B * T) % T) // BS).view(1, -1, 1)
    valid = idx >= 0
    assert bool((idx[~valid] == -1).all())
    assert bool((valid[..., :-1] | ~valid[..., 1:]).all()), "-1 must only pad the tail"
    both = valid[..., 1:] & valid[..., :-1]
    assert bool((idx[..., 1:] > idx[..., :-1])[both].all()), "valid entries must be strictly ascending"
    assert bool((idx <= qb).all()), "future block selected"
    assert bool((idx == 0).any(-1).all()), "block 0 missing"
    assert bool((idx == qb).any(-1).all()), "diagonal block missing"
    assert torch.equal(valid.sum(-1), torch.clamp(qb[..., 0] + 1, max=K).expand(H, -1))


@pytest.mark.parametrize(("B", "T", "K"), [(2, 1000, 6), (1, 4097, 16), (3, 63, 4), (1, 640, 32)])
def test_block_shared(B, T, K):
    idx = block_shared(B, T, 2, K, seed=1)
    check_contract(idx, B, T, K)
    # one row per 64-token query block, shared by its tokens
    rows = idx.view(2, B, T, K)
    qb = torch.arange(T) // BS
    first = rows[:, :, qb * BS]
    assert torch.equal(rows, first)


@pytest.mark.parametrize(("B", "T", "K"), [(2, 1000, 6), (1, 4097, 16), (3, 63, 4)])
def test_per_token(B, T, K):
    idx = per_token(B, T, 2, K, seed=2, chunk_elems=5000)      # small chunks: exercises the chunk loop
    check_contract(idx, B, T, K)
    if T > 2048:   # tokens of one late query block draw their own picks
        late = idx[:, T - 64:T]
        assert (late != late[:, :1]).any(-1).float().mean() > 0.9


def test_infllm_like():
    B, T, H, K, L, redraw = 2, 8192, 2, 24, 4, 0.1
    idx, blk = infllm_like(B, T, H, K, local_blocks=L, redraw=redraw, seed=3, chunk_elems=1 << 18,
                           return_block_picks=True)
    check_contract(idx, B, T, K)
    nb = T // BS
    forced = infllm_forced(nb, L)                                   # [NQB, NB]
    t = torch.arange(B * T)
    b, qb = t // T, (t % T) // BS
    member = torch.zeros(H, B * T, nb + 1, dtype=torch.bool)
    member.scatter_(-1, torch.where(idx < 0, nb, idx).long(), True)
    member = member[..., :nb]
    assert bool(member[:, forced[qb]].all()), "a forced block is missing"
    blk_member = torch.zeros(H, B, nb, nb + 1, dtype=torch.bool)
    blk_member.scatter_(-1, torch.where(blk < 0, nb, blk).long(), True)
    blk_member = blk_member[:, b, qb, :nb]                         # [H, total, NB]: the block's picks
    nonforced = blk_member & ~forced[qb]
    kept = (member & nonforced).sum(-1).float()
    n_nf = nonforced.sum(-1).float()
    # tokens whose block left enough unselected causal blocks to redraw from
    room = (qb + 1 - K >= K).expand(H, -1) & (n_nf > 0)
    frac = (kept[room] / n_nf[room]).mean().item()
    assert abs(frac - (1 - redraw)) < 0.02, frac
    assert bool((member.sum(-1) == K)[room].all())
    # K = 96 with the real 33-block window: forced blocks are exactly the first 34 of every late row
    idx96 = infllm_like(1, 8192, 1, 96, seed=4)
    check_contract(idx96, 1, 8192, 96)
    r = idx96[0, -1]
    assert set(range(127 - 32, 128)) | {0} <= set(r.tolist())


def brute_keys(topk_idx, cu):
    H, total, _ = topk_idx.shape
    out = torch.zeros(H, total, dtype=torch.int64)
    for s in range(cu.numel() - 1):
        lo, hi = int(cu[s]), int(cu[s + 1])
        L = hi - lo
        for t in range(lo, hi):
            r = t - lo
            for h in range(H):
                blocks = {int(j) for j in topk_idx[h, t] if 0 <= int(j) < -(-L // BS)}
                out[h, t] = sum(1 for j in blocks for key in range(j * BS, min(j * BS + BS, L)) if key <= r)
    return out


def test_attended_keys_brute_force():
    g = torch.Generator().manual_seed(5)
    cu = torch.tensor([0, 100, 357, 1000, 1001], dtype=torch.int32)
    H, K = 2, 7
    # unsorted, duplicates, -1 anywhere, other negatives, future and out-of-range blocks
    idx = torch.randint(-3, 18, (H, 1001, K), generator=g, dtype=torch.int32)
    assert torch.equal(attended_keys(idx, cu, chunk_elems=300), brute_keys(idx, cu))
    sel = per_token(2, 300, H, 4, seed=6)
    cu2 = uniform_cu_seqlens(2, 300)
    assert torch.equal(attended_keys(sel, cu2), brute_keys(sel, cu2))


@pytest.mark.parametrize(("sel", "B", "T", "K"), [("a", 2, 1000, 6), ("b", 1, 1100, 5), ("c", 2, 640, 8)])
def test_flex_union_covers_selection(sel, B, T, K):
    H, HQ = 2, 8
    gen = {"a": block_shared, "b": per_token, "c": lambda *a, **k: infllm_like(*a, local_blocks=3, **k)}[sel]
    idx = gen(B, T, H, K, seed=7)
    fb = to_flex_block_mask_inputs(idx, B, T, HQ, chunk_elems=2000)
    nq = -(-T // 128)
    # brute-force union of each 128-token tile's selected 64-blocks, as 128-blocks
    want = torch.zeros(B, H, nq, nq, dtype=torch.bool)
    for h in range(H):
        for t in range(B * T):
            b, pos = divmod(t, T)
            for j in idx[h, t].tolist():
                if 0 <= j <= pos // BS:
                    want[b, h, pos // 128, j // 2] = True
    assert torch.equal(fb.union, want)
    # ordered inputs reproduce the union, split at the diagonal, repeated over the G query heads
    G = HQ // H
    dense = torch.zeros(B, HQ, nq, nq + 1, dtype=torch.bool)
    for num, ind in ((fb.kv_num_blocks, fb.kv_indices), (fb.full_kv_num_blocks, fb.full_kv_indices)):
        assert num.dtype == ind.dtype == torch.int32 and ind.shape == (B, HQ, nq, nq)
        live = torch.arange(nq) < num.unsqueeze(-1)
        dense |= torch.zeros_like(dense).scatter_(-1, torch.where(live, ind, nq).long(), True)
    assert torch.equal(dense[..., :nq], want.repeat_interleave(G, dim=1))
    assert bool((fb.kv_num_blocks == 1).all()), "every q tile has its diagonal tile (partial)"
    # FLOP keys: 128 per full tile per token, causal keys of the diagonal tile
    n_full = want.sum(-1) - 1                                                   # [B, H, nq]
    keys = 0
    for t in range(T):
        keys += (n_full[..., t // 128] * 128).sum().item() + B * H * (t % 128 + 1)
    assert fb.keys == G * keys
    # every selected block is covered
    qt = (torch.arange(B * T) % T) // 128
    bb = torch.arange(B * T) // T
    for h in range(H):
        valid = (idx[h] >= 0) & (idx[h] <= ((torch.arange(B * T) % T) // BS).unsqueeze(-1))
        rows = fb.union[bb, h, qt]                                              # [total, nq]
        cover = rows.gather(-1, (idx[h].clamp(min=0) // 2).long())
        assert bool(cover[valid].all())


def test_flex_inputs_build_a_block_mask():
    from torch.nn.attention.flex_attention import BlockMask
    B, T, H, HQ, K = 1, 512, 2, 4, 3
    idx = per_token(B, T, H, K, seed=8)
    fb = to_flex_block_mask_inputs(idx, B, T, HQ)
    bm = BlockMask.from_kv_blocks(fb.kv_num_blocks, fb.kv_indices, fb.full_kv_num_blocks, fb.full_kv_indices,
                                  BLOCK_SIZE=(128, 128), mask_mod=lambda b, h, q, kv: q >= kv,
                                  seq_lengths=(T, T))
    assert torch.equal(bm.to_dense().bool(), fb.union.repeat_interleave(HQ // H, dim=1))


def test_same_keys_selection():
    B, T, H, K = 2, 1024, 2, 8
    sel = split_blocks(block_shared(B, T, H, K // 2, block_size=128, seed=9), 2)
    assert sel.shape == (H, B * T, K)
    fb = to_flex_block_mask_inputs(sel, B, T, 4)
    # the tiles Flex visits are exactly the 128-blocks picked (min(K/2, causal) of them per tile)
    assert torch.equal(fb.union.sum(-1), torch.clamp(torch.arange(T // 128) + 1, max=K // 2).expand(B, H, -1))
    assert fb.keys == 2 * int(attended_keys(sel, uniform_cu_seqlens(B, T)).sum())


def test_nsa_inputs():
    B, T, H, K = 2, 300, 2, 5
    idx = per_token(B, T, H, K, seed=10)
    bi, bc = to_nsa_block_indices(idx, B, T)
    assert bi.dtype == bc.dtype == torch.int64 and bi.shape == (B, T, H, K) and bc.shape == (B, T, H)
    assert torch.equal(bi[1, 7, 0], idx[0, T + 7].long())
    assert torch.equal(bc[1, 7, 1], (idx[1, T + 7] >= 0).sum())

