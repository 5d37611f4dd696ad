"""InfLLM-v2 attention end to end (spec section 9): key compression, stage 1 (scores, block pooling,
top-k) under `no_grad`, then stage 2 over the selected blocks; dense attention below `dense_len`.

`infllmv2_attention` (and its module form `InfLLMv2Attention`) dispatches each stage to a CUDA
kernel or to its PyTorch reference (`stages_for`); `naive_infllmv2_attention` is the reference of
the whole pipeline.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ._checks import (
    REF_DTYPES,
    check_attn_inputs,
    check_backend,
    check_flags,
    check_int_args,
    check_kernel_inputs,
    check_max_seqlen,
    check_softmax_scale,
    check_tensor,
    seqlens_host,
)
from ._constants import KV_BLOCK
from .compress.mean_pool import compress_k
from .compress.naive import naive_compress_k
from .stage1.naive import naive_stage1_select
from .stage2.attention import sparse_attn_varlen
from .stage2.naive import naive_dense_attn_varlen, naive_sparse_attn_varlen


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
                       coarse_kernel_size=self.coarse_kernel_size,
                       coarse_kernel_stride=self.coarse_kernel_stride, block_size=self.block_size)
        check_int_args(0, topk=self.topk, local_blocks=self.local_blocks, init_blocks=self.init_blocks)
        check_int_args(-1, dense_len=self.dense_len)
        check_flags(exact_stage1=self.exact_stage1, varlen_offset_quirk=self.varlen_offset_quirk)
        check_topk_keeps_forced_blocks(self.topk, self.init_blocks)
        if self.block_size % self.kernel_stride:
            raise ValueError(f"block_size ({self.block_size}) must be a multiple of kernel_stride "
                             f"({self.kernel_stride})")
        if self.softmax_scale is not None and not self.softmax_scale > 0:
            raise ValueError(f"softmax_scale must be positive or None, got {self.softmax_scale!r}")
        if self.score_dtype not in REF_DTYPES:
            raise ValueError(f"score_dtype must be a float dtype, got {self.score_dtype!r}")


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


def uses_kernels(q: torch.Tensor, backend: str = "auto") -> bool:
    """Whether `stages_for(q, backend)` picks the kernels: CUDA tensors under "auto" or "kernels".

    CPU tensors always run the references (there are no CPU kernels), whatever `backend` says.
    """
    return check_backend(backend) != "reference" and q.is_cuda


def check_kernel_block_size(block_size) -> None:
    """The stage-2 kernels only do InfLLM-v2's 64-key blocks; any other `block_size` raises ValueError."""
    if block_size != KV_BLOCK:
        raise ValueError(f"config.block_size must be {KV_BLOCK} on the kernel path (the stage-2 kernels "
                         f"only do {KV_BLOCK}-key blocks), got {block_size!r}; pass "
                         f"backend='reference' for other block sizes")


def check_kernel_path(cfg: InfLLMv2Config, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Everything the sparse kernel path cannot do, raised before any launch.

    Raises:
        ValueError: `config.block_size` other than 64, or dtypes/head dims/devices the kernels lack.
    """
    check_kernel_block_size(cfg.block_size)
    check_kernel_inputs(q, k, v)


def _kernel_compress_k(k, cu_seqlens_k, kernel_size=32, kernel_stride=16):
    """`compress_k` forced onto its kernel, with `naive_compress_k`'s signature."""
    return compress_k(k, cu_seqlens_k, kernel_size, kernel_stride, backend="kernels")


def _kernel_sparse_attn(q, k, v, cu_seqlens_q, cu_seqlens_k, topk_idx, max_seqlen_q, max_seqlen_k, *,
                        causal=True,
                        softmax_scale=None, return_lse=False, block_size: int = 64, upcast: bool = True):
    """`sparse_attn_varlen` on its kernel, taking `naive_sparse_attn_varlen`'s keywords.

    The kernel has no `block_size` (always 64) and always accumulates in fp32 (`upcast=True`).
    """
    check_kernel_block_size(block_size)
    if upcast is not True:
        raise ValueError("upcast=False (the low-precision reference twin) has no kernel; use "
                         "naive_sparse_attn_varlen")
    return sparse_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, topk_idx, max_seqlen_q, max_seqlen_k,
                              causal=causal, softmax_scale=softmax_scale, return_lse=return_lse,
                              backend="kernels")


