"""Layouts with one row per query head, without repeating K/V (docs/patterns.md, "Per query head vs per KV
head").

A stage-2 op: the public entry point `qhead_block_sparse_attn_varlen` is in
`infllm_cupy/stage2/attention.py`, its custom ops and the backward's plan in `infllm_cupy/stage2/qhead.py`.
This module names them for the pattern zoo.
"""
from ..stage2.attention import qhead_block_sparse_attn_varlen
from ..stage2.qhead import (
    PARTIALS_BUDGET_FRACTION,
    qhead_block_sparse_attn_bwd,
    qhead_block_sparse_attn_fwd,
    qhead_bwd_plan,
)

__all__ = [
    "PARTIALS_BUDGET_FRACTION",
    "qhead_block_sparse_attn_bwd",
    "qhead_block_sparse_attn_fwd",
    "qhead_block_sparse_attn_varlen",
    "qhead_bwd_plan",
]
