"""The InfLLM-v2 prefill body under the public prefill API (`pipeline.py`), chunked prefill into a
decode cache (`decode/step.py`) and context parallelism: the checks of a prefill call, the choice of
each stage's implementation, and the body that chains the stages (spec section 9): key compression,
stage 1 (scores, block pooling, top-k) under `no_grad`, then stage 2 over the selected blocks; dense
attention (torch SDPA on the kernel and CPU paths) below `dense_len`.

Each stage is one function that calls the kernel or the reference by an `if` on `kernels`
(`run_compress`, `run_stage1`, `run_sparse_attn`, `run_dense_attn`), with the config's fields as named
arguments; `cpu` (`runs_cpu`: "auto" on CPU tensors) picks a stage's CPU implementation over its
reference (compression, stage 1 and stage 2's forward: `compress/cpu.py`, `stage1/cpu.py`,
`stage2/cpu.py`; the dense fallback: torch SDPA). A call is
checked once, at its public entry: `check_prefill_inputs` reads both `cu_seqlens` to the host in one
copy, and the stages below get that copy (`HostSeqlens`, keyword `host_seqlens`), so they neither check
again nor read back.
"""
from __future__ import annotations

import dataclasses
import itertools

import torch

from ._checks import (
    HostSeqlens,
    check_attn_tensors,
    check_attn_values,
    check_flags,
    check_kernel_inputs,
    check_max_seqlen,
    check_softmax_scale,
    validate_values,
)
from ._rules import KV_BLOCK, check_kernel_block, n_windows, runs_cpu, runs_kernels, uses_dense
from .compress.cpu import cpu_compress_k
from .compress.mean_pool import compress_k
from .compress.naive import naive_compress_k
from .config import InfLLMv2Config
from .stage1.cpu import cpu_stage1_select
from .stage1.naive import naive_stage1_select
from .stage1.select import stage1_select
from .stage2.attention import sparse_attn_varlen
from .stage2.naive import naive_dense_attn_varlen, naive_sparse_attn_varlen
from .stage2.q8_fwd import check_q8_device
from .stage2.q8_naive import naive_q8_sparse_attn_varlen

# ------------------------------------------------------------------------------ checks at the entry


