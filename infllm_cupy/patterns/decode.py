"""Decode over a static block pattern through the decode kernel (docs/patterns.md, "Decode").

The current token of sequence b sits at position `L_b - 1` of its cache, so it belongs to query
block `(L_b - 1) // q_block` of the layout; that row's key blocks become the step's `topk_idx` for
`sparse_decode` (docs/decode.md). The rows of a layout, as ascending block lists with -1 padding,
are built once per (layout, device, group size) and cached; a step only gathers one row per
(KV head, sequence) on the device, with no host synchronisation (CUDA-graph capturable as
`sparse_decode` is).
"""
from __future__ import annotations

import weakref

import torch

# the package, not its names: `decode.sparse_decode` is both a function and a module of it
from .. import decode
from .._checks import check_flags, check_head_dim, check_tensor, validate_values
from .._rules import check_backend
from ..decode import DecodeCache, cache_tensors
from ..stage2.layout import BlockLayout
from .local_stride import per_kv_head
from .modules import SparseAttention

# id(mask) -> (weak ref to the mask, {(device, G, H): (rows, q_block, per_query_head)}), rows int32
# [(B,) H', NQB, K]:
# weak so that a dropped layout frees its table, and keyed by identity, not by the tensor (a tensor's
# == is elementwise, and a dead mask's id can be reused)
_TABLES: dict = {}


def _tables_of(mask: torch.Tensor) -> dict:
    key = id(mask)
    entry = _TABLES.get(key)
    if entry is None or entry[0]() is not mask:
        def drop(ref, key=key):
            if _TABLES.get(key, (None,))[0] is ref:
                del _TABLES[key]
        entry = (weakref.ref(mask, drop), {})
        _TABLES[key] = entry
    return entry[1]


def _rows(mask: torch.Tensor) -> torch.Tensor:
    """Each row's selected blocks ascending, -1 after them: int32 `[..., NQB, K]`, K the largest row
    count (at least 1). One host read of K, once per layout."""
    nkb = mask.shape[-1]
    K = max(1, int(mask.sum(-1).max())) if mask.numel() else 1
    ar = torch.arange(nkb, device=mask.device)
    keys = torch.where(mask, ar, nkb + ar)          # unselected blocks sort after every selected one
    rows = keys.sort(-1).values[..., :K]
    return torch.where(rows < nkb, rows, torch.full_like(rows, -1)).to(torch.int32).contiguous()


def _table(layout: BlockLayout, G: int, H: int, device: torch.device):
    """`(rows, q_block, per_query_head)` for a layout with H (KV) or H * G (query) heads."""
    mask = layout.mask
    per_dev = _tables_of(mask)
    hit = per_dev.get((device, G, H))
    if hit is not None:
        return hit
    heads = mask.shape[-3]
    per_query_head = False
    if heads == H:
        m = mask
    elif heads == H * G:
        collapsed = per_kv_head(layout, G)
        m, per_query_head = (mask, True) if collapsed is None else (collapsed.mask, False)
    else:
        raise ValueError(f"layout has {heads} heads but the cache has {H} KV heads and q has {H * G} heads "
                         f"(the layout needs one row per KV head or per query head)")
    hit = (_rows(m.to(device)), layout.q_block, per_query_head)
    per_dev[(device, G, H)] = hit
    return hit


def pattern_topk_idx(layout: BlockLayout, seqlens: torch.Tensor) -> torch.Tensor:
    """The decode step's block selection under `layout`: int32 `[H', B, K]`, row `(L_b - 1) // q_block`
    of head h' (and of sequence b for a per-sequence layout), ascending, -1 padded; H' is the layout's
    head count. Built on seqlens' device without a host read (lengths past the layout use its last
    row: `pattern_decode` checks them when it can read them for free). CPU lengths, free to read, must
    be >= 0 (ValueError); CUDA ones are not read (a negative length takes row 0)."""
    if not isinstance(layout, BlockLayout):
        raise TypeError(f"layout must be a BlockLayout, got {type(layout).__name__}")
    check_tensor("seqlens", seqlens, ndim=1, dtypes=(torch.int32, torch.int64))
    if seqlens.device.type == "cpu" and validate_values() and bool((seqlens < 0).any()):
        raise ValueError(f"seqlens must be >= 0 (each sequence's length), got {seqlens.tolist()[:16]}")
    heads = layout.mask.shape[-3]
    rows, q_block, _ = _table(layout, 1, heads, seqlens.device)
    return _gather(rows, q_block, seqlens, layout.per_sequence)


