"""Launch plans of the stage-2 kernels: every kernel choice as a value, computed from shapes and the device.

`fwd_plan` and `bwd_plan` are pure functions of the problem's shapes and the device's compute
capability (as FlashAttention-3 keeps its tile and split heuristics in code); the ops call them
with the public `kernel=` argument ("auto", "sm80", "sm90a"), and the launchers `stage2_fwd` and
`stage2_bwd` do exactly what the plan says. A test reaches a variant the heuristics never pick (a
pass count, an SM80 tile shape) by building a plan itself, usually
`dataclasses.replace(fwd_plan(...), field=value)`, and calling the launcher level with it. A plan
holds only what shapes choose: what the kernel decides per CTA (the sm_90a forward's step shapes)
is no field, and tests and A/B tools force it through the launcher's `_force_steps` hook.

Why each default is what it is: docs/stage2_fwd.md (forward) and docs/stage2_bwd.md (backward),
sections named at each constant below.
"""
from __future__ import annotations

import dataclasses
import functools

import torch

from .._kernel_arg import SM80, SM90A, wants_sm90a
from .._launch import CXX_TYPE
from .._rules import (
    KV_BLOCK,  # keys per KV block (kernels_cu: BLOCK_N)
    SMEM_PER_BLOCK,  # the sm_90 CTA's dynamic shared memory: the plans are made without a device
    cdiv,
)

# --------------------------------------------------------------------------------------------
# Forward (docs/stage2_fwd.md)
# --------------------------------------------------------------------------------------------
SM90_CONSUMERS = 2      # consumer warpgroups of the ring CTA (NC; sparse_fwd.py checks it at compile time)
SM90_STAGES = (6, 4)    # K/V ring depths compiled (template NS), deepest first: the deepest that fits
# Key-range passes of the sm_90a forward (docs/stage2_fwd.md, 6. Key-range passes): one pass per
# PASS_KV_BYTES of a sequence's K and V per KV head, at most MAX_KV_PASSES. Tuned for the forward's
# key ranges; the backward's query-range passes (DKDV_PASS_BYTES, DKDV_MAX_PASSES) are a separate
# tuning of another kernel that happens to have the same values today.
PASS_KV_BYTES = 32 << 20
MAX_KV_PASSES = 8


@dataclasses.dataclass(frozen=True)
class FwdTiles:
    """Tile shape of the SM80 forward kernel (every choice computes the same function).

    warps: warps per CTA (4 or 8). m_tiles: 16-row m-tiles per warp (1 or 2; 2 gives a warp two
    tokens at G = 16 that share every K/V fragment). sub_keys: keys per softmax sub-step (32 or 64).
    """
    warps: int = 4
    m_tiles: int = 2
    sub_keys: int = 64

    def __post_init__(self):
        if self.warps not in (4, 8) or self.m_tiles not in (1, 2) or self.sub_keys not in (32, 64):
            raise ValueError("FwdTiles needs warps in (4, 8), m_tiles in (1, 2), sub_keys in (32, 64); got "
                             f"{self}")

    @property
    def rows(self) -> int:
        return 16 * self.m_tiles * self.warps

    def name(self, dtype: torch.dtype, D: int) -> str:
        return f"stage2_fwd<{CXX_TYPE[dtype]}, {D}, {self.warps}, {self.m_tiles}, {self.sub_keys}>"


# fastest on every selection of the 8k x 2 sweep (docs/stage2_fwd.md, 3. SM80 kernel)
DEFAULT_TILES = FwdTiles()
ALL_TILES = [FwdTiles(w, m, kn) for w in (4, 8) for m in (1, 2) for kn in (32, 64)]


# the forward kernels' QH template value per FwdPlan.qhead
QHEAD_MODES = {"off": 0, "head": 2}


# The sm_90a dk/dv's QH value for BwdPlan.dkdv_group: per-query-head rows, a group's heads per CTA
DKDV_GROUP_QH = 3


def qhead_instance(name: str, qhead: str, *, group: bool = False) -> str:
    """The kernel instance of a `FwdPlan.qhead` / `BwdPlan.qhead` value: `name` (a C++ name expression
    `kernel<...>`) with the QH template value appended; "off" is the default QH = 0, the bare name.
    `group` (the sm_90a dk/dv with qhead "head" only, `BwdPlan.dkdv_group`): DKDV_GROUP_QH."""
    if group:
        return f"{name[:-1]}, {DKDV_GROUP_QH}>"
    return name if qhead == "off" else f"{name[:-1]}, {QHEAD_MODES[qhead]}>"


