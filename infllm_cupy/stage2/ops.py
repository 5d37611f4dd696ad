"""Stage-2 attention as `torch.library` custom ops (namespace `infllm_cupy`): autograd and torch.compile.

Four ops, a forward and a backward for each input form:

    infllm_cupy::sparse_attn_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, topk_idx, max_seqlen_q, max_seqlen_k,
                                 causal, softmax_scale, kernel) -> (out, lse)
    infllm_cupy::sparse_attn_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, topk_idx, max_seqlen_q,
                                 max_seqlen_k, causal, softmax_scale, kernel) -> (dq, dk, dv)
    infllm_cupy::block_sparse_attn_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, layout_mask, q_block, max_seqlen_q,
                                       max_seqlen_k, causal, softmax_scale, kernel) -> (out, lse)
    infllm_cupy::block_sparse_attn_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, layout_mask, q_block,
                                       max_seqlen_q, max_seqlen_k, causal, softmax_scale, kernel) -> (dq, dk, dv)

CUDA tensors run the kernels (`stage2_fwd`, `stage2_bwd` over the bitmask rows of `token_block_masks` or
`BlockLayout.packed`); CPU tensors run the CPU implementation of the forward (`cpu_sparse_attn_varlen`,
cpu.py: the selected blocks only) and, for the backward, the reference's gradient written out
(`naive_sparse_attn_varlen_bwd`, which recomputes the probabilities from q and k and equals autograd
through the reference up to rounding). The forward ops carry an
autograd formula (`register_autograd`): gradients flow to q, k and v only; `lse` is marked
non-differentiable; `topk_idx`, the layout, the `cu_seqlens` and the ints get none. The fake
(meta) implementations give torch.compile the output shapes without running anything, so a model
calling the ops traces with `fullgraph=True`.

The ops assume checked inputs (the public wrappers in attention.py check them, naming the
argument). `softmax_scale` is already resolved (a float); `kernel` is the public argument ("auto",
"sm80" or "sm90a"), which the forward op and, through the autograd formula, the backward op turn
into their plans (`fwd_plan`, `bwd_plan`) for the device and shapes at hand. Below the ops, the
launcher-level functions `token_fwd`, `token_bwd`, `layout_fwd` and `layout_bwd` take a plan: the
tests reach variants no `kernel` value names there: pass counts, tile shapes, and through the
forward's `_force_steps` and the backward's `_force_dq_steps` and `_pdl` hooks forced step shapes and
plain launches of the dk/dv passes.

Saved state: q, k, v, out, lse and the selection itself (`topk_idx` or the layout mask, both op
inputs that are alive anyway). The backward rebuilds the bitmask rows from them (one small launch,
`token_block_masks`, or `BlockLayout.packed`) instead of saving the masks of the forward: the
rows cost `H * total_q * n_words * 4` bytes (64 MB at 128k tokens, H = 2) held from forward to
backward, the rebuild one pass over `topk_idx` (not measured separately; small next to the
backward's own launches). The CPU backward recomputes from q, k, v and ignores out and lse.
"""  # noqa: E501 - verbatim commands, signatures and tables
import torch

from .cpu import cpu_sparse_attn_varlen
from .layout import BlockLayout
from .naive import naive_sparse_attn_varlen_bwd
from .plan import BwdPlan, FwdPlan, bwd_plan, fwd_plan, n_mask_words
from .sparse_bwd import stage2_bwd
from .sparse_fwd import stage2_fwd, token_block_masks

Tensor = torch.Tensor


# ------------------------------------------------------------------------------------------- plans


def fwd_plan_for(q: Tensor, k: Tensor, max_seqlen_k: int, split_min: int | None = None,
                 kernel: str = "auto") -> FwdPlan:
    """`fwd_plan` for these tensors on their device."""
    return fwd_plan(torch.cuda.get_device_capability(q.device), q.shape[2], q.dtype, max_seqlen_k, k.shape[0],
                    split_min=split_min, kernel=kernel)


