"""Launch plan of the stage-1 kernels: which kernel, its CTA shape and where the block keys live.

`stage1_plan` is a pure function of the problem's shapes and the device (compute capability and
shared-memory limits); `stage1_select` calls it with the public `kernel=` argument ("auto", "sm80",
"sm90a") and `launch_select` does what the plan says. Tests reach other tile shapes, the global
block-key scratch or the top-K rerun (`topk_prefix`) by building a plan themselves
(`dataclasses.replace(stage1_plan(...), field=value)`) and calling `launch_select` with it.
Why each choice: docs/stage1.md (3. The sm_90a kernel, 4. Top-K on a prefix, 5. Memory plan,
9. Long context: key ranges).
"""
from __future__ import annotations

import dataclasses
import functools

import torch

from .._kernel_arg import SM80, SM90A, wants_sm90a

SM90_MAX_LGP = 5         # the sm_90a kernel: a token's rows fit in one or two warps' 16 (G <= 32)
SM90_THREADS = 256
MAX_GROUP = 128          # G <= 128: a token's rows fit in one CTA (4 warps x 32 rows)
TILE = 64                # compressed keys per tile (S1_TILE; select.py checks it against the kernels)
STAGE_STRIDE = 68        # floats per staging row (S1_ST, checked likewise)
ROWS_PER_WARP = 32
# docs/stage1.md, 9. Long context: key ranges (the plan's choice, measured on the H100)
RANGE_MIN_TWO_PER_SM = 2048   # a split at two CTAs per SM pays only with ranges this wide (fewer merges)
SCRATCH_BUDGET_FRACTION = 8   # the global block-key scratch may take 1/8 of the device memory


def lgp_of(G: int) -> int:
    """log2 of the padded group GP (the smallest power of two >= G)."""
    return max(0, (G - 1).bit_length())


def smem_bytes_sm90(D: int, itemsize: int, lgp: int, olp: int, key_bytes: int, bs_in_smem: bool) -> int:
    """Dynamic shared memory of one sm_90a CTA (mirrors select_sm90.cu): alignment slack, two Q
    tiles and two key tiles of 64 rows, the staging rows, per-warp column sums (G > 16) and the
    block-key rows."""
    tok = 128 >> lgp
    return (1024 + 4 * TILE * D * itemsize + tok * STAGE_STRIDE * 4 + (8 * 64 * 4 if lgp == 5 else 0)
            + (tok * olp * key_bytes if bs_in_smem else 0))


def smem_bytes(D: int, itemsize: int, warps: int, lgp: int, olp: int, key_bytes: int,
               bs_in_smem: bool) -> int:
    """Dynamic shared memory of one SM80 CTA (mirrors the layout in select.cu)."""
    tok = (ROWS_PER_WARP * warps) >> lgp
    return (2 * TILE * D * itemsize + tok * STAGE_STRIDE * 4 + (warps * 64 * 4 if lgp >= 5 else 0)
            + (tok * olp * key_bytes if bs_in_smem else 0))


