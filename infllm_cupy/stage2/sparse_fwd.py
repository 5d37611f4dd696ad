"""Launchers of kernels_cu/stage2/{block_masks,sparse_fwd,sparse_fwd_sm90}.cu: block-sparse attention forward.

Both input forms reach one kernel through per-row bitmasks over 64-key blocks:
token-level `topk_idx` rows are packed on the GPU (`token_block_masks`), query-block layouts
are packed by `BlockLayout.packed` (one row per query block).
"""
from __future__ import annotations

import dataclasses
import os

import numpy as np
import torch

from .. import _jit
from .._checks import KERNEL_DTYPES, check_aligned, validate_values
from .._constants import HEAD_DIMS
from .._constants import KV_BLOCK as BLOCK_N  # kernels_cu: BLOCK_N
from .._launch import CXX_TYPE, cdiv, empty, launch, ptr
from .._tma import rows_map

FWD_SOURCE = "stage2/sparse_fwd.cu"
SM90_SOURCE = "stage2/sparse_fwd_sm90.cu"
SM90_CONSUMERS = 2      # mirrors NC in sparse_fwd_sm90.cu
SM90_STAGES = (6, 4)    # K/V ring depths compiled (template NS), deepest first: the deepest that fits
SMEM_PER_BLOCK = 227 * 1024   # the H100's (and H200's) dynamic shared memory limit per block
MASK_SOURCE = "stage2/block_masks.cu"
# Key-range passes of the sm_90a forward: at long contexts a sequence's K/V (per KV head) outgrow
# the L2, and per-token picks read blocks all over it, so most copies miss to DRAM. Each pass
# attends the blocks of one key range whose K/V fit PASS_KV_BYTES and merges its rows into the
# output by lse; only CTAs whose union exceeds `split_min` blocks split (the kernel's launch
# contract). NOTES.md (forward v7) has the measurements.
PASS_KV_BYTES = 32 << 20
MAX_KV_PASSES = 8
MASK_WARPS = 8          # mirrors #define WARPS in block_masks.cu


@dataclasses.dataclass(frozen=True)
class FwdTiles:
    """Tile shape of the forward kernel (a tuning knob; every choice computes the same function).

    warps: warps per CTA (4 or 8). m_tiles: 16-row m-tiles per warp (1 or 2; 2 gives a warp two
    tokens at G = 16 that share every K/V fragment). sub_keys: keys per softmax sub-step (32 or 64).
    """
    warps: int = 4
    m_tiles: int = 2
    sub_keys: int = 64

    def __post_init__(self):
        if self.warps not in (4, 8) or self.m_tiles not in (1, 2) or self.sub_keys not in (32, 64):
            raise ValueError(f"tiles must have warps in (4, 8), m_tiles in (1, 2), sub_keys in (32, 64); got {self}")

    @property
    def rows(self) -> int:
        return 16 * self.m_tiles * self.warps

    def name(self, dtype: torch.dtype, D: int) -> str:
        return f"stage2_fwd<{CXX_TYPE[dtype]}, {D}, {self.warps}, {self.m_tiles}, {self.sub_keys}>"


# fastest on every selection of the 8k x 2 sweep (H100, benchmarks/NOTES.md v2)
DEFAULT_TILES = FwdTiles()
ALL_TILES = [FwdTiles(w, m, kn) for w in (4, 8) for m in (1, 2) for kn in (32, 64)]


SM90A = "sm90a"   # the Hopper kernel (wgmma, warp-specialised); chosen by default on capability 9.0
SM90A_PAIR = "sm90a_pair"       # the same kernel with 128-key steps forced in every CTA (tests, A/B)
SM90A_SINGLE = "sm90a_single"   # ... with 64-key steps forced, one K/V ring shared by the warpgroups
SM90A_SPLIT = "sm90a_split"     # ... with 64-key steps and a ring per warpgroup forced
SM90A_FWD = (SM90A, SM90A_PAIR, SM90A_SINGLE, SM90A_SPLIT)
# step_mode of the sm_90a kernel: 1 = 128-key steps (two selected blocks per softmax step) in the
# CTAs where they waste nothing and split rings where the warpgroups share few blocks, 2 = 128-key
# steps everywhere, 0 = nowhere (one shared ring), 3 = split rings everywhere
# (kernels_cu/stage2/sparse_fwd_sm90.cu)
_STEP_MODE = {SM90A: 1, SM90A_PAIR: 2, SM90A_SINGLE: 0, SM90A_SPLIT: 3}


