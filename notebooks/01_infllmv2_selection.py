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
# # 01 · What does InfLLM-v2 select, and what does it keep of dense attention?
#
# InfLLM-v2 attends, for every query token, to `K = topk + local_blocks` 64-key blocks chosen in
# stage 1 from mean-compressed keys: block 0 and the `local_blocks + 1` blocks ending at the query are
# forced and count inside K, and the other `topk - 2` are the best-scoring blocks (MiniCPM4: topk 64,
# local_blocks 32, K = 96 = 1 + 33 forced + 62 by score; `docs/semantics.md`). This notebook runs
# the whole pipeline (`infllm_cupy.pipeline.infllmv2_attention`) on a synthetic sequence with known structure
# (an attention sink, local context, recurring topics and far "needle" keys that later queries look for)
# and asks:
#
# 1. which blocks each query block selects, per KV head (sparsity maps), and whether stage 1 retrieves the
#    needles (against a control: the same queries without the needle);
# 2. what the stage-1 block scores look like;
# 3. how much of each query's **dense** softmax mass falls inside its selected blocks, and how that
#    grows with the top-k budget.
#
# **How to run.** `pip install -e ".[notebooks]"` (add `gpu` on a GPU machine), then open
# `01_infllmv2_selection.ipynb` in Jupyter, or from `notebooks/`:
# `jupyter execute --output=/tmp/01_executed 01_infllmv2_selection.ipynb`, or
# `python 01_infllmv2_selection.py`. `jupytext.toml` pairs this file (the reviewed source) with the
# `.ipynb` (outputs stripped). The sequence is 32k tokens on any machine. On a CUDA GPU: MiniCPM4's
# settings, every stage on its CUDA kernel (seconds). Without one: the demo's budget (topk 8, 4 local
# blocks, K = 12), every stage on its CPU implementation, whose work grows with the selection (about
# 30 s on a 2-core machine); the dense comparisons, whose cost grows with T^2, then run on the last
# 1024 query tokens. `NB_SMOKE=1` runs a 2k-token smoke size (the test suite's).
# Figures go to `figures/` (or `$NB_FIG_DIR`).

# %%
import os
from pathlib import Path

import torch

SEED = 0
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMOKE = os.environ.get("NB_SMOKE") == "1"      # the test suite's size
GPU = DEVICE == "cuda"
why = (f"NB_SMOKE={os.environ['NB_SMOKE']}" if os.environ.get("NB_SMOKE") in ("0", "1")
       else f"CUDA GPU {torch.cuda.get_device_name()}" if GPU else "no CUDA GPU")
DTYPE = torch.bfloat16
T = 2048 if SMOKE else 32768        # tokens of the one sequence
HQ, H, D = 32, 2, 128               # MiniCPM4-8B: 32 query heads sharing 2 KV heads (G = 16), head dim 128
TOPK = 64 if GPU and not SMOKE else 8           # K = TOPK + LOCAL_BLOCKS blocks, forced ones included
LOCAL_BLOCKS = 32 if GPU and not SMOKE else 4   # local window in blocks (MiniCPM4: 64 and 32, K = 96)
# budgets of the sweep (2: the forced blocks only)
TOPKS = [2, 4, 8, 16] if SMOKE else [2, 8, 16, 32, 64, 128, 256] if GPU else [2, 4, 8, 16, 32, 64]
# the query tokens whose dense attention is compared (T^2 work): the second half, or on a CPU the last 1024
MASS_FROM = T // 2 if SMOKE or GPU else T - 1024
N_NEEDLES = 4
LOCAL_LEN, TOPIC_LEN = (128, 256) if SMOKE else (256, 1024)          # correlation lengths, tokens
FIG_DIR = Path(os.environ.get("NB_FIG_DIR", "figures"))
FIG_DIR.mkdir(parents=True, exist_ok=True)
print(f"{'small' if SMOKE else 'full'} size ({why}): T = {T} tokens, topk = {TOPK}, local_blocks = "
      f"{LOCAL_BLOCKS}, on {DEVICE}; dense comparisons on query tokens {MASS_FROM}..{T - 1}")

