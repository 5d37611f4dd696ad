"""Launcher of kernels_cu/decode/sparse_decode.cu: split-KV decode attention over the selected (or all)
64-key blocks of a KV cache, with LSE and optional attention weights. Design: docs/decode.md.

`add_sparse_decode` adds the launches to a decode step's `Launches` (decode/step.py, where the public
`sparse_decode` and `infllmv2_decode` run them); `plan_decode` is the split plan, `check_plan` and
`check_decode_kernel_inputs` the kernels' requirements."""
from __future__ import annotations

import dataclasses
import math

import torch

from .. import _jit
from .._checks import check_int_args, check_tensor
from .._dtypes import KERNEL_DTYPES
from .._launch import CXX_TYPE, Launches, empty
from .._params import KernelParams, constants
from .._rules import HEAD_DIMS, KV_BLOCK, SMEM_PER_BLOCK, cdiv
from .fp8 import E4M3, RECENT, check_verified

SOURCE = "decode/sparse_decode.cu"
WCHUNK = 1024          # positions per CTA of the weights pass
ROW_TILES = (1, 2, 4)  # MT: 16-row tiles of the query group, so G <= 64
MAX_GROUP = 16 * ROW_TILES[-1]
WEIGHTS = ("per_head", "per_kv_head")
PMAX_GROUP = 16        # keys per recorded max of the relative probabilities (a warp's key quarter of a block)

# Split planning (docs/decode.md, 4. Splits and the merge): at most CTAS_PER_SM CTAs per SM, in one
# wave (one per SM measured 1.05-1.18x faster than two on the H100 for dense decode and for sparse
# decode at batch 1, and even at batch >= 8 sparse), each split at least MIN_BLOCKS_PER_SPLIT blocks
# so its load of block i + 1 overlaps the math on block i.
CTAS_PER_SM = 1
MIN_BLOCKS_PER_SPLIT = 1
MAX_SPLITS = 256
# The merge (docs/decode.md, 4. Splits and the merge): thread groups of D / 4 threads (16-byte loads),
# each about MERGE_SPLITS_PER_GROUP splits, at most 1024 threads per CTA.
MERGE_SPLITS_PER_GROUP = 4
MERGE_MAX_THREADS = 1024

constants(SOURCE, BLK=KV_BLOCK, WCHUNK=WCHUNK)
KV8_TYPE = "fp8_e4m3"    # the FP8 cache's storage element in the .cu (one e4m3 byte)


def split_name(dtype: torch.dtype, head_dim: int, row_tiles: int, kv8: bool = False) -> str:
    """The split kernel's instance: `sparse_decode_split<T, D, MT>`, or with `kv8` the FP8 cache's
    `sparse_decode_split<T, D, MT, fp8_e4m3>`."""
    tail = f", {KV8_TYPE}" if kv8 else ""
    return f"sparse_decode_split<{CXX_TYPE[dtype]}, {head_dim}, {row_tiles}{tail}>"


def fp8_stage_bytes(head_dim: int) -> int:
    """Bytes of one FP8 staging stage (Fp8Stage<D> in the .cu): e4m3 K and V blocks, K's head_dim
    channel scales, V's 64 row scales."""
    return 2 * KV_BLOCK * head_dim + 4 * head_dim + 4 * KV_BLOCK
SPLIT_PARAMS = KernelParams(SOURCE, "SparseDecodeSplitParams<float>", """
    ptr q, k, v, seqlens, block_table
    i32 max_pages, page_size, seq_rows
    ptr topk
    i32 K, B, H, G, per_split
    f32 scale_log2
    ptr o_part, lse_part, prel, pmax
    i32 W
    ptr out, lse_out, lse2_out
    ptr k_scale, v_scale, k_recent, v_open
""")
MERGE_PARAMS = KernelParams(SOURCE, "SparseDecodeMergeParams<float>", """
    ptr o_part, lse_part
    i32 S
    ptr out, lse_out, lse2_out
""")
WEIGHTS_PARAMS = KernelParams(SOURCE, "SparseDecodeWeightsParams", """
    ptr prel, pmax, lse2, seqlens, topk
    i32 K, B, H, G, W, per_kv_head
    ptr out
""")

_jit.register_instances(SOURCE, [f"sparse_decode_split<{CXX_TYPE[t]}, {d}, {mt}>"
                                 for t in KERNEL_DTYPES for d in HEAD_DIMS for mt in ROW_TILES])
