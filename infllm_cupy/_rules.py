"""The small rules of InfLLM-v2 that many modules apply, each written once here and imported
everywhere else (ARCHITECTURE.md §1 lists them): the block size, the window count of a compression,
the selection's slot count K, the dense/sparse split, the backend rule and the default softmax scale.
Imports only torch, so every layer may use it.

Not here on purpose: each reference's chunk size (`CHUNK_ELEMS` of stage1/naive.py, `_CHUNK_ELEMS`
of stage2/naive.py and selections.py) bounds the working set of its own loop, so the values differ
and stay local; and the `WARPS`-like constants of each launcher mirror a `#define` of its own `.cu`
file.
"""
from __future__ import annotations

import functools

import torch

# The `backend=` argument of every public op: "auto" runs the kernels on CUDA tensors and, on CPU
# tensors, the op's CPU implementation where it has one (`runs_cpu`), else its reference; "kernels" and
# "reference" force one side (`runs_kernels`): "reference" is always the naive oracle.
BACKENDS = ("auto", "kernels", "reference")

# The `precision=` plan of stage 2 (the config's field and every entry's argument): "16bit" computes in
# the inputs' own bf16/fp16 (today's kernels); "int8-fp8" is the 8-bit forward of docs/stage2_q8.md (Q K^T
# in int8 on K smoothed by its mean, P V in e4m3 with V scaled per channel, fp32 across blocks).
PRECISIONS = ("16bit", "int8-fp8")

# Head dims every kernel is instantiated for (compression, stage 1, stage 2, decode).
HEAD_DIMS = (64, 128)

# Keys per selectable KV block: InfLLM-v2's block size, which stage 1 selects and the stage-2 and
# decode kernels are built for (kernels_cu: BLOCK_N); also the block of the synthetic selections.
KV_BLOCK = 64

# Dynamic shared memory of one CTA on sm_90 (H100, H200), opt-in: what plans made without a device
# assume (`smem_limits` gives a device's own numbers).
SMEM_PER_BLOCK = 227 * 1024

# The two key compressions, (kernel, stride): fine keys (stage-1 scores) and coarse keys (stage 1's
# normaliser), spec section 3. The decode cache keeps these two, and the stage-1 kernels are built
# for their strides.
COMPRESSIONS = ((32, 16), (128, 64))


def cdiv(a: int, b: int) -> int:
    """`ceil(a / b)` for ints (`b > 0`)."""
    return -(-a // b)


def n_windows(L: int, kernel_size: int, kernel_stride: int) -> int:
    """Complete compression windows `[i * stride, i * stride + kernel)` inside `L` keys: the compressed
    keys of a sequence of `L` keys (none when `L < kernel_size`)."""
    return 0 if L < kernel_size else (L - kernel_size) // kernel_stride + 1


def n_windows_of(lengths: torch.Tensor, kernel_size: int, kernel_stride: int) -> torch.Tensor:
    """`n_windows` of each entry of an integer tensor of lengths, on its device (no host read): int64."""
    L = lengths.long()
    return torch.where(L < kernel_size, torch.zeros_like(L),
                       torch.div(L - kernel_size, kernel_stride, rounding_mode="floor") + 1)


def selection_slots(topk: int, local_blocks: int, n_blocks: int) -> int:
    """K, the block slots of a selection row: `topk + local_blocks` (MiniCPM4's budget, the forced
    blocks included), at most the `n_blocks` there are."""
    return min(topk + local_blocks, n_blocks)


def uses_dense(dense_len: int, max_seqlen_k: int) -> bool:
    """Spec section 9: dense attention while the longest key sequence (in decode: the longest cache,
    the current token included) is shorter than `dense_len` (0 or -1: never)."""
    return max_seqlen_k < dense_len


def check_backend(backend) -> str:
    """`backend` must be one of `BACKENDS` (ValueError otherwise); returns it."""
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return backend


def check_precision(precision, name: str = "precision") -> str:
    """`precision` must be one of `PRECISIONS` (ValueError naming `name` otherwise); returns it."""
    if not isinstance(precision, str) or precision not in PRECISIONS:
        raise ValueError(f"{name} must be one of {PRECISIONS}, got {precision!r}")
    return precision


def check_precision_block(precision: str, block_size, name: str = "block_size") -> None:
    """The 8-bit plan's K scales are per `KV_BLOCK`-key block: on precision "int8-fp8" a block size other
    than `KV_BLOCK` is a ValueError naming `name`."""
    if precision == "int8-fp8" and (isinstance(block_size, bool) or block_size != KV_BLOCK):
        raise ValueError(f"{name} must be {KV_BLOCK} on precision='int8-fp8' (its K scales are per "
                         f"{KV_BLOCK}-key block), got {block_size!r}")


def runs_kernels(t: torch.Tensor, backend: str = "auto", name: str = "q") -> bool:
    """The backend rule of every entry point: whether the CUDA kernels run for tensor `name` (`t`).

    "auto": the kernels on CUDA tensors; on CPU tensors the CPU implementation where the op has one
    (`runs_cpu`), else the reference. "reference": the references on any device. "kernels": the
    kernels, and a ValueError naming `name` when `t` is not a CUDA tensor (there are no CPU kernels).
    """
    if check_backend(backend) == "reference":
        return False
    cuda = isinstance(t, torch.Tensor) and t.is_cuda      # not a tensor: the op's own checks name it
    if backend == "kernels" and not cuda:
        got = f"one on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a CUDA tensor for backend='kernels' (there are no CPU kernels), "
                         f"got {got}; backend='auto' or 'reference' runs the reference")
    return cuda


