r"""Synthetic token-level selections for the stage-2 benchmark, and what each anchor needs from them.

Every generator returns InfLLM-v2's `topk_idx`: int32 `[H, B*T, K]` for `B` packed sequences of `T`
tokens, block indices (64 keys each) local to the sequence, ascending, `-1` only as tail padding
(a token in block `qb` has just `qb + 1` causal blocks). Block 0 and the token's own (diagonal)
block are always selected; nothing lies in the future. Example, `T = 256`, `K = 3`, one head:

    token  0..63    -> [0, -1, -1]      (only block 0 is causal)
    token 64..127   -> [0,  1, -1]
    token 128..191  -> [0,  x,  2]      (x = a random earlier pick, here 1)
    token 192..255  -> [0,  x,  3]      (x in {1, 2})

All work is vectorized torch (random scores, forced blocks at +inf, non-causal at -inf, `topk`),
chunked over tokens so that no `[total_q, n_blocks]` tensor is built at full size.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ._rules import KV_BLOCK

_BIG = 1 << 30
_CHUNK_ELEMS = 1 << 25


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _generator(seed: int, device: torch.device | str) -> torch.Generator:
    g = torch.Generator(device=torch.device(device))
    g.manual_seed(seed)
    return g


def _token_steps(total: int, per_token: int, chunk_elems: int):
    step = max(1, chunk_elems // max(1, per_token))
    for t0 in range(0, total, step):
        yield t0, min(total, t0 + step)


def _causal_scores(u: torch.Tensor, qb: torch.Tensor, forced: torch.Tensor) -> torch.Tensor:
    """`u` `[..., NB]` random scores; +inf where `forced`, -inf past the query block `qb` `[..., 1]`."""
    j = torch.arange(u.shape[-1], device=u.device)
    return torch.where(forced, math.inf, torch.where(j <= qb, u, -math.inf))


def _topk_sorted(scores: torch.Tensor, K: int) -> torch.Tensor:
    """Top-`K` block indices of `scores` `[..., NB]`, ascending, `-inf` picks turned into a `-1` tail."""
    k = min(K, scores.shape[-1])
    vals, idx = scores.topk(k, dim=-1, sorted=False)
    idx = torch.where(vals == -math.inf, _BIG, idx).sort(dim=-1).values
    idx = torch.where(idx == _BIG, -1, idx).to(torch.int32)
    if k < K:
        idx = torch.cat([idx, idx.new_full((*idx.shape[:-1], K - k), -1)], dim=-1)
    return idx


def split_blocks(idx: torch.Tensor, factor: int) -> torch.Tensor:
    """Indices of blocks `factor` times larger -> the `factor` sub-blocks of each (`-1` stays a tail)."""
    sub = idx.unsqueeze(-1).long() * factor + torch.arange(factor, device=idx.device)
    sub = torch.where(idx.unsqueeze(-1) < 0, -1, sub)
    return sub.flatten(-2).to(torch.int32)


def block_shared(B: int, T: int, H: int, K: int, *, block_size: int = KV_BLOCK, device="cpu",
                 seed: int = 0) -> torch.Tensor:
    """Selection (a): one random causal selection per `block_size`-token query block (block 0 +
    diagonal + random earlier blocks), shared by all its tokens. Indices are in `block_size` units."""
    nb = _cdiv(T, block_size)
    g = _generator(seed, device)
    qb = torch.arange(nb, device=device).unsqueeze(-1)
    j = torch.arange(nb, device=device)
    forced = (j == 0) | (j == qb)
    u = torch.rand(H, B, nb, nb, generator=g, device=device)
    sel = _topk_sorted(_causal_scores(u, qb, forced), K)              # [H, B, NQB, K]
    tok_qb = torch.arange(T, device=device) // block_size
    return sel[:, :, tok_qb].reshape(H, B * T, K).contiguous()


def per_token(B: int, T: int, H: int, K: int, *, block_size: int = KV_BLOCK, device="cpu", seed: int = 0,
              chunk_elems: int = _CHUNK_ELEMS) -> torch.Tensor:
    """Selection (b): every token draws its own block 0 + diagonal + random earlier blocks."""
    nb = _cdiv(T, block_size)
    g = _generator(seed, device)
    j = torch.arange(nb, device=device)
    out = torch.empty(H, B * T, K, dtype=torch.int32, device=device)
    for t0, t1 in _token_steps(B * T, H * nb, chunk_elems):
        qb = ((torch.arange(t0, t1, device=device) % T) // block_size).unsqueeze(-1)   # [n, 1]
        u = torch.rand(H, t1 - t0, nb, generator=g, device=device)
        out[:, t0:t1] = _topk_sorted(_causal_scores(u, qb, (j == 0) | (j == qb)), K)
    return out


def infllm_forced(nb: int, local_blocks: int = 33, device="cpu") -> torch.Tensor:
    """bool `[NQB, NB]`: InfLLM-v2's forced blocks of query block `qb`: block 0 and
    `[qb - local_blocks + 1, qb]`."""
    qb = torch.arange(nb, device=device).unsqueeze(-1)
    j = torch.arange(nb, device=device)
    return (j == 0) | ((j <= qb) & (j > qb - local_blocks))


def infllm_like(B: int, T: int, H: int, K: int, *, block_size: int = KV_BLOCK, local_blocks: int = 33,
                redraw: float = 0.1, device="cpu", seed: int = 0, chunk_elems: int = _CHUNK_ELEMS,
                return_block_picks: bool = False):
    """Selection (c), InfLLM-like: per query block, block 0 + the `local_blocks` blocks ending at the
    diagonal (forced) + random earlier picks up to `K`; then every token keeps each non-forced pick of its
    block with probability `1 - redraw` and replaces the dropped ones by random causal blocks its query
    block did not pick (dropped picks come back only when no such block is left). Forced blocks are
    never redrawn. Needs `K >= local_blocks + 1` for all forced blocks to fit.

    With `return_block_picks`, also returns the per-query-block picks `[H, B, NQB, K]`.
    """
    nb = _cdiv(T, block_size)
    g = _generator(seed, device)
    j = torch.arange(nb, device=device)
    qb_all = torch.arange(nb, device=device).unsqueeze(-1)
    forced_blk = infllm_forced(nb, local_blocks, device)                              # [NQB, NB]
    u = torch.rand(H, B, nb, nb, generator=g, device=device)
    blk = _topk_sorted(_causal_scores(u, qb_all, forced_blk), K)                      # [H, B, NQB, K]
    del u
    member = torch.zeros(H, B, nb, nb + 1, dtype=torch.bool, device=device)
    member.scatter_(-1, torch.where(blk < 0, nb, blk).long(), True)
    member = member[..., :nb]                                                         # [H, B, NQB, NB]

    out = torch.empty(H, B * T, K, dtype=torch.int32, device=device)
    for t0, t1 in _token_steps(B * T, 4 * H * nb, chunk_elems):
        t = torch.arange(t0, t1, device=device)
        b, qb = t // T, (t % T) // block_size
        inblk = member[:, b, qb]                                                      # [H, n, NB]
        causal = j <= qb.unsqueeze(-1)                                                # [n, NB]
        r = torch.rand(H, t1 - t0, nb, generator=g, device=device)
        # kept picks (r >= redraw) score in [2, 3); fresh causal candidates [0, 1); dropped picks [-2, -1)
        score = torch.where(causal & ~inblk, r, -math.inf)
        score = torch.where(inblk, torch.where(r < redraw, r - 2.0, r + 2.0), score)
        score = torch.where(forced_blk[qb], math.inf, score)
        out[:, t0:t1] = _topk_sorted(score, K)
    return (out, blk) if return_block_picks else out


SELECTIONS = {"a": block_shared, "b": per_token, "c": infllm_like}
SELECTION_NAMES = {"a": "block-shared", "b": "per-token", "c": "infllm-like"}


def make_selection(name: str, B: int, T: int, H: int, K: int, *, device="cpu", seed: int = 0) -> torch.Tensor:
    """`topk_idx` int32 `[H, B*T, K]` for selection `name` in {"a", "b", "c"} (see the generators)."""
    return SELECTIONS[name](B, T, H, K, device=device, seed=seed)


def uniform_cu_seqlens(B: int, T: int, device="cpu") -> torch.Tensor:
    return (torch.arange(B + 1, device=device) * T).to(torch.int32)


def _token_positions(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    cu = cu_seqlens.long()
    lens = cu[1:] - cu[:-1]
    seq = torch.repeat_interleave(torch.arange(lens.numel(), device=cu.device), lens, output_size=total)
    return torch.arange(total, device=cu.device) - cu[seq]


def attended_keys(topk_idx: torch.Tensor, cu_seqlens: torch.Tensor, *, block_size: int = KV_BLOCK,
                  chunk_elems: int = _CHUNK_ELEMS) -> torch.Tensor:
    """int64 `[H, total_q]`: keys each (KV head, query token) attends under stage 2's semantics:
    duplicates counted once, negative and future blocks ignored, the diagonal block clipped at the
    query (its last partial block too). FLOP = 4 * D * G * result.sum()."""
    H, total, K = topk_idx.shape
    pos_all = _token_positions(cu_seqlens.to(topk_idx.device), total)
    out = torch.empty(H, total, dtype=torch.int64, device=topk_idx.device)
    for t0, t1 in _token_steps(total, 4 * H * K, chunk_elems):
        pos = pos_all[t0:t1]
        qb = (pos // block_size).view(1, -1, 1)
        idx = topk_idx[:, t0:t1].long()
        s = torch.where((idx >= 0) & (idx <= qb), idx, _BIG).sort(dim=-1).values
        uniq = s != _BIG
        uniq[..., 1:] &= s[..., 1:] != s[..., :-1]
        n_full = (uniq & (s < qb)).sum(-1)
        diag = (uniq & (s == qb)).any(-1)
        out[:, t0:t1] = n_full * block_size + diag * (pos % block_size + 1)
    return out


class FlexBlocks(NamedTuple):
    """`BlockMask.from_kv_blocks` inputs covering a token-level selection at `flex_block` granularity.

    `kv_*` hold the diagonal (partial, causal mask_mod applied) tile of each query tile, `full_kv_*` the
    tiles strictly below it (no mask_mod needed); shapes `[B, HQ, NQ]` and `[B, HQ, NQ, NK]`, int32.
    `union` is bool `[B, H, NQ, NK]`; `keys` = sum over (query token, query head) of the causal keys
    FlexAttention computes with it (the FLOP it does = 4 * D * keys)."""
    kv_num_blocks: torch.Tensor
    kv_indices: torch.Tensor
    full_kv_num_blocks: torch.Tensor
    full_kv_indices: torch.Tensor
    union: torch.Tensor
    keys: int


def _ordered(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    nk = mask.shape[-1]
    ar = torch.arange(nk, device=mask.device)
    idx = torch.where(mask, ar, nk).sort(dim=-1).values
    return mask.sum(-1, dtype=torch.int32), torch.where(idx == nk, 0, idx).to(torch.int32)


def to_flex_block_mask_inputs(topk_idx: torch.Tensor, B: int, T: int, HQ: int, *, block_size: int = KV_BLOCK,
                              flex_block: int = 128, chunk_elems: int = _CHUNK_ELEMS) -> FlexBlocks:
    r"""The tiles FlexAttention must visit to cover `topk_idx`: per `flex_block`-token query tile and KV
    head, the union of its tokens' valid blocks, as `flex_block`-key tiles, repeated over the `G` query
    heads of the KV head. For selection (a) this is the union over the two 64-token query blocks of a
    128-token tile; for (b) and (c) the union over 128 tokens' own picks. It computes a superset of the
    selected keys, so its output is not ours: it is the least work an exact FlexAttention version does.
    """
    H, total, K = topk_idx.shape
    if flex_block % block_size or total != B * T or HQ % H:
        raise ValueError(f"need flex_block % block_size == 0, total == B*T, HQ % H == 0; got "
                         f"{flex_block}, {block_size}, {total} vs {B}x{T}, {HQ}, {H}")
    f, G = flex_block // block_size, HQ // H
    nq = nk = _cdiv(T, flex_block)
    dev = topk_idx.device
    flat_mask = torch.zeros(B * H * nq * nk, dtype=torch.bool, device=dev)
    h = torch.arange(H, device=dev).view(H, 1, 1)
    for t0, t1 in _token_steps(total, 6 * H * K, chunk_elems):
        t = torch.arange(t0, t1, device=dev)
        b, pos = (t // T).view(1, -1, 1), (t % T).view(1, -1, 1)
        idx = topk_idx[:, t0:t1].long()
        valid = (idx >= 0) & (idx <= pos // block_size)
        flat = ((b * H + h) * nq + pos // flex_block) * nk + idx // f
        flat_mask[flat[valid]] = True
    union = flat_mask.view(B, H, nq, nk)
    i = torch.arange(nq, device=dev).view(-1, 1)
    jj = torch.arange(nk, device=dev).view(1, -1)
    full, part = union & (jj < i), union & (jj == i)
    ntok = (T - i.view(-1) * flex_block).clamp(max=flex_block)                       # tokens per q tile
    keys = G * int((full.sum(-1) * flex_block * ntok + part.any(-1) * (ntok * (ntok + 1) // 2)).sum())
    num, ind = _ordered(part)
    fnum, find = _ordered(full)
    def rep(x):
        return x.repeat_interleave(G, dim=1).contiguous()
    return FlexBlocks(rep(num), rep(ind), rep(fnum), rep(find), union, keys)


def to_nsa_block_indices(topk_idx: torch.Tensor, B: int, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fla NSA's `parallel_nsa` inputs: `block_indices` int64 `[B, T, H, K]` (same ascending rows, `-1`
    tail; NSA skips negative and future blocks) and `block_counts` int64 `[B, T, H]` (valid prefix length)."""
    H, _total, K = topk_idx.shape
    bi = topk_idx.permute(1, 0, 2).reshape(B, T, H, K)
    return bi.to(torch.int64).contiguous(), (bi >= 0).sum(-1).contiguous()
