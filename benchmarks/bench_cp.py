r"""Context parallelism (infllm_cupy.distributed): W GPUs against 1 at the same total length, one layer.

    torchrun --nproc_per_node 2 benchmarks/bench_cp.py             # 128k and 256k, search, 2 H100s
    torchrun --nproc_per_node 2 benchmarks/bench_cp.py --lengths 262144 --no-search --json cp.json
    torchrun --nproc_per_node 8 benchmarks/bench_cp.py --lengths 1048576 --ranks 2,4,8 --skip-single \
        --no-search --check-blocks 8      # 1M tokens on 8 ranks, and on 2 and 4 at that length
    torchrun --nproc_per_node 2 benchmarks/bench_cp.py --device cpu --lengths 1024 --q-heads 4 --kv-heads 2 \
        --head-dim 16 --topk 4 --local-blocks 2 --no-search --rep 1     # CPU smoke run (gloo, references)

One sequence of L tokens (README head config by default: HQ 32, H 2, D 128, bf16, InfLLM-v2 selection
with topk 64 + local 32 = K 96 blocks, `dense_len = 0`), unit-normal inputs generated chunk by chunk
from one seed, so every rank makes only its own zigzag chunks and the single-GPU run the same tensors.

Rows, per length (and per group size of `--ranks`: the layer on the first n ranks, the others idle):
    single   `infllmv2_attention` on rank 0's GPU alone (the other ranks wait); skipped with
             `--skip-single` or when it does not fit (OOM is caught and reported)
    cp       `cp_infllmv2_attention` on all W ranks; ms is the slowest rank's median
    comm     the collectives alone at this length: all-gather of K and V (forward), reduce-scatter
             of dK and dV (backward), in the gradient-reduce dtype
Modes: fwd, fwdbwd (forward + backward of one layer). Columns: ms, peak GiB per GPU
(`max_memory_allocated` during the call, inputs included), bytes per rank per layer (received by
all-gather / sent by reduce-scatter: `(W-1)/W x L x H x D x bytes`, twice), speedup = single / cp.

`--search`: the longest L that trains (fwd+bwd of the layer) on 1 GPU and on W GPUs, by bisection
over multiples of 2W x 64 tokens within `--search-budget-s` (and `--search-max`). A W-GPU probe
first reserves, on every rank, the peak its measured rows predict (+5%, a fit of `b L + c L^2` per
rank: the stage-2 bitmask rows grow as L^2; at 256k and 512k the measured peak is the backward's dq
assembly, linear, which bounds every later phase since the backward splits long slots into query
pieces, docs/context_parallel.md §9, so time the rows there and not past 1M) plus the stage-1 kernel's global
scratch counted as if always taken (`stage1_scratch_gib`, an upper bound), and runs only if all ranks could:
the W-GPU result is therefore a lower bound where the guard, not a probe, stopped it. Every probe step ends
on every rank with the same collectives: a rank catches its own failure (OOM or other), frees its
memory, issues with zeros the layer's collectives it skipped, and then the ranks agree on one
verdict (all_reduce MIN); the bounds, the next length and the time budget are agreed values, so no
rank leaves the search alone. An OOM bisects below; any other error stops that search. Reported:
the longest length that ran and the shortest that did not (or was predicted not to), per GPU count.
Runs on CPU too (`--device cpu`: no guard), which is how tests/distributed/test_cp.py checks it.

`--check-blocks N`: outputs and dq of N sampled 64-token query blocks against the float64 stage-2
reference over the same blocks' stage-1 selection (each block a chunked-prefill sequence over its
prefix), FlashAttention's rule (2x / 3x the error of the same math in bf16), on the rank that owns them.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._harness import bench_gpu_time, env_line, env_stamp, format_table
from infllm_cupy import InfLLMv2Config, infllmv2_attention
from infllm_cupy._rules import SMEM_PER_BLOCK
from infllm_cupy.distributed import (
    all_gather_rows,
    cp_infllmv2_attention,
    reduce_scatter_rows,
    zigzag_plan,
)
from infllm_cupy.stage2.plan import SM90_STAGES, sm90_smem_bytes
from infllm_cupy.stage2.sparse_bwd import bwd_max_keys
from infllm_cupy.stage2.sparse_fwd import MASK_WARPS


def key_cap(d: int) -> int:
    """The longest sequence the searches probe: past it a kernel refuses the shape (an error, not a
    memory limit). Each bound is a mask row's uint32 words (one per 32 key blocks) in shared
    memory: the backward's SM80 dq (`bwd_max_keys`; docs/stage2_bwd.md, "Limits"), the sm_90a
    forward's ring at its shallowest depth, and token_block_masks (MASK_WARPS rows per CTA)."""
    fixed = sm90_smem_bytes(d, SM90_STAGES[-1], 0)
    ring_words = (SMEM_PER_BLOCK - fixed) // (sm90_smem_bytes(d, SM90_STAGES[-1], 1) - fixed)
    mask_words = SMEM_PER_BLOCK // (4 * MASK_WARPS)
    return min(bwd_max_keys(d), ring_words * 32 * 64, mask_words * 32 * 64)

