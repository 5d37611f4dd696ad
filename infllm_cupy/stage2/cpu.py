"""Stage 2's forward on CPU tensors over the selected blocks only (docs/cpu.md, "Stage 2").

What `sparse_attn_varlen` and `block_sparse_attn_varlen` compute on CPU tensors under `backend="auto"`:
the semantics of `naive_sparse_attn_varlen` (the oracle, which computes every causal key and masks),
at a cost that grows with the selected work (T x K), not with T^2. Per sequence, KV head and chunk of
query blocks (64 tokens each, the kernels' unit), the selected (token, key block) pairs are split in two:

- **dense pairs**: blocks that more than half the tokens of a query block selected. The query block
  attends the union of its dense blocks as one fp32 GEMM (`[64 G, D] x [D, U 64]`, the kernels' plan:
  docs/stage2_fwd.md §3), each token masked to its own selection and causality.
- **sparse pairs**: the rest (per-token picks, whose union over a query block is many times their
  number). They run block by block (the transposed index of the backward kernels: docs/stage2_bwd.md
  §4): the tokens that picked key block j, gathered, against block j's keys, in batched GEMMs over
  pieces of equal length. Each pair is a split of its token's softmax (its own row max, sum and
  unnormalised output); a token's pairs combine by gathers, never a scatter-add (which CPU torch
  runs one index at a time).

The two parts merge by their softmax statistics, as split-KV attention does. Scores are base 2 (the
keys carry `softmax_scale * log2(e)`; `exp2` is CPU torch's fast exponential), all math in fp32
(float64 for float64 inputs): scores, softmax and P.V; `out` is in q's dtype and `lse` float32 (natural
log), as the oracle returns them. The chunks run on `torch.get_num_threads()` Python threads of one
intra-op thread each. No autograd of its own: `sparse_attn_varlen`'s CPU backward is the oracle's
written-out gradient (`naive_sparse_attn_varlen_bwd`), so this runs under `no_grad`.

Memory: a chunk's buffers are sized by its tokens times K (the slots of a selection row), at most
`_CHUNK_ELEMS` fp32 elements, its GEMM tiles by `_TILE_ELEMS`; K and V of one sequence's KV head are
upcast once (`Lk x D` each). Nothing is sized from `max_seqlen_q` or `max_seqlen_k`, which are only
checked.
"""
from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import torch

from .._checks import (
    HostSeqlens,
    check_attn_tensors,
    check_attn_values,
    check_flags,
    check_int_args,
    check_max_seqlen,
    check_softmax_scale,
    check_tensor,
    validate_values,
)
from .._dtypes import compute_dtype
from .._rules import cdiv
from .layout import BlockLayout

# Tokens of one query block: the unit whose commonly selected key blocks run as one dense GEMM (the
# kernels' CTA unit, docs/stage2_fwd.md §3). Chunks start at multiples of it within a sequence.
_Q_BLOCK = 64

# A key block selected by more than this share of a query block's tokens runs in the query block's
# dense GEMM (computing it for the tokens that did not select it, then masking them), below it in the
# per-block GEMMs of its pairs (docs/cpu.md, "Stage 2": the cost of each path per pair).
_DENSE_SHARE = 0.5

# Rows (tokens x G) of one piece of the per-block GEMMs: a key block's pairs are cut into pieces of at
# most this many rows, batched with the pieces of the same length.
_PIECE_ROWS = 512

# fp32 elements of one chunk's buffers (the sparse pairs' outputs and the per-token combine): 64 MB.
# Bounds the tokens of a chunk through K, never through max_seqlen. Larger chunks make larger pieces
# but leave the caches: 2^25 and 2^26 were 6-15% slower at 32k, 2^23 3-10% (docs/cpu.md, "Stage 2").
_CHUNK_ELEMS = 1 << 24

# Score elements of one batched GEMM (a tile of query blocks, or of pieces): 4 MB, cache-sized.
_TILE_ELEMS = 1 << 20

# Scores are base 2 (q scaled by `softmax_scale * log2(e)`), as in the kernels: `exp2` is CPU torch's
# fast exponential.
_LOG2E = math.log2(math.e)


