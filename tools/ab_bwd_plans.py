"""Backward plan variants, A/B in one process: bits and time against the default plan.

    python tools/ab_bwd_plans.py --cases pat:local_stride_sliding:32768:8 --variants base,+dkdv_group=1+block0_parts=1

Cases: `sel:S:T:B` (a token-level selection of benchmarks/bench_stage2.py: a, b or c, K = 96) or
`pat:NAME:T:B` (a pattern of benchmarks/bench_patterns.py: local_stride, local_stride_sliding,
per_head, sliding_tile), README heads (HQ 32, H 2, D 128, bf16). Per case the forward runs once; each
variant is the op's own backward plan ("base") with fields replaced, `+FIELD=VALUE...` as in
tools/_plans.py (ints, 0/1 for bools, strings). Prints, per variant, whether dq, dk, dv equal the base
plan's bit for bit and otherwise their largest difference relative to the base's largest magnitude.
Times: the whole backward (`stage2_bwd`), CUDA events, median after warm-up, variants interleaved per
round. Development tool.
"""  # noqa: E501 - verbatim commands, signatures and tables
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from infllm_cupy.selections import make_selection, uniform_cu_seqlens  # noqa: E402
from infllm_cupy.stage2 import ops  # noqa: E402
from infllm_cupy.stage2.ops import bwd_plan_for, fwd_plan_for  # noqa: E402

from _plans import with_fields  # noqa: E402


def pattern_layout(name: str, T: int, HQ: int, H: int):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_patterns as bp

    args = argparse.Namespace(sta_window=(3, 3, 3), d=128, cdfthreshd=0.9)
    p = bp.build_pattern(name, T, HQ, H, torch.device("cuda"), 0, args)
    return p.layout, p.per_q_head, p.causal


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="sel:a:32768:8,sel:c:32768:8,pat:local_stride:32768:8")
    ap.add_argument("--variants", default="base")
    ap.add_argument("--rep", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    HQ, H, D, dt = 32, 2, 128, torch.bfloat16
    print(torch.cuda.get_device_name(), flush=True)
    for case in a.cases.split(","):
        kind, what, T, B = case.split(":")
        T, B = int(T), int(B)
        g = torch.Generator(device="cuda").manual_seed(0)
        q, dout = (torch.randn(B * T, HQ, D, device="cuda", dtype=dt, generator=g) for _ in range(2))
        k, v = (torch.randn(B * T, H, D, device="cuda", dtype=dt, generator=g) for _ in range(2))
        cu = uniform_cu_seqlens(B, T, "cuda")
        scale = D ** -0.5
        if kind == "sel":
            topk = make_selection(what, B, T, H, 96, device="cuda", seed=0)
            fplan = fwd_plan_for(q, k, T, split_min=192)
            out, lse = ops.token_fwd(q, k, v, cu, cu, topk, T, T, True, scale, fplan)
            base = bwd_plan_for(q, k, T, T)

            def bwd(plan):
                return ops.token_bwd(dout, q, k, v, out, lse, cu, cu, topk, T, T, True, scale, plan)
        else:
            layout, per_q, causal = pattern_layout(what, T, HQ, H)
            lm = layout.mask.to("cuda")
            fplan = fwd_plan_for(q, k, T, split_min=None)
            if per_q:
                from infllm_cupy.stage2.qhead import qhead_bwd_plan
                fplan = dataclasses.replace(fplan, qhead="head")
                base = qhead_bwd_plan(torch.cuda.get_device_capability(), D, dt, T, T, k.shape[0])
            else:
                base = bwd_plan_for(q, k, T, T)
            out, lse = ops.layout_fwd(q, k, v, cu, cu, lm, layout.q_block, T, T, causal, scale, fplan)

            def bwd(plan):
                return ops.layout_bwd(dout, q, k, v, out, lse, cu, cu, lm, layout.q_block, T, T, causal,
                                      scale, plan)
        torch.cuda.synchronize()
        print(f"  {case}: inputs and forward ready", flush=True)
        plans = {}
        for name in a.variants.split(","):
            plans[name] = with_fields(base, "" if name == "base" else name)

        def run(name):
            return bwd(plans[name])

        ref = run("base")
        for name in plans:
            got = run(name)
            torch.cuda.synchronize()
            same = [torch.equal(x, y) for x, y in zip(ref, got)]
            rel = [float((x.float() - y.float()).abs().max() / y.float().abs().max().clamp_min(1e-30))
                   for x, y in zip(got, ref)]
            print(f"  {case} {name}: " + ", ".join(f"{n} {'same bits' if e else f'rel {r:.2e}'}"
                                                   for n, e, r in zip(("dq", "dk", "dv"), same, rel)),
                  flush=True)
            del got
        times = {n: [] for n in plans}
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        for _ in range(a.rounds):
            for name in plans:
                run(name)
                for _ in range(a.rep):
                    ev[0].record()
                    run(name)
                    ev[1].record()
                    torch.cuda.synchronize()
                    times[name].append(ev[0].elapsed_time(ev[1]))
        t0 = statistics.median(times["base"])
        print(f"{case} (base plan: dkdv={base.dkdv}, passes={base.dkdv_passes}, qhead={base.qhead}): "
              + ", ".join(f"{n} {statistics.median(t):.2f} ms ({t0 / statistics.median(t):.3f}x)"
                          for n, t in times.items()), flush=True)
        q = k = v = dout = out = lse = ref = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
