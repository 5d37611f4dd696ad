# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 03 · Pattern gallery: other systems' sparsity patterns through one block-sparse op
#
# Block-sparse attention users arrive with a pattern from another system: vLLM's and dkernel's
# local + vertical stride, dkernel's arbitrary per-head patterns, FlashInfer's BSR, FlexAttention's
# `BlockMask`, Sliding Tile Attention's 3-D tile windows, SpargeAttn's masks predicted per input.
# `infllm_cupy.patterns` turns each into a `BlockLayout` (which 64-key blocks each query block
# attends, per KV head), and `block_sparse_attn_varlen` runs any layout, forward and backward
# (docs/patterns.md). This notebook shows, per pattern:
#
# 1. its block map per head and its density (share of the causal, or full, attention it computes);
# 2. on a GPU, its forward and forward+backward time against dense attention (skipped on CPU);
# 3. for the predicted SpargeAttn mask, the share of the dense attention mass it keeps against its
#    density, over `cdfthreshd`, next to InfLLM-v2's own selection on the same synthetic sequence.
#
# **How to run.** `pip install -e ".[notebooks]"` (add `gpu` on a GPU machine), then open
# `03_pattern_gallery.ipynb` in Jupyter or run `python 03_pattern_gallery.py` from `notebooks/`. The
# notebook picks its size: on a CUDA GPU, a 32k-token sequence and timings on the kernels; without one,
# 2k tokens on the PyTorch references, no timings (well under a minute). `NB_SMOKE=1` forces the small
# size, `NB_SMOKE=0` the full one. Figures go to `figures/` (or `$NB_FIG_DIR`).

# %%
import math
import os
from pathlib import Path

import torch

SEED = 0
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if os.environ.get("NB_SMOKE") in ("0", "1"):
    SMOKE = os.environ["NB_SMOKE"] == "1"
    why = f"NB_SMOKE={os.environ['NB_SMOKE']}"
else:   # the full size's masks and mass sweeps over 32k tokens take many minutes on a CPU
    SMOKE = DEVICE == "cpu"
    why = "no CUDA GPU" if SMOKE else f"CUDA GPU {torch.cuda.get_device_name()}"
DTYPE = torch.bfloat16
T = 2048 if SMOKE else 32768        # tokens of the one sequence
HQ, H, D = 32, 2, 128               # README head config: 32 query heads on 2 KV heads (G = 16), head dim 128
G = HQ // H
LOCAL, STRIDE = (4, 4) if SMOKE else (16, 8)      # local + vertical stride, 64-token blocks (Phi-3-small)
TOPK, LOCAL_BLOCKS = (8, 4) if SMOKE else (64, 32)   # InfLLM-v2's budget (MiniCPM4: 64, 32)
LOCAL_LEN, TOPIC_LEN = (128, 256) if SMOKE else (256, 1024)
# Sliding Tile Attention: a 2-D (height, width) and a 3-D (frames, height, width) grid of T tokens
GRID2, TILE2, WIN2 = ((32, 64), (8, 8), (3, 3)) if SMOKE else ((128, 256), (8, 8), (5, 5))
GRID3, TILE3, WIN3 = ((8, 16, 16), (2, 4, 8), (3, 3, 1)) if SMOKE else ((8, 64, 64), (2, 8, 8), (3, 3, 3))
CDFS = [0.3, 0.5, 0.7, 0.8, 0.9, 0.95, 0.98, 0.995]   # SpargeAttn cdfthreshd sweep
HEADS_SHOWN = [0, 1, 2, 3]          # query heads drawn per-head
FIG_DIR = Path(os.environ.get("NB_FIG_DIR", "figures"))
FIG_DIR.mkdir(parents=True, exist_ok=True)
hint = " (NB_SMOKE=0 forces the full 32k-token run)" if SMOKE and "NB_SMOKE" not in why else ""
print(f"{'small' if SMOKE else 'full'} size ({why}): T = {T} tokens, HQ {HQ} on H {H}, D {D}, "
      f"local + stride {LOCAL}/{STRIDE}, on {DEVICE}; timings {'skipped (CPU)' if DEVICE == 'cpu' else 'on'}"
      f"{hint}")

# %%
import matplotlib.pyplot as plt
from mpl_toolkits.axes_grid1 import make_axes_locatable

