"""Launchers of kernels_cu/stage2/{block_masks,sparse_fwd,sparse_fwd_sm90}.cu: block-sparse attention forward.

Both input forms reach one kernel through per-row bitmasks over 64-key blocks:
token-level `topk_idx` rows are packed on the GPU (`token_block_masks`), query-block layouts
are packed by `BlockLayout.packed` (one row per query block). Which kernel runs, and how, is the
caller's `FwdPlan` (plan.py).
"""
from __future__ import annotations

import torch

from .. import _jit
from .._checks import check_aligned, validate_values
from .._dtypes import KERNEL_DTYPES
from .._kernel_arg import SM80, SM90A
from .._launch import CXX_TYPE, empty, launch
from .._params import KernelParams, constants
from .._rules import (
    HEAD_DIMS,
    KV_BLOCK,  # keys per KV block (kernels_cu: BLOCK_N)
    cdiv,
)
from .._tma import rows_map
from .plan import (
    ALL_TILES,
    DEFAULT_TILES,
    SM90_CONSUMERS,
    SM90_STAGES,
    FwdPlan,
    qhead_instance,
    sm90_fits_keys,
    sm90_smem_bytes,
)

FWD_SOURCE = "stage2/sparse_fwd.cu"
SM90_SOURCE = "stage2/sparse_fwd_sm90.cu"
MASK_SOURCE = "stage2/block_masks.cu"
MASK_WARPS = 8          # warps per CTA of token_block_masks, one per (token, KV head)
constants(MASK_SOURCE, WARPS=MASK_WARPS)
constants(FWD_SOURCE, BLOCK_N=KV_BLOCK)
constants(SM90_SOURCE, BLOCK_N=KV_BLOCK, NC=SM90_CONSUMERS)
MASK_PARAMS = KernelParams(MASK_SOURCE, "TokenBlockMasksParams", """
    ptr topk_idx, cu_seqlens_q, cu_seqlens_k, masks
    i32 batch, total_q, K, n_words, block_size
""")
# the fields both forward structs share: after their q and K/V, before the sm_90a kernel's pass fields
_FWD_FIELDS = """
    ptr masks, mask_base, cu_seqlens_q, cu_seqlens_k, out, lse
    i32 total_q, HQ, H, G, n_words
    i64 mask_h_stride
    i32 mask_q_block
    f32 scale_log2
    i32 causal
""".strip()
FWD_PARAMS = KernelParams(FWD_SOURCE, "Stage2FwdParams<float>", f"""
    ptr q, k, v
    {_FWD_FIELDS}
    i32 kv_group
""")
SM90_PARAMS = KernelParams(SM90_SOURCE, "Stage2FwdSm90Params<float>", f"""
    ptr q
    tmap tmap_k, tmap_v
    {_FWD_FIELDS}
    i32 step_mode, blk_lo, blk_hi
    ptr cta_split
    i32 split_min, x_off, kv_group
""")
# The sm_90a kernel's step_mode (RingSteps in kernels_cu/stage2/ring_sm90.cuh; docs/stage2_fwd.md,
# 5. 64- and 128-key steps, split rings). Every plan runs STEPS_AUTO: each CTA chooses its step shape
# after its setup, so the shape is no plan field. The forced shapes are paths STEPS_AUTO takes per
# CTA, forced in every CTA for tests and A/B runs only (`stage2_fwd(..., _force_steps=...)`).
STEPS_AUTO = 1
FORCED_STEPS = {"single": 0, "pair": 2, "split": 3}
constants(SM90_SOURCE, STEPS_AUTO=STEPS_AUTO, STEPS_SINGLE=FORCED_STEPS["single"],
          STEPS_PAIR=FORCED_STEPS["pair"], STEPS_SPLIT=FORCED_STEPS["split"])


# MT = 2 spills a little under the 255-register cap (D = 128: 116 B; D = 64: 8 B), yet measures
# fastest: the CPU compile check tolerates its spills and demands none of the MT = 1 variants.
for _t in ALL_TILES:
    for _d in HEAD_DIMS:
        _jit.register_instances(FWD_SOURCE, [_t.name(dt, _d) for dt in KERNEL_DTYPES],
                                strict=_t.m_tiles == 1)
