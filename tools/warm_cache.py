"""Compile every registered kernel instance this GPU can run into CuPy's disk cache, in parallel
worker processes, so that a run after it (the fuzz run, the sanitizers: docs/reliability.md) spends
its time testing rather than compiling.

    python tools/warm_cache.py                    # all instances, one worker per 2 CPU cores
    python tools/warm_cache.py --workers 8 --match stage2

Each worker takes every n-th instance and calls `_jit.get_kernel` (NVRTC, then CuPy's disk cache,
written atomically, so workers never clash). sm_90a instances are compiled only on capability 9.0.
Prints the count, the failures and the time; exit status 1 if any instance failed to compile.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _instances(match: str) -> list[tuple[str, str, bool]]:
    import torch

    import infllm_cupy  # noqa: F401  (every launcher registers its instances)
    from infllm_cupy import _jit

    hopper = torch.cuda.get_device_capability() == (9, 0)
    return [(ks.source, n, ks.sm90a) for ks in _jit.registered() for n in ks.names
            if (hopper or not ks.sm90a) and (match in ks.source or match in n)]


def _work(args) -> list[str]:
    todo, = args
    from infllm_cupy import _jit

    failed = []
    for source, name, sm90a in todo:
        try:
            _jit.get_kernel(source, name, sm90a=sm90a)
        except Exception as e:  # noqa: BLE001 - report every failure, do not stop at the first
            failed.append(f"{source} {name}: {type(e).__name__}: {str(e)[:300]}")
    return failed


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    p.add_argument("--match", default="", help="only instances whose source or name contains this")
    args = p.parse_args()
    t0 = time.perf_counter()
    todo = _instances(args.match)
    n = max(1, min(args.workers, len(todo)))
    with mp.get_context("spawn").Pool(n) as pool:
        failed = [f for part in pool.map(_work, [(todo[i::n],) for i in range(n)]) for f in part]
    print(f"warm_cache: {len(todo) - len(failed)}/{len(todo)} instances compiled with {n} workers in "
          f"{time.perf_counter() - t0:.0f} s")
    for f in failed:
        print("  FAILED " + f)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
