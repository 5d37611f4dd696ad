"""Find, fingerprint, compile and cache the CUDA sources in `kernels_cu/`.

Kernels are compiled at run time by NVRTC through `cupy.RawModule`; there is no build step.
Two cache levels: an in-process dict of compiled kernels, and CuPy's on-disk cubin cache
(`CUPY_CACHE_DIR`, default `~/.cupy/kernel_cache`). CuPy keys its disk cache on the source text
only, not on `#include`d headers, so every compiled source starts with a fingerprint of the file
and of every header it includes (transitively): an edited header is never served stale.

`compile_report` compiles any kernel for a named architecture with NVRTC alone (no GPU, no CUDA
toolkit) and returns the registers, spills and shared memory that ptxas reports: the CPU check
that every kernel builds for sm_80 and sm_90, and a cheap regression check on resources.

Each launcher declares the template instances it uses with `register_instances`, so the CPU
check covers every kernel the package can launch.

The disk cache under faults (docs/reliability.md, "The run-time compiler under faults"): a
truncated or corrupted entry fails its checksum and is recompiled and replaced, with a warning
naming the file; an unreadable entry is recompiled; a cache folder that cannot be written leaves
compiled kernels in the process, with one warning; two processes compiling the same kernel each
write a complete file and rename it into place, so neither ever reads a partial one.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import re
import warnings
from pathlib import Path

from . import _env

KERNELS_DIR_ENV = _env.KERNELS_DIR
BASE_OPTIONS = ("-std=c++17",)
# CuPy's RawModule appends -ftz=true to every NVRTC compile (cupy/cuda/compiler.py), so the kernels
# run flush-to-zero whatever BASE_OPTIONS says; compile_report adds it too, so that its register
# and spill counts are those of the code that runs.
CUPY_ADDED_OPTIONS = ("-ftz=true",)

_INCLUDE_RE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)


class KernelCompileError(RuntimeError):
    """NVRTC rejected a kernel; the message holds the kernel name and the full NVRTC log."""


# --------------------------------------------------------------------------------------------
# Sources
# --------------------------------------------------------------------------------------------
def kernels_dir() -> Path:
    """The `kernels_cu/` folder: `$INFLLM_CUPY_KERNELS_DIR` (or `_env.override(kernels_dir=...)`),
    else the copy inside an installed wheel (`infllm_cupy/kernels_cu`), else the one at the top of
    a source checkout."""
    return _find_kernels_dir(_env.kernels_dir())


@functools.cache
def _find_kernels_dir(asked: str | None) -> Path:
    if asked:
        return Path(asked).resolve()
    pkg = Path(__file__).resolve().parent
    for cand in (pkg / "kernels_cu", pkg.parent / "kernels_cu"):
        if cand.is_dir() and any(cand.rglob("*.cu")):
            return cand
    raise FileNotFoundError(f"kernels_cu/ not found in {pkg} or {pkg.parent}; set {KERNELS_DIR_ENV}")


def include_closure(source: str) -> list[Path]:
    """`source` (relative to kernels_cu/) and every project header it includes, transitively.

    Quoted includes resolve against the including file's folder, then against kernels_cu/.
    Angle-bracket includes (CUDA's own headers) are not followed: they change with the NVRTC
    version, which CuPy's cache key already holds.
    """
    root = kernels_dir()
    first = (root / source).resolve()
    if not first.is_file():
        raise FileNotFoundError(f"kernel source {source!r} not found under {root}")
    seen: dict[Path, None] = {}
    stack = [first]
    while stack:
        path = stack.pop()
        if path in seen:
            continue
        seen[path] = None
        for inc in _INCLUDE_RE.findall(path.read_text()):
            for base in (path.parent, root):
                cand = (base / inc).resolve()
                if cand.is_file():
                    stack.append(cand)
                    break
            else:
                raise FileNotFoundError(f'{path.relative_to(root)} includes "{inc}", which is not under '
                                        f'{root}')
    return list(seen)


def source_fingerprint(source: str) -> str:
    """sha256 over the paths and bytes of `source` and every header it includes."""
    root = kernels_dir()
    h = hashlib.sha256()
    for path in sorted(include_closure(source)):
        h.update(path.relative_to(root).as_posix().encode() + b"\0")
        h.update(path.read_bytes() + b"\0")
    return h.hexdigest()[:20]


# Compile-time checks appended to a source: the static_asserts of its kernels' parameter structs and
# shared constants (`_params`), so a layout that differs between the launcher and the kernel fails
# the compile.
_CHECKS: dict[str, list[str]] = {}


def register_checks(source: str, text: str) -> None:
    """Append `text` (static_asserts) to `source` whenever it is compiled."""
    checks = _CHECKS.setdefault(source, [])
    if text not in checks:
        checks.append(text)


def _code(source: str) -> str:
    # The fingerprint line makes CuPy's disk-cache key change with any included header;
    # `#line` makes NVRTC report errors against the real file name.
    text = (kernels_dir() / source).read_text()
    checks = "\n".join(_CHECKS.get(source, ()))
    tail = f'\n#line 1 "{source} (checks of infllm_cupy/_params.py)"\n{checks}\n' if checks else ""
    return f'// infllm_cupy fingerprint {source_fingerprint(source)}\n#line 1 "{source}"\n{text}{tail}'


@functools.cache
def cuda_include_dir() -> str | None:
    """Folder holding cuda_bf16.h etc. from the `nvidia-cuda-runtime` wheel (None if absent)."""
    try:
        from cuda import pathfinder

        d = pathfinder.find_nvidia_header_directory("cudart")
        return str(d) if d else None
    except Exception:  # noqa: BLE001 - the wheel layout is not ours to rely on; CuPy may still find the headers
        return None


def _include_options() -> tuple[str, ...]:
    opts = [f"-I{kernels_dir()}"]
    if (inc := cuda_include_dir()) is not None:
        opts.append(f"-I{inc}")
    return tuple(opts)


# --------------------------------------------------------------------------------------------
# Instance registry (what the package can launch)
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class KernelSet:
    source: str
    names: tuple[str, ...]
    sm90a: bool = False  # compiled for sm_90a (wgmma/TMA) and launched only on capability (9, 0)
    strict: bool = True  # the CPU compile check also demands no register spills


_REGISTRY: dict[tuple[str, bool, bool], KernelSet] = {}


def register_instances(source: str, names, *, sm90a: bool = False, strict: bool = True) -> None:
    """Declare the template instances a launcher may request from `source`. `strict=False` marks
    tuning variants allowed to spill registers (they are still compiled by the CPU check)."""
    key = (source, sm90a, strict)
    old = _REGISTRY.get(key)
    merged = tuple(dict.fromkeys((old.names if old else ()) + tuple(names)))
    _REGISTRY[key] = KernelSet(source, merged, sm90a, strict)


def registered() -> list[KernelSet]:
    return list(_REGISTRY.values())


# --------------------------------------------------------------------------------------------
# GPU path: cupy.RawModule
# --------------------------------------------------------------------------------------------
_KERNELS: dict[tuple, object] = {}


def device_capability() -> tuple[int, int]:
    import torch

    return torch.cuda.get_device_capability()


# --------------------------------------------------------------------------------------------
# Disk cache under faults
# --------------------------------------------------------------------------------------------
class KernelCacheWarning(RuntimeWarning):
    """The kernel disk cache met a fault (corrupt entry, unreadable file, read-only folder) and went on."""


_WARNED: set = set()


def _warn(msg: str, once_key=None) -> None:
    if once_key is not None:
        if once_key in _WARNED:
            return
        _WARNED.add(once_key)
    warnings.warn(msg, KernelCacheWarning, stacklevel=3)


@functools.cache
def _cache_class():
    from cupy.cuda import _compiler_cache as cc

    class KernelDiskCache(cc.DiskKernelCacheBackend):
        """CuPy's disk cache (entries prefixed with their SHA-1, written to a temporary file and renamed
        into place) with its faults turned into recompiles and warnings instead of exceptions."""

        def __init__(self, cache_dir: str | None = None):
            self._disabled = False
            try:
                super().__init__(cache_dir)
            except OSError as e:   # the folder cannot be created: run uncached
                self._cache_dir = cache_dir or cc._default_cache_dir
                self._save_cuda_source = False
                self._disabled = True
                _warn(f"kernel cache folder {self._cache_dir} cannot be created ({e}); compiled kernels are "
                      f"kept in this process only (set CUPY_CACHE_DIR to a writable folder)", self._cache_dir)

        @property
        def cache_dir(self) -> str:
            return self._cache_dir

        def load(self, name: str) -> bytes | None:
            if self._disabled:
                return None
            path = os.path.join(self._cache_dir, name)
            try:
                with open(path, "rb") as f:
                    data = f.read()
            except FileNotFoundError:
                return None
            except OSError as e:
                _warn(f"kernel cache entry {path} cannot be read ({e}); recompiling")
                return None
            payload = self._decode_cubin(data)
            if payload is None:
                _warn(f"kernel cache entry {path} is truncated or corrupted ({len(data)} bytes, checksum "
                      f"mismatch); recompiling and replacing it")
            return payload

        def save(self, name: str, cubin: bytes, source: str) -> None:
            if self._disabled:
                return
            try:
                super().save(name, cubin, source)
            except OSError as e:
                _warn(f"kernel cache folder {self._cache_dir} is not writable ({e}); compiled kernels are "
                      f"kept in this process only (set CUPY_CACHE_DIR to a writable folder)", self._cache_dir)

    return KernelDiskCache


def install_kernel_cache():
    """Put `KernelDiskCache` in place of CuPy's default disk cache (same folder), once; a backend
    the user installed is left alone. Returns the backend in use, or None with a CuPy that has no
    pluggable cache (before 14: its own cache then runs unchanged). Needs CuPy, not a GPU."""
    try:
        from cupy.cuda import _compiler_cache as cc
        from cupy.cuda import compiler

        current = compiler._kernel_cache_backend
        compiler._set_kernel_cache_backend  # noqa: B018  (present with the backend)
    except (ImportError, AttributeError):
        return None
    if type(current) is cc.DiskKernelCacheBackend:
        compiler._set_kernel_cache_backend(_cache_class()(current._cache_dir))
    return compiler._kernel_cache_backend


def get_kernel(source: str, name: str, *, sm90a: bool = False):
    """Compile (once per process; once per machine through CuPy's disk cache) and return a kernel.

    Args:
        source (str):
            Path relative to kernels_cu/, e.g. `"compress/mean_pool.cu"`.
        name (str):
            Kernel name or template name expression, e.g. `"compress_mean_pool<__nv_bfloat16, 128>"`.
        sm90a (bool, Optional):
            Compile for `sm_90a` (wgmma, setmaxnreg). Only valid on capability (9, 0). Default: False.

    Returns:
        cupy.RawKernel on the current device.
    """
    import torch

    from ._cupy import import_cupy

    cupy = import_cupy()
    dev = torch.cuda.current_device()
    # the kernels folder and line info are part of the key: a tree switched with `_env.override`
    # must not be served another tree's kernel
    lineinfo = _env.lineinfo()
    key = (source, name, sm90a, dev, _env.kernels_dir(), lineinfo)
    kern = _KERNELS.get(key)
    if kern is not None:
        return kern
    cap = torch.cuda.get_device_capability(dev)
    options = BASE_OPTIONS + _include_options()
    if lineinfo:   # source lines for Nsight Compute
        options += ("-lineinfo",)
    if sm90a:
        if cap != (9, 0):
            raise ValueError(f"kernel {name} needs sm_90a (compute capability 9.0); this device is {cap}")
        options += ("-arch=sm_90a",)
    install_kernel_cache()
    with cupy.cuda.Device(dev):
        mod = cupy.RawModule(code=_code(source), options=options,
                             name_expressions=[name])
        try:
            kern = mod.get_function(name)
        except cupy.cuda.compiler.CompileException as e:
            arch = f"sm_{cap[0]}{cap[1]}{'a' if sm90a else ''}"
            raise KernelCompileError(f"NVRTC could not compile {name} from kernels_cu/{source} "
                                     f"for {arch}:\n{e.get_message()}") from None
    _KERNELS[key] = kern
    return kern


def clear_cache() -> None:
    """Forget compiled kernels and the kernels_cu/ location (after editing kernels in a notebook)."""
    _KERNELS.clear()
    _find_kernels_dir.cache_clear()


# --------------------------------------------------------------------------------------------
# CPU path: NVRTC alone, with the ptxas resource report
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass
class KernelResources:
    name: str            # name expression
    registers: int
    spill_stores: int    # bytes
    spill_loads: int     # bytes
    stack_frame: int     # bytes
    shared_static: int   # bytes of static shared memory

    def __str__(self) -> str:
        return (f"{self.name}: {self.registers} regs, {self.stack_frame} B stack, "
                f"{self.spill_stores}/{self.spill_loads} B spill st/ld, {self.shared_static} B smem")


@dataclasses.dataclass
class CompileReport:
    source: str
    arch: str
    kernels: list[KernelResources]
    log: str


_PTXAS_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_PTXAS_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_REGS = re.compile(r"Used (\d+) registers")
_PTXAS_SMEM = re.compile(r"(\d+) bytes smem")


def compile_report(source: str, names, arch: str = "sm_90", code: str | None = None) -> CompileReport:
    """Compile `names` (name expressions) from `source` for `arch` (e.g. "sm_80", "sm_90", "sm_90a")
    with NVRTC alone, and parse ptxas' resource report per kernel. Needs no GPU and no driver: CuPy's
    thin NVRTC binding works on a CPU-only machine (its RawModule does not). `code`: the source text
    of a file outside kernels_cu/ (development tools), which may include kernels_cu/ headers."""
    from ._cupy import import_nvrtc

    nvrtc = import_nvrtc()
    names = list(names)
    label = f"{source if code is not None else 'kernels_cu/' + source} ({', '.join(names)}) for {arch}"
    prog = nvrtc.createProgram(_code(source) if code is None else code, source, [], [])
    try:
        for n in names:
            nvrtc.addNameExpression(prog, n)
        opts = list(BASE_OPTIONS + CUPY_ADDED_OPTIONS + _include_options()) + [f"--gpu-architecture={arch}",
                                                                               "--ptxas-options=-v"]
        try:
            nvrtc.compileProgram(prog, opts)
        except nvrtc.NVRTCError:
            raise KernelCompileError("NVRTC could not compile "
                                     f"{label}:\n{nvrtc.getProgramLog(prog)}") from None
        log = nvrtc.getProgramLog(prog)
        lowered = {nvrtc.getLoweredName(prog, n): n for n in names}
    finally:
        nvrtc.destroyProgram(prog)
    return CompileReport(source, arch, _parse_ptxas(log, lowered), log)


def _parse_ptxas(log: str, lowered: dict[str, str]) -> list[KernelResources]:
    out, current = [], None
    for line in log.splitlines():
        if m := _PTXAS_ENTRY.search(line):
            current = KernelResources(lowered.get(m.group(1), m.group(1)), 0, 0, 0, 0, 0)
            out.append(current)
        elif current is not None and (m := _PTXAS_FRAME.search(line)):
            current.stack_frame, current.spill_stores, current.spill_loads = map(int, m.groups())
        elif current is not None and (m := _PTXAS_REGS.search(line)):
            current.registers = int(m.group(1))
            if s := _PTXAS_SMEM.search(line):
                current.shared_static = int(s.group(1))
    return [k for k in out if k.name in lowered.values()]
