# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.7
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 02 · Decode: what InfLLM-v2 reads while generating, and what H2O would keep
#
# During generation each new token's query attends to its sequence's KV cache. InfLLM-v2 decode
# (`infllm_cupy.decode.infllmv2_decode`) scores the cache's compressed keys (stage 1), forces block 0
# and the local window, picks the best other 64-key blocks (top-k), and attends to those
# `K = topk + local_blocks` blocks only (`sparse_decode`). The selection is redone at **every step**,
# from the current token's query. H2O, a cache-eviction policy, instead keeps for good the positions
# that received the most attention so far (heavy hitters) plus a recent window; it needs the
# attention weights, which `return_attn_weights=True` gives (`docs/decode.md`, "Attention weights").
#
# On a synthetic sequence with an attention sink, local context, recurring topics and "needles" (a
# block of keys early on that a later run of 64 queries looks for), this notebook decodes a few hundred
# tokens (thousands on a GPU) on a `DecodeCache` and shows:
#
# 1. which blocks each step picks, over time, and whether the steps whose query looks for a needle
#    retrieve its block (against the same steps' queries without the needle: the control);
# 2. H2O's kept positions against InfLLM-v2's selection at the same token budget;
# 3. the share of each step's dense attention that each of them captures.
#
# **How to run.** `pip install -e ".[notebooks]"` (add `gpu` on a GPU machine), then open
# `02_decode.ipynb` in Jupyter or run `python 02_decode.py` from `notebooks/`. The notebook picks its
# size: on a CUDA GPU, a 32k-token sequence, MiniCPM4's budget (topk 64, 32 local blocks) and 4k
# decode steps on the kernels; without one, 2k tokens, a smaller budget and 320 steps on the PyTorch
# references (well under a minute). `NB_SMOKE=1` forces the small size, `NB_SMOKE=0` the full one.
# Figures go to `figures/` (or `$NB_FIG_DIR`).

# %%
import os
from pathlib import Path

import torch

SEED = 0
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if os.environ.get("NB_SMOKE") in ("0", "1"):
    SMOKE = os.environ["NB_SMOKE"] == "1"
    why = f"NB_SMOKE={os.environ['NB_SMOKE']}"
else:   # the full size runs thousands of reference steps over a 32k cache on a CPU (tens of minutes)
    SMOKE = DEVICE == "cpu"
    why = "no CUDA GPU" if SMOKE else f"CUDA GPU {torch.cuda.get_device_name()}"
DTYPE = torch.bfloat16
T = 2048 if SMOKE else 32768        # tokens of the whole sequence (prefill + decode)
HQ, H, D = 32, 2, 128               # MiniCPM4-8B: 32 query heads on 2 KV heads (G = 16), head dim 128
TOPK = 6 if SMOKE else 64           # K = TOPK + LOCAL_BLOCKS blocks per step, forced ones included
LOCAL_BLOCKS = 2 if SMOKE else 32
STEPS = 320 if SMOKE else 4160      # decode steps: enough to cover the query runs of two needles
LOCAL_LEN, TOPIC_LEN = (128, 256) if SMOKE else (256, 1024)
FIG_DIR = Path(os.environ.get("NB_FIG_DIR", "figures"))
FIG_DIR.mkdir(parents=True, exist_ok=True)
hint = " (NB_SMOKE=0 forces the full 32k-token run)" if SMOKE and "NB_SMOKE" not in why else ""
print(f"{'small' if SMOKE else 'full'} size ({why}): T = {T} tokens, {STEPS} decode steps, topk = {TOPK}, "
      f"local_blocks = {LOCAL_BLOCKS}, on {DEVICE}{hint}")

# %%
import matplotlib.pyplot as plt

from infllm_cupy.config import InfLLMv2Config
from infllm_cupy.decode import H2O, DecodeCache, infllmv2_decode, naive_infllmv2_decode, sparse_decode
from infllm_cupy.synthetic import compare_to_control, structured_sequence

