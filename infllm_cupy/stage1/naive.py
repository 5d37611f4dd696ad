"""PyTorch reference of InfLLM-v2 stage 1 (spec sections 4-6): relevance scores of the compressed keys,
max-pooling to 64-token block scores, and top-k block selection.

Everything is vectorized over tokens and heads; Python loops run only over the sequences of the
batch and over query chunks (to bound memory). Runs on CPU or CUDA tensors. Nothing here is
differentiable: stage 1 only picks blocks.
"""
from __future__ import annotations

import torch

from .._checks import (
    HostSeqlens,
    check_cu_seqlens,
    check_cu_seqlens_any,
    check_flags,
    check_int_args,
    check_lengths_arg,
    check_max_seqlen,
    check_score_dtype,
    check_stage1_inputs,
    check_tensor,
    seqlens_host,
)
from .._dtypes import INT_DTYPES, REF_DTYPES, compute_dtype
from .._rules import selection_slots, softmax_scale_of

# Elements of one fp32 score chunk `[HQ, chunk, n]`; bounds memory to a few tens of MB.
CHUNK_ELEMS = 1 << 23


def _trunc_div(a, b: int):
    """C/C++ integer division (truncates toward zero), for ints or integer tensors."""
    if isinstance(a, torch.Tensor):
        return torch.div(a, b, rounding_mode="trunc")
    return a // b if a >= 0 else -((-a) // b)


def vis_limit(r, s: int, n, Lq, *, causal: bool = True):
    r"""Number of compressed keys visible to query row `r` (spec 4.3, the kernel's `apply_mask_stage1`).

    `limit = min(n, max(0, cdiv(r+1, s) - 1 + n - cdiv(Lq - s + 1, s)))` with C truncating
    division; key `i` is visible iff `i < limit`. In prefill (`Lq` = key length) this is
    "the whole window `[i*s, i*s + 2s)` lies at or before `r`", except that it sees one key fewer
    when `Lq % s == s - 1` (quirks A and B). With `Lq` shorter than the key length, the rule is
    aligned bottom-right through `n`.

    Args:
        r (int or torch.Tensor):
            Query position(s) inside the sequence, `0 <= r < Lq`.
        s (int):
            Stride of the compressed keys (16 fine, 64 coarse).
        n (int or torch.Tensor):
            Number of compressed keys of the sequence.
        Lq (int or torch.Tensor):
            Query length of the sequence.
        causal (bool, Optional):
            `False` (decode) makes all `n` keys visible. Default: `True`.

    Returns:
        An int, or an int64 tensor broadcast over `r`, `n` and `Lq`.
    """
    if not any(isinstance(x, torch.Tensor) for x in (r, n, Lq)):
        if not causal:
            return n
        return min(n, max(0, _trunc_div(r + 1, s) - 1 + n - _trunc_div(Lq - s + 1, s)))
    dev = next(x.device for x in (r, n, Lq) if isinstance(x, torch.Tensor))
    r, n, Lq = (torch.as_tensor(x, dtype=torch.int64, device=dev) for x in (r, n, Lq))
    if not causal:
        return torch.broadcast_tensors(n, r, Lq)[0].clone()
    lim = _trunc_div(r + 1, s) - 1 + n - _trunc_div(Lq - s + 1, s)
    return torch.minimum(lim.clamp_min(0), n)