def bwd_plan_for(q: Tensor, k: Tensor, max_seqlen_q: int, max_seqlen_k: int, kernel: str = "auto") -> BwdPlan:
    """`bwd_plan` for these tensors on their device."""
    return bwd_plan(torch.cuda.get_device_capability(q.device), q.shape[1] // k.shape[1], q.shape[2], q.dtype,
                    max_seqlen_q, max_seqlen_k, k.shape[0], kernel=kernel)


# ------------------------------------------------------------------------------------ mask rows (CUDA)


def _token_rows(topk_idx, cu_seqlens_q, cu_seqlens_k, total_q, max_seqlen_k):
    """(masks, mask_base, mask_h_stride, mask_q_block) of the token-level form: one row per (h, token)."""
    masks = token_block_masks(topk_idx.contiguous(), cu_seqlens_q, cu_seqlens_k, n_mask_words(max_seqlen_k))
    return masks, cu_seqlens_q, total_q, 1


def _layout_rows(layout_mask, q_block, batch, max_seqlen_k, device):
    """(masks, mask_base, mask_h_stride, mask_q_block) of a layout: one row per (b, h, query block)."""
    words, base, h_stride = BlockLayout(layout_mask, q_block).packed(n_mask_words(max_seqlen_k), device)
    if base is None:            # one layout shared by every sequence
        base = torch.zeros(batch, dtype=torch.int32, device=device)
    return words, base, h_stride, q_block


def _contig(*ts):
    return tuple(t.contiguous() for t in ts)


# -------------------------------------------------------------------------------------- CPU parts


def _cpu_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, topk_idx, max_seqlen_q, max_seqlen_k, causal,
             softmax_scale):
    # the selected blocks only (cpu.py); the oracle's semantics, checked against it in tests/stage2
    out, lse = cpu_sparse_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, topk_idx, max_seqlen_q,
                                      max_seqlen_k,
                                      causal=causal, softmax_scale=softmax_scale, return_lse=True)
    return out.contiguous(), lse.contiguous()


def _ref_bwd(dout, q, k, v, cu_seqlens_q, cu_seqlens_k, topk_idx, max_seqlen_q, max_seqlen_k, causal,
             softmax_scale):
    # The reference's backward written out (it recomputes P; out and lse are not needed). Autograd
    # cannot run here: an op's implementation runs below the autograd dispatch key, where
    # torch.enable_grad() records nothing (and functorch's vjp trips opcheck's schema mode).
    return tuple(g.contiguous() for g in naive_sparse_attn_varlen_bwd(
        dout, q, k, v, cu_seqlens_q, cu_seqlens_k, topk_idx, max_seqlen_q, max_seqlen_k, causal,
                                                                      softmax_scale))


def _fake_fwd(q, k):
    return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


def _fake_bwd(q, k, v):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


# ------------------------------------------------------------------------------------- token level


def token_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, topk_idx, max_seqlen_q, max_seqlen_k, causal,
              softmax_scale, plan: FwdPlan, *, _force_steps: str | None = None):
    """The token-level forward on CUDA tensors under `plan` (the op's body below the plan choice).
    `_force_steps`: `stage2_fwd`'s test and A/B hook."""
    q, k, v, cu_seqlens_q, cu_seqlens_k = _contig(q, k, v, cu_seqlens_q, cu_seqlens_k)
    rows = _token_rows(topk_idx, cu_seqlens_q, cu_seqlens_k, q.shape[0], max_seqlen_k)
    return stage2_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, *rows, max_seqlen_q, causal, softmax_scale, plan,
                      max_seqlen_k=max_seqlen_k, _force_steps=_force_steps)


def token_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, topk_idx, max_seqlen_q, max_seqlen_k,
              causal, softmax_scale, plan: BwdPlan, **hooks):
    """The token-level backward on CUDA tensors under `plan`. `hooks`: `stage2_bwd`'s test and A/B
    keywords (`_pdl`, `_force_dq_steps`)."""
    tensors = _contig(dout.to(q.dtype), q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)
    rows = _token_rows(topk_idx, *tensors[6:], q.shape[0], max_seqlen_k)
    return stage2_bwd(*tensors, *rows, max_seqlen_q, max_seqlen_k, causal, softmax_scale, plan, **hooks)


