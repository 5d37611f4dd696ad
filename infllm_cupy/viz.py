"""What stage 1 selected, measured and drawn: sparsity maps, block-score heat maps, and how much of
the dense attention mass the selected blocks capture (matplotlib, imported lazily by the plots).

The measurements (`selection_density`, `attention_mass_captured`, `summarize_mass`,
`per_query_block`, `topk_sweep`) run on CPU or CUDA tensors, chunked so that they work at 32k+
tokens on a GPU; the `plot_*` helpers only draw their results.
"""
from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch

from ._checks import (
    check_cu_seqlens,
    check_head_dim,
    check_int_args,
    check_same_device,
    check_tensor,
    seqlens_host,
)
from ._rules import KV_BLOCK, softmax_scale_of
from .config import check_config, check_topk_keeps_forced_blocks
from .stage1.naive import naive_select_topk, q_block_idx_prefill


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


_FUTURE_RGBA = (0.86, 0.86, 0.86, 1.0)      # the non-causal area: its own colour, not "not selected"


def plot_selection(topk_idx, cu_seqlens_q, cu_seqlens_k, *, seq: int = 0, head: int = 0, q_block: int = 64,
                   block_size: int = 64, ax=None, title: str | None = None):
    """Sparsity map: query block i (y) against key block j (x), shaded by the fraction of i's tokens
    that selected j; key blocks that no token of the query block may attend (the future, bottom-right
    causal) in light grey, named in the legend. Returns the matplotlib Axes."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    dens = selection_density(topk_idx, cu_seqlens_q, cu_seqlens_k, seq=seq, head=head, q_block=q_block,
                             block_size=block_size)
    cq, ck = seqlens_host(cu_seqlens_q), seqlens_host(cu_seqlens_k)
    nqb, nkb = dens.shape
    last = torch.clamp((torch.arange(nqb) + 1) * q_block, max=cq[seq]) - 1 + ck[seq] - cq[seq]
    future = torch.arange(nkb)[None, :] * block_size > last[:, None]              # [NQB, NKB]
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 5.5))
    im = ax.imshow(dens.numpy(), cmap="viridis", vmin=0, vmax=1, interpolation="nearest", aspect="auto")
    grey = torch.zeros(nqb, nkb, 4)
    grey[future] = torch.tensor(_FUTURE_RGBA)
    ax.imshow(grey.numpy(), interpolation="nearest", aspect="auto")
    ax.set_xlabel(f"key block j ({block_size} keys)")
    ax.set_ylabel(f"query block i ({q_block} tokens)")
    ax.set_title(title or f"selected blocks, sequence {seq}, KV head {head}")
    ax.figure.colorbar(im, ax=ax, label="fraction of the block's tokens selecting j (0: not selected)")
    _legend(ax, [Patch(facecolor=_FUTURE_RGBA, edgecolor="0.5", label="future (not causal)")])
    return ax


def _legend(ax, handles):
    """A legend of `handles` added to the entries `ax` already shows."""
    old = ax.get_legend()
    keep = list(old.legend_handles) if old is not None else []
    ax.legend(handles=keep + list(handles), loc="upper right", fontsize=8)


def plot_block_scores(block_scores: torch.Tensor, cu_seqlens_q: torch.Tensor, *, seq: int = 0, head: int = 0,
                      q_block: int = 64, log: bool = False, ax=None, title: str | None = None):
    """Heat map of stage-1 block scores `[H, total_q, n_blocks]`, max over the tokens of each query
    block (query block `i` on y, key block `j` on x). Forced blocks (+inf: init and local) are drawn
    in light grey, blocks without a score (future, or no fine key) are left blank. With `log`, the
    colour is `log10` of the score. Returns the Axes."""
    import matplotlib.pyplot as plt

    cq = cu_seqlens_q.tolist()
    s = block_scores[head, cq[seq]:cq[seq + 1]].float().cpu()                   # [Lq, n_blocks]
    Lq = s.shape[0]
    nqb = -(-Lq // q_block)
    pad = nqb * q_block - Lq
    s = torch.nn.functional.pad(s, (0, 0, 0, pad), value=float("-inf"))
    per_block = s.view(nqb, q_block, -1).amax(1)                                 # [NQB, n_blocks]
    forced = per_block == float("inf")
    shown = per_block.masked_fill(~torch.isfinite(per_block), float("nan"))
    if log:
        shown = torch.log10(shown.masked_fill(shown <= 0, float("nan")))
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 5.5))
    im = ax.imshow(shown.numpy(), cmap="magma", interpolation="nearest", aspect="auto")
    grey = torch.zeros(*forced.shape, 4)
    grey[forced] = torch.tensor([0.82, 0.82, 0.82, 1.0])
    ax.imshow(grey.numpy(), interpolation="nearest", aspect="auto")
    ax.set_xlabel("key block j (64 keys)")
    ax.set_ylabel(f"query block i ({q_block} tokens)")
    ax.set_title(title or f"stage-1 block scores, sequence {seq}, KV head {head}")
    label = "max pooled score (forced blocks grey)"
    ax.figure.colorbar(im, ax=ax, label=f"log10 {label}" if log else label)
    return ax


class CapturedMass(NamedTuple):
    """What a selection keeps of dense causal attention, per query token (see `attention_mass_captured`).

    `mass` float32 `[HQ, total_q]`: share of the token's dense softmax mass inside its selected keys.
    `key_fraction` float32 `[H, total_q]`: share of its causal keys that the selection attends.
    Both on the CPU; NaN for a token that sees no key.
    """
    mass: torch.Tensor
    key_fraction: torch.Tensor


# Elements of one fp32 logit chunk `[HQ, chunk, keys]` (128 MB): memory stays flat at any length.
_MASS_CHUNK_ELEMS = 1 << 25


def _selection_mask(topk_idx_rows: torch.Tensor, n_blocks: int) -> torch.Tensor:
    """bool `[H, C, n_blocks]` from `topk_idx` rows `[H, C, K]`; negative / out-of-range entries drop out."""
    t = topk_idx_rows.long()
    t = torch.where((t >= 0) & (t < n_blocks), t, torch.full_like(t, n_blocks))
    sel = torch.zeros(*t.shape[:2], n_blocks + 1, dtype=torch.bool, device=t.device)
    sel.scatter_(2, t, True)
    return sel[..., :n_blocks]


@torch.no_grad()
def attention_mass_captured(q: torch.Tensor, k: torch.Tensor, cu_seqlens_q: torch.Tensor, topk_idx, *,
                            cu_seqlens_k: torch.Tensor | None = None, block_size: int = 64,
                            softmax_scale: float | None = None, chunk_elems: int = _MASS_CHUNK_ELEMS,
                            progress: bool | None = None):
    r"""For each (query token, query head), the share of its dense causal softmax mass that falls in
    the blocks its KV head selected.

    The dense attention of query row `r` (sequence `b`, head `hq`) over keys `j <= r + Lk - Lq`
    (bottom-right causal, stage 2's rule) gives probabilities `p_j`; the result is the sum of `p_j`
    over keys whose block `j // block_size` is in `topk_idx[hq // G, t]` (set semantics: duplicates,
    `-1` and out-of-range entries add nothing). 1.0 means stage 2 loses nothing against dense
    attention for that query. Computed in fp32 (float64 for float64 inputs) over query chunks of
    about `chunk_elems` logits, so a 32k-token sequence runs on a GPU in seconds.

    Args:
        q (torch.Tensor):
            Queries `[total_q, HQ, D]`.
        k (torch.Tensor):
            Keys `[total_k, H, D]`, q's dtype and device; `HQ` a multiple of `H`.
        cu_seqlens_q (torch.Tensor):
            int32 `[B+1]`.
        topk_idx (torch.Tensor or Mapping[Any, torch.Tensor]):
            int32 `[H, total_q, K]` block indices local to each sequence, or several selections by name
            (they share one pass over the dense attention).
        cu_seqlens_k (torch.Tensor, Optional):
            int32 `[B+1]`. Default: `None` (`cu_seqlens_q`).
        block_size (int, Optional):
            Keys per block. Default: 64.
        softmax_scale (float, Optional):
            Default: `None` (`1 / sqrt(D)`).
        chunk_elems (int, Optional):
            Logits per chunk (memory bound). Default: `2**25`.
        progress (bool, Optional):
            A progress bar over the chunks (tqdm). Default: `None` (shown in a terminal or a Jupyter
            notebook with ipywidgets, off when output goes to a file or pipe).

    Returns:
        CapturedMass (or a dict of them, keyed as `topk_idx`): `mass [HQ, total_q]` and
        `key_fraction [H, total_q]`, float32 on the CPU.
    """
    cu_seqlens_k = cu_seqlens_q if cu_seqlens_k is None else cu_seqlens_k
    check_tensor("q", q, ndim=3, dtypes=(torch.bfloat16, torch.float16, torch.float32, torch.float64))
    check_head_dim("q", q.shape)
    check_tensor("k", k, ndim=3, dtypes=(q.dtype,))
    check_same_device(q=q, k=k)
    if q.shape[1] % k.shape[1] or k.shape[2] != q.shape[2]:
        raise ValueError(f"q [*, HQ, D] and k [*, H, D] need HQ a multiple of H and the same D, got "
                         f"{tuple(q.shape)} and {tuple(k.shape)}")
    check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, total=q.shape[0], device=q.device)
    check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, total=k.shape[0], device=q.device,
                     batch=cu_seqlens_q.numel() - 1)
    if not isinstance(topk_idx, (torch.Tensor, Mapping)):
        raise TypeError(f"topk_idx must be a tensor or a mapping of tensors, got {type(topk_idx).__name__}")
    single = isinstance(topk_idx, torch.Tensor)
    selections = {None: topk_idx} if single else dict(topk_idx)
    H = k.shape[1]
    for name, idx in selections.items():
        check_tensor("topk_idx" if single else f"topk_idx[{name!r}]", idx, ndim=3,
                     dtypes=(torch.int32, torch.int64), shape=(H, q.shape[0], None), device=q.device)
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    total, HQ, D = q.shape
    G = HQ // H
    scale = softmax_scale_of(softmax_scale, D)
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    lq, lk = seqlens_host(cu_seqlens_q), seqlens_host(cu_seqlens_k)
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    mass = {n: torch.full((HQ, total), float("nan")) for n in selections}
    keys = {n: torch.full((H, total), float("nan")) for n in selections}
    chunks = [max(1, chunk_elems // max(1, HQ * Lk)) for Lk in lk]
    n_chunks = sum(-(-Lq // c) for Lq, c in zip(lq, chunks))
    bar = _progress(n_chunks, progress, desc="attention mass", unit="chunk")
    for b, (Lq, Lk) in enumerate(zip(lq, lk)):
        chunk = chunks[b]
        kb = k[cu_k[b]:cu_k[b] + Lk].to(cdt).permute(1, 2, 0).unsqueeze(1)        # [H, 1, D, Lk]
        for s in range(0, Lq, chunk):
            bar.update()
            e = min(Lq, s + chunk)
            n = min(Lk, e + Lk - Lq)                                              # keys the chunk can see
            if n <= 0:
                continue
            rows = slice(cu_q[b] + s, cu_q[b] + e)
            C = e - s
            last = torch.arange(s, e, device=q.device) + Lk - Lq                  # [C] last visible key
            # the G heads of a KV head as one GEMM of G*C rows
            qh = (q[rows].to(cdt) * scale).reshape(C, H, G, D).permute(1, 2, 0, 3).reshape(H, G * C, D)
            logits = torch.bmm(qh, kb[:, 0, :, :n]).view(H, G, C, n)              # [H, G, C, n]
            lo = max(0, int(last[0]) + 1)                     # from here on, columns some row cannot see
            j = torch.arange(lo, n, device=q.device)
            logits[..., lo:].masked_fill_(j[None, :] > last[:, None], float("-inf"))
            # the softmax in place, summed per block before its normalisation: [H, G, C] rows
            logits.sub_(logits.amax(-1, keepdim=True)).exp_()
            nb, full = -(-n // block_size), n // block_size
            block_mass = logits.new_empty(H, G, C, nb)
            block_mass[..., :full] = logits[..., :full * block_size].unflatten(-1, (full, block_size)).sum(-1)
            if nb > full:
                block_mass[..., full] = logits[..., full * block_size:].sum(-1)
            del logits
            block_mass /= block_mass.sum(-1, keepdim=True)                        # [H, G, C, nb]
            # causal keys of block c for each row: the row sees keys [0, last]
            start = torch.arange(nb, device=q.device) * block_size
            per_block = (last[:, None] + 1 - start[None, :]).clamp(0, block_size).to(cdt)   # [C, nb]
            seen = (last + 1).clamp_min(0).to(cdt)                                 # [C]
            for name, idx in selections.items():
                sel = _selection_mask(idx[:, rows], nb)                            # [H, C, nb]
                m = (block_mass * sel[:, None]).sum(-1)                            # [H, G, C]
                mass[name][:, rows] = m.reshape(HQ, e - s).float().cpu()
                kf = (per_block[None] * sel).sum(-1) / seen                        # [H, C]
                keys[name][:, rows] = kf.float().cpu()
    bar.close()
    out = {n: CapturedMass(mass[n], keys[n]) for n in selections}
    return out[None] if single else out


def _progress(total: int, progress: bool | None, **kwargs):
    """A tqdm bar (`tqdm.auto`: a widget in Jupyter, text in a terminal); `progress=None` leaves the
    choice to tqdm (off when output is not a terminal), False turns it off."""
    with warnings.catch_warnings():   # tqdm.auto warns once when Jupyter lacks ipywidgets, then uses text
        warnings.simplefilter("ignore")
        from tqdm.auto import tqdm

    return tqdm(total=total, disable=None if progress is None else not progress, leave=False, **kwargs)


def _token_positions(cu_seqlens_q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence `[total_q]` and position inside it `[total_q]` of each packed token (CPU int64)."""
    lengths = torch.as_tensor(seqlens_host(cu_seqlens_q), dtype=torch.int64)
    seq = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    starts = cu_seqlens_q.detach().cpu().long()[:-1]
    return seq, torch.arange(seq.numel()) - starts[seq]


def summarize_mass(captured: CapturedMass, cu_seqlens_q: torch.Tensor, *, from_position: int = 0,
                   seq: int | None = None) -> dict:
    r"""Means of a `CapturedMass` over the query tokens at or past `from_position` in their sequence.

    Early tokens have fewer causal blocks than the selection holds, so they keep all their mass;
    `from_position` leaves them out of the means.

    Args:
        captured (CapturedMass):
            From `attention_mass_captured`.
        cu_seqlens_q (torch.Tensor):
            int32 `[B+1]` (the one the mass was computed with).
        from_position (int, Optional):
            First position (inside each sequence) that counts. Default: 0.
        seq (int, Optional):
            Only this sequence. Default: `None` (all).

    Returns:
        dict: `mass` (float, over tokens and query heads), `mass_per_head` `[HQ]`, `mass_per_kv_head`
        `[H]`, `key_fraction` (float), `key_fraction_per_kv_head` `[H]`, `tokens` (int, counted).
    """
    seq_of, pos = _token_positions(cu_seqlens_q)
    keep = pos >= from_position
    if seq is not None:
        keep &= seq_of == seq
    m, kf = captured.mass[:, keep], captured.key_fraction[:, keep]
    HQ, H = m.shape[0], kf.shape[0]
    per_head = m.nanmean(dim=1) if m.shape[1] else torch.full((HQ,), float("nan"))
    kf_head = kf.nanmean(dim=1) if kf.shape[1] else torch.full((H,), float("nan"))
    return {"mass": per_head.nanmean().item(), "mass_per_head": per_head,
            "mass_per_kv_head": per_head.view(H, HQ // H).nanmean(dim=1),
            "key_fraction": kf_head.nanmean().item(), "key_fraction_per_kv_head": kf_head,
            "tokens": int(keep.sum())}


def per_query_block(values: torch.Tensor, cu_seqlens_q: torch.Tensor, *, seq: int = 0,
                    q_block: int = 64) -> torch.Tensor:
    """Mean of per-token values `[X, total_q]` (e.g. `CapturedMass.mass`) over each `q_block`-token
    query block of sequence `seq`: float32 `[X, cdiv(Lq, q_block)]`, NaN ignored."""
    check_tensor("values", values, ndim=2)
    cq = cu_seqlens_q.tolist()
    x = values[:, cq[seq]:cq[seq + 1]].float().cpu()
    Lq = x.shape[1]
    nqb = -(-Lq // q_block)
    x = torch.nn.functional.pad(x, (0, nqb * q_block - Lq), value=float("nan"))
    return x.view(x.shape[0], nqb, q_block).nanmean(dim=-1)


@torch.no_grad()
def topk_sweep(block_scores: torch.Tensor, cu_seqlens_q: torch.Tensor, max_seqlen_q: int,
               topks: Sequence[int], config=None, *, cache_lens=None) -> dict[int, torch.Tensor]:
    r"""The selection for each `topk` in `topks`, from one set of stage-1 block scores.

    Block scores do not depend on `topk` (only on the forced init and local blocks), so a sweep
    reruns only the top-k step: `K = min(topk + local_blocks, n_blocks)` best blocks, ascending,
    future blocks `-1`, as the pipeline does. The forced blocks count inside K (`InfLLMv2Config`), so
    `topk = init_blocks + 1` keeps only them and each step above adds one block picked by score.

    Args:
        block_scores (torch.Tensor):
            `[H, total_q, n_blocks]` (the pipeline's `return_aux["block_scores"]`).
        cu_seqlens_q (torch.Tensor):
            int32 `[B+1]`.
        max_seqlen_q (int):
            Longest query sequence.
        topks (Sequence[int]):
            Budgets to try, each at least `config.init_blocks + 1` (that value: only the forced blocks).
        config (InfLLMv2Config, Optional):
            The configuration the scores came from (`local_blocks`, `block_size`,
            `varlen_offset_quirk`). Default: `None` (MiniCPM4 defaults).
        cache_lens (torch.Tensor or list[int], Optional):
            As in the pipeline (chunked prefill). Default: `None`.

    Returns:
        dict[int, torch.Tensor]: topk -> `topk_idx` int32 `[H, total_q, K]`.
    """
    cfg = check_config(config)
    for i, t in enumerate(topks):
        check_topk_keeps_forced_blocks(int(t), cfg.init_blocks, name=f"topks[{i}]")
    q_blocks = q_block_idx_prefill(cu_seqlens_q, max_seqlen_q, block_size=cfg.block_size,
                                   varlen_offset_quirk=cfg.varlen_offset_quirk,
                                   cache_lens=cache_lens)
    return {int(t): naive_select_topk(block_scores, q_blocks, topk=int(t), local_blocks=cfg.local_blocks)
            for t in topks}


def _needle_marks(needles, head: int):
    """(key block, query block) points of the needles that live in KV `head` (or in every head)."""
    pts = []
    for n in needles or ():
        h = n[2] if len(n) > 2 else None
        if h is None or h == head:
            first, last = n[1] // KV_BLOCK, (n[1] + KV_BLOCK - 1) // KV_BLOCK
            pts += [(n[0], first), (n[0], last)]
    return pts


def _head_axes(n: int, width: float = 5.2, height: float = 4.6):
    import matplotlib.pyplot as plt

    cols = min(n, 4)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(width * cols, height * rows), squeeze=False)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    return fig, list(axes.flat[:n])


def plot_selection_maps(topk_idx: torch.Tensor, cu_seqlens_q: torch.Tensor,
                        cu_seqlens_k: torch.Tensor | None = None,
                        *, seq: int = 0, heads: Sequence[int] | None = None, needles=None, q_block: int = 64,
                        block_size: int = 64, suptitle: str | None = None):
    """Sparsity maps (`plot_selection`) side by side, one per KV head, with the needles (key block,
    query blocks of the run) circled in red on the head that carries them. Returns the Figure."""
    cu_seqlens_k = cu_seqlens_q if cu_seqlens_k is None else cu_seqlens_k
    heads = list(range(topk_idx.shape[0])) if heads is None else list(heads)
    fig, axes = _head_axes(len(heads))
    idx, cq, ck = topk_idx.cpu(), cu_seqlens_q.cpu(), cu_seqlens_k.cpu()
    for h, ax in zip(heads, axes):
        plot_selection(idx, cq, ck, seq=seq, head=h, q_block=q_block, block_size=block_size, ax=ax,
                       title=f"KV head {h}")
        pts = _needle_marks(needles, h)
        if pts:
            xs, ys = zip(*pts)
            marks = ax.scatter(xs, [y * KV_BLOCK // q_block for y in ys], s=90, facecolors="none",
                               edgecolors="red", linewidths=1.5, label="needle (key block, its queries)")
            _legend(ax, [marks])
    if suptitle:
        fig.suptitle(suptitle)
    fig.tight_layout()
    return fig


def plot_block_score_maps(block_scores: torch.Tensor, cu_seqlens_q: torch.Tensor, *, seq: int = 0,
                          heads: Sequence[int] | None = None, q_block: int = 64, log: bool = True,
                          needles=None, suptitle: str | None = None):
    """Stage-1 block-score heat maps (`plot_block_scores`), one per KV head, needles circled. Returns the
    Figure."""
    heads = list(range(block_scores.shape[0])) if heads is None else list(heads)
    fig, axes = _head_axes(len(heads))
    for h, ax in zip(heads, axes):
        plot_block_scores(block_scores, cu_seqlens_q, seq=seq, head=h, q_block=q_block, log=log, ax=ax,
                          title=f"KV head {h}")
        pts = _needle_marks(needles, h)
        if pts:
            xs, ys = zip(*pts)
            ax.scatter(xs, [y * KV_BLOCK // q_block for y in ys], s=90, facecolors="none", edgecolors="cyan",
                       linewidths=1.5)
    if suptitle:
        fig.suptitle(suptitle)
    fig.tight_layout()
    return fig


def _share_axes(ax, xlabel: str, ylabel: str, title: str):
    """Labels, a 0..1 y axis, grid, legend and title on a line plot of shares; returns `ax`."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title)
    ax.figure.tight_layout()
    return ax


def plot_mass_by_query_block(curves: Mapping[str, torch.Tensor], *, q_block: int = 64, first_block: int = 0,
                             ax=None, title: str | None = None):
    """Captured attention mass against the query block, one line per entry of `curves`
    (label -> `[NQB]`, e.g. from `per_query_block`, averaged over heads), the first value at query
    block `first_block` (for the mass of a sequence's later rows only). Returns the Axes."""
    import matplotlib.pyplot as plt

    check_int_args(0, first_block=first_block)
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 4))
    for label, y in curves.items():
        y = torch.as_tensor(y).float().cpu()
        ax.plot(range(first_block, first_block + y.numel()), y.numpy(), label=label, lw=1.4)
    return _share_axes(ax, f"query block i ({q_block} tokens)", "dense attention mass in the selected blocks",
                       title or "attention mass captured along the sequence")


def plot_mass_vs_topk(topks: Sequence[int], summaries: Sequence[dict], *, ax=None, title: str | None = None):
    """Mean captured mass against the top-k budget: one line per KV head and their mean (solid), and
    the share of causal keys attended (dashed), from `summarize_mass` results in `topks` order.
    Returns the Axes."""
    import matplotlib.pyplot as plt

    if len(topks) != len(summaries):
        raise ValueError(f"topks and summaries must have the same length, got {len(topks)} and "
                         f"{len(summaries)}")
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 4))
    x = list(topks)
    per_kv = torch.stack([s["mass_per_kv_head"] for s in summaries])             # [n_topk, H]
    for h in range(per_kv.shape[1]):
        ax.plot(x, per_kv[:, h].numpy(), marker="o", ms=3, lw=1, alpha=0.7, label=f"mass, KV head {h}")
    ax.plot(x, [s["mass"] for s in summaries], marker="o", color="black", lw=2, label="mass, mean")
    ax.plot(x, [s["key_fraction"] for s in summaries], ls="--", color="gray", marker="s", ms=3,
            label="keys attended / causal keys")
    positive = [t for t in x if t > 0]
    if positive and min(x) >= 0:
        ax.set_xscale("symlog", linthresh=min(positive))
    ax.set_xticks(x, [str(t) for t in x])
    return _share_axes(ax, "topk (K = topk + local_blocks blocks per token, the forced ones included)",
                       "share",
                       title or "dense attention mass captured vs top-k budget")


def plot_mass_per_head(summary: dict, *, ax=None, title: str | None = None):
    """Bar chart of the captured mass of every query head (`summarize_mass(...)["mass_per_head"]`),
    coloured by KV head. Returns the Axes."""
    import matplotlib.pyplot as plt

    per_head = summary["mass_per_head"]
    H = summary["mass_per_kv_head"].numel()
    G = per_head.numel() // H
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.2))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    ax.bar(range(per_head.numel()), per_head.numpy(), color=[colors[(i // G) % len(colors)] for i in
                                                            range(per_head.numel())])
    ax.set_xlabel(f"query head (groups of {G} share a KV head)")
    ax.set_ylabel("mass captured")
    ax.set_ylim(0, 1.02)
    ax.set_title(title or "captured mass per query head")
    ax.figure.tight_layout()
    return ax