_jit.register_instances(SM90_SOURCE, [f"stage2_fwd_sm90<{CXX_TYPE[dt]}, {d}, {ns}>" for dt in KERNEL_DTYPES
                                     for d in HEAD_DIMS for ns in SM90_STAGES], sm90a=True)
# per-query-head mask rows (FwdPlan.qhead): the QH instances, SM80 with the default tiles only
# (MT = 2 spills as its KV-row twin does: not strict)
_jit.register_instances(FWD_SOURCE, [qhead_instance(DEFAULT_TILES.name(dt, d), "head")
                                     for dt in KERNEL_DTYPES for d in HEAD_DIMS], strict=False)
_jit.register_instances(SM90_SOURCE, [qhead_instance(f"stage2_fwd_sm90<{CXX_TYPE[dt]}, {d}, {ns}>", "head")
                                      for dt in KERNEL_DTYPES for d in HEAD_DIMS for ns in SM90_STAGES],
                        sm90a=True)
_jit.register_instances(MASK_SOURCE, ["token_block_masks"])


def token_block_masks(topk_idx: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                      n_words: int) -> torch.Tensor:
    """Bitmask rows `[H, total_q, n_words]` (int32 storage of uint32 bits) from `topk_idx [H, total_q, K]`.

    Bit j of row (h, t) is set iff 0 <= j < cdiv(L_k, 64) appears in `topk_idx[h, t]`.
    """
    H, total_q, K = topk_idx.shape
    masks = torch.empty((H, total_q, n_words), dtype=torch.int32, device=topk_idx.device)
    if total_q == 0 or H == 0:
        return masks
    launch(_jit.get_kernel(MASK_SOURCE, "token_block_masks"), name="token_block_masks",
           grid=(cdiv(total_q, MASK_WARPS), H), block=(32 * MASK_WARPS,),
           shared_mem=MASK_WARPS * n_words * 4,
           params=MASK_PARAMS.pack(topk_idx=topk_idx, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                   masks=masks, batch=cu_seqlens_q.numel() - 1, total_q=total_q, K=K,
                                   n_words=n_words, block_size=KV_BLOCK))
    return masks


def _step_mode(plan: FwdPlan, force_steps: str | None) -> int:
    """The sm_90a kernel's step_mode: STEPS_AUTO, or the shape `force_steps` names."""
    if force_steps is None:
        return STEPS_AUTO
    if force_steps not in FORCED_STEPS or plan.kernel != SM90A:
        raise ValueError(f"_force_steps forces one of {tuple(FORCED_STEPS)} on the sm_90a kernel, got "
                         f"{force_steps!r} with a {plan.kernel!r} plan")
    return FORCED_STEPS[force_steps]