def cpu_sparse_attn_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                           cu_seqlens_k: torch.Tensor, topk_idx: torch.Tensor, max_seqlen_q: int,
                           max_seqlen_k: int, *, causal: bool = True, softmax_scale: float | None = None,
                           return_lse: bool = False, block_size: int = 64,
                           host_seqlens: HostSeqlens | None = None):
    r"""`naive_sparse_attn_varlen`'s forward at the cost of the selected blocks (the CPU path of
    `sparse_attn_varlen`; the module docstring has the plan).

    Same semantics, arguments and results as `naive_sparse_attn_varlen` (its `upcast=True`): query `t`
    (row `r` of sequence `b`), head `hq`, attends keys `j` with `j // block_size` in
    `topk_idx[hq // G, t]`, `j < Lk` and, if causal, `j <= r + Lk - Lq`; negative, out-of-range and
    future entries select nothing, duplicates count once; a row with no allowed key gives 0 and
    `lse = +inf`. Scores, softmax and P.V in fp32 (float64 for float64 inputs). No gradient: the
    result is computed under `no_grad` (`sparse_attn_varlen` on CPU tensors differentiates through
    the oracle's backward).

    Args:
        q (torch.Tensor):
            `[total_q, HQ, D]`, bf16, fp16, fp32 or float64, any D.
        k, v (torch.Tensor):
            `[total_k, H, D]`, q's dtype and device.
        cu_seqlens_q, cu_seqlens_k (torch.Tensor):
            int32 `[B+1]`.
        topk_idx (torch.Tensor):
            int32 `[H, total_q, K]`, block indices local to each sequence.
        max_seqlen_q, max_seqlen_k (int):
            Longest query / key sequence (checked only: nothing is sized from them).
        causal (bool, Optional):
            Default: `True`.
        softmax_scale (float, Optional):
            Default: `None` (`1 / sqrt(D)`).
        return_lse (bool, Optional):
            Also return `lse`, float32 `[HQ, total_q]`. Default: `False`.
        block_size (int, Optional):
            Keys per block. Default: 64.
        host_seqlens (HostSeqlens, Optional):
            Both offsets on the host from a caller that checked every input: no checks here and no
            read back. Default: `None`.

    Returns:
        out (torch.Tensor): `[total_q, HQ, D]` in q's dtype; and `lse` with `return_lse`.
    """
    check_flags(causal=causal, return_lse=return_lse)
    if host_seqlens is None:
        check_attn_tensors(q, k, v, cu_seqlens_q, cu_seqlens_k)
        check_tensor("topk_idx", topk_idx, ndim=3, dtypes=(torch.int32,),
                     shape=(k.shape[1], q.shape[0], None), device=q.device)
        check_int_args(1, block_size=block_size)
        host_seqlens = HostSeqlens.read(cu_seqlens_q, cu_seqlens_k)
        if validate_values():
            check_attn_values(host_seqlens, q, k)
        check_max_seqlen("max_seqlen_q", max_seqlen_q, host_seqlens.lq)
        check_max_seqlen("max_seqlen_k", max_seqlen_k, host_seqlens.lk)
    scale = check_softmax_scale(softmax_scale, q.shape[2])
    with torch.no_grad():
        out, lse = _forward(q, k, v, host_seqlens, topk_idx, causal, scale, block_size)
    return (out, lse) if return_lse else out


def cpu_block_sparse_attn_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                 cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, layout: BlockLayout,
                                 max_seqlen_q: int,
                                 max_seqlen_k: int, *, causal: bool = True,
                                 softmax_scale: float | None = None, return_lse: bool = False):
    r"""`naive_block_sparse_attn_varlen`'s forward at the cost of the selected blocks: the layout's
    token-level form (`layout.to_topk_idx`) through `cpu_sparse_attn_varlen`. The tokens of a query
    block share their selection, so every pair is dense and each query block runs one GEMM.

    Args:
        layout (BlockLayout): `mask` bool `[H, NQB, NKB]` or `[B, H, NQB, NKB]`, and `q_block`.
        Others: as `cpu_sparse_attn_varlen`.

    Returns:
        out (torch.Tensor): `[total_q, HQ, D]`; and `lse` with `return_lse`.
    """
    if not isinstance(layout, BlockLayout):
        raise TypeError(f"layout must be a BlockLayout, got {type(layout).__name__}")
    layout.check_against(k.shape[1], cu_seqlens_q.numel() - 1, max_seqlen_q, max_seqlen_k)
    return cpu_sparse_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k,
                                  layout.to_topk_idx(cu_seqlens_q).to(q.device), max_seqlen_q, max_seqlen_k,
                                  causal=causal, softmax_scale=softmax_scale, return_lse=return_lse)