def check_kernel_path(cfg: InfLLMv2Config, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Everything the sparse kernel path cannot do, raised before any launch.

    Raises:
        ValueError: `config.block_size` other than 64, or dtypes/head dims/devices the kernels lack.
    """
    check_kernel_block(cfg.block_size, "config.block_size")
    check_kernel_inputs(q, k, v)


def _read_checked(q, k, v, cu_seqlens_q, cu_seqlens_k) -> HostSeqlens:
    """The attention inputs checked (naming the argument) on one host copy of both offsets, returned:
    read even where the values go unchecked (INFLLM_CUPY_VALIDATE=0), since the lengths size the work."""
    check_attn_tensors(q, k, v, cu_seqlens_q, cu_seqlens_k)
    host = HostSeqlens.read(cu_seqlens_q, cu_seqlens_k)
    if validate_values():
        check_attn_values(host, q, k)
    return host


def check_prefill_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None,
                         max_seqlen_k=None) -> tuple[HostSeqlens, int, int]:
    """Every check of a prefill call's tensors and lengths, raising ValueError or TypeError naming the
    argument, with both `cu_seqlens` read in one device-to-host copy.

    Returns:
        `(host_seqlens, max_seqlen_q, max_seqlen_k)`: the offsets on the host for the stages below,
        and the maxima (read from the offsets where None, checked otherwise).
    """
    host = _read_checked(q, k, v, cu_seqlens_q, cu_seqlens_k)
    lq, lk = host.lq, host.lk
    max_seqlen_q = max(lq, default=0) if max_seqlen_q is None else max_seqlen_q
    max_seqlen_k = max(lk, default=0) if max_seqlen_k is None else max_seqlen_k
    check_max_seqlen("max_seqlen_q", max_seqlen_q, lq)
    check_max_seqlen("max_seqlen_k", max_seqlen_k, lk)
    if any(a > b for a, b in zip(lq, lk)):
        raise ValueError(f"cu_seqlens_q: every query length must be <= its key length, got {lq} vs {lk}")
    return host, max_seqlen_q, max_seqlen_k


# ----------------------------------------------------------------------- dense fallback (torch SDPA)

# Elements of one boolean mask chunk of the SDPA fallback when Lq != Lk (bounds its memory).
_SDPA_MASK_ELEMS = 1 << 26


def sdpa_dense_attn_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                           cu_seqlens_k: torch.Tensor, max_seqlen_q: int | None = None,
                           max_seqlen_k: int | None = None, *, causal: bool = True,
                           softmax_scale: float | None = None, return_lse: bool = False,
                           upcast: bool = True, host_seqlens: HostSeqlens | None = None) -> torch.Tensor:
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
        host_seqlens (HostSeqlens, Optional):
            Both offsets on the host from a caller that checked every input (the pipeline): no checks
            and no read back here. Default: `None` (checked and read here, one copy).

    Returns:
        out (torch.Tensor): `[total_q, HQ, D]` in q's dtype.
    """
    check_flags(causal=causal, return_lse=return_lse, upcast=upcast)
    if return_lse:
        raise ValueError("return_lse=True: torch SDPA does not return the log-sum-exp; use "
                         "naive_dense_attn_varlen")
    if host_seqlens is None:
        host_seqlens = _read_checked(q, k, v, cu_seqlens_q, cu_seqlens_k)
        if max_seqlen_q is not None:
            check_max_seqlen("max_seqlen_q", max_seqlen_q, host_seqlens.lq)
        if max_seqlen_k is not None:
            check_max_seqlen("max_seqlen_k", max_seqlen_k, host_seqlens.lk)
    scale = check_softmax_scale(softmax_scale, q.shape[2])
    sdpa = torch.nn.functional.scaled_dot_product_attention
    cu_q, cu_k = host_seqlens.q, host_seqlens.k
    outs = []
    for b, (Lq, Lk) in enumerate(zip(host_seqlens.lq, host_seqlens.lk)):
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


# -------------------------------------------------------------- the stages: kernel or reference

# With `kernels` (`runs_kernels`: CUDA tensors, backend not "reference") each stage runs its kernel
# and takes `host_seqlens` from the checked entry; otherwise, with `cpu` (`runs_cpu`: CPU tensors under
# "auto"), its CPU implementation where it has one; otherwise its reference, which checks and reads its
# own inputs (runs on CPU and CUDA tensors alike).


def run_compress(k: torch.Tensor, cu_seqlens_k: torch.Tensor, kernel_size: int, kernel_stride: int, *,
                 kernels: bool, host_seqlens: HostSeqlens | None = None,
                 cpu: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Key compression: `compress_k`'s kernel, `cpu_compress_k` (`cpu`) or `naive_compress_k`."""
    if kernels:
        return compress_k(k, cu_seqlens_k, kernel_size, kernel_stride, backend="kernels",
                          host_seqlens=host_seqlens)
    return (cpu_compress_k if cpu else naive_compress_k)(k, cu_seqlens_k, kernel_size, kernel_stride)


def run_stage1(q, ck1, ck2, cu_seqlens_q, cu_seqlens_c1, cu_seqlens_c2, max_seqlen_q: int,
               cfg: InfLLMv2Config, *, causal: bool, cache_lens, need_scores: bool, kernels: bool,
               host_seqlens: HostSeqlens | None = None, cpu: bool = False):
    """Stage 1 (scores, block pooling, top-k): `stage1_select` on the fused kernel, on the CPU
    implementation `cpu_stage1_select` (`cpu`) or on the reference `naive_stage1_select`, with the
    config's selection parameters. Returns `topk_idx`, or `(topk_idx, scores, block_scores)` with
    `need_scores` (the kernel skips writing them otherwise)."""
    args = (q, ck1, ck2, cu_seqlens_q, cu_seqlens_c1, cu_seqlens_c2, max_seqlen_q)
    kw = dict(causal=causal, cache_lens=cache_lens, softmax_scale=cfg.softmax_scale, topk=cfg.topk,
              local_blocks=cfg.local_blocks, init_blocks=cfg.init_blocks, block_size=cfg.block_size,
              kernel_stride=cfg.kernel_stride, coarse_kernel_stride=cfg.coarse_kernel_stride,
              varlen_offset_quirk=cfg.varlen_offset_quirk, score_dtype=cfg.score_dtype,
              return_scores=need_scores)
    if not kernels and cpu:
        return cpu_stage1_select(*args, **kw)
    return stage1_select(*args, **kw, backend="kernels" if kernels else "reference",
                         host_seqlens=host_seqlens)


def run_sparse_attn(q, k, v, cu_seqlens_q, cu_seqlens_k, topk_idx, max_seqlen_q: int, max_seqlen_k: int,
                    cfg: InfLLMv2Config, *, causal: bool, kernels: bool, cpu: bool = False,
                    host_seqlens: HostSeqlens | None = None) -> torch.Tensor:
    """Stage 2 over the selected blocks: `sparse_attn_varlen`'s kernels (64-key blocks, checked by
    `check_kernel_path`); else with `cpu` its CPU path (`cpu_sparse_attn`: the CPU implementation's
    forward, the reference's backward); else `naive_sparse_attn_varlen` with the config's block size.
    On `config.precision="int8-fp8"` the 8-bit plan's reference (`naive_q8_sparse_attn_varlen`: its CPU
    implementation and its oracle alike); CUDA tensors are refused (`check_q8_device`) while its
    kernels are not verified on hardware."""
    if cfg.precision == "int8-fp8":
        check_q8_device(q)
        return naive_q8_sparse_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, topk_idx, max_seqlen_q,
                                           max_seqlen_k, causal=causal, softmax_scale=cfg.softmax_scale,
                                           host_seqlens=host_seqlens)
    if kernels:
        return sparse_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, topk_idx, max_seqlen_q, max_seqlen_k,
                                  causal=causal, softmax_scale=cfg.softmax_scale, backend="kernels",
                                  host_seqlens=host_seqlens)
    attend = cpu_sparse_attn if cpu else naive_sparse_attn_varlen
    return attend(q, k, v, cu_seqlens_q, cu_seqlens_k, topk_idx, max_seqlen_q, max_seqlen_k, causal=causal,
                  softmax_scale=cfg.softmax_scale, block_size=cfg.block_size)


