"""Synthetic long sequences with the structure InfLLM-v2's selection should find: an attention sink,
local context, recurring topics and far "needle" keys that later queries look for.

Each ingredient adds a component along a shared direction to queries and keys, sized in logits (the
extra `q . k / sqrt(D)` it gives the pair it links), on top of unit-normal noise whose logits are
themselves about unit-normal. Used by the demo (`python -m infllm_cupy demo`), the notebooks and tests.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from ._checks import check_tensor
from ._rules import KV_BLOCK

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

    `q [T, HQ, D]`, `k, v [T, H, D]`, `cu_seqlens` int32 `[2]` (all on the requested device).
    """
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cu_seqlens: torch.Tensor
    needles: list[Needle]
    sink_tokens: int
    local_len: int
    params: dict = field(default_factory=dict)

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
                       needle_logit: float = 8.0):
    """The demo's sequence: unit-normal q, k, v; every 64-key block along a direction of its own; and
    `n_needles` later runs of 64 queries (every head) that look for one early block each.

    Each key block gets a random direction of the keys' own norm, so that mean pooling leaves every
    compressed key with about the same norm and no block stands out on its own: a query that looks for
    nothing picks among them by chance. A needle's query run carries its key block's direction, worth
    `needle_logit` logits (`q . k / sqrt(D)`) against those keys. `needle_logit=0` is the control: the
    same keys (needle blocks included), no query that looks for them.

    Returns:
        q `[T, HQ, D]`, k, v `[T, H, D]` (`dtype` on `device`) and the list of
        `(needle key block, query start)` pairs.
    """
    if not math.isfinite(needle_logit) or needle_logit < 0:
        raise ValueError(f"needle_logit must be a finite number >= 0, got {needle_logit!r}")
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, HQ, D, generator=g)
    k = torch.randn(T, H, D, generator=g)
    v = torch.randn(T, H, D, generator=g)
    nb = -(-T // KV_BLOCK)
    block_dirs = _unit_dirs(nb, D, g)                                       # [NB, D], norm sqrt(D)
    k += block_dirs.repeat_interleave(KV_BLOCK, 0)[:T, None, :]
    needles = needle_positions(T, n_needles)
    for kb, qs in needles:
        q[qs:qs + KV_BLOCK] += needle_logit / math.sqrt(D) * block_dirs[kb]
    return q.to(device, dtype), k.to(device, dtype), v.to(device, dtype), needles


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
        SyntheticSequence: `q [T, HQ, D]`, `k, v [T, H, D]`, `cu_seqlens`, the needles and the parameters.
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
    for i, (kb, qs) in enumerate(needle_positions(T, n_needles)):
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
                             cu, needles, sink_tokens, local_len, params)


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


class NeedleRetrieval(NamedTuple):
    """How much more often a needle's own queries select its key block than the queries that do not look
    for it (see `needle_retrieval`)."""
    recall: float        # share of (query of its run, KV head) pairs that select the needle's block
    base_rate: float     # the same share over the other queries that could select it by score
    lift: float          # recall - base_rate: 1 for perfect retrieval, about 0 for none


def needle_retrieval(topk_idx: torch.Tensor, needles, *, local_blocks: int, init_blocks: int = 1,
                     offset: int = 0, seqlen: int | None = None) -> list[NeedleRetrieval]:
    r"""Retrieval of each needle measured against a control: the needle's own queries against the other
    queries of the sequence.

    `recall` is `needle_recall`'s share. `base_rate` is the same share over every other query token
    (same KV heads) for which the needle's block is a choice by score: a later token whose forced blocks
    (the `init_blocks` first, the local window of `local_blocks + 1` blocks) do not include it. A block
    that every query picks (one that stands out under mean pooling, or a budget that holds nearly every
    block) has a high base rate and no lift, however high its recall.

    Args:
        topk_idx (torch.Tensor):
            int32 `[H, total_q, K]`.
        needles (list[Needle] or list[tuple[int, int]]):
            `(key_block, query_start[, kv_head])`; a missing or None `kv_head` means every KV head.
        local_blocks, init_blocks (int):
            The selection's forced blocks (`InfLLMv2Config`).
        offset (int, Optional):
            Index of the sequence's first token in the packed `topk_idx`. Default: 0.
        seqlen (int, Optional):
            Tokens of the sequence. Default: `None` (from `offset` to the end of `topk_idx`).

    Returns:
        list[NeedleRetrieval]: one per needle; NaN where a share has no query to count.
    """
    check_tensor("topk_idx", topk_idx, ndim=3, dtypes=(torch.int32, torch.int64))
    L = topk_idx.shape[1] - offset if seqlen is None else seqlen
    pos = torch.arange(L, device=topk_idx.device)
    out = []
    for n in needles:
        kb, qs = n[0], n[1]
        h = n[2] if len(n) > 2 else None
        sel = topk_idx[:, offset:offset + L] if h is None else topk_idx[h:h + 1, offset:offset + L]
        hit = (sel == kb).any(-1).float()                                   # [H or 1, L]
        own = (pos >= qs) & (pos < qs + KV_BLOCK)
        by_score = (kb >= init_blocks) & (pos // KV_BLOCK > kb + local_blocks)
        others = by_score & ~own
        recall = hit[:, own].mean().item() if bool(own.any()) else float("nan")
        base = hit[:, others].mean().item() if bool(others.any()) else float("nan")
        out.append(NeedleRetrieval(recall, base, recall - base))
    return out
