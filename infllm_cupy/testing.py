"""Tolerance helpers shared by tests and benchmarks (FlashAttention's rule)."""
from __future__ import annotations

import math

import torch

from .decode import DecodeCache
from .stage2.naive import naive_block_sparse_attn_varlen, naive_sparse_attn_varlen


def max_abs_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return (out.double() - ref.double()).abs().max().item() if out.numel() else 0.0


def rel_l2_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    d = (out.double() - ref.double()).norm().item()
    return d / max(ref.double().norm().item(), 1e-30)


def accuracy_per_head(out: torch.Tensor, ref: torch.Tensor) -> dict[str, torch.Tensor]:
    """SageAttention's two accuracy figures of an attention output against its high-precision reference,
    per head: `cosine` (the cosine similarity of the head's outputs over every token, flattened) and
    `rel_l1` (sum |out - ref| / sum |ref|), float64 `[heads]` each, for `[tokens, heads, D]` outputs."""
    if out.shape != ref.shape or out.dim() != 3:
        raise ValueError(f"out and ref must be [tokens, heads, D] of one shape, got {tuple(out.shape)} and "
                         f"{tuple(ref.shape)}")
    o = out.double().transpose(0, 1).reshape(out.shape[1], -1)
    r = ref.double().transpose(0, 1).reshape(ref.shape[1], -1)
    cosine = (o * r).sum(1) / (o.norm(dim=1) * r.norm(dim=1)).clamp_min(1e-300)
    rel_l1 = (o - r).abs().sum(1) / r.abs().sum(1).clamp_min(1e-300)
    return {"cosine": cosine, "rel_l1": rel_l1}


def assert_close_to_ref(name: str, out: torch.Tensor, ref: torch.Tensor, ref_lowp: torch.Tensor, *,
                        mult: float = 2.0, atol_floor: float = 1e-6) -> None:
    """FlashAttention's rule: the error of `out` against the high-precision `ref` may be at most
    `mult` times the error of `ref_lowp` (the same math done by PyTorch in the low precision),
    plus a tiny floor for outputs that are exact in both. NaN (an unwritten element) always fails."""
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    assert not torch.isnan(out).any(), f"{name}: NaN in output (an element was never written?)"
    err = max_abs_err(out, ref)
    base = max_abs_err(ref_lowp, ref)
    if out.dtype in (torch.float16, torch.bfloat16) and ref.numel():
        # one unit in the last place of the largest reference value: the output's own rounding. On a
        # handful of elements the low-precision torch error can fall below it by luck (a 2-token
        # backward in the fuzzer); on real sizes `base` is far above it.
        # An element that cancels to exactly 0 in float64 (one key's softmax: dS = dP - rowsum(dO * O)
        # = 0) keeps the rounding of its unit-scale terms: about eps^2, or the fp32 rounding of the two
        # D-term row sums, up to D x 2^-24 (a 1-token layout backward in the fuzzer: fp16, D = 64,
        # dq 1.2e-6 where eps^2 is 9.5e-7).
        eps = torch.finfo(out.dtype).eps
        fp32_sums = out.shape[-1] * 2.0**-24 if out.dim() else 0.0
        atol_floor = max(atol_floor, eps * ref.abs().max().item(), eps * eps, fp32_sums)
    assert err <= mult * base + atol_floor, (
        f"{name}: max|out-ref| = {err:.3e} > {mult} x {base:.3e} (low-precision torch error); "
        f"rel L2 {rel_l2_err(out, ref):.2e}")


def assert_decode_close_to_ref(out, lse, w, ref, ref_lse, ref_w, lowp, lowp_lse, lowp_w) -> None:
    """A decode attention's `out`, `lse` and per-head weights against the high-precision reference and
    its low-precision twin (`assert_close_to_ref`): heads with nothing selected (`ref_lse` +inf) give
    `out = 0` and `lse = +inf`, weights are exactly 0 where the reference's are and sum to 1 elsewhere."""
    assert_close_to_ref("out", out, ref, lowp)
    empty = torch.isinf(ref_lse)
    assert bool(torch.isinf(lse[empty]).all()) and bool((out[empty] == 0).all())
    assert_close_to_ref("lse", lse[~empty], ref_lse[~empty], lowp_lse[~empty], atol_floor=1e-5)
    assert_close_to_ref("weights", w, ref_w, lowp_w, atol_floor=1e-6)
    assert bool((w[ref_w == 0] == 0).all()), "weights must be exactly 0 where nothing is selected"
    torch.testing.assert_close(w.sum(-1)[~empty], torch.ones_like(lse)[~empty], atol=1e-4, rtol=0)