def stage2_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
               cu_seqlens_k: torch.Tensor, masks: torch.Tensor, mask_base: torch.Tensor, mask_h_stride: int,
               mask_q_block: int, max_seqlen_q: int, causal: bool, softmax_scale: float, plan: FwdPlan,
               max_seqlen_k: int | None = None, *,
               _force_steps: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward kernel on checked, contiguous inputs, as `plan` says. Returns
    `out [total_q, HQ, D]` and `lse [HQ, total_q]` float32. `masks` is `[..., n_words]` int32; see the
    .cu header for the rows; with `plan.qhead="head"` they are per query head
    (`mask_h_stride` rows between query heads, a layout with HQ heads). An sm_90a plan runs in
    `plan.kv_passes` key-range passes over `cdiv(max_seqlen_k, 64)` blocks (default: what the mask
    rows cover), in which the CTAs whose union of blocks exceeds `plan.split_min` split.

    `_force_steps`: a test and A/B hook, not a kernel choice (no plan or op sets it): one step shape
    of the sm_90a kernel, a key of FORCED_STEPS, in every CTA instead of each CTA's own choice."""
    step_mode = _step_mode(plan, _force_steps)
    check_aligned(q=q, k=k, v=v)
    if plan.kernel == SM90A and not sm90_fits_keys(k.shape[0]):
        raise ValueError(f"an sm_90a FwdPlan needs 0 < total_k < 2**31 - {KV_BLOCK} (TMA tensor maps), got "
                         f"{k.shape[0]}; fwd_plan picks the SM80 kernel there")
    total_q, HQ, D = q.shape
    H = k.shape[1]
    G = HQ // H
    kv_group = 1
    if plan.qhead == "head":
        # one query head per CTA: the kernels see HQ heads of one query each (G = 1) and read K/V
        # head h / kv_group; the grid runs the group's heads of a row tile next to each other
        # (sparse_fwd.cu, QH = 2). One key-range pass (FwdPlan's check).
        H, G, kv_group = HQ, 1, G
    B = cu_seqlens_q.numel() - 1
    n_words = masks.shape[-1]
    out = empty((total_q, HQ, D), dtype=q.dtype, device=q.device)
    lse = empty((HQ, total_q), dtype=torch.float32, device=q.device)
    common = dict(masks=masks, mask_base=mask_base, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                  out=out, lse=lse, total_q=total_q, HQ=HQ, H=H, G=G, n_words=n_words,
                  mask_h_stride=mask_h_stride, mask_q_block=mask_q_block,
                  scale_log2=softmax_scale * 1.4426950408889634, causal=1 if causal else 0, kv_group=kv_group)
    itemsize = q.element_size()
    if plan.kernel == SM80:
        tiles = plan.tiles
        name = qhead_instance(tiles.name(q.dtype, D), plan.qhead)
        launch(_jit.get_kernel(FWD_SOURCE, name), name=name,
               grid=(cdiv(max_seqlen_q * G, tiles.rows) * kv_group, H // kv_group, B),
               block=(32 * tiles.warps,),
               shared_mem=(tiles.rows * D + 4 * KV_BLOCK * D) * itemsize + 4 * n_words,
               params=FWD_PARAMS.pack(q=q, k=k, v=v, **common))
        return out, lse
    name = qhead_instance(f"stage2_fwd_sm90<{CXX_TYPE[q.dtype]}, {D}, {plan.stages}>", plan.qhead)
    kernel = _jit.get_kernel(SM90_SOURCE, name, sm90a=True)
    smem = sm90_smem_bytes(D, plan.stages, n_words, itemsize)
    sm90 = dict(common, q=q, tmap_k=rows_map(k, KV_BLOCK), tmap_v=rows_map(v, KV_BLOCK),
                step_mode=step_mode, split_min=plan.split_min)
    n_kb = cdiv(max_seqlen_k, KV_BLOCK) if max_seqlen_k is not None else 32 * n_words
    per = cdiv(n_kb, max(1, min(plan.kv_passes, n_kb)))
    passes = cdiv(n_kb, per) if n_kb > 0 else 1
    grid = (cdiv(max_seqlen_q * G, 64 * SM90_CONSUMERS) * kv_group, H // kv_group, B)
    # zeros: CTAs past a short sequence's rows write no flag, and `split.any()` below reads them all
    split = torch.zeros(grid[::-1], dtype=torch.int32, device=q.device) if passes > 1 else None
    # where every sequence has as many queries as keys (one cu_seqlens tensor for both: no host
    # copy needed to know it), a later causal pass leaves out the leading CTAs, whose tokens all
    # precede its key range; the kernel's own test catches the rest
    same_lengths = causal and cu_seqlens_q.data_ptr() == cu_seqlens_k.data_ptr()
    for p in range(passes):
        blk_hi = (p + 1) * per if p < passes - 1 else 1 << 30
        x_off = max(0, (p * per * KV_BLOCK * G) // (64 * SM90_CONSUMERS) - 1) if same_lengths else 0
        launch(kernel, name=name, grid=(grid[0] - x_off,) + grid[1:], block=(128 * (SM90_CONSUMERS + 1),),
               shared_mem=smem, params=SM90_PARAMS.pack(**sm90, blk_lo=p * per, blk_hi=blk_hi,
                                                        cta_split=split, x_off=x_off))
        # Where host reads are allowed anyway (the cu_seqlens checks), one more tells whether
        # any CTA split: if none did (block-shared selections), the later passes are not
        # launched. Their CTAs would only read their flag and leave, yet at 128k x 2 launching
        # them cost 2% of the forward (docs/stage2_fwd.md, 6. Key-range passes).
        if (p == 0 and passes > 1 and validate_values() and not torch.cuda.is_current_stream_capturing()
                and not bool(split.any())):
            break
    return out, lse
