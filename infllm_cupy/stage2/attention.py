"""Public stage-2 ops: InfLLM-v2's token-level sparse attention and its query-block-layout form
(per KV head, or per query head: `qhead_block_sparse_attn_varlen`).

Both go through the custom ops of ops.py (differentiable in q, k, v; torch.compile traces them
without graph breaks): CUDA tensors run kernels_cu/stage2 (one forward and one backward kernel for
both forms), CPU tensors the CPU implementation in cpu.py (the selected blocks only; the
reference's backward) inside the same ops. Layouts with one row
per query head go through the custom ops of qhead.py. `backend="reference"` calls the reference
directly (plain autograd, no custom op).
"""
from __future__ import annotations

import torch

from .._checks import (
    HostSeqlens,
    check_attn_inputs,
    check_flags,
    check_kernel_inputs,
    check_max_seqlen,
    check_softmax_scale,
    check_tensor,
)
from .._kernel_arg import check_kernel
from .._rules import check_backend, check_precision, runs_kernels
from .layout import BlockLayout, check_layout_call
from .naive import naive_block_sparse_attn_varlen, naive_sparse_attn_varlen
from .ops import block_sparse_attn_fwd, sparse_attn_fwd
from .q8_fwd import check_q8_device
from .q8_naive import naive_q8_sparse_attn_varlen
from .qhead import expand_kv, qhead_block_sparse_attn_fwd


def _use_op(backend: str, q: torch.Tensor) -> bool:
    """Whether the call goes through the custom op: everything but `backend="reference"`. The op runs the
    kernels on CUDA tensors and the CPU implementation on CPU tensors (its CPU kernel, so that a CPU
    caller also compiles with `fullgraph=True`), which is the backend rule (`runs_kernels`, whose error
    a CPU tensor under backend="kernels" gets)."""
    runs_kernels(q, backend)
    return backend != "reference"


def _check_common(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, backend):
    """Every check of the op path, before the op. The bounds of `max_seqlen_*` against the real
    lengths ride on the cu_seqlens checks' one host copy each (skipped under torch.compile and with
    INFLLM_CUPY_VALIDATE=0, see `validate_values`)."""
    check_max_seqlen("max_seqlen_q", max_seqlen_q, [])
    check_max_seqlen("max_seqlen_k", max_seqlen_k, [])
    check_attn_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                      max_seqlen_k=max_seqlen_k)
    if backend == "kernels" or q.is_cuda:
        check_kernel_inputs(q, k, v)


