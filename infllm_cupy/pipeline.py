"""InfLLM-v2 attention end to end (spec section 9): key compression, stage 1 (scores, block pooling,
top-k) under `no_grad`, then stage 2 over the selected blocks; dense attention below `dense_len`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ._checks import seqlens_host
from .compress.naive import naive_compress_k
from .stage1.naive import (
    REF_DTYPES,
    check_int_args,
    check_max_seqlen,
    naive_pool_blocks,
    naive_select_topk,
    naive_stage1_scores,
    q_block_idx_prefill,
)
from .stage2.naive import _check_attn_inputs, naive_dense_attn_varlen, naive_sparse_attn_varlen


@dataclass(frozen=True)
class InfLLMv2Config:
    r"""Hyper-parameters of InfLLM-v2 (MiniCPM4 / 4.1 defaults).

    Args:
        kernel_size, kernel_stride (int):
            Fine key compression (stage-1 scores). Default: 32, 16.
        coarse_kernel_size, coarse_kernel_stride (int):
            Coarse compression (stage-1 normaliser). Default: 128, 64.
        block_size (int):
            Key block of stage 2. Default: 64.
        topk (int):
            Top-k budget; `topk + local_blocks` blocks are kept. Default: 64.
        local_blocks (int):
            `window_size // block_size`; `local_blocks + 1` blocks are forced. Default: 32.
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

    def __post_init__(self):
        check_int_args(1, kernel_size=self.kernel_size, kernel_stride=self.kernel_stride,
                       coarse_kernel_size=self.coarse_kernel_size, coarse_kernel_stride=self.coarse_kernel_stride,
                       block_size=self.block_size)
        check_int_args(0, topk=self.topk, local_blocks=self.local_blocks, init_blocks=self.init_blocks)
        check_int_args(-1, dense_len=self.dense_len)
        if self.block_size % self.kernel_stride:
            raise ValueError(f"block_size ({self.block_size}) must be a multiple of kernel_stride "
                             f"({self.kernel_stride})")
        if self.softmax_scale is not None and not self.softmax_scale > 0:
            raise ValueError(f"softmax_scale must be positive or None, got {self.softmax_scale!r}")
        if self.score_dtype not in REF_DTYPES:
            raise ValueError(f"score_dtype must be a float dtype, got {self.score_dtype!r}")


def check_config(config) -> InfLLMv2Config:
    if config is None:
        return InfLLMv2Config()
    if not isinstance(config, InfLLMv2Config):
        raise TypeError(f"config must be an InfLLMv2Config or None, got {type(config).__name__}")
    return config


# Every stage by name; a kernel that replaces one must keep the reference's signature.
_REFERENCE_STAGES = {
    "compress_k": naive_compress_k,
    "stage1_scores": naive_stage1_scores,
    "pool_blocks": naive_pool_blocks,
    "select_topk": naive_select_topk,
    "sparse_attn": naive_sparse_attn_varlen,
    "dense_attn": naive_dense_attn_varlen,
}


def stages_for(q: torch.Tensor) -> dict:
    """Implementation of each stage for these inputs.

    This is where the `backend` switch goes: CUDA tensors will get the CuPy kernels stage by stage,
    each with the signature of the reference it replaces. Today every stage is the PyTorch reference.
    """
    return dict(_REFERENCE_STAGES)


def select_blocks(stages: dict, q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, cache_lens, causal,
                  cfg: InfLLMv2Config, ck1=None, cu_seqlens_c1=None, ck2=None, cu_seqlens_c2=None) -> dict:
    """Compression (unless given) -> stage-1 scores -> pooling -> top-k, without gradients.

    Returns the dict of intermediates (`ck1`, `ck2`, `cu_seqlens_c1/c2`, `scores`, `block_scores`,
    `topk_idx`) that `return_aux` exposes.
    """
    with torch.no_grad():
        if ck1 is None:
            ck1, cu_seqlens_c1 = stages["compress_k"](k, cu_seqlens_k, cfg.kernel_size, cfg.kernel_stride)
        if cfg.exact_stage1:
            ck2, cu_seqlens_c2 = ck1, cu_seqlens_c1
        elif ck2 is None:
            ck2, cu_seqlens_c2 = stages["compress_k"](k, cu_seqlens_k, cfg.coarse_kernel_size,
                                                      cfg.coarse_kernel_stride)
        scores = stages["stage1_scores"](
            q, ck1, ck2, cu_seqlens_q, cu_seqlens_c1, cu_seqlens_c2, max_seqlen_q, causal=causal,
            softmax_scale=cfg.softmax_scale, score_dtype=cfg.score_dtype, kernel_stride=cfg.kernel_stride,
            coarse_kernel_stride=cfg.coarse_kernel_stride)
        block_scores = stages["pool_blocks"](
            scores, cu_seqlens_q, cu_seqlens_c1, cache_lens, max_seqlen_q, init_blocks=cfg.init_blocks,
            local_blocks=cfg.local_blocks, block_size=cfg.block_size, kernel_stride=cfg.kernel_stride)
        q_blocks = q_block_idx_prefill(cu_seqlens_q, max_seqlen_q, cfg.block_size, cfg.varlen_offset_quirk,
                                       cache_lens=cache_lens)
        topk_idx = stages["select_topk"](block_scores, q_blocks, cfg.topk, cfg.local_blocks)
    return {"ck1": ck1, "ck2": ck2, "cu_seqlens_c1": cu_seqlens_c1, "cu_seqlens_c2": cu_seqlens_c2,
            "scores": scores, "block_scores": block_scores, "topk_idx": topk_idx}