@torch.library.custom_op("infllm_cupy::sparse_attn_fwd", mutates_args=(), device_types="cuda")
def sparse_attn_fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                    topk_idx: Tensor, max_seqlen_q: int, max_seqlen_k: int, causal: bool,
                    softmax_scale: float, kernel: str) -> tuple[Tensor, Tensor]:
    """`(out [total_q, HQ, D], lse float32 [HQ, total_q])` of token-level sparse attention."""
    # key-range passes for CTAs whose tokens picked over 2 K different blocks (per-token picks)
    plan = fwd_plan_for(q, k, max_seqlen_k, split_min=2 * topk_idx.shape[2], kernel=kernel)
    return token_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, topk_idx, max_seqlen_q, max_seqlen_k, causal,
                     softmax_scale, plan)


@sparse_attn_fwd.register_kernel("cpu")
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, topk_idx, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
      kernel):
    return _cpu_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, topk_idx, max_seqlen_q, max_seqlen_k, causal,
                    softmax_scale)


@sparse_attn_fwd.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, topk_idx, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
      kernel):
    return _fake_fwd(q, k)


@torch.library.custom_op("infllm_cupy::sparse_attn_bwd", mutates_args=(), device_types="cuda")
def sparse_attn_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                    cu_seqlens_q: Tensor,
                    cu_seqlens_k: Tensor, topk_idx: Tensor, max_seqlen_q: int, max_seqlen_k: int,
                    causal: bool, softmax_scale: float, kernel: str) -> tuple[Tensor, Tensor, Tensor]:
    """`(dq, dk, dv)` of `sparse_attn_fwd` (q's, k's and v's shapes and dtype)."""
    plan = bwd_plan_for(q, k, max_seqlen_q, max_seqlen_k, kernel)
    return token_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, topk_idx, max_seqlen_q,
                     max_seqlen_k, causal, softmax_scale, plan)


@sparse_attn_bwd.register_kernel("cpu")
def _(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, topk_idx, max_seqlen_q, max_seqlen_k, causal,
      softmax_scale, kernel):
    return _ref_bwd(dout, q, k, v, cu_seqlens_q, cu_seqlens_k, topk_idx, max_seqlen_q, max_seqlen_k, causal,
                    softmax_scale)


@sparse_attn_bwd.register_fake
def _(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, topk_idx, max_seqlen_q, max_seqlen_k, causal,
      softmax_scale, kernel):
    return _fake_bwd(q, k, v)


def _setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens_q, cu_seqlens_k, sel = inputs[:6]
    ctx.args = inputs[6:]            # the ints, causal, softmax_scale and kernel: the backward op's tail
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, sel)


def _n_none(n):
    return (None,) * n


def _sparse_backward(ctx, dout, dlse):
    q, k, v, out, lse, cu_q, cu_k, topk_idx = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = sparse_attn_bwd(dout, q, k, v, out, lse, cu_q, cu_k, topk_idx, *ctx.args)
    return (dq, dk, dv) + _n_none(8)


sparse_attn_fwd.register_autograd(_sparse_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------------- block layouts


def layout_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, layout_mask, q_block, max_seqlen_q, max_seqlen_k, causal,
               softmax_scale, plan: FwdPlan, *, _force_steps: str | None = None):
    """The layout forward on CUDA tensors under `plan` (mask on q's device). `_force_steps`:
    `stage2_fwd`'s test and A/B hook."""
    q, k, v, cu_seqlens_q, cu_seqlens_k = _contig(q, k, v, cu_seqlens_q, cu_seqlens_k)
    rows = _layout_rows(layout_mask, q_block, cu_seqlens_q.numel() - 1, max_seqlen_k, q.device)
    return stage2_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, *rows, max_seqlen_q, causal, softmax_scale, plan,
                      max_seqlen_k=max_seqlen_k, _force_steps=_force_steps)


