"""Pointer, scalar, allocation and stream helpers shared by every launcher.

Kernels receive raw device pointers and NumPy-typed scalars: CuPy sends a Python `float` as a
C `double`, which a `float` parameter reads as garbage, so every scalar goes through `np.int32`,
`np.int64` or `np.float32` here. Launches run on torch's current stream, so ordering with torch's
own work needs no synchronisation.
"""
from __future__ import annotations

import ctypes
import functools

import numpy as np
import torch

from . import _env

CXX_TYPE = {torch.float16: "__half", torch.bfloat16: "__nv_bfloat16", torch.float32: "float"}


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
    from ._cupy import import_cupy

    cupy = import_cupy()
    return cupy.cuda.Stream.from_external(torch.cuda.current_stream())


def empty(shape, *, dtype: torch.dtype, device) -> torch.Tensor:
    """Allocate a kernel output. With INFLLM_CUPY_POISON=1 (set by the tests; see `_env`) floating
    outputs are NaN-filled and integer outputs filled with a sentinel, so an element the kernel never
    writes fails."""
    if _env.poison():
        fill = float("nan") if dtype.is_floating_point else -(2**30)
        return torch.full(shape, fill, dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def launch(kernel, *, name: str, grid, block, args, shared_mem: int = 0, pdl: bool = False) -> None:
    """Launch `kernel` on torch's current stream, with the kernel's name in any error.

    `pdl`: launch as a programmatic dependent of the previous kernel in the stream (sm_90: it may
    start before that one ends; the kernel orders itself with griddepcontrol). CuPy has no launch
    with attributes, so this goes to the driver's cuLaunchKernelEx through ctypes."""
    from ._cupy import import_cupy

    cupy = import_cupy()

    grid = tuple(int(g) for g in grid)
    if any(g <= 0 for g in grid):
        return  # nothing to do: an empty grid is not a launch error
    if shared_mem > 48 * 1024 and kernel.max_dynamic_shared_size_bytes < shared_mem:
        kernel.max_dynamic_shared_size_bytes = shared_mem
    block = tuple(int(b) for b in block)
    try:
        with torch.cuda.device(torch.cuda.current_device()):
            stream = current_stream()
            if pdl:
                _launch_programmatic(kernel, grid, block, args, shared_mem, stream.ptr)
            else:
                kernel(grid, block, args, shared_mem=shared_mem, stream=stream)
    except (cupy.cuda.driver.CUDADriverError, _DriverError) as e:
        raise RuntimeError(f"launch of kernel {name} failed (grid={grid}, block={block}, "
                           f"shared_mem={shared_mem}): {e}") from e


class _DriverError(RuntimeError):
    pass


class _LaunchAttribute(ctypes.Structure):      # CUlaunchAttribute (cuda.h): id, 4 pad bytes, 64-byte value
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_char * 64)]


class _LaunchConfig(ctypes.Structure):         # CUlaunchConfig (cuda.h)
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_mem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


_PROGRAMMATIC_STREAM_SERIALIZATION = 6          # CUlaunchAttributeID (cuda.h)


@functools.cache
def _driver():
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p,
                                     ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
    lib.cuLaunchKernelEx.restype = ctypes.c_int
    lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    return lib


def _launch_programmatic(kernel, grid, block, args, shared_mem: int, stream: int) -> None:
    # every argument by address, as cuLaunchKernelEx takes them: NumPy scalars as 0-d arrays of
    # their own type (the kernels' int32 / int64 / float / pointer parameters), tensor maps as
    # their 128 bytes
    bufs = []
    for a in args:
        if isinstance(a, np.ndarray):
            bufs.append(np.ascontiguousarray(a))
        elif isinstance(a, np.generic):
            bufs.append(np.array(a))
        else:
            raise TypeError(f"kernel arguments are NumPy scalars or arrays, got {type(a).__name__}")
    params = (ctypes.c_void_p * len(bufs))(*[b.ctypes.data for b in bufs])
    attr = _LaunchAttribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION, value=(1).to_bytes(4, "little"))
    grid3, block3 = (*grid, 1, 1)[:3], (*block, 1, 1)[:3]
    cfg = _LaunchConfig((ctypes.c_uint * 3)(*grid3), (ctypes.c_uint * 3)(*block3), shared_mem,
                        ctypes.c_void_p(stream), ctypes.pointer(attr), 1)
    lib = _driver()
    res = lib.cuLaunchKernelEx(ctypes.byref(cfg), ctypes.c_void_p(kernel.kernel.ptr), params, None)
    if res != 0:
        msg = ctypes.c_char_p()
        lib.cuGetErrorString(res, ctypes.byref(msg))
        raise _DriverError(f"cuLaunchKernelEx: error {res} ({(msg.value or b'?').decode()})")
