"""SpargeAttn's block-mask predictor as a `BlockLayout` (docs/patterns.md, "SpargeAttn predictor").

Per sequence and head: mean-pool q over blocks of `block_q` tokens and k over blocks of 64; a
block is self-similar when the mean cosine similarity over all pairs of its tokens (self-pairs
included) exceeds `simthreshd1`. Pooled scores `pool_q . pool_k / sqrt(D)` are softmaxed over the
self-similar key blocks (block-causal when `causal`); each query block keeps the fewest key blocks,
taken in descending score, whose cumulative share stays within `cdfthreshd` (at least one). Key
blocks that are not self-similar are kept for every query block, query blocks that are not
self-similar keep every key block (pooling would misrepresent them), and the first `sink_blocks`
key blocks are always kept. GQA: key block statistics of KV head h serve its G query heads; the
per-KV-head layout is the union of its query heads' selections (keeps what any head needs).
"""
from __future__ import annotations

import torch

from .._checks import (
    check_cu_seqlens_any,
    check_flags,
    check_head_dim,
    check_heads,
    check_int_args,
    check_tensor,
)
from .._rules import KV_BLOCK, softmax_scale_of
from ..stage2.layout import BlockLayout

# Elements of one [B, heads, NQB, NKB] score chunk: bounds the working set of the sort (the scores,
# their sorted copy and int64 indices) at a few GiB for 128k-token sequences.
_CHUNK_ELEMS = 1 << 27


# The range of each threshold: a cosine similarity, a share of the pooled attention.
_THRESHOLD_RANGES = {"simthreshd1": (-1.0, 1.0, "a mean cosine similarity"),
                     "cdfthreshd": (0.0, 1.0, "a share of the pooled attention")}


