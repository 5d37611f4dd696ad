"""`InfLLMv2Config`: InfLLM-v2's hyper-parameters (MiniCPM4 / 4.1 defaults), the rules between them
checked when a config is made, and `check_config`, the one way an op takes a config argument."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ._checks import (
    check_flags,
    check_int_args,
    check_score_dtype,
    check_softmax_scale,
    check_window_covers_stride,
)
from ._dtypes import REF_DTYPES
from ._rules import check_precision, check_precision_block


@dataclass(frozen=True, kw_only=True)
class InfLLMv2Config:
    r"""Hyper-parameters of InfLLM-v2 (MiniCPM4 / 4.1 defaults).

    What `topk` means (MiniCPM4's definition, docs/semantics.md): every query token gets
    `K = topk + local_blocks` block slots (`topk_idx` is `[H, total_q, K]`, at most the number of
    blocks). The forced blocks take their slots inside K: the `init_blocks` leading blocks and the
    `local_blocks + 1` blocks ending at the query's own block (the local window counts the query's
    block too). The `topk - init_blocks - 1` slots left go to the best-scoring other blocks.
    MiniCPM4: `topk = 64`, `local_blocks = 32`, so K = 96 = 1 init + 33 local + 62 by score.
    `topk < init_blocks + 1` cannot hold every forced block (stage 1 would drop some of them, leaving
    holes in the local window) and raises ValueError.

    Args:
        kernel_size, kernel_stride (int):
            Fine key compression (stage-1 scores). Default: 32, 16.
        coarse_kernel_size, coarse_kernel_stride (int):
            Coarse compression (stage-1 normaliser). Default: 128, 64.
        block_size (int):
            Key block of stage 2. Default: 64.
        topk (int):
            Selection budget: `K = topk + local_blocks` slots, forced blocks included (see above);
            at least `init_blocks + 1`. Default: 64.
        local_blocks (int):
            `window_size // block_size`; the local window is `local_blocks + 1` blocks, the query's
            own block and the `local_blocks` before it. Default: 32.
        init_blocks (int):
            Leading blocks always selected. Default: 1.
        dense_len (int):
            Dense attention when the longest key sequence is shorter; 0 or -1 means always sparse.
            Default: 8192.
        exact_stage1 (bool):
            Normalise stage 1 over the fine keys themselves (coarse keys = `ck1`, exact softmax)
            instead of the coarse-key approximation. Default: `False`.
        varlen_offset_quirk (bool):
            HF's `max_seqlen_q - L_b` offset of the query block in ragged prefill batches. Default: `False`.
        softmax_scale (float, Optional):
            Default: `None` (`1 / sqrt(D)`).
        score_dtype (torch.dtype):
            dtype of stage-1 scores and block scores, on which top-k runs. Default: `torch.bfloat16`
            (as the original; fp32 gives tie-free comparisons in tests).
        precision (str):
            Stage 2's plan (`_rules.PRECISIONS`): "16bit" (the inputs' bf16/fp16, fp32 accumulation) or
            "int8-fp8" (the 8-bit forward of docs/stage2_q8.md: no gradients, 64-key blocks only, CPU
            tensors only until its kernels are verified on hardware; compression, stage 1 and the
            dense fallback stay in 16 bits). Default: "16bit".
    """
    kernel_size: int = 32
    kernel_stride: int = 16
    coarse_kernel_size: int = 128
    coarse_kernel_stride: int = 64
    block_size: int = 64
    topk: int = 64
    local_blocks: int = 32
    init_blocks: int = 1
    dense_len: int = 8192
    exact_stage1: bool = False
    varlen_offset_quirk: bool = False
    softmax_scale: float | None = None
    score_dtype: torch.dtype = torch.bfloat16
    precision: str = "16bit"

    def __post_init__(self):
        check_int_args(1, kernel_size=self.kernel_size, kernel_stride=self.kernel_stride,
                       coarse_kernel_size=self.coarse_kernel_size,
                       coarse_kernel_stride=self.coarse_kernel_stride, block_size=self.block_size)
        check_int_args(0, topk=self.topk, local_blocks=self.local_blocks, init_blocks=self.init_blocks)
        check_int_args(-1, dense_len=self.dense_len)
        check_flags(exact_stage1=self.exact_stage1, varlen_offset_quirk=self.varlen_offset_quirk)
        check_topk_keeps_forced_blocks(self.topk, self.init_blocks)
        check_window_covers_stride("kernel_size", self.kernel_size, "kernel_stride", self.kernel_stride)
        check_window_covers_stride("coarse_kernel_size", self.coarse_kernel_size, "coarse_kernel_stride",
                                   self.coarse_kernel_stride)
        if self.block_size % self.kernel_stride:
            raise ValueError(f"block_size ({self.block_size}) must be a multiple of kernel_stride "
                             f"({self.kernel_stride}): block pooling takes block_size // kernel_stride fine "
                             f"keys per block")
        s2, bs = self.coarse_kernel_stride, self.block_size
        if bs % s2 and s2 % bs:
            raise ValueError(f"coarse_kernel_stride ({s2}) must divide block_size ({bs}) or be a multiple of "
                             f"it, so that the coarse windows line up with the key blocks (MiniCPM4: 64 "
                             f"with 64-key blocks)")
        check_softmax_scale(self.softmax_scale, 1)
        if self.score_dtype is None:
            raise ValueError(f"score_dtype must be one of {tuple(REF_DTYPES)}, got None")
        check_score_dtype(self.score_dtype)
        check_precision(self.precision)
        check_precision_block(self.precision, self.block_size)


def check_topk_keeps_forced_blocks(topk: int, init_blocks: int, name: str = "topk") -> None:
    """Raise ValueError unless `K = topk + local_blocks` slots hold every forced block.

    A query far enough from the start has `init_blocks + local_blocks + 1` forced blocks (the init
    blocks and a local window that does not overlap them), so `topk >= init_blocks + 1` exactly.
    The original (HF MiniCPM) does not check this; there, too, a smaller `topk` lets `torch.topk`
    drop forced blocks among the tied `+inf` scores, which contradicts their being forced, so we
    refuse the configuration rather than reproduce the holes.
    """
    if topk < init_blocks + 1:
        raise ValueError(f"{name} must be at least init_blocks + 1 = {init_blocks + 1}, got {topk}: "
                         f"K = {name} + local_blocks slots must hold the {init_blocks} init block(s) and the "
                         f"local_blocks + 1 local blocks (the forced blocks count inside K, as in MiniCPM4); "
                         f"{name} = {init_blocks + 1} keeps only the forced blocks")


def check_config(config) -> InfLLMv2Config:
    if config is None:
        return InfLLMv2Config()
    if not isinstance(config, InfLLMv2Config):
        raise TypeError(f"config must be an InfLLMv2Config or None, got {type(config).__name__}")
    return config
