r"""The CPU paths against the CPU's own floor: fp32 `torch.matmul` rate, then each stage's time, its
effective rate and its selected-work floor, from 4k to 64k tokens.

    python benchmarks/bench_cpu.py                          # stage 2 at 4k, 16k, 64k, the demo's shape
    python benchmarks/bench_cpu.py --lengths 4k,8k,16k,32k,64k --selections demo,b --json cpu.json
    python benchmarks/bench_cpu.py --lengths 4k,8k --oracle-max 8k   # the oracle beside it (T^2)

Rows (impl):
    matmul_fp32  `torch.matmul` of two fp32 squares (1024 and 2048): GFLOP/s; the larger rate is the floor
    stage2       `sparse_attn_varlen` on CPU tensors (backend "auto": stage 2's CPU implementation,
                 `infllm_cupy/stage2/cpu.py`) under `no_grad`, bf16 inputs, one sequence of T tokens
    oracle       `naive_sparse_attn_varlen` (the reference: every causal key, masked) on the same inputs,
                 for T <= --oracle-max, one run
Per row: ms (median), the selected work in GFLOP (4 D x the keys each (token, query head) attends:
`selections.attended_keys`), its effective GFLOP/s, the floor (that work at the matmul rate), time /
floor, and the peak resident memory the call added (Linux: `/proc/self/status` VmHWM, reset before
the call; "-" elsewhere). Selections (`--selections`, K = `--K` slots per token):
    demo  the demo's shape: block 0 and the 5 local blocks forced, shared by a query block, the other
          K - 6 drawn per token (`selections.infllm_like(..., local_blocks=5, redraw=1.0)`)
    a, b, c  `selections.make_selection`'s block-shared, per-token and InfLLM-like selections
Goal: stage 2 within 2x of its floor (demo, 32k). Runs on CPU only; threads are torch's default.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._harness import (  # noqa: E402
    add_head_args,
    env_stamp,
    format_table,
    parse_config,
    print_env,
    write_json,
)

IMPLS = ("stage2", "oracle")
SELECTIONS = ("demo", "a", "b", "c")
GEMM_SIZES = (1024, 2048)


@dataclasses.dataclass
class CpuRow:
    """One timed row; `ms` is None when skipped."""
    impl: str
    config: str
    selection: str = "-"
    K: int | None = None
    ms: float | None = None
    reps: int = 0
    gflop: float | None = None
    gflops: float | None = None
    floor_ms: float | None = None
    over_floor: float | None = None
    peak_mb: float | None = None
    note: str = ""


def _status_kb(key: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def peak_mb_of(fn) -> tuple[object, float | None]:
    """`fn()` and the resident memory it added at its peak, in MB (None where the kernel gives no
    resettable high-water mark)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")       # resets VmHWM to the current RSS
        base = _status_kb("VmRSS")
    except OSError:
        base = None
    out = fn()
    hwm = _status_kb("VmHWM")
    return out, None if base is None or hwm is None else (hwm - base) / 1024


