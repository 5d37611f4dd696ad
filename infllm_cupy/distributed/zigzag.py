"""The zigzag layout of context parallelism (docs/context_parallel.md §2) and its collectives.

Every sequence `b` of length `L_b` is cut into `2W` equal chunks of `c_b = L_b / (2W)` tokens
(`W` ranks); rank `r` holds chunks `r` and `2W - 1 - r` (Megatron's load balancing: an early and a
late chunk, so every rank has the same causal work). A rank's tensor is packed like the global
one: for each sequence in order, its chunk `r` then its chunk `2W - 1 - r`, so the local
`cu_seqlens` is the global one divided by `W`.

`ZigzagPlan` holds the host-side bookkeeping of one (lengths, W, rank): which local rows belong to
which chunk, the permutation between the all-gathered buffer (rank-major) and the natural
(global packed) order, and, for each of the rank's two chunk slots, the varlen description that
lets the single-GPU ops see the chunk's queries at their global positions (§3).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
import torch.distributed as dist

from .._rules import KV_BLOCK, n_windows

# torch 2.13 renamed the tensor forms of the two collectives (the old names warn); 2.11 has only those.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_rows(x: torch.Tensor, group=None, *, async_op: bool = False):
    """`[W * n, ...]` of every rank's `[n, ...]` in rank order; with `async_op`, `(out, work)`."""
    W = dist.get_world_size(group)
    out = x.new_empty((W * x.shape[0],) + tuple(x.shape[1:]))
    work = _all_gather(out, x.contiguous(), group=group, async_op=async_op)
    return (out, work) if async_op else out