def _gather(rows: torch.Tensor, q_block: int, seqlens: torch.Tensor, per_sequence: bool) -> torch.Tensor:
    B = seqlens.shape[0]
    nqb = rows.shape[-2]
    if per_sequence and rows.shape[0] != B:
        raise ValueError(f"layout has {rows.shape[0]} sequences but the cache has {B}")
    qb = ((seqlens.long() - 1).clamp(min=0) // q_block).clamp(max=nqb - 1)
    if per_sequence:
        sel = rows[torch.arange(B, device=rows.device), :, qb]          # [B, H', K]
    else:
        return rows[:, qb].contiguous()                                   # [H', B, K]
    return sel.permute(1, 0, 2).contiguous()


def pattern_decode(q: torch.Tensor, cache, layout, *, softmax_scale: float | None = None,
                   return_lse: bool = False, backend: str = "auto"):
    r"""One decode step of attention under a static block pattern (the prefill's pattern, continued).

    Sequence b's query (at position `L_b - 1`, its key already in the cache) attends the keys of the
    layout's row for query block `(L_b - 1) // q_block`, restricted to `t < L_b`: exactly the last
    row of the prefill under the same layout with `causal=True`. Runs `sparse_decode` (kernels on
    CUDA tensors, `naive_sparse_decode` on CPU tensors).

    Args:
        q (torch.Tensor): `[B, HQ, D]`, as `sparse_decode`.
        cache (DecodeCache or tuple): as `sparse_decode` (contiguous or paged).
        layout (BlockLayout or SparseAttention): `mask [H', NQB, NKB]` or `[B, H', NQB, NKB]` with
            H' the cache's KV heads, or the query heads HQ (per-query-head patterns: collapsed to
            the KV heads when each group's G heads agree, else one `sparse_decode` call per group
            member with G = 1, which reads the cache's selected blocks G times); or a
            `SparseAttention` / `LocalStrideSparseAttention` module, whose layout is used.
        softmax_scale (float, Optional): keyword-only, as all after it. Default: `D ** -0.5`.
        return_lse (bool, Optional): also return lse float32 `[B, HQ]`. Default: False.
        backend (str, Optional): as `sparse_decode`. Default: "auto".

    Returns:
        out `[B, HQ, D]`, and lse with `return_lse`.

    The index is gathered on the device (no host read). With a `DecodeCache` (whose lengths have a
    host mirror) and validation on, a sequence longer than the layout covers raises; tuple caches
    are trusted as in `sparse_decode` (such a sequence would use the layout's last row).
    """
    check_backend(backend)
    check_flags(return_lse=return_lse)
    k, _, seqlens, _, _ = cache_tensors(cache)
    check_tensor("q", q, ndim=3, dtypes=(k.dtype,), device=k.device)
    check_head_dim("q", q.shape)
    H = k.shape[2]
    HQ = q.shape[1]
    if HQ % H:
        raise ValueError(f"q has {HQ} heads and the cache has {H}: the query head count must be a "
                         f"multiple of it")
    G = HQ // H
    if isinstance(layout, SparseAttention):
        layout, _ = layout.layout_for(HQ, H, q.device)
    if not isinstance(layout, BlockLayout):
        raise TypeError(f"layout must be a BlockLayout or a SparseAttention module, "
                        f"got {type(layout).__name__}")
    if layout.per_sequence and layout.mask.shape[0] != seqlens.shape[0]:
        raise ValueError(f"layout has {layout.mask.shape[0]} sequences but the cache has {seqlens.shape[0]}")
    if isinstance(cache, DecodeCache) and validate_values():
        cover = layout.mask.shape[-2] * layout.q_block
        if cache.max_len() > cover:
            raise ValueError(f"the cache holds a sequence of {cache.max_len()} tokens but the layout covers "
                             f"{cover} ({layout.mask.shape[-2]} query blocks of {layout.q_block})")
    rows, q_block, per_query_head = _table(layout, G, H, q.device)
    idx = _gather(rows, q_block, seqlens.to(q.device), layout.per_sequence)
    if not per_query_head:
        return decode.sparse_decode(q, cache, idx, softmax_scale=softmax_scale, return_lse=return_lse,
                             backend=backend)
    # query heads of a group select differently: one G = 1 call per group member g (heads h*G + g)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device) if return_lse else None
    for g in range(G):
        res = decode.sparse_decode(q[:, g::G].contiguous(), cache, idx[g::G].contiguous(),
                            softmax_scale=softmax_scale, return_lse=return_lse, backend=backend)
        if return_lse:
            out[:, g::G], lse[:, g::G] = res
        else:
            out[:, g::G] = res
    return (out, lse) if return_lse else out
