"""Context-parallel InfLLM-v2 attention over `torch.distributed` (docs/context_parallel.md).

All-gather form: every rank holds the zigzag shard of q, k, v (zigzag.py); K and V are gathered
into natural order, and each rank runs compression, stage 1, top-k and stage 2 for its own
queries against the gathered keys, with global positions. The backward reduce-scatters dK and dV
to their owners. Everything else is the single-GPU ops, unchanged: a chunk's queries at global
positions `[a, e)` are a chunked-prefill sequence (queries `[a, e)`, keys `[0, e)`), which the
stage-1 `cache_lens` and stage 2's bottom-right causal alignment already express (§3).
"""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

from .._checks import check_flags, check_kernel_inputs, check_softmax_scale, check_tensor
from .._dtypes import REF_DTYPES
from .._kernel_arg import check_kernel
from .._rules import KV_BLOCK, cdiv, check_backend, runs_kernels, uses_dense
from ..config import InfLLMv2Config, check_config
from ..prefill import run_compress, run_stage1
from ..stage2.layout import BlockLayout
from ..stage2.naive import naive_sparse_attn_varlen, naive_sparse_attn_varlen_bwd
from ..stage2.ops import block_sparse_attn_bwd, block_sparse_attn_fwd, sparse_attn_bwd, sparse_attn_fwd
from .zigzag import (
    Slot,
    ZigzagPlan,
    all_gather_rows,
    check_zigzag_lengths,
    group_info,
    put_rows,
    reduce_scatter_rows,
    sequence_lengths,
    take_rows,
    zigzag_plan,
)

# ------------------------------------------------------------------------------ agreement of ranks

_META_FIELDS = (
    "version",
    "world size",
    "local input error",
    "sequences",
    "lengths hash",
    "total tokens",
    "q rows",
    "q heads",
    "kv heads",
    "head dim",
    "dtype",
    "k rows",
    "v shape",
    "layout",
    "config hash",
    "backend/kernel",
    "device type",
)
_DTYPE_CODE = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3, torch.float64: 4}


def _crc(s: str) -> int:
    return zlib.crc32(s.encode())


def _local_meta(W, lengths, q, k, v, layout, cfg, backend, kernel, error):
    def dim(t, i):
        return int(t.shape[i]) if isinstance(t, torch.Tensor) and t.dim() > i else -1

    lh = _crc(",".join(map(str, lengths))) if lengths is not None else -1
    lay = -1 if layout is None else _crc(f"{layout.q_block}:{tuple(layout.mask.shape)}")
    return [
        1,
        W,
        1 if error else 0,
        -1 if lengths is None else len(lengths),
        lh,
        -1 if lengths is None else sum(lengths),
        dim(q, 0),
        dim(q, 1),
        dim(k, 1),
        dim(q, 2),
        _DTYPE_CODE.get(getattr(q, "dtype", None), 0),
        dim(k, 0),
        _crc(str(tuple(v.shape))) if isinstance(v, torch.Tensor) else -1,
        lay,
        _crc(repr(cfg)),
        _crc(f"{backend}/{kernel}"),
        _crc(q.device.type) if isinstance(q, torch.Tensor) else -1,
    ]


