"""Plots of what stage 1 selected: sparsity maps and block-score heat maps (matplotlib, lazy import)."""
from __future__ import annotations

import torch

from ._checks import check_tensor


def selection_density(topk_idx: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, *,
                      seq: int = 0, head: int = 0, q_block: int = 64, block_size: int = 64,
                      causal: bool = True) -> torch.Tensor:
    """Fraction of the tokens of each query block that selected each key block.

    Returns float32 `[cdiv(Lq, q_block), cdiv(Lk, block_size)]` for sequence `seq` and KV head `head`
    (1.0 where every token of the query block selected the key block). Entries stage 2 would ignore
    (negative, out of range, future) are left out.
    """
    check_tensor("topk_idx", topk_idx, ndim=3, dtypes=(torch.int32, torch.int64))
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    Lq, Lk = cq[seq + 1] - cq[seq], ck[seq + 1] - ck[seq]
    nqb, nkb = -(-Lq // q_block), -(-Lk // block_size)
    idx = topk_idx[head, cq[seq]:cq[seq + 1]].long().cpu()                       # [Lq, K]
    r = torch.arange(Lq)[:, None]
    ok = (idx >= 0) & (idx < nkb)
    if causal:
        ok &= idx * block_size <= r + Lk - Lq
    # one vote per (token, block): duplicates count once
    sel = torch.zeros(Lq, nkb + 1, dtype=torch.bool)
    sel.scatter_(1, torch.where(ok, idx, torch.full_like(idx, nkb)), True)
    sel = sel[:, :nkb].float()
    counts = torch.zeros(nqb, nkb).index_add_(0, torch.arange(Lq) // q_block, sel)
    tokens = torch.bincount(torch.arange(Lq) // q_block, minlength=nqb).clamp_min(1)
    return counts / tokens[:, None]


def plot_selection(topk_idx, cu_seqlens_q, cu_seqlens_k, *, seq: int = 0, head: int = 0, q_block: int = 64,
                   block_size: int = 64, ax=None, title: str | None = None):
    """Sparsity map: query block i (y) against key block j (x), shaded by the fraction of i's tokens
    that selected j. Returns the matplotlib Axes."""
    import matplotlib.pyplot as plt

    dens = selection_density(topk_idx, cu_seqlens_q, cu_seqlens_k, seq=seq, head=head, q_block=q_block,
                             block_size=block_size)
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 5.5))
    im = ax.imshow(dens.numpy(), cmap="viridis", vmin=0, vmax=1, interpolation="nearest", aspect="auto")
    ax.set_xlabel(f"key block j ({block_size} keys)")
    ax.set_ylabel(f"query block i ({q_block} tokens)")
    ax.set_title(title or f"selected blocks, sequence {seq}, KV head {head}")
    ax.figure.colorbar(im, ax=ax, label="fraction of the block's tokens selecting j")
    return ax


def plot_block_scores(block_scores: torch.Tensor, cu_seqlens_q: torch.Tensor, *, seq: int = 0, head: int = 0,
                      q_block: int = 64, ax=None, title: str | None = None):
    """Heat map of stage-1 block scores `[H, total_q, n_blocks]`, max over the tokens of each query
    block; forced blocks (+inf) are drawn at the top of the colour scale. Returns the Axes."""
    import matplotlib.pyplot as plt

    cq = cu_seqlens_q.tolist()
    s = block_scores[head, cq[seq]:cq[seq + 1]].float().cpu()                   # [Lq, n_blocks]
    Lq = s.shape[0]
    nqb = -(-Lq // q_block)
    pad = nqb * q_block - Lq
    s = torch.nn.functional.pad(s, (0, 0, 0, pad), value=float("-inf"))
    per_block = s.view(nqb, q_block, -1).amax(1)
    finite = per_block[torch.isfinite(per_block)]
    top = finite.max().item() if finite.numel() else 1.0
    shown = per_block.clamp(max=top).masked_fill(per_block == float("-inf"), float("nan"))
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 5.5))
    im = ax.imshow(shown.numpy(), cmap="magma", interpolation="nearest", aspect="auto")
    ax.set_xlabel("key block j (64 keys)")
    ax.set_ylabel(f"query block i ({q_block} tokens)")
    ax.set_title(title or f"stage-1 block scores, sequence {seq}, KV head {head}")
    ax.figure.colorbar(im, ax=ax, label="max pooled score (forced blocks clipped to max)")
    return ax
