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


def total_memory(device: torch.device) -> int:
    """Bytes of memory of CUDA `device` (the memory budgets of the plans are shares of it)."""
    return _total_memory_of(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _total_memory_of(device_index: int) -> int:
    return int(torch.cuda.get_device_properties(device_index).total_memory)


# The shapes behind the pointers handed out lately, so that a failed launch can name what its pointer
# arguments were (docs/reliability.md, "The run-time compiler under faults"): one dict store per
# pointer (dtype and torch.Size references, formatted only on failure), forgotten past 1024 entries.
_PTR_SHAPES: dict = {}
_PTR_SHAPES_MAX = 1024


def _remember(address: int, t: torch.Tensor) -> None:
    if len(_PTR_SHAPES) >= _PTR_SHAPES_MAX:
        _PTR_SHAPES.clear()
    _PTR_SHAPES[address] = (t.dtype, t.shape)


def ptr(t: torch.Tensor) -> np.uint64:
    """Device pointer of a contiguous CUDA tensor, as a kernel argument."""
    if not t.is_cuda:
        raise ValueError(f"expected a CUDA tensor, got one on {t.device}")
    if not t.is_contiguous():
        raise ValueError("kernels read contiguous tensors; call .contiguous() first")
    address = t.data_ptr()
    _remember(address, t)
    return np.uint64(address)


def describe_args(args) -> str:
    """The kernel arguments in words: pointers as the tensors they came from (`bfloat16[1000, 32,
    128]`, when `ptr` made them), scalars as `int32 5`, tensor maps by their size."""
    out = []
    for i, a in enumerate(args):
        if isinstance(a, np.uint64):
            known = _PTR_SHAPES.get(int(a))
            what = f"{str(known[0]).replace('torch.', '')}{list(known[1])}" if known else "pointer"
            out.append(f"arg{i}={what}@{int(a):#x}" if int(a) else f"arg{i}=nullptr")
        elif isinstance(a, np.generic):
            out.append(f"arg{i}={a.dtype} {a.item()!r}")
        elif isinstance(a, np.ndarray):
            out.append(f"arg{i}=array {a.dtype}{list(a.shape)}")
        else:
            out.append(f"arg{i}={type(a).__name__}")
    return ", ".join(out)


def launch_error(name: str, grid, block, shared_mem: int, args, err: BaseException) -> RuntimeError:
    """The exception a failed launch raises: the kernel, its launch shape and its arguments' shapes."""
    return RuntimeError(f"launch of kernel {name} failed: {err}\n  grid={tuple(grid)}, block={tuple(block)}, "
                        f"dynamic shared memory={shared_mem} B\n  arguments: {describe_args(args)}")


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
    block = tuple(int(b) for b in block)
    try:
        if shared_mem > 48 * 1024 and kernel.max_dynamic_shared_size_bytes < shared_mem:
            kernel.max_dynamic_shared_size_bytes = shared_mem
        with torch.cuda.device(torch.cuda.current_device()):
            stream = current_stream()
            if pdl:
                _launch_programmatic(kernel, grid, block, args, shared_mem, stream.ptr)
            else:
                kernel(grid, block, args, shared_mem=shared_mem, stream=stream)
    except (cupy.cuda.driver.CUDADriverError, cupy.cuda.runtime.CUDARuntimeError, _DriverError) as e:
        raise launch_error(name, grid, block, shared_mem, args, e) from e


class _DriverError(RuntimeError):
    pass


class _LaunchAttribute(ctypes.Structure):      # CUlaunchAttribute (cuda.h): id, 4 pad bytes, 64-byte value
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_char * 64)]


class _LaunchConfig(ctypes.Structure):         # CUlaunchConfig (cuda.h)
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_mem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)),
                ("num_attrs", ctypes.c_uint)]


_PROGRAMMATIC_STREAM_SERIALIZATION = 6          # CUlaunchAttributeID (cuda.h)


@functools.cache
def _driver():
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p,
                                     ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
    lib.cuLaunchKernelEx.restype = ctypes.c_int
    lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    u = ctypes.c_uint
    lib.cuLaunchKernel.argtypes = [ctypes.c_void_p, u, u, u, u, u, u, u, ctypes.c_void_p, ctypes.c_void_p,
                                   ctypes.c_void_p]
    lib.cuLaunchKernel.restype = ctypes.c_int
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
    grid3, block3 = (*grid, 1, 1)[:3], (*block, 1, 1)[:3]
    res = _launch_ex(ctypes.c_void_p(kernel.kernel.ptr), grid3, block3, shared_mem, stream, params)
    if res != 0:
        raise _DriverError(f"cuLaunchKernelEx: error {res} ({_error_string(res)})")


