"""Launcher of kernels_cu/decode/select_decode.cu: stage 1 for decode (one query token per sequence) with
each sequence's compressed keys split over many CTAs, then an exact merge and the top-k. Design:
docs/decode.md ("Stage 1 for decode: the split kernels").

Three launches: `select_decode_coarse` (per range of coarse keys: max and sum of the scaled
exponentials per query head), `select_decode_fine` (per range of fine keys: merges the coarse partials
into each head's normaliser, group-summed rounded scores, max pooling of the range's blocks) and
`select_decode_topk` (per sequence and KV head: the one block a range shares with the next, padding,
forced blocks, top-K by the whole CTA). `select_topk_rows` runs the top-k launch alone on given block
scores (tests, benchmarks). The result equals the prefill stage-1 kernel's `decode_select` (same rounding
points: group sum in fp32, rounded to `score_dtype`, then pooled).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import torch

from .. import _jit
from .._checks import check_aligned, check_tensor
from .._dtypes import KERNEL_DTYPES
from .._launch import CXX_TYPE, Launches, empty
from .._params import KernelParams, constants
from .._rules import (
    COMPRESSIONS,
    HEAD_DIMS,
    KV_BLOCK,
    SMEM_PER_BLOCK,
    cdiv,
    n_windows,
    selection_slots,
    sm_count,
    softmax_scale_of,
)

SOURCE = "decode/select_decode.cu"
TILE = 64                  # compressed keys per tile
NSTAGE = 3                 # ck tiles in the cp.async ring
ROW_TILES = (1, 2, 4)      # MT: 16-row mma tiles of the query group, G <= 64
MAX_GROUP = 16 * ROW_TILES[-1]
SCORE_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}   # `kind` of stage1/select_common.cuh
KEY_TYPE = {0: "unsigned", 1: "unsigned short", 2: "unsigned short"}
TOPK_SCRATCH_BYTES = 4 * 584  # the CTA top-k's histograms and counts after the row
# threads of the top-k kernel (any multiple of 32 up to 512 works): 512 took 5.6 us against 6.7 us for
# 256 at 2048 blocks (docs/decode.md, 14. Stage 1 for decode: the split kernels)
TOPK_THREADS = 512

# Work split (docs/decode.md, "Stage 1 for decode: the split kernels"): about CTAS_PER_SM CTAs per SM
# for each score kernel, every CTA at least one 64-key tile, at most MAX_TILES tiles (the scores of a
# fine range stay in shared memory).
CTAS_PER_SM = 2
MAX_TILES = 64
# The fine and top-k launches as programmatic dependents of the launch before them (sm_90): the fine
# kernel's Q and ck1 loads overlap the coarse kernel, and two launch gaps of a graph replay shrink.
PDL = True

constants(SOURCE, SEL_TILE=TILE, SEL_NST=NSTAGE, SEL_TOPK_SCRATCH=TOPK_SCRATCH_BYTES // 4)
COARSE_PARAMS = KernelParams(SOURCE, "SelectDecodeCoarseParams<float>", """
    ptr q, ck2, seqlens
    i32 N2, H, G, T2, exact
    f32 sl2
    i32 dense_len
    ptr part
""")
FINE_PARAMS = KernelParams(SOURCE, "SelectDecodeFineParams<float>", """
    ptr q, ck1, seqlens
    i32 N1, H, G, T1, R2, exact, kind
    f32 sl2
    i32 dense_len
    ptr part, blk, lead
""")
TOPK_PARAMS = KernelParams(SOURCE, "SelectDecodeTopkParams", """
    ptr blk, lead, seqlens
    i32 B, H, T1, R1, out_len, olp, K, kout, init_blocks, local_blocks, kind, topk_prefix, dense_len
    ptr topk_idx
