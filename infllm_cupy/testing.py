"""Tolerance helpers shared by tests and benchmarks (FlashAttention's rule)."""
from __future__ import annotations

import torch


def max_abs_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return (out.double() - ref.double()).abs().max().item() if out.numel() else 0.0


def rel_l2_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    d = (out.double() - ref.double()).norm().item()
    return d / max(ref.double().norm().item(), 1e-30)


def assert_close_to_ref(name: str, out: torch.Tensor, ref: torch.Tensor, ref_lowp: torch.Tensor, *,
                        mult: float = 2.0, atol_floor: float = 1e-6) -> None:
    """FlashAttention's rule: the error of `out` against the high-precision `ref` may be at most
    `mult` times the error of `ref_lowp` (the same math done by PyTorch in the low precision),
    plus a tiny floor for outputs that are exact in both. NaN (an unwritten element) always fails."""
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    assert not torch.isnan(out).any(), f"{name}: NaN in output (an element was never written?)"
    err = max_abs_err(out, ref)
    base = max_abs_err(ref_lowp, ref)
    assert err <= mult * base + atol_floor, (
        f"{name}: max|out-ref| = {err:.3e} > {mult} x {base:.3e} (low-precision torch error); "
        f"rel L2 {rel_l2_err(out, ref):.2e}")