GiB = 2**30


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    p.add_argument(
        "--lengths", default="131072,262144", help="comma-separated sequence lengths. Default: %(default)s"
    )
    # not --hq / --h / --d as the other scripts: torchrun's own parser takes "--h" and "--d" for
    # abbreviations of its options even after the script's name
    p.add_argument("--q-heads", dest="hq", type=int, default=32)
    p.add_argument("--kv-heads", dest="h", type=int, default=2)
    p.add_argument("--head-dim", dest="d", type=int, default=128)
    p.add_argument("--topk", type=int, default=64)
    p.add_argument("--local-blocks", type=int, default=32)
    p.add_argument("--modes", default="fwd,fwdbwd")
    p.add_argument(
        "--rep", type=int, default=5, help="timed runs per row (fixed: every rank runs the same count)"
    )
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument(
        "--skip-single", action="store_true", help="no single-GPU rows (lengths one GPU cannot hold)"
    )
    p.add_argument(
        "--ranks",
        default=None,
        help="comma-separated group sizes to run the layer on, each the first n ranks (the 1M-token run's "
        "scaling: 2,4,8 on 8 GPUs). Default: the whole world",
    )
    p.add_argument("--grad-reduce-dtype", default="input", choices=("input", "float32"))
    p.add_argument("--search", dest="search", action="store_true", default=True)
    p.add_argument("--no-search", dest="search", action="store_false")
    p.add_argument("--search-budget-s", type=float, default=100.0, help="seconds for both searches together")
    p.add_argument("--search-steps", type=int, default=5, help="bisection steps per GPU count")
    p.add_argument(
        "--search-max",
        type=int,
        default=None,
        help="longest length either search may probe (default: 16 x the longest --lengths for 1 GPU, "
        "then 2W x the 1-GPU failure)",
    )
    p.add_argument(
        "--memory-cap-gib",
        type=float,
        default=None,
        help="cap torch's allocator at this many GiB per GPU (set_per_process_memory_fraction), so that "
        "a larger card measures the longest lengths of a smaller one: 79.1 is the H100 80GB's capacity",
    )
    p.add_argument(
        "--inject-probe-failure-rank",
        type=int,
        default=None,
        metavar="R",
        help="test hook: rank R raises an injected OOM in the first search probe at "
        "--inject-probe-failure-at (the others must not hang: tests/distributed/test_cp.py)",
    )
    p.add_argument(
        "--inject-probe-failure-at",
        default="layer",
        choices=("layer", "guard", "single"),
        help="test hook: where rank R fails: inside the W-rank layer after its K/V all-gathers, in the "
        "W-rank guard's reservation, or in the 1-GPU probe (rank 0 only). Default: %(default)s",
    )
    p.add_argument(
        "--check-blocks", type=int, default=0, help="sampled 64-token query blocks to check per length"
    )
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    a.lengths = [int(x) for x in a.lengths.split(",") if x]
    a.modes = [m for m in a.modes.split(",") if m]
    a.ranks = [int(x) for x in a.ranks.split(",") if x] if a.ranks else None
    bad = [m for m in a.modes if m not in ("fwd", "fwdbwd")]
    if bad:
        p.error(f"--modes: unknown {bad}; choose from ['fwd', 'fwdbwd']")
    if a.search_max is not None and a.search_max <= 0:
        p.error(f"--search-max: expected a positive length, got {a.search_max}")
    return a