# %%
from itertools import pairwise

from infllm_cupy.config import InfLLMv2Config
from infllm_cupy.pipeline import infllmv2_attention
from infllm_cupy.prefill import stage_names, stages_for
from infllm_cupy.synthetic import needle_retrieval, structured_sequence
from infllm_cupy.testing import rel_l2_err
from infllm_cupy.viz import (
    attention_mass_captured,
    per_query_block,
    plot_block_score_maps,
    plot_mass_by_query_block,
    plot_mass_per_head,
    plot_mass_vs_topk,
    plot_selection_maps,
    summarize_mass,
    topk_sweep,
)

# %% [markdown]
# ## A sequence with structure
#
# `structured_sequence` starts from unit-normal queries, keys and values (their logits
# `q·k/√D` are about unit-normal too) and plants four things, each sized in logits:
# a **sink** (key 0 gets +8 logits from every query), **local context** (+3 logits between a token and
# its neighbours, fading over `LOCAL_LEN` tokens), **recurring topics** (+1.5 logits between tokens of
# the same topic; eight topics take turns every `TOPIC_LEN` tokens, so attention also goes far back)
# and four **needles**: a block of 64 keys early in the sequence and, much later, a run of 64 queries
# that look for it (+8 logits). Each needle lives in one KV head only (needle `i` in head `i % H`).
# `data.q_control` keeps the needles' query runs as they are without the needle direction: the control
# of the retrieval check below.

# %%
data = structured_sequence(T, HQ, H, D, n_needles=N_NEEDLES, local_len=LOCAL_LEN, topic_len=TOPIC_LEN,
                           dtype=DTYPE, device=DEVICE, seed=SEED)
q, k, v, cu = data.q, data.k, data.v, data.cu_seqlens
for n in data.needles:
    print(f"needle in KV head {n.kv_head}: keys in block {n.key_block}, "
          f"queried by tokens {n.query_start}-{n.query_start + 63} (query blocks {n.query_blocks})")

# %% [markdown]
# ## The pipeline
#
# `InfLLMv2Config` holds MiniCPM4's hyper-parameters (fine keys: mean over 32 tokens every 16; coarse
# keys for the stage-1 normaliser: 128 every 64; 64-key blocks; 1 init block). MiniCPM4 runs dense
# attention below `dense_len = 8192` keys; `dense_len=0` keeps this sequence sparse at any size. With
# `return_aux=True` the pipeline also returns its intermediates: the stage-1 `scores` per fine key,
# the pooled `block_scores` and the selection `topk_idx` `[H, T, K]`. `stages_for` tells which
# implementation each stage ran.

# %%
cfg = InfLLMv2Config(topk=TOPK, local_blocks=LOCAL_BLOCKS, dense_len=0)
with torch.no_grad():
    out, aux = infllmv2_attention(q, k, v, cu, config=cfg, return_aux=True)
topk_idx, block_scores = aux["topk_idx"], aux["block_scores"]
for stage, impl in stage_names(stages_for(q, "auto")).items():
    print(f"{stage:14s} {impl}")
print(f"topk_idx {tuple(topk_idx.shape)}: K = {topk_idx.shape[-1]} slots = topk {cfg.topk} + local_blocks "
      f"{cfg.local_blocks}; {cfg.init_blocks} init + {cfg.local_blocks + 1} local blocks are forced, "
      f"{cfg.topk - cfg.init_blocks - 1} picked by score")

# %% [markdown]
# ## Which blocks each query block selects
#
# One map per KV head: query block `i` (64 tokens) on the y axis, key block `j` on the x axis, shaded
# by the share of the block's tokens that selected `j` (tokens select individually; a query block's
# tokens mostly agree). The diagonal band is the forced local window, column 0 the forced init block
# (where the sink is). Red circles mark the needles in the head that carries them. The other
# off-diagonal picks follow the recurring topics, and a block whose keys all point one way (a needle's
# keys) keeps its norm under mean pooling, so it can score high for queries that do not look for it too.

# %%
fig = plot_selection_maps(topk_idx, cu, needles=data.needles,
                          suptitle=f"selected blocks per KV head, T = {T}, topk = {TOPK}")
