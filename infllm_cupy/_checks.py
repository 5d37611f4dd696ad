"""Input checks that run before any launch and name the offending argument.

Shape, dtype, device and contiguity checks are free. Checks on the *values* of `cu_seqlens`
need one device-to-host copy; they run unless `INFLLM_CUPY_VALIDATE=0` (for training loops that
cannot afford the sync and already trust their inputs), and never while torch.compile traces (a
host read would break the graph).
"""
from __future__ import annotations

import os
from typing import Iterable, Sequence

import torch

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)  # references
KERNEL_DTYPES = (torch.bfloat16, torch.float16)


def validate_values() -> bool:
    """Whether to run the checks on values (host copies): not under torch.compile, nor with
    INFLLM_CUPY_VALIDATE=0."""
    if torch.compiler.is_compiling():
        return False
    return os.environ.get("INFLLM_CUPY_VALIDATE", "1") != "0"


def _fmt_dtypes(dtypes: Iterable[torch.dtype]) -> str:
    return " or ".join(str(d).replace("torch.", "") for d in dtypes)


def check_tensor(name: str, t, *, ndim: int | None = None, dtypes: Sequence[torch.dtype] | None = None,
                 shape: Sequence[int | None] | None = None, device: torch.device | None = None,
                 contiguous: bool = False) -> None:
    """Raise TypeError/ValueError naming `name` unless `t` matches every given constraint.

    `shape` entries that are None are free. `device` compares type and index.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype {_fmt_dtypes(dtypes)}, got {str(t.dtype).replace('torch.', '')}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if shape is not None:
        want = tuple("*" if s is None else s for s in shape)
        if t.dim() != len(shape) or any(s is not None and s != a for s, a in zip(shape, t.shape)):
            raise ValueError(f"{name} must have shape {want}, got {tuple(t.shape)}")
    if device is not None and t.device != torch.device(device):
        raise ValueError(f"{name} must be on {torch.device(device)}, got {t.device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous())")


def check_same_device(**tensors: torch.Tensor) -> torch.device:
    """All tensors on one device; returns it."""
    items = [(n, t) for n, t in tensors.items() if t is not None]
    dev = items[0][1].device
    for n, t in items[1:]:
        if t.device != dev:
            raise ValueError(f"{n} is on {t.device} but {items[0][0]} is on {dev}; all inputs must share a device")
    return dev


def check_heads(hq: int, h: int, *, q_name: str = "q", k_name: str = "k") -> int:
    """GQA group size G = HQ // H; HQ must be a positive multiple of H."""
    if h <= 0 or hq <= 0 or hq % h != 0:
        raise ValueError(f"{q_name} has {hq} heads and {k_name} has {h}: the query head count must be a "
                         f"positive multiple of the key/value head count")
    return hq // h


def check_cu_seqlens(name: str, cu: torch.Tensor, *, total: int, device: torch.device | None = None,
                     batch: int | None = None, max_seqlen: int | None = None, max_name: str = "max_seqlen") -> None:
    """`cu` must be int32 [B+1], start at 0, never decrease and end at `total`; with `max_seqlen`,
    no sequence may be longer than it (checked on the same host copy)."""
    check_tensor(name, cu, ndim=1, dtypes=(torch.int32,), device=device)
    if cu.numel() < 2:
        raise ValueError(f"{name} must have at least 2 entries ([0, len0, ...]), got {cu.numel()}")
    if batch is not None and cu.numel() != batch + 1:
        raise ValueError(f"{name} has {cu.numel() - 1} sequences but another cu_seqlens has {batch}")
    if not validate_values():
        return
    c = cu.detach().to("cpu", torch.int64)
    if int(c[0]) != 0:
        raise ValueError(f"{name} must start at 0, got {int(c[0])}")
    if bool((c[1:] < c[:-1]).any()):
        raise ValueError(f"{name} must be non-decreasing (cumulative sequence lengths), got {c.tolist()[:16]}")
    if int(c[-1]) != total:
        raise ValueError(f"{name} must end at the total token count {total}, got {int(c[-1])}")
    longest = int((c[1:] - c[:-1]).max())
    if max_seqlen is not None and max_seqlen < longest:
        raise ValueError(f"{max_name} must be >= the longest sequence ({longest}), got {max_seqlen}")


def seqlens_host(cu: torch.Tensor) -> list[int]:
    """Per-sequence lengths as Python ints (one small device-to-host copy)."""
    c = cu.detach().to("cpu", torch.int64)
    return (c[1:] - c[:-1]).tolist()
