"""Dtype rules shared by the checks, the references and the launchers: which dtypes each side takes
and the dtype the references compute scores in. Imports only torch, so every layer may use it.
"""
from __future__ import annotations

import torch

# The references also take float64 (for gradcheck and exact comparisons).
REF_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
KERNEL_DTYPES = (torch.bfloat16, torch.float16)
INT_DTYPES = (torch.int32, torch.int64)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for bf16/fp16/fp32 inputs, float64 for float64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32
