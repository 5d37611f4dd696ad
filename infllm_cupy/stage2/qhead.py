"""Stage 2 under layouts with one row per query head, without repeating K/V: the custom ops and the
backward's plan (docs/patterns.md, "Per query head vs per KV head").

The public entry point is `qhead_block_sparse_attn_varlen` in attention.py, which takes a
`BlockLayout` with HQ heads (query head `h * G + g` reads row `h * G + g`); `block_sparse_attn_varlen`
routes such layouts there. On CUDA
tensors the forward and the backward run the stage-2 kernels' per-query-head instances
(`FwdPlan.qhead="head"`, `BwdPlan.qhead="head"`; docs/stage2_fwd.md and docs/stage2_bwd.md,
"Per-query-head mask rows"), K/V kept at H heads (no copy): each CTA takes one query head's rows, so
it walks only that head's blocks, and the group's heads share K/V through the L2; dK and dV come as
per-query-head partials that the launcher sums over the group in fp32 (where those would take more
than an eighth of the device memory, one dk/dv CTA per KV head sums its group's heads instead). CPU
tensors, and
`backend="reference"`, run the expanded path (K/V repeated to HQ heads, the per-KV-head op at G = 1,
dK/dV summed over the group), which computes the same numbers as the kernels' path.

The forward and backward are the custom ops `infllm_cupy::qhead_block_sparse_attn_fwd` and
`infllm_cupy::qhead_block_sparse_attn_bwd` (fake implementations for torch.compile; the forward
carries the autograd formula).
"""
from __future__ import annotations

import dataclasses

import torch

from .._launch import total_memory
from .layout import BlockLayout
from .naive import naive_block_sparse_attn_varlen
from .ops import block_sparse_attn_bwd, fwd_plan_for, layout_bwd, layout_fwd
from .plan import BwdPlan, bwd_plan

Tensor = torch.Tensor


def expand_kv(k: Tensor, v: Tensor, G: int) -> tuple[Tensor, Tensor]:
    return k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)


# dk/dv partials per query head (G x the size of dk and dv) past this share of the device memory: the
# sm_90a dk/dv sums each group in its CTA instead (BwdPlan.dkdv_group; docs/stage2_bwd.md, "Per-query-head
# mask rows"): measured within 0.93-1.04x of the partials' time, so it is the plan where they would be large
PARTIALS_BUDGET_FRACTION = 8


def qhead_bwd_plan(capability, D: int, dtype: torch.dtype, max_seqlen_q: int, max_seqlen_k: int, total_k: int,
                   kernel: str = "auto", *, HQ: int = 1, partials_budget: int | None = None) -> BwdPlan:
    """The per-query-head backward's plan: the expanded path's (`bwd_plan` at G = 1: the kernels see
    one query head per row) with `qhead="head"`; on sm_90a, `dkdv_group` (block 0 then in one part)
    where the per-query-head dk/dv partials would take more than `partials_budget` bytes (None:
    never): 2 x total_k x HQ x D elements in q's dtype, and as many fp32 sums with query-range passes."""
    plan = dataclasses.replace(bwd_plan(capability, 1, D, dtype, max_seqlen_q, max_seqlen_k, total_k,
                                        kernel=kernel),
                               qhead="head")
    partials = 2 * total_k * HQ * D * (dtype.itemsize + (4 if plan.dkdv_passes > 1 else 0))
    if plan.kernel == "sm90a" and partials_budget is not None and partials > partials_budget:
        plan = dataclasses.replace(plan, dkdv_group=True, block0_parts=1)
    return plan


@torch.library.custom_op("infllm_cupy::qhead_block_sparse_attn_fwd", mutates_args=(), device_types="cuda")
def qhead_block_sparse_attn_fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                                layout_mask: Tensor, q_block: int, max_seqlen_q: int, max_seqlen_k: int,
                                causal: bool, softmax_scale: float, kernel: str) -> tuple[Tensor, Tensor]:
    """`(out, lse)` under `BlockLayout(layout_mask, q_block)` with one row per query head (mask on q's
    device)."""
    plan = dataclasses.replace(fwd_plan_for(q, k, max_seqlen_k, split_min=None, kernel=kernel), qhead="head")
    return layout_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, layout_mask, q_block, max_seqlen_q, max_seqlen_k,
                      causal, softmax_scale, plan)