def run_dense_attn(q, k, v, cu_seqlens_q, cu_seqlens_k, cfg: InfLLMv2Config, *, causal: bool, kernels: bool,
                   cpu: bool = False, host_seqlens: HostSeqlens | None = None) -> torch.Tensor:
    """Dense attention (the fallback below `dense_len`): torch SDPA per sequence
    (`sdpa_dense_attn_varlen`) with `kernels` or `cpu` (on CPU tensors torch's CPU kernels, 2-3x the
    reference's rate: docs/cpu.md), else `naive_dense_attn_varlen`."""
    if kernels or cpu:
        return sdpa_dense_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=causal,
                                      softmax_scale=cfg.softmax_scale, host_seqlens=host_seqlens)
    return naive_dense_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=causal,
                                   softmax_scale=cfg.softmax_scale)


# ------------------------------------------------------------------------------- the prefill body


def _compressed_offsets(cu_k: tuple[int, ...], kernel_size: int, kernel_stride: int) -> tuple[int, ...]:
    """Host offsets of the compressed keys of keys with offsets `cu_k` (`compressed_cu_seqlens` on ints)."""
    out = [0]
    for a, b in itertools.pairwise(cu_k):
        out.append(out[-1] + n_windows(b - a, kernel_size, kernel_stride))
    return tuple(out)


def select_blocks(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, cache_lens, causal, cfg: InfLLMv2Config,
                  ck1=None, cu_seqlens_c1=None, ck2=None, cu_seqlens_c2=None, *, kernels: bool = False,
                  need_scores: bool = True, host_seqlens: HostSeqlens | None = None,
                  cpu: bool = False) -> dict:
    """Compression (unless given) -> stage 1 (scores, pooling, top-k), without gradients.

    `kernels`: the stages' kernels (`runs_kernels`), else with `cpu` (`runs_cpu`) their CPU
    implementations, else their references. `host_seqlens`: the
    offsets of `cu_seqlens_q` / `cu_seqlens_k` on the host, from a caller that checked the inputs
    (the given compressed keys must then be `compress_k`'s of k with the config's sizes).

    Returns the dict of intermediates (`ck1`, `ck2`, `cu_seqlens_c1/c2`, `scores`, `block_scores`,
    `topk_idx`) that `return_aux` exposes; `scores` and `block_scores` are None unless `need_scores`
    (a stage-1 kernel can then skip writing them).
    """
    check_flags(kernels=kernels, need_scores=need_scores, cpu=cpu)
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__} (the stages are chosen by "
                        f"kernels=, not passed in)")
    host1 = None
    if host_seqlens is not None and kernels:
        # the compressed keys' offsets on the host, for the stage-1 kernel (the references read theirs)
        c1 = _compressed_offsets(host_seqlens.k, cfg.kernel_size, cfg.kernel_stride)
        c2 = c1 if cfg.exact_stage1 else _compressed_offsets(host_seqlens.k, cfg.coarse_kernel_size,
                                                             cfg.coarse_kernel_stride)
        host1 = dataclasses.replace(host_seqlens, c1=c1, c2=c2)
    with torch.no_grad():
        if ck1 is None:
            ck1, cu_seqlens_c1 = run_compress(k, cu_seqlens_k, cfg.kernel_size, cfg.kernel_stride,
                                              kernels=kernels, host_seqlens=host_seqlens, cpu=cpu)
        if cfg.exact_stage1:
            ck2, cu_seqlens_c2 = ck1, cu_seqlens_c1
        elif ck2 is None:
            ck2, cu_seqlens_c2 = run_compress(k, cu_seqlens_k, cfg.coarse_kernel_size,
                                              cfg.coarse_kernel_stride, kernels=kernels,
                                              host_seqlens=host_seqlens, cpu=cpu)
        selected = run_stage1(q, ck1, ck2, cu_seqlens_q, cu_seqlens_c1, cu_seqlens_c2, max_seqlen_q, cfg,
                              causal=causal, cache_lens=cache_lens, need_scores=need_scores, kernels=kernels,
                              host_seqlens=host1, cpu=cpu)
        topk_idx, scores, block_scores = selected if need_scores else (selected, None, None)
    return {"ck1": ck1, "ck2": ck2, "cu_seqlens_c1": cu_seqlens_c1, "cu_seqlens_c2": cu_seqlens_c2,
            "scores": scores, "block_scores": block_scores, "topk_idx": topk_idx}


