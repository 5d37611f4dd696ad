"""Synthetic long sequences with the structure InfLLM-v2's selection should find: an attention sink,
local context, recurring topics and far "needle" keys that later queries look for.

Each ingredient adds a component along a shared direction to queries and keys, sized in logits (the
extra `q . k / sqrt(D)` it gives the pair it links), on top of unit-normal noise whose logits are
themselves about unit-normal. Used by the demo (`python -m infllm_cupy demo`), the notebooks and tests.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from ._checks import check_tensor
from ._rules import KV_BLOCK, n_windows
from .compress import compress_k
from .config import check_config
from .stage1 import stage1_select

# Share of the sink component put on the queries; the keys carry the rest, so that the direction
# adds little noise to the logits of the other keys.
_SINK_QUERY_SCALE = 0.3


class Needle(NamedTuple):
    """A run of 64 keys (one 64-key block) and a later run of 64 queries that look for it."""
    key_block: int
    query_start: int
    kv_head: int | None = None      # the KV head (and its query heads) carrying it; None: every head

    @property
    def query_blocks(self) -> tuple[int, int]:
        """First and last 64-token query block of the query run (the run is not block aligned)."""
        return self.query_start // KV_BLOCK, (self.query_start + KV_BLOCK - 1) // KV_BLOCK


@dataclass
class SyntheticSequence:
    """One packed sequence and the structure planted in it.

    `q [T, HQ, D]`, `k, v [T, H, D]`, `cu_seqlens` int32 `[2]` (all on the requested device);
    `q_control [len(needles) * 64, HQ, D]`: the needles' query runs without any needle's direction (the
    control of `needle_retrieval`).
    """
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cu_seqlens: torch.Tensor
    needles: list[Needle]
    sink_tokens: int
    local_len: int
    params: dict = field(default_factory=dict)
    q_control: torch.Tensor | None = None

    @property
    def T(self) -> int:
        return self.q.shape[0]


def _unit_dirs(n: int, D: int, g: torch.Generator) -> torch.Tensor:
    """`[n, D]` random directions of norm `sqrt(D)` (the typical norm of a unit-normal vector)."""
    u = torch.randn(n, D, generator=g)
    return u / u.norm(dim=-1, keepdim=True) * math.sqrt(D)


def needle_positions(T: int, n_needles: int) -> list[tuple[int, int]]:
    """`(key block, query start)` of each needle: key blocks spread over the first quarter (never
    block 0), query runs over the second half, starting 17 tokens into a block."""
    nb = T // KV_BLOCK
    out = []
    for i in range(n_needles):
        kb = 1 + (i * (nb // 4)) // max(1, n_needles)
        qs = (nb // 2 + (i * (nb // 2 - 2)) // max(1, n_needles)) * KV_BLOCK + 17
        out.append((kb, qs))
    return out


def synthetic_sequence(T: int, HQ: int, H: int, D: int, n_needles: int, dtype, device, seed: int = 0, *,
                       needle_logit: float = 8.0, return_control: bool = False):
    """The demo's sequence: unit-normal q, k, v; every 64-key block along a direction of its own; and
    `n_needles` later runs of 64 queries (every head) that look for one early block each.

    Each key block gets a random direction of the keys' own norm, so that mean pooling leaves every
    compressed key with about the same norm and no block stands out on its own: a query that looks for
    nothing picks among them by chance. A needle's query run carries its key block's direction, worth
    `needle_logit` logits (`q . k / sqrt(D)`) against those keys. `needle_logit=0` is the control: the
    same keys (needle blocks included), no query that looks for them.

    Returns:
        q `[T, HQ, D]`, k, v `[T, H, D]` (`dtype` on `device`) and the list of
        `(needle key block, query start)` pairs; with `return_control`, also the needles' query runs
        without the needle direction, `[n_needles * 64, HQ, D]` (the control's queries at those rows,
        to the bit: `needle_retrieval`'s `q_control`).
    """
    if not math.isfinite(needle_logit) or needle_logit < 0:
        raise ValueError(f"needle_logit must be a finite number >= 0, got {needle_logit!r}")
    g = torch.Generator().manual_seed(seed)
    needles = needle_positions(T, n_needles)
    # q drawn in chunks of whole rows (the same numbers as one draw: HQ * D is a multiple of randn's
    # 16-value blocks) and stored in `dtype` as it goes, so fp32 q never exists whole (537 MB at 32k
    # tokens, MiniCPM4's heads); the needles' rows are kept in fp32 until their directions are drawn
    q = torch.empty(T, HQ, D, dtype=dtype, device=device)
    rows = max(1, 2**22 // max(1, HQ * D)) if (HQ * D) % 16 == 0 else T
    kept = {}
    for s in range(0, T, rows):
        x = torch.randn(min(rows, T - s), HQ, D, generator=g)
        for _, qs in needles:
            lo, hi = max(qs, s), min(qs + KV_BLOCK, s + x.shape[0])
            if lo < hi:
                kept.setdefault(qs, []).append(x[lo - s:hi - s].clone())
        q[s:s + x.shape[0]] = x.to(device, dtype)
    k = torch.randn(T, H, D, generator=g)
    v = torch.randn(T, H, D, generator=g)
    nb = -(-T // KV_BLOCK)
    block_dirs = _unit_dirs(nb, D, g)                                       # [NB, D], norm sqrt(D)
    k += block_dirs.repeat_interleave(KV_BLOCK, 0)[:T, None, :]
    control = {qs: torch.cat(kept[qs]) for _, qs in needles}
    q_control = torch.cat([control[qs] for _, qs in needles]) if needles else torch.zeros(0, HQ, D)
    for kb, qs in needles:
        q[qs:qs + KV_BLOCK] = (control[qs] + needle_logit / math.sqrt(D) * block_dirs[kb]).to(device, dtype)
    out = q, k.to(device, dtype), v.to(device, dtype), needles
    return (*out, q_control.to(device, dtype)) if return_control else out


def _smooth_process(T: int, D: int, length: int, n_pool: int, g: torch.Generator) -> torch.Tensor:
    """`[T, D]` smooth random process: anchors every `length` tokens, blended with cos/sin weights
    (which keep the variance constant), so tokens less than about `length` apart are correlated.
    With `n_pool > 0` the anchors are drawn from a pool of that many directions, so they recur far away."""
    n_anchor = T // length + 2
    if n_pool > 0:
        pool = _unit_dirs(n_pool, D, g)
        anchors = pool[torch.randint(0, n_pool, (n_anchor,), generator=g)]
    else:
        anchors = _unit_dirs(n_anchor, D, g)
    pos = torch.arange(T, dtype=torch.float64) / length
    i = pos.floor().long()
    x = (pos - i).float()[:, None] * (math.pi / 2)
    return torch.cos(x) * anchors[i] + torch.sin(x) * anchors[i + 1]


def structured_sequence(T: int, HQ: int, H: int, D: int, *, n_needles: int = 4, needle_logit: float = 8.0,
                        per_head_needles: bool = True, sink_tokens: int = 1, sink_logit: float = 8.0,
                        local_len: int = 256, local_logit: float = 3.0, topic_len: int = 1024,
                        topic_logit: float = 1.5, n_topics: int = 8, dtype: torch.dtype = torch.bfloat16,
                        device="cpu", seed: int = 0) -> SyntheticSequence:
    r"""One sequence with an attention sink, local context, recurring topics and far needles.

    On top of unit-normal `q`, `k`, `v` (whose logits are about unit-normal):

    - sink: keys `[0, sink_tokens)` and every query share a direction worth `sink_logit` logits, so
      every query puts a large share of its attention on the first tokens (InfLLM-v2 forces block 0);
    - local context: queries and keys follow one smooth random process (a new direction every
      `local_len` tokens), worth `local_logit` logits between a token and itself, less with distance;
    - topics: a second, slower process (every `topic_len` tokens) whose directions come from a pool
      of `n_topics`, so a topic, and the attention it draws, recurs far back (`topic_logit` logits);
    - needles (`needle_positions`): a 64-key block early on and a later run of 64 queries along a
      direction of their own, worth `needle_logit` logits; with `per_head_needles`, needle `i`
      lives only in KV head `i % H` (its keys, and the queries of its `HQ // H` heads).

    Args:
        T, HQ, H, D (int):
            Tokens, query heads, key/value heads (`HQ` a multiple of `H`), head dim.
        n_needles (int, Optional):
            Default: 4.
        needle_logit, sink_logit, local_logit, topic_logit (float, Optional):
            Strength of each ingredient in logits at softmax scale `1/sqrt(D)`; 0 leaves it out.
            Default: 8, 8, 3, 1.5.
        per_head_needles (bool, Optional):
            Default: `True`.
        sink_tokens (int, Optional):
            Default: 1.
        local_len, topic_len (int, Optional):
            Correlation lengths in tokens. Default: 256, 1024.
        n_topics (int, Optional):
            Size of the topic pool. Default: 8.
        dtype (torch.dtype, Optional):
            Default: `torch.bfloat16`.
        device (str or torch.device, Optional):
            Default: "cpu".
        seed (int, Optional):
            Everything is drawn on the CPU from this seed, so data do not depend on the device. Default: 0.

    Returns:
        SyntheticSequence: `q [T, HQ, D]`, `k, v [T, H, D]`, `cu_seqlens`, the needles, the parameters and
        `q_control`, the needles' query runs without the needles (`needle_retrieval`'s control).
    """
    for name, val, lo in (("T", T, 1), ("HQ", HQ, 1), ("H", H, 1), ("D", D, 1), ("n_needles", n_needles, 0),
                          ("sink_tokens", sink_tokens, 0), ("local_len", local_len, 1),
                          ("topic_len", topic_len, 1), ("n_topics", n_topics, 1)):
        if isinstance(val, bool) or not isinstance(val, int):
            raise TypeError(f"{name} must be an int, got {type(val).__name__}")
        if val < lo:
            raise ValueError(f"{name} must be >= {lo}, got {val}")
    if HQ % H:
        raise ValueError(f"HQ ({HQ}) must be a multiple of H ({H})")
    if n_needles and T < 4 * KV_BLOCK:
        raise ValueError(f"T must be >= {4 * KV_BLOCK} to place needles, got {T}")
    G = HQ // H
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, G, D, generator=g)
    k = torch.randn(T, H, D, generator=g)
    v = torch.randn(T, H, D, generator=g)
    root_d = math.sqrt(D)

    if sink_tokens and sink_logit:
        s = _unit_dirs(1, D, g)[0]
        q += _SINK_QUERY_SCALE * s
        k[:sink_tokens] += sink_logit * root_d / (_SINK_QUERY_SCALE * D) * s

    for logit, length, pool in ((local_logit, local_len, 0), (topic_logit, topic_len, n_topics)):
        if logit:
            z = _smooth_process(T, D, length, pool, g)                       # [T, D], |z| ~ sqrt(D)
            c = math.sqrt(logit * root_d / D)
            q += c * z[:, None, None, :]
            k += c * z[:, None, :]

    needles = []
    c = math.sqrt(needle_logit * root_d / D)
    positions = needle_positions(T, n_needles)
    q_control = torch.cat([q[qs:qs + KV_BLOCK] for _, qs in positions]) if positions else q[:0]
    for i, (kb, qs) in enumerate(positions):
        u = _unit_dirs(1, D, g)[0]
        h = i % H if per_head_needles else None
        heads = slice(None) if h is None else slice(h, h + 1)
        k[kb * KV_BLOCK:(kb + 1) * KV_BLOCK, heads] += c * u
        q[qs:qs + KV_BLOCK, heads] += c * u
        needles.append(Needle(kb, qs, h))

    cu = torch.tensor([0, T], dtype=torch.int32, device=device)
    params = {"T": T, "HQ": HQ, "H": H, "D": D, "n_needles": n_needles, "needle_logit": needle_logit,
              "per_head_needles": per_head_needles, "sink_tokens": sink_tokens, "sink_logit": sink_logit,
              "local_len": local_len, "local_logit": local_logit, "topic_len": topic_len,
              "topic_logit": topic_logit, "n_topics": n_topics, "seed": seed}
    return SyntheticSequence(q.reshape(T, HQ, D).to(device, dtype), k.to(device, dtype), v.to(device, dtype),
                             cu, needles, sink_tokens, local_len, params,
                             q_control.reshape(-1, HQ, D).to(device, dtype))


def needle_recall(topk_idx: torch.Tensor, needles, *, offset: int = 0) -> list[float]:
    r"""For each needle, the share of (query token of its run, KV head carrying it) pairs whose
    selection contains the needle's key block.

    Args:
        topk_idx (torch.Tensor):
            int32 `[H, total_q, K]`.
        needles (list[Needle] or list[tuple[int, int]]):
            `(key_block, query_start[, kv_head])`; a missing or None `kv_head` means every KV head.
        offset (int, Optional):
            Index of the sequence's first token in the packed `topk_idx`. Default: 0.

    Returns:
        list[float]: one recall in `[0, 1]` per needle.
    """
    check_tensor("topk_idx", topk_idx, ndim=3, dtypes=(torch.int32, torch.int64))
    out = []
    for n in needles:
        kb, qs = n[0], n[1]
        h = n[2] if len(n) > 2 else None
        sel = topk_idx[:, offset + qs:offset + qs + KV_BLOCK]
        if h is not None:
            sel = sel[h:h + 1]
        out.append((sel == kb).any(-1).float().mean().item() if sel.numel() else float("nan"))
    return out


# ------------------------------------------------------------------------------ the retrieval check

RETRIEVAL_GAIN = 0.5
"""The bar of the retrieval check: a needle is retrieved when its queries select its block in at least
this share of the (query token, KV head) pairs whose control query leaves the block out
(`NeedleRetrieval.gain`). The control's gain is 0 by construction, perfect retrieval's 1."""


class NeedleRetrieval(NamedTuple):
    """A needle's retrieval measured against its control (see `needle_retrieval`). Every share counts only
    the (query token of the run, KV head carrying the needle) pairs for which the needle's block is a
    choice by score: not an init block and outside the token's local window."""
    pairs: int              # (query token of the run, KV head) pairs for which the block is a choice by score
    recall: float           # share of those pairs whose selection holds the block
    control_recall: float   # the same share with the control's queries (the run without the needle direction)
    open_pairs: int         # pairs whose control selection leaves the block out: room to retrieve it
    gain: float             # share of the open pairs whose selection holds the block: the statistic

    @property
    def retrieved(self) -> bool:
        """`gain >= RETRIEVAL_GAIN` over at least one open pair (False under the control, always)."""
        return self.open_pairs > 0 and self.gain >= RETRIEVAL_GAIN

    def reason(self) -> str:
        """What the counts show, in words (why the needle counts as retrieved or not)."""
        if self.pairs == 0:
            return ("its block is forced for every query of its run (an init block, or inside the local "
                    "window): nothing to retrieve by score")
        if self.open_pairs == 0:
            return (f"the control's queries select its block in every one of the {self.pairs} pairs (a "
                    f"budget that holds it anyway, or a block that stands out for any query): nothing to "
                    f"retrieve")
        few = (f" (few: the control selects it in {self.control_recall:.0%} of the {self.pairs} pairs)"
               if self.open_pairs < 10 else "")
        return (f"selected in {self.gain:.0%} of the {self.open_pairs} pairs whose control query leaves it "
                f"out{few}, {RETRIEVAL_GAIN:.0%} needed")