# ------------------------------------------------------------------------------------------ the body


def chunk_tokens(K: int, G: int, D: int) -> int:
    """Tokens of one chunk (a multiple of `_Q_BLOCK`): its sparse pairs' outputs, at most `K x G x D`
    elements per token (and their padding), stay within `_CHUNK_ELEMS` with the per-token combine's
    buffers; the GEMM tiles are bounded apart (`_TILE_ELEMS`)."""
    per_token = max(1, K) * G * 2 * D
    return max(1, _CHUNK_ELEMS // (per_token * _Q_BLOCK)) * _Q_BLOCK


def _forward(q, k, v, host: HostSeqlens, topk_idx, causal: bool, scale: float, bs: int):
    """`(out, lse)` of every sequence, KV head and chunk. The chunks of one (sequence, KV head) run on
    `torch.get_num_threads()` Python threads, each with one intra-op thread: many small ops in parallel
    regions of two threads lose to two single-threaded streams of them (docs/cpu.md, "Stage 2")."""
    total_q, HQ, D = q.shape
    H = k.shape[1]
    G = HQ // H
    K = topk_idx.shape[2]
    cdt = compute_dtype(q.dtype)
    out = q.new_empty(total_q, HQ, D)
    lse = torch.full((HQ, total_q), math.inf, dtype=torch.float32)
    C_max = chunk_tokens(K, G, D)
    workers = torch.get_num_threads()
    inference = torch.is_inference_mode_enabled()          # grad and inference modes are per thread
    pool = None if workers == 1 else ThreadPoolExecutor(workers, initializer=torch.set_num_threads,
                                                        initargs=(1,))
    try:
        for b, (Lq, Lk) in enumerate(zip(host.lq, host.lk)):
            q0, k0 = host.q[b], host.k[b]
            if Lq == 0 or Lk == 0 or K == 0:
                out[q0:q0 + Lq] = 0                         # no key: out 0, lse +inf
                continue
            nb = cdiv(Lk, bs)
            for h in range(H):
                # this KV head's keys (scaled by `scale * log2(e)`: base-2 scores) and values in the
                # compute dtype, as whole blocks, and one zero block (index nb) that padding points to
                kb = torch.zeros(nb + 1, bs, D, dtype=cdt)
                vb = torch.zeros(nb + 1, bs, D, dtype=cdt)
                kb.view(-1, D)[:Lk] = k[k0:k0 + Lk, h]
                kb.mul_(scale * _LOG2E)
                vb.view(-1, D)[:Lk] = v[k0:k0 + Lk, h]
                heads = slice(h * G, (h + 1) * G)

                # chunks of at most C_max tokens, at least one per worker
                step = min(C_max, max(1, cdiv(cdiv(Lq, workers), _Q_BLOCK)) * _Q_BLOCK)

                def attend(r0, h=h, heads=heads, kb=kb, vb=vb, Lq=Lq, Lk=Lk, q0=q0, nb=nb, step=step):
                    with torch.inference_mode(inference), torch.no_grad():
                        r1 = min(Lq, r0 + step)
                        r = torch.arange(r0, r1)
                        # the last key each row sees (-1: none): causal bottom-right, the sequence's end
                        last = (r + Lk - Lq).clamp(max=Lk - 1) if causal else torch.full_like(r, Lk - 1)
                        idx = _clean(topk_idx[h, q0 + r0:q0 + r1].long(), last, bs, nb)
                        o, ls = _chunk(q[q0 + r0:q0 + r1, heads].to(cdt).contiguous(), kb, vb, idx, last, bs)
                        out[q0 + r0:q0 + r1, heads].copy_(o)
                        lse[heads, q0 + r0:q0 + r1] = ls.t()

                if pool is None:
                    for r0 in range(0, Lq, step):
                        attend(r0)
                else:
                    for f in [pool.submit(attend, r0) for r0 in range(0, Lq, step)]:
                        f.result()
    finally:
        if pool is not None:
            pool.shutdown()
    return out, lse


def _clean(idx: torch.Tensor, last: torch.Tensor, bs: int, nb: int) -> torch.Tensor:
    """`idx [C, K]` with every entry that selects nothing (negative, `>= nb`, wholly in the future of
    its row) and every repeat set to -1 (rows sorted)."""
    ok = (idx >= 0) & (idx < nb) & (idx * bs <= last[:, None])
    s = torch.where(ok, idx, nb).sort(dim=1).values
    repeat = torch.zeros_like(ok)
    repeat[:, 1:] = s[:, 1:] == s[:, :-1]
    return torch.where(repeat | (s == nb), -1, s)


def _chunk(qf, kb, vb, idx, last, bs):
    """One chunk of one KV head: `qf [C, G, D]` (compute dtype; token 0 starts a query block), `kb, vb
    [nb + 1, bs, D]` (keys scaled by `scale * log2(e)`), `idx [C, K]` cleaned, `last [C]`. Returns
    `out [C, G, D]` and the natural `lse [C, G]` (+inf on rows with no key)."""
    C, G, D = qf.shape
    nb = kb.shape[0] - 1
    nqb = cdiv(C, _Q_BLOCK)
    valid = idx >= 0
    # tokens of each query block that selected each key block -> the dense blocks of each query block
    sel = torch.zeros(nqb * _Q_BLOCK, nb + 1, dtype=torch.bool)
    sel[:C].scatter_(1, torch.where(valid, idx, nb), True)
    sel[:, nb] = False
    n_tok = torch.full((nqb,), _Q_BLOCK, dtype=torch.long)
    n_tok[-1] = C - (nqb - 1) * _Q_BLOCK
    dense = sel.view(nqb, _Q_BLOCK, nb + 1).sum(1) > _DENSE_SHARE * n_tok[:, None]   # [nqb, nb + 1]
    if bool(dense.any()):
        m, ls, o = _dense_part(qf, kb, vb, sel, dense, last, bs)
    else:
        m, ls, o = qf.new_full((C, G), -math.inf), qf.new_zeros(C, G), qf.new_zeros(C, G, D)
    sparse = valid & ~dense[(torch.arange(C) // _Q_BLOCK)[:, None], idx.clamp(min=0)]
    if bool(sparse.any()):
        return _sparse_part(qf, kb, vb, torch.where(sparse, idx, -1), last, bs, m, ls, o)
    has = ls > 0
    return o.div_(torch.where(has, ls, 1.0)[..., None]), _lse(m, ls, has)


def _lse(m: torch.Tensor, ls: torch.Tensor, has: torch.Tensor) -> torch.Tensor:
    """The natural log-sum-exp of base-2 row maxima `m` and sums `ls`, +inf where not `has`."""
    return torch.where(has, (m + ls.log2()) * math.log(2.0), math.inf)


def _pad_len(n: int) -> int:
    """The padded length of a piece of `n` tokens: `n` up to 4, else `n` rounded up to an eighth of its
    power of two (pieces of one padded length batch into one GEMM; padding < 25%)."""
    if n <= 4:
        return n
    step = 1 << (n.bit_length() - 3)
    return -(-n // step) * step


def _buckets(sizes: list[int]) -> list[tuple[int, list[int]]]:
    """`(padded size, [indices])` of `sizes` grouped by `_pad_len`."""
    groups: dict[int, list[int]] = {}
    for i, n in enumerate(sizes):
        groups.setdefault(_pad_len(n), []).append(i)
    return sorted(groups.items())


def _exp2_rows(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`s [..., N]` (base-2 scores, -inf: masked) turned in place into `exp2(s - m)` with `m` its row
    max; returns `(m, sum)`. A row with no finite score gives `m = -inf`, zeros and sum 0. (exp2 is
    the fast exponential of CPU torch, ~3x `exp`; the scale carries `log2(e)`, as the kernels do.)"""
    m = s.amax(-1)
    s.sub_(torch.where(m > -math.inf, m, 0.0)[..., None]).exp2_()
    return m, s.sum(-1)


def _dense_part(qf, kb, vb, sel, dense, last, bs):
    """The dense pairs: each query block against the union of its dense key blocks, one GEMM per tile
    of query blocks with the same (padded) union size, each token masked to its own selection and
    causality (only in the blocks where some token needs one). Returns `(m, l, o)` `[C, G]`, `[C, G]`,
    `[C, G, D]`: row max (base 2), sum of `exp2(s - m)` and the unnormalised output (`-inf`, 0, 0 on
    rows with no dense pair)."""
    C, G, D = qf.shape
    nb = kb.shape[0] - 1
    nqb = dense.shape[0]
    Cp = nqb * _Q_BLOCK
    qp = qf if Cp == C else torch.cat([qf, qf.new_zeros(Cp - C, G, D)])
    lastp = last if Cp == C else torch.cat([last, last.new_full((Cp - C,), -1)])
    m = qf.new_full((Cp, G), -math.inf)
    ls = qf.new_zeros(Cp, G)
    o = qf.new_zeros(Cp, G, D)
    order = torch.argsort(dense.to(torch.uint8), dim=1, descending=True, stable=True)  # dense blocks first
    ar = torch.arange(bs)
    for u, qbs in _buckets(dense.sum(1).tolist()):
        if u == 0:
            continue
        step = max(1, _TILE_ELEMS // (_Q_BLOCK * G * u * bs))
        for t0 in range(0, len(qbs), step):
            ib = torch.tensor(qbs[t0:t0 + step])
            n = ib.numel()
            blocks = order[ib, :u]                                      # [n, u]
            blocks = torch.where(dense[ib[:, None], blocks], blocks, nb)  # padding -> the zero block
            rows = (ib[:, None] * _Q_BLOCK + torch.arange(_Q_BLOCK)).view(-1)
            s = torch.bmm(qp.view(nqb, _Q_BLOCK * G, D).index_select(0, ib),
                          kb.index_select(0, blocks.view(-1)).view(n, u * bs, D).transpose(1, 2))
            s = s.view(n, _Q_BLOCK, G, u * bs)
            # each token's view of each block: selected, and its last key there (< bs - 1: partly)
            picked = sel[rows].view(n, _Q_BLOCK, nb + 1).gather(2, blocks[:, None, :].expand(n, _Q_BLOCK, u))
            lim = lastp[rows].view(n, _Q_BLOCK, 1) - blocks[:, None, :] * bs      # [n, 64, u]
            whole = (picked & (lim >= bs - 1)).all(1)                   # [n, u]
            # a fill, not an added -inf: a non-finite key stays out of the rows that do not attend it
            for c in (~whole).any(0).nonzero().squeeze(1).tolist():     # usually the diagonal block alone
                ok = picked[:, :, c, None] & (ar <= lim[:, :, c, None])  # [n, 64, bs]
                s[..., c * bs:(c + 1) * bs].masked_fill_(~ok[:, :, None, :], -math.inf)
            mt, lt = _exp2_rows(s)
            ot = torch.bmm(s.view(n, _Q_BLOCK * G, u * bs),
                           vb.index_select(0, blocks.view(-1)).view(n, u * bs, D))
            m[rows] = mt.view(-1, G)
            ls[rows] = lt.view(-1, G)
            o[rows] = ot.view(-1, G, D)
    return m[:C], ls[:C], o[:C]


def _sparse_part(qf, kb, vb, idx, last, bs, m, ls, o):
    """The sparse pairs `idx [C, K]` (-1: none), block by block, merged with the dense part's `(m, l,
    o)` (`_dense_part`'s form). Each key block's pairs are cut into pieces of at most `_PIECE_ROWS`
    rows; pieces of one padded length run as one batched GEMM per tile. Each pair keeps its own row
    max, sum and unnormalised output (split-KV attention with one split per pair), so a tile needs
    nothing of the others; a token's pairs then combine by gathers (never a scatter-add, which CPU
    torch runs one index at a time), weighted and normalised in one pass. Returns `(out, lse)` as
    `_chunk`."""
    C, K = idx.shape
    G, D = qf.shape[1], qf.shape[2]
    nb = kb.shape[0] - 1
    cap = max(1, _PIECE_ROWS // G)
    flat = (idx >= 0).view(-1).nonzero().squeeze(1)                     # slot t * K + s of each pair
    j = idx.view(-1)[flat]
    order = torch.argsort(j, stable=True)                               # pairs by block, then token
    j, flat = j[order], flat[order]
    tok = flat // K
    n_pairs = j.numel()
    lim = last[tok] - j * bs                                            # the pair's last key in its block
    # pieces: runs of one block, at most `cap` tokens
    count = torch.bincount(j, minlength=nb)
    rank = torch.arange(n_pairs) - (torch.cumsum(count, 0) - count)[j]
    cut = torch.ones(n_pairs, dtype=torch.bool)
    cut[1:] = (j[1:] != j[:-1]) | (rank[1:] // cap != rank[:-1] // cap)
    p_first = cut.nonzero().squeeze(1)                                  # first pair of each piece
    piece = torch.cumsum(cut, 0) - 1
    p_len = torch.diff(p_first, append=p_first.new_tensor([n_pairs]))
    p_mask = torch.zeros(p_first.numel(), dtype=torch.bool).scatter_reduce_(0, piece, lim < bs - 1, "amax")
    # rows: pieces of one padded length and mask need side by side (one batched GEMM per tile)
    groups: dict[tuple[int, bool], list[int]] = {}
    for i, (n, mk) in enumerate(zip(p_len.tolist(), p_mask.tolist())):
        groups.setdefault((_pad_len(n), mk), []).append(i)
    p_row = torch.empty(p_first.numel(), dtype=torch.long)
    tiles = []
    R = 0
    tile_rows = max(1, _TILE_ELEMS // (G * bs))
    for (npd, mk), ps in sorted(groups.items()):
        pt = torch.tensor(ps)
        p_row[pt] = R + torch.arange(len(ps)) * npd
        step = max(1, tile_rows // npd)
        for t0 in range(0, len(ps), step):
            t1 = min(len(ps), t0 + step)
            tiles.append((R + t0 * npd, R + t1 * npd, t1 - t0, npd, mk, j[p_first[pt[t0:t1]]]))
        R += len(ps) * npd
    row = p_row[piece] + (torch.arange(n_pairs) - p_first[piece])       # the row of each pair
    tok_row = torch.full((R,), C, dtype=torch.long)                     # padding rows: token C (zeros)
    tok_row[row] = tok
    lim_row = torch.full((R,), bs - 1, dtype=torch.long)
    lim_row[row] = lim
    # each token's pairs, left-aligned in Ks <= K slots; empty slots: row R
    has_pair = idx >= 0
    Ks = int(has_pair.sum(1).max())
    slot_row = torch.full((C * Ks,), R, dtype=torch.long)
    slot_row[tok * Ks + (has_pair.cumsum(1) - 1).view(-1)[flat]] = row
    slot_row = slot_row.view(C, Ks)

    qx = torch.cat([qf, qf.new_zeros(1, G, D)])
    m_row = qf.new_full((R + 1, G), -math.inf)                          # row R: the empty slot
    l_row = qf.new_zeros(R + 1, G)
    o_row = qf.new_empty(R + 1, G, D)
    o_row[R] = 0
    ar = torch.arange(bs)
    for r0, r1, n, npd, mk, blocks in tiles:
        s = torch.bmm(qx.index_select(0, tok_row[r0:r1]).view(n, npd * G, D),
                      kb.index_select(0, blocks).transpose(1, 2)).view(r1 - r0, G, bs)
        if mk:
            s.masked_fill_((ar > lim_row[r0:r1, None])[:, None, :], -math.inf)
        m_row[r0:r1], l_row[r0:r1] = _exp2_rows(s)
        torch.bmm(s.view(n, npd * G, bs), vb.index_select(0, blocks), out=o_row[r0:r1].view(n, npd * G, D))
    # combine: every slot's pair and the dense part against the token's max, the weights normalised first
    m_slots = m_row.index_select(0, slot_row.view(-1)).view(C, Ks, G)
    top = torch.maximum(m, m_slots.amax(1))
    top0 = torch.where(top > -math.inf, top, 0.0)
    w = (m_slots - top0[:, None]).exp2()                                # [C, Ks, G]; 0 for empty slots
    wd = (m - top0).exp2()
    ls = ls * wd + (w * l_row.index_select(0, slot_row.view(-1)).view(C, Ks, G)).sum(1)
    has = ls > 0
    inv = torch.where(has, ls, 1.0).reciprocal()
    out = o.mul_((wd * inv)[..., None])
    w.mul_(inv[:, None])
    buf = torch.empty_like(out)
    for slot in range(Ks):
        out.addcmul_(torch.index_select(o_row, 0, slot_row[:, slot], out=buf), w[:, slot, :, None])
    return out, _lse(top, ls, has)