def dense_aux(**given) -> dict:
    """The aux dict of the dense path: no selection; compressed keys only if the caller gave them."""
    keys = ("ck1", "ck2", "cu_seqlens_c1", "cu_seqlens_c2", "scores", "block_scores", "topk_idx")
    return {"dense": True, **{k: given.get(k) for k in keys}}


def prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, cfg: InfLLMv2Config,
            *, kernels: bool, host_seqlens: HostSeqlens, return_aux: bool = False, compressed=None,
            cpu: bool = False):
    """The prefill body over inputs checked at a public entry (`check_prefill_inputs`, or a caller
    that knows the lengths): dense attention below `dense_len`, else compression, stage 1 and top-k,
    then stage 2 over the selected blocks, causal and bottom-right aligned (a query shorter than its
    keys sees the first `Lk - Lq` keys as its cache).

    `kernels`: the stages' kernels (`runs_kernels`), else with `cpu` (`runs_cpu`) the CPU
    implementations where a stage has one, else the references. `host_seqlens`: both
    offsets on the host; nothing below reads them back. `compressed`: `(ck1, cu_seqlens_c1, ck2,
    cu_seqlens_c2)` of k with the config's sizes, or None to compress here. Returns `out`, and the
    aux dict of `naive_infllmv2_attention` with `return_aux`. `config.precision="int8-fp8"` refuses
    CUDA tensors (`check_q8_device`) whatever the length, before any stage runs.
    """
    if cfg.precision == "int8-fp8":
        check_q8_device(q)
    if uses_dense(cfg.dense_len, max_seqlen_k):
        out = run_dense_attn(q, k, v, cu_seqlens_q, cu_seqlens_k, cfg, causal=True, kernels=kernels,
                             cpu=cpu, host_seqlens=host_seqlens)
        return (out, dense_aux()) if return_aux else out
    if kernels:
        check_kernel_path(cfg, q, k, v)
    # host ints, not a device tensor: stage 1 needs max(cache_lens) on the host, which a CUDA tensor
    # would cost a device-to-host sync to give; None (zeros) for a plain prefill, which spares the
    # ints' blocking host-to-device copy as well
    cache_lens = [b - a for a, b in zip(host_seqlens.lq, host_seqlens.lk)]
    if not any(cache_lens):
        cache_lens = None
    aux = select_blocks(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, cache_lens, True, cfg,
                        *(compressed or ()), kernels=kernels, need_scores=return_aux,
                        host_seqlens=host_seqlens, cpu=cpu)
    out = run_sparse_attn(q, k, v, cu_seqlens_q, cu_seqlens_k, aux["topk_idx"], max_seqlen_q, max_seqlen_k,
                          cfg, causal=True, kernels=kernels, cpu=cpu, host_seqlens=host_seqlens)
    return (out, dict(dense=False, **aux)) if return_aux else out


# ------------------------------------------------------------------------ the stages by name (logs)