def assert_grads_close_to_ref(out: torch.Tensor, ref: torch.Tensor, ref_lowp: torch.Tensor, inputs,
                              ref_inputs) -> None:
    """dq, dk, dv of `out` against the float64 `ref` by FlashAttention's rule (at most 3x the error of
    `ref_lowp`, the same math in low precision), for one random dout. `inputs` are the (q, k, v) that
    `out` and `ref_lowp` were computed from, `ref_inputs` the float64 leaves of `ref`."""
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, inputs, do)
    ref_grads = torch.autograd.grad(ref, ref_inputs, do.double())
    lowp_grads = torch.autograd.grad(ref_lowp, inputs, do)
    for name, g, r, lp in zip(("dq", "dk", "dv"), grads, ref_grads, lowp_grads):
        assert_close_to_ref(name, g, r, lp, mult=3)


def cu_seqlens_from_lengths(lengths, device="cpu") -> torch.Tensor:
    """int32 `[B+1]` cumulative lengths."""
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    if len(lengths):
        cu[1:] = torch.tensor(list(lengths), dtype=torch.int64).cumsum(0).to(torch.int32)
    return cu.to(device)


def random_topk_idx(H: int, lengths_q, lengths_k, K: int, *, block_size: int = 64, junk: bool = True,
                    empty_rows: bool = False, generator: torch.Generator | None = None,
                    device="cpu") -> torch.Tensor:
    """Random token-level selections `[H, total_q, K]` int32 for tests.

    Each token picks K entries among its sequence's blocks. With `junk`, entries also include
    -1 tails, other negatives, out-of-range and future blocks and duplicates, all of which the ops
    must ignore. With `empty_rows`, about 1 token in 16 selects nothing usable at all.
    """
    rows = []
    for Lq, Lk in zip(lengths_q, lengths_k):
        nb = max(1, -(-Lk // block_size))
        u = torch.rand(H, Lq, K, generator=generator)
        if junk:
            idx = torch.floor(u * (nb + 6)).long() - 3          # [-3, nb + 2]: negatives and out-of-range
            dup = torch.rand(H, Lq, K, generator=generator) < 0.1
            idx = torch.where(dup, idx.roll(1, dims=-1), idx)  # duplicates
            tail = torch.rand(H, Lq, 1, generator=generator) * K
            idx = torch.where(torch.arange(K)[None, None] > tail + K // 2, torch.full_like(idx, -1), idx)
        else:
            idx = torch.floor(u * nb).long()
        if empty_rows:
            empty = torch.rand(H, Lq, 1, generator=generator) < 1 / 16
            idx = torch.where(empty, torch.full_like(idx, -1), idx)
        rows.append(idx)
    return torch.cat(rows, dim=1).to(torch.int32).to(device) if rows else torch.zeros(H, 0, K,
                                                                                      dtype=torch.int32)


def sparse_attn_inputs(lengths_q, lengths_k, HQ: int, H: int, D: int, dtype: torch.dtype, *, K: int = 12,
                       seed: int = 0, device="cuda", **sel):
    """Random `q, k, v, dout` (never zeros), `cu_seqlens_q`, `cu_seqlens_k` and a `topk_idx` with
    junk entries (`random_topk_idx(..., **sel)`) for stage-2 tests, drawn from one seeded generator."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lengths_q), HQ, D, generator=g).to(device, dtype)
    k = torch.randn(sum(lengths_k), H, D, generator=g).to(device, dtype)
    v = torch.randn(sum(lengths_k), H, D, generator=g).to(device, dtype)
    do = torch.randn(sum(lengths_q), HQ, D, generator=g).to(device, dtype)
    idx = random_topk_idx(H, lengths_q, lengths_k, K, generator=g, **sel).to(device)
    cu_q, cu_k = cu_seqlens_from_lengths(lengths_q, device), cu_seqlens_from_lengths(lengths_k, device)
    return q, k, v, do, cu_q, cu_k, idx


def reference_sparse_grads(q, k, v, dout, cu_q, cu_k, topk_idx, max_q, max_k, causal, *, exact: bool):
    """`(out, lse, (dq, dk, dv))` of the stage-2 reference through autograd: in float64 (`exact`) or
    as the low-precision twin (`upcast=False`, FlashAttention's baseline)."""
    leaves = [t.detach().double().requires_grad_() if exact else t.detach().clone().requires_grad_()
              for t in (q, k, v)]
    out, lse = naive_sparse_attn_varlen(*leaves, cu_q, cu_k, topk_idx, max_q, max_k, causal=causal,
                                        return_lse=True, upcast=exact)
    return out.detach(), lse, torch.autograd.grad(out, leaves, dout.double() if exact else dout)


def _qhead_layout_ref(leaves, cu_q, cu_k, layout, max_q: int, max_k: int, *, exact: bool) -> torch.Tensor:
    """The reference output of a per-query-head `layout` on `leaves` (q, k, v) with K/V repeated to
    q's heads: float64 math (`exact`) or the low-precision twin."""
    G = leaves[0].shape[1] // leaves[1].shape[1]
    return naive_block_sparse_attn_varlen(leaves[0], *(x.repeat_interleave(G, 1) for x in leaves[1:]),
                                          cu_q, cu_k, layout, max_q, max_k,
                                          **({} if exact else {"upcast": False}))


def assert_qhead_layout_close(out: torch.Tensor, q, k, v, leaves, cu_q, cu_k, layout, max_q: int,
                              max_k: int) -> None:
    """`out` (from the `leaves` copies of q, k, v under a per-query-head `layout`) and its gradients
    against the float64 reference with K/V repeated to q's heads (FlashAttention's rule, 2x out and 3x
    gradients), the same reference in q's precision as the baseline."""
    ref_leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref = _qhead_layout_ref(ref_leaves, cu_q, cu_k, layout, max_q, max_k, exact=True)
    lowp = _qhead_layout_ref(leaves, cu_q, cu_k, layout, max_q, max_k, exact=False)
    assert_close_to_ref("out", out, ref, lowp, mult=2)
    assert_grads_close_to_ref(out, ref, lowp, leaves, ref_leaves)


def check_qhead_layout_grads(grads, q, k, v, dout, cu_q, cu_k, layout, max_q: int, max_k: int) -> None:
    """Gradients `(dq, dk, dv)` of a per-query-head `layout` for `dout` (from a launcher, not
    autograd) against the float64 reference with K/V repeated to q's heads, by FlashAttention's rule
    (3x the error of the same math in q's precision)."""
    ref_leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    low_leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    ref = torch.autograd.grad(_qhead_layout_ref(ref_leaves, cu_q, cu_k, layout, max_q, max_k, exact=True),
                              ref_leaves, dout.double())
    low = torch.autograd.grad(_qhead_layout_ref(low_leaves, cu_q, cu_k, layout, max_q, max_k, exact=False),
                              low_leaves, dout)
    for name, g, r, lp, x in zip(("dq", "dk", "dv"), grads, ref, low, (q, k, v)):
        assert g.shape == x.shape, f"{name}: shape {tuple(g.shape)} != {tuple(x.shape)}"
        assert_close_to_ref(name, g, r, lp, mult=3)


def check_sparse_grads(grads, q, k, v, dout, cu_q, cu_k, topk_idx, max_q, max_k, causal, *, out=None):
    """Assert stage-2 gradients (and `out`, if given) against the reference by FlashAttention's rule
    (3x the low-precision error for gradients, 2x for the output), with exact zeros where nothing
    reached an element: dq of rows with no allowed key (lse = +inf), dk and dv of keys no query
    selected (their float64 reference dv row is exactly 0). Returns `(empty_rows [total_q, HQ],
    unused_keys [total_k, H])` so a caller can require that its case exercises both."""
    ref_out, ref_lse, ref = reference_sparse_grads(q, k, v, dout, cu_q, cu_k, topk_idx, max_q, max_k, causal,
                                                   exact=True)
    lowp_out, _, lowp = reference_sparse_grads(q, k, v, dout, cu_q, cu_k, topk_idx, max_q, max_k, causal,
                                               exact=False)
    if out is not None:
        assert_close_to_ref("out", out, ref_out, lowp_out, mult=2)
    for name, g, r, lp, x in zip(("dq", "dk", "dv"), grads, ref, lowp, (q, k, v)):
        assert g.dtype == x.dtype and g.shape == x.shape and g.is_contiguous(), f"{name}: dtype/shape/layout"
        assert_close_to_ref(name, g, r, lp, mult=3)
    empty_rows = torch.isinf(ref_lse).T
    assert bool((grads[0][empty_rows] == 0).all()), "dq of rows with no allowed key must be exactly 0"
    unused = (ref[2] == 0).all(-1)
    for name, g in (("dk", grads[1]), ("dv", grads[2])):
        assert bool((g[unused] == 0).all()), f"{name} of keys no query selected must be exactly 0"
    return empty_rows, unused


def random_decode_cache(lengths, H: int, D: int, dtype: torch.dtype, *, page_size: int | None = None,
                        device="cpu", seed: int = 0, spare: int = 70, spare_pages: int = 2, kv_dtype=None):
    """A `DecodeCache` holding random K/V of `lengths` (appended as one chunk) with `spare` positions
    of room; a paged cache (`page_size`) gets shuffled pages out of `spare_pages` more than it needs;
    `kv_dtype` its K/V storage (`DecodeCache`'s)."""

    g = torch.Generator().manual_seed(seed)
    B, cap = len(lengths), max(lengths) + spare
    if page_size is None:
        cache = DecodeCache.contiguous(B, cap, H, D, dtype=dtype, device=device, kv_dtype=kv_dtype)
    else:
        per = math.ceil(cap / page_size)
        n_pages = B * per + spare_pages
        bt = torch.randperm(n_pages, generator=g)[:B * per].view(B, per).to(torch.int32)
        cache = DecodeCache.paged(n_pages, page_size, H, D, bt.to(device), dtype=dtype, device=device,
                                  kv_dtype=kv_dtype)
    k = (torch.randn(sum(lengths), H, D, generator=g) * 2).to(device, dtype)
    v = torch.randn(sum(lengths), H, D, generator=g).to(device, dtype)
    cache.append(k, v, cu_seqlens_from_lengths(lengths))
    return cache