def choose_tiles(D: int, itemsize: int, lgp: int, olp: int, key_bytes: int, smem_max: int,
                 smem_per_sm: int) -> tuple[int, bool]:
    """(warps, block keys in shared memory) of the SM80 kernel for one launch.

    Prefers 4 warps (128 rows per CTA: each key tile read from L2 serves the most rows) at a size that
    lets two CTAs share an SM; then fewer warps (fewer tokens, so less block-key memory); then any
    size that fits one CTA per SM; else block keys in a global scratch.
    """
    min_warps = max(1, (1 << lgp) // ROWS_PER_WARP)
    choices = [w for w in (4, 2, 1) if w >= min_warps]
    two_per_sm = min(smem_per_sm // 2 - 1024, smem_max)
    for limit in (two_per_sm, smem_max):
        for w in choices:
            if smem_bytes(D, itemsize, w, lgp, olp, key_bytes, True) <= limit:
                return w, True
    for w in choices:
        if smem_bytes(D, itemsize, w, lgp, olp, key_bytes, False) <= smem_max:
            return w, False
    return choices[-1], False     # does not fit at all: the launcher reports it


@dataclasses.dataclass(frozen=True)
class Stage1Plan:
    """What `launch_select` launches.

    kernel: "sm80" or "sm90a" (G <= 32, capability 9.0). warps: warps per CTA (sm90a: 8, its two
    warpgroups; sm80: 1, 2 or 4, enough for one token's G rows). block_keys_in_smem: the block-key
    rows in shared memory, else in a global scratch. topk_prefix: 0 lets the top-K search the
    blocks up to each token's own block first; a positive value shortens that prefix to this many
    blocks (tests: it makes the search fall back to the whole row). range_blocks: 0 runs one launch;
    a positive multiple of 64 splits the key blocks into ranges of that many blocks, one range pass
    each, with an exact merge of the candidates (block keys in shared memory, rows of
    `64 + range_blocks` keys; the launcher uses the global scratch instead when K > range_blocks or
    `return_scores` is asked for). packed: the sm_90a kernel sums each token's probabilities over
    its heads on f16 pairs (16-bit score dtypes, tokens of 3 or more rows; docs/stage1.md,
    "Packed group sum"), within about one bf16 step of the exact float32 sum; False keeps the exact
    path, the one the tests hold to the reference.
    """
    kernel: str
    warps: int
    block_keys_in_smem: bool = True
    topk_prefix: int = 0
    range_blocks: int = 0
    packed: bool = False

    def __post_init__(self):
        if self.kernel not in (SM80, SM90A):
            raise ValueError(f"Stage1Plan.kernel must be 'sm80' or 'sm90a', got {self.kernel!r}")
        allowed = (SM90_THREADS // 32,) if self.kernel == SM90A else (1, 2, 4)
        if self.warps not in allowed:
            raise ValueError(f"Stage1Plan.warps must be one of {allowed} for the {self.kernel} kernel, "
                             f"got {self.warps!r}")
        if not isinstance(self.topk_prefix, int) or self.topk_prefix < 0:
            raise ValueError(f"Stage1Plan.topk_prefix must be an int >= 0, got {self.topk_prefix!r}")
        if not isinstance(self.packed, bool) or (self.packed and self.kernel != SM90A):
            raise ValueError(f"Stage1Plan.packed must be a bool, True only for the sm90a kernel; got "
                             f"{self.packed!r} for {self.kernel}")
        if (isinstance(self.range_blocks, bool) or not isinstance(self.range_blocks, int)
                or self.range_blocks < 0 or self.range_blocks % 64):
            raise ValueError(f"Stage1Plan.range_blocks must be 0 or a positive multiple of 64, got "
                             f"{self.range_blocks!r}")

    def tokens_per_cta(self, G: int) -> int:
        """Tokens whose rows one CTA holds (0: the CTA cannot hold one token's G rows)."""
        rows = 128 if self.kernel == SM90A else ROWS_PER_WARP * self.warps
        return rows >> lgp_of(G)

    def smem_bytes(self, G: int, D: int, itemsize: int, out_len: int, key_bytes: int) -> int:
        """Dynamic shared memory of one launch; with range_blocks, of one range pass."""
        olp = 64 + self.range_blocks if self.range_blocks else -(-out_len // 64) * 64
        in_smem = self.block_keys_in_smem or self.range_blocks > 0
        if self.kernel == SM90A:
            return smem_bytes_sm90(D, itemsize, lgp_of(G), olp, key_bytes, in_smem)
        return smem_bytes(D, itemsize, self.warps, lgp_of(G), olp, key_bytes, in_smem)


def scratch_bytes(plan: Stage1Plan, H: int, total_q: int, out_len: int, key_bytes: int, K: int = 96,
                  HQ: int = 0) -> int:
    """Bytes of the global memory that `plan` needs besides the output: the block-key scratch
    `[H, total_q, olp]` (the memory wall of long sequences, docs/stage1.md, 5. Memory plan) or, for
    a range split, the candidates and the running merge keys (16 B per (KV head, token, slot); the
    output is allocated after the candidates are freed) and the row biases `[total_q, HQ]` float
    (O(total_q x K)); 0 when the block keys live in shared memory."""
    if plan.range_blocks and K <= plan.range_blocks:
        return H * total_q * K * 16 + total_q * HQ * 4
    if plan.block_keys_in_smem:
        return 0
    return H * total_q * (-(-out_len // 64) * 64) * key_bytes


def _range_widths(kernel: str, warps: int, G: int, D: int, itemsize: int, key_bytes: int, smem_max: int,
                  smem_per_sm: int) -> tuple[int, int]:
    """(widest range at two CTAs per SM, widest at one CTA per SM): multiples of 64 blocks whose rows
    (`64 + range` keys per token) fit in shared memory; 0 where none fits."""
    lgp = lgp_of(G)

    def smem(rb):
        if kernel == SM90A:
            return smem_bytes_sm90(D, itemsize, lgp, 64 + rb, key_bytes, True)
        return smem_bytes(D, itemsize, warps, lgp, 64 + rb, key_bytes, True)

    fixed = smem(0)
    per = smem(64) - fixed                       # bytes per 64 blocks of every token's row
    return tuple(max(0, (limit - fixed) // per * 64) if per > 0 else 0
                 for limit in (min(smem_per_sm // 2 - 1024, smem_max), smem_max))


def range_blocks_for(kernel: str, warps: int, G: int, D: int, itemsize: int, key_bytes: int, smem_max: int,
                     smem_per_sm: int) -> int:
    """The key-range width of a split: the widest at two CTAs per SM if it holds RANGE_MIN_TWO_PER_SM
    blocks or more, else the widest at one CTA per SM (each pass costs a merge: fewer, wider passes
    beat occupancy, docs/stage1.md, 9. Long context: key ranges); 0 if none fits."""
    two, one = _range_widths(kernel, warps, G, D, itemsize, key_bytes, smem_max, smem_per_sm)
    return two if two >= RANGE_MIN_TWO_PER_SM else one


@functools.lru_cache(maxsize=1024)
def stage1_plan(capability, G: int, D: int, dtype: torch.dtype, score_dtype: torch.dtype, out_len: int,
                smem_max: int, smem_per_sm: int, kernel: str = "auto", *, rows: int = 0,
                scratch_budget: int = 0) -> Stage1Plan:
    """The stage-1 plan for one call.

    capability: the device's (major, minor); smem_max, smem_per_sm: its opt-in per-block and per-SM
    dynamic shared memory. score_dtype: that of the scores (fp32 keys take 4 bytes, 16-bit ones 2).
    kernel: "auto" (sm_90a on capability 9.0 when G <= 32, else SM80), "sm80" or "sm90a"
    (ValueError on another capability or G > 32). rows: H x total_q, the rows a global block-key
    scratch would hold; scratch_budget: the bytes that scratch may take (`scratch_budget_of`). Where
    the block-key rows do not fit in shared memory, one launch with the scratch is taken while it
    fits the budget, key ranges beyond (rows = 0 or budget 0: ranges always).
    """
    lgp = lgp_of(G)
    sm90a = wants_sm90a(kernel, capability, "stage 1")
    if sm90a and lgp > SM90_MAX_LGP:
        if kernel == SM90A:
            raise ValueError(f"kernel='sm90a' needs G <= {1 << SM90_MAX_LGP} for stage 1 (a token's rows on "
                             f"one or two warps), got G = {G}")
        sm90a = False
    olp = -(-out_len // 64) * 64
    key_bytes = 4 if score_dtype == torch.float32 else 2
    itemsize = dtype.itemsize
    scratch_fits = 0 < rows * olp * key_bytes <= scratch_budget
    # docs/stage1.md, 9. Long context: key ranges: rows in shared memory at two CTAs per SM -> one
    # launch; at one CTA per SM -> ranges at two per SM where they are wide (fewer tokens wait on each
    # SM's exp and top-K); past shared memory -> the global scratch within its budget, else ranges
    if sm90a:
        warps = SM90_THREADS // 32
        full = smem_bytes_sm90(D, itemsize, lgp, olp, key_bytes, True)
        two, _ = _range_widths(SM90A, warps, G, D, itemsize, key_bytes, smem_max, smem_per_sm)
        if full <= min(smem_per_sm // 2 - 1024, smem_max):
            return Stage1Plan(SM90A, warps, True, 0, 0)
        if full <= smem_max:
            split = two >= RANGE_MIN_TWO_PER_SM and olp > two
            return Stage1Plan(SM90A, warps, True, 0, two if split else 0)
        if scratch_fits:
            return Stage1Plan(SM90A, warps, False, 0, 0)
        return Stage1Plan(SM90A, warps, False, 0,
                          range_blocks_for(SM90A, warps, G, D, itemsize, key_bytes, smem_max, smem_per_sm))
    warps, in_smem = choose_tiles(D, itemsize, lgp, olp, key_bytes, smem_max, smem_per_sm)
    if in_smem:
        return Stage1Plan(SM80, warps, True)
    if scratch_fits:
        return Stage1Plan(SM80, warps, False)
    warps = max(1, (1 << lgp) // ROWS_PER_WARP)       # fewest tokens per CTA: the widest ranges
    return Stage1Plan(SM80, warps, False, 0,
                      range_blocks_for(SM80, warps, G, D, itemsize, key_bytes, smem_max, smem_per_sm))
