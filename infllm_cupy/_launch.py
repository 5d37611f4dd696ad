"""Pointer, scalar, allocation and stream helpers shared by every launcher.

Kernels receive raw device pointers and NumPy-typed scalars: CuPy sends a Python `float` as a
C `double`, which a `float` parameter reads as garbage, so every scalar goes through `np.int32`,
`np.int64` or `np.float32` here. Launches run on torch's current stream, so ordering with torch's
own work needs no synchronisation.
"""
from __future__ import annotations

import os

import numpy as np
import torch

CXX_TYPE = {torch.float16: "__half", torch.bfloat16: "__nv_bfloat16", torch.float32: "float"}

POISON_ENV = "INFLLM_CUPY_POISON"


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def ptr(t: torch.Tensor) -> np.uint64:
    """Device pointer of a contiguous CUDA tensor, as a kernel argument."""
    if not t.is_cuda:
        raise ValueError(f"expected a CUDA tensor, got one on {t.device}")
    if not t.is_contiguous():
        raise ValueError("kernels read contiguous tensors; call .contiguous() first")
    return np.uint64(t.data_ptr())


def current_stream():
    """CuPy view of torch's current stream on the current device."""
    import cupy

    return cupy.cuda.Stream.from_external(torch.cuda.current_stream())


def empty(shape, *, dtype: torch.dtype, device) -> torch.Tensor:
    """Allocate a kernel output. With INFLLM_CUPY_POISON=1 (set by the tests) floating outputs are
    NaN-filled and integer outputs filled with a sentinel, so an element the kernel never writes fails."""
    if os.environ.get(POISON_ENV) == "1":
        fill = float("nan") if dtype.is_floating_point else -(2**30)
        return torch.full(shape, fill, dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def launch(kernel, *, name: str, grid, block, args, shared_mem: int = 0) -> None:
    """Launch `kernel` on torch's current stream, with the kernel's name in any error."""
    import cupy

    grid = tuple(int(g) for g in grid)
    if any(g <= 0 for g in grid):
        return  # nothing to do: an empty grid is not a launch error
    if shared_mem > 48 * 1024 and kernel.max_dynamic_shared_size_bytes < shared_mem:
        kernel.max_dynamic_shared_size_bytes = shared_mem
    try:
        with torch.cuda.device(torch.cuda.current_device()):
            kernel(grid, tuple(int(b) for b in block), args, shared_mem=shared_mem, stream=current_stream())
    except cupy.cuda.driver.CUDADriverError as e:
        raise RuntimeError(f"launch of kernel {name} failed (grid={grid}, block={block}, "
                           f"shared_mem={shared_mem}): {e}") from e