# Elements of one boolean mask chunk of the SDPA fallback when Lq != Lk (bounds its memory).
_SDPA_MASK_ELEMS = 1 << 26


def sdpa_dense_attn_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                           cu_seqlens_k: torch.Tensor, max_seqlen_q: int | None = None,
                           max_seqlen_k: int | None = None, *, causal: bool = True,
                           softmax_scale: float | None = None, return_lse: bool = False,
                           upcast: bool = True) -> torch.Tensor:
    r"""Dense varlen attention through `torch.nn.functional.scaled_dot_product_attention`, one call per
    sequence.

    Same semantics and signature as `naive_dense_attn_varlen` (GQA, causal mask aligned bottom-right:
    row `r` sees keys `j <= r + Lk - Lq`; rows that see no key give 0). Sequences with `Lq == Lk`
    take SDPA's own `is_causal` path (flash / cuDNN / efficient, whatever torch picks, with
    backward); chunked-prefill sequences (`Lq < Lk`) pass an explicit boolean mask built per query
    chunk. This is the kernel path's dense fallback: torch's fused kernels are as fast as any we
    would write for dense attention.

    Args:
        q (torch.Tensor):
            Queries `[total_q, HQ, D]`.
        k, v (torch.Tensor):
            Keys and values `[total_k, H, D]`, q's dtype; `HQ` a multiple of `H`.
        cu_seqlens_q, cu_seqlens_k (torch.Tensor):
            int32 `[B+1]`.
        max_seqlen_q, max_seqlen_k (int, Optional):
            As in `naive_dense_attn_varlen`: checked when given. Default: `None`.
        causal (bool, Optional):
            Keyword-only, as every flag below. Default: `True`.
        softmax_scale (float, Optional):
            Default: `None` (`1 / sqrt(D)`).
        return_lse (bool, Optional):
            Must be `False`: SDPA does not return the log-sum-exp. Default: `False`.
        upcast (bool, Optional):
            Accepted for the reference's signature; SDPA computes in its own precision. Default: `True`.

    Returns:
        out (torch.Tensor): `[total_q, HQ, D]` in q's dtype.
    """
    check_flags(causal=causal, return_lse=return_lse, upcast=upcast)
    if return_lse:
        raise ValueError("return_lse=True: torch SDPA does not return the log-sum-exp; use "
                         "naive_dense_attn_varlen")
    check_attn_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k)
    lq, lk = seqlens_host(cu_seqlens_q), seqlens_host(cu_seqlens_k)
    if max_seqlen_q is not None:
        check_max_seqlen("max_seqlen_q", max_seqlen_q, lq)
    if max_seqlen_k is not None:
        check_max_seqlen("max_seqlen_k", max_seqlen_k, lk)
    scale = check_softmax_scale(softmax_scale, q.shape[2])
    sdpa = torch.nn.functional.scaled_dot_product_attention
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    outs = []
    for b, (Lq, Lk) in enumerate(zip(lq, lk)):
        if Lq == 0:
            continue
        qb = q[cu_q[b]:cu_q[b] + Lq].transpose(0, 1).unsqueeze(0)               # [1, HQ, Lq, D]
        kb = k[cu_k[b]:cu_k[b] + Lk].transpose(0, 1).unsqueeze(0)               # [1, H, Lk, D]
        vb = v[cu_k[b]:cu_k[b] + Lk].transpose(0, 1).unsqueeze(0)
        # Rows before the first visible key (causal with Lq > Lk, or no keys at all) give 0.
        n_empty = Lq if Lk == 0 else (max(0, Lq - Lk) if causal else 0)
        if n_empty:
            outs.append(q.new_zeros(n_empty, q.shape[1], q.shape[2]))
            qb, Lq = qb[:, :, n_empty:], Lq - n_empty
            if Lq == 0:
                continue
        if not causal or Lq == Lk:
            o = sdpa(qb, kb, vb, is_causal=causal, scale=scale, enable_gqa=True)
        else:
            # Bottom-right alignment, which is_causal (top-left) does not give; masked per query chunk.
            parts = []
            chunk = max(1, _SDPA_MASK_ELEMS // Lk)
            for s in range(0, Lq, chunk):
                e = min(Lq, s + chunk)
                n = e + Lk - Lq                                                 # keys the chunk can see
                r = torch.arange(s, e, device=q.device)
                mask = torch.arange(n, device=q.device)[None, :] <= (r + Lk - Lq)[:, None]
                parts.append(sdpa(qb[:, :, s:e], kb[:, :, :n], vb[:, :, :n], attn_mask=mask, scale=scale,
                                  enable_gqa=True))
            o = torch.cat(parts, dim=2)
        outs.append(o[0].transpose(0, 1))
    return torch.cat(outs, dim=0) if outs else q.new_zeros(0, q.shape[1], q.shape[2])


# Every stage by name; a kernel that replaces one must keep the reference's signature.
_REFERENCE_STAGES = {
    "compress_k": naive_compress_k,
    "stage1_select": naive_stage1_select,
    "sparse_attn": naive_sparse_attn_varlen,
    "dense_attn": naive_dense_attn_varlen,
}


def _stage1_kernel():
    """The stage-1 kernel op (scores, block pooling and top-k in one launch), with
    `naive_stage1_select`'s signature; the pipeline asks for `return_scores=True` only when
    `return_aux` exposes the scores and block scores."""
    from .stage1.select import stage1_select

    return stage1_select


def stages_for(q: torch.Tensor, backend: str = "reference") -> dict:
    """Implementation of each stage for these inputs, by name.

    With CUDA tensors and `backend` "auto" or "kernels": `compress_k` and `sparse_attn` are the
    kernels (`sparse_attn` raises ValueError for a `block_size` other than 64), `dense_attn` is torch
    SDPA (`sdpa_dense_attn_varlen`), and `stage1_select` is the fused stage-1 kernel
    (`infllm_cupy.stage1.select`). Otherwise, or with `backend="reference"`, every stage is the
    reference, which runs on CPU and CUDA tensors alike.

    Args:
        q (torch.Tensor):
            The queries (only their device matters).
        backend (str, Optional):
            "auto", "kernels" or "reference". Default: "reference", so that reference pipelines
            (`naive_infllmv2_attention`, the naive decode) stay references on the GPU.

    Returns:
        dict: `compress_k`, `stage1_select`, `sparse_attn`, `dense_attn` -> callables with the
        signatures of `naive_compress_k`, `naive_stage1_select`, `naive_sparse_attn_varlen` and
        `naive_dense_attn_varlen`.
    """
    stages = dict(_REFERENCE_STAGES)
    if not uses_kernels(q, backend):
        return stages
    stages.update(compress_k=_kernel_compress_k, sparse_attn=_kernel_sparse_attn,
                  dense_attn=sdpa_dense_attn_varlen)
    stages["stage1_select"] = _stage1_kernel()
    return stages


def stage_names(stages: dict) -> dict[str, str]:
    """`{stage: "module.function"}` of a `stages_for` dict, for logs and benchmark tables."""
    return {name: f"{getattr(f, '__module__', '?')}.{getattr(f, '__qualname__', repr(f))}"
            for name, f in stages.items()}


def select_blocks(stages: dict, q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, cache_lens, causal,
                  cfg: InfLLMv2Config, ck1=None, cu_seqlens_c1=None, ck2=None, cu_seqlens_c2=None, *,
                  need_scores: bool = True) -> dict:
    """Compression (unless given) -> stage 1 (scores, pooling, top-k), without gradients.

    Returns the dict of intermediates (`ck1`, `ck2`, `cu_seqlens_c1/c2`, `scores`, `block_scores`,
    `topk_idx`) that `return_aux` exposes; `scores` and `block_scores` are None unless `need_scores`
    (a stage-1 kernel can then skip writing them).
    """
    with torch.no_grad():
        if ck1 is None:
            ck1, cu_seqlens_c1 = stages["compress_k"](k, cu_seqlens_k, cfg.kernel_size, cfg.kernel_stride)
        if cfg.exact_stage1:
            ck2, cu_seqlens_c2 = ck1, cu_seqlens_c1
        elif ck2 is None:
            ck2, cu_seqlens_c2 = stages["compress_k"](k, cu_seqlens_k, cfg.coarse_kernel_size,
                                                      cfg.coarse_kernel_stride)
        selected = stages["stage1_select"](
            q, ck1, ck2, cu_seqlens_q, cu_seqlens_c1, cu_seqlens_c2, max_seqlen_q, causal=causal,
            cache_lens=cache_lens, softmax_scale=cfg.softmax_scale, topk=cfg.topk,
                                           local_blocks=cfg.local_blocks,
            init_blocks=cfg.init_blocks, block_size=cfg.block_size, kernel_stride=cfg.kernel_stride,
            coarse_kernel_stride=cfg.coarse_kernel_stride, varlen_offset_quirk=cfg.varlen_offset_quirk,
            score_dtype=cfg.score_dtype, return_scores=need_scores)
        topk_idx, scores, block_scores = selected if need_scores else (selected, None, None)
    return {"ck1": ck1, "ck2": ck2, "cu_seqlens_c1": cu_seqlens_c1, "cu_seqlens_c2": cu_seqlens_c2,
            "scores": scores, "block_scores": block_scores, "topk_idx": topk_idx}


def dense_aux(**given) -> dict:
    """The aux dict of the dense path: no selection; compressed keys only if the caller gave them."""
    keys = ("ck1", "ck2", "cu_seqlens_c1", "cu_seqlens_c2", "scores", "block_scores", "topk_idx")
    return {"dense": True, **{k: given.get(k) for k in keys}}


def _prefill(stages: dict, q, k, v, cu_seqlens_q, cu_seqlens_k, lq: list[int], lk: list[int],
             max_seqlen_q: int,
             max_seqlen_k: int, cfg: InfLLMv2Config, return_aux: bool, kernel_path: bool, compressed=None):
    """The prefill pipeline over checked inputs, with the given stage implementations; `compressed`
    (`ck1, cu_seqlens_c1, ck2, cu_seqlens_c2` of k, or None) skips the compression."""
    if max_seqlen_k < cfg.dense_len:
        out = stages["dense_attn"](q, k, v, cu_seqlens_q, cu_seqlens_k, causal=True,
                                   softmax_scale=cfg.softmax_scale)
        return (out, dense_aux()) if return_aux else out
    if kernel_path:
        check_kernel_path(cfg, q, k, v)
    # host ints, not a device tensor: stage 1 needs max(cache_lens) on the host, which a CUDA tensor
    # would cost a device-to-host sync to give; None (zeros) for a plain prefill, which spares the
    # ints' blocking host-to-device copy as well
    cache_lens = [b - a for a, b in zip(lq, lk)]
    if not any(cache_lens):
        cache_lens = None
    aux = select_blocks(stages, q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, cache_lens, True, cfg,
                        *(compressed or ()), need_scores=return_aux)
    out = stages["sparse_attn"](q, k, v, cu_seqlens_q, cu_seqlens_k, aux["topk_idx"], max_seqlen_q,
                                max_seqlen_k,
                                causal=True, softmax_scale=cfg.softmax_scale, block_size=cfg.block_size)
    return (out, dict(dense=False, **aux)) if return_aux else out


def _check_prefill_lengths(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    """Host lengths, with `max_seqlen_*` checked (or computed when None)."""
    lq, lk = seqlens_host(cu_seqlens_q), seqlens_host(cu_seqlens_k)
    max_seqlen_q = max(lq, default=0) if max_seqlen_q is None else max_seqlen_q
    max_seqlen_k = max(lk, default=0) if max_seqlen_k is None else max_seqlen_k
    check_max_seqlen("max_seqlen_q", max_seqlen_q, lq)
    check_max_seqlen("max_seqlen_k", max_seqlen_k, lk)
    if any(a > b for a, b in zip(lq, lk)):
        raise ValueError(f"cu_seqlens_q: every query length must be <= its key length, got {lq} vs {lk}")
    return lq, lk, max_seqlen_q, max_seqlen_k


def naive_infllmv2_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                             cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                             config: InfLLMv2Config | None = None, *, return_aux: bool = False):
    r"""InfLLM-v2 prefill attention (PyTorch reference of the whole pipeline).

    Keys are mean-compressed (32/16 and 128/64), stage 1 scores them for every query token, the scores
    are max-pooled into 64-token blocks with the init and local blocks forced, the top
    `K = topk + local_blocks` blocks are kept (the forced ones among them; see `InfLLMv2Config`), and
    stage 2 attends causally (bottom-right aligned) over them. Stage 1 takes no gradient; `q`, `k`,
    `v` get theirs through stage 2. When the longest key
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
    check_flags(return_aux=return_aux)
    check_attn_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k)
    check_max_seqlen("max_seqlen_q", max_seqlen_q, [])
    check_max_seqlen("max_seqlen_k", max_seqlen_k, [])
    lq, lk, _, _ = _check_prefill_lengths(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return _prefill(stages_for(q, "reference"), q, k, v, cu_seqlens_q, cu_seqlens_k, lq, lk, max_seqlen_q,
                    max_seqlen_k, cfg, return_aux, kernel_path=False)


def infllmv2_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                       cu_seqlens_k: torch.Tensor | None = None, max_seqlen_q: int | None = None,
                       max_seqlen_k: int | None = None, config: InfLLMv2Config | None = None, *,
                       backend: str = "auto", return_aux: bool = False):
    r"""InfLLM-v2 prefill attention: compression -> stage 1 -> top-k -> stage 2, on kernels where they exist.

    Same semantics as `naive_infllmv2_attention` (MiniCPM4 defaults: kernels 32/16 and 128/64,
    64-key blocks, `topk = 64` with `local_blocks = 32`: K = 96 blocks per query token, of which
    1 init and 33 local blocks are forced and 62 picked by score (`InfLLMv2Config`), dense attention
    when the longest key sequence is shorter than `dense_len = 8192`). Causal masking is aligned
    bottom-right, so a query chunk shorter than its keys (chunked prefill) sees the cache. With
    `block_size = 2`, `Lq = 2`, `Lk = 6` and a token that selected blocks `{0, 2}` (the last query):

        keys   0 1 2 3 4 5
        mask   1 1 0 0 1 1

    Which implementation runs each stage (`stages_for`): for CUDA tensors with `backend` "auto" or
    "kernels", key compression, stage 1 (scores, pooling, top-k in one launch) and stage 2 are the
    CUDA kernels, and the dense fallback is torch SDPA per sequence. `backend="reference"` runs every stage's
    reference; CPU tensors always do.

    Gradients: `q`, `k` and `v` get theirs through stage 2 (the stage-2 backward kernel on the
    kernel path, autograd of the reference otherwise) or through the dense fallback (SDPA's own
    backward); compression, stage 1 and top-k run under `torch.no_grad()` and give none, as in
    InfLLM-v2 (the selection is not trained).

    Args:
        q (torch.Tensor):
            Queries `[total_q, HQ, D]`. Kernel path: bf16 or fp16, `D` in {64, 128}.
        k, v (torch.Tensor):
            Keys (post-RoPE) and values `[total_k, H, D]`, q's dtype; `HQ` a multiple of `H`.
        cu_seqlens_q (torch.Tensor):
            int32 `[B+1]`.
        cu_seqlens_k (torch.Tensor, Optional):
            int32 `[B+1]`, every `Lq <= Lk`. Default: `None` (`cu_seqlens_q`: plain prefill).
        max_seqlen_q, max_seqlen_k (int, Optional):
            Longest query / key sequence. Default: `None` (read from the `cu_seqlens`).
        config (InfLLMv2Config, Optional):
            Default: `None` (MiniCPM4 defaults). The kernel path needs `block_size = 64`.
        backend (str, Optional):
            "auto", "kernels" or "reference". Default: "auto".
        return_aux (bool, Optional):
            Also return the intermediates dict of `naive_infllmv2_attention`. Default: `False`.

    Returns:
        out (torch.Tensor): `[total_q, HQ, D]` in q's dtype (and the aux dict with `return_aux`).

    Raises:
        ValueError: bad inputs (naming the argument), a `backend` outside `BACKENDS`, or what the
            kernel path cannot do (`config.block_size != 64`, dtype, head dim), before any launch.
    """
    cfg = check_config(config)
    check_backend(backend)
    check_flags(return_aux=return_aux)
    if cu_seqlens_k is None:
        # k shares q's cu_seqlens: a mismatch is one of the tensors the user passed, not of a
        # cu_seqlens_k they never gave.
        check_tensor("q", q, ndim=3, dtypes=REF_DTYPES)
        check_tensor("k", k, ndim=3)
        if k.shape[0] != q.shape[0]:
            raise ValueError(f"k has {k.shape[0]} rows but q has {q.shape[0]}: without cu_seqlens_k, k and v "
                             f"share q's cu_seqlens_q (pass cu_seqlens_k for keys longer than the queries)")
        cu_seqlens_k = cu_seqlens_q
    check_attn_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k)
    lq, lk, max_seqlen_q, max_seqlen_k = _check_prefill_lengths(cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                                max_seqlen_k)
    return _prefill(stages_for(q, backend), q, k, v, cu_seqlens_q, cu_seqlens_k, lq, lk, max_seqlen_q,
                    max_seqlen_k, cfg, return_aux, kernel_path=uses_kernels(q, backend))


def infllmv2_attention_host_lengths(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                    cu_seqlens_q: torch.Tensor,
                                    cu_seqlens_k: torch.Tensor, seqlens_q: list[int], seqlens_k: list[int],
                                    config: InfLLMv2Config | None = None, *, backend: str = "auto",
                                    compressed: tuple | None = None) -> torch.Tensor:
    r"""`infllmv2_attention` for a caller that knows the sequence lengths on the host (the transformers
    integration, docs/integrations.md "How the backend maps HF's calls"): the lengths are not read back
    from `cu_seqlens_*` (a device-to-host sync per call), and `compressed` may hand over k's compressed
    keys (e.g. a `DecodeCache`'s) instead of compressing k again. Same outputs as `infllmv2_attention`
    when `compressed` is what `compress_k` gives for k.

    Args:
        q, k, v, cu_seqlens_q, cu_seqlens_k, config, backend:
            As in `infllmv2_attention` (`cu_seqlens_k` required).
        seqlens_q, seqlens_k (list[int]):
            Per-sequence query and key lengths, the differences of `cu_seqlens_q` / `cu_seqlens_k`
            (trusted: only their sums and `Lq <= Lk` are checked, on the host).
        compressed (tuple, Optional):
            `(ck1, cu_seqlens_c1, ck2, cu_seqlens_c2)` of k with the config's kernel sizes and strides
            (packed varlen, as `compress_k` returns them), or None to compress here. Default: `None`.

    Returns:
        out (torch.Tensor): `[total_q, HQ, D]` in q's dtype.
    """
    cfg = check_config(config)
    check_backend(backend)
    check_attn_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k)
    for name, lens, total, cu in (("seqlens_q", seqlens_q, q.shape[0], cu_seqlens_q),
                                  ("seqlens_k", seqlens_k, k.shape[0], cu_seqlens_k)):
        if (not isinstance(lens, (list, tuple)) or len(lens) != cu.numel() - 1
                or any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in lens)
                or sum(lens) != total):
            raise ValueError(f"{name} must be {cu.numel() - 1} non-negative ints summing to {total}, got "
                             f"{list(lens)[:16] if isinstance(lens, (list, tuple)) else lens!r}")
    if any(a > b for a, b in zip(seqlens_q, seqlens_k)):
        raise ValueError(f"seqlens_q: every query length must be <= its key length, got {seqlens_q} vs "
                         f"{seqlens_k}")
    if compressed is not None:
        if not isinstance(compressed, (tuple, list)) or len(compressed) != 4:
            raise ValueError("compressed must be (ck1, cu_seqlens_c1, ck2, cu_seqlens_c2) or None")
        for name, t in zip(("ck1", "ck2"), compressed[0::2]):
            check_tensor(name, t, ndim=3, dtypes=(k.dtype,), shape=(None, k.shape[1], k.shape[2]),
                         device=k.device)
        for name, t in zip(("cu_seqlens_c1", "cu_seqlens_c2"), compressed[1::2]):
            check_tensor(name, t, shape=(cu_seqlens_k.numel(),), dtypes=(torch.int32,), device=k.device)
    return _prefill(stages_for(q, backend), q, k, v, cu_seqlens_q, cu_seqlens_k, list(seqlens_q),
                    list(seqlens_k), max(seqlens_q, default=0), max(seqlens_k, default=0), cfg, False,
                    kernel_path=uses_kernels(q, backend), compressed=compressed)


class InfLLMv2Attention(torch.nn.Module):
    r"""`infllmv2_attention` as a module that holds its configuration (no parameters).

    Args:
        config (InfLLMv2Config, Optional):
            Default: `None` (MiniCPM4 defaults).
        backend (str, Optional):
            "auto", "kernels" or "reference" (see `infllmv2_attention`). Default: "auto".

    Example:
        >>> attn = InfLLMv2Attention(InfLLMv2Config(dense_len=0))
        >>> out = attn(q, k, v, cu_seqlens)            # q [total, HQ, D], k, v [total, H, D]
    """

    def __init__(self, config: InfLLMv2Config | None = None, *, backend: str = "auto"):
        super().__init__()
        self.config = check_config(config)
        self.backend = check_backend(backend)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                cu_seqlens_k: torch.Tensor | None = None, max_seqlen_q: int | None = None,
                max_seqlen_k: int | None = None) -> torch.Tensor:
        r"""Attention output `[total_q, HQ, D]`.

        Args:
            q (torch.Tensor):
                `[total_q, HQ, D]`.
            k, v (torch.Tensor):
                `[total_k, H, D]`.
            cu_seqlens_q (torch.Tensor):
                int32 `[B+1]`.
            cu_seqlens_k (torch.Tensor, Optional):
                int32 `[B+1]`. Default: `None` (`cu_seqlens_q`).
            max_seqlen_q, max_seqlen_k (int, Optional):
                Default: `None` (computed from the `cu_seqlens`, one host read).
        """
        return infllmv2_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  self.config, backend=self.backend)

    def extra_repr(self) -> str:
        return f"backend={self.backend!r}, config={self.config}"
