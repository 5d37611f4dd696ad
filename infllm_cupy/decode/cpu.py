"""Decode attention on CPU tensors over the selected blocks only (the CPU implementation of the step's
attention; `naive_sparse_decode` stays the oracle it is tested against).

Per sequence, the keys and values of the blocks each KV head selected are gathered (a contiguous slice
for a dense step on a contiguous cache), converted to fp32 (float64 for float64 inputs) and attended by
the head's G query heads in two batched GEMMs. The work and the memory grow with the selection
(K blocks x 64 keys per KV head), not with the cache: the reference converts and masks every cached
key, so a 32k cache costs it ~500x the selected work at K = 12. Semantics are the reference's: entries
that are negative or `>= cdiv(L_b, block_size)` are ignored, duplicates count once, a head with nothing
selected gives `out = 0` and `lse = +inf`, and the weights are the softmax over every cached position,
0 where not selected.
"""
from __future__ import annotations

import dataclasses

import torch

from .._dtypes import compute_dtype
from .._rules import KV_BLOCK, cdiv


@dataclasses.dataclass(frozen=True)
class Fp8Pages:
    """K or V of an FP8 cache (docs/decode.md §16) as the CPU step reads it: only the gathered rows are
    dequantized, so a step costs the selection, not the cache (`DecodeCache.dequantized` reads every
    page). `data`: e4m3 `[rows, S, H, D]`; `scale`: K's `[rows, ceil(S / 64), H, D]` (per channel of
    each 64-token page) or V's `[rows, S, H]`; `open_`: the open page's buffer in the query's dtype
    (`k_recent`, slot `t % 128`, or `v_open`, slot `t % 64`); `is_k`: which of the two."""

    data: torch.Tensor
    scale: torch.Tensor
    open_: torch.Tensor
    is_k: bool

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def rows(self, b: int, t: torch.Tensor, heads: torch.Tensor, row: torch.Tensor, slot: torch.Tensor,
             L: int) -> torch.Tensor:
        """Positions `t [H, S]` of sequence b (storage `row`, `slot`), heads `[H, 1]`, in the query's
        dtype: `(e4m3 as fp32) * scale` rounded once, as `fp8.dequantize_*` and the kernels read them;
        positions of the open page (at or past `L - L % 64`) from its buffer."""
        x = self.data[row, slot, heads].float()                              # [H, S, D]
        if self.is_k:
            x = x * self.scale[row, slot // KV_BLOCK, heads]
        else:
            x = x * self.scale[row, slot, heads][..., None]
        x = x.to(self.open_.dtype)
        buf = self.open_[b, t % self.open_.shape[1], heads]
        return torch.where((t >= L - L % KV_BLOCK)[..., None], buf, x)


def _selected_positions(ids: torch.Tensor, L: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Cache positions `[H, S]` of the blocks in `ids [H, K]` (one sequence) and which of them count
    (`[H, S]` bool): blocks out of range or repeated, and positions at or past `L`, do not."""
    nb = cdiv(L, block_size)
    ids = torch.where((ids >= 0) & (ids < nb), ids, torch.full_like(ids, nb))
    ids = torch.sort(ids, dim=1).values                      # repeats side by side, unusable ones last
    keep = ids < nb
    keep[:, 1:] &= ids[:, 1:] != ids[:, :-1]
    pos = ids[:, :, None] * block_size + torch.arange(block_size, dtype=ids.dtype)   # [H, K, bs]
    ok = keep[:, :, None] & (pos < L)
    return torch.where(ok, pos, torch.zeros_like(pos)).flatten(1), ok.flatten(1)


def _gather(cache: torch.Tensor | Fp8Pages, b: int, bt: torch.Tensor | None, pos: torch.Tensor | None,
            L: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows of sequence b's cache as `[H, S, D]` in `dtype`: positions `pos [H, S]` per KV head, or
    `0 .. L-1` for every head when `pos` is None."""
    H = cache.shape[2]
    if isinstance(cache, Fp8Pages):
        t = torch.arange(L).expand(H, L) if pos is None else pos
        heads = torch.arange(H)[:, None]
        if bt is None:
            row, slot = torch.full_like(t, b), t
        else:
            ps = cache.shape[1]
            row, slot = bt[b].long()[t // ps], t % ps
        return cache.rows(b, t, heads, row, slot, L).to(dtype)
    if pos is None:
        if bt is None:
            return cache[b, :L].transpose(0, 1).to(dtype)
        t = torch.arange(L)
        ps = cache.shape[1]
        return cache[bt[b, t // ps].long(), t % ps].transpose(0, 1).to(dtype)
    heads = torch.arange(H)[:, None]
    if bt is None:
        return cache[b][pos, heads].to(dtype)
    ps = cache.shape[1]
    return cache[bt[b].long()[pos // ps], pos % ps, heads].to(dtype)


def cpu_sparse_decode(q, k, v, seqlens, bt, width: int, topk_idx, *, scale: float, block_size: int,
                      return_lse: bool, return_attn_weights: bool, weights: str,
                      host_lens: list[int] | None = None):
    """`sparse_decode_checked` (the reference on checked inputs) over the selected blocks only: the same
    arguments and results; `k` and `v` may also be an FP8 cache's `Fp8Pages`. `host_lens`: the lengths
    where the caller knows them (else read from `seqlens`)."""
    B, HQ, D = q.shape
    H = k.shape[2]
    G = HQ // H
    cdt = compute_dtype(q.dtype)
    lens = host_lens if host_lens is not None else [int(x) for x in seqlens.tolist()]
    out = torch.zeros(B, HQ, D, dtype=q.dtype)
    lse = torch.full((B, HQ), float("inf"), dtype=torch.float32)
    w = torch.zeros(B, H, G, width, dtype=torch.float32) if return_attn_weights else None
    for b, L in enumerate(lens):
        if L <= 0:
            continue
        if L > width:
            raise ValueError(f"seqlens: sequence {b} has {L} keys, more than the cache's width {width}")
        pos = ok = None
        if topk_idx is not None:
            pos, ok = _selected_positions(topk_idx[:, b].long(), L, block_size)
        kb, vb = _gather(k, b, bt, pos, L, cdt), _gather(v, b, bt, pos, L, cdt)     # [H, S, D]
        s = torch.bmm(q[b].reshape(H, G, D).to(cdt), kb.transpose(1, 2)).mul_(scale)  # [H, G, S]
        if ok is not None:
            s.masked_fill_(~ok[:, None], float("-inf"))
        m = s.amax(-1, keepdim=True)
        has = torch.isfinite(m)                              # False: nothing selected (all -inf)
        m = torch.where(has, m, torch.zeros_like(m))
        p = torch.exp(s - m)
        denom = p.sum(-1, keepdim=True)
        p = p / torch.where(has, denom, torch.ones_like(denom))
        out[b] = torch.bmm(p, vb).reshape(HQ, D).to(q.dtype)
        lse[b] = torch.where(has, m + torch.log(denom), torch.full_like(m, float("inf"))).reshape(HQ).float()
        if w is not None:
            if pos is None:
                w[b, :, :, :L] = p.float()
            else:                                            # positions that do not count add 0
                w[b].scatter_add_(2, pos[:, None].expand(H, G, -1), p.float())
    res = [out]
    if return_lse:
        res.append(lse)
    if return_attn_weights:
        res.append(w.reshape(B, HQ, width) if weights == "per_head" else w.sum(2))
    return res[0] if len(res) == 1 else tuple(res)
