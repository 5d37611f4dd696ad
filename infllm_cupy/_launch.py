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

from . import _env, _jit

CXX_TYPE = {torch.float16: "__half", torch.bfloat16: "__nv_bfloat16", torch.float32: "float"}


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


def describe_pointer(address: int) -> str:
    """A pointer argument in words: the tensor it came from (`bfloat16[1000, 32, 128]@0x...`, when `ptr`
    made it), else its address."""
    if not address:
        return "nullptr"
    known = _PTR_SHAPES.get(int(address))
    what = f"{str(known[0]).replace('torch.', '')}{list(known[1])}" if known else "pointer"
    return f"{what}@{int(address):#x}"


def describe_args(args) -> str:
    """The kernel arguments in words: pointers as the tensors they came from (`bfloat16[1000, 32,
    128]`, when `ptr` made them), scalars as `int32 5`, tensor maps by their size."""
    out = []
    for i, a in enumerate(args):
        if isinstance(a, np.uint64):
            out.append(f"arg{i}={describe_pointer(int(a))}")
        elif isinstance(a, np.generic):
            out.append(f"arg{i}={a.dtype} {a.item()!r}")
        elif isinstance(a, np.ndarray):
            out.append(f"arg{i}=array {a.dtype}{list(a.shape)}")
        else:
            out.append(f"arg{i}={type(a).__name__}")
    return ", ".join(out)


def launch_error(name: str, grid, block, shared_mem: int, args, err: BaseException) -> RuntimeError:
    """The exception a failed launch raises: the kernel, its launch shape and its arguments' shapes
    (`args`: the arguments, or their description)."""
    described = args if isinstance(args, str) else describe_args(args)
    return RuntimeError(f"launch of kernel {name} failed: {err}\n  grid={tuple(grid)}, block={tuple(block)}, "
                        f"dynamic shared memory={shared_mem} B\n  arguments: {described}")