def _meta_device(group, q):
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agree_across_ranks(meta: list[int], error: Exception | None, group=None) -> None:
    """All-gather a small int64 description of every rank's call and raise the same way on every
    rank when they differ or one rank's own checks failed, instead of hanging in a later collective.

    `meta` follows `_META_FIELDS`; `error` is this rank's own input error (raised on this rank, the
    others name it by rank)."""
    W, r = group_info(group)
    dev = _meta_device(group, None)
    mine = torch.tensor(meta, dtype=torch.int64, device=dev)
    allm = all_gather_rows(mine[None], group).cpu()  # [W, fields]
    bad_ranks = [w for w in range(W) if int(allm[w, 2])]
    if error is not None:
        raise error
    if bad_ranks:
        raise ValueError(
            f"context parallel: rank(s) {bad_ranks} of {W} failed their input checks (their "
            f"error names the argument); this rank {r} stops too"
        )
    diff = [(i, allm[:, i].tolist()) for i in range(allm.shape[1]) if bool((allm[:, i] != allm[0, i]).any())]
    if diff:
        names = {code: str(dt).replace("torch.", "") for dt, code in _DTYPE_CODE.items()}
        parts = "; ".join(
            f"{_META_FIELDS[i]}: {[names.get(x, x) for x in vals] if _META_FIELDS[i] == 'dtype' else vals}"
            for i, vals in diff
        )
        raise ValueError(
            f"context parallel: the {W} ranks disagree ({parts}; values by rank, hashes for "
            f"lengths/config/layout). Every rank must pass the same global cu_seqlens, config, "
            f"layout, dtype and head shapes, and a shard of total / {W} rows"
        )


# ---------------------------------------------------------------------------------- the selection


