"""Launcher of kernels_cu/decode/cache_append.cu: one decode step's token per sequence into a
`DecodeCache` (key, value, the compression windows that end at it, the length) in one launch that
reads the positions on the device. Design: docs/decode.md, 2. Cache.

`DecodeCache.append` takes it for one-token appends of CUDA caches (`kernel_appends`); the custom op
`infllm_cupy::cache_append` (decode/ops.py) for compiled callers. Chunk appends (prefill) keep the
torch path: they run once per prompt.
"""
from __future__ import annotations

import torch

from .. import _jit
from .._launch import CXX_TYPE, Launches
from .._params import KernelParams, constants

SOURCE = "decode/cache_append.cu"
THREADS = 128            # threads per CTA, one CTA per sequence
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
constants(SOURCE, CA_THREADS=THREADS)
APPEND_PARAMS = KernelParams(SOURCE, "CacheAppendParams<float>", """
    ptr k_new, v_new, k, v, ck1, ck2, seqlens, block_table
    i32 max_pages, page_size, L_max, capacity, row, N1, N2
""")

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
    max_pages = block_table.shape[1] if paged else 0
    page_size = k.shape[1] if paged else 0
    L_max = 0 if paged else k.shape[1]
    capacity = max_pages * page_size if paged else L_max
    run = Launches(k.device)
    run.add(SOURCE, f"cache_append_one<{CXX_TYPE[k.dtype]}>", (B,), (THREADS,), 0, APPEND_PARAMS,
            dict(k_new=k_new, v_new=v_new, k=k, v=v, ck1=ck1, ck2=ck2, seqlens=seqlens,
                 block_table=block_table, max_pages=max_pages, page_size=page_size, L_max=L_max,
                 capacity=capacity, row=k.shape[2] * k.shape[3], N1=ck1.shape[1], N2=ck2.shape[1]))
    return run
