"""Input checks that run before any launch and name the offending argument.

Shape, dtype, device and contiguity checks are free. Checks on the *values* of `cu_seqlens`
need one device-to-host copy; they run unless `INFLLM_CUPY_VALIDATE=0` (for training loops that
cannot afford the sync and already trust their inputs), and never while torch.compile traces (a
host read would break the graph).
"""
from __future__ import annotations

import contextlib
import math
import numbers
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import accumulate, pairwise

import torch

from . import _env
from ._dtypes import INT_DTYPES, KERNEL_DTYPES, REF_DTYPES
from ._rules import HEAD_DIMS, softmax_scale_of


def validate_values() -> bool:
    """Whether to run the checks on values (host copies): not under torch.compile, nor with
    INFLLM_CUPY_VALIDATE=0 or `_env.override(validate=False)`."""
    if torch.compiler.is_compiling():
        return False
    return _env.validate()


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
        raise TypeError(f"{name} must have dtype {_fmt_dtypes(dtypes)}, got "
                        f"{str(t.dtype).replace('torch.', '')}")
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
            raise ValueError(f"{n} is on {t.device} but {items[0][0]} is on {dev}; all inputs must share a "
                             "device")
    return dev


def check_heads(hq: int, h: int, *, q_name: str = "q", k_name: str = "k") -> int:
    """GQA group size G = HQ // H; HQ must be a positive multiple of H."""
    if h <= 0 or hq <= 0 or hq % h != 0:
        raise ValueError(f"{q_name} has {hq} heads and {k_name} has {h}: the query head count must be a "
                         f"positive multiple of the key/value head count")
    return hq // h


def check_cu_seqlens(name: str, cu: torch.Tensor, *, total: int, device: torch.device | None = None,
                     batch: int | None = None, max_seqlen: int | None = None, max_name: str = "max_seqlen",
                     batch_name: str = "cu_seqlens_q") -> None:
    """`cu` must be int32 [B+1], start at 0, never decrease and end at `total`; with `max_seqlen`,
    no sequence may be longer than it (checked on the same host copy). With `batch`, it must have
    that many sequences, as the argument `batch_name` (what the user passed) has."""
    check_cu_tensor(name, cu, device=device, batch=batch, batch_name=batch_name)
    if validate_values():
        check_cu_values(name, cu_seqlens_host(cu)[0], total=total, max_seqlen=max_seqlen, max_name=max_name)


def check_cu_tensor(name: str, cu: torch.Tensor, *, device: torch.device | None = None,
                    batch: int | None = None, batch_name: str = "cu_seqlens_q") -> None:
    """The checks of `check_cu_seqlens` that read no values: int32 `[B+1]`, `B >= 1`, `batch` sequences."""
    check_tensor(name, cu, ndim=1, dtypes=(torch.int32,), device=device)
    if cu.numel() < 2:
        raise ValueError(f"{name} must have at least 2 entries ([0, len0, ...]), got {cu.numel()}")
    if batch is not None and cu.numel() != batch + 1:
        raise ValueError(f"{name} has {cu.numel() - 1} sequences but {batch_name} has {batch}")


def check_cu_values(name: str, c: Sequence[int], *, total: int, max_seqlen: int | None = None,
                    max_name: str = "max_seqlen") -> None:
    """The checks of `check_cu_seqlens` on the values, given on the host (`cu_seqlens_host`)."""
    if c[0] != 0:
        raise ValueError(f"{name} must start at 0, got {c[0]}")
    if any(b < a for a, b in pairwise(c)):
        raise ValueError(f"{name} must be non-decreasing (cumulative sequence lengths), got {list(c)[:16]}")
    if c[-1] != total:
        raise ValueError(f"{name} must end at the total token count {total}, got {c[-1]}")
    longest = max(b - a for a, b in pairwise(c))
    if max_seqlen is not None and max_seqlen < longest:
        raise ValueError(f"{max_name} must be >= the longest sequence ({longest}), got {max_seqlen}")


def cu_seqlens_host(*cus: torch.Tensor) -> list[list[int]]:
    """The values of 1-D integer tensors (`cu_seqlens`) as Python ints, all in one device-to-host copy
    (one tensor given twice is read once). The checks read `cu_seqlens` through here only."""
    unique = list({id(c): c for c in cus}.values())
    flat = unique[0].detach() if len(unique) == 1 else torch.cat([c.detach() for c in unique])
    values = flat.to("cpu", torch.int64).tolist()
    by_id, at = {}, 0
    for c in unique:
        by_id[id(c)] = values[at:at + c.numel()]
        at += c.numel()
    return [by_id[id(c)] for c in cus]