def as_tiles(tiles, device=None):
    """Resolve the `tiles` argument: None picks the sm_90a kernel on capability (9, 0) and the
    default SM80 tiles elsewhere; "sm90a", a FwdTiles or a (warps, m_tiles, sub_keys) tuple force one."""
    if tiles is None:
        cap = torch.cuda.get_device_capability(device) if torch.cuda.is_available() else None
        return SM90A if cap == (9, 0) else DEFAULT_TILES
    if tiles in SM90A_FWD or isinstance(tiles, FwdTiles):
        return tiles
    if isinstance(tiles, (tuple, list)) and len(tiles) == 3:
        return FwdTiles(*tiles)
    raise TypeError(f"tiles must be None, 'sm90a', a FwdTiles or a (warps, m_tiles, sub_keys) tuple, got {tiles!r}")


# MT = 2 spills a little under the 255-register cap (D = 128: 116 B; D = 64: 8 B), yet measures
# fastest: the CPU compile check tolerates its spills and demands none of the MT = 1 variants.
for _t in ALL_TILES:
    for _d in HEAD_DIMS:
        _jit.register_instances(FWD_SOURCE, [_t.name(dt, _d) for dt in KERNEL_DTYPES],
                                strict=_t.m_tiles == 1)
_jit.register_instances(SM90_SOURCE, [f"stage2_fwd_sm90<{CXX_TYPE[dt]}, {d}, {ns}>" for dt in KERNEL_DTYPES
                                     for d in HEAD_DIMS for ns in SM90_STAGES], sm90a=True)
_jit.register_instances(MASK_SOURCE, ["token_block_masks"])


def kv_passes_for(max_seqlen_k: int, D: int, itemsize: int) -> int:
    """Key-range passes of the sm_90a forward: as many as keep one pass's K and V of one sequence
    and KV head within PASS_KV_BYTES (1 up to 64k keys at D = 128 in bf16, 2 at 128k).
    `$INFLLM_CUPY_FWD_PASSES` overrides it (A/B runs and tests)."""
    env = os.environ.get("INFLLM_CUPY_FWD_PASSES")
    if env:
        return max(1, int(env))
    return max(1, min(MAX_KV_PASSES, cdiv(max_seqlen_k * D * 2 * itemsize, PASS_KV_BYTES)))


def n_mask_words(max_seqlen_k: int) -> int:
    """uint32 words per bitmask row covering `cdiv(max_seqlen_k, 64)` blocks (at least 1)."""
    return max(1, cdiv(cdiv(max_seqlen_k, BLOCK_N), 32))


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
           args=(ptr(topk_idx), ptr(cu_seqlens_q), ptr(cu_seqlens_k), ptr(masks),
                 np.int32(cu_seqlens_q.numel() - 1), np.int32(total_q), np.int32(K), np.int32(n_words),
                 np.int32(BLOCK_N)))
    return masks


def sm90_smem_bytes(D: int, stages: int, n_words: int, itemsize: int = 2, dq: bool = False) -> int:
    """1 KB alignment slack, Q tiles (and with `dq`, the backward's dout tiles), K/V ring,
    mbarriers, CTA + per-warpgroup unions."""
    tiles = SM90_CONSUMERS * (2 if dq else 1)
    return (1024 + (tiles * 64 * D + stages * 2 * BLOCK_N * D) * itemsize
            + 8 * stages * (2 * SM90_CONSUMERS + 1) + 4 * n_words * (SM90_CONSUMERS + 1))


def sm90_stages(D: int, n_words: int, itemsize: int = 2, dq: bool = False) -> int:
    """The deepest compiled K/V ring that fits the shared memory (the mask words grow with
    max_seqlen_k), for the forward or (`dq`) the backward's dq instance of the same kernel."""
    for ns in SM90_STAGES:
        if sm90_smem_bytes(D, ns, n_words, itemsize, dq) <= SMEM_PER_BLOCK:
            return ns
    return SM90_STAGES[-1]   # too long for any: the launch names the shared memory it asked for


def fwd_smem_bytes(D: int, tiles, n_words: int, itemsize: int = 2) -> int:
    if tiles in SM90A_FWD:
        return sm90_smem_bytes(D, sm90_stages(D, n_words, itemsize), n_words, itemsize)
    return (tiles.rows * D + 4 * BLOCK_N * D) * itemsize + 4 * n_words