def compare_to_control(hit: torch.Tensor, control_hit: torch.Tensor) -> NeedleRetrieval:
    r"""The retrieval statistic of a needle from its hits: `hit` and `control_hit` are bool tensors of one
    shape, one entry per (query, KV head) pair for which the needle's block is a choice by score (the
    caller leaves the forced pairs out), True where the selection holds the block, with the needle's
    queries and with the control's (the same queries without the needle direction).

    `gain` is the share of the pairs whose control misses the block that the needle's queries select it
    (NaN when the control misses none); see `needle_retrieval`.
    """
    check_tensor("hit", hit, dtypes=(torch.bool,))
    check_tensor("control_hit", control_hit, dtypes=(torch.bool,), shape=tuple(hit.shape))
    pairs = hit.numel()
    nan = float("nan")
    open_ = ~control_hit
    n_open = int(open_.sum())
    return NeedleRetrieval(pairs, int(hit.sum()) / pairs if pairs else nan,
                           int(control_hit.sum()) / pairs if pairs else nan, n_open,
                           int(hit[open_].sum()) / n_open if n_open else nan)


def _window(qs: int, T: int, align: int) -> tuple[int, int]:
    """Rows `[a, b)` that stage 1 re-runs for a query run `[qs, qs + 64)` of a `T`-token sequence: `a` the
    run's first block start rounded down to `align`, `b` the first position >= the run's end with
    `b = T (mod align)`. Stage 1's visibility of the compressed keys is aligned bottom-right (a query
    sees `(r + 1) // s - 1 + n - (Lq - s + 1) // s` keys), so a window that starts on a multiple of the
    strides and ends on `T` modulo them sees, row for row, what the whole sequence sees, quirks included."""
    a = qs // align * align
    e = qs + KV_BLOCK
    return a, e + (T - e) % align


