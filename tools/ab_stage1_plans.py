"""A/B of stage-1 plan variants over `launch_select`, outputs compared bit for bit (development tool).

    python tools/ab_stage1_plans.py --cases 32kx8,128kx2,512kx1 \
        --variants base,+range_blocks=1024,+block_keys_in_smem=0

A variant is `base` (the plan `stage1_select` takes for the case) or `base` with plan fields replaced
(`+FIELD=VALUE...`, as tools/_plans.py reads them; a leading `+` means `base+`). Per case (T x B,
README heads: HQ 32, H 2, D 128, bf16, K = 96, random inputs) and round, each variant in rotated
order: run once (its `topk_idx` is compared with the first variant's: exit status 1 if any differ),
then time it (CUDA events, median of `--rep` after a warm-up). Prints each variant's median over
rounds and its ratio to the first variant's.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from infllm_cupy import _jit
from infllm_cupy._kernel_arg import SM90A
from infllm_cupy._rules import KV_BLOCK
from infllm_cupy.stage1.select import SOURCE, SOURCE_SM90, device_stage1_plan, kernel_name, launch_select

from _plans import with_fields
from ab_stage1_trees import median_ms, parse_case, readme_inputs, summary


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", default="32kx8,128kx2")
    p.add_argument("--variants", default="base,+range_blocks=1024")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--rep", type=int, default=5)
    a = p.parse_args(argv)
    variants = [v if v.startswith("base") else "base" + v for v in a.variants.split(",")]
    bad = 0
    for case in a.cases.split(","):
        T, B = parse_case(case)
        q, ck1, ck2, cu, cu1, cu2 = readme_inputs(T, B)
        HQ, H, D = q.shape[1], ck1.shape[1], q.shape[2]
        base = device_stage1_plan(q.device, HQ // H, D, q.dtype, torch.bfloat16, -(-T // KV_BLOCK),
                                  rows=H * q.shape[0])
        plans = {v: with_fields(base, v[len("base"):]) for v in variants}
        for v, plan in plans.items():
            sm90a = plan.kernel == SM90A
            name = kernel_name(q.dtype, torch.bfloat16, D, sm90a, plan.range_blocks > 0)
            attrs = _jit.get_kernel(SOURCE_SM90 if sm90a else SOURCE, name, sm90a=sm90a).attributes
            print(f"{case} {v}: {plan}; {name}: {attrs['num_regs']} registers, "
                  f"{attrs['local_size_bytes']} B local", flush=True)

        def call(plan):
            return launch_select(q, ck1, ck2, cu, cu1, cu2, T, topk=64, local_blocks=32,
                                 score_dtype=torch.bfloat16, plan=plan)

        times: dict[str, list[float]] = {v: [] for v in variants}
        ref = None
        for r in range(a.rounds):
            order = variants[r % len(variants):] + variants[:r % len(variants)]
            for v in order:
                out = call(plans[v])
                if ref is None and v == variants[0]:
                    ref = out.clone()
                elif ref is not None and not torch.equal(out, ref):
                    print(f"  {case} {v}: topk_idx DIFFERS from {variants[0]}", flush=True)
                    bad += 1
                del out
                times[v].append(median_ms(lambda: call(plans[v]), a.rep))
                print(f"  round {r} {case} {v:<44} {times[v][-1]:9.3f} ms", flush=True)
        summary(case, times, 44)
    print("outputs identical" if bad == 0 else f"{bad} output mismatches")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
