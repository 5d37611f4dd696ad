"""PyTorch reference of InfLLM-v2 decode (spec section 8): one new query per sequence against its KV cache."""
from __future__ import annotations

import math

import torch

from .._checks import (
    check_attn_inputs,
    check_cu_seqlens,
    check_flags,
    check_head_dim,
    check_int_args,
    check_softmax_scale,
    check_tensor,
    seqlens_host,
)
from .._dtypes import REF_DTYPES, compute_dtype
from .._rules import uses_dense
from ..config import InfLLMv2Config, check_config
from ..prefill import dense_aux, run_dense_attn, run_sparse_attn, select_blocks
from .cache import cache_tensors


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
    check_flags(return_aux=return_aux)
    check_tensor("q", q, ndim=3, dtypes=REF_DTYPES)
    check_head_dim("q", q.shape)
    # The user passes no cu_seqlens_q (one query row per sequence; built below), so the batch is
    # checked here, naming what they passed, before the generic checks see the built tensor.
    check_tensor("cu_seqlens_k", cu_seqlens_k, ndim=1, dtypes=(torch.int32,), device=q.device)
    B = cu_seqlens_k.numel() - 1
    if q.shape[0] != B:
        raise ValueError(f"q has {q.shape[0]} rows but cu_seqlens_k has {B} sequences: decode takes one "
                         f"query row per sequence")
    cu_seqlens_q = torch.arange(B + 1, dtype=torch.int32, device=q.device)
    check_attn_inputs(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, k_name="k_cache", v_name="v_cache")
    for name, ck, cu in (("ck1", ck1, cu_seqlens_c1), ("ck2", ck2, cu_seqlens_c2)):
        if (ck is None) != (cu is None):
            raise ValueError(f"{name} and cu_seqlens_c{name[2:]} must be given together")
        if ck is not None:
            check_tensor(name, ck, ndim=3, dtypes=(q.dtype,), device=q.device)
            check_cu_seqlens(f"cu_seqlens_c{name[2:]}", cu, total=ck.shape[0], device=q.device, batch=B,
                             batch_name="cu_seqlens_k")
    lk = seqlens_host(cu_seqlens_k)
    if any(L < 1 for L in lk):
        raise ValueError(f"cu_seqlens_k: every cache must hold at least the current token, got lengths {lk}")
    max_seqlen_k = max(lk, default=0)
    # every stage's reference (kernels=False, cpu=False), as in the prefill reference
    if uses_dense(cfg.dense_len, max_seqlen_k):
        out = run_dense_attn(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, cfg, causal=False,
                             kernels=False)
        aux = dense_aux(ck1=ck1, ck2=ck2, cu_seqlens_c1=cu_seqlens_c1, cu_seqlens_c2=cu_seqlens_c2)
        return (out, aux) if return_aux else out
    cache_lens = (cu_seqlens_k[1:] - cu_seqlens_k[:-1] - 1).to(torch.int32)
    aux = select_blocks(q, k_cache, cu_seqlens_q, cu_seqlens_k, 1, cache_lens, False, cfg, ck1=ck1,
                        cu_seqlens_c1=cu_seqlens_c1, ck2=ck2, cu_seqlens_c2=cu_seqlens_c2, kernels=False)
    out = run_sparse_attn(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, aux["topk_idx"], 1, max_seqlen_k,
                          cfg, causal=False, kernels=False)
    return (out, dict(dense=False, **aux)) if return_aux else out


def naive_sparse_decode(q: torch.Tensor, cache, topk_idx: torch.Tensor | None = None, *,
                        softmax_scale: float | None = None, block_size: int = 64, return_lse: bool = False,
                        return_attn_weights: bool = False, weights: str = "per_head", upcast: bool = True):
    r"""Attention of one query per sequence over the selected key blocks of its cache (reference).

    Sequence b attends, non-causally, to the positions `t < L_b` of its cache whose block
    `t // block_size` appears in `topk_idx[h, b]` (every block when `topk_idx` is None: dense
    decode). Entries that are negative or `>= cdiv(L_b, block_size)` are ignored, duplicates count once.

    Args:
        q (torch.Tensor):
            `[B, HQ, D]`, the current token's queries; heads `h*G .. h*G+G-1` share KV head h.
        cache (DecodeCache or tuple):
            A `DecodeCache`, or `(k_cache, v_cache, seqlens[, block_table])`: k/v `[B, L_max, H, D]`
            (contiguous) or `[num_pages, page_size, H, D]` with `block_table int32 [B, max_pages]`
            (paged), and `seqlens` int32 `[B]`. The cache holds the current token's key.
        topk_idx (torch.Tensor, Optional):
            int32 `[H, B, K]` block indices local to each sequence, -1 padding. Default: None (dense).
            int32 both, as the kernels take them (`sparse_decode` accepts the same on every device).
        softmax_scale (float, Optional): Default: `D ** -0.5`.
        block_size (int, Optional): Default: 64.
        return_lse (bool, Optional): Also return lse float32 `[B, HQ]` (natural log; +inf where
            nothing is selected).
        return_attn_weights (bool, Optional): Also return the softmax probabilities over every cached
            position, float32, 0 where not selected or past `L_b`: `[B, HQ, W]` with
            `weights="per_head"`, summed over each group `[B, H, W]` with `"per_kv_head"`; W is the
            cache's addressable width (L_max, or max_pages * page_size).
        upcast (bool, Optional): `True`: math in fp32 (float64 for float64 inputs); `False`: the
            matmuls in q's dtype (FlashAttention's low-precision baseline). Default: True.

    Returns:
        out `[B, HQ, D]` in q's dtype, then lse and weights if asked for.
    """
    check_flags(return_lse=return_lse, return_attn_weights=return_attn_weights, upcast=upcast)
    check_int_args(1, block_size=block_size)
    k, v, seqlens, bt, width = check_sparse_decode_inputs(q, cache, topk_idx, weights)
    scale = check_softmax_scale(softmax_scale, q.shape[2])
    return sparse_decode_checked(q, k, v, seqlens, bt, width, topk_idx, scale=scale, block_size=block_size,
                                  return_lse=return_lse, return_attn_weights=return_attn_weights,
                                  weights=weights, upcast=upcast)