def _window_selection(qw, k, windows, cfg, backend):
    """Stage 1 on the packed windows: window `i` is a sequence of `b - a` queries after `a` cached keys,
    against the compressed keys of the prefix `[0, b)` (the first windows of the whole sequence's)."""
    dev = qw.device
    kmax = max(b for _, b in windows)
    cuk = torch.tensor([0, kmax], dtype=torch.int32, device=dev)
    ck1, _ = compress_k(k[:kmax], cuk, cfg.kernel_size, cfg.kernel_stride, backend=backend)
    if cfg.exact_stage1:
        ck2, sizes2 = ck1, (cfg.kernel_size, cfg.kernel_stride)
    else:
        ck2, _ = compress_k(k[:kmax], cuk, cfg.coarse_kernel_size, cfg.coarse_kernel_stride, backend=backend)
        sizes2 = (cfg.coarse_kernel_size, cfg.coarse_kernel_stride)
    n1 = [n_windows(b, cfg.kernel_size, cfg.kernel_stride) for _, b in windows]
    n2 = [n_windows(b, *sizes2) for _, b in windows]

    def cu(lengths):
        return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=dev)

    return stage1_select(qw, torch.cat([ck1[:n] for n in n1]), torch.cat([ck2[:n] for n in n2]),
                         cu([b - a for a, b in windows]), cu(n1), cu(n2), max(b - a for a, b in windows),
                         cache_lens=[a for a, _ in windows], softmax_scale=cfg.softmax_scale, topk=cfg.topk,
                         local_blocks=cfg.local_blocks, init_blocks=cfg.init_blocks,
                         block_size=cfg.block_size,
                         kernel_stride=cfg.kernel_stride, coarse_kernel_stride=cfg.coarse_kernel_stride,
                         score_dtype=cfg.score_dtype, backend=backend)