def runs_cpu(t: torch.Tensor, backend: str = "auto") -> bool:
    """The backend rule's CPU side: whether an op with a CPU implementation (stage 1 and compression:
    `stage1/cpu.py`, `compress/cpu.py`; stage 2's forward over the selected blocks only: `stage2/cpu.py`;
    the dense fallback: torch SDPA) runs it rather than its reference, for tensor `t`.

    "auto" on a CPU tensor: the CPU implementation (fp32 GEMMs in chunks, memory bounded by the chunk).
    "reference" on any device: the reference (the naive oracle every implementation is tested against).
    "kernels", and CUDA tensors: not this (`runs_kernels` decides). Other devices run the reference.
    """
    return check_backend(backend) == "auto" and isinstance(t, torch.Tensor) and t.device.type == "cpu"


def softmax_scale_of(softmax_scale: float | None, head_dim: int) -> float:
    """The scale a checked `softmax_scale` stands for: itself as a float, or `1 / sqrt(head_dim)` for
    None (ValueError for a head dim below 1)."""
    if softmax_scale is not None:
        return float(softmax_scale)
    if head_dim < 1:
        raise ValueError(f"the head dim must be at least 1 for the default softmax scale 1 / sqrt(D), got "
                         f"{head_dim}")
    return head_dim ** -0.5


def check_kernel_block(block_size, name: str = "block_size") -> None:
    """The kernels are built for `KV_BLOCK`-key blocks: a ValueError naming `name` for any other
    block size (the references take any)."""
    if isinstance(block_size, bool) or block_size != KV_BLOCK:
        raise ValueError(f"{name} must be {KV_BLOCK} for the kernels (the key block they are built for), got "
                         f"{block_size!r}; the references (backend='reference') take any block size")


def check_block_multiple(**sizes) -> None:
    """Each block size of a layout or pattern (`name=value`) must be a positive int multiple of
    `KV_BLOCK`, so that its blocks are whole key blocks (ValueError naming it): the pattern zoo's
    block sizes and `BlockLayout`'s `kv_block`. Not the kernels' own block, which is `KV_BLOCK` exactly
    (`check_kernel_block`)."""
    for name, v in sizes.items():
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0 or v % KV_BLOCK:
            raise ValueError(f"{name} must be a positive multiple of {KV_BLOCK} (64, 128, 192, ...: whole "
                             f"{KV_BLOCK}-key blocks), got {v!r}")


@functools.cache
def sm_count(device_index: int) -> int:
    """Streaming multiprocessors of CUDA device `device_index` (plans size their grids by it)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def smem_limits(device_index: int) -> tuple[int, int]:
    """`(per block opt-in, per SM)` dynamic shared memory of CUDA device `device_index`, in bytes:
    the device's own numbers (torch's properties), the A100's (163 KB, 164 KB) where torch does not
    report them."""
    p = torch.cuda.get_device_properties(device_index)
    per_block = int(getattr(p, "shared_memory_per_block_optin", 0) or 0)
    per_sm = int(getattr(p, "shared_memory_per_multiprocessor", 0) or 0)
    if not per_block or not per_sm:
        return 163 * 1024, 164 * 1024
    return per_block, per_sm