fig.savefig(FIG_DIR / "01_selection_maps.png", dpi=110)

# %% [markdown]
# **Is a needle retrieved?** That its queries select its block says nothing by itself: a large budget, or a
# block that stands out under mean pooling (a needle's keys all point one way, so its compressed keys keep
# their norm), puts the block in every query's selection. `needle_retrieval` (the demo's check) measures it
# against a control, the same queries without the needle direction: stage 1 runs on each needle's 64
# queries as they are and as `data.q_control`, against the same keys, and counts only the (query token,
# KV head) pairs for which the block is a choice by score (not forced by the init block or the local
# window). Its statistic, the **gain**, is the share of the pairs whose control leaves the block out that
# select it: 1 for perfect retrieval, 0 for the control itself at any budget (the two sides are then the
# same tensors). A needle is retrieved at a gain of 0.5 or more. When the control already selects the block
# for every pair, nothing is left to show: not retrieved, whatever the recall.

# %%
found = needle_retrieval(q, k, data.q_control, data.needles, cfg)
for n, r in zip(data.needles, found):
    print(f"needle block {n.key_block} (KV head {n.kv_head}): selected by {r.recall:.0%} of its {r.pairs} "
          f"(token, head) pairs with the needle, {r.control_recall:.0%} without; "
          f"{'retrieved' if r.retrieved else 'not retrieved'}: {r.reason()}")
retrieved = [n.key_block for n, r in zip(data.needles, found) if r.retrieved]
anyway = [n.key_block for n, r in zip(data.needles, found) if r.pairs and not r.open_pairs]
print(f"retrieved: blocks {retrieved}; selected by their control for every pair (nothing to show): {anyway}")
# the summary at the end of the notebook rests on these: every needle is either retrieved or selected anyway
assert all(r.retrieved or (r.pairs and not r.open_pairs) for r in found), found

# %% [markdown]
# ## Stage-1 block scores
#
# Stage 1 scores every fine compressed key for every query token (a softmax over the keys with the
# coarse keys' normaliser, summed over the 16 query heads of the KV head), then max-pools them into
# 64-key blocks. Shown: the max over each query block's tokens, on a log scale; forced blocks in grey.
# The needles stand out by orders of magnitude, topic blocks by less.

# %%
fig = plot_block_score_maps(block_scores, cu, needles=data.needles, suptitle="stage-1 block scores (log10)")
fig.savefig(FIG_DIR / "01_block_scores.png", dpi=110)

# %% [markdown]
# ## How much of dense attention the selection keeps
#
# For every query token and query head, `attention_mass_captured` computes the dense causal softmax
# over all earlier keys and sums it over the keys the selection attends. 1.0 means that stage 2 gives
# exactly the dense output for that query. Block scores do not depend on the budget, so `topk_sweep`
# re-runs only the top-k step for each budget in `TOPKS` (2: only the forced blocks), and one pass over
# the dense attention measures all of them. Tokens in the first half of the sequence have few causal
# blocks (the early ones select all of them), so the means below count the query tokens from
# `MASS_FROM` on: the second half on a GPU, the last 1024 on a CPU (the dense pass costs T^2 there).
# Those rows against all the keys are one sequence of `T - MASS_FROM` queries over `T` keys, causal and
# bottom-right aligned (`cu_seqlens_k`), as stage 2 attends them.

# %%
rows = slice(MASS_FROM, T)
cu_rows = torch.tensor([0, T - MASS_FROM], dtype=torch.int32, device=DEVICE)
selections = topk_sweep(block_scores, cu, T, TOPKS, cfg)
captured = attention_mass_captured(q[rows], k, cu_rows, {t: sel[:, rows] for t, sel in selections.items()},
                                   cu_seqlens_k=cu, progress=False)
summaries = [summarize_mass(captured[t], cu_rows) for t in TOPKS]
for t, s in zip(TOPKS, summaries):
    print(f"topk {t:4d}: mass captured {s['mass']:.3f} (per KV head "
          f"{', '.join(f'{x:.3f}' for x in s['mass_per_kv_head'].tolist())}) "
          f"attending {s['key_fraction']:.1%} of the causal keys")