def stage2_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
               cu_seqlens_k: torch.Tensor, masks: torch.Tensor, mask_base: torch.Tensor, mask_h_stride: int,
               mask_q_block: int, max_seqlen_q: int, causal: bool, softmax_scale: float,
               tiles=DEFAULT_TILES, max_seqlen_k: int | None = None,
               split_min: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward kernel on checked, contiguous inputs. Returns `out [total_q, HQ, D]` and
    `lse [HQ, total_q]` float32. `masks` is `[..., n_words]` int32; see the .cu header for the rows.
    With `split_min` (the token-level op passes 2 K) the sm_90a kernel runs in
    `kv_passes_for(max_seqlen_k, ...)` key-range passes, and CTAs whose union of blocks exceeds
    `split_min` split over them (`$INFLLM_CUPY_FWD_SPLIT_MIN` overrides it); `max_seqlen_k`
    defaults to what the mask rows cover."""
    check_aligned(q=q, k=k, v=v)
    total_q, HQ, D = q.shape
    H = k.shape[1]
    G = HQ // H
    B = cu_seqlens_q.numel() - 1
    n_words = masks.shape[-1]
    out = empty((total_q, HQ, D), dtype=q.dtype, device=q.device)
    lse = empty((HQ, total_q), dtype=torch.float32, device=q.device)
    if tiles in SM90A_FWD and not 0 < k.shape[0] < 2**31 - BLOCK_N:
        # no keys: no tensor map to encode (the SM80 kernel writes the empty rows); TMA row
        # coordinates are int32
        tiles = DEFAULT_TILES
    head = (ptr(masks), ptr(mask_base), ptr(cu_seqlens_q), ptr(cu_seqlens_k))
    tail = (np.int32(total_q), np.int32(HQ), np.int32(H), np.int32(G), np.int32(n_words),
            np.int64(mask_h_stride), np.int32(mask_q_block), np.float32(softmax_scale * 1.4426950408889634),
            np.int32(1 if causal else 0))
    smem = fwd_smem_bytes(D, tiles, n_words, q.element_size())
    if tiles not in SM90A_FWD:
        name = tiles.name(q.dtype, D)
        launch(_jit.get_kernel(FWD_SOURCE, name), name=name, grid=(cdiv(max_seqlen_q * G, tiles.rows), H, B),
               block=(32 * tiles.warps,), shared_mem=smem,
               args=(ptr(q), ptr(k), ptr(v)) + head + (ptr(out), ptr(lse)) + tail)
        return out, lse
    name = f"stage2_fwd_sm90<{CXX_TYPE[q.dtype]}, {D}, {sm90_stages(D, n_words, q.element_size())}>"
    kernel = _jit.get_kernel(SM90_SOURCE, name, sm90a=True)
    maps = (rows_map(k, BLOCK_N), rows_map(v, BLOCK_N))
    n_kb = cdiv(max_seqlen_k, BLOCK_N) if max_seqlen_k is not None else 32 * n_words
    passes = 1 if split_min is None else kv_passes_for(n_kb * BLOCK_N, D, q.element_size())
    per = cdiv(n_kb, max(1, min(passes, n_kb)))
    passes = cdiv(n_kb, per) if n_kb > 0 else 1
    grid = (cdiv(max_seqlen_q * G, 64 * SM90_CONSUMERS), H, B)
    # zeros: CTAs past a short sequence's rows write no flag, and `split.any()` below reads them all
    split = torch.zeros(grid[::-1], dtype=torch.int32, device=q.device) if passes > 1 else None
    split_min = int(os.environ.get("INFLLM_CUPY_FWD_SPLIT_MIN", split_min or 0))
    # where every sequence has as many queries as keys (one cu_seqlens tensor for both: no host
    # copy needed to know it), a later causal pass leaves out the leading CTAs, whose tokens all
    # precede its key range; the kernel's own test catches the rest
    same_lengths = causal and cu_seqlens_q.data_ptr() == cu_seqlens_k.data_ptr()
    for p in range(passes):
        blk_hi = (p + 1) * per if p < passes - 1 else 1 << 30
        x_off = max(0, (p * per * BLOCK_N * G) // (64 * SM90_CONSUMERS) - 1) if same_lengths else 0
        launch(kernel, name=name, grid=(grid[0] - x_off,) + grid[1:], block=(128 * (SM90_CONSUMERS + 1),),
               shared_mem=smem, args=(ptr(q),) + maps + head + (ptr(out), ptr(lse)) + tail
               + (np.int32(_STEP_MODE[tiles]), np.int32(p * per), np.int32(blk_hi),
                  ptr(split) if split is not None else np.uint64(0), np.int32(split_min), np.int32(x_off)))
        if p == 0 and passes > 1 and validate_values() and not torch.cuda.is_current_stream_capturing():
            # Where host reads are allowed anyway (the cu_seqlens checks), one more tells whether
            # any CTA split: if none did (block-shared selections), the later passes are not
            # launched. Their CTAs would only read their flag and leave, yet at 128k x 2 launching
            # them cost 2% of the forward (NOTES.md, forward v7).
            if not bool(split.any()):
                break
    return out, lse