@dataclasses.dataclass(frozen=True)
class FwdPlan:
    """What `stage2_fwd` launches.

    kernel: "sm80" (`tiles` gives its shape) or "sm90a" (the warp-specialised ring kernel, whose
    CTAs each choose their step shape: docs/stage2_fwd.md, 5. 64- and 128-key steps, split rings).
    sm_90a only: `stages` (K/V ring depth, one of SM90_STAGES; it must fit the shared memory with
    the mask rows), `kv_passes` (key-range passes; 1: none) and `split_min` (a CTA splits over the
    passes only where its union of blocks exceeds this many).
    `qhead`: how mask rows per query head (a layout with HQ heads) run, a key of QHEAD_MODES
    (docs/stage2_fwd.md, "Per-query-head mask rows"): "off" (rows per KV head) or "head" (one query
    head per CTA, K/V heads shared through the L2); "head": SM80 only with the default tiles.
    """
    kernel: str
    tiles: FwdTiles = DEFAULT_TILES
    stages: int = SM90_STAGES[0]
    kv_passes: int = 1
    split_min: int = 0
    qhead: str = "off"

    def __post_init__(self):
        if self.kernel not in (SM80, SM90A):
            raise ValueError(f"FwdPlan.kernel must be 'sm80' or 'sm90a', got {self.kernel!r}")
        if not isinstance(self.tiles, FwdTiles):
            raise TypeError(f"FwdPlan.tiles must be a FwdTiles, got {self.tiles!r}")
        if self.stages not in SM90_STAGES:
            raise ValueError(f"FwdPlan.stages must be one of {SM90_STAGES}, got {self.stages!r}")
        if (not isinstance(self.kv_passes, int) or self.kv_passes < 1
                or (self.kernel == SM80 and self.kv_passes != 1)):
            raise ValueError("FwdPlan.kv_passes must be an int >= 1 (1 for the SM80 kernel), got "
                             f"{self.kv_passes!r}")
        if not isinstance(self.split_min, int) or self.split_min < 0:
            raise ValueError(f"FwdPlan.split_min must be an int >= 0, got {self.split_min!r}")
        if self.qhead not in QHEAD_MODES:
            raise ValueError(f"FwdPlan.qhead must be one of {tuple(QHEAD_MODES)}, got {self.qhead!r}")
        if self.qhead != "off" and self.kv_passes != 1:
            # layouts run one pass; "head" CTAs would also need their own pass flags
            raise ValueError(f"FwdPlan.qhead={self.qhead!r} needs kv_passes=1, got {self.kv_passes}")
        if self.qhead != "off" and self.kernel == SM80 and self.tiles != DEFAULT_TILES:
            # only the default tile shape has per-query-head instances (compile time of the CPU suite)
            raise ValueError(f"FwdPlan.qhead={self.qhead!r} needs the default SM80 tiles {DEFAULT_TILES}, "
                             f"got {self.tiles}")


def n_mask_words(max_seqlen_k: int) -> int:
    """uint32 words per bitmask row covering `cdiv(max_seqlen_k, 64)` blocks (at least 1)."""
    return max(1, cdiv(cdiv(max_seqlen_k, KV_BLOCK), 32))


def sm90_smem_bytes(D: int, stages: int, n_words: int, itemsize: int = 2, dq: bool = False) -> int:
    """1 KB alignment slack, Q tiles (and with `dq`, the backward's dout tiles), K/V ring,
    mbarriers, CTA + per-warpgroup unions."""
    tiles = SM90_CONSUMERS * (2 if dq else 1)
    return (1024 + (tiles * 64 * D + stages * 2 * KV_BLOCK * D) * itemsize
            + 8 * stages * (2 * SM90_CONSUMERS + 1) + 4 * n_words * (SM90_CONSUMERS + 1))


def sm90_stages(D: int, n_words: int, itemsize: int = 2, dq: bool = False) -> int:
    """The deepest compiled K/V ring that fits the shared memory (the mask words grow with
    max_seqlen_k), for the forward or (`dq`) the backward's dq instance of the same kernel."""
    for ns in SM90_STAGES:
        if sm90_smem_bytes(D, ns, n_words, itemsize, dq) <= SMEM_PER_BLOCK:
            return ns
    return SM90_STAGES[-1]   # too long for any: the launch names the shared memory it asked for


def kv_passes_for(max_seqlen_k: int, D: int, itemsize: int) -> int:
    """Key-range passes of the sm_90a forward: as many as keep one pass's K and V of one sequence
    and KV head within PASS_KV_BYTES (1 up to 64k keys at D = 128 in bf16, 2 at 128k)."""
    return max(1, min(MAX_KV_PASSES, cdiv(max_seqlen_k * D * 2 * itemsize, PASS_KV_BYTES)))