# the FP8 cache's instances (docs/decode.md §16): compiled by the CPU suite, launched only once
# `fp8.VERIFIED_ON_HARDWARE` (their GPU tests passed on a GPU). At D = 128 with 2 and 4 row tiles they
# spill 4-12 bytes under the 128 registers of their residency (not strict until tuned on hardware).
_KV8_SPILLS = {(128, 2), (128, 4)}
_jit.register_instances(SOURCE, [split_name(t, d, mt, True) for t in KERNEL_DTYPES for d in HEAD_DIMS
                                 for mt in ROW_TILES if (d, mt) not in _KV8_SPILLS])
_jit.register_instances(SOURCE, [split_name(t, d, mt, True) for t in KERNEL_DTYPES for d in HEAD_DIMS
                                 for mt in ROW_TILES if (d, mt) in _KV8_SPILLS], strict=False)
_jit.register_instances(SOURCE,
                        [f"sparse_decode_merge<{CXX_TYPE[t]}, {d}>" for t in KERNEL_DTYPES
                         for d in HEAD_DIMS])
_jit.register_instances(SOURCE, ["sparse_decode_weights"])


def kv_stages(head_dim: int) -> int:
    """K/V blocks in shared memory per CTA (KVLayout<D>::NSTAGE in the .cu, checked at compile time)."""
    return 2


