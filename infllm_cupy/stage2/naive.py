"""PyTorch reference of InfLLM-v2 stage 2 (spec section 7): attention over the selected key blocks,
and dense varlen attention for the fallback path.

Both build a boolean mask per query chunk and run masked softmax attention, vectorized over heads
and tokens. Autograd through them is the reference backward.
"""
from __future__ import annotations

import torch

from .._checks import (
    check_attn_inputs,
    check_flags,
    check_int_args,
    check_max_seqlen,
    check_softmax_scale,
    check_tensor,
    seqlens_host,
)
from .._dtypes import compute_dtype
from .._rules import softmax_scale_of
from .layout import BlockLayout, check_layout_call

# Elements of one fp32 score tile `[H, G, chunk, keys]`: 16M (64 MB), enough to keep BLAS busy.
_CHUNK_ELEMS = 1 << 24


def _masked_attention(q, k, v, allow, scale, upcast, need_lse):
    """Softmax attention of one query chunk against one sequence's keys under a boolean mask.

    `q [C, H, G, D]`, `k, v [N, H, D]`, `allow [H or 1, C, N]` bool. Returns `out [C, H, G, D]`
    (dtype of q) and, if `need_lse`, `lse [H, G, C]` (`+inf` on rows with no allowed key), else None.
    """
    sdt = compute_dtype(q.dtype)
    mdt = sdt if upcast else q.dtype
    qh = (q.to(mdt) * scale).permute(1, 2, 0, 3)                       # [H, G, C, D]
    kh = k.to(mdt).permute(1, 2, 0).unsqueeze(1)                       # [H, 1, D, N]
    vh = v.to(mdt).permute(1, 0, 2).unsqueeze(1)                       # [H, 1, N, D]
    s = torch.matmul(qh, kh).to(sdt)                                   # [H, G, C, N]
    s = s.masked_fill(~allow[:, None], float("-inf"))
    p = torch.softmax(s, dim=-1)
    has_key = allow.any(dim=-1)[:, None, :, None]                      # [H or 1, 1, C, 1]
    if not bool(has_key.all()):
        # A row with no allowed key (softmax gives NaN there): output 0, as FA2 / InfLLM-v2. The
        # masked_fill above sends no gradient into such rows, so the NaN never reaches q, k or v.
        p = torch.where(has_key, p, torch.zeros_like(p))
    out = torch.matmul(p.to(mdt), vh).permute(2, 0, 1, 3).to(q.dtype)  # [C, H, G, D]
    if not need_lse:
        return out, None
    # lse = +inf on empty rows, so that a backward's exp(s - lse) is 0 there.
    lse = torch.logsumexp(s.detach(), dim=-1)
    lse = torch.where(has_key[..., 0], lse, torch.full_like(lse, float("inf")))
    return out, lse


