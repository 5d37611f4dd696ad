"""PyTorch reference of key compression (spec section 3): mean pooling over complete windows."""
from __future__ import annotations

import torch

from .._checks import check_compress_args
from .._rules import n_windows_of


def compressed_cu_seqlens(cu_seqlens_k: torch.Tensor, kernel_size: int, kernel_stride: int) -> torch.Tensor:
    """`cu_seqlens` of the compressed keys, computed on `cu_seqlens_k`'s device (no host sync)."""
    n = n_windows_of(cu_seqlens_k[1:] - cu_seqlens_k[:-1], kernel_size, kernel_stride)
    cu = torch.zeros(n.numel() + 1, dtype=torch.int32, device=cu_seqlens_k.device)
    cu[1:] = torch.cumsum(n, 0).to(torch.int32)
    return cu


def naive_compress_k(k: torch.Tensor, cu_seqlens_k: torch.Tensor, kernel_size: int = 32,
                     kernel_stride: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Mean of the keys over every complete window of each sequence.

    Args:
        k (torch.Tensor):
            Keys `[total_k, H, D]` (bf16, fp16 or fp32), packed varlen.
        cu_seqlens_k (torch.Tensor):
            int32 `[B+1]`.
        kernel_size, kernel_stride (int):
            Window length and step. InfLLM-v2 uses 32/16 (fine) and 128/64 (coarse). Default: 32, 16.

    Returns:
        ck (torch.Tensor): `[total_c, H, D]`, same dtype as `k`; window `i` of sequence `b` is
            `mean(k[s_b + i*stride : s_b + i*stride + kernel])`, summed in fp32 then rounded.
        cu_seqlens_c (torch.Tensor): int32 `[B+1]`, with `n_b = (L_b - kernel)//stride + 1` or 0.
    """
    check_compress_args(k, cu_seqlens_k, kernel_size, kernel_stride)
    cu_c = compressed_cu_seqlens(cu_seqlens_k, kernel_size, kernel_stride)
    starts = cu_seqlens_k[:-1].long()
    n = (cu_c[1:] - cu_c[:-1]).long()
    total_c = int(cu_c[-1])
    if total_c == 0:
        return k.new_empty((0,) + tuple(k.shape[1:])), cu_c
    seq = torch.repeat_interleave(torch.arange(n.numel(), device=k.device), n)        # [total_c]
    local = torch.arange(total_c, device=k.device) - cu_c[:-1].long()[seq]      # window index in its sequence
    first = starts[seq] + local * kernel_stride                                      # [total_c]
    idx = first[:, None] + torch.arange(kernel_size, device=k.device)[None, :]       # [total_c, kernel]
    acc = torch.float64 if k.dtype == torch.float64 else torch.float32
    ck = k[idx.reshape(-1)].view(total_c, kernel_size, *k.shape[1:]).to(acc).mean(dim=1)
    return ck.to(k.dtype), cu_c
