"""Launchers of kernels_cu/stage2/sparse_bwd.cu, sparse_bwd_sm90.cu and sparse_bwd_dq_sm90.cu:
block-sparse attention backward (dq, dk, dv).

The launches, all on torch's current stream and with no host synchronisation (docs/stage2_bwd.md §2):
`stage2_bwd_delta` (rowsum(dout * out)), `stage2_bwd_tiles` (for each KV block, the bitmask of
64-row query tiles that selected it: the transposed index dk/dv need; once or twice), dq (the
forward's walk over each query tile's blocks; on Hopper `stage2_bwd_dq_ring_sm90`, the forward's
warp-specialised K/V ring), dk/dv (one CTA per KV block over its query tiles) and, where the plan
splits block 0's queries, `stage2_bwd_dkdv_parts`. Neither gradient kernel uses float
atomics, so results are bit-identical from run to run: there is no separate deterministic mode
because the default already is one. Which kernels run, and how, is the caller's `BwdPlan` (plan.py).
"""
from __future__ import annotations

import functools

import numpy as np
import torch

from .. import _jit
from .._checks import check_aligned
from .._dtypes import KERNEL_DTYPES
from .._kernel_arg import SM80, SM90A
from .._launch import CXX_TYPE, empty, launch
from .._params import KernelParams, constants
from .._rules import (
    HEAD_DIMS,
    KV_BLOCK,  # keys per KV block (kernels_cu: BLOCK_N)
    SMEM_PER_BLOCK,
    cdiv,
    smem_limits,
)
from .._tma import TMAP_DTYPE, heads_map, rows_map
from .plan import (
    ALL_BWD_TILES,
    DEFAULT_BWD_TILES,
    GATHER_G,
    QT,
    SM90_CONSUMERS,
    SM90_STAGES,
    BwdPlan,
    BwdTiles,
    qhead_instance,
    sm80_dkdv_flushes,
    sm90_smem_bytes,
)

RING_SOURCE = "stage2/sparse_bwd_dq_sm90.cu"   # the dq kernel on the forward's K/V ring