for (t0, a), (t1, b) in zip(zip(TOPKS, summaries), zip(TOPKS[1:], summaries[1:])):
    print(f"topk {t0:4d} -> {t1:4d}: mass {100 * (b['mass'] - a['mass']):+5.1f} points for "
          f"{100 * (b['key_fraction'] - a['key_fraction']):+5.1f} points of keys")
# what the summary at the end says of these numbers: more mass than keys at every budget, and diminishing
# returns (the last step buys less mass per point of keys than the first)
assert all(s["mass"] > s["key_fraction"] for s in summaries)
steps = [(b["mass"] - a["mass"]) / (b["key_fraction"] - a["key_fraction"]) for a, b in pairwise(summaries)]
assert steps[-1] < steps[0], steps

# %% [markdown]
# Along the sequence: the mean over query heads for a few budgets. With only the forced blocks,
# what is kept is the sink and the local window; the budget adds the needles and the topic blocks.

# %%
shown = [t for t in TOPKS if t in (min(TOPKS), TOPK, max(TOPKS))]
curves = {f"topk = {t}": per_query_block(captured[t].mass, cu_rows).nanmean(dim=0) for t in shown}
ax = plot_mass_by_query_block(curves, first_block=MASS_FROM // 64,
                              title=f"dense attention mass in the selected blocks, T = {T}")
ax.figure.savefig(FIG_DIR / "01_mass_by_query_block.png", dpi=110)

# %%
ax = plot_mass_vs_topk(TOPKS, summaries, title=f"mass captured vs top-k (tokens {MASS_FROM}..{T - 1})")
ax.figure.savefig(FIG_DIR / "01_mass_vs_topk.png", dpi=110)

# %% [markdown]
# Per query head at the configured budget. The heads of a KV head share its selection but not their
# attention. Here every head of a group sees the same planted structure, so the bars differ only by
# noise; with a real model's queries and keys, this is where a head that attends differently from its
# group shows up.

# %%
ax = plot_mass_per_head(summaries[TOPKS.index(TOPK)] if TOPK in TOPKS else summaries[-1],
                        title=f"mass captured per query head, topk = {TOPK}")
ax.figure.savefig(FIG_DIR / "01_mass_per_head.png", dpi=110)

# %% [markdown]
# ## Sparse against dense output
#
# The same call with `dense_len` above `T` takes the dense fallback (torch SDPA), here on the query
# tokens from `MASS_FROM` on against all the keys. The relative L2 error of the sparse output there is
# the price of the mass the selection leaves out.

# %%
dense_cfg = InfLLMv2Config(topk=TOPK, local_blocks=LOCAL_BLOCKS, dense_len=T + 1)
with torch.no_grad():
    dense = infllmv2_attention(q[rows], k, v, cu_rows, cu, config=dense_cfg)
print(f"relative L2 error of the sparse output over tokens {MASS_FROM}..{T - 1}: "
      f"{rel_l2_err(out[rows], dense):.3f}")

# %% [markdown]
# ## What we saw
#
# - The forced blocks (sink and local window) alone keep much of the attention (topk 2 above); the picks by
#   score add the needles' blocks and the topic blocks that recur far back. Every needle whose block its
#   control leaves out is retrieved (a gain of 0.5 or more: the check above asserts it); the others are
#   selected by their control queries too, so their selection shows nothing either way.
# - At every budget the selected blocks hold a larger share of the dense mass than of the keys: the
#   selection spends its keys where the attention is. The returns diminish, though: the forced blocks
#   and the first picks capture most of the mass, and each larger budget then buys a few points of mass
#   with many points of keys (the step lines above; the mass curve flattens while the key share keeps
#   rising).
# - Mean pooling favours blocks whose keys agree (a needle's keys), which then also win for queries that
#   do not look for them: the needles' selection without the needle above (up to every pair), and such
#   columns in the sparsity maps. That is why the check compares each needle's queries with their control
#   rather than reading the recall, which alone cannot tell a retrieved needle from one selected anyway.