def _chunk_rows(HQ: int, N: int) -> int:
    return max(16, _CHUNK_ELEMS // max(1, HQ * N))


def _chunks(q, cu_seqlens_q, cu_seqlens_k, causal):
    """The (sequence, query chunk) pieces of `_attend` and `_attend_bwd`: yields `(b, qrows, start,
    end, N, keys, Lq, Lk)`, with `N` the keys the chunk can see (0: nothing to compute)."""
    HQ = q.shape[1]
    lq, lk = seqlens_host(cu_seqlens_q), seqlens_host(cu_seqlens_k)
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b, (Lq, Lk) in enumerate(zip(lq, lk)):
        chunk = _chunk_rows(HQ, Lk)
        for start in range(0, Lq, chunk):
            end = min(Lq, start + chunk)
            # Causal (bottom-right): row r sees keys j <= r + Lk - Lq; keys past the chunk's last row's
            # limit are never used, so they are not computed.
            N = max(0, min(Lk, end + Lk - Lq)) if causal else Lk
            yield b, slice(cu_q[b] + start, cu_q[b] + end), start, end, N, slice(cu_k[b], cu_k[b] + N), Lq, Lk


def _allow(allow_fn, b, qrows, start, end, N, Lq, Lk, causal, device):
    """The block selection of `allow_fn` with the causal part added: bool `[H or 1, C, N]`."""
    allow = allow_fn(b, qrows, start, end, N)
    if causal:
        r = torch.arange(start, end, device=device)
        j = torch.arange(N, device=device)
        allow = allow & (j[None, :] <= (r + Lk - Lq)[:, None])[None]
    return allow


def _attend(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, upcast, need_lse, allow_fn):
    """Loop over sequences and query chunks; `allow_fn(b, qrows, start, end, N) -> [H or 1, C, N]` bool
    gives the block selection part of the mask (the causal part is added here).

    Returns `out [total_q, HQ, D]` and `lse [HQ, total_q]` float32 (None unless `need_lse`).
    """
    _, HQ, D = q.shape
    H = k.shape[1]
    G = HQ // H
    outs, lses = [], []
    for b, qrows, start, end, N, keys, Lq, Lk in _chunks(q, cu_seqlens_q, cu_seqlens_k, causal):
        C = end - start
        if N == 0:
            outs.append(q.new_zeros(C, HQ, D))
            lses.append(torch.full((HQ, C), float("inf"), dtype=torch.float32, device=q.device))
            continue
        allow = _allow(allow_fn, b, qrows, start, end, N, Lq, Lk, causal, q.device)
        o, lse = _masked_attention(q[qrows].reshape(C, H, G, D), k[keys], v[keys], allow, scale, upcast,
                                   need_lse)
        outs.append(o.reshape(C, HQ, D))
        if need_lse:
            lses.append(lse.reshape(HQ, C).float())
    out = torch.cat(outs, dim=0) if outs else q.new_zeros(0, HQ, D)
    if not need_lse:
        return out, None
    lse = torch.cat(lses, dim=1) if lses else torch.zeros(HQ, 0, dtype=torch.float32, device=q.device)
    return out, lse


def naive_sparse_attn_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                             cu_seqlens_k: torch.Tensor, topk_idx: torch.Tensor, max_seqlen_q: int,
                             max_seqlen_k: int, *, causal: bool = True, softmax_scale: float | None = None,
                             return_lse: bool = False, block_size: int = 64, upcast: bool = True):
    r"""Attention of every query token over the key blocks its KV head selected (InfLLM-v2 stage 2).

    Query `t` (row `r` of sequence `b`) in head `hq` attends to keys `j` of its sequence with
    `j // block_size` in `topk_idx[hq // G, t]`, `j < Lk` and, when causal, `j <= r + Lk - Lq`
    (bottom-right aligned). Entries that are negative (`-1` padding), `>= ceil(Lk / block_size)`
    or future blocks select nothing; duplicates are harmless. For `Lq = 2`, `Lk = 5`,
    `block_size = 2` and `topk_idx = [[0, -1], [2, 0]]` the allowed keys are:

        1 1 0 0 0
        1 1 0 0 1

    A row with no allowed key gives output 0 and `lse = +inf`.

    Args:
        q (torch.Tensor):
            Queries `[total_q, HQ, D]` (bf16, fp16, fp32 or float64).
        k, v (torch.Tensor):
            Keys and values `[total_k, H, D]`, same dtype; `HQ` a multiple of `H`.
        cu_seqlens_q, cu_seqlens_k (torch.Tensor):
            int32 `[B+1]`.
        topk_idx (torch.Tensor):
            int32 `[H, total_q, K]`: block indices local to each sequence.
        max_seqlen_q, max_seqlen_k (int):
            Longest query / key sequence (checked only).
        causal (bool, Optional):
            Default: `True`.
        softmax_scale (float, Optional):
            Default: `None` (`1 / sqrt(D)`).
        return_lse (bool, Optional):
            Also return the log-sum-exp. Default: `False`.
        block_size (int, Optional):
            Keys per block. Default: 64.
        upcast (bool, Optional):
            `True`: all math in fp32 (float64 for float64 inputs). `False`: the matmuls run in the input
            dtype and only the softmax in fp32 (FlashAttention's low-precision twin for tolerances).
            Default: `True`.

    Returns:
        out (torch.Tensor): `[total_q, HQ, D]` in q's dtype; with `return_lse`, also
        lse (torch.Tensor): float32 `[HQ, total_q]`, natural log, no gradient.
    """
    check_attn_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k)
    check_flags(causal=causal, return_lse=return_lse, upcast=upcast)
    H = k.shape[1]
    check_tensor("topk_idx", topk_idx, ndim=3, dtypes=(torch.int32,), shape=(H, q.shape[0], None),
                 device=q.device)
    check_int_args(1, block_size=block_size)
    lq, lk = seqlens_host(cu_seqlens_q), seqlens_host(cu_seqlens_k)
    check_max_seqlen("max_seqlen_q", max_seqlen_q, lq)
    check_max_seqlen("max_seqlen_k", max_seqlen_k, lk)
    scale = check_softmax_scale(softmax_scale, q.shape[2])

    out, lse = _attend(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, upcast, return_lse,
                       _topk_allow_fn(topk_idx, lk, block_size))
    return (out, lse) if return_lse else out