def cpu_times(fn, *, warmup: int, rep: int | None, target_ms: float, max_rep: int) -> list[float]:
    """Milliseconds of each timed run of `fn()` after `warmup` untimed ones: `rep` runs, or (None) runs
    until about `target_ms` of them, at most `max_rep` (a long call runs once)."""
    for _ in range(warmup):
        fn()
    times = []
    while len(times) < (rep or max_rep) and (rep or sum(times) < target_ms):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def gemm_rate(n: int, rep: int = 5) -> float:
    """GFLOP/s of `torch.matmul` on two fp32 `n x n` squares: the median of `rep` runs after one."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    times = cpu_times(lambda: torch.matmul(a, b), warmup=1, rep=rep, target_ms=0, max_rep=rep)
    return 2 * n ** 3 / (statistics.median(times) * 1e-3) / 1e9


def make_inputs(T: int, HQ: int, H: int, D: int, K: int, selection: str, seed: int):
    from infllm_cupy.selections import infllm_like, make_selection

    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(T, n, D, generator=g).to(torch.bfloat16) for n in (HQ, H, H))
    if selection == "demo":
        idx = infllm_like(1, T, H, K, local_blocks=5, redraw=1.0, seed=seed)
    else:
        idx = make_selection(selection, 1, T, H, K, seed=seed)
    return q, k, v, torch.tensor([0, T], dtype=torch.int32), idx


def check_against_oracle(HQ: int, H: int, D: int, K: int) -> str:
    """Stage 2 on CPU against the oracle at 1000 tokens, FlashAttention's rule."""
    from infllm_cupy.stage2.attention import sparse_attn_varlen
    from infllm_cupy.stage2.naive import naive_sparse_attn_varlen
    from infllm_cupy.testing import assert_close_to_ref

    q, k, v, cu, idx = make_inputs(1000, HQ, H, D, K, "demo", 1)
    with torch.no_grad():
        out = sparse_attn_varlen(q, k, v, cu, cu, idx, 1000, 1000)
        ref = naive_sparse_attn_varlen(q.double(), k.double(), v.double(), cu, cu, idx, 1000, 1000)
        lowp = naive_sparse_attn_varlen(q, k, v, cu, cu, idx, 1000, 1000, upcast=False)
    try:
        assert_close_to_ref("stage2", out, ref, lowp)
    except AssertionError as e:
        return f"check FAILED: {e}"
    return "check PASSED: stage 2 on CPU within FlashAttention's rule of the oracle (1000 tokens, demo)"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="4k,16k,64k", help="tokens of the one sequence (k = 1024). "
                   "Default: 4k,16k,64k")
    p.add_argument("--selections", default="demo", help=f"comma-separated, of {SELECTIONS}. Default: demo")
    p.add_argument("--K", type=int, default=12, help="selected blocks per token (the demo's 12)")
    p.add_argument("--impls", default="stage2,oracle", help=f"comma-separated, of {IMPLS}")
    p.add_argument("--oracle-max", default="4k", help="time the oracle up to this length. Default: 4k")
    add_head_args(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rep", type=int, default=None, help="timed runs; default: about --target-ms of work")
    p.add_argument("--target-ms", type=float, default=3000.0)
    p.add_argument("--max-rep", type=int, default=5)
    p.add_argument("--skip-check", action="store_true")
    p.add_argument("--json", default=None, help="write the rows (with versions and commit) to this file")
    a = p.parse_args(argv)
    if a.hq % a.h:
        p.error("--hq must be a multiple of --h")
    a.lengths = [parse_config(f"{x}x1")[0] for x in a.lengths.split(",") if x]
    a.oracle_max = parse_config(f"{a.oracle_max}x1")[0]
    for name, allowed in (("selections", SELECTIONS), ("impls", IMPLS)):
        vals = [x for x in getattr(a, name).split(",") if x]
        bad = [x for x in vals if x not in allowed]
        if bad:
            p.error(f"--{name}: unknown {bad}; choose from {list(allowed)}")
        setattr(a, name, vals)
    return a


def main(argv=None) -> list[CpuRow]:
    from infllm_cupy.selections import attended_keys
    from infllm_cupy.stage2.attention import sparse_attn_varlen
    from infllm_cupy.stage2.naive import naive_sparse_attn_varlen

    a = parse_args(argv)
    t_start = time.perf_counter()
    env = env_stamp()
    env["threads"] = str(torch.get_num_threads())
    print_env(env)
    if not a.skip_check:
        print(check_against_oracle(a.hq, a.h, a.d, a.K), flush=True)
    rows = []
    rates = {}
    for n in GEMM_SIZES:
        rates[n] = gemm_rate(n)
        rows.append(CpuRow("matmul_fp32", f"{n}^3", gflops=rates[n], gflop=2 * n ** 3 / 1e9))
    floor = max(rates.values())
    print(f"fp32 matmul: {', '.join(f'{n}^3 {r:.0f}' for n, r in rates.items())} GFLOP/s; floor rate "
          f"{floor:.0f} GFLOP/s ({env['threads']} threads)", flush=True)
    fns = {"stage2": sparse_attn_varlen, "oracle": naive_sparse_attn_varlen}
    for T in a.lengths:
        for sel in a.selections:
            q, k, v, cu, idx = make_inputs(T, a.hq, a.h, a.d, a.K, sel, a.seed)
            gflop = 4 * a.d * (a.hq // a.h) * attended_keys(idx, cu).sum().item() / 1e9
            for impl in a.impls:
                row = CpuRow(impl, f"T{T}-HQ{a.hq}-H{a.h}-D{a.d}", sel, a.K, gflop=gflop,
                             floor_ms=gflop / floor * 1e3)
                rows.append(row)
                if impl == "oracle" and T > a.oracle_max:
                    row.note = f"skipped: T > --oracle-max {a.oracle_max}"
                    continue
                fn = fns[impl]
                peaks = []

                def call(fn=fn, peaks=peaks):
                    with torch.no_grad():
                        if peaks:
                            return fn(q, k, v, cu, cu, idx, T, T)
                        _, mb = peak_mb_of(lambda: fn(q, k, v, cu, cu, idx, T, T))
                        peaks.append(mb)

                reps = dict(warmup=0, rep=1, max_rep=1) if impl == "oracle" else dict(
                    warmup=a.warmup, rep=a.rep, max_rep=a.max_rep)
                times = cpu_times(call, target_ms=a.target_ms, **reps)
                row.ms, row.reps, row.peak_mb = statistics.median(times), len(times), peaks[0]
                row.gflops = gflop / (row.ms * 1e-3)
                row.over_floor = row.ms / row.floor_ms
                print(f"{impl:7s} T={T:6d} {sel:4s}: {row.ms:10.1f} ms  {row.gflops:6.1f} GFLOP/s  floor "
                      f"{row.floor_ms:8.1f} ms  x{row.over_floor:.2f}  peak +{row.peak_mb or 0:.0f} MB",
                      flush=True)
    rates_after = {n: gemm_rate(n) for n in GEMM_SIZES}
    print(f"fp32 matmul after: {', '.join(f'{n}^3 {r:.0f}' for n, r in rates_after.items())} GFLOP/s "
          f"(a rate far from the first means a machine shared while timing)")
    records = [dataclasses.asdict(r) for r in rows]
    print("\n" + format_table(records, ("impl", "config", "selection", "K", "ms", "reps", "gflop", "gflops",
                                        "floor_ms", "over_floor", "peak_mb", "note")))
    goal = [r for r in rows if r.impl == "stage2" and r.selection == "demo" and r.config.startswith("T32768-")
            and r.ms is not None]
    if goal:
        print(f"\ngoal: stage 2 within 2x of its floor at 32k (demo): x{goal[0].over_floor:.2f}")
    print(f"\nwall {time.perf_counter() - t_start:.0f} s")
    if a.json:
        write_json(rows, a.json, env, {"matmul_gflops_after": rates_after})
    return rows


if __name__ == "__main__":
    main()
