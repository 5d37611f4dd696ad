"""Launchers of the 8-bit stage-2 forward (`precision="int8-fp8"`, docs/stage2_q8.md): the quantization
kernels (kernels_cu/stage2/q8_quantize.cu: `q8_kv_stats`, `q8_quantize_q`, `q8_quantize_k`) and the
attention kernel (kernels_cu/stage2/q8_fwd.cu: `q8_fwd`, mma.sync for sm_89 / sm_90, compiled for sm_90a).

The kernels have not yet run on a GPU: until their GPU tests (tests/stage2/test_q8_fwd.py) have passed
on one, every CUDA tensor on this plan is refused (`check_q8_device`, also at the top of `q8_quantize`
and `q8_fwd`) and CPU tensors run the plan's reference (stage2/q8_naive.py). The CPU suite compiles
every instance (tests/test_jit.py, the slow compile test; docs/stage2_q8.md §6)."""
from __future__ import annotations

import math

import torch

from .. import _env, _jit
from .._checks import HostSeqlens
from .._dtypes import KERNEL_DTYPES
from .._launch import CXX_TYPE, empty, launch
from .._params import KernelParams, constants
from .._rules import HEAD_DIMS, KV_BLOCK, cdiv
from .plan import n_mask_words
from .q8_naive import PLAN, Q8Operands, k_scale_slots
from .sparse_fwd import token_block_masks

# Flipped once the GPU tests of the 8-bit kernels pass on a GPU (docs/stage2_q8.md §7).
VERIFIED_ON_HARDWARE = False

