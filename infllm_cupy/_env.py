"""The package's one reader of the environment: paths and debugging switches, nothing that picks a kernel.

    INFLLM_CUPY_KERNELS_DIR   the kernels_cu/ folder to compile from (default: the one beside or inside
                              the package)
    INFLLM_CUPY_VALIDATE      "0": skip the input checks that read values back to the host (the
                              cu_seqlens checks; for training loops that cannot afford the sync)
    INFLLM_CUPY_POISON        "1": fill kernel outputs with NaN / a sentinel before the launch, so an
                              element a kernel never writes shows (the tests set it)
    INFLLM_CUPY_LINEINFO      "1": compile with -lineinfo (source lines in Nsight Compute)

Kernel choices are values, not variables: see `stage2/plan.py` and `stage1/plan.py`.

The variables are read at each use (a test or a notebook may set them after import). `override`
sets any of them within a `with` block, without touching `os.environ`:
the benchmarks time with `override(validate=False)`, the A/B tools compile other trees with
`override(kernels_dir=...)`.
"""
from __future__ import annotations

import contextlib
import os

KERNELS_DIR = "INFLLM_CUPY_KERNELS_DIR"
VALIDATE = "INFLLM_CUPY_VALIDATE"
POISON = "INFLLM_CUPY_POISON"
LINEINFO = "INFLLM_CUPY_LINEINFO"

# Process-wide, not per thread: autograd runs backward ops on its own threads, and they must see
# what the caller's block set.
_OVERRIDES: dict = {}


def _overrides() -> dict:
    return _OVERRIDES


def kernels_dir() -> str | None:
    """The kernels_cu/ folder asked for (override, else `$INFLLM_CUPY_KERNELS_DIR`), or None."""
    o = _overrides()
    if "kernels_dir" in o:
        return o["kernels_dir"]
    return os.environ.get(KERNELS_DIR) or None


def validate() -> bool:
    """Whether the input checks that read values back to the host run (default: yes)."""
    o = _overrides()
    if "validate" in o:
        return o["validate"]
    return os.environ.get(VALIDATE, "1") != "0"


def poison() -> bool:
    """Whether kernel outputs are allocated NaN / sentinel filled (default: no)."""
    o = _overrides()
    if "poison" in o:
        return o["poison"]
    return os.environ.get(POISON) == "1"


def lineinfo() -> bool:
    """Whether kernels compile with -lineinfo (default: no)."""
    o = _overrides()
    if "lineinfo" in o:
        return o["lineinfo"]
    return os.environ.get(LINEINFO) == "1"


_UNSET = object()


@contextlib.contextmanager
def override(*, kernels_dir=_UNSET, validate=_UNSET, poison=_UNSET, lineinfo=_UNSET):
    """Within the block (process-wide), the given settings replace the environment's.

    `kernels_dir`: a folder (str or Path), or None for the default search. `validate`, `poison`,
    `lineinfo`: bools. Compiled kernels are cached per kernels folder and line-info setting, so
    switching trees never serves one tree's kernel for another's.
    """
    new = {}
    if kernels_dir is not _UNSET:
        new["kernels_dir"] = None if kernels_dir is None else os.fspath(kernels_dir)
    for name, value in (("validate", validate), ("poison", poison), ("lineinfo", lineinfo)):
        if value is not _UNSET:
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
            new[name] = value
    o = _overrides()
    saved = dict(o)
    o.update(new)
    try:
        yield
    finally:
        o.clear()
        o.update(saved)
