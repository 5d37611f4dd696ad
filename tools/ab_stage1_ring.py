r"""A/B of the sm_90a stage-1 kernel's key-tile ring depth (`Stage1Plan.key_stages`), in one process.

    python tools/ab_stage1_ring.py                                   # the default cases and depths
    python tools/ab_stage1_ring.py --cases 128kx2 --key-stages 2,3 --rounds 3

Cases `TxB` (B sequences of T tokens, the README head config: HQ = 32, H = 2, D = 128, bf16, K = 96,
random q and compressed keys of the real counts). Per case the variants are the plan of today
(`stage1_plan`, 2 stages: `ns=2`), the same plan with each `--key-stages` depth forced (`ns=N`; same
range width, so a ring that no longer fits two CTAs per SM runs at one), and, where that happens,
depth N with the key ranges narrowed to the widest that keeps two CTAs per SM (`ns=N,ranges=W`: more
range passes, each with a merge; docs/stage1.md, 9. Long context: key ranges). `stage1_select`
alone is timed (CUDA events, median), the variants alternating in each round (reversed every other
round) so that clock drift shows between rounds, not variants; the best round counts. Every variant's
`topk_idx` must equal the `ns=2` one bit for bit (checked in the first round; a mismatch is
reported in the table and the exit status is 1). The column `plan picks` names the variant
`stage1_plan` takes with `KEY_STAGES_MAX` (infllm_cupy/stage1/plan.py) = N (`max=N`) and, with
`,ranges`, with `RING_RANGES_MIN` = 64 as well (ranges of any width for a deeper ring). Capability
9.0 only.
docs/stage1.md, 3. The sm_90a kernel, its key-tile ring.
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

from benchmarks._harness import bench_gpu_time, env_line, env_stamp, format_table  # noqa: E402
from benchmarks.bench_stage2 import parse_config  # noqa: E402

HQ, H = 32, 2


def inputs(T: int, B: int, D: int, device, seed: int = 0):
    """Random q and compressed keys with the counts `compress_k` (32/16 and 128/64) gives."""
    g = torch.Generator(device=device).manual_seed(seed)
    n1, n2 = max(0, (T - 32) // 16 + 1), max(0, (T - 128) // 64 + 1)
    q = torch.randn(B * T, HQ, D, generator=g, device=device, dtype=torch.bfloat16)
    ck1 = (2 * torch.randn(B * n1, H, D, generator=g, device=device)).to(torch.bfloat16)
    ck2 = (2 * torch.randn(B * n2, H, D, generator=g, device=device)).to(torch.bfloat16)
    cu = [(torch.arange(B + 1, device=device) * n).to(torch.int32) for n in (T, n1, n2)]
    return q, ck1, ck2, *cu


def variants(base, G: int, D: int, out_len: int, stages, limits):
    """[(label, plan, CTAs per SM)] of one case (see the module doc)."""
    from infllm_cupy.stage1.plan import SM90A, _range_widths

    smem_max, smem_per_sm = limits
    two_per_sm = min(smem_per_sm // 2 - 1024, smem_max)
    K = 96

    def per_sm(p):
        b = p.smem_bytes(G, D, 2, out_len, 2)
        return 2 if b <= two_per_sm else 1 if b <= smem_max else 0

    out = []
    for ns in stages:
        p = dataclasses.replace(base, key_stages=ns)
        if per_sm(p):
            out.append((f"ns={ns}", p, per_sm(p)))
        if ns > 2 and per_sm(p) < per_sm(base):
            w, _ = _range_widths(SM90A, base.warps, G, D, 2, 2, smem_max, smem_per_sm, ns)
            if K <= w < -(-out_len // 64) * 64:
                pr = dataclasses.replace(p, range_blocks=w, block_keys_in_smem=True)
                out.append((f"ns={ns},ranges={w}", pr, per_sm(pr)))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="32kx8,128kx1,128kx2,512kx1", help="comma-separated TxB. Default: %(default)s")
    p.add_argument("--key-stages", default="2,3,4", help="ring depths to time. Default: %(default)s")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--rep", type=int, default=0, help="timed runs per variant and round (0: by duration)")
    p.add_argument("--d", type=int, default=128)
    a = p.parse_args(argv)
    stages = sorted({int(x) for x in a.key_stages.split(",") if x})
    from infllm_cupy.stage1 import select as sel
    from infllm_cupy.stage1.plan import KEY_STAGES, stage1_plan

    if any(s not in KEY_STAGES for s in stages):
        p.error(f"--key-stages must be among {KEY_STAGES}")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("ab_stage1_ring: needs a capability 9.0 GPU (the sm_90a kernel); nothing to do")
        return 0
    dev = torch.device("cuda")
    limits = sel._smem_limits(dev)
    cap = torch.cuda.get_device_capability(dev)
    env, t_start = env_stamp(), time.perf_counter()
    recs, bad = [], 0
    for case in a.cases.split(","):
        T, B = parse_config(case)
        G, out_len = HQ // H, -(-T // 64)
        q, ck1, ck2, cu, cu1, cu2 = inputs(T, B, a.d, dev)
        budget = sel.scratch_budget_of(dev)
        base = stage1_plan(cap, G, a.d, torch.bfloat16, torch.bfloat16, out_len, *limits, "sm90a",
                           rows=H * B * T, scratch_budget=budget, max_key_stages=2)
        # what the plan takes with KEY_STAGES_MAX = n (and RING_RANGES_MIN = 64: ranges of any width)
        chosen = {f"max={n}{',ranges' if rr else ''}": stage1_plan(
            cap, G, a.d, torch.bfloat16, torch.bfloat16, out_len, *limits, "sm90a", rows=H * B * T,
            scratch_budget=budget, max_key_stages=n, ring_ranges_min=rr) for n in KEY_STAGES for rr in (0, 64)}
        vs = variants(base, G, a.d, out_len, stages, limits)
        print(f"\n== {case}: out_len {out_len}; today's plan {base}", flush=True)
        times: dict[str, list[float]] = {lb: [] for lb, _, _ in vs}
        ident: dict[str, bool] = {}
        ref = None
        for rnd in range(a.rounds):
            for lb, plan, _ in (vs if rnd % 2 == 0 else vs[::-1]):
                def run(plan=plan):
                    return sel.launch_select(q, ck1, ck2, cu, cu1, cu2, T, topk=64, local_blocks=32, plan=plan)
                if rnd == 0:
                    out = run()
                    torch.cuda.synchronize()
                    if ref is None:
                        ref = out
                    ident[lb] = bool(torch.equal(out, ref))
                    del out
                kw = {"rep": a.rep} if a.rep else {}
                ms = statistics.median(bench_gpu_time(run, warmup=1, device=dev, **kw))
                times[lb].append(ms)
                print(f"  round {rnd} {lb:18s} {ms:9.2f} ms", flush=True)
        t2 = min(times[vs[0][0]])
        for lb, plan, per_sm in vs:
            best = min(times[lb])
            picks = [lb2 for lb2, c in chosen.items() if c == plan]
            recs.append({"case": case, "variant": lb, "range_blocks": plan.range_blocks, "CTAs/SM": per_sm,
                         "ms": best, "x vs ns=2": t2 / best, "rounds": " ".join(f"{x:.2f}" for x in times[lb]),
                         "identical": ident[lb], "plan picks": ",".join(picks) or "-"})
            bad += not ident[lb]
        del q, ck1, ck2, ref
        torch.cuda.empty_cache()
    print()
    print(format_table(recs, ["case", "variant", "range_blocks", "CTAs/SM", "ms", "x vs ns=2", "rounds", "identical",
                              "plan picks"], max_width=60))
    print(env_line(env, t_start))
    if bad:
        print(f"{bad} variant(s) NOT bit-identical to ns=2")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
