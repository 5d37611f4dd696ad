"""Shared pieces of the property-based fuzz tests (docs/reliability.md, "Fuzzing"): hypothesis
strategies for ragged batches and hostile selections, brute-force oracles, and the one-line
reproducer every case records with `note()`.

The oracles are written from the semantics in docs/semantics.md alone (a dense boolean mask built
key by key and a plain masked softmax in float64), never from the references' code, so the CPU
share checks the references and the GPU share checks the kernels against those references.
"""
from __future__ import annotations

import torch
from hypothesis import note
from hypothesis import strategies as st

from infllm_cupy.testing import cu_seqlens_from_lengths

KV_BLOCK = 64

# one sequence length: zero-length and one-token sequences are drawn often, lengths around block
# boundaries (63, 64, 65, 127, 128, 129) too, and anything up to `hi`
def seq_len(hi: int = 300) -> st.SearchStrategy[int]:
    return st.one_of(st.sampled_from([0, 1, 1, 2, 63, 64, 65, 127, 128, 129]),
                     st.integers(0, hi))


def lengths(hi: int = 300, max_batch: int = 4, min_total: int = 0) -> st.SearchStrategy[list[int]]:
    return st.lists(seq_len(hi), min_size=1, max_size=max_batch).filter(lambda x: sum(x) >= min_total)


# (HQ, H): G from 1 to 16 with a non-power of two, one or two KV heads
heads = st.sampled_from([(1, 1), (2, 1), (2, 2), (4, 2), (3, 1), (6, 2), (8, 1), (16, 2), (12, 1)])