def naive_block_sparse_attn_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                   cu_seqlens_q: torch.Tensor,
                                   cu_seqlens_k: torch.Tensor, layout: BlockLayout, max_seqlen_q: int,
                                   max_seqlen_k: int, *, causal: bool = True,
                                   softmax_scale: float | None = None,
                                   return_lse: bool = False, upcast: bool = True):
    r"""Reference of `block_sparse_attn_varlen`: attention under a query-block layout.

    Every token of query block `i` (`layout.q_block` tokens, counted per sequence) selects the 64-key
    blocks `j` with `layout.mask[(b,) h, i, j]`; this is `naive_sparse_attn_varlen` over that
    token-level selection (`layout.to_topk_idx(cu_seqlens_q)`), so the two forms share one definition.

    Args:
        layout (BlockLayout):
            `mask` bool `[H, NQB, NKB]` or `[B, H, NQB, NKB]` over 64-key blocks, and `q_block`.
        Others: as `naive_sparse_attn_varlen`.

    Returns:
        out (torch.Tensor): `[total_q, HQ, D]`; and `lse` with `return_lse`.
    """
    B = check_layout_call(layout, q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k)
    layout.check_against(k.shape[1], B, max_seqlen_q, max_seqlen_k)
    return naive_sparse_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k,
                                    layout.to_topk_idx(cu_seqlens_q).to(q.device),
                                    max_seqlen_q, max_seqlen_k, causal=causal, softmax_scale=softmax_scale,
                                    return_lse=return_lse, upcast=upcast)


def naive_sparse_attn_varlen_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                 cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                                 topk_idx: torch.Tensor,
                                 max_seqlen_q: int, max_seqlen_k: int, causal: bool = True,
                                 softmax_scale: float | None = None, *, block_size: int = 64):
    r"""Gradients of `naive_sparse_attn_varlen` (upcast) for the output gradient `dout`, written out.

    Recomputes the probabilities `P` chunk by chunk and applies attention's backward in the
    compute dtype (fp32, float64 for float64 inputs): `dV = P^T dO`, `dS = P * (dO V^T - rowsum(dO * O))`,
    `dQ = scale * dS K`, `dK = scale * dS^T Q`; the G query heads of a KV head sum into its dK, dV.
    Rows with no allowed key give `dQ = 0`, and keys no query attends get `dK = dV = 0`. Equal to
    autograd through the forward up to rounding; it exists because it runs where autograd cannot
    (inside a custom op's implementation, below the autograd dispatch key: the CPU backward of the
    `infllm_cupy::sparse_attn_bwd` op). `topk_idx` gets no gradient.

    Args:
        dout (torch.Tensor):
            `[total_q, HQ, D]`, the gradient of the output.
        Others: as `naive_sparse_attn_varlen`.

    Returns:
        (dq, dk, dv) (tuple of torch.Tensor): the shapes and dtypes of `q`, `k`, `v`.
    """
    check_attn_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k)
    H = k.shape[1]
    check_tensor("topk_idx", topk_idx, ndim=3, dtypes=(torch.int32,), shape=(H, q.shape[0], None),
                 device=q.device)
    check_tensor("dout", dout, shape=tuple(q.shape), device=q.device)
    check_int_args(1, block_size=block_size)
    lq, lk = seqlens_host(cu_seqlens_q), seqlens_host(cu_seqlens_k)
    check_max_seqlen("max_seqlen_q", max_seqlen_q, lq)
    check_max_seqlen("max_seqlen_k", max_seqlen_k, lk)
    scale = softmax_scale_of(softmax_scale, q.shape[2])
    return _attend_bwd(dout, q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale,
                       _topk_allow_fn(topk_idx, lk, block_size))