""")

_jit.register_instances(SOURCE, [f"select_decode_{k}<{CXX_TYPE[t]}, {d}, {mt}>" for k in ("coarse", "fine")
                                 for t in KERNEL_DTYPES for d in HEAD_DIMS for mt in ROW_TILES])
_jit.register_instances(SOURCE, [f"select_decode_topk<{kt}>" for kt in ("unsigned", "unsigned short")])


@dataclasses.dataclass(frozen=True)
class SelectDecodePlan:
    """What the stage-1 decode launches run: a pure function of shapes and the SM count
    (`plan_select_decode`), the same at every step of a captured graph.

    Attributes:
        row_tiles (int): 16-row mma tiles of the query group (G <= 16 * row_tiles); 4 warps each.
        fine_tiles (int): 64-key tiles of ck1 per CTA of the fine kernel (T1).
        fine_ranges (int): CTAs per (sequence, KV head) of the fine kernel (R1); they cover fine keys
            `[-1, 64 T1 R1 - 1)`, i.e. blocks `[0, 16 T1 R1)`.
        coarse_tiles (int): 64-key tiles of ck2 (exact mode: ck1) per CTA of the coarse kernel (T2).
        coarse_ranges (int): CTAs per (sequence, KV head) of the coarse kernel (R2).
    """
    row_tiles: int
    fine_tiles: int
    fine_ranges: int
    coarse_tiles: int
    coarse_ranges: int

    def score_smem_bytes(self, head_dim: int, fine: bool) -> int:
        """Dynamic shared memory of a score kernel (SelSmem<D, MT>::BYTES in the .cu, checked at compile
        time; the fine kernel adds its range's 64 T1 fp32 scores)."""
        rowb, mt = 2 * head_dim, self.row_tiles
        base = 16 * mt * rowb + NSTAGE * TILE * rowb + 2 * 4 * mt * 16 * 4 + 16 * mt * 4
        return base + (4 * TILE * self.fine_tiles if fine else 0)


constants(SOURCE, **{f"SelSmem<{d}, {mt}>::BYTES": SelectDecodePlan(mt, 1, 1, 1, 1).score_smem_bytes(d, False)
                     for d in HEAD_DIMS for mt in ROW_TILES})


def _ranges(n_keys: int, want: int) -> tuple[int, int]:
    """(tiles per CTA, CTAs) covering `n_keys` keys with about `want` CTAs."""
    n_tiles = max(1, cdiv(n_keys, TILE))
    per = min(MAX_TILES, max(1, cdiv(n_tiles, max(1, want))))
    return per, cdiv(n_tiles, per)


def plan_select_decode(batch: int, num_kv_heads: int, group: int, n1_max: int, n2_max: int,
                       sm_count: int) -> SelectDecodePlan:
    """The split for `batch` sequences x `num_kv_heads` whose rows hold at most `n1_max` fine and
    `n2_max` coarse windows (the cache's `ck1.shape[1]`, `ck2.shape[1]`; exact mode: both n1_max), on a
    GPU of `sm_count` SMs. The fine ranges cover keys -1 .. n1_max - 1 plus the block past the last
    key (`64 T1 R1 >= n1_max + 4`)."""
    if not 1 <= group <= MAX_GROUP:
        raise ValueError(f"the query group G = HQ / H must be in [1, {MAX_GROUP}], got {group}")
    for name, x in (("batch", batch), ("num_kv_heads", num_kv_heads), ("sm_count", sm_count)):
        if x < 1:
            raise ValueError(f"{name} must be >= 1, got {x}")
    for name, x in (("n1_max", n1_max), ("n2_max", n2_max)):
        if x < 0:
            raise ValueError(f"{name} must be >= 0, got {x}")
    mt = next(t for t in ROW_TILES if group <= 16 * t)
    want = cdiv(CTAS_PER_SM * sm_count, batch * num_kv_heads)
    t1, r1 = _ranges(n1_max + 4, want)
    t2, r2 = _ranges(n2_max, want)
    return SelectDecodePlan(mt, t1, r1, t2, r2)


def check_select_plan(plan, group: int, n1_max: int, n2_max: int, head_dim: int) -> None:
    """`plan` must fit the group, cover every window and fit a CTA's shared memory."""
    if (not isinstance(plan, SelectDecodePlan) or plan.row_tiles not in ROW_TILES
            or 16 * plan.row_tiles < group):
        raise ValueError(f"plan: {plan!r} does not fit G = {group} (row_tiles in {ROW_TILES}, 16 x row_tiles "
                         ">= G)")
    if min(plan.fine_tiles, plan.fine_ranges, plan.coarse_tiles, plan.coarse_ranges) < 1:
        raise ValueError(f"plan: every count must be >= 1, got {plan!r}")
    if TILE * plan.fine_tiles * plan.fine_ranges < n1_max + 4:
        raise ValueError(f"plan: {plan!r} covers {TILE * plan.fine_tiles * plan.fine_ranges} fine keys, the "
                         f"cache holds up to {n1_max} (+ 4 needed)")
    if TILE * plan.coarse_tiles * plan.coarse_ranges < n2_max:
        raise ValueError(f"plan: {plan!r} covers {TILE * plan.coarse_tiles * plan.coarse_ranges} coarse "
                         f"keys, the cache holds up to {n2_max}")
    if plan.score_smem_bytes(head_dim, True) > SMEM_PER_BLOCK:
        raise ValueError(f"plan: {plan!r} needs {plan.score_smem_bytes(head_dim, True)} B of shared memory")


@functools.cache
def _plan_for(B: int, H: int, G: int, N1: int, N2: int, D: int, device_index: int) -> SelectDecodePlan:
    plan = plan_select_decode(B, H, G, N1, N2, sm_count(device_index))
    check_select_plan(plan, G, N1, N2, D)
    return plan


def select_width(topk: int, local_blocks: int, out_len: int, dense_len: int = 0) -> int:
    """Slots of a `select_decode` row: `K = min(topk + local_blocks, out_len)`, widened with
    `dense_len > 0` to hold a dense step's blocks (`cdiv(dense_len - 1, 64)`, at most `out_len`)."""
    K = selection_slots(topk, local_blocks, out_len)
    return max(K, min(cdiv(max(dense_len - 1, 0), KV_BLOCK), out_len)) if dense_len > 0 else K


def select_decode(q: torch.Tensor, ck1: torch.Tensor, ck2: torch.Tensor, seqlens: torch.Tensor, out_len: int,
                  *, topk: int, local_blocks: int, init_blocks: int, softmax_scale: float | None,
                  score_dtype: torch.dtype | None, exact: bool, plan: SelectDecodePlan | None = None,
                  dense_len: int = 0) -> torch.Tensor:
    r"""Stage 1 for decode on CUDA tensors: `topk_idx int32 [H, B, select_width(...)]`.

    Args:
        q (torch.Tensor): `[B, HQ, D]` bf16/fp16, D in {64, 128}, G = HQ / H <= 64.
        ck1, ck2 (torch.Tensor): the cache's compressed keys `[B, N1, H, D]` (32/16) and `[B, N2, H, D]`
            (128/64), q's dtype, sequence b's valid windows first (`DecodeCache.ck1`, `.ck2`).
        seqlens (torch.Tensor): int32 `[B]`, the cache lengths `L_b` (the current token included):
            the windows counted from them, the query in block `(L_b - 1) // 64`.
        out_len (int): blocks of the cache's width (`cdiv(capacity, 64)`), the static row length.
        topk, local_blocks, init_blocks, softmax_scale, score_dtype, exact: as `InfLLMv2Config`
            (`score_dtype` None: fp32; `exact`: ck1 also gives the normaliser, ck2 unused).
        plan (SelectDecodePlan, Optional): Default: `plan_select_decode` for these shapes and this GPU.
        dense_len (int, Optional): > 0 decides dense or sparse on the device (spec section 9): while
            every `L_b < dense_len` the rows list blocks `0 .. cdiv(L_b, 64) - 1` (then -1), so
            `sparse_decode` over them is dense decode. Default 0: always select (K = topk +
            local_blocks slots).

    Reads nothing back from the device and allocates shapes fixed by the arguments' shapes, so it
    captures in a CUDA graph.
    """
    sdt = check_select_inputs(q, ck1, ck2, seqlens, score_dtype=score_dtype, exact=exact, dense_len=dense_len,
                              plan=plan)
    run = Launches(q.device)
    topk_idx = add_select_decode(run, q, ck1, ck2, seqlens, out_len, topk=topk, local_blocks=local_blocks,
                                 init_blocks=init_blocks, softmax_scale=softmax_scale, score_dtype=sdt,
                                 exact=exact, plan=plan, dense_len=dense_len)
    run.run()
    return topk_idx


def check_select_inputs(q, ck1, ck2, seqlens, *, score_dtype, exact: bool, dense_len: int = 0,
                        plan: SelectDecodePlan | None = None, q_checked: bool = False) -> torch.dtype:
    """`select_decode`'s checks (shapes, dtypes, devices, alignment, the plan); raises naming the argument.
    Returns the score dtype (fp32 for None). `q_checked`: the caller checked q for the decode kernels
    already (the decode step, through `sparse_decode`'s checks: dtype, contiguity, alignment, head dim,
    device), so only the other arguments are checked, against it."""
    if not q_checked:
        check_tensor("q", q, ndim=3, dtypes=KERNEL_DTYPES, contiguous=True)
    _B, HQ, D = q.shape
    check_compressed_keys(q, ck1, ck2, seqlens, exact=exact, contiguous=True)
    H = ck1.shape[2]
    # 16-byte cp.async rows
    check_aligned(**({} if q_checked else {"q": q}), ck1=ck1, **({} if exact else {"ck2": ck2}))
    if not q_checked and D not in HEAD_DIMS:
        raise ValueError(f"q: head dim {D} is not one of the kernel's {HEAD_DIMS}")
    sdt = torch.float32 if score_dtype is None else score_dtype
    if sdt not in SCORE_KIND:
        raise ValueError(f"score_dtype must be one of {tuple(SCORE_KIND)} or None, got {score_dtype!r}")
    if isinstance(dense_len, bool) or not isinstance(dense_len, int) or dense_len < 0:
        raise ValueError(f"dense_len must be an int >= 0, got {dense_len!r}")
    if not q_checked and not q.is_cuda:
        raise ValueError(f"q must be a CUDA tensor, got one on {q.device}")
    N1 = ck1.shape[1]
    N2 = N1 if exact else ck2.shape[1]
    if plan is not None:
        check_select_plan(plan, HQ // H, N1, N2, D)
    return sdt


def check_compressed_keys(q, ck1, ck2, seqlens, *, exact: bool, contiguous: bool) -> None:
    """The compressed keys `ck1 [B, N1, H, D]`, `ck2 [B, N2, H, D]` (unused with `exact`) and the lengths
    `seqlens int32 [B]` against a checked q `[B, HQ, D]`: its dtype and device, B, D, HQ a multiple of
    H. `contiguous` for the kernels; the reference takes any strides. Raises naming the argument."""
    B, HQ, D = q.shape
    check_tensor("ck1", ck1, ndim=4, dtypes=(q.dtype,), device=q.device, contiguous=contiguous)
    H = ck1.shape[2]
    if ck1.shape[0] != B or ck1.shape[3] != D:
        raise ValueError(f"ck1 must have shape [B={B}, N1, H, D={D}], got {tuple(ck1.shape)}")
    if not exact:
        check_tensor("ck2", ck2, ndim=4, dtypes=(q.dtype,), device=q.device, contiguous=contiguous)
        if ck2.shape[0] != B or ck2.shape[2:] != ck1.shape[2:]:
            raise ValueError(f"ck2 must have shape [B={B}, N2, H={H}, D={D}], got {tuple(ck2.shape)}")
    check_tensor("seqlens", seqlens, shape=(B,), dtypes=(torch.int32,), device=q.device,
                 contiguous=contiguous)
    if HQ % H:
        raise ValueError(f"q has {HQ} heads, not a multiple of ck1's {H} KV heads")


def plan_for(q_shape, ck1_shape, ck2_shape, exact: bool, device_index: int) -> SelectDecodePlan:
    """The default plan of `select_decode` for these shapes on CUDA device `device_index` (checked)."""
    B, HQ, D = q_shape
    H, N1 = ck1_shape[2], ck1_shape[1]
    return _plan_for(B, H, HQ // H, N1, N1 if exact else ck2_shape[1], D, device_index)


def scratch_floats(q_shape, num_kv_heads: int, plan: SelectDecodePlan) -> int:
    """fp32 words of `add_select_decode`'s scratch (the coarse partials, the block scores and each
    range's lead score); a multiple of 4 (16 bytes)."""
    B, HQ, _ = q_shape
    H = num_kv_heads
    n = B * H * plan.coarse_ranges * (HQ // H) * 2 + B * H * 16 * plan.fine_tiles * plan.fine_ranges
    return 4 * cdiv(n + B * H * plan.fine_ranges, 4)


def add_select_decode(run: Launches, q, ck1, ck2, seqlens, out_len: int, *, topk: int, local_blocks: int,
                      init_blocks: int, softmax_scale, score_dtype: torch.dtype, exact: bool,
                      plan: SelectDecodePlan | None = None, dense_len: int = 0,
                      topk_idx=None, scratch=None) -> torch.Tensor:
    """Adds `select_decode`'s three launches to `run` on checked inputs (`select_decode` checks them) and
    returns the `topk_idx` they write (allocated here unless given, `[H, B, select_width(...)]`).
    `scratch`: float32 of at least `scratch_floats(...)` words, 8-byte aligned (allocated here when
    None), referenced by `run`'s arguments."""
    B, HQ, D = q.shape
    H = ck1.shape[2]
    G = HQ // H
    N1 = ck1.shape[1]
    N2 = N1 if exact else ck2.shape[1]
    if plan is None:
        plan = _plan_for(B, H, G, N1, N2, D, q.device.index)
    K = selection_slots(topk, local_blocks, out_len)
    kout = select_width(topk, local_blocks, out_len, dense_len)
    dev = q.device
    if topk_idx is None:
        topk_idx = empty((H, B, kout), dtype=torch.int32, device=dev)
    if B == 0 or K <= 0:
        return topk_idx
    kind = SCORE_KIND[score_dtype]
    olp, topk_smem = _topk_row_smem(out_len, kind)
    scale = softmax_scale_of(softmax_scale, D)
    sl2 = scale * math.log2(math.e)
    T1, R1, T2, R2 = plan.fine_tiles, plan.fine_ranges, plan.coarse_tiles, plan.coarse_ranges
    # one scratch allocation (fewer allocator calls on the eager path): part float2 [B, H, R2, G] first
    # (8-byte aligned), then blk [B, H, 16 T1 R1] and lead [B, H, R1]
    n_part, n_blk, n_lead = B * H * R2 * G * 2, B * H * 16 * T1 * R1, B * H * R1
    if scratch is None:
        scratch = torch.empty(scratch_floats(q.shape, H, plan), dtype=torch.float32, device=dev)
    part, blk = scratch[:n_part], scratch[n_part:n_part + n_blk]
    lead = scratch[n_part + n_blk:n_part + n_blk + n_lead]
    mt, T = plan.row_tiles, CXX_TYPE[q.dtype]
    run.add(SOURCE, f"select_decode_coarse<{T}, {D}, {mt}>", (R2, H, B), (128 * mt,),
            plan.score_smem_bytes(D, False), COARSE_PARAMS,
            dict(q=q, ck2=ck1 if exact else ck2, seqlens=seqlens, N2=N2, H=H, G=G, T2=T2, exact=int(exact),
                 sl2=sl2, dense_len=dense_len, part=part))
    run.add(SOURCE, f"select_decode_fine<{T}, {D}, {mt}>", (R1, H, B), (128 * mt,),
            plan.score_smem_bytes(D, True), FINE_PARAMS,
            dict(q=q, ck1=ck1, seqlens=seqlens, N1=N1, H=H, G=G, T1=T1, R2=R2, exact=int(exact), kind=kind,
                 sl2=sl2, dense_len=dense_len, part=part, blk=blk, lead=lead), pdl=PDL)
    run.add(SOURCE, f"select_decode_topk<{KEY_TYPE[kind]}>", (H * B,), (TOPK_THREADS,), topk_smem,
            TOPK_PARAMS,
            dict(blk=blk, lead=lead, seqlens=seqlens, B=B, H=H, T1=T1, R1=R1, out_len=out_len, olp=olp, K=K,
                 kout=kout, init_blocks=init_blocks, local_blocks=local_blocks, kind=kind, topk_prefix=0,
                 dense_len=dense_len, topk_idx=topk_idx), pdl=PDL)
    return topk_idx


def _topk_row_smem(out_len: int, kind: int) -> tuple[int, int]:
    """(olp, dynamic shared memory of the top-k kernel): the row of olp = out_len rounded up to 64 keys,
    then the CTA top-k's scratch."""
    olp = cdiv(out_len, 64) * 64
    smem = olp * (4 if kind == 0 else 2) + TOPK_SCRATCH_BYTES
    if smem > SMEM_PER_BLOCK:
        raise ValueError(f"the cache's width ({out_len} blocks) needs {smem} B of shared memory for the "
                         f"top-k row; at most {SMEM_PER_BLOCK}")
    return olp, smem


def select_topk_rows(blk: torch.Tensor, lead: torch.Tensor, seqlens: torch.Tensor, out_len: int, *,
                     fine_tiles: int,
                     topk: int, local_blocks: int, init_blocks: int, score_dtype: torch.dtype | None,
                     topk_prefix: int = 0, threads: int = TOPK_THREADS) -> torch.Tensor:
    r"""The top-k launch alone (`select_decode_topk`) on block scores as the fine kernel leaves them: a
    test and benchmark hook. Returns `topk_idx int32 [H, B, K]`, `K = min(topk + local_blocks, out_len)`.

    Args:
        blk (torch.Tensor): float32 `[B, H, 16 T1 R1]`, block scores per range (T1 = `fine_tiles`); block
            j is read where sequence b has a fine window in it (`4 j - 1 < n1`), rounded to `score_dtype`.
        lead (torch.Tensor): float32 `[B, H, R1]`: range r's first window score, max-ed into block
            `16 T1 r - 1` (read where that window exists).
        seqlens (torch.Tensor): int32 `[B]`, the cache lengths (windows, the query's block, forced blocks).
        out_len (int): blocks per row. topk, local_blocks, init_blocks, score_dtype: as `select_decode`.
        topk_prefix (int): > 0 ends the search prefix past block `max(topk_prefix, K) - 1` (the kernel's
            test hook). threads (int): CTA size, a multiple of 32 in [32, 512] (`select_decode`: 512).
    """
    check_tensor("blk", blk, ndim=3, dtypes=(torch.float32,), contiguous=True)
    B, H, nb = blk.shape
    check_tensor("lead", lead, ndim=3, dtypes=(torch.float32,), device=blk.device, contiguous=True)
    check_tensor("seqlens", seqlens, shape=(B,), dtypes=(torch.int32,), device=blk.device, contiguous=True)
    if not isinstance(fine_tiles, int) or fine_tiles < 1 or nb % (16 * fine_tiles):
        raise ValueError(f"fine_tiles must be an int >= 1 dividing blk's {nb} blocks by 16 x fine_tiles, "
                         f"got {fine_tiles!r}")
    R1 = nb // (16 * fine_tiles)
    if lead.shape != (B, H, R1):
        raise ValueError(f"lead must have shape [B={B}, H={H}, R1={R1}], got {tuple(lead.shape)}")
    if not isinstance(out_len, int) or not 1 <= out_len <= nb:
        raise ValueError(f"out_len must be an int in [1, {nb}] (blk's blocks), got {out_len!r}")
    sdt = torch.float32 if score_dtype is None else score_dtype
    if sdt not in SCORE_KIND:
        raise ValueError(f"score_dtype must be one of {tuple(SCORE_KIND)} or None, got {score_dtype!r}")
    if not isinstance(topk_prefix, int) or topk_prefix < 0:
        raise ValueError(f"topk_prefix must be an int >= 0, got {topk_prefix!r}")
    if not isinstance(threads, int) or not 32 <= threads <= 512 or threads % 32:
        raise ValueError(f"threads must be a multiple of 32 in [32, 512], got {threads!r}")
    if not blk.is_cuda:
        raise ValueError(f"blk must be a CUDA tensor, got one on {blk.device}")
    kind = SCORE_KIND[sdt]
    olp, smem = _topk_row_smem(out_len, kind)
    K = selection_slots(topk, local_blocks, out_len)
    topk_idx = empty((H, B, K), dtype=torch.int32, device=blk.device)
    if B == 0 or H == 0 or K <= 0:
        return topk_idx
    run = Launches(blk.device)
    run.add(SOURCE, f"select_decode_topk<{KEY_TYPE[kind]}>", (H * B,), (threads,), smem, TOPK_PARAMS,
            dict(blk=blk, lead=lead, seqlens=seqlens, B=B, H=H, T1=fine_tiles, R1=R1, out_len=out_len,
                 olp=olp, K=K, kout=K, init_blocks=init_blocks, local_blocks=local_blocks, kind=kind,
                 topk_prefix=topk_prefix, dense_len=0, topk_idx=topk_idx))
    run.run()
    return topk_idx


@torch.no_grad()
def emulate_select_decode(q: torch.Tensor, ck1: torch.Tensor, ck2: torch.Tensor, seqlens: torch.Tensor,
                          out_len: int, plan: SelectDecodePlan, *, topk: int, local_blocks: int,
                          init_blocks: int,
                          softmax_scale: float | None, score_dtype: torch.dtype | None,
                          exact: bool) -> torch.Tensor:
    """The split kernels' algorithm in PyTorch (fp32, any device): per-range coarse (max, sum) partials
    merged into each head's normaliser, per-range fine scores with the one key a range's first block
    takes from the previous range, the boundary max in the top-k step. It checks the merge math on
    CPU (tests/decode/test_select_decode.py); results equal `decode_select(backend="reference")` up to
    the summation order of fp32 sums."""
    B, HQ, D = q.shape
    H = ck1.shape[2]
    G = HQ // H
    scale = softmax_scale_of(softmax_scale, D)
    sl2 = scale * math.log2(math.e)
    sdt = torch.float32 if score_dtype is None else score_dtype
    T1, R1, T2, R2 = plan.fine_tiles, plan.fine_ranges, plan.coarse_tiles, plan.coarse_ranges
    nbr = 16 * T1
    ninf = float("-inf")
    blk_all = torch.full((B, H, R1 * nbr), ninf)
    lead_all = torch.full((B, H, R1), ninf)
    for b in range(B):
        L = int(seqlens[b])
        n1 = n_windows(L, *COMPRESSIONS[0])
        n2 = n1 if exact else n_windows(L, *COMPRESSIONS[1])
        ckc = ck1 if exact else ck2
        for h in range(H):
            qg = q[b, h * G:(h + 1) * G].float()                                   # [G, D]
            # coarse kernel: one (max, sum) per range and head, log2 domain
            parts = []
            for r in range(R2):
                k0, k1_ = r * 64 * T2, min(n2, (r + 1) * 64 * T2)
                if k1_ <= k0:
                    parts.append((torch.full((G,), ninf), torch.zeros(G)))
                    continue
                x = (qg @ ckc[b, k0:k1_, h].float().T) * sl2                        # [G, n]
                m = x.amax(dim=1)
                parts.append((m, torch.exp2(x - m[:, None]).sum(dim=1)))
            M = torch.stack([p[0] for p in parts]).amax(dim=0)
            Z = sum(torch.where(p[0] == ninf, torch.zeros(G), p[1] * torch.exp2(p[0] - M)) for p in parts)
            bias = M + torch.log2(Z)
            # fine kernel: range r holds keys [64 T1 r - 1, 64 T1 (r + 1) - 1)
            blk = torch.full((R1 * nbr,), ninf)
            lead = torch.full((R1,), ninf)
            for r in range(R1):
                k0 = 64 * T1 * r - 1
                if r > 0 and k0 >= n1:
                    continue
                keys = torch.arange(k0, k0 + 64 * T1)
                ok = (keys >= 0) & (keys < n1)
                sc = torch.full((64 * T1,), ninf)
                if ok.any():
                    kv = ck1[b, keys[ok], h].float()
                    p = torch.exp2((qg @ kv.T) * sl2 - bias[:, None]).sum(dim=0)
                    sc[ok] = p.to(sdt).float() if n2 > 0 else torch.zeros_like(p)
                pooled = torch.full((nbr,), ninf)
                for jl in range(nbr):
                    hi = 4 * jl + 5 if jl + 1 < nbr else 4 * jl + 4
                    pooled[jl] = sc[4 * jl:hi].max()
                blk[r * nbr:(r + 1) * nbr] = pooled
                lead[r] = sc[0]
            blk_all[b, h], lead_all[b, h] = blk, lead
    return emulate_topk_rows(blk_all, lead_all, seqlens, out_len, fine_tiles=T1, topk=topk,
                             local_blocks=local_blocks, init_blocks=init_blocks, score_dtype=score_dtype)


def score_keys(x: torch.Tensor, score_dtype: torch.dtype) -> torch.Tensor:
    """int64 order-preserving keys of `x` rounded to `score_dtype` (stage1/select_common.cuh, `Score`):
    the kernels compare these, so -0.0 < +0.0 there."""
    bits = 32 if score_dtype == torch.float32 else 16
    view = torch.int32 if bits == 32 else torch.int16
    u = x.to(score_dtype).view(view).to(torch.int64) & ((1 << bits) - 1)
    sign = 1 << (bits - 1)
    return torch.where(u & sign != 0, ~u & ((1 << bits) - 1), u | sign)


@torch.no_grad()
def emulate_topk_rows(blk: torch.Tensor, lead: torch.Tensor, seqlens: torch.Tensor, out_len: int, *,
                      fine_tiles: int, topk: int, local_blocks: int, init_blocks: int,
                      score_dtype: torch.dtype | None) -> torch.Tensor:
    """The top-k kernel in PyTorch (CPU), `select_topk_rows`'s arguments: each row completed (the
    boundary max with the next range's lead, -inf past the last window, forced blocks), its K best keys
    (ties to the lower block) ascending, blocks past the query's own as -1. `int32 [H, B, K]`."""
    blk, lead, seqlens = blk.cpu().float(), lead.cpu().float(), seqlens.cpu()
    B, H, nb = blk.shape
    nbr = 16 * fine_tiles
    R1 = nb // nbr
    sdt = torch.float32 if score_dtype is None else score_dtype
    K = selection_slots(topk, local_blocks, out_len)
    out = torch.full((H, B, max(K, 0)), -1, dtype=torch.int32)
    j = torch.arange(out_len)
    for b in range(B):
        L = int(seqlens[b])
        n1 = n_windows(L, *COMPRESSIONS[0])
        nbv = n1 // 4 + 1 if n1 > 0 else 0
        qb = max(L - 1, 0) // KV_BLOCK
        nv = min(out_len, nbv)
        for h in range(H):
            row = torch.full((out_len,), float("-inf"))
            row[:nv] = blk[b, h, :nv]
            for jb in range(nbr - 1, nv, nbr):              # the last block of each range but the last
                rn = (jb + 1) // nbr
                if rn < R1 and rn * nbr * 4 - 1 < n1:
                    row[jb] = torch.maximum(row[jb], lead[b, h, rn])
            row[(j < init_blocks) | ((j <= qb) & (j >= qb - local_blocks))] = float("inf")
            order = torch.sort(-score_keys(row, sdt), stable=True).indices[:K]   # ties: the lower block first
            sel = torch.sort(order).values
            out[h, b] = torch.where(sel > qb, torch.full_like(sel, -1), sel).to(torch.int32)
    return out
