"""Other systems' block-sparse formats in and out of `BlockLayout` (docs/patterns.md, "Formats").

- CSR, vLLM's blocksparse attention: per head `crow [H, NQB+1]` and `col [H, nnz_max]`, columns
  ascending within a row, rows padded with -1 to the longest head (int64, as vLLM builds them).
- BSR, FlashInfer's `BlockSparseAttentionWrapper`: one pattern for all heads, `indptr [MB+1]`,
  `indices [nnz]` (int32), blocks of R query rows by C key columns.
- FlexAttention's `BlockMask`: `kv_num_blocks`/`kv_indices` (partial blocks, where the mask_mod
  runs) and `full_kv_num_blocks`/`full_kv_indices` (blocks computed without it), over blocks of
  `BLOCK_SIZE = (Q, KV)` tokens, 128 by default.

Every conversion is exact or raises: a coarser block grid than the layout's is only accepted where
the finer blocks it merges agree, and sizes that do not fall on the 64-key grid raise ValueError.
"""
from __future__ import annotations

import math

import torch

from .._checks import argument_names, check_bool, check_int_args, check_tensor
from .._rules import KV_BLOCK, check_block_multiple
from ..stage2.layout import BlockLayout

_INTS = (torch.int32, torch.int64)


def layout_q_block(block: int) -> int:
    """The layout row size for a format's query block: itself for 64 and 128, else 128 (or 64 for an
    odd multiple of 64), so the layout selects the same tokens (its rows repeat)."""
    return block if block <= 128 else (128 if block % 128 == 0 else KV_BLOCK)