def _topk_allow_fn(topk_idx, lk, block_size):
    """`allow_fn` of `_attend` for token-level block indices `topk_idx [H, total_q, K]`."""
    H = topk_idx.shape[0]

    def allow_fn(b, qrows, start, end, N):
        n_blocks = -(-lk[b] // block_size)
        t = topk_idx[:, qrows].long()                                  # [H, C, K]
        # Unusable entries go to a spare column n_blocks, dropped after the scatter.
        t = torch.where((t >= 0) & (t < n_blocks), t, torch.full_like(t, n_blocks))
        sel = torch.zeros(H, end - start, n_blocks + 1, dtype=torch.bool, device=topk_idx.device)
        sel.scatter_(2, t, True)
        key_block = torch.arange(N, device=topk_idx.device) // block_size
        return sel[:, :, key_block]                                    # [H, C, N]

    return allow_fn


def _attend_bwd(dout, q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, allow_fn):
    """Backward of `_attend` (upcast): `(dq, dk, dv)` in the dtypes of q, k, v."""
    _, HQ, D = q.shape
    H = k.shape[1]
    G = HQ // H
    sdt = compute_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=sdt, device=q.device)
    dk = torch.zeros(k.shape, dtype=sdt, device=q.device)
    dv = torch.zeros(v.shape, dtype=sdt, device=q.device)
    for b, qrows, start, end, N, keys, Lq, Lk in _chunks(q, cu_seqlens_q, cu_seqlens_k, causal):
        if N == 0:
            continue                                                   # rows that see no key: dq = 0
        C = end - start
        allow = _allow(allow_fn, b, qrows, start, end, N, Lq, Lk, causal, q.device)
        qh = q[qrows].to(sdt).reshape(C, H, G, D).permute(1, 2, 0, 3)       # [H, G, C, D]
        doh = dout[qrows].to(sdt).reshape(C, H, G, D).permute(1, 2, 0, 3)   # [H, G, C, D]
        kh = k[keys].to(sdt).permute(1, 0, 2).unsqueeze(1)                  # [H, 1, N, D]
        vh = v[keys].to(sdt).permute(1, 0, 2).unsqueeze(1)                  # [H, 1, N, D]
        s = torch.matmul(qh * scale, kh.transpose(-1, -2))                  # [H, G, C, N]
        s = s.masked_fill(~allow[:, None], float("-inf"))
        has_key = allow.any(dim=-1)[:, None, :, None]
        p = torch.softmax(s, dim=-1)
        p = torch.where(has_key, p, torch.zeros_like(p))                    # empty rows: P = 0
        o = torch.matmul(p, vh)                                             # [H, G, C, D]
        dp = torch.matmul(doh, vh.transpose(-1, -2))                        # [H, G, C, N]
        ds = p * (dp - (doh * o).sum(-1, keepdim=True))
        dq[qrows] = (torch.matmul(ds, kh) * scale).permute(2, 0, 1, 3).reshape(C, HQ, D)
        dk[keys] += torch.einsum("hgcn,hgcd->nhd", ds, qh) * scale
        dv[keys] += torch.einsum("hgcn,hgcd->nhd", p, doh)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def naive_dense_attn_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                            cu_seqlens_k: torch.Tensor, max_seqlen_q: int | None = None,
                            max_seqlen_k: int | None = None, *, causal: bool = True,
                            softmax_scale: float | None = None, return_lse: bool = False,
                            upcast: bool = True):
    r"""Dense varlen attention with GQA, causal mask aligned bottom-right (`j <= r + Lk - Lq`).

    Args:
        q (torch.Tensor):
            Queries `[total_q, HQ, D]`.
        k, v (torch.Tensor):
            Keys and values `[total_k, H, D]`.
        cu_seqlens_q, cu_seqlens_k (torch.Tensor):
            int32 `[B+1]`.
        max_seqlen_q, max_seqlen_k (int, Optional):
            Longest query / key sequence, in the place `sparse_attn_varlen` takes them; checked
            when given, not needed. Default: `None`.
        causal (bool, Optional):
            Keyword-only, as every flag below. Default: `True`.
        softmax_scale (float, Optional):
            Default: `None` (`1 / sqrt(D)`).
        return_lse (bool, Optional):
            Also return the float32 log-sum-exp `[HQ, total_q]`. Default: `False`.
        upcast (bool, Optional):
            As in `naive_sparse_attn_varlen`. Default: `True`.

    Returns:
        out (torch.Tensor): `[total_q, HQ, D]` in q's dtype (and lse with `return_lse`).
    """
    check_attn_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k)
    check_flags(causal=causal, return_lse=return_lse, upcast=upcast)
    if max_seqlen_q is not None:
        check_max_seqlen("max_seqlen_q", max_seqlen_q, seqlens_host(cu_seqlens_q))
    if max_seqlen_k is not None:
        check_max_seqlen("max_seqlen_k", max_seqlen_k, seqlens_host(cu_seqlens_k))
    scale = check_softmax_scale(softmax_scale, q.shape[2])

    def allow_fn(b, qrows, start, end, N):
        return torch.ones(1, end - start, N, dtype=torch.bool, device=q.device)

    out, lse = _attend(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, upcast, return_lse, allow_fn)
    return (out, lse) if return_lse else out