@dataclasses.dataclass(frozen=True)
class DecodePlan:
    """What the decode launch runs: a pure function of shapes and the SM count (`plan_decode`).

    Attributes:
        row_tiles (int): 16-row mma tiles of the query group (G <= 16 * row_tiles); 4 warps each.
        num_splits (int): CTAs per (sequence, KV head) along the block list; merged by LSE.
        per_split (int): topk entries (sparse) or blocks (dense) each split takes.
        merge_groups (int): thread groups of the merge over the splits (a power of two, D / 4 threads
            each, 32 to 1024 threads in all); 0 = `default_merge_groups`.
        pdl (bool): under CUDA-graph capture on sm_90, launch the merge and the weights pass as
            programmatic dependents of the kernel before them (their launch overlaps its tail).
    """
    row_tiles: int
    num_splits: int
    per_split: int
    _: dataclasses.KW_ONLY
    merge_groups: int = 0
    pdl: bool = True

    def merge_threads(self, head_dim: int) -> int:
        """Threads per CTA of the merge: merge_groups (or its default) groups of head_dim / 4."""
        groups = self.merge_groups or default_merge_groups(self.num_splits, head_dim)
        return groups * (head_dim // 4)

    def split_smem_bytes(self, head_dim: int, sparse: bool, k: int = 0, *, kv8: bool = False) -> int:
        """Dynamic shared memory of the split kernel (SplitSmem<D, MT, KV8> in the .cu, whose LIST offset
        is checked at compile time): Q, two K/V stages, row stats, warp counts, (`kv8`: the FP8 cache)
        the e4m3 staging stages, then (sparse) the split's block list and the first k topk entries."""
        rowb = 2 * head_dim
        mt = self.row_tiles
        return (16 * mt * rowb + kv_stages(head_dim) * 2 * KV_BLOCK * rowb + 2 * mt * 4 * 16 * 4 + 4 * mt * 4
                + (kv_stages(head_dim) * fp8_stage_bytes(head_dim) if kv8 else 0)
                + (4 * (self.per_split + k) if sparse else 0))


constants(SOURCE, **{f"KVLayout<{d}>::NSTAGE": kv_stages(d) for d in HEAD_DIMS},
          **{f"SplitSmem<{d}, {mt}>::LIST": DecodePlan(mt, 1, 1).split_smem_bytes(d, False)
             for d in HEAD_DIMS for mt in ROW_TILES},
          **{f"SplitSmem<{d}, {mt}, true>::LIST": DecodePlan(mt, 1, 1).split_smem_bytes(d, False, kv8=True)
             for d in HEAD_DIMS for mt in ROW_TILES},
          **{f"Fp8Stage<{d}>::BYTES": fp8_stage_bytes(d) for d in HEAD_DIMS})


def default_merge_groups(num_splits: int, head_dim: int) -> int:
    """About MERGE_SPLITS_PER_GROUP splits per thread group, rounded to a power of two, within
    [32, MERGE_MAX_THREADS] threads (a warp at least: the merge reduces with full-warp shuffles)."""
    dv = head_dim // 4
    want = 1 << max(0, math.ceil(math.log2(cdiv(num_splits, MERGE_SPLITS_PER_GROUP))))
    return min(max(want, cdiv(32, dv)), MERGE_MAX_THREADS // dv)


def plan_decode(batch: int, num_kv_heads: int, group: int, n_entries: int, sm_count: int) -> DecodePlan:
    """The launch plan for `batch` sequences x `num_kv_heads` with `n_entries` topk entries per row
    (sparse) or blocks of the cache's width (dense), on a GPU of `sm_count` SMs."""
    check_int_args(1, batch=batch, num_kv_heads=num_kv_heads, group=group, sm_count=sm_count)
    check_int_args(0, n_entries=n_entries)
    if not 1 <= group <= MAX_GROUP:
        raise ValueError(f"the query group G = HQ / H must be in [1, {MAX_GROUP}], got {group}")
    mt = next(t for t in ROW_TILES if group <= 16 * t)
    n_entries = max(1, n_entries)
    # the most splits whose CTAs fit one wave (a partial second wave costs more than fewer splits)
    want = CTAS_PER_SM * sm_count // max(1, batch * num_kv_heads)
    splits = max(1, min(want, cdiv(n_entries, MIN_BLOCKS_PER_SPLIT), MAX_SPLITS))
    per = cdiv(n_entries, splits)
    return DecodePlan(mt, cdiv(n_entries, per), per)


def scratch_floats(q_shape, num_kv_heads: int, width: int, plan: DecodePlan,
                   return_attn_weights: bool) -> int:
    """fp32 words of `add_sparse_decode`'s scratch: the merge's partials (none with one split), the
    weights' fp16 probabilities and maxima, the log2 LSE; a multiple of 4 (16 bytes)."""
    B, HQ, D = q_shape
    S = plan.num_splits
    n_o, n_l = (0, 0) if S == 1 else (B * HQ * S * D, B * HQ * S)
    n_p, n_m = (weights_scratch_floats(B, num_kv_heads, HQ // num_kv_heads, width) if return_attn_weights
                else (0, 0))
    return 4 * cdiv(n_o + n_p + n_m + n_l + B * HQ, 4)


def add_sparse_decode(run: Launches, q, k, v, seqlens, bt, width: int, topk_idx, *, scale: float,
                      plan: DecodePlan, return_attn_weights: bool = False, weights: str = "per_head",
                      out=None, lse=None, w_out=None, scratch=None, kv8=None):
    """Adds `sparse_decode`'s launches (split, merge unless one split, weights pass) to `run` on checked
    inputs and a checked plan, and returns `(out, lse, weights or None)` they write (allocated here
    unless given). `scratch`: float32 of at least `scratch_floats(...)` words, 16-byte aligned
    (allocated here when None), referenced by `run`'s arguments. `kv8`: an FP8 cache's `(k_scale,
    v_scale, k_recent, v_open)` (`DecodeCache.fp8_tensors()`, `k`, `v` its e4m3 storage): the FP8
    split kernel, refused until verified on hardware (`fp8.check_verified`)."""
    if kv8 is not None:
        check_verified("sparse_decode_split<..., fp8_e4m3>")
    B, HQ, D = q.shape
    H = k.shape[2]
    G = HQ // H
    K = topk_idx.shape[2] if topk_idx is not None else 0
    sparse = topk_idx is not None
    S = plan.num_splits
    dev = q.device
    # the merge's inputs, the log2 LSE and (with weights) the fp16 relative probabilities and their
    # per-16-key maxima in one scratch allocation (fewer allocator calls when eager; docs/decode.md,
    # 5. Attention weights)
    direct = S == 1       # one split writes out and lse itself: no partials, no merge launch
    n_o, n_l = (0, 0) if direct else (B * HQ * S * D, B * HQ * S)
    n_p, n_m = weights_scratch_floats(B, H, G, width) if return_attn_weights else (0, 0)
    if scratch is None:
        scratch = torch.empty(scratch_floats(q.shape, H, width, plan, return_attn_weights),
                              dtype=torch.float32, device=dev)
    # prel and pmax 16-byte aligned (n_o, n_p, n_m are multiples of 4 floats): 8- and 16-byte accesses
    o_part = scratch[:n_o]
    prel = scratch[n_o:n_o + n_p].view(torch.float16)
    pmax = scratch[n_o + n_p:n_o + n_p + n_m]
    lse_part = scratch[n_o + n_p + n_m:n_o + n_p + n_m + n_l]
    lse2 = scratch[n_o + n_p + n_m + n_l:n_o + n_p + n_m + n_l + B * HQ]
    if out is None:
        out = empty((B, HQ, D), dtype=q.dtype, device=dev)
    if lse is None:
        lse = empty((B, HQ), dtype=torch.float32, device=dev)
    if return_attn_weights and w_out is None:
        w_out = empty((B, HQ if weights == "per_head" else H, width), dtype=torch.float32, device=dev)
    paged = bt is not None
    k_scale, v_scale, k_recent, v_open = kv8 if kv8 is not None else (None,) * 4
    run.add(SOURCE, split_name(q.dtype, D, plan.row_tiles, kv8 is not None), (S, H, B),
            (128 * plan.row_tiles,), plan.split_smem_bytes(D, sparse, K, kv8=kv8 is not None), SPLIT_PARAMS,
            dict(q=q, k=k, v=v, seqlens=seqlens, block_table=bt, max_pages=bt.shape[1] if paged else 0,
                 page_size=k.shape[1] if paged else 0, seq_rows=0 if paged else k.shape[1], topk=topk_idx,
                 K=K, B=B, H=H, G=G, per_split=plan.per_split, scale_log2=scale * math.log2(math.e),
                 o_part=None if direct else o_part, lse_part=None if direct else lse_part,
                 prel=prel if return_attn_weights else None, pmax=pmax if return_attn_weights else None,
                 W=width, out=out if direct else None, lse_out=lse if direct else None,
                 lse2_out=lse2 if direct else None, k_scale=k_scale, v_scale=v_scale, k_recent=k_recent,
                 v_open=v_open))
    if not direct:
        nt = plan.merge_threads(D)
        run.add(SOURCE, f"sparse_decode_merge<{CXX_TYPE[q.dtype]}, {D}>", (B * HQ,), (nt,), 16 * nt,
                MERGE_PARAMS,
                dict(o_part=o_part, lse_part=lse_part, S=S, out=out, lse_out=lse, lse2_out=lse2),
                pdl=plan.pdl)
    if return_attn_weights:
        run.add(SOURCE, "sparse_decode_weights", (cdiv(width, WCHUNK), H, B), (WCHUNK // 4,), 0,
                WEIGHTS_PARAMS,
                dict(prel=prel, pmax=pmax, lse2=lse2, seqlens=seqlens, topk=topk_idx, K=K, B=B, H=H, G=G,
                     W=width, per_kv_head=int(weights == "per_kv_head"), out=w_out), pdl=plan.pdl)
    return out, lse, w_out


def weights_scratch_floats(batch: int, kv_heads: int, group: int, width: int) -> tuple[int, int]:
    """fp32 words of the weights' scratch (docs/decode.md, 5. Attention weights): the fp16 relative
    probabilities `[B, HQ, W]` (rounded up to 16 bytes) and one fp32 max per 16-key group and query
    head, `[B, H, cdiv(W, 16), GP]` with the group padded to GP = a multiple of 4 (a 16-byte load
    takes 4 heads' maxes)."""
    rows = batch * kv_heads * group
    return 4 * cdiv(rows * width, 8), batch * kv_heads * cdiv(width, PMAX_GROUP) * 4 * cdiv(group, 4)


def check_plan(plan, group: int, n_entries: int, head_dim: int, k: int = 0, *, kv8: bool = False) -> None:
    """`plan` must cover the group and every entry (sparse: the K topk entries; dense: the blocks of
    the cache's width), and its shared memory must fit a CTA (the topk row is staged there)."""
    if not isinstance(plan, DecodePlan) or plan.row_tiles not in ROW_TILES or 16 * plan.row_tiles < group:
        raise ValueError(f"plan: {plan!r} does not fit G = {group} (row_tiles in {ROW_TILES}, 16 x row_tiles "
                         ">= G)")
    if plan.num_splits < 1 or plan.per_split < 1 or plan.num_splits * plan.per_split < n_entries:
        raise ValueError(f"plan: {plan!r} covers {plan.num_splits * plan.per_split} entries, fewer than "
                         f"the {n_entries} to read")
    if not isinstance(plan.pdl, bool):
        raise ValueError(f"plan: pdl must be a bool, got {plan.pdl!r}")
    g = plan.merge_groups
    is_int = isinstance(g, int) and not isinstance(g, bool)
    if not is_int or g < 0 or (g & (g - 1)) or (g and not 32 <= g * (head_dim // 4) <= MERGE_MAX_THREADS):
        raise ValueError("plan: merge_groups must be 0 (default) or a power of two with 32 <= merge_groups "
                         f"x D / 4 <= {MERGE_MAX_THREADS} at D = {head_dim}, got {g!r}")
    if plan.split_smem_bytes(head_dim, k > 0, k, kv8=kv8) > SMEM_PER_BLOCK:
        raise ValueError(f"topk_idx: K = {k} entries need more shared memory than a CTA has "
                         f"({plan.split_smem_bytes(head_dim, True, k, kv8=kv8)} > {SMEM_PER_BLOCK} bytes)")


def check_decode_kernel_inputs(q, k, v, seqlens, bt, topk_idx, kv8=None):
    """Shapes, dtypes, devices and layouts the kernels need; raises naming the argument. Reads no values.
    `kv8`: an FP8 cache's `(k_scale, v_scale, k_recent, v_open)`, `k` and `v` then e4m3."""
    check_tensor("q", q, ndim=3, dtypes=KERNEL_DTYPES, contiguous=True)
    B, HQ, D = q.shape
    store = (E4M3,) if kv8 is not None else (q.dtype,)
    check_tensor("k_cache", k, ndim=4, dtypes=store, device=q.device, contiguous=True)
    check_tensor("v_cache", v, shape=tuple(k.shape), dtypes=store, device=q.device, contiguous=True)
    if kv8 is not None:
        check_fp8_tensors(q, k, kv8)
    H = k.shape[2]
    if D not in HEAD_DIMS or k.shape[3] != D:
        raise ValueError(f"q has head dim {D} and the cache {k.shape[3]}; the kernel takes equal dims in "
                         f"{HEAD_DIMS}")
    if HQ % H:
        raise ValueError(f"q has {HQ} heads, not a multiple of the cache's {H} KV heads")
    G = HQ // H
    if G > MAX_GROUP:
        raise ValueError(f"q: group size G = {G} > {MAX_GROUP} is not supported by the kernel")
    if seqlens.dim() == 1 and seqlens.shape[0] != B:
        raise ValueError(f"q has {B} rows (one per sequence) but the cache holds {seqlens.shape[0]} "
                         "sequences")
    check_tensor("seqlens", seqlens, shape=(B,), dtypes=(torch.int32,), device=q.device, contiguous=True)
    if bt is not None:
        check_tensor("block_table", bt, ndim=2, dtypes=(torch.int32,), device=q.device, contiguous=True)
        if bt.shape[0] != B:
            raise ValueError(f"block_table has {bt.shape[0]} rows for {B} sequences")
        if k.shape[1] % KV_BLOCK:
            raise ValueError(f"k_cache: page_size {k.shape[1]} must be a multiple of {KV_BLOCK}")
    elif k.shape[0] != B:
        raise ValueError(f"k_cache holds {k.shape[0]} sequences but q has {B}")
    K = 0
    if topk_idx is not None:
        check_tensor("topk_idx", topk_idx, ndim=3, dtypes=(torch.int32,), device=q.device, contiguous=True)
        if tuple(topk_idx.shape[:2]) != (H, B):
            raise ValueError(f"topk_idx must have shape (H={H}, B={B}, K), got {tuple(topk_idx.shape)}")
        K = topk_idx.shape[2]
    if not q.is_cuda:
        raise ValueError(f"q must be a CUDA tensor for backend='kernels', got one on {q.device}")
    return B, HQ, D, H, G, K


def check_fp8_tensors(q, k, kv8) -> None:
    """An FP8 cache's `(k_scale, v_scale, k_recent, v_open)` beside its e4m3 `k` `[rows, R, H, D]`
    (docs/decode.md §16): shapes, dtypes, device, contiguity; raises naming the tensor."""
    if not isinstance(kv8, (tuple, list)) or len(kv8) != 4:
        raise TypeError("kv8 must be (k_scale, v_scale, k_recent, v_open)")
    rows, R, H, D = k.shape
    B = q.shape[0]
    k_scale, v_scale, k_recent, v_open = kv8
    for name, t, shape, dt in (("k_scale", k_scale, (rows, cdiv(R, KV_BLOCK), H, D), torch.float32),
                               ("v_scale", v_scale, (rows, R, H), torch.float32),
                               ("k_recent", k_recent, (B, RECENT, H, D), q.dtype),
                               ("v_open", v_open, (B, KV_BLOCK, H, D), q.dtype)):
        check_tensor(name, t, shape=shape, dtypes=(dt,), device=q.device, contiguous=True)