def reduce_scatter_rows(x: torch.Tensor, group=None, *, async_op: bool = False):
    """Sum over ranks of `[W * n, ...]`, each rank keeping its `[n, ...]` slice; with `async_op`,
    `(out, work)`."""
    W = dist.get_world_size(group)
    out = x.new_empty((x.shape[0] // W,) + tuple(x.shape[1:]))
    work = _reduce_scatter(out, x.contiguous(), group=group, async_op=async_op)
    return (out, work) if async_op else out


def zigzag_granule(world_size: int, q_block: int = KV_BLOCK) -> int:
    """Every sequence length must be a multiple of this: `2W` chunks of whole 64-key blocks (and whole
    layout query blocks), which keeps compression windows, stage-1 visibility and stage-2 blocks
    aligned with the chunks (docs/context_parallel.md §3)."""
    return 2 * world_size * math.lcm(KV_BLOCK, q_block)


def check_zigzag_lengths(lengths, world_size: int, q_block: int = KV_BLOCK) -> None:
    """ValueError unless every length is a positive multiple of `zigzag_granule(world_size, q_block)`."""
    g = zigzag_granule(world_size, q_block)
    bad = [(b, L) for b, L in enumerate(lengths) if L <= 0 or L % g]
    if bad:
        b, L = bad[0]
        raise ValueError(
            f"cu_seqlens: sequence {b} has length {L}; with {world_size} ranks every sequence must be a "
            f"positive multiple of {g} (2 x world size chunks of whole {math.lcm(KV_BLOCK, q_block)}-token "
            f"blocks); pad the sequences ({len(bad)} of {len(lengths)} are not)"
        )


@dataclasses.dataclass(frozen=True)
class Slot:
    """One of a rank's two chunk slots (0: chunk `r`, 1: chunk `2W-1-r`) as a varlen batch over the
    natural-order keys `k_full[:k_end]`. One sequence (B = 1): the chunk's queries against keys
    `[0, e)`, the prefix up to the chunk's end, so that bottom-right causal alignment puts its
    queries at their global positions. B > 1: `2B` sequences, `2b` the chunk of sequence b against
    `[S_b, S_b + e_b)`, `2b + 1` a query-less filler over `[S_b + e_b, S_{b+1})` that keeps the
    next prefix starting where its sequence starts (docs/context_parallel.md §3)."""

    starts: tuple  # a_b: global position of the chunk's first token inside its sequence
    ends: tuple  # e_b = a_b + c_b
    chunk: tuple  # c_b
    rows: object  # the chunk's local rows: a slice (B = 1) or an int64 index tensor
    cu_q: torch.Tensor  # int32 [2B+1] over the slot's packed queries
    cu_k: torch.Tensor  # int32 [2B+1] over the natural-order keys
    cache_lens: torch.Tensor  # int32 [2B]: a_b for the chunks, 0 for the fillers
    max_q: int
    max_k: int
    k_end: int  # keys past this row are no slot sequence's (B = 1: e; else the total)


@dataclasses.dataclass(frozen=True)
class ZigzagPlan:
    """Bookkeeping of the zigzag layout for sequence `lengths`, `world_size` ranks, rank `rank`."""

    lengths: tuple
    world_size: int
    rank: int
    device: torch.device
    n_local: int
    seq_starts: tuple  # S_b, global packed start of each sequence
    nat_from_gath: torch.Tensor  # int64 [total]: natural row t is gathered row nat_from_gath[t]
    gath_from_nat: torch.Tensor  # the inverse permutation
    local_rows: torch.Tensor  # int64 [n_local]: the global rows this rank holds, in local order
    slots: tuple  # (Slot, Slot)

    @property
    def total(self) -> int:
        return sum(self.lengths)

    def slot_compressed_cu(
        self, slot: Slot, kernel_size: int, kernel_stride: int
    ) -> tuple[torch.Tensor, int]:
        """(`cu` int32, `end`) of the slot over the full sequences' compressed keys `ck[:end]`: a chunk's
        sequence holds the windows that end by `e_b` (a prefix of its sequence's windows), a filler
        the rest of the sequence's."""
        if len(self.lengths) == 1:
            n_e = n_windows(slot.ends[0], kernel_size, kernel_stride)
            return torch.tensor([0, n_e], dtype=torch.int32, device=self.device), n_e
        cu, acc = [0], 0
        for L, e in zip(self.lengths, slot.ends):
            n_e, n_L = n_windows(e, kernel_size, kernel_stride), n_windows(L, kernel_size, kernel_stride)
            cu += [acc + n_e, acc + n_L]
            acc += n_L
        return torch.tensor(cu, dtype=torch.int32, device=self.device), acc


def zigzag_plan(lengths, world_size: int, rank: int, device) -> ZigzagPlan:
    """The (cached) `ZigzagPlan` of these sequence lengths; lengths must be multiples of `2 * world_size`."""
    return _zigzag_plan(tuple(int(L) for L in lengths), int(world_size), int(rank), str(torch.device(device)))


@functools.lru_cache(maxsize=32)
def _zigzag_plan(lengths: tuple, W: int, r: int, device: str) -> ZigzagPlan:
    dev = torch.device(device)
    for b, L in enumerate(lengths):
        if L % (2 * W):
            raise ValueError(
                f"cu_seqlens: sequence {b} has length {L}, not a multiple of 2 x world size = {2 * W}"
            )
    B = len(lengths)
    seq_starts = [0]
    for L in lengths:
        seq_starts.append(seq_starts[-1] + L)
    total = seq_starts[-1]
    n_local = total // W
    # natural row -> (owner rank, local row): chunk j of sequence b lives on rank min(j, 2W-1-j),
    # in the first (j < W) or second half of that rank's rows of the sequence
    nat_from_gath = torch.empty(total, dtype=torch.int64)
    for b, L in enumerate(lengths):
        c = L // (2 * W)
        base_local = seq_starts[b] // W
        for j in range(2 * W):
            w, half = (j, 0) if j < W else (2 * W - 1 - j, 1)
            s = seq_starts[b] + j * c
            g0 = w * n_local + base_local + half * c
            nat_from_gath[s : s + c] = torch.arange(g0, g0 + c)
    gath_from_nat = torch.empty_like(nat_from_gath)
    gath_from_nat[nat_from_gath] = torch.arange(total)
    local_rows = nat_from_gath.new_empty(n_local)
    mine = (nat_from_gath >= r * n_local) & (nat_from_gath < (r + 1) * n_local)
    local_rows[nat_from_gath[mine] - r * n_local] = torch.nonzero(mine).flatten()
    slots = []
    for s, j in enumerate((r, 2 * W - 1 - r)):
        chunk = tuple(L // (2 * W) for L in lengths)
        starts = tuple(j * c for c in chunk)
        ends = tuple(a + c for a, c in zip(starts, chunk))
        if B == 1:
            rows = slice(s * chunk[0], (s + 1) * chunk[0])
        else:
            rows = torch.cat(
                [
                    torch.arange(seq_starts[b] // W + s * c, seq_starts[b] // W + (s + 1) * c)
                    for b, c in enumerate(chunk)
                ]
            ).to(dev)
        if B == 1:  # no filler: the keys past the chunk's end are simply not passed
            cu_q, cu_k, cache, k_end = [0, chunk[0]], [0, ends[0]], [starts[0]], ends[0]
        else:
            cu_q, cu_k, cache, qa, k_end = [0], [0], [], 0, total
            for b, (_, c, a, e) in enumerate(zip(lengths, chunk, starts, ends)):
                qa += c
                cu_q += [qa, qa]
                cu_k += [seq_starts[b] + e, seq_starts[b + 1]]
                cache += [a, 0]
        lk = [cu_k[i + 1] - cu_k[i] for i in range(len(cu_k) - 1)]
        slots.append(
            Slot(
                starts,
                ends,
                chunk,
                rows,
                torch.tensor(cu_q, dtype=torch.int32, device=dev),
                torch.tensor(cu_k, dtype=torch.int32, device=dev),
                torch.tensor(cache, dtype=torch.int32, device=dev),
                max(chunk),
                max(lk),
                k_end,
            )
        )
    return ZigzagPlan(
        lengths,
        W,
        r,
        dev,
        n_local,
        tuple(seq_starts),
        nat_from_gath.to(dev),
        gath_from_nat.to(dev),
        local_rows.to(dev),
        tuple(slots),
    )


def take_rows(x: torch.Tensor, rows) -> torch.Tensor:
    """Rows of x (a view for a slice, a contiguous copy for an index tensor)."""
    return x[rows] if isinstance(rows, slice) else x.index_select(0, rows)


def put_rows(out: torch.Tensor, rows, val: torch.Tensor) -> None:
    if isinstance(rows, slice):
        out[rows] = val
    else:
        out.index_copy_(0, rows, val)


def group_info(group):
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialised: call torch.distributed.init_process_group "
            "(e.g. under torchrun) before the context-parallel functions"
        )
    return dist.get_world_size(group), dist.get_rank(group)


def sequence_lengths(cu_seqlens: torch.Tensor) -> list[int]:
    if (
        not isinstance(cu_seqlens, torch.Tensor)
        or cu_seqlens.dim() != 1
        or cu_seqlens.numel() < 2
        or cu_seqlens.dtype not in (torch.int32, torch.int64)
    ):
        raise ValueError(
            "cu_seqlens must be an int32 (or int64) 1-D tensor [B+1] of the global (unsharded) "
            f"sequences, got {cu_seqlens!r:.80}"
        )
    c = cu_seqlens.detach().to("cpu", torch.int64)
    if int(c[0]) != 0 or bool((c[1:] < c[:-1]).any()):
        raise ValueError(f"cu_seqlens must start at 0 and never decrease, got {c.tolist()[:16]}")
    return (c[1:] - c[:-1]).tolist()


def zigzag_shard(x: torch.Tensor, cu_seqlens: torch.Tensor, group=None) -> torch.Tensor:
    r"""This rank's zigzag shard of a global packed tensor `x [total, ...]` (rows in sequence order).

    For each sequence, chunks `r` and `2W-1-r` of its `2W` equal chunks, in that order; the local
    `cu_seqlens` is `cu_seqlens // W`. Not differentiable (a plain index; shard inputs before the graph).

    Args:
        x (torch.Tensor):
            `[total, ...]`, the same on every rank.
        cu_seqlens (torch.Tensor):
            int32 `[B+1]` of the global sequences; every length a multiple of `2 * world size`.
        group (ProcessGroup, Optional):
            Default: `None` (the default group).
    """
    W, r = group_info(group)
    lengths = sequence_lengths(cu_seqlens)
    if x.shape[0] != sum(lengths):
        raise ValueError(f"x has {x.shape[0]} rows but cu_seqlens covers {sum(lengths)}")
    plan = zigzag_plan(lengths, W, r, x.device)
    return x.index_select(0, plan.local_rows)


class _GatherRows(torch.autograd.Function):
    """All-gather into natural order; backward: permute to rank order and reduce-scatter (sum)."""

    @staticmethod
    def forward(ctx, x, plan: ZigzagPlan, group):
        ctx.plan, ctx.group = plan, group
        return all_gather_rows(x, group).index_select(0, plan.nat_from_gath)

    @staticmethod
    def backward(ctx, g):
        return reduce_scatter_rows(g.index_select(0, ctx.plan.gath_from_nat), ctx.group), None, None


def zigzag_unshard(x_local: torch.Tensor, cu_seqlens: torch.Tensor, group=None) -> torch.Tensor:
    r"""The global packed tensor from every rank's zigzag shard (an all-gather and a permutation).

    Differentiable: the gradient of the full tensor is summed over ranks and each rank keeps its
    shard's rows (reduce-scatter), so a loss computed on every rank counts once per rank.

    Args:
        x_local (torch.Tensor):
            `[total / W, ...]`, this rank's shard (`zigzag_shard`'s layout).
        cu_seqlens (torch.Tensor):
            int32 `[B+1]` of the global sequences.
        group (ProcessGroup, Optional):
            Default: `None`.
    """
    W, r = group_info(group)
    lengths = sequence_lengths(cu_seqlens)
    if x_local.shape[0] * W != sum(lengths):
        raise ValueError(
            f"x_local has {x_local.shape[0]} rows; {W} ranks x that != {sum(lengths)} (cu_seqlens)"
        )
    return _GatherRows.apply(x_local, zigzag_plan(lengths, W, r, x_local.device), group)