def empty(shape, *, dtype: torch.dtype, device) -> torch.Tensor:
    """Allocate a kernel output. With INFLLM_CUPY_POISON=1 (set by the tests; see `_env`) floating
    outputs are NaN-filled and integer outputs filled with a sentinel, so an element the kernel never
    writes fails."""
    if _env.poison():
        fill = float("nan") if dtype.is_floating_point else -(2**30)
        return torch.full(shape, fill, dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def launch(kernel, *, name: str, grid, block, params=None, args=(), shared_mem: int = 0,
           pdl: bool = False) -> None:
    """Launch `kernel` on torch's current stream, with the kernel's name and arguments in any error.

    `params`: the kernel's parameter struct (`_params.KernelParams.pack`); `args`: plain arguments
    (NumPy scalars, tensor maps) for the few kernels outside the package's families (tools). `pdl`:
    launch as a programmatic dependent of the previous kernel in the stream (sm_90: it may start
    before that one ends; the kernel orders itself with griddepcontrol)."""
    grid = tuple(int(g) for g in grid)
    if any(g <= 0 for g in grid):
        return  # nothing to do: an empty grid is not a launch error
    index = torch.cuda.current_device()
    prepared = PreparedLaunch(kernel, name=name, grid=grid, block=block, shared_mem=shared_mem,
                              args=(params,) if params is not None else args)
    prepared.launch(raw_stream(index), pdl)


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


# ------------------------------------------------------------------------------ prepared launches
# Every launch goes through one path: the arguments are packed once into host buffers (a kernel's
# parameter struct from `_params`, or 8-byte slots for plain scalars), and each launch is one
# cuLaunchKernel (cuLaunchKernelEx for programmatic dependent launches) through ctypes, reading them
# by address. The eager decode step is a handful of tiny kernels (docs/decode.md, 6. CUDA graphs and
# host synchronisation), so what one launch costs on the host decides its speed: a `Program` packs a
# step's launches once and later calls rewrite only the pointers of per-call tensors.


_NULL = np.uint64(0)


class Packed:
    """A kernel's parameter struct packed for a launch (`_params.KernelParams.pack`): its bytes as
    64-bit words, and its declaration (field offsets, and how to describe it in an error)."""

    __slots__ = ("decl", "words")

    def __init__(self, words: np.ndarray, decl):
        self.words, self.decl = words, decl


def pack_arg(a) -> int:
    """A plain kernel argument's 8-byte slot value: pointers and 64-bit ints as they are, 32-bit ints and
    floats as their bits in the low 4 bytes."""
    if isinstance(a, np.uint64):
        return int(a)
    if isinstance(a, (np.int32, np.uint32, np.float32)):
        return int(np.asarray(a).view(np.uint32))
    if isinstance(a, (np.int64, np.float64)):
        return int(np.asarray(a).view(np.uint64))
    raise TypeError("kernel arguments are parameter structs or NumPy scalars (pointers as np.uint64, "
                    f"np.int32, np.int64, np.float32), got {type(a).__name__}")


def _buffer(a) -> np.ndarray:
    """The host buffer (64-bit words) the driver reads argument `a` from."""
    if isinstance(a, Packed):      # packed for this launch alone: its words are the buffer
        return a.words
    if isinstance(a, np.ndarray):         # a tensor map passed by value
        raw = np.ascontiguousarray(a).view(np.uint8).ravel()
        out = np.zeros(-(-raw.size // 8), dtype=np.uint64)
        out.view(np.uint8)[:raw.size] = raw
        return out
    return np.array([pack_arg(a)], dtype=np.uint64)


class PreparedLaunch:
    """One kernel launch whose arguments are packed once (`args`: `Packed` parameter structs, tensor
    maps, or NumPy scalars).

    `bufs[i]` holds argument i as 64-bit words (a `Program` rewrites the pointers of per-call tensors
    there); `launch(stream)` launches on the raw stream handle `stream`
    (`torch.cuda.current_stream().cuda_stream`), as a programmatic dependent of the launch before it
    when `pdl` (sm_90). Errors raise `launch_error`'s message, naming the kernel and its arguments."""

    __slots__ = ("args", "block", "bufs", "func", "grid", "kernel", "name", "params", "shared_mem")

    def __init__(self, kernel, *, name: str, grid, block, shared_mem: int, args):
        self.kernel, self.name, self.args = kernel, name, tuple(args)
        self.grid = tuple(int(g) for g in (*grid, 1, 1)[:3])
        self.block = tuple(int(b) for b in (*block, 1, 1)[:3])
        self.shared_mem = int(shared_mem)
        if self.shared_mem > 48 * 1024 and kernel.max_dynamic_shared_size_bytes < self.shared_mem:
            kernel.max_dynamic_shared_size_bytes = self.shared_mem
        self.bufs = [_buffer(a) for a in self.args]
        # the driver reads each kernel argument from its own address: a parameter struct's fields are
        # the kernel's arguments in order (kernels_cu/common/params.cuh), each at its offset in the
        # struct (added to the offsets as one array: a Python list of ~30 addresses costs 3x the time)
        parts = [a.decl.offsets_array + b.ctypes.data if isinstance(a, Packed)
                 else np.array([b.ctypes.data], dtype=np.uint64) for a, b in zip(self.args, self.bufs)]
        addresses = np.concatenate(parts) if len(parts) > 1 else parts[0] if parts else np.zeros(1, np.uint64)
        self.params = (ctypes.c_void_p * addresses.size).from_buffer(addresses)   # keeps `addresses` alive
        self.func = ctypes.c_void_p(kernel.kernel.ptr)

    def describe(self) -> str:
        """The arguments in words, as they are packed now."""
        parts = []
        for a, b in zip(self.args, self.bufs):
            if isinstance(a, Packed):
                parts.append(a.decl.describe(b))
            else:
                parts.append(describe_args([a if isinstance(a, np.ndarray) else np.uint64(int(b[0]))]))
        return ", ".join(parts)

    def launch(self, stream: int, pdl: bool = False) -> None:
        lib = _driver()
        if pdl:
            res = _launch_ex(self.func, self.grid, self.block, self.shared_mem, stream, self.params)
        else:
            g, b = self.grid, self.block
            res = lib.cuLaunchKernel(self.func, g[0], g[1], g[2], b[0], b[1], b[2], self.shared_mem, stream,
                                     self.params, None)
        if res:
            err = _DriverError(f"{'cuLaunchKernelEx' if pdl else 'cuLaunchKernel'}: error {res} "
                               f"({_error_string(res)})")
            raise launch_error(self.name, self.grid, self.block, self.shared_mem, self.describe(), err)


class Program:
    """Prepared launches in order, on one device; `run(**bindings)` re-points the named tensors'
    pointer fields (a field that pointed inside a bound tensor at its build keeps its byte offset into
    the new one), writes the named int32 fields given as ints, and launches them all on torch's
    current stream."""

    __slots__ = ("device", "keep", "launches", "pdl", "slots", "sm90")

    def __init__(self, device: torch.device, launches, pdl, slots, keep):
        self.device, self.launches, self.pdl, self.slots, self.keep = device, launches, pdl, slots, keep
        self.sm90 = torch.cuda.get_device_capability(device)[0] >= 9

    def run(self, **bindings) -> None:
        for name, t in bindings.items():
            if type(t) is int:                       # an int32 field's value (`program(scalars=...)`)
                for words, i, _ in self.slots[name]:
                    words[i] = t
                continue
            addr = t.data_ptr()
            for words, i, offset in self.slots[name]:
                words[i] = addr + offset
        index = self.device.index
        if torch.cuda.current_device() != index:
            with torch.cuda.device(index):
                return self._launch(index)
        self._launch(index)

    def _launch(self, index: int) -> None:
        stream = raw_stream(index)
        # programmatic dependent launches only while a graph is captured on sm_90: eagerly their driver
        # call costs more host time than it saves on the GPU (docs/decode.md, 8)
        pdl_ok = self.sm90 and torch.cuda.is_current_stream_capturing()
        for launch, pdl in zip(self.launches, self.pdl):
            launch.launch(stream, pdl and pdl_ok)


class Launches:
    """Collects launches; `run()` launches them in order on torch's current stream of `device`,
    `program(...)` prepares them for replays. Each launch takes a parameter struct (`params`, a
    `_params.KernelParams`, and its field `values`: tensors, contiguous on `device`, None for a
    null pointer, or numbers)."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.items = []

    def add(self, source: str, name: str, grid, block, shared_mem: int, params, values=None, *,
            pdl: bool = False) -> None:
        """`params`: the kernel's `KernelParams` and `values` its fields by name; or `params` a tuple of
        plain arguments in order (tensors, None, NumPy scalars) and no `values`.

        `pdl`: launch as a programmatic dependent of the launch before it while a CUDA graph is being
        captured on sm_90 (a replay then overlaps the two); eagerly, and below sm_90, a plain launch
        (the driver call with launch attributes costs more host time than it saves on the GPU when
        the host is the bottleneck). The kernel must wait (griddepcontrol.wait) before reading that
        launch's output."""
        if values is None:
            params, values = None, tuple(params)
        else:
            values = dict(values)
        self.items.append((source, name, tuple(int(g) for g in grid), tuple(int(b) for b in block),
                           int(shared_mem), params, values, pdl))

    def program(self, *, strict: bool = False, scalars=(), **dynamic: torch.Tensor) -> Program:
        """The launches prepared; each field that is one of the `dynamic` tensors, or a view inside
        one's memory, is re-pointed by `Program.run(name=...)` (at the same byte offset). Other tensor
        fields keep the tensor they were given (the program holds it); with `strict` there may be none,
        so the program holds no device memory and serves any call of the same shapes. The int32 fields
        named in `scalars` take the value `Program.run(name=int)` gives. An empty grid launches
        nothing."""
        launches, pdl, keep = [], [], []
        slots = {name: [] for name in (*dynamic, *scalars)}
        spans = [(dn, dt.data_ptr(), dt.data_ptr() + dt.numel() * dt.element_size())
                 for dn, dt in dynamic.items()]
        with torch.cuda.device(self.device):
            for source, name, grid, block, smem, params, values, p in self.items:
                if not all(g > 0 for g in grid):
                    continue
                # a parameter struct (fields by name), or plain arguments in order (tools' kernels)
                fields = values.items() if params is not None else enumerate(values)
                rebind = []
                for field, v in fields:
                    if isinstance(v, torch.Tensor):
                        bound = _binding(v, dynamic, spans)
                        if bound is not None:
                            rebind.append((bound[0], field, bound[1]))
                        elif strict:
                            raise ValueError(f"a strict program binds every tensor: field {field!r} of "
                                             f"{name} is none of {sorted(dynamic)} and inside none of them")
                        else:
                            keep.append(v)
                if params is not None:
                    args = (params.pack(**values),)
                else:
                    args = tuple(_NULL if a is None else ptr(a) if isinstance(a, torch.Tensor) else a
                                 for a in values)
                launch = PreparedLaunch(_jit.get_kernel(source, name), name=name, grid=grid, block=block,
                                        shared_mem=smem, args=args)
                for dn, field, offset in rebind:
                    if params is not None:
                        slots[dn].append((launch.bufs[0], params.offsets[field] // 8, offset))
                    else:
                        slots[dn].append((launch.bufs[field], 0, offset))
                for field in scalars:
                    if params is not None and params.kinds.get(field) == "i32":
                        slots[field].append((launch.bufs[0].view(np.int32), params.offsets[field] // 4, 0))
                launches.append(launch)
                pdl.append(p)
        return Program(self.device, launches, pdl, slots, keep)

    def run(self) -> None:
        self.program().run()


def _binding(v: torch.Tensor, dynamic: dict, spans) -> tuple[str, int] | None:
    """`(name, byte offset)` of the dynamic tensor that `v` is, or whose memory holds `v`'s; None."""
    for dn, dt in dynamic.items():
        if v is dt:
            return dn, 0
    addr = v.data_ptr()
    end = addr + v.numel() * v.element_size()
    for dn, lo, hi in spans:
        if lo <= addr and end <= hi and hi > lo:
            return dn, addr - lo
    return None


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
