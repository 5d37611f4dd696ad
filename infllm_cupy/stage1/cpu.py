"""The CPU implementation of stage 1 (spec sections 4-6): compressed-key scores, block pooling and
top-k in tiles of fp32 GEMMs, what `stage1_select` and `stage1_scores` run on CPU tensors under
`backend="auto"` (docs/cpu.md, "Stage 1 and compression").

Same signatures, semantics and rounding points as the oracle (`naive.py`): the scores are computed in
fp32 (float64 for float64 inputs) with the oracle's elementwise steps in its order (`exp(scale * s1 -
scale * m) / Z`), rounded to `score_dtype`, then max-pooled and ranked on the rounded values, ties to
the lower block index. What differs is the shape of the work:

- one query tile (`C` tokens x all heads) at a time, `C` sized so that a tile's scores stay near
  `TILE_ELEMS` fp32 elements (cache-resident), and only the keys the tile's last row sees are scored
  (causal rows see about half the keys on average: the oracle scores every key and masks);
- the row masks touch only the few columns where the tile's rows differ;
- the block scores of a row are pooled in the tile and ranked at once (top-k on int64 keys that hold
  the score's bits and the block index, so ties go to the lower index without a sort of the row);
  no `[H, total_q, n1]` or `[H, total_q, out_len]` tensor exists unless `return_scores` asks for it;
- a row's width is the blocks that hold data, not `max_seqlen_q`: memory is bounded by the tile and
  the actual lengths, never by `max_seqlen_q` (an oversized one only changes K and the quirk's
  query block, both of which this reproduces).

The fp32 sums (the normaliser over coarse keys, the group sum) run in a different order than the
oracle's (torch picks a reduction order per shape), so fp32 scores differ from the oracle's by about an
ulp, and the selections by as much as a near-tie at that scale allows (docs/cpu.md).
"""
from __future__ import annotations

import concurrent.futures
import math
import threading

import torch

from .._checks import (
    HostSeqlens,
    check_flags,
    check_int_args,
    check_lengths_arg,
    check_max_seqlen,
    check_score_dtype,
    check_tensor,
)
from .._dtypes import INT_DTYPES, REF_DTYPES, compute_dtype
from .._rules import cdiv, selection_slots, softmax_scale_of
from .naive import check_scores_args, q_block_idx_checked, vis_limit

# fp32 elements of one tile's fine scores `[HQ, C, keys]` (4 MiB): small enough to stay in cache
# between the GEMM and the elementwise steps that follow it, large enough that each tile's dozen torch
# calls cost little next to its GEMM (docs/cpu.md).
TILE_ELEMS = 1 << 20
LOG2E = 1.0 / math.log(2.0)
# query rows of one tile, at most (the early rows of a causal sequence see few keys)
MAX_TILE_ROWS = 1024
MIN_TILE_ROWS = 8
# fine keys of one column chunk of the fine pass, at least
FINE_MIN_COLS = 256
# GEMM widths are rounded up to this many keys (MKL runs ragged widths 10-40% slower)
PAD_COLS = 32


@torch.no_grad()
def cpu_stage1_scores(q: torch.Tensor, ck1: torch.Tensor, ck2: torch.Tensor, cu_seqlens_q: torch.Tensor,
                      cu_seqlens_c1: torch.Tensor, cu_seqlens_c2: torch.Tensor,
                      max_seqlen_q: int | None = None,
                      *, causal: bool = True, softmax_scale: float | None = None,
                      score_dtype: torch.dtype | None = torch.bfloat16, kernel_stride: int = 16,
                      coarse_kernel_stride: int = 64) -> torch.Tensor:
    r"""`naive_stage1_scores` in tiles of fp32 GEMMs: the stage-1 score matrix `[H, total_q, max_n1]`.

    Same arguments, checks and result as `naive_stage1_scores` (within about an ulp of the compute
    dtype before the rounding to `score_dtype`).
    """
    lq = check_scores_args(q, ck1, ck2, cu_seqlens_q, cu_seqlens_c1, cu_seqlens_c2, max_seqlen_q, causal,
                           kernel_stride, coarse_kernel_stride, score_dtype)
    run = _Run(q, ck1, ck2, cu_seqlens_q, cu_seqlens_c1, cu_seqlens_c2, lq, causal=causal,
               softmax_scale=softmax_scale, score_dtype=score_dtype, kernel_stride=kernel_stride,
               coarse_kernel_stride=coarse_kernel_stride)
    scores = run.new_scores()
    run.sweep(scores=scores)
    return scores