def sm90_fits_keys(total_k: int) -> bool:
    """The sm_90a kernels read K/V through TMA tensor maps: none can be encoded without keys, and
    TMA row coordinates are int32."""
    return 0 < total_k < 2**31 - KV_BLOCK


@functools.lru_cache(maxsize=1024)
def fwd_plan(capability, D: int, dtype: torch.dtype, max_seqlen_k: int, total_k: int,
             split_min: int | None = None, kernel: str = "auto") -> FwdPlan:
    """The forward's plan for one call.

    capability: the device's (major, minor). split_min: None for one pass (the layout op); the
    token-level op passes 2 K, and the sm_90a kernel then runs in `kv_passes_for` key-range passes
    in which CTAs whose union exceeds `split_min` blocks split. kernel: "auto" (sm_90a on
    capability 9.0, else SM80), "sm80" or "sm90a" (ValueError on another capability). Without keys
    (or past TMA's int32 rows) the SM80 kernel runs whatever `kernel` asks: it writes the empty rows.
    """
    if not wants_sm90a(kernel, capability, "the stage-2 forward") or not sm90_fits_keys(total_k):
        return FwdPlan(SM80, DEFAULT_TILES)
    itemsize = dtype.itemsize
    passes = 1 if split_min is None else kv_passes_for(cdiv(max_seqlen_k, KV_BLOCK) * KV_BLOCK, D, itemsize)
    return FwdPlan(SM90A, stages=sm90_stages(D, n_mask_words(max_seqlen_k), itemsize),
                   kv_passes=passes, split_min=split_min or 0)


# --------------------------------------------------------------------------------------------
# Backward (docs/stage2_bwd.md)
# --------------------------------------------------------------------------------------------
QT = 64                 # query rows per dk/dv tile (mirrors #define QT)
# The gathering dk/dv instance (docs/stage2_bwd.md, 7. Fixed tiles vs gathered tokens (auto)) is
# built for these group sizes; elsewhere only fixed tiles run.
GATHER_G = (8, 64)
# Block 0's parts (docs/stage2_bwd.md, 8. Block 0 in parts): about this many query tiles each.
BLOCK0_PART_TILES = 1024
# Query-range passes of the sm_90a dk/dv (docs/stage2_bwd.md, 10. Query-range passes and PDL):
# one per DKDV_PASS_BYTES of a sequence's Q and dO per KV head, at most DKDV_MAX_PASSES. Tuned for
# the dk/dv's query ranges, separately from the forward's key-range passes (PASS_KV_BYTES,
# MAX_KV_PASSES), whose values happen to be the same today.
DKDV_PASS_BYTES = 32 << 20
DKDV_MAX_PASSES = 8
# Flush interval of the SM80 dk/dv (docs/stage2_bwd.md, 12. SM80 path): a CTA adds its register sums
# to fp32 rows in global memory after this many 64-row query tiles: a quarter of the query rows one
# sm_90a query-range pass sums at 1M tokens (which met the error rule there). Up to 32k tokens at
# G = 16 no CTA has more, so nothing is allocated and the kernel is the one without flushes.
DKDV_FLUSH_TILES = 8192
# sm_90a dk/dv instances: fixed 64-row query tiles, gathered tokens, or both, each key block done by
# the one its tile fill favours
DKDV_INSTANCES = ("tiles", "gather", "auto")


@dataclasses.dataclass(frozen=True)
class BwdTiles:
    """Tile shape of the SM80 backward kernels (every choice computes the same function).

    dq_warps: warps per dq CTA (4 or 8; 16 query rows each). dkdv_cols: query rows per dk/dv
    sub-step (16, 32 or 64); a sub-step none of whose rows selected the warp's keys is skipped.
    """
    dq_warps: int = 4
    dkdv_cols: int = 32

    def __post_init__(self):
        if self.dq_warps not in (4, 8) or self.dkdv_cols not in (16, 32, 64):
            raise ValueError(f"BwdTiles needs dq_warps in (4, 8) and dkdv_cols in (16, 32, 64); got {self}")

    def dq_name(self, dtype, D):
        return f"stage2_bwd_dq<{CXX_TYPE[dtype]}, {D}, {self.dq_warps}>"

    def dkdv_name(self, dtype, D, flush: bool = False):
        """The SM80 dk/dv instance; `flush`: the one with two-level sums (BwdPlan.dkdv_flush)."""
        return f"stage2_bwd_dkdv<{CXX_TYPE[dtype]}, {D}, {self.dkdv_cols}, {'true' if flush else 'false'}>"