def seqlens_host(cu: torch.Tensor) -> list[int]:
    """Per-sequence lengths as Python ints (one small device-to-host copy)."""
    return [b - a for a, b in pairwise(cu_seqlens_host(cu)[0])]


@dataclass(frozen=True)
class HostSeqlens:
    """The `cu_seqlens` of one call as Python ints, read once by the public entry that checked the
    call's inputs (`read`), or built from lengths its caller knows (`from_lengths`).

    A launcher given one (`host_seqlens=`) trusts its inputs: it checks none of them again and reads
    no `cu_seqlens` back from the device. `q`, `k`: the offsets of `cu_seqlens_q` and `cu_seqlens_k`;
    `c1`, `c2`: those of the compressed keys (`cu_seqlens_c1`, `cu_seqlens_c2`) once stage 1 is near.
    """
    q: tuple[int, ...]
    k: tuple[int, ...]
    c1: tuple[int, ...] | None = None
    c2: tuple[int, ...] | None = None

    @classmethod
    def read(cls, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor) -> HostSeqlens:
        """Both offsets in one device-to-host copy (one read when they are one tensor)."""
        q, k = cu_seqlens_host(cu_seqlens_q, cu_seqlens_k)
        return cls(tuple(q), tuple(k))

    @classmethod
    def from_lengths(cls, seqlens_q: Sequence[int], seqlens_k: Sequence[int]) -> HostSeqlens:
        """The offsets of per-sequence lengths known on the host (no device read)."""
        return cls((0, *accumulate(seqlens_q)), (0, *accumulate(seqlens_k)))

    @property
    def lq(self) -> list[int]:
        return [b - a for a, b in pairwise(self.q)]

    @property
    def lk(self) -> list[int]:
        return [b - a for a, b in pairwise(self.k)]


def check_bool(name: str, value) -> bool:
    """A flag must be a bool (TypeError naming `name` otherwise): `causal="no"` or a max length
    passed where a flag was expected must not be read as True. Returns it."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return value


def check_flags(**flags) -> None:
    """`check_bool` on each keyword (`check_flags(causal=causal, return_lse=return_lse)`)."""
    for name, value in flags.items():
        check_bool(name, value)


def check_softmax_scale(softmax_scale, head_dim: int) -> float:
    """`softmax_scale` must be None (`1 / sqrt(head_dim)`) or a positive number; returns the float."""
    number = isinstance(softmax_scale, (int, float)) and not isinstance(softmax_scale, bool)
    if softmax_scale is not None and not (number and math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(f"softmax_scale must be a positive finite float or None, got {softmax_scale!r}")
    return softmax_scale_of(softmax_scale, head_dim)


def check_head_dim(name: str, shape: Sequence[int]) -> int:
    """The last dim of `name`'s `shape` (its head dim) must be at least 1 (a softmax scale `1 / sqrt(D)`
    needs it); returns it."""
    if shape[-1] < 1:
        raise ValueError(f"{name} has head dim {shape[-1]} (shape {tuple(shape)}); it must be at least 1")
    return shape[-1]


def check_score_dtype(score_dtype) -> None:
    """Stage 1's `score_dtype`: None (the compute dtype) or a float dtype the references take."""
    if score_dtype is not None and score_dtype not in REF_DTYPES:
        raise ValueError(f"score_dtype must be None or one of {_fmt_dtypes(REF_DTYPES)} (the dtype of the "
                         f"stage-1 scores, on which top-k runs), got {score_dtype!r}")


