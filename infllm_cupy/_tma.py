"""Tensor maps for Hopper's bulk tensor copies (TMA), encoded on the host by the CUDA driver.

A kernel that copies with `cp.async.bulk.tensor` reads a 128-byte `CUtensorMap` describing the
global tensor (address, sizes, strides), the box one copy moves and the shared-memory swizzle.
The driver's `cuTensorMapEncodeTiled` builds it; we call it through ctypes on `libcuda`, which
every CUDA machine has (no toolkit), and pass the result by value as a `__grid_constant__`
kernel parameter (`TmaMap` in kernels_cu/common/wgmma_sm90.cuh). CuPy passes a one-element
NumPy array by value, which is how the 128 bytes reach the launch.
"""
from __future__ import annotations

import ctypes
import functools

import numpy as np
import torch

TMAP_DTYPE = np.dtype([("bits", np.uint64, (16,))])   # 128 opaque bytes
TMAP_BYTES = 128

# cuda.h enums (CUtensorMapDataType, ...Interleave, ...Swizzle, ...L2promotion, ...FloatOOBfill)
_DTYPE_UINT16 = 1        # 16-bit elements copied as bits: bf16 and fp16 alike, zeros are 0 bits
_INTERLEAVE_NONE = 0
_SWIZZLE_128B = 3
_L2_PROMOTION_256B = 3
_OOB_FILL_ZEROS = 0


@functools.cache
def _encode_tiled():
    lib = ctypes.CDLL("libcuda.so.1")
    fn = lib.cuTensorMapEncodeTiled
    u32p, u64p = ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint64)
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64p, u64p, u32p, u32p,
                   ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def _encode(addr: int, dims: tuple, box: tuple, what: str) -> np.ndarray:
    """A CUtensorMap over 16-bit elements at `addr`: `dims` innermost first (dense rows, so the
    byte strides follow from them), boxes of `box`, 128-byte swizzle, zeros out of bounds."""
    rank = len(dims)
    # the driver wants a 64-byte aligned CUtensorMap: encode into an aligned slice of a buffer
    buf = np.zeros(TMAP_BYTES + 64, dtype=np.uint8)
    off = -buf.ctypes.data % 64
    out = buf[off:off + TMAP_BYTES]
    strides = [2 * dims[0]]
    for d in dims[1:-1]:
        strides.append(strides[-1] * d)
    err = _encode_tiled()(out.ctypes.data, _DTYPE_UINT16, rank, addr, (ctypes.c_uint64 * rank)(*dims),
                          (ctypes.c_uint64 * (rank - 1))(*strides), (ctypes.c_uint32 * rank)(*box),
                          (ctypes.c_uint32 * rank)(*([1] * rank)), _INTERLEAVE_NONE, _SWIZZLE_128B,
                          _L2_PROMOTION_256B, _OOB_FILL_ZEROS)
    if err != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed with CUresult {err} (address {addr:#x}, {what})")
    tmap = np.empty(1, dtype=TMAP_DTYPE)
    tmap.view(np.uint8)[:] = out
    return tmap


@functools.lru_cache(maxsize=256)
def _rows_map(addr: int, rows: int, cols: int, box_rows: int) -> np.ndarray:
    return _encode(addr, (cols, rows), (64, box_rows),
                   f"{rows} rows of {cols} 16-bit elements, boxes of {box_rows} x 64")


def rows_map(t: torch.Tensor, box_rows: int) -> np.ndarray:
    """Tensor map over a contiguous 16-bit CUDA tensor `[rows, ...]` viewed as `[rows, cols]`:
    boxes of `box_rows` rows by 64 elements (128 bytes), 128-byte swizzle, zeros out of bounds.
    Needs a 16-byte aligned address and at least one row."""
    if t.element_size() != 2 or not t.is_contiguous() or t.shape[0] == 0:
        raise ValueError(f"rows_map needs a contiguous, non-empty 16-bit tensor, got {t.dtype} "
                         f"{tuple(t.shape)}")
    if t.data_ptr() % 16:
        raise ValueError(f"rows_map needs a 16-byte aligned tensor, got address {t.data_ptr():#x}")
    cols = t.numel() // t.shape[0]
    if cols % 64:
        raise ValueError(f"rows_map needs rows of a multiple of 64 elements, got {cols}")
    return _rows_map(t.data_ptr(), t.shape[0], cols, box_rows)


@functools.lru_cache(maxsize=256)
def _heads_map(addr: int, n: int, heads: int, cols: int, box_heads: int, box_n: int) -> np.ndarray:
    return _encode(addr, (cols, heads, n), (64, box_heads, box_n),
                   f"[{n}, {heads}, {cols}] 16-bit elements, boxes of {box_n} x {box_heads} x 64")


def heads_map(t: torch.Tensor, box_heads: int) -> np.ndarray:
    """Tensor map over a contiguous 16-bit CUDA tensor `[n, heads, cols]` whose boxes are
    `64 // box_heads` rows of `n` by `box_heads` heads by 64 elements, 128-byte swizzle, zeros out of
    bounds: in shared memory, 64 rows of 128 bytes ordered (row of n, head), the layout of a
    64-row tile of flattened (token, head-in-group) rows. Needs `box_heads` to divide 64."""
    if t.element_size() != 2 or not t.is_contiguous() or t.dim() != 3 or t.shape[0] == 0:
        raise ValueError(f"heads_map needs a contiguous, non-empty 3-d 16-bit tensor, got {t.dtype} "
                         f"{tuple(t.shape)}")
    if t.data_ptr() % 16 or t.shape[2] % 64 or 64 % box_heads or box_heads > t.shape[1]:
        raise ValueError("heads_map needs a 16-byte aligned tensor with rows of a multiple of 64 elements "
                         f"and box_heads dividing 64 (at most {t.shape[1]}), got address {t.data_ptr():#x}, "
                         f"shape {tuple(t.shape)}, box_heads {box_heads}")
    return _heads_map(t.data_ptr(), t.shape[0], t.shape[1], t.shape[2], box_heads, 64 // box_heads)
