"""PyTorch reference of InfLLM-v2 decode (spec section 8): one new query per sequence against its KV cache."""
from __future__ import annotations

import torch

from .._checks import check_tensor, seqlens_host
from ..pipeline import InfLLMv2Config, check_config, dense_aux, select_blocks, stages_for
from ..stage1.naive import REF_DTYPES
from ..stage2.naive import _check_attn_inputs


def naive_infllmv2_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          cu_seqlens_k: torch.Tensor, *, config: InfLLMv2Config | None = None,
                          ck1: torch.Tensor | None = None, cu_seqlens_c1: torch.Tensor | None = None,
                          ck2: torch.Tensor | None = None, cu_seqlens_c2: torch.Tensor | None = None,
                          return_aux: bool = False):
    r"""One decode step of InfLLM-v2 attention (HF's path).

    The cache of sequence `b` holds `L_b` keys, the current token's included, so `cache_lens = L_b - 1`.
    Stage 1 runs non-causally over the complete compressed windows of the cache, pooling places the
    query in block `(L_b - 1) // block_size`, top-k drops later blocks, and stage 2 attends
    non-causally over the selected blocks of the whole cache. When the longest cache is shorter than
    `config.dense_len`, dense attention over the cache is used instead.

    Args:
        q (torch.Tensor):
            Queries `[B, HQ, D]`, one token per sequence.
        k_cache, v_cache (torch.Tensor):
            Cached keys (post-RoPE) and values `[total_k, H, D]`, packed varlen.
        cu_seqlens_k (torch.Tensor):
            int32 `[B+1]`; every `L_b >= 1`.
        config (InfLLMv2Config, Optional):
            Default: `None` (MiniCPM4 defaults).
        ck1, cu_seqlens_c1, ck2, cu_seqlens_c2 (torch.Tensor, Optional):
            Compressed caches kept by the caller (fine and coarse); computed from `k_cache` when None.
        return_aux (bool, Optional):
            Also return the intermediates dict of `naive_infllmv2_attention`. Default: `False`.

    Returns:
        out (torch.Tensor): `[B, HQ, D]` in q's dtype (and the aux dict with `return_aux`).
    """
    cfg = check_config(config)
    check_tensor("q", q, ndim=3, dtypes=REF_DTYPES)
    cu_seqlens_q = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    _check_attn_inputs(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, k_name="k_cache", v_name="v_cache")
    for name, ck, cu in (("ck1", ck1, cu_seqlens_c1), ("ck2", ck2, cu_seqlens_c2)):
        if (ck is None) != (cu is None):
            raise ValueError(f"{name} and cu_seqlens_{name[1:]} must be given together")
    lk = seqlens_host(cu_seqlens_k)
    if any(L < 1 for L in lk):
        raise ValueError(f"cu_seqlens_k: every cache must hold at least the current token, got lengths {lk}")
    max_seqlen_k = max(lk, default=0)
    stages = stages_for(q)
    if max_seqlen_k < cfg.dense_len:
        out = stages["dense_attn"](q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, causal=False,
                                   softmax_scale=cfg.softmax_scale)
        aux = dense_aux(ck1=ck1, ck2=ck2, cu_seqlens_c1=cu_seqlens_c1, cu_seqlens_c2=cu_seqlens_c2)
        return (out, aux) if return_aux else out
    cache_lens = (cu_seqlens_k[1:] - cu_seqlens_k[:-1] - 1).to(torch.int32)
    aux = select_blocks(stages, q, k_cache, cu_seqlens_q, cu_seqlens_k, 1, cache_lens, False, cfg,
                        ck1=ck1, cu_seqlens_c1=cu_seqlens_c1, ck2=ck2, cu_seqlens_c2=cu_seqlens_c2)
    out = stages["sparse_attn"](q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, aux["topk_idx"], 1, max_seqlen_k,
                                causal=False, softmax_scale=cfg.softmax_scale, block_size=cfg.block_size)
    return (out, dict(dense=False, **aux)) if return_aux else out