def check_max_seqlen(name: str, value, lengths: Sequence[int]) -> int:
    """`value` must be an int no smaller than the longest sequence; returns it."""
    # torch.SymInt: an int that torch.compile traces symbolically (automatic dynamic shapes)
    if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0 (a length: at least the longest sequence's), got {value}")
    longest = max(lengths, default=0)
    if validate_values() and value < longest:
        raise ValueError(f"{name} must be >= the longest sequence ({longest}), got {value}")
    return value


def host_int_list(name: str, value, *, what: str = "ints") -> list[int]:
    """A list or tuple of ints (numpy ints too, no bools) as Python ints, or a TypeError naming `name`:
    `5`, `"abc"`, `None` or `[0, 1.5]` passed where one length per sequence was expected are refused,
    not iterated, parsed or truncated."""
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise TypeError(f"{name} must be {what} (a list, or an integer tensor), got {type(value).__name__} "
                        f"{value!r}"[:200])
    bad = [x for x in value if isinstance(x, bool) or not isinstance(x, numbers.Integral)]
    if bad:
        raise TypeError(f"{name} must be {what}, got {type(bad[0]).__name__} {bad[0]!r} in "
                        f"{list(value)[:8]}")
    return [int(x) for x in value]


@contextlib.contextmanager
def argument_names(**names: str):
    """Within the block, a TypeError or ValueError whose message names an argument of a function called
    inside it (`ck1`, `crow`, ...) is raised again naming the caller's argument instead (`k`, `indptr`, ...):
    same type, same traceback; other errors pass unchanged. For the entries that take an argument under
    another name and pass it on (the compat layer, the patterns' format converters)."""
    try:
        yield
    except (TypeError, ValueError) as e:
        msg = str(e)
        new = re.sub(r"\b(" + "|".join(map(re.escape, names)) + r")\b", lambda m: names[m.group(1)], msg)
        if new == msg or type(e) not in (TypeError, ValueError):
            raise
        raise type(e)(new).with_traceback(e.__traceback__) from None


def check_lengths_arg(name: str, value, batch: int, device: torch.device) -> torch.Tensor:
    """Per-sequence integers (`cache_lens`): None (zeros), a list of ints or an int tensor `[B]`.

    Returns an int64 tensor on `device`.
    """
    if value is None:
        return torch.zeros(batch, dtype=torch.int64, device=device)
    if not isinstance(value, torch.Tensor):
        # ints are checked on the host, before their copy: no read back from the device
        out = torch.as_tensor(host_int_list(name, value), dtype=torch.int64)
        if out.numel() != batch:
            raise ValueError(f"{name} must have one entry per sequence ({batch}), got {out.numel()}")
        if validate_values() and bool((out < 0).any()):
            raise ValueError(f"{name} must be non-negative, got {out.tolist()[:16]}")
        return out.to(device)
    check_tensor(name, value, ndim=1, dtypes=INT_DTYPES)
    out = value.to(device=device, dtype=torch.int64)
    if out.numel() != batch:
        raise ValueError(f"{name} must have one entry per sequence ({batch}), got {out.numel()}")
    if validate_values() and bool((out < 0).any()):
        raise ValueError(f"{name} must be non-negative, got {out.tolist()[:16]}")
    return out


def check_cu_seqlens_any(name: str, cu, *, device: torch.device | None = None, batch: int | None = None,
                         batch_name: str = "cu_seqlens_q") -> None:
    """`check_cu_seqlens` for a `cu` whose total is not known from another tensor."""
    check_tensor(name, cu, ndim=1, dtypes=(torch.int32,), device=device)
    check_cu_seqlens(name, cu, total=int(cu[-1]) if cu.numel() else 0, device=device, batch=batch,
                     batch_name=batch_name)


def check_int_args(minimum: int, **values) -> None:
    """Each value must be an int (TypeError) that is at least `minimum` (ValueError)."""
    for name, v in values.items():
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name} must be an int, got {type(v).__name__}")
        if v < minimum:
            raise ValueError(f"{name} must be >= {minimum}, got {v}")


def check_compress_args(k, cu_seqlens_k, kernel_size, kernel_stride, dtypes=REF_DTYPES) -> None:
    """Inputs of key compression (`compress_k`, `naive_compress_k`); `dtypes` narrows for the kernel."""
    check_tensor("k", k, ndim=3, dtypes=dtypes)
    check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, total=k.shape[0], device=k.device)
    check_int_args(1, kernel_size=kernel_size, kernel_stride=kernel_stride)
    check_window_covers_stride("kernel_size", kernel_size, "kernel_stride", kernel_stride)


def check_window_covers_stride(size_name: str, size: int, stride_name: str, stride: int) -> None:
    """A compression window must be at least its stride: a shorter one leaves the keys between two
    windows out of every compressed key."""
    if size < stride:
        raise ValueError(f"{size_name} ({size}) must be >= {stride_name} ({stride}): windows shorter than "
                         f"their stride leave {stride - size} of every {stride} keys out of every "
                         f"compressed key")


