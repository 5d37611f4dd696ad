"""Block pooling of stage-1 scores as device-side tensor code: `naive_pool_blocks`'s contract, bit for bit.

`pool_blocks` takes the same arguments and returns the same tensor as `naive_pool_blocks` (the oracle in
`naive.py`), but builds each token's sequence index, position and fine-key count on the device
(`searchsorted` over `cu_seqlens_q`) instead of reading the lengths on the host, and runs the whole
batch in a handful of large slices instead of a Python loop over row chunks. It reads at most one small
tensor back to the host: the output width needs `max(cache_lens)` when `cache_lens` is a tensor, and
the value checks (`INFLLM_CUPY_VALIDATE`) ride on the same copy. With `cache_lens` None or a list of
ints and the value checks off, it reads nothing back.

For query row `r` of sequence `b` (token `t`), with `w = block_size // kernel_stride`:
block `j` is `+inf` if `j < init_blocks` or `off_bq - local_blocks <= j <= off_bq`
(`off_bq = (r + cache_lens[b]) // block_size`), else the max of `scores[h, t, w*j - 1 : w*j + w]`
clipped to the sequence's own fine keys `[0, n1_b)`, or `-inf` when that window is empty. The max is
`amax` over the same padded, unfolded windows the reference reduces, so NaN propagates and signed
zeros resolve as in the reference.
"""
from __future__ import annotations

import torch

from .._checks import check_int_args, check_tensor, validate_values
from .._dtypes import REF_DTYPES

# Elements of one slice of the padded score buffer (`[heads, tokens, w * out_len + 1]`): 64 Mi elements,
# 128 MiB in bf16; a 32k-token, 2-head MiniCPM4 prefill runs in 2-3 slices.
_SLICE_ELEMS = 1 << 26


def _lengths(cache_lens, batch: int, device: torch.device):
    """`cache_lens` as an int64 device tensor `[B]` and, when known without a device read, its max."""
    if cache_lens is None:
        return torch.zeros(batch, dtype=torch.int64, device=device), 0
    if isinstance(cache_lens, torch.Tensor):
        check_tensor("cache_lens", cache_lens, ndim=1, dtypes=(torch.int32, torch.int64))
        if cache_lens.numel() != batch:
            raise ValueError(f"cache_lens must have one entry per sequence ({batch}), got "
                             f"{cache_lens.numel()}")
        return cache_lens.to(device=device, dtype=torch.int64), None
    vals = [int(x) for x in cache_lens]
    if len(vals) != batch:
        raise ValueError(f"cache_lens must have one entry per sequence ({batch}), got {len(vals)}")
    if any(x < 0 for x in vals):
        raise ValueError(f"cache_lens must be non-negative, got {vals[:16]}")
    # a non-blocking copy: the host values are staged at once, and the stream is not synchronized
    return torch.tensor(vals, dtype=torch.int64).to(device, non_blocking=True), max(vals, default=0)


def _read_back(scores, cu_q, cu_k, cache, cache_max, max_seqlen_q):
    """The one device-to-host read: `max(cache_lens)` when not known, plus the value checks of
    `naive_pool_blocks` (cu_seqlens start at 0 and never decrease, cu_seqlens_q ends at the token count,
    max_seqlen_q covers every query sequence, no sequence has more fine keys than scores has columns,
    cache_lens non-negative) when they are on. Returns `max(cache_lens)`."""
    check = validate_values()
    if cache_max is not None and not check:
        return cache_max
    lq, n1 = cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]
    parts = [cache.max().reshape(1) if cache.numel() else cache.new_zeros(1)]
    if check:
        parts += [cu_q[:1], cu_q[-1:], lq.min().reshape(1), lq.max().reshape(1),
                  cu_k[:1], n1.min().reshape(1), n1.max().reshape(1), cache.min().reshape(1)]
    vals = torch.cat(parts).tolist()
    if not check:
        return vals[0]
    cmax, q0, qend, lq_min, lq_max, k0, n1_min, n1_max, cmin = vals
    T, W = scores.shape[1], scores.shape[2]
    if q0 != 0 or lq_min < 0:
        raise ValueError(f"cu_seqlens_q must start at 0 and be non-decreasing, got {cu_q.tolist()[:16]}")
    if qend != T:
        raise ValueError(f"cu_seqlens_q must end at the total token count {T}, got {qend}")
    if k0 != 0 or n1_min < 0:
        raise ValueError(f"cu_seqlens_c1 must start at 0 and be non-decreasing, got {cu_k.tolist()[:16]}")
    if max_seqlen_q < lq_max:
        raise ValueError(f"max_seqlen_q must be >= the longest sequence ({lq_max}), got {max_seqlen_q}")
    if W < n1_max:
        raise ValueError(f"scores has {W} columns but a sequence has {n1_max} fine keys (cu_seqlens_c1)")
    if cmin < 0:
        raise ValueError(f"cache_lens must be non-negative, got {cache.tolist()[:16]}")
    return cmax if cache_max is None else cache_max


