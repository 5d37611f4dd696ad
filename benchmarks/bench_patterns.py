r"""The pattern zoo: every pattern through our block-sparse op against FlexAttention with the
same mask and dense cuDNN SDPA, forward and forward+backward, in one process.

    python benchmarks/bench_patterns.py                                   # 32kx8 and 128kx2, all patterns
    python benchmarks/bench_patterns.py --patterns local_stride,sparge --modes fwd --json out.json
    python benchmarks/bench_patterns.py --device cpu                      # tiny smoke run (references)

Patterns (rows' `pattern`; heads: README config HQ 32, H 2, D 128, bf16; 128-token blocks where the
pattern allows, so FlexAttention gets whole 128x128 tiles):
    local_stride          vLLM's local + vertical stride, homogeneous heads: block 128, local 8, stride 8
    local_stride_sliding  the same with head-sliding strides: the 16 query heads of a KV head differ, so ours
                          runs the per-query-head kernels (`qhead_block_sparse_attn_varlen`, one query
                          head per CTA, forward and backward, K/V not repeated); `ours_xbwd` the same
                          forward with the backward before BwdPlan.qhead (K/V repeated per query head
                          inside the timed call, the G = 1 backward kernels, dK/dV summed; fwdbwd and bwd
                          modes only); `ours_rep` the older path, K/V repeated to G = 1 for forward and
                          backward (docs/patterns.md, "Per query head vs per KV head")
    per_head              a dkernel-style arbitrary per-query-head pattern over 64-token blocks (head h: sink
                          block, local window of 4 + 4 (h % 4) blocks, vertical stride 16 shifted by h);
                          Flex needs its mask_mod to look the 64-blocks up inside 128 tiles
    sliding_tile          STA on a 3-D (frames, 64, 64) token grid, 2x8x8 = 128-token tiles, non-causal,
                          tokens permuted so tiles are contiguous (permutation not timed)
    sparge                SpargeAttn's predicted mask (`predict_sparge`) on `structured_sequence(T)`, shared
                          by the batch (random q/k/v would predict near-dense); the prediction is timed too
A pattern whose constructor is not in `infllm_cupy.patterns` yet gets rows with note "not built yet".

Implementations: `ours` = `block_sparse_attn_varlen` on the pattern's `BlockLayout` (mask on the device);
`flex` = FlexAttention (torch.compile on CUDA) with a `BlockMask` of 128x128 tiles selecting exactly the
same keys: tiles wholly inside the pattern as `full_kv_*` (no mask_mod), the others it touches (the
causal diagonal; for patterns not aligned to 128 tokens also tiles cut by the pattern) partial, with a
mask_mod that looks the pattern's 64-blocks up (one mask_mod shape for all patterns of a config, so the
compiled kernels are shared); `dense` = SDPA cuDNN dense (causal for causal patterns, full for
sliding_tile), `[B, HQ, T, D]` with enable_gqa (K/V repeated if the backend refuses GQA; on CPU the
default backend). Per config the anchors run first, then ours. Before timing, a check verifies on a
2k-token sequence that each BlockMask makes FlexAttention compute exactly our (query, key) pairs.
Effective TFLOP/s count the keys each query attends under the pattern (causal clipping included; dense:
all of them); bwd = 2.5x, fwdbwd = 3.5x the forward. density = attended keys / dense keys.
Goals: flex ms / ours ms >= 1.2; ours ms / (density x dense ms) <= 1.3.

Time: the default run (2 configs x 5 patterns x fwd,fwdbwd) is estimated, not measured, at about
3.5 to 4 minutes on an H100: about 100 s of FlexAttention compiles (a forward and a backward kernel per
config and causal flag), about 50 s of dense SDPA (a 128kx2 full-attention fwd+bwd call is about 4 s;
warm-up, a sizing call and 3 timed calls), and about 60 s for the sparse rows, our NVRTC compiles and
the SpargeAttn inputs. `--budget-s` (default 240) skips the remaining rows (recorded as skipped; the
anchors stop at 80% of it so ours keeps the rest), so the run cannot go much past 4 minutes.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import _harness as harness  # noqa: E402
from infllm_cupy import _env  # noqa: E402
from infllm_cupy._rules import KV_BLOCK  # noqa: E402
from infllm_cupy.patterns import qhead_block_sparse_attn_varlen  # noqa: E402
from infllm_cupy.selections import uniform_cu_seqlens  # noqa: E402
from infllm_cupy.stage2 import BlockLayout, block_sparse_attn_varlen  # noqa: E402
from infllm_cupy.stage2.qhead import _expanded_bwd, qhead_block_sparse_attn_fwd  # noqa: E402

PATTERNS = ("local_stride", "local_stride_sliding", "per_head", "sliding_tile", "sparge")
IMPLS = ("ours", "ours_xbwd", "ours_rep", "flex", "dense")
FLEX_TILE = 128
NOT_BUILT = "not built yet"
GOAL_FLEX, GOAL_DENSITY = 1.2, 1.3


@dataclasses.dataclass
class PRow(harness.Row):
    """A harness row plus the pattern's density (attended keys / dense keys) and the peak GPU memory
    allocated while the row was timed (GiB, inputs included)."""
    density: float | None = None
    peak_gib: float | None = None


class _QheadExpandedBwd(torch.autograd.Function):
    """`ours_xbwd`: the per-query-head forward kernels with the backward as it was before
    BwdPlan.qhead (K/V repeated to HQ heads, the G = 1 backward kernels, dK/dV summed in fp32)."""

    @staticmethod
    def forward(ctx, q, k, v, cu, mask, q_block, T, causal):
        scale = q.shape[2] ** -0.5
        out, lse = qhead_block_sparse_attn_fwd(q, k, v, cu, cu, mask, q_block, T, T, causal, scale, "auto")
        ctx.save_for_backward(q, k, v, out, lse, cu, mask)
        ctx.args = (q_block, T, T, causal, scale, "auto")
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, cu, mask = ctx.saved_tensors
        dq, dk, dv = _expanded_bwd(dout.contiguous(), q, k, v, out, lse, cu, cu, mask, *ctx.args)
        return dq, dk, dv, None, None, None, None, None


@dataclasses.dataclass
class Pattern:
    """A built pattern: its layout (per KV head, or per query head when a group's heads differ)."""
    name: str
    layout: BlockLayout | None
    causal: bool = True
    per_q_head: bool = False
    perm: torch.Tensor | None = None
    note: str = ""
    predict: Callable[[], object] | None = None     # the predictor, timed as its own row (sparge)


# ------------------------------------------------------------------------------------------------ patterns


def _collapse(mask: torch.Tensor, q_block: int, G: int) -> tuple[BlockLayout, bool]:
    """Per-KV-head layout when the G heads of every group agree, else the per-query-head one."""
    hq = mask.shape[-3]
    grouped = mask.reshape(hq // G, G, *mask.shape[-2:])
    if bool((grouped == grouped[:, :1]).all()):
        return BlockLayout(grouped[:, 0].contiguous(), q_block), False
    return BlockLayout(mask.contiguous(), q_block), True


def per_head_mask(HQ: int, T: int) -> torch.Tensor:
    """bool `[HQ, NB, NB]` over 64-token blocks: head h keeps block 0, a local window of 4 + 4 (h % 4)
    blocks and every 16th column shifted by h (a dkernel-style pattern that differs per query head)."""
    nb = -(-T // KV_BLOCK)
    i = torch.arange(nb).view(1, -1, 1)
    j = torch.arange(nb).view(1, 1, -1)
    h = torch.arange(HQ).view(-1, 1, 1)
    keep = (j == 0) | (i - j < 4 + 4 * (h % 4)) | ((j + h) % 16 == 15)
    return (keep & (j <= i)).contiguous()


def tile_grid(T: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """A 3-D (frames, height, width) grid of T tokens and a 128-token tile (2, 8, 8)."""
    side = 64 if T % (2 * 64 * 64) == 0 else 16 if T % (2 * 16 * 16) == 0 else 8
    if T % (2 * side * side):
        raise ValueError(f"T={T} is not a multiple of {2 * side * side} (2 frames of {side}x{side})")
    return (T // (side * side), side, side), (2, 8, 8)


def build_pattern(name: str, T: int, HQ: int, H: int, device: torch.device, seed: int, args) -> Pattern:
    """Build one pattern for sequences of T tokens; a constructor not in the package yet gives a note."""
    G = HQ // H
    try:
        import infllm_cupy.patterns as P
    except Exception as e:  # noqa: BLE001 - the package may be mid-edit: the other rows still run
        return Pattern(name, None, note=f"{NOT_BUILT}: infllm_cupy.patterns ({harness.short_error(e)})")
    if name in ("local_stride", "local_stride_sliding"):
        if not hasattr(P, "local_stride"):
            return Pattern(name, None, note=f"{NOT_BUILT}: infllm_cupy.patterns.local_stride")
        lay = P.local_stride(HQ, T, block_size=128, local_blocks=8, vert_stride=8,
                             homo_head=name == "local_stride")
        layout, per_q = _collapse(lay.mask, lay.q_block, G)
        return Pattern(name, layout, per_q_head=per_q)
    if name == "per_head":
        layout, per_q = _collapse(per_head_mask(HQ, T), KV_BLOCK, G)
        return Pattern(name, layout, per_q_head=per_q)
    if name == "sliding_tile":
        if not hasattr(P, "sliding_tile"):
            return Pattern(name, None, causal=False, note=f"{NOT_BUILT}: infllm_cupy.patterns.sliding_tile")
        grid, tile = tile_grid(T)
        lay, perm, _ = P.sliding_tile(grid, tile, args.sta_window, num_heads=H)
        return Pattern(name, lay, causal=False, perm=perm)
    if name == "sparge":
        if not hasattr(P, "predict_sparge"):
            return Pattern(name, None, note=f"{NOT_BUILT}: infllm_cupy.patterns.predict_sparge")
        from infllm_cupy.synthetic import structured_sequence
        data = structured_sequence(T, HQ, H, args.d, dtype=torch.bfloat16, device=device, seed=seed)

        def predict():
            return P.predict_sparge(data.q, data.k, cdfthreshd=args.cdfthreshd, causal=True)

        lay = predict()
        mask = lay.mask[0] if lay.per_sequence else lay.mask
        if mask.shape[0] == HQ and H != HQ:
            layout, per_q = _collapse(mask, lay.q_block, G)
        else:
            layout, per_q = BlockLayout(mask.contiguous(), lay.q_block), False
        return Pattern(name, layout, per_q_head=per_q, predict=predict)
    raise ValueError(f"unknown pattern {name!r}")


# ---------------------------------------------------------------------------------------------- key counts


def pair_counts(T: int, q_block: int, nkb: int, causal: bool, device="cpu") -> torch.Tensor:
    """int64 `[NQB, NKB]`: (query, key) pairs of query block i (q_block tokens) and 64-key block j that
    attention computes, tokens past T dropped, keys after the query dropped when causal."""
    nqb = -(-T // q_block)
    a = (torch.arange(nqb, device=device) * q_block).view(-1, 1)              # first query of the block
    b = ((torch.arange(nqb, device=device) + 1) * q_block).clamp(max=T).view(-1, 1) - 1
    s0 = (torch.arange(nkb, device=device) * KV_BLOCK).view(1, -1)
    L = (T - s0).clamp(min=0, max=KV_BLOCK)                                  # keys in the block
    if not causal:
        return (b - a + 1) * L

    def upto(x):   # sum over queries t <= x of the keys s0 <= s <= t in the block
        u = (x - s0 + 1).clamp(min=0)
        inside = torch.minimum(u, L)
        return inside * (inside + 1) // 2 + (u - inside) * L
    return upto(b) - upto(a - 1)


def attended_keys(p: Pattern, T: int, B: int, HQ: int) -> int:
    """Sum over (query token, query head) of the keys each attends under the pattern (the FLOP basis)."""
    m = p.layout.mask
    cnt = pair_counts(T, p.layout.q_block, m.shape[-1], p.causal, m.device)
    nqb = cnt.shape[0]
    per_head = (m[..., :nqb, :].long() * cnt).sum()
    return int(per_head) * B * (1 if p.per_q_head else HQ // m.shape[-3])


def dense_keys(T: int, B: int, HQ: int, causal: bool) -> int:
    return HQ * B * (T * (T + 1) // 2 if causal else T * T)


# --------------------------------------------------------------------------------------------- BlockMask


def _lookup_mod(lut: torch.Tensor, causal: bool):
    """The mask_mod of partial tiles: the pattern's 64x64 block (per query head), and causality.
    One code object per causal flag and a look-up table of one shape per config for every pattern,
    so the compiled FlexAttention kernels are shared by the patterns instead of built per pattern."""
    if causal:
        def mask_mod(b, h, q_idx, kv_idx):
            return lut[h, q_idx // KV_BLOCK, kv_idx // KV_BLOCK] & (q_idx >= kv_idx)
    else:
        def mask_mod(b, h, q_idx, kv_idx):
            return lut[h, q_idx // KV_BLOCK, kv_idx // KV_BLOCK]
    return mask_mod


def _ordered(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    nk = mask.shape[-1]
    idx = torch.where(mask, torch.arange(nk, device=mask.device), nk).sort(dim=-1).values
    return mask.sum(-1, dtype=torch.int32), torch.where(idx == nk, 0, idx).to(torch.int32)


def flex_block_mask(p: Pattern, T: int, HQ: int, BlockMask):
    """A BlockMask of 128x128 tiles (one batch row, broadcast; HQ heads) selecting exactly the pattern's keys.

    A tile wholly inside the pattern and strictly below the diagonal (or anywhere, non-causal) is a
    full tile (no mask_mod); a tile only partly inside, or on the diagonal, is a partial tile whose
    mask_mod looks the pattern's 64-blocks up and applies causality. For a pattern aligned to 128
    tokens the only partial tiles are the diagonal ones (`aligned`)."""
    m, qb = p.layout.mask, p.layout.q_block
    if qb % KV_BLOCK:
        raise ValueError(f"q_block {qb} is not a multiple of {KV_BLOCK}")
    G = HQ // m.shape[-3]
    n64 = -(-T // KV_BLOCK)
    fine = m.repeat_interleave(qb // KV_BLOCK, dim=-2)[:, :n64, :n64]        # [Hl, n64, n64] 64x64 blocks
    nt = -(-T // FLEX_TILE)
    fine = torch.nn.functional.pad(fine, (0, 2 * nt - n64, 0, 2 * nt - n64))
    sub = fine.view(fine.shape[0], nt, 2, nt, 2)
    i = torch.arange(2 * nt, device=m.device)
    if p.causal:   # a 64x64 sub-block strictly after the diagonal computes nothing: drop it before "any"
        sub = (sub & (i.view(-1, 1) >= i.view(1, -1)).view(1, nt, 2, nt, 2))
    any_, all_ = sub.any(4).any(2), sub.all(4).all(2)                        # [Hl, nt, nt]
    ti = torch.arange(nt, device=m.device)
    below = (ti.view(-1, 1) > ti.view(1, -1)) if p.causal else torch.ones(nt, nt, dtype=torch.bool,
                                                                         device=m.device)
    full = all_ & below
    partial = any_ & ~full
    aligned = bool((partial & below).sum() == 0)       # partial tiles only on the diagonal (or none)
    lut = fine.repeat_interleave(G, dim=0).contiguous()                     # [HQ, 2 nt, 2 nt]
    mask_mod = _lookup_mod(lut, p.causal)
    def rep(x):
        return x.repeat_interleave(G, dim=0)[None].contiguous()
    num, ind = _ordered(partial)
    fnum, find = _ordered(full)
    bm = BlockMask.from_kv_blocks(rep(num), rep(ind), rep(fnum), rep(find), BLOCK_SIZE=FLEX_TILE,
                                  mask_mod=mask_mod, seq_lengths=(T, T))
    return bm, mask_mod, aligned


# ------------------------------------------------------------------------------------------------ runner


class Runner:
    def __init__(self, args, device: torch.device):
        self.args, self.device = args, device
        self.rows: list[PRow] = []
        self.t_start = time.perf_counter()

    def over_budget(self, impl: str) -> bool:
        # the anchors stop at 80% of the budget so that ours (timed after them per config) keeps the rest
        limit = self.args.budget_s * (1.0 if impl in ("ours", "ours_xbwd", "ours_rep", "predict") else 0.8)
        return self.args.budget_s > 0 and time.perf_counter() - self.t_start > limit

    def time(self, row: PRow, forward: Callable | None, inputs, keys: int | None, *, skip: str = "") -> PRow:
        """Time one row; a failure (or `skip`) is recorded in `row.note` and the run goes on."""
        a = self.args
        if keys is not None:
            row.keys_per_q = keys / self.n_q_rows
            row.flop = harness.flops_attn(keys, a.d, row.mode)
        why = harness.skip_reason(skip, forward, self.over_budget(row.impl), a.budget_s)
        if why:
            row.note = why
        else:
            fn = None
            try:
                fn = harness.make_fn(forward, inputs, row.mode) if row.impl != "predict" else forward
                if self.device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(self.device)
                harness.time_row(row, fn, a, self.device)
                if self.device.type == "cuda":
                    row.peak_gib = torch.cuda.max_memory_allocated(self.device) / 2**30
            except Exception as e:  # noqa: BLE001 - one failing row must not kill the table
                row.note = (row.note + "; " if row.note else "") + harness.short_error(e)
            finally:
                del fn
                harness.free_gpu_memory(self.device)
        self.rows.append(row)
        tqdm.write(f"  {row.impl:<7} {row.config} {row.selection:<20} {row.mode:<6} "
                   f"ms={row.ms if row.ms is None else round(row.ms, 3)} "
                   f"TFLOP/s={row.tflops if row.tflops is None else round(row.tflops, 1)} {row.note}")
        return row


def sdpa_fn(device: torch.device, causal: bool, gqa: bool = True):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    ctx = ((lambda: sdpa_kernel([SDPBackend.CUDNN_ATTENTION])) if device.type == "cuda"
           else contextlib.nullcontext)

    def sdpa(q_, k_, v_):
        with ctx():
            return torch.nn.functional.scaled_dot_product_attention(q_, k_, v_, is_causal=causal,
                                                                    enable_gqa=gqa)
    return sdpa


def bench_config(r: Runner, T: int, B: int, phase: str, flex, BlockMask, cache: dict):
    """One (T, B): in phase "anchors" dense and Flex rows, in phase "ours" our rows (and the predictor)."""
    a, dev = r.args, r.device
    HQ, H, D = a.hq, a.h, a.d
    G = HQ // H
    cfg = harness.shape_id(B, T, HQ, H, D)
    r.n_q_rows = B * T * HQ
    g = torch.Generator(device=dev).manual_seed(a.seed)
    q = torch.randn(B * T, HQ, D, generator=g, device=dev, dtype=torch.bfloat16)
    k = torch.randn(B * T, H, D, generator=g, device=dev, dtype=torch.bfloat16)
    v = torch.randn(B * T, H, D, generator=g, device=dev, dtype=torch.bfloat16)
    cu = uniform_cu_seqlens(B, T, dev)
    bhtd = None
    if phase == "anchors":
        bhtd = tuple(x.view(B, T, x.shape[1], D).transpose(1, 2).contiguous() for x in (q, k, v))

    pats = []
    for name in a.patterns:
        key = (name, T)
        if key not in cache:
            try:
                p = build_pattern(name, T, HQ, H, dev, a.seed, a)
                if p.layout is not None:   # on the device once: the op would copy a host mask every call
                    p.layout = BlockLayout(p.layout.mask.to(dev), p.layout.q_block)
                cache[key] = p
            except Exception as e:  # noqa: BLE001 - a broken constructor is a row note, not a crash
                cache[key] = Pattern(name, None, note=f"build failed: {harness.short_error(e)}")
        pats.append(cache[key])

    if phase == "anchors" and "dense" in a.impls:
        for causal in sorted({p.causal for p in pats if p.layout is not None}, reverse=True):
            keys = dense_keys(T, B, HQ, causal)
            for mode in a.modes:
                row = r.time(PRow("dense", cfg, "causal" if causal else "full", None, mode, density=1.0),
                              sdpa_fn(dev, causal), bhtd, keys)
                if row.ms is None and dev.type == "cuda" and not row.note.startswith("skipped"):
                    r.rows.pop()     # GQA refused by this backend: K/V repeated to HQ heads instead
                    kr, vr = (x.repeat_interleave(G, dim=1) for x in bhtd[1:])
                    r.time(PRow("dense", cfg, "causal" if causal else "full", None, mode, density=1.0,
                                note=f"KV repeated ({row.note[:80]})"), sdpa_fn(dev, causal, gqa=False),
                           (bhtd[0], kr, vr), keys)
                    del kr, vr

    for p in tqdm(pats, desc=f"{cfg} {phase}", disable=None, leave=False):
        keys = attended_keys(p, T, B, HQ) if p.layout is not None else None
        dens = keys / dense_keys(T, B, HQ, p.causal) if keys is not None else None
        skip = p.note if p.layout is None else ""
        if phase == "anchors" and "flex" in a.impls:
            fn, note = None, ""
            if not skip:
                try:
                    bm, _, aligned = flex_block_mask(p, T, HQ, BlockMask)
                    note = "" if aligned else "partial tiles off the diagonal (pattern not 128-aligned)"

                    def fn(q_, k_, v_, bm=bm):
                        return flex(q_, k_, v_, block_mask=bm, enable_gqa=True)
                except Exception as e:  # noqa: BLE001
                    skip = f"BlockMask: {harness.short_error(e)}"
            for mode in a.modes:
                r.time(PRow("flex", cfg, p.name, None, mode, density=dens, note=note), fn, bhtd, keys,
                       skip=skip)
            fn = bm = None
        if phase == "ours" and "ours_rep" in a.impls and p.per_q_head:
            # the path before the per-query-head kernels: K/V repeated to G = 1, forward and backward
            def fn_rep(q_, k_, v_, lay=p.layout, causal=p.causal):
                k_, v_ = k_.repeat_interleave(G, 1), v_.repeat_interleave(G, 1)
                return block_sparse_attn_varlen(q_, k_, v_, cu, cu, lay, T, T, causal=causal)
            for mode in a.modes:
                r.time(PRow("ours_rep", cfg, p.name, None, mode, density=dens,
                            note="KV repeated per query head (G=1)"), fn_rep, (q, k, v), keys, skip=skip)
            fn_rep = None
        if phase == "ours" and "ours_xbwd" in a.impls and p.per_q_head and dev.type == "cuda":
            mask_dev = p.layout.mask.to(dev)

            def fn_xbwd(q_, k_, v_, mask=mask_dev, q_block=p.layout.q_block, causal=p.causal):
                return _QheadExpandedBwd.apply(q_, k_, v_, cu, mask, q_block, T, causal)
            for mode in a.modes:
                if mode != "fwd":       # the forward is ours'
                    r.time(PRow("ours_xbwd", cfg, p.name, None, mode, density=dens,
                                note="per-query-head fwd; bwd: KV repeated (before BwdPlan.qhead)"), fn_xbwd,
                           (q, k, v), keys, skip=skip)
            fn_xbwd = None
        if phase == "ours" and "ours" in a.impls:
            fn, note = None, ""
            if not skip:
                lay, causal = p.layout, p.causal
                if p.per_q_head:
                    note = ("per-query-head rows, one head per CTA (fwd and bwd)" if dev.type == "cuda"
                            else "per-query-head layout; CPU reference: KV repeated per query head")

                    def fn(q_, k_, v_, lay=lay, causal=causal):
                        return qhead_block_sparse_attn_varlen(q_, k_, v_, cu, cu, lay, T, T, causal=causal)
                else:
                    def fn(q_, k_, v_, lay=lay, causal=causal):
                        return block_sparse_attn_varlen(q_, k_, v_, cu, cu, lay, T, T, causal=causal)
            for mode in a.modes:
                r.time(PRow("ours", cfg, p.name, None, mode, density=dens, note=note), fn, (q, k, v), keys,
                       skip=skip)
            if p.predict is not None and "fwd" in a.modes:
                with torch.no_grad():
                    r.time(PRow("predict", cfg, p.name, None, "fwd", note="predict_sparge on one sequence"),
                           p.predict, (), None)
            fn = None
    del q, k, v, bhtd
    harness.free_gpu_memory(dev)


def _tiles(num: torch.Tensor, ind: torch.Tensor, nt: int) -> torch.Tensor:
    """bool `[HQ, NQ, NK]` from a BlockMask's (num_blocks, indices) pair (first batch row)."""
    num, ind = num[0].long(), ind[0].long()
    valid = torch.arange(ind.shape[-1], device=ind.device) < num[..., None]
    out = torch.zeros(*num.shape, nt + 1, dtype=torch.bool, device=ind.device)
    out.scatter_(-1, torch.where(valid, ind, nt), True)
    return out[..., :nt]


def flex_token_mask(bm, mask_mod, T: int, HQ: int) -> torch.Tensor:
    """bool `[HQ, T, T]`: the (query, key) pairs compiled FlexAttention computes with `bm`: every pair
    of a full tile, the pairs of a partial tile that `mask_mod` keeps, nothing elsewhere. (Eager
    FlexAttention ignores the block lists and applies mask_mod everywhere, so comparing eager outputs
    would not test them.)"""
    nt = -(-T // FLEX_TILE)
    full = _tiles(bm.full_kv_num_blocks, bm.full_kv_indices, nt)
    part = _tiles(bm.kv_num_blocks, bm.kv_indices, nt)
    def up(t):
        return t.repeat_interleave(FLEX_TILE, 1).repeat_interleave(FLEX_TILE, 2)[:, :T, :T]
    dev = bm.kv_indices.device
    h = torch.arange(HQ, device=dev).view(-1, 1, 1)
    qi, ki = torch.arange(T, device=dev).view(1, -1, 1), torch.arange(T, device=dev).view(1, 1, -1)
    kept = torch.ones(1, 1, 1, dtype=torch.bool, device=dev) if mask_mod is None else mask_mod(0, h, qi, ki)
    return up(full) | (up(part) & kept)


def pattern_token_mask(p: Pattern, T: int, HQ: int) -> torch.Tensor:
    """bool `[HQ, T, T]`: the (query, key) pairs our op attends under the pattern."""
    m = p.layout.mask
    m = m.repeat_interleave(HQ // m.shape[0], 0).repeat_interleave(p.layout.q_block, 1)[:, :T]
    m = m.repeat_interleave(KV_BLOCK, 2)[:, :, :T]
    if p.causal:
        m = m & torch.ones(T, T, dtype=torch.bool, device=m.device).tril()
    return m


def run_check(a, dev, BlockMask) -> str:
    """Per pattern, on one short sequence: the BlockMask built here makes FlexAttention compute exactly
    the (query, key) pairs ours attends (token level, no tolerance)."""
    T = min(a.configs[0][0], 2048)
    verdicts, ok_all = [], True
    for name in a.patterns:
        try:
            p = build_pattern(name, T, a.hq, a.h, dev, a.seed, a)
            if p.layout is None:
                verdicts.append(f"{name}: {p.note}")
                continue
            bm, mask_mod, _ = flex_block_mask(p, T, a.hq, BlockMask)
            want, got = pattern_token_mask(p, T, a.hq), flex_token_mask(bm, mask_mod, T, a.hq)
            bad = int((want != got).sum())
            ok = bad == 0
            verdicts.append(f"{name}: {'ok' if ok else 'FAIL'} ({bad} pairs differ of {want.numel()})")
        except Exception as e:  # noqa: BLE001
            ok = False
            verdicts.append(f"{name}: ERROR {harness.short_error(e)}")
        ok_all &= ok
    return f"check (T={T}) " + ("PASSED: " if ok_all else "FAILED: ") + "; ".join(verdicts)


# ---------------------------------------------------------------------------------------------- reporting


def goal_table(rows: list[PRow], on_gpu: bool = True) -> list[dict]:
    """One line per (config, pattern, mode) with ours: ms of each implementation and the goal ratios
    (the verdict only on a GPU: on CPU both sides run PyTorch references)."""
    idx = {(x.impl, x.config, x.selection, x.mode): x for x in rows}
    out = []
    for x in rows:
        if x.impl != "ours":
            continue
        p = PATTERN_CAUSAL.get((x.config, x.selection), True)
        fl = idx.get(("flex", x.config, x.selection, x.mode))
        rp = idx.get(("ours_rep", x.config, x.selection, x.mode))
        xb = idx.get(("ours_xbwd", x.config, x.selection, x.mode))
        de = idx.get(("dense", x.config, "causal" if p else "full", x.mode))
        rec = {"config": x.config, "pattern": x.selection, "mode": x.mode, "density": x.density,
               "ours_ms": x.ms, "ours_TFLOP/s": x.tflops, "flex_ms": fl.ms if fl else None,
               "dense_ms": de.ms if de else None,
               "flex/ours": None, "ours/(dens*dense)": None, "goals": "-",
               "rep/ours": rp.ms / x.ms if rp and rp.ms and x.ms else None,
               "xbwd/ours": xb.ms / x.ms if xb and xb.ms and x.ms else None,
               "ours_GiB": x.peak_gib, "xbwd_GiB": xb.peak_gib if xb else None}
        if x.ms and fl and fl.ms:
            rec["flex/ours"] = fl.ms / x.ms
            x.ratios["flex/ours"] = rec["flex/ours"]
        if x.ms and de and de.ms and x.density:
            rec["ours/(dens*dense)"] = x.ms / (x.density * de.ms)
            x.ratios["ours/(density*dense)"] = rec["ours/(dens*dense)"]
        if not on_gpu:
            rec["goals"] = "n/a (cpu)"
        elif rec["flex/ours"] is not None and rec["ours/(dens*dense)"] is not None:
            ok = rec["flex/ours"] >= GOAL_FLEX and rec["ours/(dens*dense)"] <= GOAL_DENSITY
            rec["goals"] = "met" if ok else "MISSED"
        out.append(rec)
    return out


PATTERN_CAUSAL: dict[tuple[str, str], bool] = {}




def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    harness.add_run_args(p, target_ms=300.0, min_rep=3, max_rep=10)
    p.set_defaults(budget_s=240.0)
    for act in p._actions:   # the shared help names the stage benchmarks' default configs
        if act.dest == "configs":
            act.help = "comma-separated TxB (k = 1024). Default: 32kx8,128kx2 (--quick: 8kx2; on CPU 2048x1)"
    p.add_argument("--patterns", default=",".join(PATTERNS), help=f"subset of {','.join(PATTERNS)}")
    p.add_argument("--modes", default="fwd,fwdbwd", help=f"subset of {','.join(harness.MODES)}. "
                                                                "Default: fwd,fwdbwd")
    p.add_argument("--impls", default=",".join(IMPLS), help=f"subset of {','.join(IMPLS)}")
    p.add_argument("--skip-check", action="store_true",
                   help="skip the check that each BlockMask selects exactly the pattern's (query, key) pairs")
    p.add_argument("--cdfthreshd", type=float, default=0.9, help="SpargeAttn's cumulative-mass threshold")
    p.add_argument("--sta-window", default="3,3,3",
                   help="STA window in tiles per axis (frames, height, width). Default: 3,3,3")
    a = p.parse_args(argv)
    dev = torch.device(a.device)
    if a.configs is None:
        a.configs = ("8kx2" if a.quick else "32kx8,128kx2") if dev.type == "cuda" else "2048x1"
        if dev.type != "cuda" and a.hq == 32 and a.h == 2 and a.d == 128:
            a.hq, a.h, a.d = 4, 2, 32          # CPU smoke: the references are slow; the shapes stay GQA
    a.configs = [harness.parse_config(c) for c in a.configs.split(",") if c]
    a.patterns = harness.csv_choices(p, "--patterns", a.patterns, PATTERNS)
    a.modes = harness.csv_choices(p, "--modes", a.modes, harness.MODES)
    a.impls = harness.csv_choices(p, "--impls", a.impls, IMPLS)
    a.sta_window = tuple(int(x) for x in a.sta_window.split(","))
    harness.check_run_args(p, a, quick_target_ms=100.0, quick_max_rep=5)
    return a


def main(argv=None) -> list[PRow]:
    a = parse_args(argv)
    dev = torch.device(a.device)
    env = harness.env_stamp()
    harness.print_env(env)
    print(f"configs {a.configs}, patterns {a.patterns}, modes {a.modes}, HQ {a.hq} H {a.h} D {a.d}, "
          f"budget {a.budget_s:g} s", flush=True)
    r = Runner(a, dev)

    flex, BlockMask = harness.setup_flex(dev, compile_=not a.no_compile,
                                         backward=any(m != "fwd" for m in a.modes))

    check = "check skipped (--skip-check)" if a.skip_check else run_check(a, dev, BlockMask)
    print(check, flush=True)
    cache: dict = {}
    # per config: the anchors, then ours, so that a crash in ours cannot cost that config's anchors
    for T, B in tqdm(a.configs, desc="configs", unit="config", disable=None):
        for phase in ("anchors", "ours"):
            if phase == "ours" and not {"ours", "ours_xbwd", "ours_rep"} & set(a.impls):
                continue
            # the launcher's host-side input checks (a sync per call) are not timed
            ctx = _env.override(validate=False) if phase == "ours" else contextlib.nullcontext()
            try:
                with ctx:
                    bench_config(r, T, B, phase, flex, BlockMask, cache)
            except Exception as e:  # noqa: BLE001 - e.g. OOM building inputs: record it, go on
                r.rows.append(PRow(phase, harness.shape_id(B, T, a.hq, a.h, a.d),
                                   note=f"config failed: {harness.short_error(e)}"))
                tqdm.write(f"config {T}x{B} ({phase}) failed: {harness.short_error(e)}")
                harness.free_gpu_memory(dev)
            if a.json:
                harness.write_json(r.rows, a.json, env, extra={"check": check, "argv": sys.argv[1:]})
    for (name, T), p in cache.items():
        for B in {b for t, b in a.configs if t == T}:
            PATTERN_CAUSAL[(harness.shape_id(B, T, a.hq, a.h, a.d), name)] = p.causal

    peak = torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else float("nan")
    order = {i: n for n, i in enumerate(("dense", "flex", "ours_rep", "ours_xbwd", "ours", "predict"))}
    cfg_order = {harness.shape_id(B, T, a.hq, a.h, a.d): n for n, (T, B) in enumerate(a.configs)}
    r.rows.sort(key=lambda x: (cfg_order.get(x.config, 99), x.selection, order.get(x.impl, 9),
                               harness.MODES.index(x.mode) if x.mode in harness.MODES else 9))
    goals = goal_table(r.rows, on_gpu=dev.type == "cuda")
    harness.print_table(r.rows, ("impl", "config", "selection", "mode", "density", "ms", "tflops",
                                 "keys_per_q", "peak_gib", "reps", "note"),
                        title="All rows (selection = pattern; ms = median; TFLOP/s effective on attended "
                              "keys)")
    cols = ["config", "pattern", "mode", "density", "ours_ms", "ours_TFLOP/s", "flex_ms", "dense_ms",
            "flex/ours", "ours/(dens*dense)", "rep/ours", "xbwd/ours", "ours_GiB", "xbwd_GiB", "goals"]
    print(f"\n### Patterns against FlexAttention and dense cuDNN (goals: flex/ours >= {GOAL_FLEX}, "
          f"ours/(density x dense) <= {GOAL_DENSITY})\n")
    print(harness.markdown_table(goals, cols) if goals else "(no ours rows)", flush=True)
    print(f"\n{check}")
    print(harness.env_line(env, r.t_start, f"peak GPU memory {peak:.1f} GiB"), flush=True)
    if a.json:
        harness.write_json(r.rows, a.json, env, extra={"check": check, "argv": sys.argv[1:], "peak_gib": peak,
                                                       "goals": goals})
    return r.rows


if __name__ == "__main__":
    main()
