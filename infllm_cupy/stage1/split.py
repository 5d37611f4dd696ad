"""Stage 1 at long context, split over key-block ranges with an exact merge: the PyTorch reference.

The one-launch kernel keeps every token's block scores (`out_len` keys per token) until its top-K;
past what shared memory holds they go to a global scratch `[H, total_q, olp]` (34 GB at 512k tokens
with fp32 scores). The split path needs only O(total_q x K) extra memory:

1. **Row statistics**: per (token, query head) the coarse-pass max `m` and normaliser `Z` over ALL
   the token's visible coarse keys (`row_stats`). The scores are per-head probabilities summed over
   the group, so the normalisation must be known before any range sums heads.
2. **Range passes**: the key blocks split into ranges `[j0, j1)` (`block_ranges`); a pass computes,
   per (KV head, token), the fine scores of keys `[4 j0 - 1, 4 j1)` only (one key of overlap: the
   pooling window of block `j0` starts at key `4 j0 - 1`), pools them to the range's blocks, forces
   the init / local blocks that fall inside the range, and keeps the range's best `min(K, j1 - j0)`
   candidates (block score, block index), ties to the lower index (`range_candidates`).
3. **Merge**: the running candidates and the range's are merged to the top-K of their union, ties
   to the lower block index (`merge_candidates`). Every block of the global top-K is in its own
   range's top-K under the same total order, so the merge is exact. Finally the indices are sorted
   ascending and those after the token's own block become the `-1` tail (`finish_candidates`).

`split_stage1_select` chains them and equals `naive_stage1_select` under our tie rule (the K
largest block scores, ties to the lower index). Scores are computed with the same operations as
`naive_stage1_scores`, so on inputs whose dot products are exact in fp32 they are bit-identical.
The kernel path that follows this plan and why: docs/stage1.md (9. Long context: key ranges).
"""
from __future__ import annotations

import torch

from .. import _checks
from .._checks import check_int_args, check_lengths_arg, check_max_seqlen, seqlens_host
from .._dtypes import compute_dtype
from .._rules import selection_slots, softmax_scale_of
from .naive import CHUNK_ELEMS, q_block_idx_prefill, vis_limit

RANGE_ALIGN = 16   # blocks per 64-key fine tile of the kernels: a range starts on a tile


def block_ranges(out_len: int, range_blocks: int) -> list[tuple[int, int]]:
    """`[(j0, j1), ...]` covering blocks `[0, out_len)` in ranges of `range_blocks` (a positive
    multiple of 16, so that every range starts on a 64-key fine tile of the kernels)."""
    check_int_args(0, out_len=out_len)
    check_int_args(1, range_blocks=range_blocks)
    if range_blocks % RANGE_ALIGN:
        raise ValueError(f"range_blocks must be a multiple of {RANGE_ALIGN}, got {range_blocks}")
    return [(j, min(out_len, j + range_blocks)) for j in range(0, out_len, range_blocks)]


def _seq_rows(cu_seqlens_q, lq):
    cu_q = cu_seqlens_q.tolist()
    return [(b, cu_q[b], L) for b, L in enumerate(lq)]