def dense_aux(**given) -> dict:
    """The aux dict of the dense path: no selection; compressed keys only if the caller gave them."""
    keys = ("ck1", "ck2", "cu_seqlens_c1", "cu_seqlens_c2", "scores", "block_scores", "topk_idx")
    return {"dense": True, **{k: given.get(k) for k in keys}}


def naive_infllmv2_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                             cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                             config: InfLLMv2Config | None = None, return_aux: bool = False):
    r"""InfLLM-v2 prefill attention (PyTorch reference of the whole pipeline).

    Keys are mean-compressed (32/16 and 128/64), stage 1 scores them for every query token, the scores
    are max-pooled into 64-token blocks with the init and local blocks forced, the top
    `topk + local_blocks` blocks are kept, and stage 2 attends causally (bottom-right aligned) over
    them. Stage 1 takes no gradient; `q`, `k`, `v` get theirs through stage 2. When the longest key
    sequence is shorter than `config.dense_len`, plain dense causal attention is used instead.
    Query sequences shorter than their key sequences are chunked prefill: the first `Lk - Lq` keys
    are the cache.

    Args:
        q (torch.Tensor):
            Queries `[total_q, HQ, D]` (bf16, fp16 or fp32).
        k, v (torch.Tensor):
            Keys (post-RoPE) and values `[total_k, H, D]`; `HQ` a multiple of `H`.
        cu_seqlens_q, cu_seqlens_k (torch.Tensor):
            int32 `[B+1]`; every `Lq <= Lk`.
        max_seqlen_q, max_seqlen_k (int):
            Longest query / key sequence.
        config (InfLLMv2Config, Optional):
            Default: `None` (MiniCPM4 defaults).
        return_aux (bool, Optional):
            Also return a dict of intermediates: `dense`, `ck1`, `ck2`, `cu_seqlens_c1`, `cu_seqlens_c2`,
            `scores`, `block_scores`, `topk_idx` (all None on the dense path). Default: `False`.

    Returns:
        out (torch.Tensor): `[total_q, HQ, D]` in q's dtype (and the aux dict with `return_aux`).
    """
    cfg = check_config(config)
    _check_attn_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k)
    lq, lk = seqlens_host(cu_seqlens_q), seqlens_host(cu_seqlens_k)
    check_max_seqlen("max_seqlen_q", max_seqlen_q, lq)
    check_max_seqlen("max_seqlen_k", max_seqlen_k, lk)
    if any(a > b for a, b in zip(lq, lk)):
        raise ValueError(f"cu_seqlens_q: every query length must be <= its key length, got {lq} vs {lk}")
    stages = stages_for(q)
    if max_seqlen_k < cfg.dense_len:
        out = stages["dense_attn"](q, k, v, cu_seqlens_q, cu_seqlens_k, causal=True,
                                   softmax_scale=cfg.softmax_scale)
        return (out, dense_aux()) if return_aux else out
    cache_lens = torch.tensor([b - a for a, b in zip(lq, lk)], dtype=torch.int32, device=q.device)
    aux = select_blocks(stages, q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, cache_lens, True, cfg)
    out = stages["sparse_attn"](q, k, v, cu_seqlens_q, cu_seqlens_k, aux["topk_idx"], max_seqlen_q, max_seqlen_k,
                                causal=True, softmax_scale=cfg.softmax_scale, block_size=cfg.block_size)
    return (out, dict(dense=False, **aux)) if return_aux else out