# %% [markdown]
# ## A cache to decode on
#
# `structured_sequence` (see notebook 01) plants a sink on key 0, local context, recurring topics and
# four needles: a 64-key block in the first quarter and, in the second half, a run of 64 queries that
# look for it (needle `i` lives in KV head `i % 2`). The cache is prefilled with the tokens before the
# decode window (one `append` of a chunk, which also writes the compressed keys), and the window is
# placed so that the query runs of the first two needles fall inside it.

# %%
data = structured_sequence(T, HQ, H, D, local_len=LOCAL_LEN, topic_len=TOPIC_LEN, dtype=DTYPE, device=DEVICE,
                           seed=SEED)
needles = data.needles[:2]
START = needles[0].query_start - 41                    # first decoded position
assert needles[1].query_start + 64 <= START + STEPS <= T
cache = DecodeCache.contiguous(1, START + STEPS, H, D, dtype=DTYPE, device=DEVICE)
cache.append(data.k[:START], data.v[:START], [0, START])
cfg = InfLLMv2Config(topk=TOPK, local_blocks=LOCAL_BLOCKS, dense_len=0)
K = cfg.topk + cfg.local_blocks
print(f"prefilled {cache.lengths()[0]} tokens; compressed keys ck1 {tuple(cache.ck1.shape)}, "
      f"ck2 {tuple(cache.ck2.shape)}; each step reads K = {K} blocks ({64 * K} keys)")
for i, n in enumerate(needles):
    print(f"needle {i} (KV head {n.kv_head}): keys in block {n.key_block}, queried at steps "
          f"{n.query_start - START}-{n.query_start - START + 63}")

# %% [markdown]
# ## Generation
#
# Each step appends the new token's key and value to the cache (which also writes a compression
# window when one completes), then runs the InfLLM-v2 step, which returns the selection
# (`return_topk_idx=True`). To compare against H2O and to measure what the selection captures, the
# same query also attends densely with `return_attn_weights=True, weights="per_kv_head"`: the
# softmax summed over the 16 query heads of each KV head, `[B, H, W]`. H2O accumulates those
# weights (`H2O.update`) and keeps, per KV head, the `recent` last positions and the highest
# accumulated scores, with the same token budget as InfLLM-v2 (`K * 64` positions) and the same local
# window. H2O here starts accumulating at the first decode step, and `H2O.kept` is re-evaluated every
# step: a position it dropped earlier may come back, which real eviction does not allow, so its numbers
# below are an upper bound for H2O. At the steps whose query looks for a needle, the step also runs on
# the control's query (the same query without the needle direction, `data.q_control`) against the same
# cache: what that step would select without the needle.