# ------------------------------------------------------------------------------ prepared launches
# The eager decode step is a handful of tiny kernels (docs/decode.md, 6. CUDA graphs and host
# synchronisation), so what one launch costs on the host decides its speed. CuPy's kernel call
# converts every argument on every call; a `PreparedLaunch` packs the arguments once into 8-byte
# slots (the driver reads sizeof(parameter) bytes from each slot's address, so an int32 or a float
# sits in the low 4 bytes of its slot) and later calls change only the slots that differ (the
# pointers of per-call tensors) before one cuLaunchKernel through ctypes.


def pack_arg(a) -> int:
    """A kernel argument's 8-byte slot value: pointers and 64-bit ints as they are, 32-bit ints and
    floats as their bits in the low 4 bytes."""
    if isinstance(a, np.uint64):
        return int(a)
    if isinstance(a, (np.int32, np.uint32, np.float32)):
        return int(np.asarray(a).view(np.uint32))
    if isinstance(a, (np.int64, np.float64)):
        return int(np.asarray(a).view(np.uint64))
    raise TypeError("prepared kernel arguments are NumPy scalars (pointers as np.uint64, np.int32, "
                    f"np.int64, np.float32), got {type(a).__name__}")


class PreparedLaunch:
    """One kernel launch whose arguments are packed once (`args`: NumPy scalars, as `launch` takes).

    `slots[i]` holds argument i (a pointer's address, or a packed value; a `Program` rewrites the
    pointers of per-call tensors there); `launch(stream)` launches on the raw stream handle `stream`
    (`torch.cuda.current_stream().cuda_stream`), as a
    programmatic dependent of the launch before it when `pdl` (sm_90). Errors raise `launch_error`'s
    message, naming the kernel and its arguments."""

    __slots__ = ("block", "func", "grid", "kernel", "name", "params", "shared_mem", "slots")

    def __init__(self, kernel, *, name: str, grid, block, shared_mem: int, args):
        self.kernel, self.name = kernel, name
        self.grid = tuple(int(g) for g in (*grid, 1, 1)[:3])
        self.block = tuple(int(b) for b in (*block, 1, 1)[:3])
        self.shared_mem = int(shared_mem)
        if self.shared_mem > 48 * 1024 and kernel.max_dynamic_shared_size_bytes < self.shared_mem:
            kernel.max_dynamic_shared_size_bytes = self.shared_mem
        self.slots = np.array([pack_arg(a) for a in args], dtype=np.uint64)
        base = self.slots.ctypes.data
        self.params = (ctypes.c_void_p * max(1, len(args)))(*[base + 8 * i for i in range(len(args))])
        self.func = ctypes.c_void_p(kernel.kernel.ptr)

    def args(self) -> list:
        """The arguments as `describe_args` reads them (every slot as a pointer-sized value)."""
        return [np.uint64(int(s)) for s in self.slots]

    def launch(self, stream: int, pdl: bool = False) -> None:
        lib = _driver()
        if pdl:
            res = _launch_ex(self.func, self.grid, self.block, self.shared_mem, stream, self.params)
        else:
            g, b = self.grid, self.block
            res = lib.cuLaunchKernel(self.func, g[0], g[1], g[2], b[0], b[1], b[2], self.shared_mem, stream,
                                     self.params, None)
        if res:
            raise launch_error(self.name, self.grid, self.block, self.shared_mem, self.args(), _DriverError(
                f"cuLaunchKernel: error {res} ({_error_string(res)})"))


def raw_stream(device_index: int) -> int:
    """Torch's current stream on `device_index` as the driver's handle (torch's C accessor where the
    build has it: a fraction of a microsecond, against a few for `current_stream()`)."""
    get = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if get is not None:
        return get(device_index)
    return torch.cuda.current_stream(device_index).cuda_stream


def _error_string(res: int) -> str:
    msg = ctypes.c_char_p()
    _driver().cuGetErrorString(res, ctypes.byref(msg))
    return (msg.value or b"?").decode()


def _launch_ex(func, grid, block, shared_mem: int, stream: int, params) -> int:
    """cuLaunchKernelEx with programmatic stream serialization; returns the driver's status."""
    attr = _LaunchAttribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION)
    # the value's raw bytes: a c_char array initialised from bytes would stop at the first NUL
    value = (1).to_bytes(4, "little")
    ctypes.memmove(ctypes.addressof(attr) + _LaunchAttribute.value.offset, value, len(value))
    cfg = _LaunchConfig((ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(*block), shared_mem,
                        ctypes.c_void_p(stream), ctypes.pointer(attr), 1)
    return _driver().cuLaunchKernelEx(ctypes.byref(cfg), func, params, None)