def _per_head(name: str, value, hq: int, device) -> torch.Tensor:
    """A float or a 1-D tensor of one value per query head -> float tensor [HQ] (SpargeAttn takes both),
    each value inside the threshold's range (ValueError naming `name` otherwise; a tensor is read on the
    host for that, HQ values)."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a float or a tensor of one value per query head, got bool")
    if isinstance(value, (int, float)):
        out = torch.full((hq,), float(value), dtype=torch.float64)
    elif isinstance(value, torch.Tensor) and value.dim() <= 1 and value.numel() in (1, hq):
        out = value.detach().to("cpu", torch.float64).reshape(-1).expand(hq).contiguous()
    else:
        raise ValueError(f"{name} must be a float or a tensor of 1 or {hq} values (one per query head), got "
                         f"{value!r}")
    lo, hi, what = _THRESHOLD_RANGES[name]
    bad = ~((out >= lo) & (out <= hi))                       # NaN fails both comparisons
    if bool(bad.any()):
        raise ValueError(f"{name} must be in [{lo:g}, {hi:g}] ({what}), got {out[bad][0].item()!r}")
    return out.to(device)


def _check(q, k, cu_seqlens, block_q, block_k, sink_blocks, causal, per_query_head):
    check_tensor("q", q, ndim=3)
    check_head_dim("q", q.shape)
    check_tensor("k", k, ndim=3, shape=(q.shape[0], None, q.shape[2]))
    if not q.dtype.is_floating_point or not k.dtype.is_floating_point:
        raise TypeError("q and k must be floating point")
    check_flags(causal=causal, per_query_head=per_query_head)
    if block_q not in (64, 128) or isinstance(block_q, bool):
        raise ValueError(f"block_q must be 64 or 128 (the layout's query block), got {block_q!r}")
    if block_k != KV_BLOCK or isinstance(block_k, bool):
        raise ValueError(f"block_k must be {KV_BLOCK} (our key block), got {block_k!r}")
    check_int_args(0, sink_blocks=sink_blocks)
    G = check_heads(q.shape[1], k.shape[1])
    if cu_seqlens is None:
        cu = torch.tensor([0, q.shape[0]], dtype=torch.int32, device=q.device)
    else:
        check_cu_seqlens_any("cu_seqlens", cu_seqlens, device=q.device)
        if int(cu_seqlens[-1]) != q.shape[0]:
            raise ValueError(f"cu_seqlens ends at {int(cu_seqlens[-1])} but q has {q.shape[0]} tokens")
        cu = cu_seqlens
    return G, cu


def _block_stats(x: torch.Tensor, seq: torch.Tensor, pos: torch.Tensor, nb: int, bs: int, B: int):
    """Per block of `bs` tokens of each sequence: (mean [B, NB, H, D], mean pairwise cosine
    [B, NB, H], token count [B, NB]). The mean cosine over all n^2 pairs is |sum of unit vectors|^2 / n^2."""
    H, D = x.shape[1], x.shape[2]
    blk = seq * nb + torch.div(pos, bs, rounding_mode="floor")
    sums = x.new_zeros(B * nb, H, D).index_add_(0, blk, x)
    unit = x / x.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(x.dtype).tiny)
    usum = x.new_zeros(B * nb, H, D).index_add_(0, blk, unit)
    cnt = torch.zeros(B * nb, dtype=x.dtype, device=x.device).index_add_(0, blk,
                                                                         torch.ones_like(blk, dtype=x.dtype))
    c = cnt.clamp_min(1)[:, None]
    mean = sums / c[..., None]
    sim = usum.pow(2).sum(-1) / (c * c)
    return mean.view(B, nb, H, D), sim.view(B, nb, H), cnt.view(B, nb)


def predict_sparge(q: torch.Tensor, k: torch.Tensor, cu_seqlens: torch.Tensor | None = None, *,
                   block_q: int = 128,
                   block_k: int = KV_BLOCK, simthreshd1=0.1, cdfthreshd=0.9, sink_blocks: int = 0,
                   causal: bool = False, per_query_head: bool = False) -> BlockLayout:
    """SpargeAttn's predicted block mask for self-attention (q and k share `cu_seqlens`).

    Args:
        q: `[T, HQ, D]`; k: `[T, H, D]` (HQ a multiple of H), tokens packed by `cu_seqlens`.
        cu_seqlens: int32 `[B+1]`; None for one sequence of T tokens.
        block_q: query tokens per layout row (64 or 128; SpargeAttn's BLKQ, default 128).
        block_k: keys per block, 64 (SpargeAttn's BLKK).
        simthreshd1: self-similarity threshold (float or one per query head).
        cdfthreshd: share of the pooled attention to keep per query block (float or per query head).
        sink_blocks: leading key blocks always kept (SpargeAttn's `attention_sink` is 1).
        causal: block-causal prediction: key block j is a candidate for query block i when
            `64 j < (i+1) block_q`; the op must then run with `causal=True`.
        per_query_head: one layout row per query head (run with K/V repeated, G = 1) instead of
            the union over each KV head's group.

    Returns:
        `BlockLayout` `[H or HQ, NQB, NKB]` for `cu_seqlens=None`, else `[B, H or HQ, NQB, NKB]`.
    """
    G, cu = _check(q, k, cu_seqlens, block_q, block_k, sink_blocks, causal, per_query_head)
    dev = q.device
    T, HQ, D = q.shape
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    sim1 = _per_head("simthreshd1", simthreshd1, HQ, dev).to(cdt)
    cdf_t = _per_head("cdfthreshd", cdfthreshd, HQ, dev).to(cdt)
    H = k.shape[1]
    B = cu.numel() - 1
    lens = (cu[1:] - cu[:-1]).long()
    max_len = int(lens.max()) if B else 0
    nqb, nkb = -(-max_len // block_q), -(-max_len // KV_BLOCK)
    seq = torch.repeat_interleave(torch.arange(B, device=dev), lens, output_size=T)
    pos = torch.arange(T, device=dev) - cu[:-1].long()[seq]
    with torch.no_grad():
        pq, sq, cq = _block_stats(q.detach().to(cdt), seq, pos, nqb, block_q, B)
        pk, sk, ck = _block_stats(k.detach().to(cdt), seq, pos, nkb, KV_BLOCK, B)
        kv_of = torch.arange(HQ, device=dev) // G
        q_valid = cq > 0                                                     # [B, NQB]
        k_valid = ck > 0                                                     # [B, NKB]
        q_sim = sq > sim1                                                    # [B, NQB, HQ]
        k_sim = sk[:, :, kv_of] > sim1                                     # [B, NKB, HQ] (head h's threshold)
        i = torch.arange(nqb, device=dev)
        j = torch.arange(nkb, device=dev)
        block_causal = (j[None, :] * KV_BLOCK < (i[:, None] + 1) * block_q) if causal \
            else torch.ones(nqb, nkb, dtype=torch.bool, device=dev)
        out = torch.empty(B, HQ, nqb, nkb, dtype=torch.bool, device=dev)
        step = max(1, _CHUNK_ELEMS // max(1, B * nqb * nkb))
        scale = softmax_scale_of(None, D)
        for h0 in range(0, HQ, step):                    # chunks of heads bound memory, not a per-block loop
            hs = slice(h0, min(HQ, h0 + step))
            qh = pq[:, :, hs].permute(0, 2, 1, 3)                                    # [B, h, NQB, D]
            kh = pk[:, :, kv_of[hs]].permute(0, 2, 1, 3)                             # [B, h, NKB, D]
            score = qh @ kh.transpose(-1, -2) * scale
            ks = k_sim[:, :, hs].permute(0, 2, 1)                                    # [B, h, NKB]
            allowed = ks[:, :, None, :] & k_valid[:, None, None, :] & block_causal
            score = score.masked_fill(~allowed, float("-inf"))
            prob = torch.softmax(score, -1).nan_to_num(0.0)                         # all-masked rows: nothing
            srt = prob.sort(dim=-1, descending=True, stable=True)
            cdf = srt.values.cumsum(-1)
            thr = cdf_t[hs].view(1, -1, 1, 1).expand(B, -1, nqb, 1).contiguous()
            num = torch.searchsorted(cdf.contiguous(), thr, right=True).clamp_min(1)   # [B, h, NQB, 1]
            keep_sorted = torch.arange(nkb, device=dev) < num
            sel = torch.zeros_like(allowed).scatter_(-1, srt.indices, keep_sorted) & allowed
            sel |= ~ks[:, :, None, :]                                                # non-self-similar keys
            sel |= ~q_sim[:, :, hs].permute(0, 2, 1)[..., None]                     # non-self-similar queries
            out[:, hs] = sel
        if sink_blocks:
            out[..., :sink_blocks] = True
        out &= block_causal & q_valid[:, None, :, None] & k_valid[:, None, None, :]
        if not per_query_head:
            out = out.view(B, H, G, nqb, nkb).any(2)
    return BlockLayout(out[0].contiguous() if cu_seqlens is None else out.contiguous(), block_q)


def naive_predict_sparge(q: torch.Tensor, k: torch.Tensor, cu_seqlens: torch.Tensor | None = None, *,
                         block_q: int = 128, block_k: int = KV_BLOCK, simthreshd1=0.1, cdfthreshd=0.9,
                         sink_blocks: int = 0, causal: bool = False,
                         per_query_head: bool = False) -> BlockLayout:
    """`predict_sparge` as plain loops over sequences, heads and blocks: pairwise cosine matrices,
    one softmax and one running cumulative sum per query block (the reference of the tests)."""
    G, cu = _check(q, k, cu_seqlens, block_q, block_k, sink_blocks, causal, per_query_head)
    _T, HQ, D = q.shape
    scale = softmax_scale_of(None, D)
    H = k.shape[1]
    B = cu.numel() - 1
    bounds = [(int(cu[b]), int(cu[b + 1])) for b in range(B)]
    max_len = max((e - s for s, e in bounds), default=0)
    nqb, nkb = -(-max_len // block_q), -(-max_len // KV_BLOCK)
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    sim1 = _per_head("simthreshd1", simthreshd1, HQ, "cpu").tolist()
    cdf_t = _per_head("cdfthreshd", cdfthreshd, HQ, "cpu").tolist()
    out = torch.zeros(B, HQ, nqb, nkb, dtype=torch.bool)
    qc, kc = q.detach().cpu().to(cdt), k.detach().cpu().to(cdt)

    def stats(x):
        xn = x / x.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(x.dtype).tiny)
        return x.mean(0), float((xn @ xn.T).mean())

    for b, (s, e) in enumerate(bounds):
        L = e - s
        nq, nk = -(-L // block_q), -(-L // KV_BLOCK)
        for h in range(HQ):
            kvh = h // G
            kblocks = [stats(kc[s + j * KV_BLOCK:s + min(L, (j + 1) * KV_BLOCK), kvh]) for j in range(nk)]
            for i in range(nq):
                pool_q, simq = stats(qc[s + i * block_q:s + min(L, (i + 1) * block_q), h])
                cand = [j for j in range(nk) if kblocks[j][1] > sim1[h]
                        and (not causal or j * KV_BLOCK < (i + 1) * block_q)]
                keep = set()
                if cand:
                    scores = torch.stack([pool_q @ kblocks[j][0] * scale for j in cand])
                    probs = torch.softmax(scores, 0).tolist()
                    order = sorted(range(len(cand)), key=lambda t: (-probs[t], t))
                    total, n = 0.0, 0
                    for t in order:
                        total += probs[t]
                        if total <= cdf_t[h]:
                            n += 1
                        else:
                            break
                    keep = {cand[t] for t in order[:max(n, 1)]}
                for j in range(nk):
                    kept = j in keep or kblocks[j][1] <= sim1[h] or simq <= sim1[h] or j < sink_blocks
                    out[b, h, i, j] = kept and (not causal or j * KV_BLOCK < (i + 1) * block_q)
    if not per_query_head:
        out = out.view(B, H, G, nqb, nkb).any(2)
    out = out.to(q.device)
    return BlockLayout(out[0].contiguous() if cu_seqlens is None else out.contiguous(), block_q)