QUANT_SOURCE = "stage2/q8_quantize.cu"
FWD_SOURCE = "stage2/q8_fwd.cu"
QUANT_WARPS = 8          # warps per CTA of q8_quantize_q, one per (token, query head) row
FWD_ROWS = 64            # (token, head) rows per CTA of q8_fwd: 64 / G tokens
FWD_THREADS = 128
constants(QUANT_SOURCE, WARPS=QUANT_WARPS, BLOCK_N=KV_BLOCK)
constants(FWD_SOURCE, BLOCK_N=KV_BLOCK, ROWS=FWD_ROWS, NWARPS=FWD_THREADS // 32)

STATS_PARAMS = KernelParams(QUANT_SOURCE, "Q8KvStatsParams<float>", """
    ptr k, v, cu_seqlens_k, k_mean, v8, v_scale
    i32 H, D
""")
QUANT_Q_PARAMS = KernelParams(QUANT_SOURCE, "Q8QuantizeQParams<float>", """
    ptr q, q8, q_scale
    i64 rows
    i32 D
""")
QUANT_K_PARAMS = KernelParams(QUANT_SOURCE, "Q8QuantizeKParams<float>", """
    ptr k, cu_seqlens_k, k_mean, k8, k_scale
    i32 H, D, n_slots
""")
FWD_PARAMS = KernelParams(FWD_SOURCE, "Q8FwdParams<float>", """
    ptr q8, q_scale, k8, k_scale, v8, v_scale, masks, cu_seqlens_q, cu_seqlens_k, out
    i32 total_q, H, G, n_words, n_slots
    f32 scale_log2
    i32 causal
""")

_jit.register_instances(QUANT_SOURCE, [f"{k}<{CXX_TYPE[dt]}>" for k in ("q8_kv_stats", "q8_quantize_q",
                                                                         "q8_quantize_k")
                                       for dt in KERNEL_DTYPES], sm90a=True)
_jit.register_instances(FWD_SOURCE, [f"q8_fwd<{CXX_TYPE[dt]}, {d}>" for dt in KERNEL_DTYPES
                                     for d in HEAD_DIMS], sm90a=True)


def check_q8_device(t: torch.Tensor, name: str = "q") -> None:
    """Raise NotImplementedError for a CUDA tensor `name` on the 8-bit plan while its kernels are not
    verified on hardware (`VERIFIED_ON_HARDWARE`)."""
    if isinstance(t, torch.Tensor) and t.is_cuda and not VERIFIED_ON_HARDWARE:
        raise NotImplementedError(
            f"{PLAN} on CUDA tensors ({name} is on {t.device}): the 8-bit kernels are not yet verified on "
            f"hardware (they compile, but their GPU tests have never run); run this plan on CPU tensors "
            f"(its reference) or use precision='16bit' on the GPU")


def _int8_out(shape, device) -> torch.Tensor:
    """An int8 kernel output; poisoned (INFLLM_CUPY_POISON, `_env`) with -128, which no quantized value
    takes (the grid is -127..127), so an element the kernel never writes fails the bit-for-bit test."""
    if _env.poison():
        return torch.full(shape, -128, dtype=torch.int8, device=device)
    return torch.empty(shape, dtype=torch.int8, device=device)


def q8_quantize(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                cu_seqlens_k: torch.Tensor, host: HostSeqlens) -> Q8Operands:
    """`naive_q8_quantize` on the GPU (q8_quantize.cu): the same operands and scales, bit for bit but
    for K's mean (its float64 sum in key order; docs/stage2_q8.md §2). Inputs checked by the caller
    (bf16 / fp16, D in {64, 128}, contiguous, on one CUDA device)."""
    check_q8_device(q)
    total_q, HQ, D = q.shape
    total_k, H, _ = k.shape
    B = len(host.k) - 1
    dev = q.device
    # k_scale's columns no block maps to stay unwritten (poisoned in tests: they are compared nowhere)
    ops = Q8Operands(q8=_int8_out(q.shape, dev),
                     q_scale=empty((total_q, HQ), dtype=torch.float32, device=dev),
                     k8=_int8_out(k.shape, dev),
                     k_scale=empty((H, k_scale_slots(total_k, B)), dtype=torch.float32, device=dev),
                     k_mean=empty((B, H, D), dtype=torch.float32, device=dev),
                     v8=empty(v.shape, dtype=torch.float8_e4m3fn, device=dev),
                     v_scale=empty((B, H, D), dtype=torch.float32, device=dev))
    if B == 0:
        return ops
    T = CXX_TYPE[q.dtype]
    launch(_jit.get_kernel(QUANT_SOURCE, f"q8_kv_stats<{T}>", sm90a=True), name="q8_kv_stats", grid=(H, B),
           block=(D,), params=STATS_PARAMS.pack(k=k, v=v, cu_seqlens_k=cu_seqlens_k, k_mean=ops.k_mean,
                                                v8=ops.v8, v_scale=ops.v_scale, H=H, D=D))
    if total_q * HQ:
        launch(_jit.get_kernel(QUANT_SOURCE, f"q8_quantize_q<{T}>", sm90a=True), name="q8_quantize_q",
               grid=(cdiv(total_q * HQ, QUANT_WARPS),), block=(32 * QUANT_WARPS,),
               params=QUANT_Q_PARAMS.pack(q=q, q8=ops.q8, q_scale=ops.q_scale, rows=total_q * HQ, D=D))
    max_k = max(host.lk, default=0)
    if max_k:
        launch(_jit.get_kernel(QUANT_SOURCE, f"q8_quantize_k<{T}>", sm90a=True), name="q8_quantize_k",
               grid=(cdiv(max_k, KV_BLOCK), H, B), block=(KV_BLOCK,),
               params=QUANT_K_PARAMS.pack(k=k, cu_seqlens_k=cu_seqlens_k, k_mean=ops.k_mean, k8=ops.k8,
                                          k_scale=ops.k_scale, H=H, D=D, n_slots=ops.k_scale.shape[1]))
    return ops


def q8_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
           cu_seqlens_k: torch.Tensor, topk_idx: torch.Tensor, host: HostSeqlens, causal: bool,
           softmax_scale: float, *, operands: Q8Operands | None = None) -> torch.Tensor:
    """`naive_q8_sparse_attn_varlen`'s output (no lse) on the GPU: `q8_quantize`, the bitmask rows of
    `topk_idx` (`token_block_masks`), then `q8_fwd` over them. `operands`: given ones (a test's) instead
    of quantizing here. Inputs checked by the caller; G = HQ / H at most 64."""
    check_q8_device(q)
    total_q, HQ, D = q.shape
    H = k.shape[1]
    G = HQ // H
    ops = operands if operands is not None else q8_quantize(q, k, v, cu_seqlens_q, cu_seqlens_k, host)
    max_q, max_k = max(host.lq, default=0), max(host.lk, default=0)
    if not (total_q and max_k and topk_idx.shape[2]):
        return torch.zeros_like(q)                # no key anywhere: every row is 0
    out = empty(q.shape, dtype=q.dtype, device=q.device)      # every row written, 0 where no key
    n_words = n_mask_words(max_k)
    masks = token_block_masks(topk_idx.contiguous(), cu_seqlens_q, cu_seqlens_k, n_words)
    launch(_jit.get_kernel(FWD_SOURCE, f"q8_fwd<{CXX_TYPE[q.dtype]}, {D}>", sm90a=True), name="q8_fwd",
           grid=(cdiv(max_q, FWD_ROWS // G), H, len(host.q) - 1), block=(FWD_THREADS,),
           params=FWD_PARAMS.pack(q8=ops.q8, q_scale=ops.q_scale, k8=ops.k8, k_scale=ops.k_scale, v8=ops.v8,
                                  v_scale=ops.v_scale, masks=masks, cu_seqlens_q=cu_seqlens_q,
                                  cu_seqlens_k=cu_seqlens_k, out=out, total_q=total_q, H=H, G=G,
                                  n_words=n_words, n_slots=ops.k_scale.shape[1],
                                  scale_log2=softmax_scale * math.log2(math.e), causal=int(bool(causal))))
    return out