class Ctx:
    def __init__(self, a):
        self.a = a
        self.world_rank, self.world = dist.get_rank(), dist.get_world_size()
        self.sizes = a.ranks or [self.world]
        bad = [n for n in self.sizes if not 1 <= n <= self.world]
        if bad:
            raise SystemExit(f"--ranks: {bad} outside 1..{self.world}")
        # every rank takes part in creating every group (new_group is collective over the world)
        self.groups = {n: (None if n == self.world else dist.new_group(list(range(n)))) for n in self.sizes}
        self.use(self.world)
        self.dev = (
            torch.device("cuda", torch.cuda.current_device()) if a.device == "cuda" else torch.device("cpu")
        )
        self.dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
        self.cfg = InfLLMv2Config(topk=a.topk, local_blocks=a.local_blocks, dense_len=0)
        self.reduce_dtype = torch.float32 if a.grad_reduce_dtype == "float32" else None
        self.backend = "auto" if a.device == "cuda" else "reference"
        self.granule = 2 * max(self.sizes) * 64
        self.injected_once: set[str] = set()  # --inject-probe-failure-rank fires once per place

    def use(self, n: int) -> None:
        """Run the layer on the first n ranks: `group`, `W`, this rank's `rank` in it (or -1), `active`."""
        self.group, self.W = self.groups.get(n), n
        self.active = self.world_rank < n
        self.rank = self.world_rank if self.active else -1

    def log(self, *x):
        if self.world_rank == 0:
            print(*x, flush=True)

    def sync(self):
        if self.dev.type == "cuda":
            torch.cuda.synchronize()

    def peak_reset(self):
        if self.dev.type == "cuda":
            self.sync()
            torch.cuda.reset_peak_memory_stats()

    def peak(self) -> float:
        return torch.cuda.max_memory_allocated() / GiB if self.dev.type == "cuda" else float("nan")

    def gather(self, x: float) -> list[float]:
        out = [None] * self.world
        dist.all_gather_object(out, x)
        return out

    def agree(self, level: int) -> int:
        """The MIN over the world of every rank's `level`: one all_reduce, the same value everywhere."""
        t = torch.tensor([int(level)], dtype=torch.int32, device=self.dev)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def same(self, what: str, x) -> None:
        """Raise on every rank (never on some only) unless every rank holds the same `x`."""
        xs = self.gather(x)
        if any(y != xs[0] for y in xs):
            raise RuntimeError(f"bench_cp: the ranks disagree on {what}: {xs}")


