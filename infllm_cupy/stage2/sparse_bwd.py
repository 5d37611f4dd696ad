"""Launchers of kernels_cu/stage2/sparse_bwd.cu: block-sparse attention backward (dq, dk, dv).

(Being written: the kernel launch lands in the next commit; the signature is final.)
"""
from __future__ import annotations

import torch


def stage2_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
               lse: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, masks: torch.Tensor,
               mask_base: torch.Tensor, mask_h_stride: int, mask_q_block: int, max_seqlen_q: int,
               max_seqlen_k: int, causal: bool, softmax_scale: float
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of `stage2_fwd` (same mask arguments) on checked, contiguous CUDA inputs.

    `dout`, `out` `[total_q, HQ, D]`, `lse` float32 `[HQ, total_q]` from the forward. Returns
    `dq [total_q, HQ, D]`, `dk, dv [total_k, H, D]` in q's dtype. Uses no float atomics: the result
    is bit-identical from run to run.
    """
    raise NotImplementedError("stage-2 backward kernels are being written")
