"""The CPU implementation of key compression (spec section 3): what `compress_k` runs on CPU tensors
under `backend="auto"` (docs/cpu.md, "Stage 1 and compression").

`naive_compress_k` gathers every window of the batch at once (`[total_c, kernel, H, D]` in fp32: 8x the
keys' bf16 bytes for 32/16, 8x again for 128/64) and takes one mean. This takes the same mean, window
chunk by window chunk, over a strided view of each sequence's keys copied into an fp32 buffer of at most
`CHUNK_ELEMS` elements: memory is bounded by the chunk, and the result is the oracle's bit for bit (the
same fp32 mean over a buffer of the same layout; torch's reduction order over the window does not depend
on how many windows a call holds, `tests/compress/test_compress.py` checks it).
"""
from __future__ import annotations

import torch

from .._checks import check_compress_args
from .naive import compressed_cu_seqlens

# fp32 elements of one chunk of windows `[c, kernel, H, D]` (4 MiB: cache-resident; 16 MiB ran 9x slower at
# 32k tokens, docs/cpu.md)
CHUNK_ELEMS = 1 << 20


@torch.no_grad()
def cpu_compress_k(k: torch.Tensor, cu_seqlens_k: torch.Tensor, kernel_size: int = 32,
                   kernel_stride: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    r"""`naive_compress_k` in bounded chunks: the mean of the keys over every complete window.

    Same arguments, checks and result (bit for bit) as `naive_compress_k`.

    Returns:
        ck (torch.Tensor): `[total_c, H, D]`, k's dtype.
        cu_seqlens_c (torch.Tensor): int32 `[B+1]`.
    """
    check_compress_args(k, cu_seqlens_k, kernel_size, kernel_stride)
    cu_c = compressed_cu_seqlens(cu_seqlens_k, kernel_size, kernel_stride)
    cu_k, cu = cu_seqlens_k.tolist(), cu_c.tolist()
    _, H, D = k.shape
    out = k.new_empty((cu[-1], H, D))
    acc = torch.float64 if k.dtype == torch.float64 else torch.float32
    per = max(1, CHUNK_ELEMS // (kernel_size * H * D))          # windows per chunk
    buf = None
    k = k.contiguous()
    # One thread: each chunk is two memory-bound torch calls too short to share (32k tokens, H 2,
    # D 128, both compressions: 8.5 ms); on a shared 2-core machine two threads per call stall on each
    # other (docs/cpu.md, "Stage 1 and compression").
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for b in range(len(cu) - 1):
            s, n = cu_k[b], cu[b + 1] - cu[b]
            for i0 in range(0, n, per):
                c = min(per, n - i0)
                # windows i0 .. i0 + c - 1 of sequence b: rows s + i stride .. s + i stride + kernel - 1
                win = k[s + i0 * kernel_stride:].as_strided((c, kernel_size, H, D),
                                                             (kernel_stride * H * D, H * D, D, 1))
                if buf is None or buf.numel() < c * kernel_size * H * D:
                    buf = torch.empty(per * kernel_size * H * D, dtype=acc)
                x = buf[:c * kernel_size * H * D].view(c, kernel_size, H, D)
                x.copy_(win)
                out[cu[b] + i0:cu[b] + i0 + c] = x.mean(dim=1)
    finally:
        torch.set_num_threads(threads)
    return out, cu_c