def sparse_attn_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                       cu_seqlens_k: torch.Tensor, topk_idx: torch.Tensor, max_seqlen_q: int,
                       max_seqlen_k: int,
                       *, causal: bool = True, softmax_scale: float | None = None, return_lse: bool = False,
                       backend: str = "auto", kernel: str = "auto", host_seqlens: HostSeqlens | None = None,
                       precision: str = "16bit"):
    r"""Attention of each query token over the 64-key blocks its KV head selected (InfLLM-v2 stage 2).

    Query `t` (row `r` of sequence `b`), head `hq`, attends keys `c` of its sequence with
    `c // 64` in `topk_idx[hq // G, t]`, `c < Lk` and, if causal, `c <= r + Lk - Lq` (bottom-right
    aligned, so only the diagonal block is masked inside). Negative (`-1` padding), out-of-range
    and future indices select nothing; duplicates are harmless. A row with no allowed key gives
    output 0 and `lse = +inf`. For `Lq = 2`, `Lk = 5`, blocks of 2 keys and `topk_idx = [[0, -1], [2, 0]]`:

        1 1 0 0 0
        1 1 0 0 1

    Differentiable in `q`, `k` and `v` (the stage-2 backward kernel on CUDA tensors, the
    reference's backward on CPU tensors); `topk_idx`, the `cu_seqlens` and `lse` get no gradient,
    as in InfLLM-v2 (the selection is not trained through this op). The backward is deterministic
    (no float atomics). Goes through the custom op `infllm_cupy::sparse_attn_fwd` (ops.py), so
    `torch.compile(fullgraph=True)` traces it; under compilation the checks that read the
    `cu_seqlens` back to the host are skipped (the shape, dtype and device checks stay).

    Args:
        q (torch.Tensor):
            `[total_q, HQ, D]`, bf16 or fp16 (the reference also takes fp32/float64); D in {64, 128}.
        k, v (torch.Tensor):
            `[total_k, H, D]`, q's dtype, `HQ = G * H` for any G >= 1.
        cu_seqlens_q, cu_seqlens_k (torch.Tensor):
            int32 `[B+1]` on q's device.
        topk_idx (torch.Tensor):
            int32 `[H, total_q, K]`, block indices local to each sequence.
        max_seqlen_q, max_seqlen_k (int):
            Longest query / key sequence (sizes the launch; checked unless INFLLM_CUPY_VALIDATE=0).
        causal (bool, Optional):
            Keyword-only, as every argument after it. Default: `True`.
        softmax_scale (float, Optional):
            Default: `None` (`1 / sqrt(D)`).
        return_lse (bool, Optional):
            Also return `lse`, float32 `[HQ, total_q]`, natural log, no gradient. Default: `False`.
        backend (str, Optional):
            "auto": the custom op, which runs the kernels on CUDA tensors and, on CPU tensors, the
            CPU implementation (`cpu_sparse_attn_varlen`, cpu.py: the selected blocks only) forward
            and the reference's backward; "kernels": the op, refusing what the kernels cannot do (CPU
            tensors, fp32, other head dims); "reference": `naive_sparse_attn_varlen` called directly
            (plain autograd, any dtype, no custom op, so torch.compile graph-breaks on its host reads).
            Default: "auto".
        kernel (str, Optional):
            Which kernels run on CUDA tensors, forward and backward: "auto" (the sm_90a kernels on
            compute capability 9.0, the SM80 kernels elsewhere), "sm80" (the mma.sync kernels, also
            on an H100) or "sm90a" (ValueError on any other capability). The finer choices (step
            shapes, key-range passes, tiles) are the plan's (stage2/plan.py). Ignored by the
            reference. Default: "auto".
        host_seqlens (HostSeqlens, Optional):
            Given by a caller that checked every input against the kernels (the pipeline): the op
            path then skips its checks, and with them their host copy of the `cu_seqlens`. Ignored
            by the reference. Default: `None`.
        precision (str, Optional):
            "16bit": the math above in q's bf16/fp16 with fp32 accumulation. "int8-fp8": the 8-bit
            forward (docs/stage2_q8.md: Q K^T in int8 on K smoothed by its mean, P V in e4m3), within
            its accuracy contract of the 16-bit result (cosine >= 0.999 per head); no gradients (a
            backward through its output raises); CPU tensors run its reference
            (`naive_q8_sparse_attn_varlen`) under every backend but "kernels", CUDA tensors raise
            NotImplementedError until its kernels are verified on hardware. Default: "16bit".

    Returns:
        out (torch.Tensor): `[total_q, HQ, D]` in q's dtype; and `lse` with `return_lse`.
    """
    check_kernel(kernel)
    check_flags(causal=causal, return_lse=return_lse)
    if check_precision(precision) == "int8-fp8":
        runs_kernels(q, backend)                   # the backend rule's errors first (CPU and "kernels")
        check_q8_device(q)
        return naive_q8_sparse_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, topk_idx, max_seqlen_q,
                                           max_seqlen_k, causal=causal, softmax_scale=softmax_scale,
                                           return_lse=return_lse, host_seqlens=host_seqlens)
    if not _use_op(backend, q):
        return naive_sparse_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, topk_idx, max_seqlen_q,
                                        max_seqlen_k,
                                        causal=causal, softmax_scale=softmax_scale, return_lse=return_lse)
    if host_seqlens is None:
        _check_common(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, backend)
        check_tensor("topk_idx", topk_idx, ndim=3, dtypes=(torch.int32,),
                     shape=(k.shape[1], q.shape[0], None), device=q.device)
    out, lse = sparse_attn_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, topk_idx, max_seqlen_q, max_seqlen_k,
                               bool(causal), check_softmax_scale(softmax_scale, q.shape[2]), kernel)
    return (out, lse) if return_lse else out