import infllm_cupy.patterns as P
from infllm_cupy.config import InfLLMv2Config
from infllm_cupy.pipeline import infllmv2_attention
from infllm_cupy.stage2 import BlockLayout, block_sparse_attn_varlen
from infllm_cupy.synthetic import structured_sequence
from infllm_cupy.viz import attention_mass_captured, summarize_mass, topk_sweep


def pair_counts(T, q_block, nkb, causal):
    """[NQB, NKB]: (query, key) pairs of query block i and 64-key block j that attention computes."""
    nqb = -(-T // q_block)
    a = (torch.arange(nqb) * q_block).view(-1, 1)
    b = ((torch.arange(nqb) + 1) * q_block).clamp(max=T).view(-1, 1) - 1
    s0 = (torch.arange(nkb) * 64).view(1, -1)
    L = (T - s0).clamp(0, 64)
    if not causal:
        return (b - a + 1) * L

    def upto(x):   # pairs with query t <= x and key s0 <= s <= t
        u = (x - s0 + 1).clamp(min=0)
        inside = torch.minimum(u, L)
        return inside * (inside + 1) // 2 + (u - inside) * L
    return upto(b) - upto(a - 1)


def density(layout, causal=True):
    """Per head of the layout: attended (query, key) pairs / those of dense (causal) attention."""
    m = layout.mask.cpu()
    cnt = pair_counts(T, layout.q_block, m.shape[-1], causal)
    dense = T * (T + 1) // 2 if causal else T * T
    return (m[:, :cnt.shape[0]].long() * cnt).sum((-1, -2)).double() / dense


NOT_BUILT = {}   # pattern -> what is missing from infllm_cupy.patterns


def missing(name, attr):
    if hasattr(P, attr):
        return False
    NOT_BUILT[name] = f"not built yet: infllm_cupy.patterns.{attr}"
    print(f"{name}: {NOT_BUILT[name]}")
    return True


def draw(ax, mask, title, q_block=64, unit="block", k_block=64):
    """One block map: query block down (`q_block` tokens each), key block across (`k_block` tokens each),
    dark = attended; `unit="tile"` names FlexAttention's tiles instead."""
    # beyond a few hundred blocks a one-block stride column is thinner than a pixel: average, don't drop
    interp = "nearest" if max(mask.shape) <= 256 else "antialiased"
    ax.imshow(mask.float().cpu(), cmap="Greys", vmin=0, vmax=1, interpolation=interp, aspect="auto")
    ax.set_title(title, fontsize=9)
    ax.set_xlabel(f"key {unit} ({k_block} tokens)", fontsize=8)
    ax.set_ylabel(f"query {unit} ({q_block} tokens)", fontsize=8)
    ax.tick_params(labelsize=7)


def draw_missing(ax, title, note):
    ax.text(0.5, 0.5, note.replace(": ", ":\n"), ha="center", va="center", fontsize=9, color="tab:red",
            transform=ax.transAxes)
    ax.set_title(title, fontsize=9)
    ax.set_xticks([])
    ax.set_yticks([])


# %% [markdown]
# ## Local + vertical stride (vLLM, dkernel)
#
# Phi-3-small's pattern: block (i, j) is attended when `j <= i` and either `i - j < local_blocks` or
# column j is one of every `vert_stride`-th. With `homo_head=True` all heads share the columns; with
# head sliding each head's columns move by `max(1, vert_stride // num_heads)`, so together the heads
# cover every column. Our layout is per KV head: homogeneous heads collapse to it at no cost
# (`per_kv_head`); sliding heads differ inside a KV head's group, so they run per query head (K/V
# repeated, docs/patterns.md, "Per query head vs per KV head").

# %%
homo = P.local_stride(HQ, T, block_size=64, local_blocks=LOCAL, vert_stride=STRIDE, homo_head=True)
sliding = P.local_stride(HQ, T, block_size=64, local_blocks=LOCAL, vert_stride=STRIDE, homo_head=False)
homo_kv = P.per_kv_head(homo, G)
print(f"homogeneous: per-query-head mask {tuple(homo.mask.shape)} collapses to per-KV-head "
      f"{tuple(homo_kv.mask.shape)}; head sliding collapses: {P.per_kv_head(sliding, G) is not None}")
d_homo, d_sliding = density(homo), density(sliding)
fig, axes = plt.subplots(1, 1 + len(HEADS_SHOWN), figsize=(3.2 * (1 + len(HEADS_SHOWN)), 3.4))
draw(axes[0], homo.mask[0], f"homogeneous (all heads)\ndensity {d_homo[0]:.3f}")
for ax, h in zip(axes[1:], HEADS_SHOWN):
    draw(ax, sliding.mask[h], f"head-sliding, head {h}\ndensity {d_sliding[h]:.3f}")
fig.suptitle(f"local + vertical stride: local_blocks {LOCAL}, vert_stride {STRIDE} (64-token blocks)")
fig.tight_layout()
fig.savefig(FIG_DIR / "03_local_stride.png", dpi=110)

# %% [markdown]
# ## A dkernel per-head pattern through `SparseAttention`
#
# dkernel's `SparseAttention(block_size, block_sparse_pattern)` takes any `[heads, NB, NB]` pattern.
# Here every query head has its own: the sink block, a local window of 4, 8, 12 or 16 blocks by head,
# and every 16th column shifted by the head. The module (batch-first `[B, T, H, D]`) runs it exactly;
# it is checked against the reference on this sequence below.

# %%
nb = T // 64
i, j, hh = torch.arange(nb).view(1, -1, 1), torch.arange(nb).view(1, 1, -1), torch.arange(HQ).view(-1, 1, 1)
per_head = ((j == 0) | (i - j < 4 + 4 * (hh % 4)) | ((j + hh) % 16 == 15)) & (j <= i)
per_head_layout = BlockLayout(per_head.contiguous(), 64)
d_per_head = density(per_head_layout)
fig, axes = plt.subplots(1, len(HEADS_SHOWN), figsize=(3.2 * len(HEADS_SHOWN), 3.4))
for ax, h in zip(axes, HEADS_SHOWN):
    draw(ax, per_head[h], f"head {h}: density {d_per_head[h]:.3f}")
fig.suptitle("a per-head pattern (sink + local window of 4 (1 + h % 4) blocks + stride 16 shifted by h)")
fig.tight_layout()
fig.savefig(FIG_DIR / "03_per_head.png", dpi=110)

# %% [markdown]
# ## The same pattern in other systems' formats
#
# vLLM keeps a CSR per head (`crow`, `col`), FlashInfer a BSR of R x C blocks shared by the heads,
# FlexAttention a `BlockMask` (per 128x128 tile: partial tiles with a mask_mod, full tiles without).
# Each goes in and out exactly; the BlockMask's tiles are coarser than a 64-block pattern, so its
# mask_mod carries the detail (the tiles drawn here are what FlexAttention visits).

# %%
fmt = {}
if not missing("formats", "to_csr"):
    crow, col = P.to_csr(sliding)
    back_csr = P.from_csr(crow, col, q_block=64, num_kv_blocks=sliding.mask.shape[-1])
    fmt["CSR (vLLM), head-sliding"] = (back_csr.mask[HEADS_SHOWN[1]],
                                       bool(torch.equal(back_csr.mask, sliding.mask)), back_csr.q_block)
    indptr, indices = P.to_bsr(homo, R=64, C=64)
    back_bsr = P.from_bsr(indptr, indices, R=64, C=64, num_kv_blocks=homo.mask.shape[-1], num_heads=HQ)
    fmt["BSR (FlashInfer), homogeneous"] = (back_bsr.mask[0], bool(torch.equal(back_bsr.mask, homo.mask)),
                                            back_bsr.q_block)
    aligned = P.local_stride(HQ, T, block_size=128, local_blocks=max(1, LOCAL // 2), vert_stride=STRIDE,
                             num_kv_heads=H)
    bm = P.to_block_mask(aligned, seq_len_q=T, seq_len_kv=T, BLOCK_SIZE=128, causal=True, num_q_heads=HQ)
    back_bm = P.per_kv_head(P.from_block_mask(bm), G)
    fmt["BlockMask (Flex), block 128"] = (back_bm.mask[0], bool(torch.equal(back_bm.mask, aligned.mask)),
                                          back_bm.q_block)
    bm64 = P.to_block_mask(sliding, seq_len_q=T, seq_len_kv=T, BLOCK_SIZE=128, causal=True)
    fmt["BlockMask tiles, head-sliding 64"] = (bm64.to_dense()[0, HEADS_SHOWN[1]], None, 128)
fig, axes = plt.subplots(1, 4, figsize=(13, 3.4))
if fmt:
    for ax, (name, (m, same, qb_tokens)) in zip(axes, fmt.items()):
        title = f"{name}\n" + ("round trip exact" if same else "ROUND TRIP DIFFERS" if same is False
                               else "128x128 tiles FlexAttention visits")
        if same is None:
            draw(ax, m, title, q_block=128, unit="tile", k_block=128)
        else:
            draw(ax, m, title, q_block=qb_tokens)
        if same is not None:
            print(f"{name}: round trip {'exact' if same else 'DIFFERS'}")
    assert all(same is not False for _, same, _ in fmt.values())
else:
    for ax in axes:
        draw_missing(ax, "formats", NOT_BUILT["formats"])
fig.tight_layout()
fig.savefig(FIG_DIR / "03_formats.png", dpi=110)

# %% [markdown]
# ## Sliding Tile Attention: 2-D and 3-D windows, and the permutation
#
# STA groups the tokens of a (frames,) height x width grid into tiles and lets each tile attend the
# tiles of a window around it, whole tiles only (the window is shifted inward at the grid's edge).
# The permutation `perm` orders tokens tile by tile so a tile is a contiguous run of tokens: run the
# op on `q[perm]`, `k[perm]`, `v[perm]` (non-causal) and put the output back with `inv_perm`. Left:
# the position of each grid token in the tiled order; middle: the block map in that order (a query
# block of 64 or 128 tokens lies within one tile); right: which grid tokens the query block at the
# grid's centre attends.

# %%
sta = {}
if not missing("sliding_tile", "sliding_tile"):
    for name, grid, tile, win in (("2-D", GRID2, TILE2, WIN2), ("3-D", GRID3, TILE3, WIN3)):
        lay, perm, inv = P.sliding_tile(grid, tile, win, num_heads=H)
        assert torch.equal(perm[inv], torch.arange(T))
        sta[name] = (lay, perm, inv, grid, tile, win)
        print(f"STA {name}: grid {grid}, tile {tile}, window {win} tiles: q_block {lay.q_block}, "
              f"density {density(lay, causal=False)[0]:.3f}")
fig, axes = plt.subplots(2, 3, figsize=(13, 7.5))
for row, name in zip(axes, ("2-D", "3-D")):
    if name not in sta:
        for ax in row:
            draw_missing(ax, f"STA {name}", NOT_BUILT["sliding_tile"])
        continue
    lay, perm, inv, grid, tile, win = sta[name]
    order = inv.view(grid)                           # grid token -> its position in the tiled order
    frame = order if len(grid) == 2 else order[grid[0] // 2]
    im = row[0].imshow(frame, cmap="viridis", interpolation="nearest")
    row[0].set_title(f"{name}: tiled position of each token" + ("" if len(grid) == 2 else " (middle frame)"),
                     fontsize=9)
    cax = make_axes_locatable(row[0]).append_axes("right", size="5%", pad=0.08)   # a bar as tall as the image
    fig.colorbar(im, cax=cax).set_label("position in the tiled order", fontsize=8)
    cax.tick_params(labelsize=7)
    draw(row[1], lay.mask[0], f"{name} block map (tiled order), density {density(lay, causal=False)[0]:.3f}",
         q_block=lay.q_block)
    centre = torch.tensor(grid) // 2                 # the query block holding the grid's centre token
    flat = int((centre * torch.tensor([math.prod(grid[a + 1:]) for a in range(len(grid))])).sum())
    qb = int(inv[flat]) // lay.q_block
    keys = lay.mask[0, qb].repeat_interleave(64)[:T].float()          # tiled key order
    keys[qb * lay.q_block:(qb + 1) * lay.q_block] = 0.5                # the query block itself, grey
    att = keys[inv].view(grid)                       # back to the grid
    att_f = att if len(grid) == 2 else att[int(centre[0])]
    im = row[2].imshow(att_f, cmap="Greys", vmin=0, vmax=1, interpolation="nearest")
    where = "" if len(grid) == 2 else " in its frame"
    row[2].set_title(f"{name}: grid tokens attended by query block {qb}{where}\n"
                     f"({lay.q_block} tokens, grey)", fontsize=9)
    cax = make_axes_locatable(row[2]).append_axes("right", size="5%", pad=0.08)
    bar = fig.colorbar(im, cax=cax, ticks=[0, 0.5, 1])
    bar.ax.set_yticklabels(["not attended", "the query\nblock", "attended"], fontsize=7)
    for ax in (row[0], row[2]):                      # the grid as laid out: height down, width across
        ax.set_xlabel("width (tokens)", fontsize=8)
        ax.set_ylabel("height (tokens)", fontsize=8)
        ax.tick_params(labelsize=7)
fig.tight_layout()
fig.savefig(FIG_DIR / "03_sliding_tile.png", dpi=110)

# %% [markdown]
# ## A synthetic sequence, InfLLM-v2's selection, and SpargeAttn's predicted mask
#
# `structured_sequence` (notebook 01) plants a sink, local context, recurring topics and needles.
# InfLLM-v2 picks blocks per query *token* from compressed keys (drawn here as the share of a query
# block's tokens that select each key block); SpargeAttn predicts a block mask from mean-pooled
# queries and keys: blocks whose tokens are not self-similar are always kept, and per query block the
# key blocks covering `cdfthreshd` of the pooled attention. SpargeAttn predicts per query head;
# `predict_sparge` keeps the union over the G query heads of each KV head by default, which our
# per-KV-head layout runs at no extra cost (`per_query_head=True` keeps them apart). The prediction
# here is block-causal (`causal=True`), as the attention it feeds.

# %%
data = structured_sequence(T, HQ, H, D, local_len=LOCAL_LEN, topic_len=TOPIC_LEN, dtype=DTYPE, device=DEVICE,
                           seed=SEED)
q, k, v, cu = data.q, data.k, data.v, data.cu_seqlens
cfg = InfLLMv2Config(topk=TOPK, local_blocks=LOCAL_BLOCKS, dense_len=0)
with torch.no_grad():
    _, aux = infllmv2_attention(q, k, v, cu, config=cfg, return_aux=True)
sel = aux["topk_idx"].long().cpu()                                   # [H, T, K]
share = torch.zeros(H, T, nb + 1)
share.scatter_(2, torch.where(sel >= 0, sel, nb), 1.0)
share = share[..., :nb].view(H, nb, 64, nb).mean(2)                  # [H, query block, key block]

SPARGE = not missing("sparge", "predict_sparge")


def sparge_layout(cdf):
    return P.predict_sparge(q, k, cdfthreshd=cdf, causal=True)


fig, axes = plt.subplots(1, 2 * H, figsize=(3.3 * 2 * H, 3.5))
for h in range(H):
    draw(axes[h], share[h], f"InfLLM-v2 selection, KV head {h}\n(share of the block's tokens)", q_block=64)
    for n in data.needles:
        if n.kv_head == h:
            axes[h].plot(n.key_block, n.query_start // 64, "o", mfc="none", color="tab:red", ms=8)
if SPARGE:
    sp = sparge_layout(0.9)
    d_sp = density(sp)
    for h in range(H):
        hh = h if sp.num_kv_heads == H else h * G      # a KV head, or the first query head of its group
        draw(axes[H + h], sp.mask[hh], f"SpargeAttn cdfthreshd 0.9, {'KV ' if sp.num_kv_heads == H else ''}"
             f"head {hh}\ndensity {d_sp[hh]:.3f}", q_block=sp.q_block)
else:
    for h in range(H):
        draw_missing(axes[H + h], f"SpargeAttn, head {h}", NOT_BUILT["sparge"])
fig.tight_layout()
fig.savefig(FIG_DIR / "03_infllm_vs_sparge.png", dpi=110)

# %% [markdown]
# ## Attention mass kept against density
#
# For each mask: the share of every query's dense causal attention that falls in the blocks it
# computes (`attention_mass_captured`, mean over query heads and the second half of the sequence),
# against the share of the causal keys it computes. SpargeAttn over its `cdfthreshd` sweep, InfLLM-v2
# over its top-k budget, and the static patterns (one point each). Up and to the left is better.

# %%
def as_topk(layout):
    """The layout as InfLLM-v2's token-level selection `[heads, T, K]` (ascending, -1 padded) of this
    one sequence, for attention_mass_captured; and its head count. Gathers each token's row directly
    (memory heads x T x K)."""
    m = layout.mask.to(q.device)
    nkb = m.shape[-1]
    K = max(1, int(m.sum(-1).max()))
    ar = torch.arange(nkb, device=m.device)
    rows = torch.where(m, ar, nkb + ar).sort(-1).values[..., :K]        # selected blocks first, ascending
    rows = torch.where(rows < nkb, rows, -1).to(torch.int32)
    qb = torch.arange(T, device=m.device) // layout.q_block
    return rows[:, qb].contiguous(), m.shape[0]


if SMOKE:   # the same rows as BlockLayout.to_topk_idx, which builds a [T, heads, NQB, K] intermediate
    assert torch.equal(as_topk(sliding)[0].cpu(), sliding.to_topk_idx(cu.cpu()))
curves = {}
with torch.no_grad():
    topks = sorted({2, TOPK // 2, TOPK, 2 * TOPK, 4 * TOPK})
    sweep = topk_sweep(aux["block_scores"], cu, T, topks, cfg)
    cm = attention_mass_captured(q, k, cu, sweep, progress=False)
    sums = [summarize_mass(cm[t], cu, from_position=T // 2) for t in topks]
    curves["InfLLM-v2 (top-k sweep)"] = ([s["key_fraction"] for s in sums], [s["mass"] for s in sums])
    k_rep = k.repeat_interleave(G, dim=1)
    static = {"local+stride homogeneous": homo_kv, "local+stride head-sliding": sliding,
              "per-head": per_head_layout}
    for name, lay in static.items():
        idx, heads = as_topk(lay)
        cm = attention_mass_captured(q, k_rep if heads == HQ else k, cu, idx, progress=False)
        s = summarize_mass(cm, cu, from_position=T // 2)
        curves[name] = ([s["key_fraction"]], [s["mass"]])
    if SPARGE:   # the sweep's masks are per KV head (union over the group): one pass for all of them
        cm = attention_mass_captured(q, k, cu, {c: as_topk(sparge_layout(c))[0] for c in CDFS},
                                     progress=False)
        sums = [summarize_mass(cm[c], cu, from_position=T // 2) for c in CDFS]
        curves["SpargeAttn (cdfthreshd sweep)"] = ([s["key_fraction"] for s in sums],
                                                   [s["mass"] for s in sums])
for name, (xs, ys) in curves.items():
    print(f"{name:32s} density " + ", ".join(f"{x:.3f}" for x in xs) + " -> mass "
          + ", ".join(f"{y:.3f}" for y in ys))
fig, ax = plt.subplots(figsize=(6.5, 4.5))
for name, (xs, ys) in curves.items():
    ax.plot(xs, ys, "o-" if len(xs) > 1 else "s", label=name)
if not SPARGE:
    ax.text(0.5, 0.1, "SpargeAttn: " + NOT_BUILT["sparge"], transform=ax.transAxes, ha="center",
            color="tab:red")
ax.set(xlabel="share of causal keys computed (second half of the sequence)",
       ylabel="dense attention mass kept", ylim=(0, 1.02), title="mass kept vs density")
ax.legend(fontsize=8)
fig.tight_layout()
fig.savefig(FIG_DIR / "03_mass_vs_density.png", dpi=110)

# %% [markdown]
# ## Exactness of the per-head module
#
# `SparseAttention` on the per-head pattern against the reference (`block_sparse_attn_varlen` on the
# per-query-head layout with K/V repeated, which on CPU is the PyTorch reference).

# %%
from infllm_cupy.patterns.modules import SparseAttention
from infllm_cupy.stage2 import naive_block_sparse_attn_varlen

mod = SparseAttention(64, per_head).to(DEVICE)
TC = min(T, 2048)        # the reference materialises per-token selections: check on the first 2k tokens
cu_c = torch.tensor([0, TC], dtype=torch.int32, device=DEVICE)
with torch.no_grad():
    out_mod = mod(q[None, :TC], k[None, :TC], v[None, :TC])[0]
    head_rows = BlockLayout(per_head[:, :TC // 64, :TC // 64].to(DEVICE), 64)
    ref = naive_block_sparse_attn_varlen(q[:TC], k_rep[:TC], v[:TC].repeat_interleave(G, dim=1), cu_c, cu_c,
                                         head_rows, TC, TC)
err = (out_mod.float() - ref.float()).abs().max().item()
print(f"first {TC} tokens: max |SparseAttention - reference| = {err:.2e}")
assert err < 5e-2

# %% [markdown]
# ## Time against dense attention (GPU only)
#
# Forward and forward+backward of each pattern on this sequence (B = 1, T tokens, bf16), against
# dense SDPA (cuDNN; causal, or full for the non-causal sliding tile pattern). The dashed mark is
# density x the dense time, where a kernel that wastes nothing on skipped blocks would land. The
# sliding tile pattern is timed on the sequence as it is: the permutation changes which tokens meet,
# not the work. `benchmarks/bench_patterns.py` times the same patterns at 32k x 8 and 128k x 2
# against FlexAttention too.

# %%
def gpu_ms(fn, reps=5):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


if DEVICE == "cpu":
    print("timings skipped: no CUDA GPU (the CPU runs the PyTorch references, whose times say nothing "
          "about the kernels); run on a GPU or see benchmarks/bench_patterns.py")
else:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def run(fwd, mode, *xs):
        if mode == "fwd":
            with torch.no_grad():
                return lambda: fwd(*xs)
        leaves = [x.detach().requires_grad_() for x in xs]
        return lambda: torch.autograd.grad(fwd(*leaves), leaves, torch.ones_like(xs[0]))

    def dense(causal, gqa=True):
        def f(q_, k_, v_):
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                return torch.nn.functional.scaled_dot_product_attention(
                    q_[None].transpose(1, 2), k_[None].transpose(1, 2), v_[None].transpose(1, 2),
                    is_causal=causal, enable_gqa=gqa)[0].transpose(0, 1)
        return f

    try:   # cuDNN may refuse GQA: then dense attention gets K/V repeated to HQ heads, outside the timing
        dense(True)(q[:128], k[:128], v[:128])
        dense_kv, dense_gqa = (k, v), True
    except RuntimeError as e:
        print(f"cuDNN SDPA refuses GQA ({str(e).splitlines()[0][:80]}): dense runs on K/V repeated")
        dense_kv, dense_gqa = (k_rep, v.repeat_interleave(G, dim=1)), False

    def ours(lay, causal):
        rep = lay.num_kv_heads == HQ and H != HQ
        lay = BlockLayout(lay.mask.to(DEVICE), lay.q_block)   # on the device once, not copied per call

        def f(q_, k_, v_):
            if rep:   # a per-query-head pattern: K/V viewed per query head (G = 1)
                k_, v_ = k_.repeat_interleave(G, 1), v_.repeat_interleave(G, 1)
            return block_sparse_attn_varlen(q_, k_, v_, cu, cu, lay, T, T, causal=causal)
        return f

    timed = {"local+stride homogeneous": (homo_kv, True), "local+stride head-sliding": (sliding, True),
             "per-head (module)": (None, True)}
    if "3-D" in sta:
        timed["sliding tile 3-D"] = (sta["3-D"][0], False)
    if SPARGE:
        timed["sparge cdfthreshd 0.9"] = (sp, True)
    rows = []
    for name, (lay, causal) in timed.items():
        fwd = (lambda q_, k_, v_: mod(q_[None], k_[None], v_[None])[0]) if lay is None else ours(lay, causal)
        dens = float((d_per_head if lay is None else density(lay, causal)).mean())
        rec = {"name": name, "density": dens}
        for mode in ("fwd", "fwdbwd"):
            rec[mode] = gpu_ms(run(fwd, mode, q, k, v))
            rec["dense_" + mode] = gpu_ms(run(dense(causal, dense_gqa), mode, q, *dense_kv))
        rows.append(rec)
        print(f"{name:28s} density {dens:.3f}: fwd {rec['fwd']:.2f} ms (dense {rec['dense_fwd']:.2f}), "
              f"fwd+bwd {rec['fwdbwd']:.2f} ms (dense {rec['dense_fwdbwd']:.2f})")
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    x = torch.arange(len(rows)).float()
    for ax, mode in zip(axes, ("fwd", "fwdbwd")):
        ax.bar(x - 0.2, [r[mode] for r in rows], 0.4, label="ours")
        ax.bar(x + 0.2, [r["dense_" + mode] for r in rows], 0.4, label="dense cuDNN", color="tab:gray")
        ax.scatter(x - 0.2, [r["density"] * r["dense_" + mode] for r in rows], marker="_", s=400, color="k",
                   label="density x dense", zorder=3)
        ax.set_xticks(x.tolist(), [r["name"] for r in rows], rotation=20, ha="right", fontsize=8)
        ax.set(ylabel="ms", title=f"{'forward' if mode == 'fwd' else 'forward + backward'}, T = {T}, B = 1")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(FIG_DIR / "03_timing.png", dpi=110)

# %%
if NOT_BUILT:
    print("NOT BUILT YET (cells above show a placeholder):")
    for name, note in NOT_BUILT.items():
        print(f"  {name}: {note}")
else:
    print("every pattern of the gallery ran")