def reproducer(name: str, **args) -> str:
    """The one line that reruns a fuzz case: the case function and its drawn arguments."""
    call = f"{name}(" + ", ".join(f"{k}={v!r}" for k, v in args.items()) + ")"
    note(f"reproduce: {call}")
    return call


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def hostile_topk(H: int, lq: list[int], lk: list[int], K: int, seed: int, *, mix: str) -> torch.Tensor:
    """`[H, total_q, K]` int32 selections. `mix`: "valid" (blocks of the sequence, may be future),
    "junk" (valid mixed with -1 tails, other negatives, out-of-range and future blocks, duplicates),
    "empty" (junk plus whole rows of -1), "all_neg" (every entry negative)."""
    g = gen(seed)
    rows = []
    for Lq, Lk in zip(lq, lk):
        nb = max(1, -(-Lk // KV_BLOCK))
        u = torch.rand(H, Lq, K, generator=g)
        if mix == "all_neg":
            idx = -1 - torch.floor(u * 5).long()
        elif mix == "valid":
            idx = torch.floor(u * nb).long()
        else:
            idx = torch.floor(u * (nb + 6)).long() - 3                    # [-3, nb + 2]
            big = torch.rand(H, Lq, K, generator=g) < 0.05
            idx = torch.where(big, torch.full_like(idx, 2**31 - 1), idx)   # far out of range
            dup = torch.rand(H, Lq, K, generator=g) < 0.2
            idx = torch.where(dup, idx.roll(1, dims=-1), idx)
            tail = torch.rand(H, Lq, 1, generator=g) * K
            idx = torch.where(torch.arange(K)[None, None] > tail + K // 2, torch.full_like(idx, -1), idx)
            if mix == "empty":
                empty = torch.rand(H, Lq, 1, generator=g) < 0.2
                idx = torch.where(empty, torch.full_like(idx, -1), idx)
        rows.append(idx)
    if not rows:
        return torch.zeros(H, 0, K, dtype=torch.int32)
    return torch.cat(rows, dim=1).to(torch.int32)


def qkv(lq, lk, HQ, H, D, dtype, seed, device="cpu", scale_k: float = 1.0):
    g = gen(seed)
    q = torch.randn(sum(lq), HQ, D, generator=g).to(device, dtype)
    k = (scale_k * torch.randn(sum(lk), H, D, generator=g)).to(device, dtype)
    v = torch.randn(sum(lk), H, D, generator=g).to(device, dtype)
    do = torch.randn(sum(lq), HQ, D, generator=g).to(device, dtype)
    return q, k, v, do, cu_seqlens_from_lengths(lq, device), cu_seqlens_from_lengths(lk, device)


# --------------------------------------------------------------------------------------------
# brute-force oracles (float64, key by key)
# --------------------------------------------------------------------------------------------
def token_allow(topk_idx: torch.Tensor, b_rows: slice, Lq: int, Lk: int, causal: bool) -> torch.Tensor:
    """`[H, Lq, Lk]` bool: key j of the sequence is attended by row r under KV head h when block
    j // 64 is listed in the row's selection, and, causal, j <= r + Lk - Lq (bottom-right)."""
    sel = topk_idx[:, b_rows].long()                                      # [H, Lq, K]
    blk = torch.arange(Lk) // KV_BLOCK
    allow = (sel[..., None] == blk[None, None, None]).any(2)              # [H, Lq, Lk]
    if causal:
        allow &= torch.arange(Lk)[None, :] <= (torch.arange(Lq) + Lk - Lq)[:, None]
    return allow


def layout_allow(mask: torch.Tensor, q_block: int, b: int, Lq: int, Lk: int, causal: bool) -> torch.Tensor:
    m = mask[b] if mask.dim() == 4 else mask                             # [H, NQB, NKB]
    r, j = torch.arange(Lq), torch.arange(Lk)
    allow = m[:, (r // q_block)[:, None], (j // KV_BLOCK)[None, :]]        # [H, Lq, Lk]
    if causal:
        allow &= j[None, :] <= (r + Lk - Lq)[:, None]
    return allow


def dense_masked_attention(q, k, v, cu_q, cu_k, allow_of, scale=None):
    """Plain masked softmax attention per sequence and head in float64; `allow_of(b, Lq, Lk)` gives
    `[H, Lq, Lk]`. Returns `(out [total_q, HQ, D], lse [HQ, total_q])`: rows with no allowed key
    give 0 and +inf. Differentiable."""
    HQ, D = q.shape[1], q.shape[2]
    H = k.shape[1]
    G = HQ // H
    scale = D ** -0.5 if scale is None else scale
    cq, ck = cu_q.tolist(), cu_k.tolist()
    outs, lses = [], []
    for b in range(len(cq) - 1):
        Lq, Lk = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
        if Lq == 0:
            continue
        qb = q[cq[b]:cq[b + 1]].double()
        kb, vb = k[ck[b]:ck[b + 1]].double(), v[ck[b]:ck[b + 1]].double()
        allow = allow_of(b, Lq, Lk)                                        # [H, Lq, Lk]
        out_b = []
        lse_b = []
        for hq in range(HQ):
            h = hq // G
            s = (qb[:, hq] @ kb[:, h].T) * scale                           # [Lq, Lk]
            a = allow[h]
            s = s.masked_fill(~a, float("-inf"))
            has = a.any(-1)
            m = torch.cat([s, s.new_full((Lq, 1), float("-inf"))], -1).max(-1).values        # Lk may be 0
            m = torch.where(has, m, torch.zeros_like(m)).detach()                            # a shift only
            p = torch.exp(s - m[:, None])
            z = p.sum(-1)
            o = (p @ vb[:, h]) / torch.where(has, z, torch.ones_like(z))[:, None]
            out_b.append(torch.where(has[:, None], o, torch.zeros_like(o)))
            lse_b.append(torch.where(has, m + torch.log(torch.where(has, z, torch.ones_like(z))),
                                     torch.full_like(m, float("inf"))).detach())
        outs.append(torch.stack(out_b, 1))
        lses.append(torch.stack(lse_b, 0))
    out = torch.cat(outs) if outs else q.new_zeros(0, HQ, D, dtype=torch.float64)
    lse = torch.cat(lses, 1) if lses else torch.zeros(HQ, 0, dtype=torch.float64)
    return out, lse