def coarse_to_layout(mask: torch.Tensor, q_block: int, kv_block: int) -> BlockLayout:
    """A bool mask `[..., NQB, NKB]` over blocks of `q_block` queries by `kv_block` keys (both
    multiples of 64) as a `BlockLayout` selecting the same tokens."""
    check_block_multiple(q_block=q_block, kv_block=kv_block)
    qb = layout_q_block(q_block)
    m = mask.repeat_interleave(kv_block // KV_BLOCK, dim=-1).repeat_interleave(q_block // qb, dim=-2)
    return BlockLayout(m.contiguous(), qb)


def _merge(m: torch.Tensor, dim: int, r: int, name: str) -> torch.Tensor:
    """Group `r` consecutive entries along `dim`; every group must agree (a ragged tail group is
    compared over the entries it has). Raises ValueError naming `name` otherwise."""
    if r == 1:
        return m
    n = m.shape[dim]
    pad = (-n) % r
    if pad:
        last = m.narrow(dim, n - 1, 1)
        m = torch.cat([m, last.expand(*[pad if d == dim % m.dim() else s for d, s in enumerate(m.shape)])],
                      dim)
    shape = list(m.shape)
    d = dim % m.dim()
    g = m.reshape(*shape[:d], shape[d] // r, r, *shape[d + 1:])
    first = g.select(d + 1, 0)
    if not bool((g == first.unsqueeze(d + 1)).all()):
        raise ValueError(f"the layout is finer than {name}: blocks merged into one {name} block differ, so "
                         f"this format cannot express it exactly (use a smaller {name})")
    return first


def layout_to_coarse(layout: BlockLayout, q_block: int, kv_block: int, *, q_name: str = "q_block",
                     kv_name: str = "kv_block") -> torch.Tensor:
    """The layout as a bool mask over blocks of `q_block` x `kv_block` tokens; exact or ValueError."""
    check_block_multiple(**{q_name: q_block, kv_name: kv_block})
    m = _merge(layout.mask, -1, kv_block // KV_BLOCK, kv_name)
    lq = layout.q_block
    g = math.gcd(lq, q_block)
    m = m.repeat_interleave(lq // g, dim=-2)            # rows of g tokens (exact split)
    return _merge(m, -2, q_block // g, q_name).contiguous()


# --------------------------------------------------------------------------------------------------
# CSR (vLLM)

def to_csr(layout: BlockLayout, *, q_block: int | None = None, kv_block: int = KV_BLOCK
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's per-head CSR of the layout: `(crow [H, NQB+1], col [H, nnz_max])` int64, columns
    ascending within each row, each head's columns padded with -1 to the longest head's count.

    Rows are blocks of `q_block` queries (default the layout's own), columns blocks of `kv_block`
    keys (vLLM uses one `block_size` for both). Raises ValueError for per-sequence layouts and for
    grids the layout cannot be merged onto exactly.
    """
    if not isinstance(layout, BlockLayout):
        raise TypeError(f"layout must be a BlockLayout, got {type(layout).__name__}")
    if layout.per_sequence:
        raise ValueError("to_csr takes a layout shared by all sequences ([H, NQB, NKB]); vLLM's CSR has no "
                         "batch dimension")
    m = layout_to_coarse(layout, layout.q_block if q_block is None else q_block, kv_block)
    H, nqb, _nkb = m.shape
    counts = m.sum(-1)                                                   # [H, NQB]
    crow = torch.zeros(H, nqb + 1, dtype=torch.int64, device=m.device)
    crow[:, 1:] = counts.cumsum(-1)
    nnz = crow[:, -1]
    width = int(nnz.max()) if H else 0
    col = torch.full((H, width), -1, dtype=torch.int64, device=m.device)
    h, _, j = m.nonzero(as_tuple=True)                              # row-major: rows in order, cols ascending
    pos = torch.arange(h.numel(), device=m.device) - torch.cat([nnz.new_zeros(1), nnz.cumsum(0)[:-1]])[h]
    col[h, pos] = j
    return crow, col


def from_csr(crow: torch.Tensor, col: torch.Tensor, *, q_block: int, kv_block: int = KV_BLOCK,
             num_kv_blocks: int | None = None) -> BlockLayout:
    """A layout from vLLM's CSR: `crow [H, NQB+1]` (or `[NQB+1]` for one head), `col [H, >= nnz]` (or
    `[>= nnz]`) in blocks of `q_block` queries and `kv_block` keys; entries past each head's
    `crow[-1]` (vLLM's -1 padding) are ignored. `num_kv_blocks` (in `kv_block` units) defaults to
    the largest column + 1."""
    check_tensor("crow", crow, dtypes=_INTS)
    check_tensor("col", col, dtypes=_INTS)
    check_block_multiple(q_block=q_block, kv_block=kv_block)
    if crow.dim() == 1:
        crow, col = crow[None], col[None]
    if crow.dim() != 2 or col.dim() != 2 or col.shape[0] != crow.shape[0]:
        raise ValueError("crow must be [H, NQB+1] and col [H, nnz_max] (or both 1-D), got "
                         f"{tuple(crow.shape)} and {tuple(col.shape)}")
    crow, col = crow.long(), col.long()
    H, nqb = crow.shape[0], crow.shape[1] - 1
    if nqb < 0 or bool((crow[:, 0] != 0).any()) or bool((crow[:, 1:] < crow[:, :-1]).any()) \
            or int(crow[:, -1].max()) > col.shape[1]:
        raise ValueError("crow must start at 0, never decrease, and end at most at col.shape[-1] per head")
    pos = torch.arange(col.shape[1], device=col.device)
    valid = pos[None] < crow[:, -1:]
    used = col[valid]
    if used.numel() and int(used.min()) < 0:
        raise ValueError("col has a negative block index within a head's crow[-1] entries")
    nkb = (int(used.max()) + 1 if used.numel() else 0) if num_kv_blocks is None else num_kv_blocks
    check_int_args(0, num_kv_blocks=nkb)
    if used.numel() and int(used.max()) >= nkb:
        raise ValueError(f"col has block index {int(used.max())} >= num_kv_blocks={nkb}")
    # the row of each entry: how many row starts lie at or before its position
    row = torch.searchsorted(crow[:, 1:].contiguous(), pos[None].expand(H, -1).contiguous(), right=True)
    m = torch.zeros(H, nqb, nkb, dtype=torch.bool, device=col.device)
    hh = torch.arange(H, device=col.device)[:, None].expand(-1, col.shape[1])
    m[hh[valid], row[valid], col[valid]] = True
    return coarse_to_layout(m, q_block, kv_block)


# --------------------------------------------------------------------------------------------------
# BSR (FlashInfer)

def to_bsr(layout: BlockLayout, *, R: int, C: int, head: int | None = None) -> tuple[torch.Tensor,
                                                                                     torch.Tensor]:
    """FlashInfer's BSR (`indptr [MB+1]`, `indices [nnz]`, int32, columns ascending) over blocks of
    `R` queries by `C` keys (multiples of 64, ValueError otherwise). FlashInfer's wrapper takes one
    pattern for all heads: the layout's heads must agree unless `head` picks one."""
    if not isinstance(layout, BlockLayout):
        raise TypeError(f"layout must be a BlockLayout, got {type(layout).__name__}")
    check_block_multiple(R=R, C=C)
    if layout.per_sequence:
        raise ValueError("to_bsr takes a layout shared by all sequences ([H, NQB, NKB])")
    m = layout.mask
    if head is None:
        if not bool((m == m[:1]).all()):
            raise ValueError("the layout's heads differ and FlashInfer's BSR holds one pattern: pass head=")
        head = 0
    check_int_args(0, head=head)
    if head >= m.shape[0]:
        raise ValueError(f"head must be in [0, {m.shape[0]}) (the layout's heads), got {head}")
    crow, col = to_csr(BlockLayout(m[head:head + 1], layout.q_block), q_block=R, kv_block=C)
    return crow[0].to(torch.int32), col[0].to(torch.int32)


def from_bsr(indptr: torch.Tensor, indices: torch.Tensor, *, R: int, C: int, num_kv_blocks: int | None = None,
             num_heads: int = 1) -> BlockLayout:
    """A layout from FlashInfer's BSR (`indptr [MB+1]`, `indices [nnz]`, blocks of `R` x `C`, multiples
    of 64), the same pattern for `num_heads` KV heads. `num_kv_blocks` counts blocks of `C` keys
    (FlashInfer's `N // C`; default the largest index + 1)."""
    check_tensor("indptr", indptr, ndim=1, dtypes=_INTS)
    check_tensor("indices", indices, ndim=1, dtypes=_INTS)
    check_block_multiple(R=R, C=C)
    check_int_args(1, num_heads=num_heads)
    with argument_names(crow="indptr", col="indices", q_block="R", kv_block="C"):   # from_csr's names
        one = from_csr(indptr, indices, q_block=R, kv_block=C, num_kv_blocks=num_kv_blocks)
    return BlockLayout(one.mask.expand(num_heads, -1, -1).contiguous(), one.q_block)


# --------------------------------------------------------------------------------------------------
# FlexAttention BlockMask

def _block_size_pair(block_size) -> tuple[int, int]:
    if isinstance(block_size, int) and not isinstance(block_size, bool):
        return block_size, block_size
    if (isinstance(block_size, (tuple, list)) and len(block_size) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) for b in block_size)):
        return block_size[0], block_size[1]
    raise ValueError(f"BLOCK_SIZE must be an int or a (Q, KV) pair, got {block_size!r}")


def from_block_mask(block_mask) -> BlockLayout:
    """A layout from a FlexAttention `BlockMask`: a block is selected when it is listed as partial or
    full. Its `BLOCK_SIZE` must be multiples of 64. The result has the BlockMask's batch (a
    `[B, H, ...]` layout when B > 1, else `[H, ...]`) and heads (query heads when the mask was built
    per query head: collapse with `per_kv_head`). The mask_mod's token-level detail inside partial
    blocks is not carried: the layout selects whole blocks (causality comes from `causal=True`)."""
    fields = ("BLOCK_SIZE", "kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
              "seq_lengths")
    if not all(hasattr(block_mask, f) for f in fields):
        raise TypeError(f"block_mask must be a FlexAttention BlockMask (torch.nn.attention.flex_attention; "
                        f"with {', '.join(fields)}), got {type(block_mask).__name__}")
    qb, kb = _block_size_pair(block_mask.BLOCK_SIZE)
    check_block_multiple(**{"BLOCK_SIZE[0]": qb, "BLOCK_SIZE[1]": kb})
    B, H, nqb = block_mask.kv_num_blocks.shape
    nkb = -(-block_mask.seq_lengths[1] // kb)
    m = torch.zeros(B, H, nqb, nkb + 1, dtype=torch.bool, device=block_mask.kv_num_blocks.device)
    for num, idx in ((block_mask.kv_num_blocks, block_mask.kv_indices),
                     (block_mask.full_kv_num_blocks, block_mask.full_kv_indices)):
        if num is None:
            continue
        listed = torch.arange(idx.shape[-1], device=idx.device) < num[..., None].long()
        # unlisted slots go to the spare column nkb, dropped below
        m.scatter_(-1, torch.where(listed, idx.long(), torch.full_like(idx, nkb, dtype=torch.long)), True)
    m = m[..., :nkb]
    nq_tokens = block_mask.seq_lengths[0]
    m = m[..., :-(-nq_tokens // qb), :]
    layout = coarse_to_layout(m[0] if B == 1 else m, qb, kb)
    keep_q = -(-nq_tokens // layout.q_block)
    return BlockLayout(layout.mask[..., :keep_q, :].contiguous(), layout.q_block)


def _sorted_indices(sel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(count int32 [...], indices int32 [..., N]): selected columns ascending, then the others."""
    n = sel.shape[-1]
    ar = torch.arange(n, device=sel.device)
    keys = torch.where(sel, ar, ar + n)
    return sel.sum(-1).to(torch.int32), keys.sort(-1).values.remainder(n).to(torch.int32)


def to_block_mask(layout: BlockLayout, *, seq_len_q: int | None = None, seq_len_kv: int | None = None,
                  BLOCK_SIZE=128, causal: bool = False, num_q_heads: int | None = None):
    """A FlexAttention `BlockMask` computing exactly what `block_sparse_attn_varlen(..., layout,
    causal=causal)` computes on one sequence (docs/patterns.md, "Formats").

    Blocks of `BLOCK_SIZE` (int or (Q, KV)) tokens that contain any selected token pair are listed;
    those whose every pair is selected (all sub-blocks, below the diagonal when causal, inside the
    sequence) are listed as full, the rest as partial with a mask_mod reading the layout at token
    level. `num_q_heads` (a multiple of the layout's KV heads) gives one head per query head for
    `flex_attention(..., enable_gqa=True)`; default one per KV head. Built on the layout's device.
    """
    from torch.nn.attention.flex_attention import BlockMask

    if not isinstance(layout, BlockLayout):
        raise TypeError(f"layout must be a BlockLayout, got {type(layout).__name__}")
    check_bool("causal", causal)
    bq, bk = _block_size_pair(BLOCK_SIZE)
    check_int_args(1, **{"BLOCK_SIZE[0]": bq, "BLOCK_SIZE[1]": bk})
    mask = layout.mask if layout.per_sequence else layout.mask[None]            # [B, H, NQB, NKB]
    B, H, nqb, nkb = mask.shape
    lq = nqb * layout.q_block if seq_len_q is None else seq_len_q
    lk = nkb * KV_BLOCK if seq_len_kv is None else seq_len_kv
    check_int_args(1, seq_len_q=lq, seq_len_kv=lk)
    G = 1
    if num_q_heads is not None:
        check_int_args(1, num_q_heads=num_q_heads)
        if num_q_heads % H:
            raise ValueError(f"num_q_heads={num_q_heads} must be a multiple of the layout's {H} KV heads")
        G = num_q_heads // H
    dev = mask.device
    # the layout at token granularity g (rows) x 64 (keys), padded to the FlexAttention grid
    gq = math.gcd(layout.q_block, bq)
    gk = math.gcd(KV_BLOCK, bk)
    nq_blocks, nk_blocks = -(-lq // bq), -(-lk // bk)
    rows = torch.arange(nq_blocks * bq // gq, device=dev) * gq                  # first token of each g-row
    cols = torch.arange(nk_blocks * bk // gk, device=dev) * gk
    r_idx = (rows // layout.q_block).clamp(max=nqb - 1)
    c_idx = (cols // KV_BLOCK).clamp(max=nkb - 1)
    fine = mask[:, :, r_idx][..., c_idx]                                         # [B, H, nq*bq/gq, nk*bk/gk]
    in_q = (rows < lq) & (rows < nqb * layout.q_block)
    in_k = (cols < lk) & (cols < nkb * KV_BLOCK)
    fine = fine & in_q[:, None] & in_k[None, :]
    if causal:
        # a fine cell holds some pair on or below the diagonal when its first key <= its last query
        fine = fine & (cols[None, :] <= rows[:, None] + gq - 1)
    cells = fine.reshape(B, H, nq_blocks, bq // gq, nk_blocks, bk // gk)
    touched = cells.any(-1).any(-2)
    full = cells.all(-1).all(-2)
    q_end = (torch.arange(nq_blocks, device=dev) + 1) * bq
    k_start = torch.arange(nk_blocks, device=dev) * bk
    k_end = k_start + bk
    inside = (q_end <= lq)[:, None] & (k_end <= lk)[None, :]
    if causal:
        inside = inside & ((k_end - 1)[None, :] <= (q_end - bq)[:, None])
    full = full & inside
    partial = touched & ~full
    if G > 1:
        partial, full = partial.repeat_interleave(G, 1), full.repeat_interleave(G, 1)
    kv_num, kv_idx = _sorted_indices(partial)
    full_num, full_idx = _sorted_indices(full)

    q_block = layout.q_block
    shared = layout.mask                                   # [H, NQB, NKB] when not per sequence

    def mask_mod(b, h, q_idx, kv_idx):
        if layout.per_sequence:
            sel = shared[b, h // G, q_idx // q_block, kv_idx // KV_BLOCK]
        else:
            sel = shared[h // G, q_idx // q_block, kv_idx // KV_BLOCK]
        return sel & (kv_idx <= q_idx) if causal else sel

    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=(bq, bk),
                                    mask_mod=mask_mod, seq_lengths=(lq, lk))
