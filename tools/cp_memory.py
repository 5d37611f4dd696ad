r"""Per-rank memory of one context-parallel forward+backward at the peak (docs/context_parallel.md §9).

    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True torchrun --nproc_per_node 2 tools/cp_memory.py \
        --length 2949120 [--single-length 1568768] [--json $OUT/cp_memory.json]

Runs `cp_infllmv2_attention` (benchmarks/bench_cp.py's inputs and head config: HQ 32, H 2, D 128, bf16,
K = 96) once at `--length` tokens on every rank, and with `--single-length` `infllmv2_attention` on
rank 0's GPU alone first. While it runs it samples `torch.cuda.memory_allocated()` at every phase
boundary of the layer (the wrappers of `infllm_cupy.distributed.cp`'s helpers) and at every kernel
launch of the package (the stage-2 backward's peak is at its dk/dv launches, where the masks, the
transposed indices and the fp32 sums are all alive). Each time the sample reaches a new maximum
(by more than 2%) it keeps a snapshot of the live blocks (`torch.cuda.memory._snapshot()` under
`_record_memory_history`, Python stacks), and reports, per rank:

- the timeline: allocated GiB at each phase entry / exit and the largest sample inside it;
- at the highest sample: the live bytes grouped by the innermost package line that allocated them
  (GiB and bytes per token of the whole sequence), which is the table of §9;
- `max_memory_allocated`, reserved, and the device memory outside PyTorch (NCCL, context).

An OOM is caught and reported with the breakdown at the highest sample before it.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GiB = 2**30


class Recorder:
    def __init__(self, label: str, tokens: int):
        self.label, self.tokens = label, tokens
        self.samples: list[tuple[str, int]] = []  # (where, allocated bytes)
        self.best = 0
        self.best_where = ""
        self.snap_at = 0  # allocated bytes when best_blocks was taken
        self.best_blocks: dict[str, int] = {}
        self.phase_max: dict[str, int] = {}
        self.stack: list[str] = []

    def sample(self, where: str) -> None:
        a = torch.cuda.memory_allocated()
        self.samples.append((where, a))
        for p in self.stack:
            self.phase_max[p] = max(self.phase_max.get(p, 0), a)
        if a > self.best:
            self.best, self.best_where = a, where
        # a snapshot per 2% of growth past 256 MiB: each one walks every block
        if a > max(self.snap_at * 1.02, 2**28):
            self.snap_at, self.best_blocks = a, live_blocks()

    def report(self) -> dict:
        return {
            "label": self.label,
            "tokens": self.tokens,
            "max_memory_allocated_gib": torch.cuda.max_memory_allocated() / GiB,
            "reserved_gib": torch.cuda.memory_reserved() / GiB,
            "outside_torch_gib": outside_torch() / GiB,
            "highest_sample_gib": self.best / GiB,
            "highest_sample_at": self.best_where,
            "snapshot_gib": self.snap_at / GiB,
            "live_at_highest": sorted(self.best_blocks.items(), key=lambda kv: -kv[1]),
            "timeline": compress_timeline(self.samples, self.phase_max),
        }


def outside_torch() -> int:
    free, total = torch.cuda.mem_get_info()
    return total - free - torch.cuda.memory_reserved()


def _where(frames) -> str:
    """The innermost frame in the package (not the launch / allocation helpers), else in this repo."""
    skip = ("_launch.py",)
    for f in frames:
        fn = f.get("filename", "")
        if "/infllm_cupy/" in fn and not fn.endswith(skip):
            return f"{fn.split('/infllm_cupy/')[-1]}:{f.get('line')} {f.get('name')}"
    for f in frames:
        fn = f.get("filename", "")
        if "/benchmarks/" in fn or "/tools/" in fn:
            return f"{fn.rsplit('/', 2)[-2]}/{fn.rsplit('/', 1)[-1]}:{f.get('line')} {f.get('name')}"
    return "(elsewhere)"


def live_blocks() -> dict[str, int]:
    out: dict[str, int] = {}
    snap = torch.cuda.memory._snapshot()
    for seg in snap.get("segments", []):
        for b in seg.get("blocks", []):
            if b.get("state") != "active_allocated":
                continue
            key = _where(b.get("frames", []))
            out[key] = out.get(key, 0) + int(b.get("requested_size", b.get("size", 0)))
    return out


def compress_timeline(samples, phase_max) -> list[tuple[str, float]]:
    """Phase boundaries only (kernel launches are folded into their phase's maximum)."""
    rows = []
    for where, a in samples:
        if where.startswith("launch "):
            continue
        rows.append((where, round(a / GiB, 2)))
    rows += [(f"max inside {p}", round(m / GiB, 2)) for p, m in phase_max.items()]
    return rows


def instrument(rec_ref: list) -> None:
    """Wrap the layer's helpers and every package module's `launch` so that they sample memory."""
    import importlib

    import infllm_cupy._launch as launch_mod
    from infllm_cupy.distributed import cp

    # the launching modules, imported now so that their `launch` is replaced below
    for m in ("compress.mean_pool", "stage1.select", "stage2.sparse_fwd", "stage2.sparse_bwd"):
        importlib.import_module(f"infllm_cupy.{m}")

    def wrap(mod, name):
        fn = getattr(mod, name)

        def wrapped(*a, **kw):
            rec = rec_ref[0]
            if rec is None:
                return fn(*a, **kw)
            tag = f"{name}#{sum(1 for w, _ in rec.samples if w == f'enter {name}')}"
            rec.sample(f"enter {name}")
            rec.stack.append(tag)
            try:
                return fn(*a, **kw)
            finally:
                rec.sample(f"exit {name}")
                rec.stack.pop()

        setattr(mod, name, wrapped)

    names = ("_select", "_s2_fwd", "_s2_bwd", "_combine_key_grads", "all_gather_rows", "reduce_scatter_rows")
    for name in names:
        wrap(cp, name)
    orig = launch_mod.launch

    def launch(kernel, *, name, **kw):
        rec = rec_ref[0]
        if rec is not None:
            rec.sample(f"launch {name}")
        return orig(kernel, name=name, **kw)

    for mname, mod in list(sys.modules.items()):
        if mname.startswith("infllm_cupy") and getattr(mod, "launch", None) is orig:
            mod.launch = launch


def run_one(rec_ref, label, tokens, fn) -> dict:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    rec = Recorder(label, tokens)
    rec_ref[0] = rec
    err = None
    try:
        fn()
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - an OOM is a result here
        err = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"
        traceback.print_exc()
    rec_ref[0] = None
    rep = rec.report()
    rep["error"] = err
    return rep


def print_report(rank: int, rep: dict) -> None:
    L = rep["tokens"]
    err = f"  ERROR {rep['error']}" if rep["error"] else ""
    print(f"\n=== rank {rank}: {rep['label']} at {L} tokens{err}")
    mx = rep["max_memory_allocated_gib"]
    print(
        f"max_memory_allocated {mx:.2f} GiB ({mx * GiB / L:.0f} B per token), reserved "
        f"{rep['reserved_gib']:.2f} GiB, outside torch {rep['outside_torch_gib']:.2f} GiB"
    )
    print(
        f"highest sample {rep['highest_sample_gib']:.2f} GiB at {rep['highest_sample_at']}; live at the "
        f"last snapshot ({rep['snapshot_gib']:.2f} GiB, within 2% of it):"
    )
    for where, b in rep["live_at_highest"]:
        if b >= 2**20:
            print(f"  {b / GiB:8.2f} GiB  {b / L:8.0f} B/token  {where}")
    print("timeline (GiB allocated):")
    for where, g in rep["timeline"]:
        print(f"  {g:8.2f}  {where}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--length", type=int, required=True, help="tokens of the one sequence (multiple of 2W x 64)"
    )
    p.add_argument("--single-length", type=int, default=0, help="also one GPU (rank 0) at this length first")
    p.add_argument("--json", default=None)
    p.add_argument(
        "--max-entries", type=int, default=1000, help="trace entries kept (blocks keep their stacks)"
    )
    a = p.parse_args(argv)
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=300))
    from benchmarks.bench_cp import Ctx, _Ledger, cp_call, cp_inputs, full_tensor
    from benchmarks.bench_cp import parse_args as bench_args
    from infllm_cupy import infllmv2_attention

    c = Ctx(bench_args(["--lengths", str(a.length), "--no-search"]))
    torch.cuda.memory._record_memory_history(max_entries=a.max_entries, stacks="python")
    rec_ref: list = [None]
    instrument(rec_ref)
    reports = []
    if a.single_length and c.world_rank == 0:

        def single():
            q, k, v = (full_tensor(c, x, a.single_length).requires_grad_() for x in ("q", "k", "v"))
            do = full_tensor(c, "do", a.single_length)
            cu = torch.tensor([0, a.single_length], dtype=torch.int32, device=c.dev)
            out = infllmv2_attention(q, k, v, cu, config=c.cfg, backend=c.backend)
            torch.autograd.backward(out, do)

        reports.append(run_one(rec_ref, "one GPU (infllmv2_attention)", a.single_length, single))
    dist.barrier()
    # a rank that fails (OOM) issues the layer's remaining collectives with zeros, as the benchmark's
    # search probes do, so that its peer is not left waiting in one
    ledger = _Ledger(c, a.length)

    def cp_layer():
        with ledger.counting():
            q, k, v, do, cu = cp_inputs(c, a.length)
            out = cp_call(c, q, k, v, cu, check_ranks=False)
            torch.autograd.backward(out, do)

    reports.append(run_one(rec_ref, f"context parallel, {c.W} ranks", a.length, cp_layer))
    if reports[-1]["error"]:
        gc.collect()
        torch.cuda.empty_cache()
        if not ledger.mismatch(finished=False):
            ledger.complete()
    torch.cuda.memory._record_memory_history(enabled=None)
    allr = [None] * c.world
    dist.all_gather_object(allr, reports)
    if c.world_rank == 0:
        for r, reps in enumerate(allr):
            for rep in reps:
                print_report(r, rep)
        if a.json:
            Path(a.json).parent.mkdir(parents=True, exist_ok=True)
            Path(a.json).write_text(json.dumps({"argv": sys.argv[1:], "ranks": allr}, indent=1, default=str))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
