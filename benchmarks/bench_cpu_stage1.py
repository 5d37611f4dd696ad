r"""Stage 1 and key compression on CPU: the CPU implementations' time and effective rate against the
CPU's fp32 GEMM rate, from 4k to 64k tokens (docs/cpu.md, "Stage 1 and compression").

    python benchmarks/bench_cpu_stage1.py                          # 4k, 8k, 16k: about 20 s on 2 cores
    python benchmarks/bench_cpu_stage1.py --tokens 4k,8k,16k,32k,64k --json cpu_stage1.json   # about 1.5 min
    python benchmarks/bench_cpu_stage1.py --tokens 2k,4k --oracle  # also the naive references

One causal sequence of T tokens, HQ 32, H 2, D 128, bf16 (the demo's shapes), K = topk 8 + local-blocks 4
= 12 (the demo's CPU budget), random q and keys. Rows per T:
    compress   both compressions (32/16 and 128/64), `compress_k` on CPU (`cpu_compress_k`)
    stage1     `stage1_select` on CPU (`cpu_stage1_select`): scores, pooling, top-k
    oracle_*   with --oracle: `naive_compress_k` and `naive_stage1_select` on the same inputs
`extra_mib`: the most the process's resident set grew during a call above its level before it (sampled
every 2 ms): what the call allocates beyond its inputs. Stage 1's useful FLOP count: 2 D per (query
head, query token, visible compressed key), fine and coarse keys, causal (what a GEMM over the visible
keys costs; the implementation computes a few percent more: each tile to its last row's keys, widths
rounded up to 32). It grows as T^2 / 16 (fine keys) + T^2 / 64 (coarse keys), so time should grow about
4x per doubling of T.

The floor: `torch.matmul` of 2048 x 2048 fp32 squares (`_harness.fp32_gemm_rate`), measured before
each T and after the last; `floor` is the best of them. Each time is the best of `--rep` runs (the machine
may be shared: the best run is the one least disturbed), with the median beside it.
"""
from __future__ import annotations

import argparse
import resource
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._harness import env_stamp, format_table, fp32_gemm_rate, print_env  # noqa: E402


def parse_tokens(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        n = int(part[:-1]) * 1024 if part.endswith("k") else int(part)
        if n < 1:
            raise argparse.ArgumentTypeError(f"--tokens: every length must be >= 1, got {part!r}")
        out.append(n)
    return out


def useful_flop(T: int, HQ: int, D: int, n1: int, n2: int) -> float:
    """2 D per (query head, query token, visible fine or coarse key), causal (spec 4.3's rule)."""
    from infllm_cupy.stage1.naive import vis_limit
    r = torch.arange(T)
    keys = int(vis_limit(r, 16, n1, T).sum()) + int(vis_limit(r, 64, n2, T).sum())
    return 2.0 * D * HQ * keys


def _rss_mib() -> float:
    """The process's resident set now (Linux: /proc/self/statm), MiB."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except OSError:
        return float("nan")
    return pages * resource.getpagesize() / 2 ** 20


def timed(fn, rep: int) -> tuple[float, float, float]:
    """(best, median) seconds of `rep` calls, and the most the resident set grew above its level before
    each call (sampled every 2 ms on a thread: what the call allocates beyond its inputs), MiB."""
    times, grown = [], 0.0
    for _ in range(rep):
        base, peak, done = _rss_mib(), [0.0], threading.Event()

        def sample(base=base, peak=peak, done=done):
            while not done.wait(0.002):
                peak[0] = max(peak[0], _rss_mib() - base)

        watcher = threading.Thread(target=sample, daemon=True)
        watcher.start()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        done.set()
        watcher.join()
        grown = max(grown, peak[0], _rss_mib() - base)
    return min(times), statistics.median(times), grown


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=parse_tokens, default=parse_tokens("4k,8k,16k"),
                   help="comma-separated sequence lengths (k = 1024). Default: 4k,8k,16k")
    p.add_argument("--hq", type=int, default=32)
    p.add_argument("--h", type=int, default=2)
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--local-blocks", type=int, default=4)
    p.add_argument("--rep", type=int, default=2, help="timed runs per row (the best is reported). Default: 2")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads. Default: torch's")
    p.add_argument("--oracle", action="store_true", help="also time the naive references (slow: T^2 memory)")
    p.add_argument("--json", default=None, help="write the rows (with the env stamp) to this file")
    a = p.parse_args(argv)
    if a.threads is not None:
        torch.set_num_threads(a.threads)

    from infllm_cupy.compress import compress_k, naive_compress_k
    from infllm_cupy.stage1 import naive_stage1_select, stage1_select

    env = env_stamp()
    env["threads"] = str(torch.get_num_threads())
    print_env(env)
    t_start = time.perf_counter()
    floors = []
    rows = []
    prev = None
    for T in a.tokens:
        floors.append(fp32_gemm_rate())
        g = torch.Generator().manual_seed(0)
        q = torch.empty(T, a.hq, a.d, dtype=torch.bfloat16)
        for t0 in range(0, T, 4096):          # in chunks: no fp32 copy of q raises the process's peak
            q[t0:t0 + 4096] = torch.randn(min(4096, T - t0), a.hq, a.d, generator=g)
        k = (4 * torch.randn(T, a.h, a.d, generator=g)).to(torch.bfloat16)
        cu = torch.tensor([0, T], dtype=torch.int32)
        impls = [("", compress_k, stage1_select)]
        if a.oracle:
            impls.append(("oracle_", naive_compress_k, naive_stage1_select))
        for prefix, compress, select in impls:
            (ck1, cu1), (ck2, cu2) = compress(k, cu, 32, 16), compress(k, cu, 128, 64)
            best, med, mib = timed(lambda: (compress(k, cu, 32, 16), compress(k, cu, 128, 64)), a.rep)
            rows.append({"impl": prefix + "compress", "T": T, "s": best, "median_s": med, "extra_mib": mib})
            best, med, mib = timed(lambda: select(q, ck1, ck2, cu, cu1, cu2, T, topk=a.topk,
                                             local_blocks=a.local_blocks), a.rep)
            flop = useful_flop(T, a.hq, a.d, ck1.shape[0], ck2.shape[0])
            row = {"impl": prefix + "stage1", "T": T, "s": best, "median_s": med, "gflop": flop / 1e9,
                   "gflops": flop / best / 1e9, "extra_mib": mib}
            if not prefix and prev is not None:
                row["growth"] = best / prev[1]
                row["growth_T2"] = (T / prev[0]) ** 2
            if not prefix:
                prev = (T, best)
            rows.append(row)
        print(f"  T = {T}: done ({time.perf_counter() - t_start:.0f} s)", flush=True)
    floors.append(fp32_gemm_rate())
    floor = max(floors)
    for row in rows:
        if "gflops" in row:
            row["of_floor"] = row["gflops"] / floor
    print(f"\nfp32 GEMM floor (torch.matmul, 2048^2, {env['threads']} threads): {floor:.1f} GFLOP/s "
          f"(measured {', '.join(f'{f:.0f}' for f in floors)})")
    print(format_table(rows, ("impl", "T", "s", "median_s", "gflop", "gflops", "of_floor", "growth",
                              "growth_T2", "extra_mib")))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak RSS of the process: {peak:.0f} MiB")
    if a.json:
        import json
        payload = {"env": env, "floor_gflops": floor, "floors": floors, "peak_rss_mib": peak, "rows": rows}
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(payload, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
