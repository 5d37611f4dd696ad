"""A/B of two checkouts over `benchmarks/bench_pipeline.py`, rounds alternating on one GPU (development
tool): the check that a change above the kernels (the Python of the prefill pipeline, its launchers) left
the pipeline's speed where it was.

    mkdir -p /tmp/old && git archive <commit> | tar -x -C /tmp/old
    python tools/ab_pipeline.py --old /tmp/old --configs 32kx8 --inputs structured --rounds 3

Each round runs the benchmark once per checkout, in rotated order, each in its own process (its own
package, imported from that checkout; the compiled kernels are shared through CuPy's cache where the
sources are equal), with `--impls selection,stage2,pipeline --skip-check`. Prints, per (config, inputs,
row), the median over rounds of each checkout's ms and new / old (> 1: the new checkout slower).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROWS = "selection,stage2,pipeline"


def run_once(tree: Path, configs: str, inputs: str, out: Path) -> dict:
    """One benchmark run of checkout `tree`: {(config, impl): ms}."""
    path = os.pathsep.join(p for p in (str(tree), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path}
    cmd = [sys.executable, str(tree / "benchmarks" / "bench_pipeline.py"), "--configs", configs,
           "--inputs", inputs, "--impls", ROWS, "--skip-check", "--json", str(out)]
    subprocess.run(cmd, cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL)
    rows = json.loads(out.read_text())["rows"]
    return {(r["config"], r["impl"]): r["ms"] for r in rows if r.get("ms") is not None}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--old", required=True, help="the other checkout's root (benchmarks/ and infllm_cupy/)")
    p.add_argument("--configs", default="32kx8")
    p.add_argument("--inputs", default="structured")
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    trees = {"old": Path(a.old).resolve(), "new": ROOT}
    times: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            order = list(trees) if r % 2 == 0 else list(trees)[::-1]
            for name in order:
                res = run_once(trees[name], a.configs, a.inputs, Path(tmp) / f"{name}{r}.json")
                for key, ms in res.items():
                    times.setdefault(key, {}).setdefault(name, []).append(ms)
                print(f"round {r + 1}/{a.rounds} {name}: " + ", ".join(f"{k[1]}@{k[0]} {v:.2f} ms"
                                                                       for k, v in res.items()), flush=True)
    print(f"{'config':24} {'row':10} {'old ms':>9} {'new ms':>9} {'new/old':>8}")
    for (config, impl), by in sorted(times.items()):
        if len(by) == 2:
            old, new = statistics.median(by["old"]), statistics.median(by["new"])
            print(f"{config:24} {impl:10} {old:9.2f} {new:9.2f} {new / old:8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