DEFAULT_BWD_TILES = BwdTiles()
ALL_BWD_TILES = [BwdTiles(w, c) for w in (4, 8) for c in (16, 32, 64)]


@dataclasses.dataclass(frozen=True)
class BwdPlan:
    """What `stage2_bwd` launches.

    kernel: the dk/dv kernel, "sm80" (`tiles.dkdv_cols`) or "sm90a". dq: "sm80" (`tiles.dq_warps`)
    or "sm90a" (the forward's K/V ring of depth `dq_stages`; each CTA picks its step shape, which
    the launcher's test and A/B hook `_force_dq_steps` forces instead). sm_90a dk/dv only: `dkdv`
    (one of DKDV_INSTANCES; "gather" and "auto" need
    8 <= G <= 64), `dkdv_tma` (fixed tiles by TMA, needs 64 % G == 0; else cp.async),
    `dkdv_passes` (query-range passes; 1: none) and `block0_parts` (CTAs sharing block 0; only
    without passes). Passes after the first launch as programmatic dependents whatever the shapes
    (the launcher's test and A/B hook `_pdl=False` launches them one after the other).
    SM80 dk/dv only: `dkdv_flush` (query tiles a CTA sums in registers before it adds them to fp32
    rows in global memory; those rows are allocated only where a sequence has more tiles, see
    `sm80_dkdv_flushes`).
    `dkdv_group` (sm_90a with qhead "head" only): one dk/dv CTA per (key block, KV head) walks the
    index rows of the group's query heads one after another and writes dk, dv per KV head (no
    per-query-head partials, no group sum afterwards); needs `block0_parts` 1.
    `qhead`: a key of QHEAD_MODES (docs/stage2_bwd.md, "Per-query-head mask rows"): "off" (mask rows
    per KV head) or "head" (rows per query head, a layout with HQ heads: every kernel runs with one
    query head per CTA, G = 1 in its row space, K/V read at head `h / G`, dk/dv as per-query-head
    partials summed over the group). "head" needs fixed tiles (`dkdv="tiles"`) and, on SM80, the
    default tiles; the other fields are those of the plan at G = 1 (`bwd_plan(..., G=1, ...)`).
    """
    kernel: str
    tiles: BwdTiles = DEFAULT_BWD_TILES
    dq: str = SM80
    dq_stages: int = SM90_STAGES[0]
    dkdv: str = "tiles"
    dkdv_tma: bool = True
    dkdv_passes: int = 1
    block0_parts: int = 1
    dkdv_flush: int = DKDV_FLUSH_TILES
    qhead: str = "off"
    dkdv_group: bool = False

    def __post_init__(self):
        if self.kernel not in (SM80, SM90A) or self.dq not in (SM80, SM90A):
            raise ValueError(f"BwdPlan.kernel and BwdPlan.dq must be 'sm80' or 'sm90a', got {self.kernel!r}, "
                             f"{self.dq!r}")
        if not isinstance(self.tiles, BwdTiles):
            raise TypeError(f"BwdPlan.tiles must be a BwdTiles, got {self.tiles!r}")
        if self.kernel == SM80 and (self.dq != SM80 or self.dkdv_passes != 1 or self.block0_parts != 1):
            raise ValueError(f"an SM80 BwdPlan has the SM80 dq, one pass and no block-0 parts, got {self}")
        if self.dq_stages not in SM90_STAGES:
            raise ValueError(f"BwdPlan.dq_stages must be one of {SM90_STAGES}, got {self.dq_stages!r}")
        if self.dkdv not in DKDV_INSTANCES:
            raise ValueError(f"BwdPlan.dkdv must be one of {DKDV_INSTANCES}, got {self.dkdv!r}")
        if not isinstance(self.dkdv_passes, int) or self.dkdv_passes < 1:
            raise ValueError(f"BwdPlan.dkdv_passes must be an int >= 1, got {self.dkdv_passes!r}")
        if not isinstance(self.block0_parts, int) or not 1 <= self.block0_parts <= 32 \
                or (self.block0_parts > 1 and self.dkdv_passes > 1):
            raise ValueError(f"BwdPlan.block0_parts must be an int in [1, 32], and 1 with passes, got {self}")
        if type(self.dkdv_flush) is not int or self.dkdv_flush < 1:
            raise ValueError(f"BwdPlan.dkdv_flush must be an int >= 1 (query tiles per flush), got "
                             f"{self.dkdv_flush!r}")
        if not isinstance(self.qhead, str) or self.qhead not in QHEAD_MODES:
            raise ValueError(f"BwdPlan.qhead must be one of {tuple(QHEAD_MODES)}, got {self.qhead!r}")
        if self.qhead != "off" and self.kernel == SM90A and self.dkdv != "tiles":
            # one query head per row: G = 1, where only fixed tiles exist
            raise ValueError(f"BwdPlan.qhead={self.qhead!r} runs fixed tiles (G = 1 in the row space): dkdv "
                             f"must be 'tiles', got {self.dkdv!r}")
        if type(self.dkdv_group) is not bool:
            raise ValueError(f"BwdPlan.dkdv_group must be a bool, got {self.dkdv_group!r}")
        if self.dkdv_group and (self.kernel != SM90A or self.qhead != "head" or self.block0_parts != 1):
            raise ValueError("BwdPlan.dkdv_group walks a group's per-query-head rows in one sm_90a dk/dv "
                             f"CTA: it needs kernel 'sm90a', qhead 'head' and block0_parts 1; got {self}")
        if self.qhead != "off" and self.tiles != DEFAULT_BWD_TILES:
            # only the default tile shape has per-query-head SM80 instances (compile time of the CPU suite)
            raise ValueError(f"BwdPlan.qhead={self.qhead!r} needs the default SM80 tiles "
                             f"{DEFAULT_BWD_TILES}, got {self.tiles}")