@torch.no_grad()
def cpu_stage1_select(q: torch.Tensor, ck1: torch.Tensor, ck2: torch.Tensor, cu_seqlens_q: torch.Tensor,
                      cu_seqlens_c1: torch.Tensor, cu_seqlens_c2: torch.Tensor, max_seqlen_q: int, *,
                      causal: bool = True, cache_lens=None, softmax_scale: float | None = None,
                      topk: int = 64, local_blocks: int = 32, init_blocks: int = 1, block_size: int = 64,
                      kernel_stride: int = 16, coarse_kernel_stride: int = 64,
                      varlen_offset_quirk: bool = False, score_dtype: torch.dtype | None = torch.bfloat16,
                      return_scores: bool = False, host_seqlens: HostSeqlens | None = None):
    r"""`naive_stage1_select` in tiles of fp32 GEMMs: scores, block pooling and top-k, one query tile at
    a time.

    Same arguments, checks and outputs as `naive_stage1_select` (`topk_idx int32 [H, total_q, K]`, with
    `return_scores` also `scores [H, total_q, max_n1]` and `block_scores [H, total_q, out_len]`),
    with the oracle's rounding points and tie rule (docs/cpu.md: what agrees, exactly or within an
    ulp). Extra memory is one tile and the output; `max_seqlen_q` sizes nothing but the returned
    block scores.
    """
    check_flags(varlen_offset_quirk=varlen_offset_quirk, return_scores=return_scores)
    if host_seqlens is None:
        lq = check_scores_args(q, ck1, ck2, cu_seqlens_q, cu_seqlens_c1, cu_seqlens_c2, max_seqlen_q, causal,
                               kernel_stride, coarse_kernel_stride, score_dtype)
    else:
        check_score_dtype(score_dtype)
        lq = host_seqlens.lq
    # the pooling's and top-k's checks (naive_pool_blocks, naive_select_topk), in their order
    check_int_args(1, block_size=block_size, kernel_stride=kernel_stride)
    check_int_args(0, init_blocks=init_blocks, local_blocks=local_blocks)
    if block_size % kernel_stride:
        raise ValueError(f"block_size ({block_size}) must be a multiple of kernel_stride ({kernel_stride})")
    check_max_seqlen("max_seqlen_q", max_seqlen_q, lq)
    cache = check_lengths_arg("cache_lens", cache_lens, len(lq), q.device)
    check_int_args(0, topk=topk, local_blocks=local_blocks)
    run = _Run(q, ck1, ck2, cu_seqlens_q, cu_seqlens_c1, cu_seqlens_c2, lq, causal=causal,
               softmax_scale=softmax_scale, score_dtype=score_dtype, kernel_stride=kernel_stride,
               coarse_kernel_stride=coarse_kernel_stride)
    sel = _Selection(run, cache, max_seqlen_q, topk=topk, local_blocks=local_blocks, init_blocks=init_blocks,
                     block_size=block_size, varlen_offset_quirk=varlen_offset_quirk,
                     return_scores=return_scores)
    scores = run.new_scores() if return_scores else None
    run.sweep(scores=scores, select=sel)
    return (sel.topk_idx, scores, sel.block_scores) if return_scores else sel.topk_idx


