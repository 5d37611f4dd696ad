"""Context parallelism over `torch.distributed`: all-gather of K and V with the zigzag layout
(docs/context_parallel.md). Launch with `torchrun`; NCCL for CUDA tensors, gloo for CPU tensors."""

from .cp import ContextParallelInfLLMv2, agree_across_ranks, cp_infllmv2_attention
from .zigzag import (
    ZigzagPlan,
    all_gather_rows,
    check_zigzag_lengths,
    reduce_scatter_rows,
    zigzag_granule,
    zigzag_plan,
    zigzag_shard,
    zigzag_unshard,
)

__all__ = [
    "ContextParallelInfLLMv2",
    "cp_infllmv2_attention",
    "agree_across_ranks",
    "ZigzagPlan",
    "zigzag_plan",
    "zigzag_granule",
    "check_zigzag_lengths",
    "zigzag_shard",
    "zigzag_unshard",
    "all_gather_rows",
    "reduce_scatter_rows",
]
