"""Launcher of kernels_cu/decode/cache_append.cu: one decode step's token per sequence into a
`DecodeCache` (key, value, the compression windows that end at it, the length) in one launch that
reads the positions on the device. Design: docs/decode.md, 2. Cache.

`DecodeCache.append` takes it for one-token appends of CUDA caches (`kernel_appends`); the custom op
`infllm_cupy::cache_append` (decode/ops.py) for compiled callers. Chunk appends (prefill) keep the
torch path: they run once per prompt.
"""
from __future__ import annotations

import numpy as np
import torch

from .. import _jit
from .._launch import CXX_TYPE
from ._fast import Launches

SOURCE = "decode/cache_append.cu"
THREADS = 128            # #define CA_THREADS
DTYPES = (torch.float16, torch.bfloat16, torch.float32)

_jit.register_instances(SOURCE, [f"cache_append_one<{CXX_TYPE[t]}>" for t in DTYPES])


def kernel_appends(k: torch.Tensor) -> bool:
    """Whether the kernel takes one-token appends into a cache whose keys are `k` (`[B or pages, L, H,
    D]`): CUDA, fp16/bf16/fp32, rows of whole 16-byte pieces."""
    return k.is_cuda and k.dtype in DTYPES and (k.shape[2] * k.shape[3] * k.element_size()) % 16 == 0


def append_launches(k_new, v_new, k, v, ck1, ck2, seqlens, block_table) -> Launches:
    """The launch, unchecked (`DecodeCache.append` and the op check their inputs): `k_new`, `v_new`
    `[B, H, D]` contiguous and 16-byte aligned; the cache's tensors as `DecodeCache` holds them."""
    B = seqlens.shape[0]
    paged = block_table is not None
    i32 = np.int32
    max_pages = block_table.shape[1] if paged else 0
    page_size = k.shape[1] if paged else 0
    L_max = 0 if paged else k.shape[1]
    capacity = max_pages * page_size if paged else L_max
    run = Launches(k.device)
    run.add(SOURCE, f"cache_append_one<{CXX_TYPE[k.dtype]}>", (B,), (THREADS,), 0,
            (k_new, v_new, k, v, ck1, ck2, seqlens, block_table, i32(max_pages), i32(page_size), i32(L_max),
             i32(capacity), i32(k.shape[2] * k.shape[3]), i32(ck1.shape[1]), i32(ck2.shape[1])))
    return run