def _kernel_compress_k(k, cu_seqlens_k, kernel_size=32, kernel_stride=16):
    """`compress_k` forced onto its kernel, with `naive_compress_k`'s signature."""
    return compress_k(k, cu_seqlens_k, kernel_size, kernel_stride, backend="kernels")


def _kernel_sparse_attn(q, k, v, cu_seqlens_q, cu_seqlens_k, topk_idx, max_seqlen_q, max_seqlen_k, *,
                        causal=True,
                        softmax_scale=None, return_lse=False, block_size: int = 64, upcast: bool = True):
    """`sparse_attn_varlen` on its kernel, taking `naive_sparse_attn_varlen`'s keywords.

    The kernel has no `block_size` (always 64) and always accumulates in fp32 (`upcast=True`).
    """
    check_kernel_block(block_size)
    if upcast is not True:
        raise ValueError("upcast=False (the low-precision reference twin) has no kernel; use "
                         "naive_sparse_attn_varlen")
    return sparse_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, topk_idx, max_seqlen_q, max_seqlen_k,
                              causal=causal, softmax_scale=softmax_scale, return_lse=return_lse,
                              backend="kernels")


def cpu_sparse_attn(q, k, v, cu_seqlens_q, cu_seqlens_k, topk_idx, max_seqlen_q, max_seqlen_k, *, causal=True,
                    softmax_scale=None, return_lse=False, block_size: int = 64, upcast: bool = True):
    """Stage 2's CPU path, taking `naive_sparse_attn_varlen`'s keywords: `sparse_attn_varlen` under
    "auto" on 64-key blocks (the CPU implementation's forward, stage2/cpu.py, and the reference's
    backward), the reference for another block size (which only the references take).

    Always fp32 math (`upcast=True`): the low-precision twin (`upcast=False`) is the reference's.
    """
    if upcast is not True:
        raise ValueError("upcast=False (the low-precision reference twin) has no CPU implementation; use "
                         "naive_sparse_attn_varlen")
    if block_size == KV_BLOCK:
        return sparse_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, topk_idx, max_seqlen_q, max_seqlen_k,
                                  causal=causal, softmax_scale=softmax_scale, return_lse=return_lse)
    return naive_sparse_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, topk_idx, max_seqlen_q, max_seqlen_k,
                                    causal=causal, softmax_scale=softmax_scale, return_lse=return_lse,
                                    block_size=block_size)


_REFERENCE_STAGES = {
    "compress_k": naive_compress_k,
    "stage1_select": naive_stage1_select,
    "sparse_attn": naive_sparse_attn_varlen,
    "dense_attn": naive_dense_attn_varlen,
}


def stages_for(q: torch.Tensor, backend: str = "reference") -> dict:
    """The implementation of each stage for these inputs, by name, for callers that run one stage on
    its own (benchmark rows, context parallelism) and for logs (`stage_names`); the prefill body calls
    the `run_*` functions instead. Each has its reference's signature.

    With CUDA tensors and `backend` "auto" or "kernels": `compress_k` and `sparse_attn` are the
    kernels (`sparse_attn` raises ValueError for a `block_size` other than 64), `dense_attn` is torch
    SDPA (`sdpa_dense_attn_varlen`), and `stage1_select` is the fused stage-1 kernel
    (`infllm_cupy.stage1.select`). With CPU tensors and `backend="auto"` (`runs_cpu`), the CPU
    implementations: `cpu_compress_k`, `cpu_stage1_select`, `cpu_sparse_attn` (stage2/cpu.py's forward,
    the reference's backward) and torch SDPA for `dense_attn`. Otherwise, or with
    `backend="reference"`, every stage is the reference, which runs on CPU and CUDA tensors alike.

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
    if runs_cpu(q, backend):
        stages.update(compress_k=cpu_compress_k, stage1_select=cpu_stage1_select, sparse_attn=cpu_sparse_attn,
                      dense_attn=sdpa_dense_attn_varlen)
    if not runs_kernels(q, backend):
        return stages
    stages.update(compress_k=_kernel_compress_k, stage1_select=stage1_select, sparse_attn=_kernel_sparse_attn,
                  dense_attn=sdpa_dense_attn_varlen)
    return stages


def stage_names(stages: dict) -> dict[str, str]:
    """`{stage: "module.function"}` of a `stages_for` dict, for logs and benchmark tables."""
    return {name: f"{getattr(f, '__module__', '?')}.{getattr(f, '__qualname__', repr(f))}"
            for name, f in stages.items()}