def _stage1_rows(q, k1, k2, r, n1, n2, Lq, s1_stride, s2_stride, causal, scale):
    """Scores of one query chunk of one sequence.

    `q [C, H, G, D]`, `k1 [n1, H, D]`, `k2 [n2, H, D]` (compute dtype), `r [C]` positions.
    Returns `[H, C, n1]`.
    """
    C, H, G, _ = q.shape
    l1 = vis_limit(r, s1_stride, n1, Lq, causal=causal)                       # [C]
    l2 = vis_limit(r, s2_stride, n2, Lq, causal=causal)                       # [C]
    qh = q.permute(1, 2, 0, 3)                                         # [H, G, C, D]
    s2 = torch.matmul(qh, k2.permute(1, 2, 0).unsqueeze(1))            # [H, G, C, n2]
    s1 = torch.matmul(qh, k1.permute(1, 2, 0).unsqueeze(1))            # [H, G, C, n1]
    j = torch.arange(n2, device=q.device)
    i = torch.arange(n1, device=q.device)
    s2 = s2.masked_fill(j[None, :] >= l2[:, None], float("-inf"))
    s1 = s1.masked_fill(i[None, :] >= l1[:, None], float("-inf"))
    # Pass 1: max and normaliser over the visible coarse keys. A row with none keeps its zero init
    # in the kernel (early exit), so its max is replaced by 0 only to avoid inf - inf.
    has_coarse = l2 > 0                                                # [C]
    m = s2.amax(dim=-1, keepdim=True) if n2 > 0 else s2.new_zeros(H, G, C, 1)
    m = torch.where(has_coarse[:, None], m, torch.zeros_like(m))
    Z = torch.exp(scale * (s2 - m)).sum(dim=-1, keepdim=True)
    Z = torch.where(has_coarse[:, None], Z, torch.ones_like(Z))
    # Pass 2: fine-key weights under the coarse normaliser (not a distribution: may exceed 1).
    p = torch.exp(scale * s1 - scale * m) / Z                          # [H, G, C, n1]
    score = p.sum(dim=1)                                               # [H, C, n1], sum over the group
    return torch.where(has_coarse[None, :, None], score, torch.zeros_like(score))


@torch.no_grad()
def naive_stage1_scores(q: torch.Tensor, ck1: torch.Tensor, ck2: torch.Tensor, cu_seqlens_q: torch.Tensor,
                        cu_seqlens_c1: torch.Tensor, cu_seqlens_c2: torch.Tensor,
                        max_seqlen_q: int | None = None,
                        *, causal: bool = True, softmax_scale: float | None = None,
                        score_dtype: torch.dtype | None = torch.bfloat16, kernel_stride: int = 16,
                        coarse_kernel_stride: int = 64) -> torch.Tensor:
    r"""Stage-1 relevance of every fine compressed key for every query token, summed over each KV group.

    Per sequence, query row `r`, KV head `h` and its `G` query heads `g`:
    `m_g, Z_g` = max and sum of `exp(scale * (q_g . ck2_j - m_g))` over the visible coarse keys `j`;
    `score[h, t, i] = sum_g exp(scale * q_g . ck1_i - scale * m_g) / Z_g` for visible fine keys `i`,
    else 0. A sequence with as many coarse as fine keys (`ck2 = ck1`) runs in exact mode: the
    coarse pass then uses the fine stride and the result is the exact softmax over `ck1`.
    Rows with no visible coarse key are all zero, as are entries past the sequence's `n1`.

    Args:
        q (torch.Tensor):
            Queries `[total_q, HQ, D]`.
        ck1 (torch.Tensor):
            Fine compressed keys `[total_c1, H, D]` (kernel 32, stride 16); `HQ` a multiple of `H`.
        ck2 (torch.Tensor):
            Coarse compressed keys `[total_c2, H, D]` (kernel 128, stride 64), or `ck1` for exact mode.
        cu_seqlens_q, cu_seqlens_c1, cu_seqlens_c2 (torch.Tensor):
            int32 `[B+1]`. Visibility uses the query length `Lq` and the compressed counts `n1`, `n2`.
        max_seqlen_q (int, Optional):
            Accepted for API parity with the kernel; checked when given. Default: `None`.
        causal (bool, Optional):
            Mask of spec 4.3 (bottom-right aligned); `False` for decode. Default: `True`.
        softmax_scale (float, Optional):
            Default: `None` (`1 / sqrt(D)`).
        score_dtype (torch.dtype, Optional):
            Output dtype; `None` keeps the compute dtype (fp32, or float64 for float64 inputs).
            Default: `torch.bfloat16`, as the original.
        kernel_stride, coarse_kernel_stride (int, Optional):
            Strides of the fine and coarse compressions. Default: 16, 64.

    Returns:
        scores (torch.Tensor): `[H, total_q, max_n1]` in `score_dtype`.
    """
    lq = check_scores_args(q, ck1, ck2, cu_seqlens_q, cu_seqlens_c1, cu_seqlens_c2, max_seqlen_q, causal,
                           kernel_stride, coarse_kernel_stride, score_dtype)
    return _scores_checked(q, ck1, ck2, cu_seqlens_q, cu_seqlens_c1, cu_seqlens_c2, lq, causal=causal,
                           softmax_scale=softmax_scale, score_dtype=score_dtype, kernel_stride=kernel_stride,
                           coarse_kernel_stride=coarse_kernel_stride)