@qhead_block_sparse_attn_fwd.register_kernel("cpu")
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, layout_mask, q_block, max_seqlen_q, max_seqlen_k, causal,
      softmax_scale, kernel):
    ke, ve = expand_kv(k, v, q.shape[1] // k.shape[1])
    out, lse = naive_block_sparse_attn_varlen(q, ke, ve, cu_seqlens_q, cu_seqlens_k,
                                              BlockLayout(layout_mask, q_block),
                                              max_seqlen_q, max_seqlen_k, causal=causal,
                                              softmax_scale=softmax_scale, return_lse=True)
    return out.contiguous(), lse.contiguous()


@qhead_block_sparse_attn_fwd.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, layout_mask, q_block, max_seqlen_q, max_seqlen_k, causal,
      softmax_scale, kernel):
    return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("infllm_cupy::qhead_block_sparse_attn_bwd", mutates_args=(), device_types="cuda")
def qhead_block_sparse_attn_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                                cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, layout_mask: Tensor, q_block: int,
                                max_seqlen_q: int, max_seqlen_k: int, causal: bool, softmax_scale: float,
                                kernel: str) -> tuple[Tensor, Tensor, Tensor]:
    """`(dq, dk, dv)` of `qhead_block_sparse_attn_fwd` (q's, k's and v's shapes): the backward kernels'
    per-query-head instances, K/V at H heads."""
    plan = qhead_bwd_plan(torch.cuda.get_device_capability(q.device), q.shape[2], q.dtype, max_seqlen_q,
                          max_seqlen_k, k.shape[0], kernel, HQ=q.shape[1],
                          partials_budget=total_memory(q.device) // PARTIALS_BUDGET_FRACTION)
    return layout_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, layout_mask, q_block, max_seqlen_q,
                      max_seqlen_k, causal, softmax_scale, plan)


def _expanded_bwd(dout, q, k, v, out, lse, cu_q, cu_k, layout_mask, q_block, *args):
    """The expanded path: K/V repeated to HQ heads, the per-KV-head backward at G = 1 over the same
    layout, dK/dV of the G copies summed in fp32 (float64 stays float64)."""
    H, G = k.shape[1], q.shape[1] // k.shape[1]
    ke, ve = expand_kv(k, v, G)
    dq, dke, dve = block_sparse_attn_bwd(dout, q, ke, ve, out, lse, cu_q, cu_k, layout_mask, q_block, *args)
    acc = torch.promote_types(k.dtype, torch.float32)
    dk = dke.view(k.shape[0], H, G, k.shape[2]).sum(2, dtype=acc).to(k.dtype)
    dv = dve.view(v.shape[0], H, G, v.shape[2]).sum(2, dtype=acc).to(v.dtype)
    return dq, dk, dv


@qhead_block_sparse_attn_bwd.register_kernel("cpu")
def _(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, layout_mask, q_block, max_seqlen_q, max_seqlen_k,
      causal, softmax_scale, kernel):
    return _expanded_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, layout_mask, q_block,
                         max_seqlen_q, max_seqlen_k, causal, softmax_scale, kernel)


@qhead_block_sparse_attn_bwd.register_fake
def _(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, layout_mask, q_block, max_seqlen_q, max_seqlen_k,
      causal, softmax_scale, kernel):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, layout_mask = inputs[:6]
    ctx.q_block = inputs[6]
    ctx.args = inputs[7:12]          # max_seqlen_q .. kernel: the backward op's tail
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, layout_mask)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, cu_q, cu_k, layout_mask = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = qhead_block_sparse_attn_bwd(dout, q, k, v, out, lse, cu_q, cu_k, layout_mask, ctx.q_block,
                                             *ctx.args)
    return (dq, dk, dv) + (None,) * 9


qhead_block_sparse_attn_fwd.register_autograd(_backward, setup_context=_setup_context)

