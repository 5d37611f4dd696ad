"""The FP8 KV cache's number format (docs/decode.md §15, §16): e4m3, K scaled per channel within each
64-token page, V per token and KV head; the open page of each sequence stays in the query's dtype.

Storage beside a `DecodeCache`'s `k`, `v` (e4m3, the cache's layout `[rows, S, H, D]`):
  k_scale   float32 `[rows, ceil(S / 64), H, D]`   page `j` of row r: `k[r, 64 j : 64 j + 64]`
  v_scale   float32 `[rows, S, H]`
  k_recent  `[B, 128, H, D]` the query's dtype: sequence b's last 128 keys unquantized (position t at
            slot `t % 128`): the open page and the page before it, which compression windows of up to
            128 keys still read after that page was quantized
  v_open    `[B, 64, H, D]` the query's dtype: the open page's values (position t at slot `t % 64`)

A scale is `amax / 448` in fp32 (0 for an all-zero group); a stored value is `x / scale` in fp32,
clamped to +-448 and rounded to e4m3 (round to nearest even); a read is `(e4m3 as fp32) * scale` rounded
once to the query's dtype: what a kernel that converts in registers computes, so the references and
the kernels read the same numbers.
"""
from __future__ import annotations

import torch

from .._rules import KV_BLOCK

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
KV_DTYPES = (E4M3,)        # the 8-bit storages a cache takes (kv_dtype=); None: the query's dtype
RECENT = 2 * KV_BLOCK      # unquantized keys kept per sequence: the longest compression window (128)
# The decode kernels on an FP8 cache (`sparse_decode_split<T, D, MT, fp8_e4m3>`, docs/decode.md §16) are
# compiled by the CPU suite but have never run: flipped once tests/decode/test_fp8_kernels.py passes on a
# GPU. Until then the kernel path refuses an FP8 cache (`check_verified`).
VERIFIED_ON_HARDWARE = False


def check_kv_dtype(kv_dtype, dtype: torch.dtype) -> torch.dtype | None:
    """The 8-bit storage of a cache of `dtype`, or None for 16-bit storage (`kv_dtype` None or `dtype`);
    a ValueError naming `kv_dtype` otherwise."""
    if kv_dtype is None or kv_dtype == dtype:
        return None
    if kv_dtype in KV_DTYPES and dtype in (torch.float16, torch.bfloat16):
        return kv_dtype
    what = "bfloat16 or float16 caches" if kv_dtype in KV_DTYPES else f"one of {KV_DTYPES}, None or {dtype}"
    raise ValueError(f"kv_dtype must be {what} (the 8-bit KV cache of docs/decode.md §16), got "
                     f"kv_dtype={kv_dtype} with dtype={dtype}")


def not_verified(what: str) -> NotImplementedError:
    """The error of a kernel path asked to read an FP8 cache."""
    return NotImplementedError(
        f"{what}: the decode kernels on an FP8 KV cache (kv_dtype=torch.float8_e4m3fn) are not yet verified "
        "on hardware; run backend='reference' (the references dequantize the cache as the kernels will)")


def check_verified(what: str) -> None:
    """Raise `not_verified(what)` while the FP8 cache's kernels are not verified on hardware."""
    if not VERIFIED_ON_HARDWARE:
        raise not_verified(what)


def quantize(x: torch.Tensor, dims) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` in e4m3 with one fp32 scale per group, the groups reduced over `dims` (kept as size 1)."""
    xf = x.float()
    scale = xf.abs().amax(dim=dims, keepdim=True) / E4M3_MAX
    # an all-zero group stores zeros with scale 0 (the division is never by zero)
    y = torch.where(scale > 0, xf / torch.where(scale > 0, scale, 1.0), 0.0)
    return y.clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale


def quantize_k_pages(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Full pages of keys `[n, 64, H, D]` -> e4m3 `[n, 64, H, D]` and per-channel scales `[n, H, D]`."""
    k8, scale = quantize(k, 1)
    return k8, scale.squeeze(1)


def quantize_v(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Values `[..., H, D]` -> e4m3 and per-token, per-head scales `[..., H]`."""
    v8, scale = quantize(v, -1)
    return v8, scale.squeeze(-1)


def dequantize_k_pages(k8: torch.Tensor, k_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Gathered pages `[..., 64, H, D]` with their scales `[..., H, D]`, read in `dtype` (the kernels'
    expression: fp32 product, one rounding)."""
    return (k8.float() * k_scale.unsqueeze(-3)).to(dtype)


def dequantize_v(v8: torch.Tensor, v_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Gathered values `[..., H, D]` with their scales `[..., H]`, read in `dtype`."""
    return (v8.float() * v_scale.unsqueeze(-1)).to(dtype)


def dequantize_rows(k8: torch.Tensor, v8: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor,
                    dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole storage rows `[rows, S, H, D]` read in `dtype` (a partial last page of a contiguous row
    included: its channel scales are the page's)."""
    R, S, H, D = k8.shape
    pad = (-S) % KV_BLOCK
    kp = torch.nn.functional.pad(k8.view(torch.uint8), (0, 0, 0, 0, 0, pad)).view(E4M3) if pad else k8
    kd = dequantize_k_pages(kp.view(R, (S + pad) // KV_BLOCK, KV_BLOCK, H, D), k_scale, dtype)
    return kd.view(R, S + pad, H, D)[:, :S], dequantize_v(v8, v_scale, dtype)