# %%
W = cache.capacity
nb = -(-W // 64)
h2o = H2O(1, H, W, budget=64 * K, recent=64 * (LOCAL_BLOCKS + 1), device=DEVICE)
sel = torch.zeros(STEPS, H, nb, dtype=torch.bool)
sel_control = torch.zeros(STEPS, H, nb, dtype=torch.bool)     # filled at the needles' query steps only
control_rows = {n.query_start + r - START: data.q_control[64 * i + r:64 * i + r + 1]
                for i, n in enumerate(needles) for r in range(64)}     # step -> the control's query
mass_sel = torch.zeros(STEPS, H)
mass_h2o = torch.zeros(STEPS, H)
G = HQ // H
with torch.no_grad():
    for s in range(STEPS):
        t = START + s
        cache.append(data.k[t:t + 1], data.v[t:t + 1])
        q = data.q[t:t + 1]
        out, topk_idx = infllmv2_decode(q, cache, config=cfg, return_topk_idx=True)
        _, w = sparse_decode(q, cache, None, return_attn_weights=True, weights="per_kv_head")   # dense
        h2o.update(w)
        picks = [(sel, topk_idx)]
        if s in control_rows:       # the same step on the control's query: what it selects without the needle
            picks.append((sel_control, infllmv2_decode(control_rows[s], cache, config=cfg,
                                                       return_topk_idx=True)[1]))
        for out_sel, idx in picks:
            idx = idx[:, 0].long().cpu()                                    # [H, K], -1 padded
            out_sel[s].scatter_(1, idx.clamp(min=0), (idx >= 0) & (idx < nb))
        pos_sel = sel[s].to(DEVICE).repeat_interleave(64, dim=1)[:, :W]     # [H, W] selected positions
        mass_sel[s] = (w[0] * pos_sel).sum(-1).cpu() / G                    # mean over the group's heads
        kept = h2o.kept(cache.seqlens)[0]                                   # [H, budget], -1 padded
        keep = torch.zeros(H, W + 1, device=DEVICE)
        keep.scatter_(1, torch.where(kept >= 0, kept, torch.full_like(kept, W)), 1.0)
        mass_h2o[s] = (w[0] * keep[:, :W]).sum(-1).cpu() / G
print(f"decoded {STEPS} steps; cache now holds {cache.lengths()[0]} tokens")

# %% [markdown]
# The step is the reference's (`naive_infllmv2_decode` on the packed cache) at the last position:

# %%
k_p, v_p, cu_p = cache.packed()
ref = naive_infllmv2_decode(q, k_p, v_p, cu_p, config=cfg)
err = (out.float() - ref.float()).abs().max().item()
print(f"last step: max |infllmv2_decode - naive_infllmv2_decode| = {err:.2e}")
assert err < 5e-2

# %% [markdown]
# ## Which blocks each step picks
#
# One map per KV head: decode step on the y axis, key block on the x axis, dark where the step
# selected the block. Column 0 (the sink) and the diagonal band at the right (the local window,
# moving with the cache) are forced. Dashed lines mark the needle blocks and the steps when their
# queries run. A needle's column may darken during those steps only, or be dark throughout: a block whose
# keys all point one way (a needle's) keeps its norm under mean pooling and can win for any query of its
# head. The map cannot tell retrieval from that; the check below can.

# %%
fig, axes = plt.subplots(1, H, figsize=(6 * H, 5), squeeze=False)
for h, ax in enumerate(axes[0]):
    ax.imshow(sel[:, h].float(), aspect="auto", cmap="Greys", interpolation="nearest")
    for n in needles:
        if n.kv_head == h:
            ax.axvline(n.key_block, color="tab:red", ls="--", lw=0.8)
            for y in (n.query_start - START, n.query_start - START + 63):
                ax.axhline(y, color="tab:red", ls="--", lw=0.8)
    ax.set(title=f"KV head {h}", xlabel="key block", ylabel="decode step")
fig.suptitle(f"blocks selected per decode step (K = {K}, {START}..{START + STEPS} tokens)")
fig.tight_layout()
fig.savefig(FIG_DIR / "02_selection_over_time.png", dpi=110)

# %% [markdown]
# **Does a step retrieve the needle?** The demo's check (`needle_retrieval`, notebook 01) on decode steps:
# of the needle's 64 query steps, only those for which its block is a choice by score count (not forced:
# not block 0, not in the step's local window); each has two outcomes, the step's selection and the
# control's (the same step on the query without the needle direction). The **gain** is the share of the
# steps whose control leaves the block out that select it: 1 for perfect retrieval, 0 for a query that
# does not look for the needle. A needle whose block its control selects at every step shows nothing:
# the block is picked anyway. Last, for comparison, how often the head's other steps (queries that do not
# look for the needle, at other positions) pick the block.

# %%
for i, n in enumerate(needles):
    run = torch.arange(n.query_start, n.query_start + 64)
    steps = run - START
    by_score = (n.key_block >= cfg.init_blocks) & (n.key_block < run // 64 - cfg.local_blocks)
    r = compare_to_control(sel[steps, n.kv_head, n.key_block][by_score],
                           sel_control[steps, n.kv_head, n.key_block][by_score])
    others = torch.ones(STEPS, dtype=torch.bool)
    others[steps] = False
    elsewhere = sel[others, n.kv_head, n.key_block].float().mean().item()
    print(f"needle {i} (KV head {n.kv_head}, block {n.key_block}): picked at {r.recall:.0%} of its {r.pairs} "
          f"query steps by score, {r.control_recall:.0%} of them without the needle; "
          f"{'retrieved' if r.retrieved else 'not retrieved'}: {r.reason()}; the head's other steps pick it "
          f"at {elsewhere:.0%}")
changes = (sel[1:] ^ sel[:-1]).sum(-1).float().mean(0) / 2
print("blocks swapped per step (mean, per KV head):", [round(x, 2) for x in changes.tolist()])

# %% [markdown]
# ## H2O's kept positions against InfLLM-v2's selection
#
# At the last step, per key block: the share of its positions H2O keeps (its heavy hitters
# accumulated over the decode window, plus the recent window) and how often InfLLM-v2 selected the
# block over the steps. Both spend the same number of positions. H2O keeps scattered single tokens
# (the sink, tokens that many queries liked); InfLLM-v2 reads whole blocks and changes them per
# query, so a needle block that no earlier query wanted is still available to the one that does.

# %%
kept = h2o.kept(cache.seqlens)[0].cpu()
kept_blocks = torch.zeros(H, nb)
for h in range(H):
    kk = kept[h][kept[h] >= 0]
    kept_blocks[h].index_add_(0, kk // 64, torch.full((kk.numel(),), 1 / 64))
freq = sel.float().mean(0)
fig, axes = plt.subplots(H, 1, figsize=(11, 2.6 * H), squeeze=False, sharex=True)
for h, ax in enumerate(axes[:, 0]):
    ax.bar(range(nb), freq[h], width=1.0, color="tab:blue", alpha=0.5,
           label="InfLLM-v2: share of steps selecting")
    ax.step(range(nb), kept_blocks[h], where="mid", color="tab:orange", label="H2O: share of positions kept")
    for n in needles:
        if n.kv_head == h:
            ax.axvline(n.key_block, color="tab:red", ls="--", lw=0.8)
    ax.set(ylabel=f"KV head {h}", ylim=(0, 1.05))
axes[0, 0].legend(loc="upper center", fontsize=8)
axes[-1, 0].set_xlabel("key block")
fig.suptitle(f"same budget ({64 * K} positions): H2O's kept set vs InfLLM-v2's selections")
fig.tight_layout()
fig.savefig(FIG_DIR / "02_h2o_vs_infllm.png", dpi=110)

# %%
last = sel[-1].repeat_interleave(64, dim=1)[:, :W]
for h in range(H):
    kk = kept[h][kept[h] >= 0]
    print(f"KV head {h}: H2O keeps {kk.numel()} positions, {last[h, kk].float().mean().item():.0%} of them "
          f"inside the blocks InfLLM-v2 selects at the last step")

# %% [markdown]
# ## Attention mass captured
#
# For every step: the share of the step's dense attention (mean over the query heads of each KV
# head) that falls inside InfLLM-v2's selected blocks, and inside H2O's kept positions. 1.0 would
# make the sparse output equal to the dense one.

# %%
fig, axes = plt.subplots(1, H, figsize=(6 * H, 3.5), squeeze=False, sharey=True)
for h, ax in enumerate(axes[0]):
    ax.plot(mass_sel[:, h], label="InfLLM-v2 selection", lw=1)
    ax.plot(mass_h2o[:, h], label="H2O kept (upper bound)", lw=1)
    spans = [n for n in needles if n.kv_head == h]
    for i, n in enumerate(spans):
        ax.axvspan(n.query_start - START, n.query_start - START + 63, color="tab:red", alpha=0.1,
                   label="steps whose query looks for a needle" if i == 0 else None)
    ax.set(title=f"KV head {h}", xlabel="decode step", ylim=(0, 1.02))
    ax.legend(fontsize=8)
axes[0, 0].set_ylabel("dense attention mass captured")
fig.tight_layout()
fig.savefig(FIG_DIR / "02_mass_captured.png", dpi=110)

# %%
for h in range(H):
    runs = [n for n in needles if n.kv_head == h]
    msk = torch.zeros(STEPS, dtype=torch.bool)
    for n in runs:
        msk[n.query_start - START:n.query_start - START + 64] = True
    print(f"KV head {h}: mass captured, mean over steps: InfLLM-v2 {mass_sel[:, h].mean():.3f}, "
          f"H2O {mass_h2o[:, h].mean():.3f}; during its needle's queries: InfLLM-v2 "
          f"{mass_sel[msk, h].mean():.3f}, H2O {mass_h2o[msk, h].mean():.3f}")
