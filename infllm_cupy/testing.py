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


def cu_seqlens_from_lengths(lengths, device="cpu") -> torch.Tensor:
    """int32 `[B+1]` cumulative lengths."""
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    if len(lengths):
        cu[1:] = torch.tensor(list(lengths), dtype=torch.int64).cumsum(0).to(torch.int32)
    return cu.to(device)


def random_topk_idx(H: int, lengths_q, lengths_k, K: int, *, block_size: int = 64, junk: bool = True,
                    empty_rows: bool = False, generator: torch.Generator | None = None,
                    device="cpu") -> torch.Tensor:
    """Random token-level selections `[H, total_q, K]` int32 for tests.

    Each token picks K entries among its sequence's blocks. With `junk`, entries also include
    -1 tails, other negatives, out-of-range and future blocks and duplicates, all of which the ops
    must ignore. With `empty_rows`, about 1 token in 16 selects nothing usable at all.
    """
    rows = []
    for Lq, Lk in zip(lengths_q, lengths_k):
        nb = max(1, -(-Lk // block_size))
        u = torch.rand(H, Lq, K, generator=generator)
        if junk:
            idx = torch.floor(u * (nb + 6)).long() - 3          # [-3, nb + 2]: negatives and out-of-range
            dup = torch.rand(H, Lq, K, generator=generator) < 0.1
            idx = torch.where(dup, idx.roll(1, dims=-1), idx)  # duplicates
            tail = torch.rand(H, Lq, 1, generator=generator) * K
            idx = torch.where(torch.arange(K)[None, None] > tail + K // 2, torch.full_like(idx, -1), idx)
        else:
            idx = torch.floor(u * nb).long()
        if empty_rows:
            empty = torch.rand(H, Lq, 1, generator=generator) < 1 / 16
            idx = torch.where(empty, torch.full_like(idx, -1), idx)
        rows.append(idx)
    return torch.cat(rows, dim=1).to(torch.int32).to(device) if rows else torch.zeros(H, 0, K, dtype=torch.int32)
