"""A/B of kernels_cu/ trees over `stage1_select`, outputs compared bit for bit (development tool).

    git archive <commit> kernels_cu | tar -x -C /tmp/old
    python tools/ab_stage1_trees.py old=/tmp/old/kernels_cu new=kernels_cu --cases 32kx8,128kx1,128kx2,512kx1

Per case (T x B, README heads: HQ 32, H 2, D 128, bf16, K = 96 as MiniCPM4's budget, random inputs) and
round, each tree in rotated order: forget the compiled kernels, point `_jit` at the tree, run
`stage1_select` once (its `topk_idx`, and with `--scores` its scores and block scores, are compared with
the first tree's: exit status 1 if any differ), then time it (CUDA events, median of `--rep` after a
warm-up). Prints each tree's median over rounds and its ratio to the first tree's. Every tree is
launched by this checkout's launcher, so it must take the fields that `stage1/select.py` declares
(`Stage1SelectParams`, `Stage1SelectSm90Params`), as arguments or as one struct: the layout checks fail
the compile of a tree whose kernels take other parameters.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from infllm_cupy import _env, _jit
from infllm_cupy.compress import compress_k
from infllm_cupy.selections import uniform_cu_seqlens
from infllm_cupy.stage1.select import stage1_select


def parse_case(text: str) -> tuple[int, int]:
    t, b = text.lower().split("x")
    n = int(float(t[:-1]) * (1024 if t.endswith("k") else 1024 * 1024)) if t[-1] in "km" else int(t)
    return n, int(b)


def readme_inputs(T: int, B: int, seed: int = 1):
    """Random bf16 q and keys at the README heads (HQ 32, H 2, D 128), B sequences of T tokens, and
    their compressed keys: `(q, ck1, ck2, cu_seqlens, cu_seqlens_c1, cu_seqlens_c2)` on the GPU."""
    HQ, H, D = 32, 2, 128
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B * T, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(B * T, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    cu = uniform_cu_seqlens(B, T, "cuda")
    ck1, cu1 = compress_k(k, cu, 32, 16, backend="kernels")
    ck2, cu2 = compress_k(k, cu, 128, 64, backend="kernels")
    return q, ck1, ck2, cu, cu1, cu2


def median_ms(call, rep: int) -> float:
    """Median CUDA-event time of `rep` calls after one warm-up call."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(rep + 1):
        start.record()
        call()
        end.record()
        end.synchronize()
        ts.append(start.elapsed_time(end))
    return statistics.median(ts[1:])


def summary(case: str, times: dict[str, list[float]], width: int) -> None:
    """Each variant's median over rounds and its ratio to the first variant's (`times` in order)."""
    first = next(iter(times))
    base = statistics.median(times[first])
    for label, ts in times.items():
        m = statistics.median(ts)
        print(f"{case:<8} {label:<{width}} {m:9.3f} ms  {base / m:6.3f}x vs {first}", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("trees", nargs="+", help="LABEL=DIR of kernels_cu/ trees; the first is the reference")
    p.add_argument("--cases", default="32kx8,128kx1,128kx2")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--rep", type=int, default=5)
    p.add_argument("--scores", action="store_true",
                   help="also compare scores and block scores (return_scores)")
    a = p.parse_args(argv)
    trees = [t.split("=", 1) for t in a.trees]
    bad = 0
    for case in a.cases.split(","):
        T, B = parse_case(case)
        q, ck1, ck2, cu, cu1, cu2 = readme_inputs(T, B)

        def call():
            return stage1_select(q, ck1, ck2, cu, cu1, cu2, T, topk=64, local_blocks=32,
                                 return_scores=a.scores)

        times: dict[str, list[float]] = {label: [] for label, _ in trees}
        ref = None
        for r in range(a.rounds):
            order = trees[r % len(trees):] + trees[:r % len(trees)]
            for label, tree in order:
                with _env.override(kernels_dir=str(Path(tree).resolve())):
                    _jit.clear_cache()
                    out = call()
                    out = out if isinstance(out, tuple) else (out,)
                    if ref is None and label == trees[0][0]:
                        ref = [x.clone() for x in out]
                    elif ref is not None and not all(torch.equal(x, y) for x, y in zip(out, ref)):
                        print(f"  {case} {label}: outputs DIFFER from {trees[0][0]}", flush=True)
                        bad += 1
                    del out
                    times[label].append(median_ms(call, a.rep))
                    print(f"  round {r} {case} {label:<8} {times[label][-1]:9.3f} ms", flush=True)
        summary(case, times, 8)
    print("outputs identical" if bad == 0 else f"{bad} output mismatches")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