def check_scores_args(q, ck1, ck2, cu_seqlens_q, cu_seqlens_c1, cu_seqlens_c2, max_seqlen_q, causal,
                      kernel_stride, coarse_kernel_stride, score_dtype) -> list[int]:
    """`naive_stage1_scores`' checks (also the CPU implementation's, `cpu.py`); returns the query lengths
    (host ints)."""
    check_stage1_inputs(q, ck1, ck2, cu_seqlens_q, cu_seqlens_c1, cu_seqlens_c2)
    check_flags(causal=causal)
    check_score_dtype(score_dtype)
    check_int_args(1, kernel_stride=kernel_stride, coarse_kernel_stride=coarse_kernel_stride)
    lq = seqlens_host(cu_seqlens_q)
    if max_seqlen_q is not None:
        check_max_seqlen("max_seqlen_q", max_seqlen_q, lq)
    return lq


def _scores_checked(q, ck1, ck2, cu_seqlens_q, cu_seqlens_c1, cu_seqlens_c2, lq: list[int], *,
                    causal: bool, softmax_scale, score_dtype, kernel_stride: int,
                    coarse_kernel_stride: int) -> torch.Tensor:
    """`naive_stage1_scores` on checked inputs, `lq` the query lengths on the host."""
    n1s, n2s = seqlens_host(cu_seqlens_c1), seqlens_host(cu_seqlens_c2)
    T, HQ, D = q.shape
    H = ck1.shape[1]
    G = HQ // H
    scale = softmax_scale_of(softmax_scale, D)
    cdt = compute_dtype(q.dtype)
    out = torch.zeros(H, T, max(n1s, default=0), dtype=cdt, device=q.device)
    cu_q, cu1, cu2 = (c.tolist() for c in (cu_seqlens_q, cu_seqlens_c1, cu_seqlens_c2))
    for b, (Lq, n1, n2) in enumerate(zip(lq, n1s, n2s)):
        if Lq == 0 or n1 == 0:
            continue
        k1 = ck1[cu1[b]:cu1[b + 1]].to(cdt)
        k2 = ck2[cu2[b]:cu2[b + 1]].to(cdt)
        # Exact mode (spec 4.2): the coarse pass walks the fine keys with the fine stride.
        s2_stride = kernel_stride if n1 == n2 else coarse_kernel_stride
        chunk = max(1, min(Lq, CHUNK_ELEMS // (HQ * (n1 + n2))))
        for start in range(0, Lq, chunk):
            end = min(Lq, start + chunk)
            rows = slice(cu_q[b] + start, cu_q[b] + end)
            qc = q[rows].to(cdt).reshape(end - start, H, G, D)
            r = torch.arange(start, end, device=q.device)
            out[:, rows, :n1] = _stage1_rows(qc, k1, k2, r, n1, n2, Lq, kernel_stride, s2_stride, causal,
                                             scale)
    return out if score_dtype is None else out.to(score_dtype)


def _token_layout(cu_seqlens_q: torch.Tensor, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence index `[total_q]` and position inside the sequence `[total_q]` of every query token."""
    dev = cu_seqlens_q.device
    seq = torch.repeat_interleave(torch.arange(len(lengths), device=dev),
                                  torch.as_tensor(lengths, dtype=torch.int64, device=dev))
    r = torch.arange(seq.numel(), device=dev) - cu_seqlens_q.long()[:-1][seq]
    return seq, r


@torch.no_grad()
def naive_pool_blocks(scores: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_c1: torch.Tensor,
                      cache_lens, max_seqlen_q: int, *, init_blocks: int = 1, local_blocks: int = 32,
                      block_size: int = 64, kernel_stride: int = 16) -> torch.Tensor:
    r"""Max-pool fine-key scores into key-block scores and force the init and local blocks (spec 5).

    With `w = block_size // kernel_stride` (4), block `j`'s score for query row `r` of sequence `b` is
    `+inf` if `j < init_blocks` or `off_bq - local_blocks <= j <= off_bq`, where
    `off_bq = (r + cache_lens[b]) // block_size` (so `local_blocks + 1` local blocks are forced);
    otherwise the max of `scores[h, t, 4j-1 : 4j+4]` clipped to `[0, n1_b)`, or `-inf` if that is empty.
    Future blocks are not masked here (top-k's `-1` step and stage 2 handle them).

    Args:
        scores (torch.Tensor):
            Stage-1 scores `[H, total_q, >= max_n1]`.
        cu_seqlens_q (torch.Tensor):
            int32 `[B+1]`.
        cu_seqlens_c1 (torch.Tensor):
            int32 `[B+1]` of the fine compressed keys (gives `n1_b`).
        cache_lens (torch.Tensor or list[int] or None):
            `[B]` keys before each sequence's first query (0 in prefill, `L-1` in decode); None = zeros.
        max_seqlen_q (int):
            Sets `out_len = ceil((max_seqlen_q + max(cache_lens)) / block_size)` for the whole batch.
        init_blocks, local_blocks, block_size, kernel_stride (int, Optional):
            Default: 1, 32, 64, 16.

    Returns:
        block_scores (torch.Tensor): `[H, total_q, out_len]`, same dtype as `scores`.
    """
    check_tensor("scores", scores, ndim=3, dtypes=REF_DTYPES)
    check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, total=scores.shape[1], device=scores.device)
    B = cu_seqlens_q.numel() - 1
    check_cu_seqlens_any("cu_seqlens_c1", cu_seqlens_c1, device=scores.device, batch=B)
    check_int_args(1, block_size=block_size, kernel_stride=kernel_stride)
    check_int_args(0, init_blocks=init_blocks, local_blocks=local_blocks)
    if block_size % kernel_stride:
        raise ValueError(f"block_size ({block_size}) must be a multiple of kernel_stride ({kernel_stride})")
    lq, n1s = seqlens_host(cu_seqlens_q), seqlens_host(cu_seqlens_c1)
    check_max_seqlen("max_seqlen_q", max_seqlen_q, lq)
    if scores.shape[2] < max(n1s, default=0):
        raise ValueError(f"scores has {scores.shape[2]} columns but a sequence has {max(n1s)} fine keys "
                         f"(cu_seqlens_c1)")
    cache = check_lengths_arg("cache_lens", cache_lens, B, scores.device)
    H, T, W = scores.shape
    out_len = -(-(max_seqlen_q + (int(cache.max()) if B else 0)) // block_size)
    if out_len == 0 or T == 0:
        return scores.new_zeros(H, T, out_len)
    seq, r = _token_layout(cu_seqlens_q, lq)
    n1_tok = torch.as_tensor(n1s, dtype=torch.int64, device=scores.device)[seq]     # [T]
    off_bq = (r + cache[seq]) // block_size                                          # [T]
    w = block_size // kernel_stride
    # Shifted by one (left pad) so that window j covers padded[w*j : w*j + w + 1], i.e. keys [w*j-1, w*j+w).
    padded_len = w * out_len + 1
    j = torch.arange(out_len, device=scores.device)
    i = torch.arange(W, device=scores.device)
    out = []
    rows_per_chunk = max(1, CHUNK_ELEMS // (H * max(padded_len, W)))
    for start in range(0, T, rows_per_chunk):
        rows = slice(start, min(T, start + rows_per_chunk))
        # Fine keys past the sequence's own n1 do not exist: they must not win a max (the tensor holds 0
        # there).
        s = scores[:, rows].masked_fill(i[None, :] >= n1_tok[rows, None], float("-inf"))
        s = torch.nn.functional.pad(s, (1, max(0, padded_len - 1 - W)), value=float("-inf"))[..., :padded_len]
        pooled = s.unfold(-1, w + 1, w).amax(dim=-1)                                 # [H, rows, out_len]
        ob = off_bq[rows, None]
        forced = (j[None, :] < init_blocks) | ((j[None, :] <= ob) & (j[None, :] >= ob - local_blocks))
        out.append(pooled.masked_fill(forced[None], float("inf")))
    return torch.cat(out, dim=1)


def q_block_idx_prefill(cu_seqlens_q: torch.Tensor, max_seqlen_q: int, *, block_size: int = 64,
                        varlen_offset_quirk: bool = False, cache_lens=None) -> torch.Tensor:
    r"""Key block that holds each query token (the top-k cut-off of spec 6).

    `(r + cache_lens[b]) // block_size` for query row `r` of sequence `b`. With
    `varlen_offset_quirk=True`, HF's prefill rule `(r + max_seqlen_q - L_b) // block_size` is used
    instead of `r` (shorter sequences of a ragged batch then keep some future blocks).

    Args:
        cu_seqlens_q (torch.Tensor):
            int32 `[B+1]`.
        max_seqlen_q (int):
            Longest query sequence (only used by the quirk).
        block_size (int, Optional):
            Default: 64.
        varlen_offset_quirk (bool, Optional):
            Default: `False`.
        cache_lens (torch.Tensor or list[int] or None, Optional):
            `[B]` keys before each sequence's queries (chunked prefill); None = zeros. Default: `None`.

    Returns:
        q_block_idx (torch.Tensor): int32 `[total_q]`.
    """
    check_cu_seqlens_any("cu_seqlens_q", cu_seqlens_q)
    check_int_args(1, block_size=block_size)
    check_flags(varlen_offset_quirk=varlen_offset_quirk)
    lq = seqlens_host(cu_seqlens_q)
    check_max_seqlen("max_seqlen_q", max_seqlen_q, lq)
    cache = check_lengths_arg("cache_lens", cache_lens, len(lq), cu_seqlens_q.device)
    return q_block_idx_checked(cu_seqlens_q, lq, cache, max_seqlen_q, block_size=block_size,
                               varlen_offset_quirk=varlen_offset_quirk)


def q_block_idx_checked(cu_seqlens_q: torch.Tensor, lq: list[int], cache: torch.Tensor, max_seqlen_q: int, *,
                        block_size: int = 64, varlen_offset_quirk: bool = False) -> torch.Tensor:
    """`q_block_idx_prefill` on checked inputs: `lq` the query lengths on the host, `cache` int64 `[B]`
    on `cu_seqlens_q`'s device. Reads nothing back from the device."""
    seq, r = _token_layout(cu_seqlens_q, lq)
    pos = r + cache[seq]
    if varlen_offset_quirk:
        pos = pos + max_seqlen_q - torch.as_tensor(lq, dtype=torch.int64, device=pos.device)[seq]
    return (pos // block_size).to(torch.int32)


def q_block_idx_decode(cache_lens, *, block_size: int = 64) -> torch.Tensor:
    r"""Key block of the single decode query of each sequence: `cache_lens // block_size`.

    Args:
        cache_lens (torch.Tensor or list[int]):
            `[B]` cached keys before the current token (`L - 1` when the cache holds it).
        block_size (int, Optional):
            Default: 64.

    Returns:
        q_block_idx (torch.Tensor): int32 `[B]`.
    """
    check_int_args(1, block_size=block_size)
    if cache_lens is None:
        raise TypeError("cache_lens must be a tensor or a list of ints, got None")
    dev = cache_lens.device if isinstance(cache_lens, torch.Tensor) else torch.device("cpu")
    n = cache_lens.numel() if isinstance(cache_lens, torch.Tensor) else len(cache_lens)
    return (check_lengths_arg("cache_lens", cache_lens, n, dev) // block_size).to(torch.int32)


@torch.no_grad()
def naive_select_topk(block_scores: torch.Tensor, q_block_idx: torch.Tensor, *, topk: int = 64,
                      local_blocks: int = 32) -> torch.Tensor:
    r"""Pick the `K = min(topk + local_blocks, out_len)` best blocks per (KV head, token) (spec 6).

    The K highest scores with ties to the lower block index (the stage-1 and decode kernels' rule,
    docs/semantics.md), indices sorted ascending, then every index `> q_block_idx[t]` (a future
    block) becomes `-1`. The ascending sort puts those at the end, so `-1` is tail padding only.

    Args:
        block_scores (torch.Tensor):
            `[H, total_q, out_len]` from `naive_pool_blocks`.
        q_block_idx (torch.Tensor):
            int32 or int64 `[total_q]`: the block holding each query token.
        topk, local_blocks (int, Optional):
            Default: 64, 32 (MiniCPM4: K = 96).

    Returns:
        topk_idx (torch.Tensor): int32 `[H, total_q, K]`.
    """
    check_tensor("block_scores", block_scores, ndim=3, dtypes=REF_DTYPES)
    check_tensor("q_block_idx", q_block_idx, dtypes=INT_DTYPES, shape=(block_scores.shape[1],),
                 device=block_scores.device)
    check_int_args(0, topk=topk, local_blocks=local_blocks)
    K = selection_slots(topk, local_blocks, block_scores.shape[2])
    # a stable descending sort keeps equal scores in index order: ties go to the lower block
    # (`torch.topk` leaves them unspecified, and its choice changes with the row's width)
    idx = block_scores.sort(dim=-1, descending=True, stable=True).indices[..., :K].sort(dim=-1).values
    idx = idx.masked_fill(idx > q_block_idx.long()[None, :, None], -1)
    return idx.to(torch.int32)


@torch.no_grad()
def naive_stage1_select(q: torch.Tensor, ck1: torch.Tensor, ck2: torch.Tensor, cu_seqlens_q: torch.Tensor,
                        cu_seqlens_c1: torch.Tensor, cu_seqlens_c2: torch.Tensor, max_seqlen_q: int, *,
                        causal: bool = True, cache_lens=None, softmax_scale: float | None = None,
                        topk: int = 64, local_blocks: int = 32, init_blocks: int = 1, block_size: int = 64,
                        kernel_stride: int = 16, coarse_kernel_stride: int = 64,
                        varlen_offset_quirk: bool = False, score_dtype: torch.dtype | None = torch.bfloat16,
                        return_scores: bool = False, host_seqlens: HostSeqlens | None = None):
    r"""Stage 1 end to end: scores, block pooling, top-k.

    Prefill: `causal=True`, `cache_lens` None (or the keys before each query chunk in chunked
    prefill). Decode: `causal=False`, one query per sequence, `cache_lens = L - 1`.

    Args:
        q, ck1, ck2, cu_seqlens_q, cu_seqlens_c1, cu_seqlens_c2:
            As in `naive_stage1_scores`.
        max_seqlen_q (int):
            Longest query sequence (sets the pooled width).
        causal (bool, Optional):
            Default: `True`.
        cache_lens (torch.Tensor or list[int] or None, Optional):
            `[B]`. Default: `None` (zeros).
        softmax_scale (float, Optional):
            Default: `None` (`1 / sqrt(D)`).
        topk, local_blocks, init_blocks, block_size, kernel_stride, coarse_kernel_stride (int, Optional):
            Default: 64, 32, 1, 64, 16, 64.
        varlen_offset_quirk (bool, Optional):
            HF's ragged-batch offset of the query block (see `q_block_idx_prefill`). Default: `False`.
        score_dtype (torch.dtype, Optional):
            dtype of scores and block scores (top-k runs on it). Default: `torch.bfloat16`.
        return_scores (bool, Optional):
            Also return the scores and block scores. Default: `False`.
        host_seqlens (HostSeqlens, Optional):
            `cu_seqlens_q` on the host (`host_seqlens.q`) from a caller that checked every input against
            each other (the decode step over its cache's layout): the tensors are then not checked again
            and the query lengths are not read back. Default: `None`.

    Returns:
        topk_idx (torch.Tensor): int32 `[H, total_q, K]`; with `return_scores`, the tuple
        `(topk_idx, scores [H, total_q, max_n1], block_scores [H, total_q, out_len])`.
    """
    check_flags(varlen_offset_quirk=varlen_offset_quirk, return_scores=return_scores)
    if host_seqlens is None:
        lq = check_scores_args(q, ck1, ck2, cu_seqlens_q, cu_seqlens_c1, cu_seqlens_c2, max_seqlen_q, causal,
                               kernel_stride, coarse_kernel_stride, score_dtype)
    else:
        check_score_dtype(score_dtype)
        lq = host_seqlens.lq
    return _select_checked(q, ck1, ck2, cu_seqlens_q, cu_seqlens_c1, cu_seqlens_c2, lq, max_seqlen_q,
                          causal=causal, cache_lens=cache_lens, softmax_scale=softmax_scale, topk=topk,
                          local_blocks=local_blocks, init_blocks=init_blocks, block_size=block_size,
                          kernel_stride=kernel_stride, coarse_kernel_stride=coarse_kernel_stride,
                          varlen_offset_quirk=varlen_offset_quirk, score_dtype=score_dtype,
                          return_scores=return_scores)


def _select_checked(q, ck1, ck2, cu_seqlens_q, cu_seqlens_c1, cu_seqlens_c2, lq: list[int], max_seqlen_q: int,
                   *, causal: bool, cache_lens, softmax_scale, topk: int, local_blocks: int, init_blocks: int,
                   block_size: int, kernel_stride: int, coarse_kernel_stride: int, varlen_offset_quirk: bool,
                   score_dtype, return_scores: bool = False):
    """`naive_stage1_select` on inputs it or its caller checked (q, the keys and their offsets against each
    other; `lq` the query lengths on the host): the decode step checks its own arguments once and
    passes a layout it built. Pooling and top-k still check the intermediates they take."""
    scores = _scores_checked(q, ck1, ck2, cu_seqlens_q, cu_seqlens_c1, cu_seqlens_c2, lq, causal=causal,
                             softmax_scale=softmax_scale, score_dtype=score_dtype,
                             kernel_stride=kernel_stride, coarse_kernel_stride=coarse_kernel_stride)
    block_scores = naive_pool_blocks(scores, cu_seqlens_q, cu_seqlens_c1, cache_lens, max_seqlen_q,
                                     init_blocks=init_blocks, local_blocks=local_blocks,
                                     block_size=block_size, kernel_stride=kernel_stride)
    q_blocks = q_block_idx_prefill(cu_seqlens_q, max_seqlen_q, block_size=block_size,
                                   varlen_offset_quirk=varlen_offset_quirk, cache_lens=cache_lens)
    topk_idx = naive_select_topk(block_scores, q_blocks, topk=topk, local_blocks=local_blocks)
    return (topk_idx, scores, block_scores) if return_scores else topk_idx