def check_sparse_decode_inputs(q, cache, topk_idx, weights: str):
    """`naive_sparse_decode`'s checks of q, the cache (as `cache_tensors` takes it), the selection and
    `weights`; raises naming the argument. Returns `cache_tensors(cache)`."""
    k, v, seqlens, bt, width = cache_tensors(cache)
    check_tensor("q", q, ndim=3, dtypes=(k.dtype,), device=k.device)
    check_head_dim("q", q.shape)
    B, HQ, D = q.shape
    H = k.shape[2]
    if k.shape[3] != D:
        raise ValueError(f"q has head dim {D} but the cache has {k.shape[3]}")
    if HQ % H:
        raise ValueError(f"q has {HQ} heads, not a multiple of the cache's {H} KV heads")
    if seqlens.shape[0] != B:
        raise ValueError(f"q has {B} rows (one per sequence) but the cache holds {seqlens.shape[0]} "
                         "sequences")
    if weights not in ("per_head", "per_kv_head"):
        raise ValueError(f"weights must be 'per_head' or 'per_kv_head', got {weights!r}")
    if topk_idx is not None:
        # int32 as the kernels take it (`check_decode_kernel_inputs`): CPU accepts what the GPU does
        check_tensor("topk_idx", topk_idx, ndim=3, dtypes=(torch.int32,), device=k.device)
        if tuple(topk_idx.shape[:2]) != (H, B):
            raise ValueError(f"topk_idx must have shape (H={H}, B={B}, K), got {tuple(topk_idx.shape)}")
    return k, v, seqlens, bt, width


def sparse_decode_checked(q, k, v, seqlens, bt, width: int, topk_idx, *, scale: float, block_size: int,
                           return_lse: bool, return_attn_weights: bool, weights: str, upcast: bool = True):
    """`naive_sparse_decode` on checked inputs (the cache as `cache_tensors` gives it, `scale` a float):
    the decode step's reference path, which checked them at its own entry."""

    B, HQ, D = q.shape
    H = k.shape[2]
    G = HQ // H
    sdt = compute_dtype(q.dtype)
    mdt = sdt if upcast else q.dtype
    lens = [int(x) for x in seqlens.cpu().tolist()]
    out = torch.zeros(B, HQ, D, dtype=q.dtype, device=q.device)
    lse = torch.full((B, HQ), float("inf"), dtype=torch.float32, device=q.device)
    w = torch.zeros(B, H, G, width, dtype=torch.float32, device=q.device)
    for b, L in enumerate(lens):
        if L <= 0:
            continue
        if L > width:
            raise ValueError(f"seqlens: sequence {b} has {L} keys, more than the cache's width {width}")
        t = torch.arange(L, device=k.device)
        if bt is None:
            kb, vb = k[b, :L], v[b, :L]
        else:
            ps = k.shape[1]
            pages = bt[b, t // ps].long()
            kb, vb = k[pages, t % ps], v[pages, t % ps]
        nb = math.ceil(L / block_size)
        if topk_idx is None:
            allow = torch.ones(H, L, dtype=torch.bool, device=k.device)
        else:
            ids = topk_idx[:, b].long()                                    # [H, K]
            ok = (ids >= 0) & (ids < nb)
            sel = torch.zeros(H, nb + 1, dtype=torch.bool, device=k.device)
            sel.scatter_(1, torch.where(ok, ids, torch.full_like(ids, nb)), True)
            allow = sel[:, :nb][:, t // block_size]                         # [H, L]
        qh = (q[b].view(H, G, D).to(mdt) * scale)
        s = torch.matmul(qh, kb.to(mdt).permute(1, 2, 0)).to(sdt)          # [H, G, L]
        s = s.masked_fill(~allow[:, None], float("-inf"))
        has = allow.any(-1)[:, None, None]                                  # [H, 1, 1]
        p = torch.where(has, torch.softmax(s, -1), torch.zeros_like(s))
        o = torch.matmul(p.to(mdt), vb.to(mdt).permute(1, 0, 2))           # [H, G, D]
        out[b] = o.reshape(HQ, D).to(q.dtype)
        lse[b] = torch.where(has[..., 0], torch.logsumexp(s, -1), torch.full_like(s[..., 0], float("inf"))
                             ).reshape(HQ).float()
        w[b, :, :, :L] = p.float()
    res = [out]
    if return_lse:
        res.append(lse)
    if return_attn_weights:
        res.append(w.reshape(B, HQ, width) if weights == "per_head" else w.sum(2))
    return res[0] if len(res) == 1 else tuple(res)
