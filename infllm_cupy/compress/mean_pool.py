"""Launcher of kernels_cu/compress/mean_pool.cu: key compression on the GPU."""
from __future__ import annotations

import torch

from .. import _jit
from .._checks import HostSeqlens, check_aligned, check_compress_args
from .._launch import CXX_TYPE, empty, launch
from .._params import KernelParams, constants
from .._rules import HEAD_DIMS, cdiv, n_windows, runs_cpu, runs_kernels
from .cpu import cpu_compress_k
from .naive import compressed_cu_seqlens, naive_compress_k

SOURCE = "compress/mean_pool.cu"
WARPS = 4  # warps per CTA, one per (compressed key, head)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
constants(SOURCE, WARPS=WARPS)
MEAN_POOL_PARAMS = KernelParams(SOURCE, "CompressMeanPoolParams<float>", """
    ptr k, cu_seqlens_k, cu_seqlens_c, out
    i32 batch, total_c, H, kernel_size, kernel_stride
""")

_jit.register_instances(SOURCE,
                        [f"compress_mean_pool<{CXX_TYPE[t]}, {d}>" for t in DTYPES for d in HEAD_DIMS])


def compress_k(k: torch.Tensor, cu_seqlens_k: torch.Tensor, kernel_size: int = 32, kernel_stride: int = 16,
               *, backend: str = "auto", host_seqlens: HostSeqlens | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Mean of the keys over every complete window of each sequence (InfLLM-v2 key compression).

    Args:
        k (torch.Tensor):
            Keys `[total_k, H, D]`, packed varlen. The kernel takes bf16/fp16/fp32 and D in {64, 128}.
        cu_seqlens_k (torch.Tensor):
            int32 `[B+1]` on k's device.
        kernel_size, kernel_stride (int):
            Window length and step: 32/16 (fine keys) or 128/64 (coarse keys). Default: 32, 16.
        backend (str, Optional):
            "auto" (the kernel for CUDA tensors, the CPU implementation `cpu_compress_k` for CPU
            tensors: the oracle's result in bounded chunks), "kernels" or "reference" (the oracle
            `naive_compress_k` on any device).
        host_seqlens (HostSeqlens, Optional):
            `cu_seqlens_k` on the host (`host_seqlens.k`) from a caller that checked every input (the
            pipeline): the kernel path then skips its input checks and reads nothing back. Ignored on
            CPU. Default: `None`.

    Returns:
        ck (torch.Tensor): `[total_c, H, D]`, k's dtype; window `i` of sequence `b` is the fp32 mean of
            `k[s_b + i*stride : s_b + i*stride + kernel]`. Only complete windows exist, so a sequence
            shorter than `kernel_size` contributes none.
        cu_seqlens_c (torch.Tensor): int32 `[B+1]`.

    Sizing the output reads `cu_seqlens_c[-1]` back to the host (one sync), unless `host_seqlens` gives it.
    """
    if not runs_kernels(k, backend, "k"):
        impl = cpu_compress_k if runs_cpu(k, backend) else naive_compress_k
        return impl(k, cu_seqlens_k, kernel_size, kernel_stride)
    if host_seqlens is None:
        check_compress_args(k, cu_seqlens_k, kernel_size, kernel_stride, dtypes=DTYPES)
    if not k.is_cuda:
        raise ValueError(f"k must be a CUDA tensor for backend='kernels', got one on {k.device}")
    _total_k, H, D = k.shape
    if D not in HEAD_DIMS:
        raise ValueError(f"k has head dim {D}; the compression kernel supports {HEAD_DIMS}")
    k = k.contiguous()
    check_aligned(k=k)                     # rows read in 4- or 8-byte vectors
    cu_c = compressed_cu_seqlens(cu_seqlens_k, kernel_size, kernel_stride)
    total_c = (int(cu_c[-1]) if host_seqlens is None
               else sum(n_windows(L, kernel_size, kernel_stride) for L in host_seqlens.lk))
    out = empty((total_c, H, D), dtype=k.dtype, device=k.device)
    if total_c == 0:
        return out, cu_c
    name = f"compress_mean_pool<{CXX_TYPE[k.dtype]}, {D}>"
    launch(_jit.get_kernel(SOURCE, name), name=name,
           grid=(cdiv(total_c * H, WARPS),), block=(32 * WARPS,),
           params=MEAN_POOL_PARAMS.pack(k=k, cu_seqlens_k=cu_seqlens_k, cu_seqlens_c=cu_c, out=out,
                                        batch=cu_seqlens_k.numel() - 1, total_c=total_c, H=H,
                                        kernel_size=kernel_size, kernel_stride=kernel_stride))
    return out, cu_c