def sm80_dkdv_flushes(max_seqlen_q: int, G: int, flush: int) -> bool:
    """Whether some CTA of the SM80 dk/dv can sum more than `flush` query tiles (a key block
    selected by every row of the longest sequence): only then does the launcher allocate the fp32
    rows and run the flushing instance."""
    return cdiv(max_seqlen_q * G, QT) > flush


def dkdv_block0_parts(max_seqlen_q: int, G: int, part_tiles: int = BLOCK0_PART_TILES) -> int:
    """CTAs that share block 0's query tiles in the sm_90a dk/dv (every token selects block 0, so
    alone it would be the longest CTA): about `part_tiles` tiles each, at most 32."""
    return max(1, min(32, cdiv(cdiv(max_seqlen_q * G, QT), part_tiles)))


def dkdv_passes(max_seqlen_q: int, G: int, D: int, itemsize: int) -> int:
    """Query-range passes of the sm_90a dk/dv: one per DKDV_PASS_BYTES of a sequence's Q and dO
    per KV head, at most DKDV_MAX_PASSES (at G = 16, D = 128 in bf16: 1 up to 4k tokens, 2 at 8k, 8 from
    32k), and
    never more than the sequence has tokens."""
    n = min(DKDV_MAX_PASSES, cdiv(max_seqlen_q * G * D * itemsize * 2, DKDV_PASS_BYTES))
    return max(1, min(n, max_seqlen_q))


@functools.lru_cache(maxsize=1024)
def bwd_plan(capability, G: int, D: int, dtype: torch.dtype, max_seqlen_q: int, max_seqlen_k: int,
             total_k: int, kernel: str = "auto") -> BwdPlan:
    """The backward's plan for one call.

    kernel: "auto" (sm_90a on capability 9.0, else SM80), "sm80" or "sm90a" (ValueError on another
    capability). On sm_90a: dq on the ring (the SM80 dq past TMA's int32 rows or the ring's shared
    memory), dk/dv by both instances ("auto") where 8 <= G <= 64 and by fixed tiles elsewhere, TMA
    where G divides 64, query-range passes by size, block 0 in parts where there is one pass.
    """
    if not wants_sm90a(kernel, capability, "the stage-2 backward"):
        return BwdPlan(SM80, DEFAULT_BWD_TILES, dq=SM80)
    itemsize = dtype.itemsize
    passes = dkdv_passes(max_seqlen_q, G, D, itemsize)
    # the ring dq holds its mask-word unions next to its ring: past about 5.9M keys at D = 128 its
    # shallowest ring no longer fits, the SM80 dq's tiles do (docs/stage2_bwd.md, "Limits")
    ring_fits = sm90_smem_bytes(D, SM90_STAGES[-1], n_mask_words(max_seqlen_k), itemsize,
                                dq=True) <= SMEM_PER_BLOCK
    return BwdPlan(SM90A, DEFAULT_BWD_TILES,
                   dq=SM90A if total_k < 2**31 - KV_BLOCK and ring_fits else SM80,
                   dq_stages=sm90_stages(D, n_mask_words(max_seqlen_k), itemsize, dq=True),
                   dkdv="auto" if GATHER_G[0] <= G <= GATHER_G[1] else "tiles", dkdv_tma=64 % G == 0,
                   dkdv_passes=passes, block0_parts=dkdv_block0_parts(max_seqlen_q, G) if passes == 1 else 1)