def layout_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, layout_mask, q_block, max_seqlen_q,
               max_seqlen_k, causal, softmax_scale, plan: BwdPlan, **hooks):
    """The layout backward on CUDA tensors under `plan`. `hooks`: `stage2_bwd`'s test and A/B keywords
    (`_pdl`, `_force_dq_steps`)."""
    tensors = _contig(dout.to(q.dtype), q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)
    rows = _layout_rows(layout_mask, q_block, cu_seqlens_q.numel() - 1, max_seqlen_k, q.device)
    return stage2_bwd(*tensors, *rows, max_seqlen_q, max_seqlen_k, causal, softmax_scale, plan, **hooks)


@torch.library.custom_op("infllm_cupy::block_sparse_attn_fwd", mutates_args=(), device_types="cuda")
def block_sparse_attn_fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                          layout_mask: Tensor, q_block: int, max_seqlen_q: int, max_seqlen_k: int,
                          causal: bool, softmax_scale: float, kernel: str) -> tuple[Tensor, Tensor]:
    """`(out, lse)` under the query-block layout `BlockLayout(layout_mask, q_block)` (mask on q's device)."""
    # one key-range pass: a layout's rows are shared by a query block, so CTAs' unions stay small
    plan = fwd_plan_for(q, k, max_seqlen_k, split_min=None, kernel=kernel)
    return layout_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, layout_mask, q_block, max_seqlen_q, max_seqlen_k,
                      causal, softmax_scale, plan)


def _layout_topk_idx(layout_mask, q_block, cu_seqlens_q):
    return BlockLayout(layout_mask, q_block).to_topk_idx(cu_seqlens_q)


@block_sparse_attn_fwd.register_kernel("cpu")
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, layout_mask, q_block, max_seqlen_q, max_seqlen_k, causal,
      softmax_scale, kernel):
    return _cpu_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, _layout_topk_idx(layout_mask, q_block, cu_seqlens_q),
                    max_seqlen_q, max_seqlen_k, causal, softmax_scale)


@block_sparse_attn_fwd.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, layout_mask, q_block, max_seqlen_q, max_seqlen_k, causal,
      softmax_scale, kernel):
    return _fake_fwd(q, k)


@torch.library.custom_op("infllm_cupy::block_sparse_attn_bwd", mutates_args=(), device_types="cuda")
def block_sparse_attn_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                          cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, layout_mask: Tensor, q_block: int,
                          max_seqlen_q: int, max_seqlen_k: int, causal: bool,
                          softmax_scale: float, kernel: str) -> tuple[Tensor, Tensor, Tensor]:
    """`(dq, dk, dv)` of `block_sparse_attn_fwd`."""
    plan = bwd_plan_for(q, k, max_seqlen_q, max_seqlen_k, kernel)
    return layout_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, layout_mask, q_block, max_seqlen_q,
                      max_seqlen_k, causal, softmax_scale, plan)


@block_sparse_attn_bwd.register_kernel("cpu")
def _(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, layout_mask, q_block, max_seqlen_q, max_seqlen_k,
      causal, softmax_scale, kernel):
    return _ref_bwd(dout, q, k, v, cu_seqlens_q, cu_seqlens_k,
                    _layout_topk_idx(layout_mask, q_block, cu_seqlens_q),
                    max_seqlen_q, max_seqlen_k, causal, softmax_scale)


@block_sparse_attn_bwd.register_fake
def _(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, layout_mask, q_block, max_seqlen_q, max_seqlen_k,
      causal, softmax_scale, kernel):
    return _fake_bwd(q, k, v)


def _block_setup_context(ctx, inputs, output):
    _setup_context(ctx, inputs[:6] + inputs[7:], output)
    ctx.q_block = inputs[6]


def _block_sparse_backward(ctx, dout, dlse):
    q, k, v, out, lse, cu_q, cu_k, layout_mask = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = block_sparse_attn_bwd(dout, q, k, v, out, lse, cu_q, cu_k, layout_mask, ctx.q_block,
                                       *ctx.args)
    return (dq, dk, dv) + _n_none(9)


block_sparse_attn_fwd.register_autograd(_block_sparse_backward, setup_context=_block_setup_context)