BWD_SOURCE = "stage2/sparse_bwd.cu"
SM90_SOURCE = "stage2/sparse_bwd_sm90.cu"
TILE_WARPS = 8          # warps per CTA of stage2_bwd_delta / stage2_bwd_tiles, one row / item each
constants(BWD_SOURCE, BLOCK_N=KV_BLOCK, QT=QT, TILE_WARPS=TILE_WARPS)
# the gathering dk/dv's tiles hold 64 / G tokens, at most GATHER_MAX: G from 64 / GATHER_MAX
constants(SM90_SOURCE, BLOCK_N=KV_BLOCK, QT=QT, GATHER_MAX=64 // GATHER_G[0])
constants(RING_SOURCE, BLOCK_N=KV_BLOCK, NC=SM90_CONSUMERS)
# The sm_90a dq's step_mode (RingSteps in kernels_cu/stage2/ring_sm90.cuh; 64-key steps only): every
# plan runs DQ_STEPS_AUTO, each CTA choosing between one ring the warpgroups share and one ring each.
# The forced shapes are those paths in every CTA, for tests and A/B runs (`_force_dq_steps`).
DQ_STEPS_AUTO = 1
FORCED_DQ_STEPS = {"single": 0, "split": 3}
constants(RING_SOURCE, STEPS_AUTO=DQ_STEPS_AUTO, STEPS_SINGLE=FORCED_DQ_STEPS["single"],
          STEPS_SPLIT=FORCED_DQ_STEPS["split"])

# The kernels' parameter structs (the .cu files' Stage2Bwd*Params), field by field in their order.
# Fields the dq and dk/dv structs share: the inputs, and the row space and softmax scalars.
_INPUTS = "ptr q, k, v, dout, lse, delta, masks, mask_base, cu_seqlens_q, cu_seqlens_k"
_ROWS = """
    i32 total_q, HQ, H, G, n_words
    i64 mask_h_stride
    i32 mask_q_block
    f32 scale_log2, scale
    i32 causal
""".strip()
DELTA_PARAMS = KernelParams(BWD_SOURCE, "Stage2BwdDeltaParams<float>", """
    ptr dout, out, delta
    i32 total_q, HQ
""")
TILES_PARAMS = KernelParams(BWD_SOURCE, "Stage2BwdTilesParams", """
    ptr masks, mask_base, cu_seqlens_q, cu_seqlens_k, ut_off, ut
    i64 ut_h_stride
    i32 G, n_words
    i64 mask_h_stride
    i32 mask_q_block, causal, tile_rows
""")
DQ_PARAMS = KernelParams(BWD_SOURCE, "Stage2BwdDqParams<float>", f"""
    {_INPUTS}
    ptr dq
    {_ROWS}
    i32 kv_group
""")
DKDV_PARAMS = KernelParams(BWD_SOURCE, "Stage2BwdDkdvParams<float>", f"""
    {_INPUTS}
    ptr ut_off, ut
    i64 ut_h_stride
    ptr dk, dv
    {_ROWS}
    ptr dk32, dv32
    i32 flush, kv_group, kb0
""")
DKDV_SM90_PARAMS = KernelParams(SM90_SOURCE, "Stage2BwdDkdvSm90Params<float>", f"""
    {_INPUTS}
    ptr ut_off, ut
    i64 ut_h_stride
    ptr vt_off, vt
    i64 vt_h_stride
    ptr dk, dv, part0
    i32 n_seq, n_kb, split0, order
    tmap tmap_q, tmap_do
    i32 use_tma
    {_ROWS}
    ptr dk32, dv32
    i32 q_lo, q_hi, last_pass, pdl, kv_group
""")
DKDV_PARTS_PARAMS = KernelParams(SM90_SOURCE, "Stage2BwdDkdvPartsParams<float>", """
    ptr part0, cu_seqlens_k, dk, dv
    i32 H, split0
    f32 scale
""")
DQ_RING_PARAMS = KernelParams(RING_SOURCE, "Stage2BwdDqRingParams<float>", f"""
    ptr q, dout
    tmap tmap_k, tmap_v
    ptr lse, delta, masks, mask_base, cu_seqlens_q, cu_seqlens_k, dq
    {_ROWS}
    i32 step_mode, kv_group
""")

# dk/dv with 64-column sub-steps sits at the 255-register cap at D = 128 (16 B of spills on sm_90):
# a tuning variant, compiled by the CPU check but allowed to spill; every other instance may not.
for _dt in KERNEL_DTYPES:
    for _d in HEAD_DIMS:
        _jit.register_instances(BWD_SOURCE, [f"stage2_bwd_delta<{CXX_TYPE[_dt]}, {_d}>"])
        for _t in ALL_BWD_TILES:
            _jit.register_instances(BWD_SOURCE, [_t.dq_name(_dt, _d)])
            _jit.register_instances(BWD_SOURCE, [_t.dkdv_name(_dt, _d, f) for f in (False, True)],
                                    strict=_t.dkdv_cols != 64)
_jit.register_instances(BWD_SOURCE, ["stage2_bwd_tiles"])
_jit.register_instances(RING_SOURCE,
                        [f"stage2_bwd_dq_ring_sm90<{CXX_TYPE[dt]}, {d}, {ns}>" for dt in KERNEL_DTYPES
                                      for d in HEAD_DIMS for ns in SM90_STAGES], sm90a=True)
_jit.register_instances(SM90_SOURCE,
                        [f"stage2_bwd_dkdv_sm90<{CXX_TYPE[dt]}, {d}, {g}>" for dt in KERNEL_DTYPES
                                     for d in HEAD_DIMS for g in ("false", "true")]
                         + [f"stage2_bwd_dkdv_parts<{CXX_TYPE[dt]}, {d}>" for dt in KERNEL_DTYPES
                            for d in HEAD_DIMS],
                         sm90a=True)


# per-query-head mask rows (BwdPlan.qhead="head"): G = 1 in the row space, so fixed tiles only, and
# the SM80 kernels with the default tiles only (compile time of the CPU suite)
for _dt in KERNEL_DTYPES:
    for _d in HEAD_DIMS:
        _jit.register_instances(BWD_SOURCE, [qhead_instance(DEFAULT_BWD_TILES.dq_name(_dt, _d), "head")]
                                + [qhead_instance(DEFAULT_BWD_TILES.dkdv_name(_dt, _d, f),
                                                  "head") for f in (False, True)])
        _jit.register_instances(RING_SOURCE,
                                [qhead_instance(f"stage2_bwd_dq_ring_sm90<{CXX_TYPE[_dt]}, {_d}, {ns}>",
                                                "head")
                                 for ns in SM90_STAGES], sm90a=True)
        _jit.register_instances(SM90_SOURCE,
                                [qhead_instance(f"stage2_bwd_dkdv_sm90<{CXX_TYPE[_dt]}, {_d}, false>", "head",
                                                             group=grp) for grp in (False, True)],
                                sm90a=True)

GRID_X_MAX = 2**31 - 1    # CUDA's grid limits (x; y and z)
GRID_YZ_MAX = 65535


def dkdv_z_chunks(n_kb: int) -> list[tuple[int, int]]:
    """`(kb0, nz)` of the SM80 dk/dv launches over `n_kb` key blocks: grid.z takes at most 65535,
    so key blocks kb0 .. kb0 + nz - 1 go to one launch (kernel argument kb0), the chunks in order
    (docs/stage2_bwd.md, "Limits"). One chunk up to 4,194,240 keys: the launch that ran before."""
    return [(kb0, min(GRID_YZ_MAX, n_kb - kb0)) for kb0 in range(0, n_kb, GRID_YZ_MAX)]


def dq_smem_limit_words(D: int, plan: BwdPlan, itemsize: int = 2, smem: int = SMEM_PER_BLOCK) -> int:
    """The most mask words per row the dq instance of `plan` takes: its CTA keeps the union of its
    tokens' mask rows (one uint32 word per 32 key blocks) in shared memory next to its tiles."""
    if plan.dq == SM90A:
        return (smem - sm90_smem_bytes(D, plan.dq_stages, 0, itemsize, dq=True)) // (4 * (SM90_CONSUMERS + 1))
    return (smem - dq_smem_bytes(D, plan.tiles, 0, itemsize)) // 4


def bwd_max_keys(D: int, itemsize: int = 2, smem: int = SMEM_PER_BLOCK) -> int:
    """The longest max_seqlen_k the backward runs at head dim D: the SM80 dq with the default tiles
    (bwd_plan's dq past the sm_90a ring's shared memory) must hold a mask row's words in `smem`
    (68,681,728 keys at D = 128 in 16-bit types on an H100), and cu_seqlens are int32
    (docs/stage2_bwd.md, "Limits")."""
    words = dq_smem_limit_words(D, BwdPlan(SM80), itemsize, smem)
    return min(words * 32 * KV_BLOCK, 2**31 - 1)


def check_bwd_limits(plan: BwdPlan, *, B: int, H: int, G: int, D: int, itemsize: int, total_q: int, HQ: int,
                     max_seqlen_q: int, max_seqlen_k: int, n_words: int, smem: int = SMEM_PER_BLOCK) -> None:
    """The backward's launch limits past which a kernel would not start or would overflow its
    32-bit math, each named (docs/stage2_bwd.md, "Limits"). `H`, `G`: the row space's (HQ, 1 with
    per-query-head rows). `smem`: the device's shared memory per block (opt-in)."""
    if max_seqlen_q * G >= 2**31:
        raise ValueError("max_seqlen_q * G must be < 2**31 for the backward kernels (32-bit row indices "
                         f"within a sequence), got {max_seqlen_q} * {G}")
    if B > GRID_YZ_MAX or H > GRID_YZ_MAX:
        raise ValueError("the backward launches put (KV head, sequence) in grid.y / grid.z (<= "
                         f"{GRID_YZ_MAX}): got {H} heads, {B} sequences")
    words_max = dq_smem_limit_words(D, plan, itemsize, smem)
    if n_words > words_max:
        raise ValueError(
            f"max_seqlen_k too long for the backward's dq: its CTA keeps the union of its mask rows "
            f"({n_words} uint32 words, one per 32 key blocks) in shared memory, and the {plan.dq} dq at D = "
            f"{D} holds at most {words_max} words ({words_max * 32 * KV_BLOCK} keys) in {smem} B; got "
            "max_seqlen_k = "
            f"{max_seqlen_k}" + ("; the SM80 dq (BwdPlan.dq='sm80') holds more" if plan.dq == SM90A else ""))
    n_kb = cdiv(max_seqlen_k, KV_BLOCK)
    if plan.kernel == SM90A and H * B * (plan.block0_parts + n_kb - 1) > GRID_X_MAX:
        raise ValueError(f"the sm_90a dk/dv grid (one CTA per (KV head, sequence, key block)) must be <= "
                         f"{GRID_X_MAX}: got H * B * (block0_parts + n_kb - 1) = {H} * {B} * "
                         f"({plan.block0_parts} + {n_kb} - 1)")
    tile_rows = G if plan.kernel == SM90A and plan.dkdv != "tiles" else QT   # the finest index built
    max_groups = cdiv(cdiv(max_seqlen_q * G, tile_rows), 32)
    if cdiv(max_groups * n_words, TILE_WARPS) > GRID_X_MAX or cdiv(total_q * HQ, 8) > GRID_X_MAX:
        raise ValueError(f"the transposed index's grid (one warp per 32 query tiles x mask word) or delta's "
                         f"(one warp per query row) exceeds {GRID_X_MAX} CTAs: {max_groups} x {n_words} "
                         f"words, {total_q} x {HQ} rows")


def dq_smem_bytes(D: int, tiles: BwdTiles, n_words: int, itemsize: int = 2) -> int:
    return (2 * 16 * tiles.dq_warps * D + 4 * KV_BLOCK * D) * itemsize + 4 * n_words


def dkdv_smem_bytes(D: int, itemsize: int = 2) -> int:
    return (2 * KV_BLOCK * D + 4 * QT * D) * itemsize + 2 * 3 * QT * 4


def dkdv_sm90_smem_bytes(D: int, itemsize: int = 2) -> int:
    # 1 KB alignment slack for the swizzled tiles + six 64 x D tiles + the row info
    return 1024 + 6 * 64 * D * itemsize + 2 * 3 * QT * 4


@functools.cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """One extra stream per device, for the second dk/dv instance of `dkdv="auto"`."""
    return torch.cuda.Stream(device=device)


def tile_index(cu_seqlens_q: torch.Tensor, G: int, max_seqlen_k: int, total_q: int, tile_rows: int = QT
               ) -> tuple[torch.Tensor, int]:
    """Offsets `ut_off` int64 `[B+1]` of each sequence's transposed index (in uint32 words, per KV
    head) over tiles of `tile_rows` flattened rows, and the per-head allocation, an upper bound
    computed on the host from sizes alone (no sync)."""
    B = cu_seqlens_q.numel() - 1
    nkb = cdiv(max_seqlen_k, KV_BLOCK)
    lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).to(torch.int64)
    bits = tile_rows * 32
    groups = (lens * G + bits - 1) // bits
    ut_off = torch.zeros(B + 1, dtype=torch.int64, device=cu_seqlens_q.device)
    ut_off[1:] = torch.cumsum(groups, 0) * nkb
    # sum_b cdiv(L_b G, bits) <= total_q G / bits + B
    per_head = max(1, nkb * (total_q * G // bits + B))
    return ut_off, per_head


def _check_plan(plan: BwdPlan, G: int, total_k: int) -> None:
    """The shape rules a plan built by hand may break (bwd_plan keeps them)."""
    if plan.dkdv != "tiles" and plan.kernel == SM90A and not GATHER_G[0] <= G <= GATHER_G[1]:
        raise ValueError(f"BwdPlan.dkdv={plan.dkdv!r} gathers tokens, which needs {GATHER_G[0]} <= G <= "
                         f"{GATHER_G[1]}; got G = {G} (use 'tiles')")
    if plan.kernel == SM90A and plan.dkdv_tma and 64 % G:
        raise ValueError("BwdPlan.dkdv_tma loads fixed tiles by TMA boxes of 64 / G tokens: G must divide "
                         f"64, got G = {G}")
    if plan.dq == SM90A and total_k >= 2**31 - KV_BLOCK:
        raise ValueError("the sm_90a dq reads K/V by TMA (int32 rows): total_k must be < 2**31 - "
                         f"{KV_BLOCK}, got {total_k}; bwd_plan picks the SM80 dq there")


def _dq_step_mode(force: str | None) -> int:
    """The sm_90a dq's step_mode: DQ_STEPS_AUTO, or the shape `force` names."""
    if force is None:
        return DQ_STEPS_AUTO
    if force not in FORCED_DQ_STEPS:
        raise ValueError(f"_force_dq_steps forces one of {tuple(FORCED_DQ_STEPS)}, got {force!r}")
    return FORCED_DQ_STEPS[force]


def stage2_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
               lse: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, masks: torch.Tensor,
               mask_base: torch.Tensor, mask_h_stride: int, mask_q_block: int, max_seqlen_q: int,
               max_seqlen_k: int, causal: bool, softmax_scale: float, plan: BwdPlan, *, _pdl: bool = True,
               _force_dq_steps: str | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of `stage2_fwd` (same mask arguments) on checked, contiguous CUDA inputs, as
    `plan` says.

    `dout`, `out` `[total_q, HQ, D]`, `lse` float32 `[HQ, total_q]` from the forward. Returns
    `dq [total_q, HQ, D]`, `dk, dv [total_k, H, D]` in q's dtype. Uses no float atomics: the result
    is bit-identical from run to run. With `plan.qhead="head"` the mask rows are per query head (a
    layout with HQ heads, `mask_h_stride` rows between query heads; docs/stage2_bwd.md,
    "Per-query-head mask rows").

    The sm_90a dk/dv's query-range passes after the first launch as programmatic dependents of the
    one before. `_pdl`: a test and A/B hook, not a kernel choice (no plan or op sets it): False
    launches them one after the other, which the tests compare the dependent launches against.
    `_force_dq_steps`: the other test and A/B hook, a key of FORCED_DQ_STEPS: the sm_90a dq's step
    shape in every CTA instead of each CTA's own choice.
    """
    check_aligned(dout=dout, q=q, k=k, v=v, out=out)
    total_q, HQ, D = q.shape
    total_k, H, _ = k.shape
    G = HQ // H
    kv_group = 1
    if plan.qhead == "head":
        # one query head per CTA and per dk/dv row set: every kernel sees HQ heads of one query each
        # (G = 1, so the transposed index and the CTA walks are the expanded path's) and reads K/V
        # head h / kv_group; dk, dv are per-query-head partials, summed over the group at the end
        H, G, kv_group = HQ, 1, G
    _check_plan(plan, G, total_k)
    # dkdv_group: dk/dv CTAs per KV head, sums of the group's query heads made in the kernel
    H_out = HQ // kv_group if plan.dkdv_group else H
    B = cu_seqlens_q.numel() - 1
    n_words = masks.shape[-1]
    dev = q.device
    check_bwd_limits(plan, B=B, H=H, G=G, D=D, itemsize=q.element_size(), total_q=total_q, HQ=HQ,
                     max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, n_words=n_words,
                     smem=smem_limits(dev.index)[0])
    dout, out, lse = dout.contiguous(), out.contiguous(), lse.contiguous()
    dq = empty((total_q, HQ, D), dtype=q.dtype, device=dev)
    dk = empty((total_k, H_out, D), dtype=k.dtype, device=dev)
    dv = empty((total_k, H_out, D), dtype=v.dtype, device=dev)
    if total_q == 0 or total_k == 0:
        return dq.zero_(), torch.zeros_like(k), torch.zeros_like(v)
    T = CXX_TYPE[q.dtype]
    itemsize = q.element_size()

    delta = torch.empty((HQ, total_q), dtype=torch.float32, device=dev)
    name = f"stage2_bwd_delta<{T}, {D}>"
    launch(_jit.get_kernel(BWD_SOURCE, name), name=name, grid=(cdiv(total_q * HQ, TILE_WARPS),),
           block=(32 * TILE_WARPS,),
           params=DELTA_PARAMS.pack(dout=dout, out=out, delta=delta, total_q=total_q, HQ=HQ))

    sm90a = plan.kernel == SM90A
    gather, split = sm90a and plan.dkdv == "gather", sm90a and plan.dkdv == "auto"

    def build_index(tile_rows: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The transposed selection over units of `tile_rows` rows (64: fixed tiles, G: tokens)."""
        ut_off, per_head = tile_index(cu_seqlens_q, G, max_seqlen_k, total_q, tile_rows)
        ut = torch.empty(H * per_head, dtype=torch.int32, device=dev)
        max_groups = cdiv(cdiv(max_seqlen_q * G, tile_rows), 32)
        launch(_jit.get_kernel(BWD_SOURCE, "stage2_bwd_tiles"), name="stage2_bwd_tiles",
               grid=(cdiv(max_groups * n_words, TILE_WARPS), H, B), block=(32 * TILE_WARPS,),
               params=TILES_PARAMS.pack(masks=masks, mask_base=mask_base, cu_seqlens_q=cu_seqlens_q,
                                        cu_seqlens_k=cu_seqlens_k, ut_off=ut_off, ut=ut, ut_h_stride=per_head,
                                        G=G, n_words=n_words, mask_h_stride=mask_h_stride,
                                        mask_q_block=mask_q_block, causal=int(causal), tile_rows=tile_rows))
        return ut_off, ut, per_head

    by_tiles = None if gather else build_index(QT)
    by_tokens = build_index(G) if gather or split else None

    # the fields the dq and dk/dv structs share (kv_group: read only by the QH = 2, 3 instances)
    inputs = dict(q=q, k=k, v=v, dout=dout, lse=lse, delta=delta, masks=masks, mask_base=mask_base,
                  cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    rows = dict(total_q=total_q, HQ=HQ, H=H, G=G, n_words=n_words, mask_h_stride=mask_h_stride,
                mask_q_block=mask_q_block, scale_log2=softmax_scale * 1.4426950408889634, scale=softmax_scale,
                causal=int(causal), kv_group=kv_group)
    if plan.dq == SM90A:
        # dq on the forward's warp-specialised K/V ring (TMA producer, two consumer warpgroups)
        ns = plan.dq_stages
        dq_name, dq_rows, dq_threads = qhead_instance(f"stage2_bwd_dq_ring_sm90<{T}, {D}, {ns}>",
                                                      plan.qhead), \
            64 * SM90_CONSUMERS, 128 * (SM90_CONSUMERS + 1)
        dq_kernel = _jit.get_kernel(RING_SOURCE, dq_name, sm90a=True)
        dq_smem = sm90_smem_bytes(D, ns, n_words, itemsize, dq=True)
        # K and V come as tensor maps
        ring_inputs = {n: x for n, x in inputs.items() if n not in ("k", "v")}
        dq_params = DQ_RING_PARAMS.pack(**ring_inputs, tmap_k=rows_map(k, KV_BLOCK),
                                        tmap_v=rows_map(v, KV_BLOCK), dq=dq, **rows,
                                        step_mode=_dq_step_mode(_force_dq_steps))
    else:
        dq_name, dq_rows, dq_threads = qhead_instance(plan.tiles.dq_name(q.dtype, D), plan.qhead), \
            16 * plan.tiles.dq_warps, 32 * plan.tiles.dq_warps
        dq_kernel = _jit.get_kernel(BWD_SOURCE, dq_name)
        dq_smem = dq_smem_bytes(D, plan.tiles, n_words, itemsize)
        dq_params = DQ_PARAMS.pack(**inputs, dq=dq, **rows)
    if sm90a:
        kv_smem = dkdv_sm90_smem_bytes(D, itemsize)
        # (gather mode, own index, the other mode's index or None): dkdv="auto" runs both instances
        if split:
            runs = [(False, by_tiles, by_tokens), (True, by_tokens, by_tiles)]
        else:
            runs = [(True, by_tokens, None)] if gather else [(False, by_tiles, None)]
        kv_launches = [(qhead_instance(f"stage2_bwd_dkdv_sm90<{T}, {D}, {'true' if g else 'false'}>",
                                       plan.qhead, group=plan.dkdv_group), True,
                        dict(ut_off=own[0], ut=own[1], ut_h_stride=own[2],
                             vt_off=other[0] if other else None, vt=other[1] if other else None,
                             vt_h_stride=other[2] if other else 0),
                        g)
                       for g, own, other in runs]
    else:
        kv_smem = dkdv_smem_bytes(D, itemsize)
        # two-level sums where some CTA may sum more than plan.dkdv_flush tiles (docs/stage2_bwd.md,
        # 12. SM80 path): fp32 rows each CTA stores before it reads them, so no zero fill
        flush = sm80_dkdv_flushes(max_seqlen_q, G, plan.dkdv_flush)
        flush_rows = tuple(empty((total_k, H, D), dtype=torch.float32, device=dev) for _ in range(2 * flush))
        flush_fields = (dict(dk32=flush_rows[0], dv32=flush_rows[1], flush=plan.dkdv_flush) if flush
                        else dict(dk32=None, dv32=None, flush=0))
        kv_launches = [(qhead_instance(plan.tiles.dkdv_name(q.dtype, D, flush), plan.qhead), False,
                        dict(ut_off=by_tiles[0], ut=by_tiles[1], ut_h_stride=by_tiles[2]), False)]
    # QH = 2: (row tile, head of the group) in x, heads fastest, KV head in y (the forward's grid)
    launch(dq_kernel, name=dq_name, grid=(cdiv(max_seqlen_q * G, dq_rows) * kv_group, H // kv_group, B),
           block=(dq_threads,),
           shared_mem=dq_smem, params=dq_params)
    n_kb = cdiv(max_seqlen_k, KV_BLOCK)
    passes = max(1, min(plan.dkdv_passes, max_seqlen_q)) if sm90a else 1   # a pass has at least one token
    split0 = plan.block0_parts if sm90a else 1
    chunk = cdiv(max_seqlen_q, passes)
    dk32 = torch.zeros((total_k, H_out, D), dtype=torch.float32, device=dev) if passes > 1 else None
    dv32 = torch.zeros((total_k, H_out, D), dtype=torch.float32, device=dev) if passes > 1 else None
    part0 = torch.empty(H * B * split0 * 2 * KV_BLOCK * D if split0 > 1 else 0, dtype=torch.float32,
                        device=dev)

    # fixed tiles of 64 / G tokens x G heads come by TMA (boxes of heads_map) where G divides 64
    dkdv_tma = sm90a and plan.dkdv_tma
    no_map = np.zeros(1, dtype=TMAP_DTYPE)
    tmaps = (dict(tmap_q=heads_map(q, G), tmap_do=heads_map(dout, G)) if dkdv_tma
             else dict(tmap_q=no_map, tmap_do=no_map))
    pdl = _pdl and passes > 1           # programmatic dependent launches: passes after the first

    def launch_dkdv(kv_name: str, sm90a: bool, index_fields: dict, gather: bool) -> None:
        if sm90a:
            # block 0's parts and the CTA order of the launch contract (sparse_bwd_sm90.cu): (sequence,
            # head) slowest for fixed tiles, key block slowest for gathered tokens (docs/stage2_bwd.md,
            # 9. CTA order)
            kernel = _jit.get_kernel(SM90_SOURCE, kv_name, sm90a=True)
            fields = dict(inputs, **index_fields, dk=dk, dv=dv, part0=part0, n_seq=B, n_kb=n_kb,
                          split0=split0, order=int(not gather), **tmaps, use_tma=int(dkdv_tma), **rows,
                          pdl=int(pdl))
            for p in range(passes):         # the query-range passes of the launch contract, in order
                pass_fields = (dict(dk32=dk32, dv32=dv32, q_lo=p * chunk, q_hi=(p + 1) * chunk,
                                    last_pass=int(p == passes - 1)) if passes > 1
                               else dict(dk32=None, dv32=None, q_lo=0, q_hi=max_seqlen_q, last_pass=1))
                launch(kernel, name=kv_name, grid=(H_out * B * (split0 + n_kb - 1),), block=(128,),
                       shared_mem=kv_smem, params=DKDV_SM90_PARAMS.pack(**fields, **pass_fields),
                       pdl=pdl and p > 0)
        else:
            kernel = _jit.get_kernel(BWD_SOURCE, kv_name)
            fields = dict(inputs, **index_fields, dk=dk, dv=dv, **rows, **flush_fields)
            for kb0, nz in dkdv_z_chunks(n_kb):     # grid.z <= 65535: key blocks in chunks, in order
                launch(kernel, name=kv_name, grid=(H, B, nz), block=(128,), shared_mem=kv_smem,
                       params=DKDV_PARAMS.pack(**fields, kb0=kb0))

    if len(kv_launches) == 2:
        # the two halves of dkdv="auto" run side by side: one after the other, the first one's
        # heaviest block (block 0, selected by every token) would run alone at its end. The side
        # stream forks from and joins back into the current one, so every later use of these
        # tensors (and of the memory they free) is ordered after both kernels.
        main = torch.cuda.current_stream(dev)
        side = _side_stream(dev)
        side.wait_stream(main)
        launch_dkdv(*kv_launches[0])
        with torch.cuda.stream(side):
            launch_dkdv(*kv_launches[1])
        main.wait_stream(side)
    else:
        launch_dkdv(*kv_launches[0])
    if split0 > 1:
        name = f"stage2_bwd_dkdv_parts<{T}, {D}>"
        launch(_jit.get_kernel(SM90_SOURCE, name, sm90a=True), name=name, grid=(H * B,), block=(256,),
               params=DKDV_PARTS_PARAMS.pack(part0=part0, cu_seqlens_k=cu_seqlens_k, dk=dk, dv=dv, H=H,
                                             split0=split0, scale=softmax_scale))
    if kv_group > 1 and not plan.dkdv_group:
        # the per-query-head partials summed over each group in fp32, as the expanded path (K/V
        # repeated to HQ heads) sums its dK, dV: the same numbers
        dk = dk.view(total_k, HQ // kv_group, kv_group, D).sum(2, dtype=torch.float32).to(k.dtype)
        dv = dv.view(total_k, HQ // kv_group, kv_group, D).sum(2, dtype=torch.float32).to(v.dtype)
    return dq, dk, dv