def _slot_layout(layout: BlockLayout, plan: ZigzagPlan, slot, device) -> BlockLayout:
    """The rows of a global layout that the slot's chunks own, as a per-sequence layout of the
    slot's sequences (one, or 2B with fillers that select nothing). A chunk starts on a query-block
    boundary (`zigzag_granule`)."""
    qb = layout.q_block
    m = layout.mask.to(device)
    B = len(plan.lengths)
    nqb = max(c // qb for c in slot.chunk)
    out = torch.zeros(
        (1 if B == 1 else 2 * B, m.shape[-3], nqb, m.shape[-1]), dtype=torch.bool, device=device
    )
    for b, (a, c) in enumerate(zip(slot.starts, slot.chunk)):
        mb = m[b] if layout.per_sequence else m
        out[2 * b, :, : c // qb] = mb[:, a // qb : (a + c) // qb]
    return BlockLayout(out, qb)


def _dense_layout(lengths, H, device) -> BlockLayout:
    """Every block (causality masks the future): the dense fallback below `dense_len` as a layout."""
    nb = cdiv(max(lengths), KV_BLOCK)
    return BlockLayout(torch.ones((H, nb, nb), dtype=torch.bool, device=device), KV_BLOCK)


def _select(plan: ZigzagPlan, q, k_full, cfg: InfLLMv2Config, kernels: bool) -> list:
    """Compression of the gathered keys, then stage 1 and top-k for each slot's queries (no grad): the
    prefill body's stages (`run_compress`, `run_stage1`), on the kernels or the references."""
    cu_full = torch.tensor(
        (0,) + tuple(sum(plan.lengths[: b + 1]) for b in range(len(plan.lengths))),
        dtype=torch.int32,
        device=q.device,
    )
    # gather K, then compress: every window, including those that straddle chunk boundaries, is the
    # single-GPU one bit for bit (docs/context_parallel.md §4)
    ck1, _ = run_compress(k_full, cu_full, cfg.kernel_size, cfg.kernel_stride, kernels=kernels)
    if cfg.exact_stage1:
        ck2, c2 = ck1, (cfg.kernel_size, cfg.kernel_stride)
    else:
        ck2, _ = run_compress(k_full, cu_full, cfg.coarse_kernel_size, cfg.coarse_kernel_stride,
                              kernels=kernels)
        c2 = (cfg.coarse_kernel_size, cfg.coarse_kernel_stride)
    sels = []
    for slot in plan.slots:
        cu_c1, end1 = plan.slot_compressed_cu(slot, cfg.kernel_size, cfg.kernel_stride)
        cu_c2, end2 = plan.slot_compressed_cu(slot, *c2)
        # the quirk's offset depends on the other sequences' query lengths: never here (the layer refuses it)
        sels.append(run_stage1(take_rows(q, slot.rows).contiguous(), ck1[:end1], ck2[:end2], slot.cu_q, cu_c1,
                               cu_c2, slot.max_q, cfg, causal=True, cache_lens=slot.cache_lens,
                               need_scores=False, kernels=kernels))
    return sels


# ---------------------------------------------------------------------------------------- stage 2


def _s2_fwd(q, k, v, slot, sel, scale, kernel, use_ops):
    if isinstance(sel, BlockLayout):
        if use_ops:
            return block_sparse_attn_fwd(
                q, k, v, slot.cu_q, slot.cu_k, sel.mask, sel.q_block, slot.max_q, slot.max_k, True, scale,
                kernel,
            )
        sel = sel.to_topk_idx(slot.cu_q)
    if use_ops:
        return sparse_attn_fwd(
            q, k, v, slot.cu_q, slot.cu_k, sel, slot.max_q, slot.max_k, True, scale, kernel
        )
    return naive_sparse_attn_varlen(
        q,
        k,
        v,
        slot.cu_q,
        slot.cu_k,
        sel,
        slot.max_q,
        slot.max_k,
        causal=True,
        softmax_scale=scale,
        return_lse=True,
    )


def _s2_bwd(dout, q, k, v, out, lse, slot, sel, scale, kernel, use_ops):
    if isinstance(sel, BlockLayout):
        if use_ops:
            return block_sparse_attn_bwd(
                dout, q, k, v, out, lse, slot.cu_q, slot.cu_k, sel.mask, sel.q_block, slot.max_q, slot.max_k,
                True, scale, kernel,
            )
        sel = sel.to_topk_idx(slot.cu_q)
    if use_ops:
        return sparse_attn_bwd(
            dout, q, k, v, out, lse, slot.cu_q, slot.cu_k, sel, slot.max_q, slot.max_k, True, scale, kernel
        )
    return naive_sparse_attn_varlen_bwd(
        dout, q, k, v, slot.cu_q, slot.cu_k, sel, slot.max_q, slot.max_k, True, scale
    )


def _combine_key_grads(plan: ZigzagPlan, g0: torch.Tensor, g1: torch.Tensor, dtype) -> torch.Tensor:
    """dK (or dV) of the rank's two slots, `[k_end]` rows each, as one tensor in the all-gather's
    rank-major order and `dtype`, ready for the reduce-scatter.

    Slot 1's prefix `[S_b, S_b + e1_b)` holds slot 0's (`e0_b < e1_b`); rows past a prefix belong
    to a filler sequence (B > 1) and are zeroed here rather than trusted. The overlap adds in fp32
    (or wider); rows no slot reaches stay zero."""
    acc = g1 if g1.dtype == dtype else g1.to(dtype)
    wide = torch.promote_types(dtype, torch.float32)
    s0, s1 = plan.slots
    for b, S in enumerate(plan.seq_starts[:-1]):
        e0, e1, end = S + s0.ends[b], S + s1.ends[b], min(plan.seq_starts[b + 1], s1.k_end)
        acc[e1:end] = 0
        acc[S:e0] = (g1[S:e0].to(wide) + g0[S:e0].to(wide)).to(dtype)
    out = (
        acc.new_zeros((plan.total,) + tuple(acc.shape[1:]))
        if s1.k_end < plan.total
        else acc.new_empty((plan.total,) + tuple(acc.shape[1:]))
    )
    out.index_copy_(0, plan.nat_from_gath[: s1.k_end], acc)
    return out


def _bwd_pieces(plan: ZigzagPlan, slot, sel, q, k_full) -> list:
    """`[(piece, r0, r1)]`: the slot's backward as query pieces in row order (`r0:r1` of the slot's
    rows; one piece, the slot itself, unless split). The stage-2 backward's masks and transposed
    indices grow as queries x keys (`H x tokens x keys / 2048` int32 words for the masks alone): a
    slot whose masks would outweigh half its dq is cut into pieces of whole 64-token blocks, piece `j`
    the queries `[b_j, b_j+1)` against the key prefix `[0, b_j+1)` (a chunked-prefill sequence, as
    the slot, docs/context_parallel.md §3). One sequence and the token-level selection only (the
    long-sequence case, docs/context_parallel.md §9); a layout or a batch keeps one piece."""
    whole = [(slot, 0, slot.max_q)]
    if len(plan.lengths) != 1 or not isinstance(sel, torch.Tensor):
        return whole
    H, (HQ, D) = k_full.shape[1], q.shape[1:]
    mask_bytes = H * slot.max_q * -(-slot.max_k // 2048) * 4
    dq_bytes = slot.max_q * HQ * D * q.element_size()
    p = min(slot.max_q // KV_BLOCK, bwd_piece_count(mask_bytes, dq_bytes))
    if p <= 1:
        return whole
    a, r_start, dev, units = slot.starts[0], slot.rows.start, q.device, slot.max_q // KV_BLOCK
    out = []
    for j in range(p):
        r0, r1 = j * units // p * KV_BLOCK, (j + 1) * units // p * KV_BLOCK
        e = a + r1
        piece = Slot(
            (a + r0,),
            (e,),
            (r1 - r0,),
            slice(r_start + r0, r_start + r1),
            torch.tensor([0, r1 - r0], dtype=torch.int32, device=dev),
            torch.tensor([0, e], dtype=torch.int32, device=dev),
            torch.tensor([a + r0], dtype=torch.int32, device=dev),
            r1 - r0,
            e,
            e,
        )
        out.append((piece, r0, r1))
    return out


# pieces of a slot's backward at most (each holds its own dq and K/V-length dK/dV until the end)
BWD_MAX_PIECES = 4


def bwd_piece_count(mask_bytes: int, dq_bytes: int) -> int:
    """Pieces for a slot whose backward masks take `mask_bytes` and dq `dq_bytes`: each piece's masks
    at most half its dq. At the README head config on 2 ranks that splits slots from about 1M keys
    (3 pieces of rank 0's wide slot at 2.9M tokens) and takes every slot phase below the end of the
    backward, where dq is assembled (docs/context_parallel.md §9, the table of phases)."""
    return max(1, min(BWD_MAX_PIECES, -(-2 * mask_bytes // dq_bytes)))


class _CPAttention(torch.autograd.Function):
    """The whole context-parallel layer: gathers, selection, stage 2 per slot; backward reduce-scatters."""

    @staticmethod
    def forward(
        ctx,
        q,
        k,
        v,
        plan: ZigzagPlan,
        group,
        cfg,
        layout,
        scale,
        kernel,
        use_ops,
        reduce_dtype,
        dense,
    ):
        # K first: the compression needs it. V's gather then runs on NCCL's stream while this
        # stream compresses and runs stage 1 (docs/context_parallel.md §5).
        k_full = all_gather_rows(k, group).index_select(0, plan.nat_from_gath)
        v_gath, v_work = all_gather_rows(v, group, async_op=True)
        H = k.shape[1]
        with torch.no_grad():
            if layout is not None or dense:
                lay = layout if layout is not None else _dense_layout(plan.lengths, H, q.device)
                sels = [_slot_layout(lay, plan, s, q.device) for s in plan.slots]
            else:
                sels = _select(plan, q, k_full, cfg, use_ops)
        v_work.wait()
        v_full = v_gath.index_select(0, plan.nat_from_gath)
        del v_gath
        out = torch.empty_like(q)
        lses = []
        for slot, sel in zip(plan.slots, sels):
            o, lse = _s2_fwd(
                take_rows(q, slot.rows).contiguous(),
                k_full[: slot.k_end],
                v_full[: slot.k_end],
                slot,
                sel,
                scale,
                kernel,
                use_ops,
            )
            put_rows(out, slot.rows, o)
            lses.append(lse)
        ctx.plan, ctx.group, ctx.sels, ctx.scale, ctx.kernel, ctx.use_ops = (
            plan,
            group,
            sels,
            scale,
            kernel,
            use_ops,
        )
        ctx.reduce_dtype, ctx.k_dtype = reduce_dtype, k.dtype
        # the gathered K and V are this function's own intermediates: held on ctx rather than saved,
        # so that the backward can drop them before it assembles dq (docs/context_parallel.md §9)
        ctx.kv_full = [k_full, v_full]
        ctx.save_for_backward(q, out, *lses)
        return out

    @staticmethod
    def backward(ctx, dout):
        if ctx.kv_full is None:
            raise RuntimeError(
                "cp_infllmv2_attention: its backward ran a second time (retain_graph=True); the first "
                "one frees the gathered K, V and the selections: run the forward again"
            )
        q, out, *lses = ctx.saved_tensors
        k_full, v_full = ctx.kv_full
        plan = ctx.plan
        sels, ctx.sels = list(ctx.sels), None
        # The wider slot first: slot 1 (chunk 2W-1-r) ends after slot 0 in every sequence, so its
        # backward holds the longest K/V-length fp32 dK/dV sums and the largest masks, the layer's
        # memory peak; run second, it would also hold slot 0's dq and dK/dV. A long slot runs in query
        # pieces, the wider piece first, so that its masks shrink; dq is assembled after every piece
        # (docs/context_parallel.md §9).
        acc_dtype = torch.promote_types(ctx.k_dtype, ctx.reduce_dtype)
        dq_parts, dks, dvs = [], [None, None], [None, None]
        for s in (1, 0):
            slot = plan.slots[s]
            for piece, r0, r1 in reversed(_bwd_pieces(plan, slot, sels[s], q, k_full)):
                n = piece.k_end
                rows = piece.rows
                sel = sels[s] if r0 == 0 and r1 == slot.max_q else sels[s][:, r0:r1]
                lse = lses[s] if r0 == 0 and r1 == slot.max_q else lses[s][:, r0:r1].contiguous()
                dq_p, dk_p, dv_p = _s2_bwd(
                    take_rows(dout, rows).contiguous(),
                    take_rows(q, rows).contiguous(),
                    k_full[:n],
                    v_full[:n],
                    take_rows(out, rows).contiguous(),
                    lse,
                    piece,
                    sel,
                    ctx.scale,
                    ctx.kernel,
                    ctx.use_ops,
                )
                dq_parts.append((rows, dq_p))
                if dks[s] is None:  # the slot's widest piece: its prefix holds every later one's
                    dks[s], dvs[s] = dk_p.to(acc_dtype), dv_p.to(acc_dtype)
                else:  # in k's dtype (fp32 with grad_reduce_dtype=float32), rounded once per add
                    dks[s][:n].add_(dk_p)
                    dvs[s][:n].add_(dv_p)
                del dq_p, dk_p, dv_p
            sels[s] = sel = lse = None  # the slot's selection is not held into the next phases
        ctx.kv_full = k_full = v_full = None
        dq = torch.empty_like(q)
        while dq_parts:
            rows, dq_p = dq_parts.pop()
            put_rows(dq, rows, dq_p)
            del dq_p
        rd = ctx.reduce_dtype
        # dK's reduce-scatter runs while dV is combined and permuted
        dk_g = _combine_key_grads(plan, *dks, rd)
        del dks
        dk, k_work = reduce_scatter_rows(dk_g, ctx.group, async_op=True)
        dv_g = _combine_key_grads(plan, *dvs, rd)
        del dvs
        dv = reduce_scatter_rows(dv_g, ctx.group)
        k_work.wait()
        return (dq, dk.to(ctx.k_dtype), dv.to(ctx.k_dtype)) + (None,) * 9


def cp_infllmv2_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    config: InfLLMv2Config | None = None,
    *,
    group=None,
    layout: BlockLayout | None = None,
    backend: str = "auto",
    kernel: str = "auto",
    grad_reduce_dtype: torch.dtype | None = None,
    check_ranks: bool = True,
) -> torch.Tensor:
    r"""InfLLM-v2 prefill attention with context parallelism over a process group (all-gather, zigzag).

    Every rank passes its zigzag shard (`zigzag_shard`) of the global packed `q`, `k`, `v` and the
    GLOBAL `cu_seqlens`; the result is this rank's shard of what `infllmv2_attention` gives on the
    concatenated sequences (same selection, causal limits and init / local blocks, by global
    position), differentiable in the three shards. K and V are all-gathered (V while stage 1 runs),
    the gathered K is compressed on every rank, and the backward reduce-scatters dK and dV.
    Launch with `torchrun`; NCCL for CUDA tensors, gloo for CPU tensors (the references).

    Args:
        q (torch.Tensor):
            This rank's queries `[total / W, HQ, D]`, zigzag layout.
        k, v (torch.Tensor):
            This rank's keys and values `[total / W, H, D]`, q's dtype.
        cu_seqlens (torch.Tensor):
            int32 `[B+1]` of the global sequences (identical on every rank); every length a multiple
            of `2 * W * 64` (`zigzag_granule`; `2 * W * lcm(64, layout.q_block)` with a layout).
        config (InfLLMv2Config, Optional):
            As `infllmv2_attention`; `varlen_offset_quirk` must be False (it depends on the batch's
            other sequences, which a chunk does not see). Below `dense_len`: dense causal attention.
            Default: `None` (MiniCPM4 defaults).
        group (ProcessGroup, Optional):
            Keyword-only, as every argument after it. Default: `None` (the default group).
        layout (BlockLayout, Optional):
            A static query-block layout of the GLOBAL sequences (`[H, NQB, NKB]` or
            `[B, H, NQB, NKB]`) instead of the InfLLM-v2 selection; the same on every rank.
            Default: `None`.
        backend (str, Optional):
            "auto", "kernels" or "reference", as `infllmv2_attention`. Default: "auto".
        kernel (str, Optional):
            The stage-2 `kernel` argument. Default: "auto".
        grad_reduce_dtype (torch.dtype, Optional):
            dtype of the dK / dV reduce-scatter: `None` is k's dtype (half the bytes of fp32);
            `torch.float32` sums the ranks' partial gradients without rounding them first.
            Default: `None`.
        check_ranks (bool, Optional):
            All-gather a small description of every rank's call first and raise on every rank if
            they differ or one rank's inputs are bad (one tiny collective and a host read per call).
            Default: `True`.

    Returns:
        out (torch.Tensor): `[total / W, HQ, D]`, this rank's shard, q's dtype.
    """
    cfg = check_config(config)
    check_flags(check_ranks=check_ranks)
    W, r = group_info(group)
    error, lengths, kernel_path = None, None, False
    try:
        check_backend(backend)
        check_kernel(kernel)
        if layout is not None and not isinstance(layout, BlockLayout):
            raise TypeError(f"layout must be a BlockLayout or None, got {type(layout).__name__}")
        # on every path, the references' too: not the kernels' rule (`check_kernel_block`), which
        # leaves the references any block size
        if cfg.block_size != KV_BLOCK:
            raise ValueError(
                f"config.block_size must be {KV_BLOCK} with context parallelism (the zigzag chunks are "
                f"whole {KV_BLOCK}-key blocks), got {cfg.block_size}"
            )
        if cfg.varlen_offset_quirk:
            raise ValueError(
                "config.varlen_offset_quirk=True is not supported with context parallelism (HF's "
                "offset depends on the whole batch's query lengths)"
            )
        if cfg.precision != "16bit":
            # its stage 2 runs the 16-bit ops: an 8-bit config would be ignored without a word
            raise ValueError(
                f"config.precision must be '16bit' with context parallelism, got {cfg.precision!r}: the "
                f"8-bit plan runs in one process (infllmv2_attention)"
            )
        check_tensor("q", q, ndim=3, dtypes=REF_DTYPES)
        check_tensor("k", k, ndim=3, dtypes=(q.dtype,))
        check_tensor("v", v, ndim=3, dtypes=(q.dtype,))
        if v.shape != k.shape:
            raise ValueError(f"v must have the shape of k {tuple(k.shape)}, got {tuple(v.shape)}")
        if q.shape[1] % k.shape[1] or q.shape[2] != k.shape[2]:
            raise ValueError(
                f"q {tuple(q.shape)} and k {tuple(k.shape)}: HQ must be a multiple of H and the head "
                f"dims equal"
            )
        lengths = sequence_lengths(cu_seqlens)
        check_zigzag_lengths(lengths, W, layout.q_block if layout is not None else 64)
        if q.shape[0] * W != sum(lengths) or k.shape[0] != q.shape[0]:
            raise ValueError(
                f"q has {q.shape[0]} rows and k {k.shape[0]}: each must be the rank's zigzag shard of "
                f"total / world size = {sum(lengths)} / {W} = {sum(lengths) // W} rows"
            )
        if layout is not None:
            layout.check_against(k.shape[1], len(lengths), max(lengths), max(lengths))
        if grad_reduce_dtype is not None and grad_reduce_dtype not in REF_DTYPES:
            raise ValueError(f"grad_reduce_dtype must be a float dtype or None, got {grad_reduce_dtype!r}")
        kernel_path = runs_kernels(q, backend)     # "kernels" on CPU tensors raises here
        if kernel_path:
            check_kernel_inputs(q, k, v)             # the block size: checked above, for every path
    except (ValueError, TypeError) as e:
        error = e
    if check_ranks:
        agree_across_ranks(
            _local_meta(W, lengths, q, k, v, layout, cfg, backend, kernel, error), error, group
        )
    elif error is not None:
        raise error
    plan = zigzag_plan(lengths, W, r, q.device)
    scale = check_softmax_scale(cfg.softmax_scale, q.shape[2])
    dense = layout is None and uses_dense(cfg.dense_len, max(lengths))
    use_ops = kernel_path  # the custom ops on CUDA; the references (same math as the ops' CPU kernels) else
    reduce_dtype = grad_reduce_dtype or k.dtype
    return _CPAttention.apply(
        q, k, v, plan, group, cfg, layout, scale, kernel, use_ops, reduce_dtype, dense
    )


class ContextParallelInfLLMv2(torch.nn.Module):
    r"""`cp_infllmv2_attention` as a module holding its configuration and process group (no parameters).

    Example (under `torchrun`, one process per GPU):
        >>> attn = ContextParallelInfLLMv2(InfLLMv2Config(), group=dist.group.WORLD)
        >>> q_l, k_l, v_l = (zigzag_shard(t, cu) for t in (q, k, v))
        >>> out_l = attn(q_l, k_l, v_l, cu)              # this rank's shard of the output
        >>> out = zigzag_unshard(out_l, cu)             # the whole output, on every rank
    """

    def __init__(
        self,
        config: InfLLMv2Config | None = None,
        *,
        group=None,
        backend: str = "auto",
        kernel: str = "auto",
        grad_reduce_dtype: torch.dtype | None = None,
        check_ranks: bool = True,
    ):
        super().__init__()
        self.config = check_config(config)
        self.group = group
        self.backend = check_backend(backend)
        self.kernel = check_kernel(kernel)
        check_flags(check_ranks=check_ranks)
        self.grad_reduce_dtype = grad_reduce_dtype
        self.check_ranks = check_ranks

    def forward(self, q, k, v, cu_seqlens, layout: BlockLayout | None = None):
        return cp_infllmv2_attention(
            q,
            k,
            v,
            cu_seqlens,
            self.config,
            group=self.group,
            layout=layout,
            backend=self.backend,
            kernel=self.kernel,
            grad_reduce_dtype=self.grad_reduce_dtype,
            check_ranks=self.check_ranks,
        )

    def extra_repr(self) -> str:
        return f"backend={self.backend!r}, kernel={self.kernel!r}, config={self.config}"