@torch.no_grad()
def row_stats(q, ck2, cu_seqlens_q, cu_seqlens_c1, cu_seqlens_c2, *, causal: bool = True,
              softmax_scale: float | None = None, kernel_stride: int = 16, coarse_kernel_stride: int = 64):
    r"""The coarse pass alone: per token and query head, `m` (max of `q . ck2_j` over the visible
    coarse keys; 0 when none) and `Z` (sum of `exp(scale (q . ck2_j - m))`; 1 when none), and
    `has_coarse [total_q]`. Exact mode (a sequence with as many coarse as fine keys) uses the fine
    stride, as `naive_stage1_scores` does.

    Returns:
        `(m [total_q, HQ], Z [total_q, HQ], has_coarse [total_q] bool)` in the compute dtype.
    """
    T, HQ, D = q.shape
    H = ck2.shape[1]
    G = HQ // H
    scale = softmax_scale_of(softmax_scale, D)
    cdt = compute_dtype(q.dtype)
    lq = seqlens_host(cu_seqlens_q)
    n1s, n2s = seqlens_host(cu_seqlens_c1), seqlens_host(cu_seqlens_c2)
    cu2 = cu_seqlens_c2.tolist()
    m_out = torch.zeros(T, HQ, dtype=cdt, device=q.device)
    z_out = torch.ones(T, HQ, dtype=cdt, device=q.device)
    has = torch.zeros(T, dtype=torch.bool, device=q.device)
    for b, qs, Lq in _seq_rows(cu_seqlens_q, lq):
        n1, n2 = n1s[b], n2s[b]
        if Lq == 0 or n1 == 0:
            continue
        k2 = ck2[cu2[b]:cu2[b + 1]].to(cdt)
        s2_stride = kernel_stride if n1 == n2 else coarse_kernel_stride
        chunk = max(1, min(Lq, CHUNK_ELEMS // (HQ * max(1, n2))))
        for start in range(0, Lq, chunk):
            end = min(Lq, start + chunk)
            r = torch.arange(start, end, device=q.device)
            qh = q[qs + start:qs + end].to(cdt).reshape(end - start, H, G, D).permute(1, 2, 0, 3)
            l2 = vis_limit(r, s2_stride, n2, Lq, causal=causal)
            s2 = torch.matmul(qh, k2.permute(1, 2, 0).unsqueeze(1))                  # [H, G, C, n2]
            j = torch.arange(n2, device=q.device)
            s2 = s2.masked_fill(j[None, :] >= l2[:, None], float("-inf"))
            # the same steps as naive._stage1_rows (pass 1)
            hc = l2 > 0
            m = s2.amax(dim=-1, keepdim=True) if n2 > 0 else s2.new_zeros(H, G, end - start, 1)
            m = torch.where(hc[:, None], m, torch.zeros_like(m))
            Z = torch.exp(scale * (s2 - m)).sum(dim=-1, keepdim=True)
            Z = torch.where(hc[:, None], Z, torch.ones_like(Z))
            m_out[qs + start:qs + end] = m[..., 0].permute(2, 0, 1).reshape(end - start, HQ)
            z_out[qs + start:qs + end] = Z[..., 0].permute(2, 0, 1).reshape(end - start, HQ)
            has[qs + start:qs + end] = hc
    return m_out, z_out, has


@torch.no_grad()
def range_block_scores(q, ck1, cu_seqlens_q, cu_seqlens_c1, stats, j0: int, j1: int, cache_lens,
                       max_seqlen_q: int,
                       *, causal: bool = True, softmax_scale: float | None = None, init_blocks: int = 1,
                       local_blocks: int = 32, score_dtype: torch.dtype | None = torch.bfloat16,
                       kernel_stride: int = 16, block_size: int = 64) -> torch.Tensor:
    r"""Block scores `[H, total_q, j1 - j0]` of blocks `[j0, j1)` (score dtype), computed from fine
    keys `[4 j0 - 1, 4 j1)` only and the row statistics `stats` of `row_stats`: the same values as
    the columns `j0 .. j1 - 1` of `naive_pool_blocks(naive_stage1_scores(...))`."""
    T, HQ, D = q.shape
    H = ck1.shape[1]
    G = HQ // H
    w = block_size // kernel_stride
    scale = softmax_scale_of(softmax_scale, D)
    cdt = compute_dtype(q.dtype)
    sdt = cdt if score_dtype is None else score_dtype
    m_all, z_all, has_all = stats
    lq, n1s = seqlens_host(cu_seqlens_q), seqlens_host(cu_seqlens_c1)
    cu1 = cu_seqlens_c1.tolist()
    B = len(lq)
    cache = check_lengths_arg("cache_lens", cache_lens, B, q.device)
    W = j1 - j0
    out = torch.empty(H, T, W, dtype=sdt, device=q.device)
    f0, f1 = max(0, w * j0 - 1), w * j1          # fine keys the range's pooling windows read
    for b, qs, Lq in _seq_rows(cu_seqlens_q, lq):
        if Lq == 0:
            continue
        n1 = n1s[b]
        g0, g1 = min(f0, n1), min(f1, n1)
        k1 = ck1[cu1[b] + g0:cu1[b] + g1].to(cdt)                                       # [nr, H, D]
        nr = g1 - g0
        chunk = max(1, min(Lq, CHUNK_ELEMS // (HQ * max(1, nr + W * (w + 1)))))
        for start in range(0, Lq, chunk):
            end = min(Lq, start + chunk)
            C = end - start
            rows = slice(qs + start, qs + end)
            r = torch.arange(start, end, device=q.device)
            qh = q[rows].to(cdt).reshape(C, H, G, D).permute(1, 2, 0, 3)               # [H, G, C, D]
            m = m_all[rows].reshape(C, H, G).permute(1, 2, 0)[..., None]              # [H, G, C, 1]
            Z = z_all[rows].reshape(C, H, G).permute(1, 2, 0)[..., None]
            hc = has_all[rows]
            l1 = vis_limit(r, kernel_stride, n1, Lq, causal=causal)
            # the same steps as naive._stage1_rows (pass 2), on the range's keys
            s1 = torch.matmul(qh, k1.permute(1, 2, 0).unsqueeze(1))                     # [H, G, C, nr]
            i = torch.arange(g0, g1, device=q.device)
            s1 = s1.masked_fill(i[None, :] >= l1[:, None], float("-inf"))
            p = torch.exp(scale * s1 - scale * m) / Z
            sc = p.sum(dim=1)                                                             # [H, C, nr]
            sc = torch.where(hc[None, :, None], sc, torch.zeros_like(sc))
            sc = sc.to(sdt).to(cdt)                       # pooled in the score dtype, as the reference
            # pooling: window of block j = keys [w j - 1, w j + w) clipped to [0, n1); laid out on the
            # padded axis of keys [w j0 - 1, w j1) (keys outside [0, n1) are -inf)
            if nr > 0:
                lo_pad = g0 - (w * j0 - 1)                 # 1 when the range starts at key 0 (no key -1)
                s = torch.nn.functional.pad(sc, (lo_pad, w * j1 - g1), value=float("-inf"))  # [H, C, w W + 1]
            else:                                          # the sequence has no key in the range
                s = sc.new_full((H, C, w * W + 1), float("-inf"))
            pooled = s.unfold(-1, w + 1, w).amax(dim=-1)                               # [H, C, W]
            off_bq = (r + int(cache[b]))[:, None] // block_size
            j = torch.arange(j0, j1, device=q.device)[None, :]
            forced = (j < init_blocks) | ((j <= off_bq) & (j >= off_bq - local_blocks))
            out[:, rows] = pooled.masked_fill(forced[None], float("inf")).to(sdt)
    return out


def _order_key(scores: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Sort order (descending score, then ascending index) as two stable sorts' permutation."""
    by_idx = torch.sort(idx, dim=-1, stable=True).indices
    s = torch.gather(scores.float(), -1, by_idx)
    by_score = torch.sort(s, dim=-1, descending=True, stable=True).indices
    return torch.gather(by_idx, -1, by_score)


def range_candidates(block_scores: torch.Tensor, j0: int, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The best `min(K, W)` blocks of one range `[H, T, W]` (block `j0 + x` at column `x`): their
    scores and global block indices, best first (ties: lower index first)."""
    W = block_scores.shape[-1]
    idx = torch.arange(j0, j0 + W, device=block_scores.device).expand_as(block_scores)
    order = _order_key(block_scores, idx)[..., :min(K, W)]
    return torch.gather(block_scores, -1, order), torch.gather(idx, -1, order)


def merge_candidates(a: tuple[torch.Tensor, torch.Tensor] | None, b: tuple[torch.Tensor, torch.Tensor],
                     K: int):
    """Top-K of the union of two candidate sets `(scores [H, T, ka], idx [H, T, ka])`, ties to the
    lower block index; `a` None is the empty set."""
    if a is None:
        s, i = b
    else:
        s, i = torch.cat([a[0], b[0]], dim=-1), torch.cat([a[1], b[1]], dim=-1)
    order = _order_key(s, i)[..., :K]
    return torch.gather(s, -1, order), torch.gather(i, -1, order)


def finish_candidates(idx: torch.Tensor, q_block_idx: torch.Tensor) -> torch.Tensor:
    """InfLLM-v2's `topk_idx` from the merged candidates: ascending, blocks after each token's own
    block (`q_block_idx [T]`) replaced by the `-1` tail."""
    idx = idx.sort(dim=-1).values
    return idx.masked_fill(idx > q_block_idx.long()[None, :, None], -1).to(torch.int32)


@torch.no_grad()
def split_stage1_select(q: torch.Tensor, ck1: torch.Tensor, ck2: torch.Tensor, cu_seqlens_q: torch.Tensor,
                        cu_seqlens_c1: torch.Tensor, cu_seqlens_c2: torch.Tensor, max_seqlen_q: int, *,
                        range_blocks: int, causal: bool = True, cache_lens=None,
                        softmax_scale: float | None = None,
                        topk: int = 64, local_blocks: int = 32, init_blocks: int = 1, block_size: int = 64,
                        kernel_stride: int = 16, coarse_kernel_stride: int = 64,
                        varlen_offset_quirk: bool = False,
                        score_dtype: torch.dtype | None = torch.bfloat16) -> torch.Tensor:
    r"""`naive_stage1_select`'s `topk_idx`, computed range by range (module docstring): row
    statistics, then per range of `range_blocks` blocks (a multiple of 16) the range's block scores
    and its top-K candidates, merged into a running top-K. Extra memory besides one range's scores:
    the candidates, `[H, total_q, K]` scores and indices. Ties go to the lower block index.

    Args: as `naive_stage1_select` (no `return_scores`), plus `range_blocks` (int, keyword).

    Returns:
        topk_idx (torch.Tensor): int32 `[H, total_q, K]`.
    """
    _checks.check_flags(causal=causal, varlen_offset_quirk=varlen_offset_quirk)
    G = _checks.check_stage1_inputs(q, ck1, ck2, cu_seqlens_q, cu_seqlens_c1, cu_seqlens_c2)
    del G
    lq = seqlens_host(cu_seqlens_q)
    check_max_seqlen("max_seqlen_q", max_seqlen_q, lq)
    check_int_args(0, topk=topk, local_blocks=local_blocks, init_blocks=init_blocks)
    check_int_args(1, block_size=block_size, kernel_stride=kernel_stride,
                   coarse_kernel_stride=coarse_kernel_stride)
    if block_size != 4 * kernel_stride:
        raise ValueError("block_size must be 4 * kernel_stride for the split path (the kernels' pooling), "
                         f"got {block_size} and {kernel_stride}")
    B = len(lq)
    cache = check_lengths_arg("cache_lens", cache_lens, B, q.device)
    out_len = -(-(max_seqlen_q + (int(cache.max()) if B else 0)) // block_size)
    K = selection_slots(topk, local_blocks, out_len)
    T, H = q.shape[0], ck1.shape[1]
    ranges = block_ranges(out_len, range_blocks)
    if K == 0 or T == 0 or H == 0:
        return torch.empty(H, T, K, dtype=torch.int32, device=q.device)
    stats = row_stats(q, ck2, cu_seqlens_q, cu_seqlens_c1, cu_seqlens_c2, causal=causal,
                      softmax_scale=softmax_scale, kernel_stride=kernel_stride,
                      coarse_kernel_stride=coarse_kernel_stride)
    run = None
    for j0, j1 in ranges:
        bs = range_block_scores(q, ck1, cu_seqlens_q, cu_seqlens_c1, stats, j0, j1, cache, max_seqlen_q,
                                causal=causal, softmax_scale=softmax_scale, init_blocks=init_blocks,
                                local_blocks=local_blocks, score_dtype=score_dtype,
                                kernel_stride=kernel_stride, block_size=block_size)
        run = merge_candidates(run, range_candidates(bs, j0, K), K)
    q_blocks = q_block_idx_prefill(cu_seqlens_q, max_seqlen_q, block_size=block_size,
                                   varlen_offset_quirk=varlen_offset_quirk, cache_lens=cache)
    return finish_candidates(run[1], q_blocks)


__all__ = ["block_ranges", "finish_candidates", "merge_candidates", "range_block_scores", "range_candidates",
           "row_stats", "split_stage1_select"]