class _Run:
    """One call's stage-1 scores, tile by tile (`sweep`)."""

    def __init__(self, q, ck1, ck2, cu_seqlens_q, cu_seqlens_c1, cu_seqlens_c2, lq: list[int], *,
                 causal: bool, softmax_scale, score_dtype, kernel_stride: int, coarse_kernel_stride: int):
        self.q, self.ck1, self.ck2 = q, ck1, ck2
        self.lq = lq
        self.cu_q = [0]
        for n in lq:
            self.cu_q.append(self.cu_q[-1] + n)
        self.cu1, self.cu2 = cu_seqlens_c1.tolist(), cu_seqlens_c2.tolist()
        self.n1s = [b - a for a, b in zip(self.cu1[:-1], self.cu1[1:])]
        self.n2s = [b - a for a, b in zip(self.cu2[:-1], self.cu2[1:])]
        self.T, self.HQ, self.D = q.shape
        self.H = ck1.shape[1]
        self.G = self.HQ // self.H
        self.causal = causal
        self.scale = softmax_scale_of(softmax_scale, self.D)
        self.cdt = compute_dtype(q.dtype)
        self.sdt = self.cdt if score_dtype is None else score_dtype
        self.s1 = kernel_stride
        self.s2c = coarse_kernel_stride
        self._ws = threading.local()          # per thread: the coarse and fine GEMMs' outputs

    def new_scores(self) -> torch.Tensor:
        return torch.zeros(self.H, self.T, max(self.n1s, default=0), dtype=self.sdt, device=self.q.device)

    def sweep(self, *, scores: torch.Tensor | None = None, select: _Selection | None = None) -> None:
        """Every query tile of every sequence: its scores (rounded to the score dtype) into `scores`,
        its pooled rows and top-k into `select`. Tiles run on `torch.get_num_threads()` threads, one
        tile per thread at a time (`run_tiles`); each writes its own rows only."""
        keys, tiles = {}, []
        for b, Lq in enumerate(self.lq):
            if Lq == 0:
                continue
            n1, n2 = self.n1s[b], self.n2s[b]
            # exact mode (spec 4.2): the coarse pass walks the fine keys with the fine stride
            s2 = self.s1 if n1 == n2 else self.s2c
            k1 = self._keys(self.ck1, self.cu1[b], n1)
            k2 = k1 if self.ck2 is self.ck1 and self.cu2[b] == self.cu1[b] and n1 == n2 else \
                self._keys(self.ck2, self.cu2[b], n2)
            keys[b] = (k1, k2, s2)
            start = 0
            while start < Lq:
                end = self._tile_end(start, Lq, n1, n2, s2)
                tiles.append((b, start, end))
                start = end

        def one(tile_rows):
            b, start, end = tile_rows
            k1, k2, s2 = keys[b]
            Lq, n1, n2 = self.lq[b], self.n1s[b], self.n2s[b]
            l1 = vis_limit(torch.arange(start, end), self.s1, n1, Lq, causal=self.causal)
            l2 = vis_limit(torch.arange(start, end), s2, n2, Lq, causal=self.causal)
            tile = self._tile(b, start, end, k1, k2, l1, l2) if n1 > 0 else None
            t0 = self.cu_q[b] + start
            if scores is not None and tile is not None:
                scores[:, t0:t0 + end - start, :tile.shape[2]] = tile
            if select is not None:
                select.rows(b, start, end, tile, n1)

        # the costliest tiles (a sequence's last rows see the most keys) first: the threads finish together
        run_tiles(tiles[::-1], one)

    def _keys(self, ck: torch.Tensor, c0: int, n: int) -> torch.Tensor:
        """One sequence's compressed keys `[H, n', D]` in the compute dtype, contiguous, with zero rows up
        to `n'`, `n` rounded up to `PAD_COLS` (GEMMs of those widths run faster; the extra columns are
        masked or dropped)."""
        out = torch.zeros(self.H, _pad(n), self.D, dtype=self.cdt)
        out[:, :n] = ck[c0:c0 + n].transpose(0, 1)
        return out

    def _tile_end(self, start: int, Lq: int, n1: int, n2: int, s2: int) -> int:
        """The end of the tile from `start`: as many rows as keep its coarse scores `[HQ, C, l2]` and one
        column chunk of its fine scores (at least `FINE_MIN_COLS` keys) within `TILE_ELEMS`."""
        rows = min(MAX_TILE_ROWS, Lq - start)
        while rows > MIN_TILE_ROWS:
            r = start + rows - 1
            fine = min(_pad(vis_limit(r, self.s1, n1, Lq, causal=self.causal)), FINE_MIN_COLS)
            width = max(_pad(vis_limit(r, s2, n2, Lq, causal=self.causal)), fine)
            if self.HQ * rows * width <= TILE_ELEMS:
                break
            rows //= 2
        return start + max(1, rows)

    def _tile(self, b: int, start: int, end: int, k1, k2, l1: torch.Tensor, l2: torch.Tensor):
        """Scores `[H, C, l1max]` of query rows `[start, end)` of sequence `b` in the score dtype (None
        when no row sees a coarse key: the rows are all zero)."""
        C, H, G, D = end - start, self.H, self.G, self.D
        l1max, l2max = int(l1.max()), int(l2.max())
        if l2max == 0 or l1max == 0:
            return None
        t0 = self.cu_q[b] + start
        # [C, HQ, D] -> [H, C G, D] in the compute dtype, one copy: rows (c, g) of each KV head
        qh = torch.empty(H, C, G, D, dtype=self.cdt)
        qh.copy_(self.q[t0:t0 + C].unflatten(1, (H, G)).transpose(0, 1))
        qh = qh.view(H, C * G, D)
        # exp(x) as exp2(x log2 e) with log2 e folded into the scale: torch's exp2 runs 2.7x faster than its
        # exp on CPU (docs/cpu.md), and the rounding steps stay the oracle's (a product, a difference,
        # the exponential), on arguments 1.44x larger
        scale = self.scale * LOG2E
        # pass 1: max and normaliser over the visible coarse keys (the GEMM's extra columns masked too)
        w2 = _pad(l2max)
        s2 = self._gemm(qh, k2, 0, w2, 0, C)                                   # [H, C, G, w2]
        l2min = int(l2.min())
        j = torch.arange(l2min, w2)
        s2[..., l2min:].masked_fill_((j[None, :] >= l2[:, None])[:, None], float("-inf"))
        m = s2.amax(dim=-1, keepdim=True)                                       # [H, C, G, 1]
        has_coarse = l2 > 0
        if l2min == 0:
            # a row with no coarse key keeps its zero init in the kernel; its max is replaced by 0 only
            # to avoid inf - inf (the oracle's steps)
            m.masked_fill_(~has_coarse[:, None, None], 0.0)
        Z = s2.sub_(m).mul_(scale).exp2_().sum(dim=-1, keepdim=True)
        if l2min == 0:
            Z.masked_fill_(~has_coarse[:, None, None], 1.0)
        sm = scale * m
        # pass 2: fine-key weights under the coarse normaliser, summed over the group, in column chunks
        w1 = _pad(l1max)
        out = torch.empty(H, C, w1, dtype=self.cdt)
        l1min = int(l1.min())
        step = _pad(max(FINE_MIN_COLS, TILE_ELEMS // (self.HQ * C)))
        for c0 in range(0, w1, step):
            c1 = min(w1, c0 + step)
            s1 = self._gemm(qh, k1, c0, c1, 1, C)                               # [H, C, G, c1 - c0]
            s1.mul_(scale).sub_(sm).exp2_().div_(Z)
            if l1min < c1:
                lo = max(l1min, c0)
                i = torch.arange(lo, c1)
                s1[..., lo - c0:].masked_fill_((i[None, :] >= l1[:, None])[:, None], 0.0)
            torch.sum(s1, dim=2, out=out[..., c0:c1])
        if l2min == 0:
            out.masked_fill_(~has_coarse[None, :, None], 0.0)
        out = out[..., :l1max]
        return out if out.dtype == self.sdt else out.to(self.sdt)

    def _gemm(self, qh: torch.Tensor, k: torch.Tensor, c0: int, c1: int, slot: int, C: int) -> torch.Tensor:
        """`qh [H, C G, D] @ k[:, c0:c1]^T` as `[H, C, G, c1 - c0]`, one GEMM per head into workspace
        `slot` (a batched GEMM would copy the key slices first)."""
        H, CG, _ = qh.shape
        n = c1 - c0
        need = H * CG * n
        bufs = getattr(self._ws, "bufs", None)
        if bufs is None:
            bufs = self._ws.bufs = [None, None]
        ws = bufs[slot]
        if ws is None or ws.numel() < need:
            ws = bufs[slot] = torch.empty(max(need, TILE_ELEMS), dtype=self.cdt)
        out = ws[:need].view(H, CG, n)
        for h in range(H):
            torch.mm(qh[h], k[h, c0:c1].t(), out=out[h])
        return out.view(H, C, CG // C, n)


def run_tiles(tiles: list, fn) -> None:
    """`fn(tile)` for every tile, on `torch.get_num_threads()` threads that each take the next tile
    when done with one, torch's own threads set to 1 meanwhile (restored after).

    Why not torch's intra-op threads: a tile is a dozen torch calls, each a parallel region whose
    threads meet at its end; on a 2-core machine shared with other work one descheduled thread stalls
    every call (docs/cpu.md, "Stage 1 and compression"), and each region costs its fork and join even
    when idle. Tiles on threads of their own meet once, at the end of the call. Every torch call of a
    tile runs on one thread, so a tile's result does not depend on the thread count. The helper
    threads are kept between calls (`_helpers`): a new thread would allocate MKL's GEMM buffers anew
    (about 50 MiB) at every call. One call at a time uses them; a call made while another runs takes
    its tiles on its own thread.
    """
    n = min(torch.get_num_threads(), len(tiles))
    if n <= 1 or not _HELPERS_LOCK.acquire(blocking=False):
        for t in tiles:
            fn(t)
        return
    it = iter(tiles)
    lock = threading.Lock()
    errors: list[BaseException] = []

    def worker():
        with torch.no_grad():
            while not errors:
                with lock:
                    t = next(it, None)
                if t is None:
                    return
                try:
                    fn(t)
                except BaseException as e:      # noqa: BLE001 - re-raised by the calling thread below
                    errors.append(e)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        pending = [_helpers(n - 1).submit(worker) for _ in range(n - 1)]
        worker()
        for f in pending:
            f.result()
    finally:
        torch.set_num_threads(threads)
        _HELPERS_LOCK.release()
    if errors:
        raise errors[0]


_HELPERS_LOCK = threading.Lock()          # held by the one call that uses the helper threads
_HELPER_POOL: list = [None, 0]            # the ThreadPoolExecutor of `_helpers` and its thread count


def _helpers(n: int) -> concurrent.futures.ThreadPoolExecutor:
    """The helper threads of `run_tiles`, at least `n`, kept between calls."""
    pool, size = _HELPER_POOL
    if pool is None or size < n:
        if pool is not None:
            pool.shutdown(wait=False)
        pool = concurrent.futures.ThreadPoolExecutor(n, thread_name_prefix="stage1-cpu")
        _HELPER_POOL[:] = [pool, n]
    return pool


def _pad(n: int) -> int:
    return -(-n // PAD_COLS) * PAD_COLS


class _Selection:
    """The pooled block scores and top-k of one call's rows, filled tile by tile (`rows`)."""

    def __init__(self, run: _Run, cache: torch.Tensor, max_seqlen_q: int, *, topk: int, local_blocks: int,
                 init_blocks: int, block_size: int, varlen_offset_quirk: bool, return_scores: bool):
        self.run = run
        self.cache = cache.tolist()
        lq = run.lq
        B = len(lq)
        self.out_len = cdiv(max_seqlen_q + (max(self.cache) if B else 0), block_size)
        self.K = selection_slots(topk, local_blocks, self.out_len)
        self.w = block_size // run.s1
        self.block_size, self.init_blocks, self.local_blocks = block_size, init_blocks, local_blocks
        # the columns that can hold anything but -inf: a fine key in the window, the init blocks, the
        # local window of the latest row; past them every column is -inf and loses every tie, so the
        # top-K of the row never reaches past max(K, that width)
        last_block = max((L - 1 + c) // block_size for L, c in zip(lq, self.cache) if L > 0) if run.T else 0
        data = max(init_blocks, last_block + 1, cdiv(max(run.n1s, default=0) + 1, self.w))
        self.width = min(self.out_len, max(self.K, data))
        self.q_blocks = q_block_idx_checked(torch.tensor(run.cu_q, dtype=torch.int32), lq, cache,
                                            max_seqlen_q, block_size=block_size,
                                            varlen_offset_quirk=varlen_offset_quirk)
        H, T = run.H, run.T
        self.topk_idx = torch.empty(H, T, self.K, dtype=torch.int32)
        self.block_scores = None
        if return_scores:
            self.block_scores = torch.full((H, T, self.out_len), float("-inf"), dtype=run.sdt)

    def rows(self, b: int, start: int, end: int, tile: torch.Tensor | None, n1: int) -> None:
        """Pool, force and rank query rows `[start, end)` of sequence `b` (`tile`: their scores, None
        for all zero)."""
        run, w, W = self.run, self.w, self.width
        H, C = run.H, end - start
        sdt = run.sdt
        lc = 0 if tile is None else tile.shape[2]                 # fine keys computed in the tile
        off_last = (end - 1 + self.cache[b]) // self.block_size   # the tile's last row's own block
        if self.block_scores is None:
            # Past the columns whose window meets a computed score, the init blocks and the local
            # windows, every column scores 0 (masked fine keys) or -inf (no fine key), and every column
            # before scores more or the same (scores are >= 0; -inf only past n1, where those are -inf
            # too): each precedes each of those (ties to the lower index), so the row's top-K lies in
            # the first max(K, ...) columns (for a causal tile's rows about half the row)
            W = min(W, max(self.K, self.init_blocks, off_last + 1, cdiv(lc + 1, w)))
        jc = min(W, cdiv(lc + 1, w))                              # columns whose window meets them
        jn = min(W, cdiv(n1 + 1, w)) if n1 > 0 else 0             # columns with a fine key at all
        pooled = torch.full((H, C, W), float("-inf"), dtype=sdt)
        if jn > jc:
            pooled[..., jc:jn] = 0.0                              # windows of masked (zero) scores only
        if jc > 0:
            # keys -1 .. w * jc - 1: -inf, the tile, zeros up to n1, -inf past it
            buf = torch.full((H, C, w * jc + 1), float("-inf"), dtype=sdt)
            if tile is not None:
                buf[..., 1:1 + lc] = tile
            hi = min(n1, w * jc)
            if hi > lc:
                buf[..., 1 + lc:1 + hi] = 0.0
            pooled[..., :jc] = buf.unfold(-1, w + 1, w).amax(dim=-1)
        # forced blocks: the init blocks and the local window ending at the row's own block
        r = torch.arange(start, end)
        off_bq = (r + self.cache[b]) // self.block_size                                # [C]
        j = torch.arange(W)
        forced = (j[None, :] <= off_bq[:, None]) & (j[None, :] >= off_bq[:, None] - self.local_blocks)
        pooled.masked_fill_(forced[None], float("inf"))
        if self.init_blocks:
            pooled[..., :min(self.init_blocks, W)] = float("inf")
        t0 = run.cu_q[b] + start
        if self.block_scores is not None:
            self.block_scores[:, t0:t0 + C, :W] = pooled
        self.topk_idx[:, t0:t0 + C] = topk_rows(pooled, self.q_blocks[t0:t0 + C], self.K)

@torch.no_grad()
def cpu_select_topk(block_scores: torch.Tensor, q_block_idx: torch.Tensor, *, topk: int = 64,
                    local_blocks: int = 32) -> torch.Tensor:
    r"""`naive_select_topk` without the sort of every row: the `K = min(topk + local_blocks, out_len)`
    best blocks per (KV head, token), ties to the lower block index, ascending, blocks after
    `q_block_idx[t]` replaced by `-1`. Same arguments, checks and result as `naive_select_topk`
    (exactly: the ranking is on the scores' own bits, `_ranked`)."""
    check_tensor("block_scores", block_scores, ndim=3, dtypes=REF_DTYPES)
    check_tensor("q_block_idx", q_block_idx, dtypes=INT_DTYPES, shape=(block_scores.shape[1],),
                 device=block_scores.device)
    check_int_args(0, topk=topk, local_blocks=local_blocks)
    return topk_rows(block_scores, q_block_idx, selection_slots(topk, local_blocks, block_scores.shape[2]))


def topk_rows(scores: torch.Tensor, q_blocks: torch.Tensor, K: int) -> torch.Tensor:
    """The K best columns of each row of `scores [H, T, W]` (ties to the lower index), ascending, the
    columns after the row's `q_blocks [T]` replaced by -1: int32 `[H, T, K]`."""
    if K == 0:
        return torch.empty(*scores.shape[:2], 0, dtype=torch.int32, device=scores.device)
    bits = _KEY_BITS.get(scores.dtype)
    if bits is None:
        # 64-bit scores leave no room for the index beside them: the oracle's stable sort
        order = scores.sort(dim=-1, descending=True, stable=True).indices[..., :K]
    else:
        order = _ranked(scores, bits).topk(K, dim=-1, sorted=False).indices
    idx = order.sort(dim=-1).values
    idx = idx.masked_fill(idx > q_blocks.long()[None, :, None], -1)
    return idx.to(torch.int32)


_KEY_BITS = {torch.float32: 32, torch.bfloat16: 16, torch.float16: 16}


def _ranked(x: torch.Tensor, bits: int) -> torch.Tensor:
    """int64 keys whose order is (value descending as torch sorts, then index ascending): the score's
    bits made order-preserving in the high half, the complement of the index in the low half."""
    W = x.shape[-1]
    x = x + 0.0                                               # -0.0 -> +0.0: equal scores, equal keys
    if bits == 32:
        v = x.view(torch.int32).to(torch.int64)
        v = v ^ ((v >> 31) & 0x7FFFFFFF)                     # negative floats: flip the magnitude bits
    else:
        v = x.view(torch.int16).to(torch.int64)
        v = v ^ ((v >> 15) & 0x7FFF)
    low = (1 << 32) - 1 - torch.arange(W, dtype=torch.int64)
    return v * (1 << 32) + low
