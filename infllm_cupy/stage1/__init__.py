"""Stage 1: compressed-key scores, block pooling and top-k block selection."""
from .naive import (
    naive_pool_blocks,
    naive_select_topk,
    naive_stage1_scores,
    naive_stage1_select,
    q_block_idx_decode,
    q_block_idx_prefill,
    vis_limit,
)
from .pool import pool_blocks
from .select import stage1_scores, stage1_select

__all__ = [
    "naive_pool_blocks",
    "naive_select_topk",
    "naive_stage1_scores",
    "naive_stage1_select",
    "pool_blocks",
    "q_block_idx_decode",
    "q_block_idx_prefill",
    "stage1_scores",
    "stage1_select",
    "vis_limit",
]