def chunk_tensor(c: Ctx, kind: str, L: int, j: int, n: int, heads: int) -> torch.Tensor:
    """Chunk j (of n equal chunks) of the global tensor `kind`: the same values on any rank."""
    g = torch.Generator(device=c.dev).manual_seed(
        ((c.a.seed * 8 + _KIND_ID[kind]) * 4099 + j) * 1_000_003 + L
    )
    return torch.randn(L // n, heads, c.a.d, generator=g, device=c.dev, dtype=torch.float32).to(c.dtype)


_KINDS = {"q": "hq", "k": "h", "v": "h", "do": "hq"}
_KIND_ID = {"q": 1, "k": 2, "v": 3, "do": 4}  # not hash(): string hashes differ between processes


def full_tensor(c: Ctx, kind: str, L: int) -> torch.Tensor:
    n = 2 * c.W
    return torch.cat([chunk_tensor(c, kind, L, j, n, getattr(c.a, _KINDS[kind])) for j in range(n)])


def shard_tensor(c: Ctx, kind: str, L: int) -> torch.Tensor:
    n, r = 2 * c.W, c.rank
    return torch.cat([chunk_tensor(c, kind, L, j, n, getattr(c.a, _KINDS[kind])) for j in (r, n - 1 - r)])


def is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower()


def time_rows(c: Ctx, fns: dict, reps: int) -> dict:
    """{mode: median ms} of the modes' callables, each rank timing its own (fixed reps)."""
    return {
        m: statistics.median(bench_gpu_time(fn, warmup=c.a.warmup, rep=reps, device=c.dev.type))
        for m, fn in fns.items()
    }


def single_rows(c: Ctx, L: int) -> dict:
    """Rank 0 alone: ms per mode and peak GiB of one fwd+bwd, or an OOM note."""
    res: dict = {}
    if c.world_rank != 0:
        return res
    try:
        q, k, v = (full_tensor(c, x, L).requires_grad_() for x in ("q", "k", "v"))
        do = full_tensor(c, "do", L)
        cu = torch.tensor([0, L], dtype=torch.int32, device=c.dev)

        def fwd():
            with torch.no_grad():
                return infllmv2_attention(q, k, v, cu, config=c.cfg, backend=c.backend)

        def fwdbwd():
            out = infllmv2_attention(q, k, v, cu, config=c.cfg, backend=c.backend)
            torch.autograd.backward(out, do)
            q.grad = k.grad = v.grad = None

        fns = {"fwd": fwd, "fwdbwd": fwdbwd}
        res["ms"] = time_rows(c, {m: fns[m] for m in c.a.modes}, c.a.rep)
        c.peak_reset()
        fwdbwd()
        c.sync()
        res["peak_gib"] = c.peak()
    except Exception as e:  # OOM and friends are a result here
        if not is_oom(e):
            raise
        res = {"oom": True, "note": f"OOM: {str(e).splitlines()[0][:120]}"}
    finally:
        q = k = v = do = None
        if c.dev.type == "cuda":
            torch.cuda.empty_cache()
    return res


def cp_inputs(c: Ctx, L: int):
    q, k, v = (shard_tensor(c, x, L).requires_grad_() for x in ("q", "k", "v"))
    return q, k, v, shard_tensor(c, "do", L), torch.tensor([0, L], dtype=torch.int32, device=c.dev)


def cp_call(c: Ctx, q, k, v, cu, **kw):
    return cp_infllmv2_attention(
        q, k, v, cu, c.cfg, group=c.group, backend=c.backend, grad_reduce_dtype=c.reduce_dtype, **kw
    )


def cp_rows(c: Ctx, L: int) -> dict:
    q, k, v, do, cu = cp_inputs(c, L)

    def fwd():
        with torch.no_grad():
            return cp_call(c, q, k, v, cu, check_ranks=False)

    def fwdbwd():
        out = cp_call(c, q, k, v, cu, check_ranks=False)
        torch.autograd.backward(out, do)
        q.grad = k.grad = v.grad = None

    cp_call(c, q, k, v, cu)  # the ranks' agreement check, once, outside the timing
    fns = {"fwd": fwd, "fwdbwd": fwdbwd}
    ms = time_rows(c, {m: fns[m] for m in c.a.modes}, c.a.rep)
    c.peak_reset()
    fwdbwd()
    c.sync()
    peak = c.peak()
    # the collectives alone, as the layer issues them
    rd = c.reduce_dtype or k.dtype
    g = torch.zeros(k.shape[0] * c.W, *k.shape[1:], dtype=rd, device=c.dev)

    def gather_kv():
        all_gather_rows(k.detach(), c.group)
        all_gather_rows(v.detach(), c.group)

    def scatter_dkdv():
        reduce_scatter_rows(g, c.group)
        reduce_scatter_rows(g, c.group)

    comm = time_rows(c, {"fwd": gather_kv, "fwdbwd": scatter_dkdv}, c.a.rep)
    per_rank_rows = (c.W - 1) * k.shape[0]
    row_bytes = k.shape[1] * k.shape[2]
    bytes_ = {
        "fwd": 2 * per_rank_rows * row_bytes * k.element_size(),
        "bwd": 2 * per_rank_rows * row_bytes * torch.empty(0, dtype=rd).element_size(),
    }
    res = {"ms": ms, "peak_gib": peak, "comm_ms": comm, "bytes": bytes_}
    if c.a.check_blocks:
        res["check"] = check_blocks(c, L, q, k, v, do, cu)
    return res


def _selected_keys(k: torch.Tensor, v: torch.Tensor, sel: torch.Tensor):
    """The keys and values of the 64-key blocks a query block's selection `sel [H, 64, K]` names (the
    union over its tokens and heads, in order, plus the query block's own block, the last of `k`) and
    `sel` renumbered onto them. The own block is the last one a token can select, so it stays last and
    the bottom-right causal mask of the compacted problem is the original one: the float64 reference
    then costs the selection, not the prefix (a 1M-token prefix is ~17 GB per fp64 score matrix)."""
    own = torch.tensor([k.shape[0] // 64 - 1], dtype=sel.dtype, device=sel.device)
    used = torch.unique(torch.cat([sel[sel >= 0], own]))                 # sorted block indices
    new_of = torch.full((int(used.max()) + 1,), -1, dtype=sel.dtype, device=sel.device)
    new_of[used] = torch.arange(used.numel(), dtype=sel.dtype, device=sel.device)
    sel_c = torch.where(sel >= 0, new_of[sel.clamp(min=0).long()], sel)
    rows = (used.long()[:, None] * 64 + torch.arange(64, device=sel.device)).reshape(-1)
    return k[rows].contiguous(), v[rows].contiguous(), sel_c


def check_blocks(c: Ctx, L: int, q, k, v, do, cu) -> dict:
    """Out and dq of sampled 64-token query blocks this rank owns against the float64 stage-2 reference
    over the same blocks' selection (FlashAttention's rule). Every rank samples the same global blocks."""
    from infllm_cupy._rules import runs_kernels
    from infllm_cupy.prefill import select_blocks
    from infllm_cupy.testing import max_abs_err, reference_sparse_grads

    q_l, k_l, v_l = (t.detach().requires_grad_() for t in (q, k, v))
    out_l = cp_call(c, q_l, k_l, v_l, cu, check_ranks=False)
    (dq_l,) = torch.autograd.grad(out_l, (q_l,), do)
    kf, vf = full_tensor(c, "k", L), full_tensor(c, "v", L)
    plan = zigzag_plan([L], c.W, c.rank, c.dev)
    g = torch.Generator().manual_seed(c.a.seed + 17)
    blocks = sorted(torch.randperm(L // 64, generator=g)[: c.a.check_blocks].tolist())
    local_of = {int(t): 64 * i for i, t in enumerate(plan.local_rows[::64].tolist())}
    mine = [b for b in blocks if b * 64 in local_of]
    worst = {"out": 0.0, "dq": 0.0}
    ok = True
    kernels = runs_kernels(q, c.backend)
    for b in mine:
        a0, i0 = b * 64, local_of[b * 64]
        rows = slice(i0, i0 + 64)
        qb, dob = q_l.detach()[rows].contiguous(), do[rows].contiguous()
        e = a0 + 64
        cu_q = torch.tensor([0, 64], dtype=torch.int32, device=c.dev)
        cu_k = torch.tensor([0, e], dtype=torch.int32, device=c.dev)
        cache = torch.tensor([a0], dtype=torch.int32, device=c.dev)
        sel = select_blocks(qb, kf[:e], cu_q, cu_k, 64, cache, True, c.cfg, kernels=kernels)["topk_idx"]
        kc, vc, sel_c = _selected_keys(kf[:e], vf[:e], sel)
        ec = kc.shape[0]
        cu_kc = torch.tensor([0, ec], dtype=torch.int32, device=c.dev)
        ref_out, _, (ref_dq, _, _) = reference_sparse_grads(
            qb, kc, vc, dob, cu_q, cu_kc, sel_c, 64, ec, True, exact=True
        )
        low_out, _, (low_dq, _, _) = reference_sparse_grads(
            qb, kc, vc, dob, cu_q, cu_kc, sel_c, 64, ec, True, exact=False
        )
        for name, got, ref, low, mult in (
            ("out", out_l.detach()[rows], ref_out, low_out, 2),
            ("dq", dq_l[rows], ref_dq, low_dq, 3),
        ):
            err, base = max_abs_err(got, ref), max_abs_err(low, ref)
            worst[name] = max(worst[name], err / max(base, 1e-12))
            ok = ok and bool(err <= mult * base + 1e-6) and not bool(torch.isnan(got).any())
    return {"blocks": len(mine), "ok": ok, "err_over_bf16_out": worst["out"], "err_over_bf16_dq": worst["dq"]}


# ------------------------------------------------------------------------------------------ search


# Every probe step ends on every rank with the same collectives: each rank catches its own failure,
# frees what it holds, completes the layer's collectives it skipped (`_Ledger`), then the ranks agree
# on one verdict (all_reduce MIN of a level) before any other collective. Decisions (stop, next
# length) come only from agreed values, so no rank can leave the loop alone (the hang of
# docs/context_parallel.md §8: ranks that disagree leave one of them waiting in a collective).
OK, FAILED, ERROR = 2, 1, 0  # agreed by MIN: the worst rank's outcome wins


def failure_level(e: BaseException) -> int:
    """FAILED for an OOM (the length does not fit: bisect below), ERROR for anything else (stop)."""
    return FAILED if is_oom(e) else ERROR


def describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}"


def free_memory(c: Ctx) -> None:
    # the caught exception's traceback frames held tensors; collect cycles before returning blocks
    gc.collect()
    if c.dev.type == "cuda":
        torch.cuda.empty_cache()


def verdict(c: Ctx, level: int, why: str) -> tuple[int, str]:
    """Every rank's reason, once the level is agreed (so every rank takes this gather or none)."""
    if level == OK:
        return OK, "ran"
    whys = c.gather(why)
    return level, "; ".join(f"rank {r}: {w}" for r, w in enumerate(whys) if w) or "failed"


def injected(c: Ctx, where: str) -> bool:
    """The test hook `--inject-probe-failure-rank`: fail this rank once, at `where`."""
    a = c.a
    hit = a.inject_probe_failure_rank == c.world_rank and a.inject_probe_failure_at == where
    if hit and where not in c.injected_once:
        c.injected_once.add(where)
        return True
    return False


def injected_oom(where: str) -> torch.OutOfMemoryError:
    return torch.OutOfMemoryError(f"out of memory (injected by --inject-probe-failure-rank, at {where})")


def probe_single(c: Ctx, L: int) -> tuple[int, str]:
    """Rank 0 alone runs fwd+bwd at L (no collective inside); the others wait in the agreement."""
    level, why = OK, ""
    if c.world_rank == 0:
        try:
            q, k, v = (full_tensor(c, x, L).requires_grad_() for x in ("q", "k", "v"))
            cu = torch.tensor([0, L], dtype=torch.int32, device=c.dev)
            out = infllmv2_attention(q, k, v, cu, config=c.cfg, backend=c.backend)
            if injected(c, "single"):
                raise injected_oom("single")
            torch.autograd.backward(out, torch.ones_like(out))
            c.sync()
        except Exception as e:  # noqa: BLE001 - a failed probe is a result
            level, why = failure_level(e), describe(e)
        q = k = v = out = None
        free_memory(c)
    return verdict(c, c.agree(level), why)


class _Ledger:
    """The collectives one fwd+bwd of the layer issues on every rank (infllm_cupy/distributed/cp.py,
    `_CPAttention`: all-gather K, all-gather V; backward: reduce-scatter dK, dV), counted as this rank
    issues them, so that a rank that failed between two of them can issue the rest with zeros and
    its peers, which went on, are not left waiting. Counted by wrapping the two functions where the
    layer looks them up, during the probe only. A successful probe whose count or shapes differ from
    this list is reported as an ERROR: the ledger is out of date with the layer."""

    def __init__(self, c: Ctx, L: int):
        kv = ((L // c.W, c.a.h, c.a.d), c.dtype)
        dkv = ((L, c.a.h, c.a.d), c.reduce_dtype or c.dtype)
        self.c = c
        self.expected = [("ag", *kv), ("ag", *kv), ("rs", *dkv), ("rs", *dkv)]
        self.issued: list[tuple] = []

    @contextlib.contextmanager
    def counting(self):
        import infllm_cupy.distributed.cp as cp_mod

        saved = cp_mod.all_gather_rows, cp_mod.reduce_scatter_rows

        def wrap(kind, fn):
            def counted(x, *args, **kw):
                r = fn(x, *args, **kw)
                self.issued.append((kind, tuple(x.shape), x.dtype))
                if len(self.issued) == 2 and injected(self.c, "layer"):  # after both gathers
                    raise injected_oom("layer")
                return r

            return counted

        cp_mod.all_gather_rows, cp_mod.reduce_scatter_rows = wrap("ag", saved[0]), wrap("rs", saved[1])
        try:
            yield self
        finally:
            cp_mod.all_gather_rows, cp_mod.reduce_scatter_rows = saved

    def mismatch(self, *, finished: bool) -> str:
        """'' while the collectives issued are the expected ones (all of them where `finished`)."""
        n = len(self.expected) if finished else len(self.issued)
        if self.issued != self.expected[:n] or len(self.issued) != n:
            return f"the layer issued {self.issued}, the bench's ledger expects {self.expected}"
        return ""

    def complete(self) -> None:
        """Issue, with zeros, the collectives this rank skipped. Raises (and the process dies, which
        torchrun turns into every rank stopping) only where the collectives themselves fail."""
        c = self.c
        for kind, shape, dtype in self.expected[len(self.issued) :]:
            x = torch.zeros(shape, dtype=dtype, device=c.dev)
            (all_gather_rows if kind == "ag" else reduce_scatter_rows)(x, c.group)
            self.issued.append((kind, shape, dtype))
            x = None
        c.sync()


def predicted_peak(points: list[tuple[int, float]], L: int) -> float | None:
    """GiB at L from `b L + c L^2` fitted through the two longest measured (L, peak) points."""
    if len(points) < 2:
        return None
    (l1, p1), (l2, p2) = sorted(points)[-2:]
    # p = b l + c l^2: two equations
    det = l1 * l2 * l2 - l2 * l1 * l1
    if det == 0:
        return None
    cc = (p2 * l1 - p1 * l2) / det
    bb = (p1 - cc * l1 * l1) / l1
    return max(bb * L + cc * L * L, 0.0)


def stage1_scratch_gib(c: Ctx, L: int) -> float:
    """Stage 1's block-key scratch at L (one slot of L / (2 W) tokens, the whole sequence's blocks) where
    the plan the pipeline takes there keeps one: `[H, tokens, out_len]` keys, quadratic in L, so it
    can appear past the measured lengths and the fit would miss it. 0 where the plan holds the rows
    in shared memory or splits the key blocks into ranges (docs/stage1.md §9): its O(tokens x K)
    candidates live in the forward, below the backward's peak that the fit measured."""
    from infllm_cupy.stage1.plan import scratch_bytes
    from infllm_cupy.stage1.select import device_stage1_plan

    if c.dev.type != "cuda":
        return 0.0
    a = c.a
    G, out_len = a.hq // a.h, -(-L // 64)
    sdt = c.cfg.score_dtype
    plan = device_stage1_plan(c.dev, G, a.d, c.dtype, sdt, out_len, rows=a.h * (L // (2 * c.W)))
    if plan.block_keys_in_smem or plan.range_blocks:
        return 0.0
    K = c.cfg.topk + c.cfg.local_blocks
    return scratch_bytes(plan, a.h, L // (2 * c.W), out_len, sdt.itemsize, K, a.hq) / GiB


def probe_cp(c: Ctx, L: int, points) -> tuple[int, str]:
    # 1. the guard, local: reserve what the fit predicts (+5%); agreed before the layer's collectives
    pred = predicted_peak(points, L) if c.dev.type == "cuda" else None
    level, why = OK, ""
    if pred is not None:
        pred += stage1_scratch_gib(c, L)
    try:
        if injected(c, "guard"):
            raise injected_oom("guard")
        if pred is not None:
            t = torch.empty(int(pred * 1.05 * GiB), dtype=torch.uint8, device=c.dev)
            del t
    except Exception as e:  # noqa: BLE001
        guard = "guard" if pred is None else f"guard: predicted {pred:.1f} GiB + 5% did not fit"
        level, why = failure_level(e), f"{describe(e)} ({guard})"
    free_memory(c)
    level = c.agree(level)
    if level != OK:
        return verdict(c, level, why)
    # 2. the layer: every rank ends it having issued the same four collectives, whatever failed here
    ledger = _Ledger(c, L)
    try:
        with ledger.counting():
            q, k, v, do, cu = cp_inputs(c, L)
            out = cp_call(c, q, k, v, cu, check_ranks=False)
            torch.autograd.backward(out, do)
            c.sync()
        why = ledger.mismatch(finished=True)  # every rank ran the same layer: all or none see it
        level = ERROR if why else OK
    except Exception as e:  # noqa: BLE001 - a failed probe is a result
        level, why = failure_level(e), describe(e)
    q = k = v = do = out = cu = None
    free_memory(c)
    if level != OK and not why.startswith("the layer issued"):
        if ledger.mismatch(finished=False):  # cannot know what the peers wait for: die, not hang
            raise RuntimeError(f"bench_cp probe at L={L}: {ledger.mismatch(finished=False)}; after {why}")
        ledger.complete()
    return verdict(c, c.agree(level), why)


def search(c: Ctx, probe, lo: int, hi: int, t_end: float) -> dict:
    """Bisection over multiples of the granule: lo ran (or 0), hi failed (or is the cap). Every
    decision comes from agreed values: the bounds (checked equal on every rank), each probe's
    agreed verdict, and the time budget (agreed: the first rank out of time stops every rank)."""
    g = c.granule
    c.same("search bounds", (lo, hi))
    cap, tried, stopped = hi, [], ""
    for _ in range(c.a.search_steps):
        if hi - lo <= g:
            break
        mid = (lo + hi) // 2 // g * g
        if mid <= lo:
            break
        if c.agree(OK if time.perf_counter() < t_end else FAILED) != OK:
            stopped = "time budget"
            break
        level, why = probe(mid)
        tried.append((mid, level == OK, why))
        c.log(f"  probe L={mid}: {why}")
        if level == OK:
            lo = mid
        else:
            hi = mid
        if level == ERROR:  # not a memory limit: bisecting below it would not measure one
            stopped = f"error at L={mid}"
            break
    # shortest_failed: None where nothing failed up to the cap (which was not itself probed)
    failed = hi if any(L == hi for L, ok, _ in tried) else None
    return {"longest_ran": lo, "shortest_failed": failed, "cap": cap, "probes": tried, "stopped": stopped}


def main(argv=None):
    a = parse_args(argv)
    t0 = time.perf_counter()
    if a.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        if a.memory_cap_gib:
            total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, a.memory_cap_gib * GiB / total))
    dist.init_process_group("nccl" if a.device == "cuda" else "gloo", timeout=datetime.timedelta(seconds=180))
    c = Ctx(a)
    env = env_stamp() if c.world_rank == 0 else {}
    c.log(
        f"bench_cp: {c.world} ranks, layer on groups of {c.sizes}, HQ {a.hq}, H {a.h}, D {a.d}, {c.dtype}, "
        f"K = {a.topk + a.local_blocks}, lengths {a.lengths}"
    )
    for L in a.lengths:
        if L % c.granule:
            raise SystemExit(f"--lengths: {L} is not a multiple of 2 x {max(c.sizes)} x 64 = {c.granule}")
    rows, points = [], {n: [] for n in c.sizes}
    for L in a.lengths:
        single = {} if a.skip_single else single_rows(c, L)
        single = c.gather(single)[0]  # rank 0's: every rank holds the same rows (the search reads them)
        for n in c.sizes:
            c.use(n)
            cp = cp_rows(c, L) if c.active else None
            got = [x for x in c.gather(cp) if x is not None]  # the n active ranks' results
            ms = {m: max(x["ms"][m] for x in got) for m in a.modes}
            comm = {m: max(x["comm_ms"][m] for x in got) for m in ("fwd", "fwdbwd")}
            peaks = [x["peak_gib"] for x in got]
            points[n].append((L, max(peaks)))
            for m in a.modes:
                s_ms = single.get("ms", {}).get(m)
                b = got[0]["bytes"]
                rows.append(
                    {
                        "L": L,
                        "ranks": n,
                        "mode": m,
                        "single_ms": s_ms,
                        "cp_ms": ms[m],
                        "speedup": (s_ms / ms[m]) if s_ms else None,
                        "single_peak_gib": single.get("peak_gib"),
                        "cp_peak_gib_max": max(peaks),
                        "cp_peak_gib_by_rank": [round(p, 2) for p in peaks],
                        "comm_ms": comm["fwd"] if m == "fwd" else comm["fwd"] + comm["fwdbwd"],
                        "bytes_per_rank": b["fwd"] if m == "fwd" else b["fwd"] + b["bwd"],
                        "note": single.get("note", ""),
                    }
                )
            if a.check_blocks:
                checks = [x["check"] for x in got]
                total = sum(x["blocks"] for x in checks)
                all_ok = all(x["ok"] for x in checks)
                c.log(
                    f"check L={L}, {n} ranks: {total} sampled query blocks, out and dq within "
                    f"FlashAttention's rule: {'PASSED' if all_ok and total else 'FAILED'} (worst err / bf16 "
                    f"err: out {max(x['err_over_bf16_out'] for x in checks):.2f}, dq "
                    f"{max(x['err_over_bf16_dq'] for x in checks):.2f})"
                )
                rows[-1]["check"] = checks
            dist.barrier()
    c.use(c.world)
    cols = (
        "L",
        "ranks",
        "mode",
        "single_ms",
        "cp_ms",
        "speedup",
        "comm_ms",
        "bytes_per_rank",
        "single_peak_gib",
        "cp_peak_gib_max",
        "note",
    )
    c.log(f"\nW GPUs (cp, `ranks`) against 1 (single), one layer; ms: slowest rank's median of {a.rep}")
    c.log(format_table(rows, cols))
    result = {"rows": rows}

    def save():
        if c.world_rank == 0 and a.json:
            Path(a.json).parent.mkdir(parents=True, exist_ok=True)
            Path(a.json).write_text(
                json.dumps(
                    {"env": env, "argv": sys.argv[1:], "world_size": c.world, **result}, indent=1, default=str
                )
            )

    save()  # the rows survive a search that fails
    if a.search and c.world in c.sizes:
        t_end = time.perf_counter() + a.search_budget_s
        # a longer probe would stop the search with a kernel's shape error, not measure a memory limit
        cap = min(a.search_max or float("inf"), key_cap(a.d))
        longest_measured = max(a.lengths)
        single_ok = [r["L"] for r in rows if r["single_ms"] is not None]
        lo1 = max(single_ok, default=0)
        cap1 = 16 * longest_measured if single_ok and lo1 == longest_measured else longest_measured
        cap1 = max(min(cap1, cap) // c.granule * c.granule, lo1)
        c.log(f"\nsearch: longest fwd+bwd on 1 GPU (bisection in ({lo1}, {cap1}])")
        s1 = search(
            c,
            lambda L: probe_single(c, L),
            lo1,
            cap1,
            time.perf_counter() + a.search_budget_s / 2,
        )
        capw = max(2 * c.W * (s1["shortest_failed"] or s1["cap"]), 2 * longest_measured)
        capw = max(min(capw, cap) // c.granule * c.granule, longest_measured)
        c.log(f"search: longest fwd+bwd on {c.W} GPUs (bisection in ({longest_measured}, {capw}])")
        if len(points[c.world]) < 2 and a.device == "cuda":
            # no fit, no guard: a probe may OOM on one rank, which the probe survives (_Ledger)
            c.log("  unguarded: the guard needs measured peaks at two --lengths")
        sw = search(c, lambda L: probe_cp(c, L, points[c.world]), longest_measured, capw, t_end)
        result["search"] = {"single": s1, "cp": sw}
        def upper(r):
            stop = f", stopped: {r['stopped']}" if r["stopped"] else ""
            if r["shortest_failed"] is None:
                return f"nothing failed up to the cap {r['cap']}{stop}"
            return f"failed or predicted not to fit at {r['shortest_failed']}{stop}"

        c.log(
            f"longest that ran: 1 GPU {s1['longest_ran']} ({upper(s1)}), {c.W} GPUs {sw['longest_ran']} "
            f"({upper(sw)}); ratio {sw['longest_ran'] / max(s1['longest_ran'], 1):.2f}x"
        )
    save()
    if c.world_rank == 0:
        print(env_line(env, t0), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
