"""H2O (heavy-hitter oracle) cache eviction driven by decode attention weights. Design:
docs/decode.md ("H2O").

H2O keeps, per KV head, the positions with the largest attention mass accumulated over the decode
steps so far (the heavy hitters) plus the most recent ones. `sparse_decode(...,
return_attn_weights=True, weights="per_kv_head")` gives exactly the per-step term: the softmax
probabilities of each position summed over the query heads of the group, `[B, H, W]`.

    h2o = H2O(batch, num_kv_heads, width, budget=256, recent=64)
    for step ...:
        out, w = sparse_decode(q, cache, return_attn_weights=True, weights="per_kv_head")
        h2o.update(w)
    kept = h2o.kept(cache.seqlens)                  # [B, H, budget] positions, ascending, -1 padded
    k2, v2, lens2 = h2o.evict(k_cache, v_cache, cache.seqlens)   # compacted per head
"""
from __future__ import annotations

import torch

from .._checks import check_tensor, host_int_list, validate_values


class H2O:
    r"""Accumulated attention scores per (sequence, KV head, position) and the H2O keep rule.

    Args:
        batch, num_kv_heads, width (int): B, H and the cache's width W (positions per sequence).
        budget (int): positions kept per (sequence, KV head) by `kept` / `evict`.
        recent (int): of those, the most recent positions kept whatever their score (`<= budget`).
        device: where the scores live. Default: "cpu".

    Attributes:
        scores (torch.Tensor): float32 `[B, H, W]`, the sum over steps of the attention weights.
    """

    def __init__(self, batch: int, num_kv_heads: int, width: int, *, budget: int, recent: int, device="cpu"):
        for name, v, lo in (("batch", batch, 1), ("num_kv_heads", num_kv_heads, 1), ("width", width, 1),
                            ("budget", budget, 1), ("recent", recent, 0)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
        if recent > budget:
            raise ValueError(f"recent ({recent}) must be <= budget ({budget})")
        self.budget, self.recent = budget, recent
        self.scores = torch.zeros(batch, num_kv_heads, width, dtype=torch.float32, device=device)

    def reset(self) -> None:
        self.scores.zero_()

    def update(self, weights: torch.Tensor) -> None:
        """Add one step's attention weights: `[B, H, W]` (per KV head: ask the step for
        `weights="per_kv_head"`, which writes 1/G of the per-head form's bytes) or `[B, HQ, W]` (per
        query head, summed here over each group of `HQ / H` heads: the same scores to fp32 rounding)."""
        B, H, W = self.scores.shape
        check_tensor("weights", weights, ndim=3, device=self.scores.device)
        if not weights.dtype.is_floating_point:
            raise TypeError(f"weights must be a float tensor (attention weights), got {weights.dtype}")
        if weights.shape[0] != B or weights.shape[2] != W or weights.shape[1] % H:
            raise ValueError(f"weights must have shape [B={B}, H={H} or a multiple, W={W}], got "
                             f"{tuple(weights.shape)}")
        w = weights.float()
        if w.shape[1] != H:
            w = w.view(B, H, w.shape[1] // H, W).sum(2)
        # one host read: a NaN or a negative weight would stay in the scores for good
        if validate_values() and not bool(((w >= 0) & (w < float("inf"))).all()):
            raise ValueError("weights must be finite and >= 0 (attention weights), got a NaN, an infinity or "
                             "a negative value; the scores are unchanged")
        self.scores += w

    def kept(self, seqlens) -> torch.Tensor:
        """Positions kept per (sequence, KV head): int64 `[B, H, budget]`, ascending, `-1` padded.

        Sequence b of `L_b` positions keeps all of them when `L_b <= budget`; otherwise the
        `recent` last ones and the `budget - recent` highest scores among the others (ties to the
        lower position). Static shapes; `seqlens` (B lengths in `[0, W]`) is read on the host to check
        it, as every value check (`_checks.validate_values`: not under torch.compile nor with
        `INFLLM_CUPY_VALIDATE=0`)."""
        B, H, W = self.scores.shape
        L = self._lengths(seqlens).view(B, 1, 1)
        t = torch.arange(W, device=self.scores.device).view(1, 1, W)
        valid = t < L
        recent = valid & (t >= L - self.recent)
        # Rank key: recent positions first (+inf), then by score; invalid positions last. A stable
        # descending sort leaves equal scores in position order (ties to the lower position).
        key = torch.where(recent, torch.full_like(self.scores, float("inf")), self.scores)
        key = torch.where(valid, key, torch.full_like(key, float("-inf")))
        order = torch.sort(key, dim=-1, descending=True, stable=True).indices[..., :self.budget]
        if order.shape[-1] < self.budget:
            order = torch.nn.functional.pad(order, (0, self.budget - order.shape[-1]), value=W)
        take = torch.gather(valid.expand(B, H, W), -1, order.clamp(max=W - 1)) & (order < W)
        pos = torch.where(take, order, torch.full_like(order, W))
        pos = torch.sort(pos, dim=-1).values
        return torch.where(pos < W, pos, torch.full_like(pos, -1))

    def _lengths(self, seqlens) -> torch.Tensor:
        """`seqlens` as int64 `[B]` on the scores' device: B integers (ints or an integer tensor), each
        in `[0, W]` (checked on the host when the values are checked, `_checks.validate_values`)."""
        B, _H, W = self.scores.shape
        if isinstance(seqlens, torch.Tensor):
            if seqlens.dtype.is_floating_point or seqlens.dtype == torch.bool:
                raise TypeError(f"seqlens must hold integers, got a {seqlens.dtype} tensor")
            L = seqlens.reshape(-1)
        else:   # a list of ints; None, an int or a string is refused here, not iterated
            L = torch.tensor(host_int_list("seqlens", seqlens, what="ints, one length per sequence"),
                             dtype=torch.int64)
        if L.numel() != B:
            raise ValueError(f"seqlens must have one length per sequence ({B}), got {L.numel()}")
        if validate_values() and not bool(((L >= 0) & (L <= W)).all()):
            raise ValueError(f"seqlens must be in [0, {W}] (the scores' width), got {L.tolist()[:8]}")
        return L.to(self.scores.device, torch.int64)

    def evict(self, k_cache: torch.Tensor, v_cache: torch.Tensor, seqlens):
        """Compact a contiguous cache `[B, W, H, D]` to the kept positions, each KV head its own:
        returns `(k [B, budget, H, D], v, seqlens int32 [B] = min(L, budget))`, and moves the
        scores of the kept positions to the front (the rest zero), so accumulation continues on
        the compacted cache. Positions past a sequence's new length are zero."""
        B, H, W = self.scores.shape
        if isinstance(k_cache, torch.Tensor) and k_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            # an 8-bit cache's values mean nothing without its scales, which live in the DecodeCache
            raise ValueError(f"k_cache must be a 16- or 32-bit cache, got {k_cache.dtype}: for an FP8 "
                             "DecodeCache, evict from cache.dequantized() and append the result to a new "
                             "cache (docs/decode.md §16)")
        check_tensor("k_cache", k_cache, ndim=4, device=self.scores.device)
        check_tensor("v_cache", v_cache, shape=tuple(k_cache.shape), dtypes=(k_cache.dtype,),
                     device=self.scores.device)
        if tuple(k_cache.shape[:3]) != (B, W, H):
            raise ValueError(f"k_cache must have shape [B={B}, W={W}, H={H}, D], got {tuple(k_cache.shape)}")
        kept = self.kept(seqlens)                                        # [B, H, budget]
        ok = kept >= 0
        idx = kept.clamp(min=0)
        D = k_cache.shape[3]
        gi = idx.transpose(1, 2)[..., None].expand(B, self.budget, H, D)  # [B, budget, H, D]
        m = ok.transpose(1, 2)[..., None]
        k2 = torch.where(m, torch.gather(k_cache, 1, gi), torch.zeros((), dtype=k_cache.dtype))
        v2 = torch.where(m, torch.gather(v_cache, 1, gi), torch.zeros((), dtype=v_cache.dtype))
        sc = torch.where(ok, torch.gather(self.scores, -1, idx), torch.zeros(()))
        self.scores.zero_()
        self.scores[..., :self.budget] = sc[..., :W]
        lens = ok[:, 0].sum(-1).to(torch.int32)
        return k2, v2, lens


def h2o_kept_eager(scores: torch.Tensor, seqlens, budget: int, recent: int) -> list:
    """The H2O rule written out with Python loops (for tests): per (b, h) the sorted kept positions."""
    B, H, _W = scores.shape
    out = []
    for b in range(B):
        L = int(seqlens[b])
        row = []
        for h in range(H):
            if L <= budget:
                row.append(list(range(L)))
                continue
            rec = list(range(L - recent, L))
            rest = sorted(range(L - recent), key=lambda t: (-float(scores[b, h, t]), t))[:budget - recent]
            row.append(sorted(rest + rec))
        out.append(row)
    return out