@torch.no_grad()
def pool_blocks(scores: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_c1: torch.Tensor, cache_lens,
                max_seqlen_q: int, *, init_blocks: int = 1, local_blocks: int = 32, block_size: int = 64,
                kernel_stride: int = 16) -> torch.Tensor:
    r"""Max-pool fine-key scores into key-block scores and force the init and local blocks (spec 5):
    `naive_pool_blocks` on the device, without a host loop.

    Args:
        scores (torch.Tensor):
            Stage-1 scores `[H, total_q, >= max_n1]` (bf16, fp16, fp32 or float64; any strides).
        cu_seqlens_q (torch.Tensor):
            int32 `[B+1]`, on scores' device.
        cu_seqlens_c1 (torch.Tensor):
            int32 `[B+1]` of the fine compressed keys (gives `n1_b`), on scores' device.
        cache_lens (torch.Tensor or list[int] or None):
            `[B]` keys before each sequence's first query; None = zeros. A tensor costs one host read
            (the output width); a list costs none.
        max_seqlen_q (int):
            Sets `out_len = ceil((max_seqlen_q + max(cache_lens)) / block_size)` for the whole batch.
        init_blocks, local_blocks, block_size, kernel_stride (int, Optional):
            Default: 1, 32, 64, 16. `block_size` must be a multiple of `kernel_stride`.

    Returns:
        block_scores (torch.Tensor): `[H, total_q, out_len]`, scores' dtype, equal bit for bit to
        `naive_pool_blocks` on the same arguments.
    """
    check_tensor("scores", scores, ndim=3, dtypes=REF_DTYPES)
    dev = scores.device
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_c1", cu_seqlens_c1)):
        check_tensor(name, cu, ndim=1, dtypes=(torch.int32,), device=dev)
        if cu.numel() < 2:
            raise ValueError(f"{name} must have at least 2 entries ([0, len0, ...]), got {cu.numel()}")
    B = cu_seqlens_q.numel() - 1
    if cu_seqlens_c1.numel() != B + 1:
        raise ValueError(f"cu_seqlens_c1 has {cu_seqlens_c1.numel() - 1} sequences but cu_seqlens_q has {B}")
    check_int_args(1, block_size=block_size, kernel_stride=kernel_stride)
    check_int_args(0, init_blocks=init_blocks, local_blocks=local_blocks)
    if isinstance(max_seqlen_q, bool) or not isinstance(max_seqlen_q, int):
        raise TypeError(f"max_seqlen_q must be an int, got {type(max_seqlen_q).__name__}")
    if max_seqlen_q < 0:
        raise ValueError(f"max_seqlen_q must be >= 0, got {max_seqlen_q}")
    if block_size % kernel_stride:
        raise ValueError(f"block_size ({block_size}) must be a multiple of kernel_stride ({kernel_stride})")
    cache, cache_max = _lengths(cache_lens, B, dev)
    cu_q, cu_k = cu_seqlens_q.long(), cu_seqlens_c1.long()
    cache_max = _read_back(scores, cu_q, cu_k, cache, cache_max, max_seqlen_q)
    H, T, W = scores.shape
    out_len = -(-(max_seqlen_q + cache_max) // block_size)
    if out_len == 0 or T == 0:
        return scores.new_zeros(H, T, out_len)

    # Per token, on the device: its sequence, its row in it, its block and its sequence's fine-key count.
    tok = torch.arange(T, device=dev)
    seq = torch.searchsorted(cu_q[1:].contiguous(), tok, right=True).clamp_(max=B - 1)
    r = tok - cu_q[seq]
    off_bq = (r + cache[seq]) // block_size                                  # [T]
    n1_tok = (cu_k[1:] - cu_k[:-1])[seq]                                     # [T]

    w = block_size // kernel_stride
    P = w * out_len + 1           # padded width: column p holds fine key p - 1; window j is [w*j, w*j + w]
    Wc = min(W, P - 1)            # fine keys that can fall in a window
    col = torch.arange(P, device=dev)
    j = torch.arange(out_len, device=dev)
    out = scores.new_empty(H, T, out_len)
    t_step = min(T, max(1, _SLICE_ELEMS // P))
    h_step = max(1, min(H, _SLICE_ELEMS // (t_step * P)))
    ninf, pinf = float("-inf"), float("inf")
    for t0 in range(0, T, t_step):
        t1 = min(T, t0 + t_step)
        # Fine keys past the sequence's own n1 do not exist (the tensor holds 0 or garbage there).
        missing = (col[None, :] > n1_tok[t0:t1, None]) | (col[None, :] == 0)          # [tokens, P]
        ob = off_bq[t0:t1, None]
        forced = (j[None, :] < init_blocks) | ((j[None, :] <= ob) & (j[None, :] >= ob - local_blocks))
        for h0 in range(0, H, h_step):
            h1 = min(H, h0 + h_step)
            buf = scores.new_empty(h1 - h0, t1 - t0, P)
            buf[..., 1:1 + Wc] = scores[h0:h1, t0:t1, :Wc]
            buf[..., 1 + Wc:] = ninf
            buf.masked_fill_(missing, ninf)
            pooled = buf.unfold(-1, w + 1, w).amax(dim=-1)                          # [heads, tokens, out_len]
            out[h0:h1, t0:t1] = pooled.masked_fill_(forced, pinf)
    return out