def check_stage1_inputs(q, ck1, ck2, cu_seqlens_q, cu_seqlens_c1, cu_seqlens_c2, max_seqlen_q=None) -> int:
    """Inputs of stage 1 (`stage1_select`, the references' scores); returns the group size G."""
    check_tensor("q", q, ndim=3, dtypes=REF_DTYPES)
    check_tensor("ck1", ck1, ndim=3, dtypes=(q.dtype,))
    check_tensor("ck2", ck2, ndim=3, dtypes=(q.dtype,))
    check_same_device(q=q, ck1=ck1, ck2=ck2)
    G = check_heads(q.shape[1], ck1.shape[1], q_name="q", k_name="ck1")
    check_head_dim("q", q.shape)
    if ck1.shape[2] != q.shape[2]:          # before ck2 is compared with ck1: name the tensor that differs
        raise ValueError(f"ck1 head dim {ck1.shape[2]} differs from q head dim {q.shape[2]}")
    if ck2.shape[1:] != ck1.shape[1:]:
        raise ValueError(f"ck2 must have shape [total_c2, H, D] = [*, {ck1.shape[1]}, {ck1.shape[2]}], "
                         f"got {tuple(ck2.shape)}")
    check_cu_tensor("cu_seqlens_q", cu_seqlens_q, device=q.device)
    B = cu_seqlens_q.numel() - 1
    check_cu_tensor("cu_seqlens_c1", cu_seqlens_c1, device=q.device, batch=B)
    check_cu_tensor("cu_seqlens_c2", cu_seqlens_c2, device=q.device, batch=B)
    if validate_values():           # the three offsets in one host copy
        cu_q, cu_c1, cu_c2 = cu_seqlens_host(cu_seqlens_q, cu_seqlens_c1, cu_seqlens_c2)
        check_cu_values("cu_seqlens_q", cu_q, total=q.shape[0], max_seqlen=max_seqlen_q,
                        max_name="max_seqlen_q")
        check_cu_values("cu_seqlens_c1", cu_c1, total=ck1.shape[0])
        check_cu_values("cu_seqlens_c2", cu_c2, total=ck2.shape[0])
    return G


def check_attn_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, *, k_name="k", v_name="v", max_seqlen_q=None,
                      max_seqlen_k=None) -> int:
    """Inputs of attention over packed varlen q, k, v (stage 2, dense, decode); returns the group size G."""
    G = check_attn_tensors(q, k, v, cu_seqlens_q, cu_seqlens_k, k_name=k_name, v_name=v_name)
    if validate_values():
        check_attn_values(HostSeqlens.read(cu_seqlens_q, cu_seqlens_k), q, k, max_seqlen_q=max_seqlen_q,
                          max_seqlen_k=max_seqlen_k)
    return G


def check_attn_values(host: HostSeqlens, q, k, *, max_seqlen_q=None, max_seqlen_k=None) -> None:
    """The checks of `check_attn_inputs` on the offsets' values, given on the host."""
    check_cu_values("cu_seqlens_q", host.q, total=q.shape[0], max_seqlen=max_seqlen_q,
                    max_name="max_seqlen_q")
    check_cu_values("cu_seqlens_k", host.k, total=k.shape[0], max_seqlen=max_seqlen_k,
                    max_name="max_seqlen_k")


def check_attn_tensors(q, k, v, cu_seqlens_q, cu_seqlens_k, *, k_name="k", v_name="v") -> int:
    """The checks of `check_attn_inputs` that read no values (shapes, dtypes, devices); returns G."""
    check_tensor("q", q, ndim=3, dtypes=REF_DTYPES)
    check_tensor(k_name, k, ndim=3, dtypes=(q.dtype,))
    check_tensor(v_name, v, ndim=3, dtypes=(q.dtype,))
    check_same_device(q=q, **{k_name: k, v_name: v})
    G = check_heads(q.shape[1], k.shape[1], k_name=k_name)
    check_head_dim("q", q.shape)
    if k.shape[2] != q.shape[2]:
        raise ValueError(f"{k_name} head dim {k.shape[2]} differs from q head dim {q.shape[2]}")
    if v.shape != k.shape:
        raise ValueError(f"{v_name} must have the shape of {k_name} {tuple(k.shape)}, got {tuple(v.shape)}")
    check_cu_tensor("cu_seqlens_q", cu_seqlens_q, device=q.device)
    check_cu_tensor("cu_seqlens_k", cu_seqlens_k, device=q.device, batch=cu_seqlens_q.numel() - 1)
    return G


def check_kernel_inputs(q, k, v) -> None:
    """What the stage-2 kernels support beyond the reference's own checks."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, dtypes=KERNEL_DTYPES)
        if not t.is_cuda:
            raise ValueError(f"{name} must be a CUDA tensor for backend='kernels', got one on {t.device}")
    if q.shape[2] not in HEAD_DIMS:
        raise ValueError(f"q has head dim {q.shape[2]}; the stage-2 kernels support {HEAD_DIMS}")


def check_aligned(**tensors: torch.Tensor) -> None:
    """The kernels copy rows in 16-byte pieces (cp.async, TMA) from each tensor's base address.
    Called by the launchers, inside the ops: a traced caller (torch.compile) has no addresses."""
    for name, t in tensors.items():
        if t.data_ptr() % 16:
            raise ValueError(f"{name} must start at a 16-byte aligned address (got {t.data_ptr():#x}); "
                             f"call .clone() on it")