def block_sparse_attn_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                             cu_seqlens_k: torch.Tensor, layout: BlockLayout, max_seqlen_q: int,
                             max_seqlen_k: int,
                             *, causal: bool = True, softmax_scale: float | None = None,
                             return_lse: bool = False, backend: str = "auto", kernel: str = "auto"):
    r"""Sparse attention under a query-block layout (one selection per query block and KV head).

    Same semantics as `sparse_attn_varlen` with every token of query block `i` selecting the
    64-key blocks `j` with `layout.mask[(b,) h, i, j]`. Differentiable in `q`, `k`, `v` (the layout
    gets no gradient), through the custom op `infllm_cupy::block_sparse_attn_fwd`. A layout with one
    row per query head (HQ heads, HQ != H) runs `qhead_block_sparse_attn_varlen` (the kernels'
    per-query-head instances, K/V not repeated; docs/patterns.md, "Per query head vs per KV head").

    Args:
        layout (BlockLayout):
            `mask` bool `[H, NQB, NKB]` or `[B, H, NQB, NKB]` over 64-key blocks, and `q_block`; or
            the same with HQ (q's heads) in place of H: one row per query head.
        Others: as `sparse_attn_varlen`.

    Returns:
        out (torch.Tensor): `[total_q, HQ, D]`; and `lse` with `return_lse`.
    """
    B = check_layout_call(layout, q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k)
    check_kernel(kernel)
    check_flags(causal=causal, return_lse=return_lse)
    hq = q.shape[1]
    if hq is not None and layout.num_kv_heads == hq != k.shape[1]:
        # one row per query head
        return qhead_block_sparse_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, layout, max_seqlen_q,
                                              max_seqlen_k,
                                              causal=causal, softmax_scale=softmax_scale,
                                              return_lse=return_lse, backend=backend, kernel=kernel)
    layout.check_against(k.shape[1], B, max_seqlen_q, max_seqlen_k, num_q_heads=hq)
    if not _use_op(backend, q):
        return naive_block_sparse_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, layout, max_seqlen_q,
                                              max_seqlen_k,
                                              causal=causal, softmax_scale=softmax_scale,
                                              return_lse=return_lse)
    _check_common(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, backend)
    out, lse = block_sparse_attn_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, layout.mask.to(q.device),
                                     layout.q_block,
                                     max_seqlen_q, max_seqlen_k, bool(causal),
                                     check_softmax_scale(softmax_scale, q.shape[2]), kernel)
    return (out, lse) if return_lse else out


def qhead_block_sparse_attn_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
    layout: BlockLayout, max_seqlen_q: int, max_seqlen_k: int, *, causal: bool = True,
    softmax_scale: float | None = None, return_lse: bool = False, backend: str = "auto", kernel: str = "auto",
):
    r"""`block_sparse_attn_varlen` under a layout with one row per query head.

    Query head `hq` of token t in query block i attends the 64-key blocks j with
    `layout.mask[(b,) hq, i, j]`, over KV head `hq // G`'s keys; otherwise the semantics of
    `block_sparse_attn_varlen` (causal bottom-right, empty rows give 0 and `lse = +inf`).
    Differentiable in q, k, v. `block_sparse_attn_varlen` calls this for a layout with HQ heads
    (HQ != H).

    Args:
        layout (BlockLayout): `mask` bool `[HQ, NQB, NKB]` or `[B, HQ, NQB, NKB]` (HQ = q's heads).
        backend (str, Optional): "auto" (the per-query-head kernels on CUDA tensors, forward and
            backward, the expanded CPU implementation on CPU tensors), "kernels" (refuses CPU tensors) or
            "reference" (the expanded path through `block_sparse_attn_varlen(..., backend="reference")`).
            Default: "auto".
        Others: as `block_sparse_attn_varlen`.

    Returns:
        out (torch.Tensor): `[total_q, HQ, D]`; and `lse` `[HQ, total_q]` with `return_lse`.
    """
    B = check_layout_call(layout, q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k)
    check_kernel(kernel)
    check_flags(causal=causal, return_lse=return_lse)
    backend = check_backend(backend)
    for name, t in (("q", q), ("k", k)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{name} must be a 3-D tensor [total, heads, D], got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    HQ, H = q.shape[1], k.shape[1]
    if H == 0 or HQ % H:
        raise ValueError(f"q has {HQ} heads and k has {H}: the query head count must be a positive multiple "
                         f"of the key/value head count")
    if layout.num_kv_heads != HQ:
        raise ValueError(f"layout has {layout.num_kv_heads} heads but q has {HQ}: a per-query-head layout "
                         f"has one row per query head (a per-KV-head one goes to block_sparse_attn_varlen)")
    if not runs_kernels(q, backend):
        G = HQ // H
        ke, ve = expand_kv(k, v, G)
        return block_sparse_attn_varlen(q, ke, ve, cu_seqlens_q, cu_seqlens_k, layout, max_seqlen_q,
                                        max_seqlen_k,
                                        causal=causal, softmax_scale=softmax_scale, return_lse=return_lse,
                                        backend=backend, kernel=kernel)
    layout.check_against(HQ, B, max_seqlen_q, max_seqlen_k)
    _check_common(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, backend)
    out, lse = qhead_block_sparse_attn_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, layout.mask.to(q.device),
                                           layout.q_block, max_seqlen_q, max_seqlen_k, bool(causal),
                                           check_softmax_scale(softmax_scale, q.shape[2]), kernel)
    return (out, lse) if return_lse else out
