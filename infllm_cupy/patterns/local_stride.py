"""vLLM's local + vertical-stride pattern (Phi-3-small blocksparse attention) as a `BlockLayout`,
and the rule that turns per-query-head masks into our per-KV-head layout (docs/patterns.md,
"Local + vertical stride", "Per query head vs per KV head").
"""
from __future__ import annotations

import torch

from .._checks import check_bool, check_int_args
from .._rules import KV_BLOCK, check_block_multiple
from ..stage2.layout import BlockLayout


def head_sliding_step(num_heads: int, vert_stride: int, *, homo_head: bool) -> int:
    """How far the vertical-stride columns move from one head to the next: 0 for homogeneous heads,
    else `max(1, vert_stride // num_heads)` (vLLM truncates `vert_stride / num_heads`)."""
    check_bool("homo_head", homo_head)
    check_int_args(1, num_heads=num_heads, vert_stride=vert_stride)
    if homo_head:
        return 0
    return max(1, vert_stride // num_heads)


def local_stride_block_mask(num_heads: int, max_seqlen: int, *, block_size: int = 64, local_blocks: int = 4,
                            vert_stride: int = 4, homo_head: bool = True) -> torch.Tensor:
    """The pattern over blocks of `block_size` (queries and keys alike): bool `[H, NB, NB]`,
    `NB = ceil(max_seqlen / block_size)`.

    Entry (h, i, j) is set when `j <= i` and either `i - j < local_blocks` (the local band) or
    `(j + h * step + 1) % vert_stride == 0` (every `vert_stride`-th column, shifted by `step` per
    head; `step` from `head_sliding_step`).
    """
    check_int_args(1, num_heads=num_heads, max_seqlen=max_seqlen, block_size=block_size,
                   local_blocks=local_blocks, vert_stride=vert_stride)
    step = head_sliding_step(num_heads, vert_stride, homo_head=homo_head)
    nb = -(-max_seqlen // block_size)
    i = torch.arange(nb)[:, None]
    j = torch.arange(nb)[None, :]
    h = torch.arange(num_heads)[:, None, None]
    vertical = (j[None] + h * step + 1) % vert_stride == 0                  # [H, 1, NB]
    return ((i >= j) & ((i - j < local_blocks) | vertical)).expand(num_heads, nb, nb).contiguous()


def expand_blocks(block_mask: torch.Tensor, block_size: int, max_seqlen: int) -> BlockLayout:
    """A mask over square blocks of `block_size` (a multiple of 64) tokens, `[..., NB, NB]`, as a
    `BlockLayout` over 64-key blocks: `q_block = block_size` for 64 and 128, otherwise 128 (or 64
    when `block_size` is an odd multiple of 64) with each row repeated for the query blocks it covers.
    Rows and columns are trimmed to `max_seqlen` tokens."""
    check_block_multiple(block_size=block_size)
    q_block = block_size if block_size <= 128 else (128 if block_size % 128 == 0 else KV_BLOCK)
    nkb = -(-max_seqlen // KV_BLOCK)
    nqb = -(-max_seqlen // q_block)
    kv_rep, q_rep = block_size // KV_BLOCK, block_size // q_block
    m = block_mask.repeat_interleave(kv_rep, dim=-1)[..., :nkb]
    m = m.repeat_interleave(q_rep, dim=-2)[..., :nqb, :]
    return BlockLayout(m.contiguous(), q_block)


def per_kv_head(mask_per_q_head, G: int, *, q_block: int | None = None) -> BlockLayout | None:
    """Collapse a per-query-head pattern to our per-KV-head `BlockLayout` when it can be done exactly
    (docs/patterns.md, "Per query head vs per KV head").

    `mask_per_q_head` is a bool `[HQ, NQB, NKB]` (or `[B, HQ, NQB, NKB]`) tensor or a `BlockLayout`
    with one row per query head. Query heads `g*G .. g*G+G-1` share KV head g (the GQA order of
    `block_sparse_attn_varlen`). When every group's G heads agree, returns the layout with
    `HQ // G` heads; when some group disagrees, returns None (run with K/V viewed per query head).
    `q_block` defaults to the layout's own, or 64 for a tensor.
    """
    check_int_args(1, G=G)
    if isinstance(mask_per_q_head, BlockLayout):
        q_block = mask_per_q_head.q_block if q_block is None else q_block
        mask_per_q_head = mask_per_q_head.mask
    q_block = KV_BLOCK if q_block is None else q_block
    if not isinstance(mask_per_q_head, torch.Tensor) or mask_per_q_head.dtype != torch.bool \
            or mask_per_q_head.dim() not in (3, 4):
        raise ValueError("mask_per_q_head must be a BlockLayout or a bool tensor [HQ, NQB, NKB] or "
                         "[B, HQ, NQB, NKB]")
    hq = mask_per_q_head.shape[-3]
    if hq % G != 0:
        raise ValueError(f"mask_per_q_head has {hq} query heads, not a multiple of G={G}")
    lead = mask_per_q_head.shape[:-3]
    grouped = mask_per_q_head.reshape(*lead, hq // G, G, *mask_per_q_head.shape[-2:])
    first = grouped.select(-3, 0)
    if not bool((grouped == first.unsqueeze(-3)).all()):
        return None
    return BlockLayout(first.contiguous(), q_block)


def local_stride(num_heads: int, max_seqlen: int, *, block_size: int = 64, local_blocks: int = 4,
                 vert_stride: int = 4, homo_head: bool = True,
                 num_kv_heads: int | None = None) -> BlockLayout:
    """vLLM's local + vertical-stride block-sparse pattern as a `BlockLayout` (docs/patterns.md,
    "Local + vertical stride").

    Block (i, j) of `block_size` tokens is attended when `j <= i` and either `i - j < local_blocks`
    or `(j + h * step + 1) % vert_stride == 0`, where `step` is 0 for `homo_head=True` and
    `max(1, vert_stride // num_heads)` otherwise (each head's vertical columns slide). Token-level
    causality inside the diagonal block comes from the op's `causal=True`. `block_size` must be a
    multiple of 64 (ValueError otherwise); the layout has `q_block = block_size` for 64 and 128,
    else 128 (or 64) with rows repeated, so it selects exactly the same tokens.

    Args:
        num_heads: query heads of the pattern (vLLM's `n_heads`).
        max_seqlen: longest sequence the layout must cover.
        num_kv_heads: None for one row per query head (run with G = 1); otherwise the layout is
            collapsed to one row per KV head, which needs the heads of each group to agree
            (always true for `homo_head=True`; ValueError otherwise).
    """
    check_bool("homo_head", homo_head)
    check_block_multiple(block_size=block_size)
    blocks = local_stride_block_mask(num_heads, max_seqlen, block_size=block_size, local_blocks=local_blocks,
                                     vert_stride=vert_stride, homo_head=homo_head)
    layout = expand_blocks(blocks, block_size, max_seqlen)
    if num_kv_heads is None:
        return layout
    check_int_args(1, num_kv_heads=num_kv_heads)
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
    collapsed = per_kv_head(layout, num_heads // num_kv_heads)
    if collapsed is None:
        raise ValueError(f"the {num_heads // num_kv_heads} query heads of a KV head have different patterns "
                         f"(homo_head=False slides the vertical columns per head): pass num_kv_heads=None "
                         f"for one row per query head and run with K/V repeated per query head")
    return collapsed