def needle_retrieval(q: torch.Tensor, k: torch.Tensor, q_control: torch.Tensor, needles, config, *,
                     backend: str = "auto") -> list[NeedleRetrieval]:
    r"""Whether stage 1 retrieves each needle, against a control that cannot pass.

    **The control** is the same sequence without the needle: the same keys (the needle's block
    included), and the needle's 64 queries without the direction that looks for it (`q_control`, which
    `synthetic_sequence(..., return_control=True)` and `structured_sequence` give). Stage 1 runs on the
    needle's queries twice, as they are and as the control's, against the same compressed keys; each
    (query token of the run, KV head carrying the needle) pair then has two outcomes, whether its
    selection holds the needle's block with the needle and without it.

    **What counts**: only the pairs for which the block is a choice by score, on both sides alike: a
    query whose forced blocks (the `init_blocks` first, the `local_blocks + 1` ending at its own) hold
    the needle's block selects it whatever it scores, so it is left out of every share (`pairs` counts
    the rest).

    **The statistic**, `gain`: among the pairs whose control selection leaves the block out (`open_pairs`:
    the block would not be there without the needle), the share whose selection holds it. A needle is
    retrieved when `gain >= RETRIEVAL_GAIN` (0.5: the needle puts its block into the selection of at
    least half of the pairs that would go without it).

    **Why it cannot be fooled.** Under the control the two inputs are the same tensors, so the two
    selections are equal and `gain` is 0 at every budget, window, length and seed: the control fails by
    construction (or has no open pair, and fails too). A share of queries that select a block says
    nothing by itself (a large budget, or a block that stands out under mean pooling, makes every query
    select it); the control's recall on the same pairs is that baseline, measured on the same query
    positions and the same heads rather than estimated from other queries, and `gain` counts only what
    the needle adds above it. It does not fall as the budget grows: a budget that holds the block for
    most queries leaves fewer open pairs, not a lower share of them; a budget that holds it for every
    query leaves none, and nothing is shown (not retrieved). Perfect retrieval gives 1 at any budget,
    so the bar sits half way between the two.

    Stage 1 re-runs on a window of rows around each run only (the run's first block to its end, aligned
    so that every row sees the compressed keys the whole sequence's run sees: `_window`), as a packed
    batch of chunked-prefill sequences: cheap at any length, and the real side is the selection the whole
    sequence makes at those rows (the tests check it). Both sides run the same shapes, so the control's
    two selections are equal to the bit on any backend.

    Args:
        q (torch.Tensor):
            The sequence's queries `[T, HQ, D]` (one sequence), with the needles' runs.
        k (torch.Tensor):
            Its keys `[T, H, D]`.
        q_control (torch.Tensor):
            The needles' runs without the needle direction: `[len(needles) * 64, HQ, D]`, run `i` in rows
            `[64 i, 64 i + 64)`; equal to q's rows of the runs for the control.
        needles (list[Needle] or list[tuple[int, int]]):
            `(key_block, query_start[, kv_head])`, at least one; a missing or None `kv_head` means every
            KV head.
        config (InfLLMv2Config):
            The selection's parameters (budget, window, compressions, score dtype).
        backend (str, Optional):
            Stage 1's and the compressions' backend. Default: "auto".

    Returns:
        list[NeedleRetrieval]: one per needle.
    """
    cfg = check_config(config)
    check_tensor("q", q, ndim=3)
    T, HQ, D = q.shape
    check_tensor("k", k, ndim=3, dtypes=(q.dtype,), device=q.device)
    if k.shape[0] != T or k.shape[2] != D or k.shape[1] < 1 or HQ % k.shape[1]:
        raise ValueError(f"k must be [T={T}, H, D={D}] with H dividing HQ={HQ}, got {tuple(k.shape)}")
    H = k.shape[1]
    if isinstance(needles, (str, bytes)) or not hasattr(needles, "__len__"):
        raise TypeError(f"needles must be a list of (key_block, query_start[, kv_head]), got "
                        f"{type(needles).__name__}")
    if len(needles) == 0:
        raise ValueError("needles is empty: with nothing planted there is nothing to retrieve, and the check "
                         "would pass by default")
    check_tensor("q_control", q_control, dtypes=(q.dtype,), shape=(len(needles) * KV_BLOCK, HQ, D),
                 device=q.device)
    parsed = []
    for i, n in enumerate(needles):
        kb, qs = n[0], n[1]
        h = n[2] if len(n) > 2 else None
        fields = (("key_block", kb), ("query_start", qs)) + ((("kv_head", h),) if h is not None else ())
        for name, val in fields:
            if isinstance(val, bool) or not isinstance(val, int):
                raise TypeError(f"needles[{i}]: {name} must be an int, got {type(val).__name__}")
        if not (0 <= qs and qs + KV_BLOCK <= T):
            raise ValueError(f"needles[{i}]: the query run [{qs}, {qs + KV_BLOCK}) must lie inside the "
                             f"{T} tokens")
        if not (0 <= kb < -(-T // KV_BLOCK)):
            raise ValueError(f"needles[{i}]: key_block must be in [0, {-(-T // KV_BLOCK)}), got {kb}")
        if h is not None and not 0 <= h < H:
            raise ValueError(f"needles[{i}]: kv_head must be in [0, {H}), got {h}")
        parsed.append((kb, qs, h))
    align = math.lcm(cfg.block_size, cfg.kernel_stride, cfg.coarse_kernel_stride)
    windows = [_window(qs, T, align) for _, qs, _ in parsed]
    real = torch.cat([q[a:b] for a, b in windows])
    ctrl = real.clone()
    offsets = list(itertools.accumulate([0] + [b - a for a, b in windows]))
    for i, ((_, qs, _), (a, _)) in enumerate(zip(parsed, windows)):
        start = offsets[i] + qs - a
        ctrl[start:start + KV_BLOCK] = q_control[i * KV_BLOCK:(i + 1) * KV_BLOCK]
    with torch.no_grad():
        sel = _window_selection(real, k, windows, cfg, backend)
        sel_c = _window_selection(ctrl, k, windows, cfg, backend)
    out = []
    for i, ((kb, qs, h), (a, _)) in enumerate(zip(parsed, windows)):
        rows = slice(offsets[i] + qs - a, offsets[i] + qs - a + KV_BLOCK)
        heads = slice(None) if h is None else slice(h, h + 1)
        qb = torch.arange(qs, qs + KV_BLOCK, device=q.device) // cfg.block_size
        by_score = (kb >= cfg.init_blocks) & (kb < qb - cfg.local_blocks)              # [64]
        hit = (sel[heads, rows] == kb).any(-1)[:, by_score]
        hit_c = (sel_c[heads, rows] == kb).any(-1)[:, by_score]
        out.append(compare_to_control(hit.cpu(), hit_c.cpu()))
    return out
