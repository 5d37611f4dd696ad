r"""Stage 1 at long context: one launch (block keys in shared memory or the global scratch) against
the key-range passes (docs/stage1.md, 9. Long context: key ranges), time, extra GPU memory and
whether the selections are identical. GPU only.

    python benchmarks/bench_stage1_ranges.py                       # the default cases below
    python benchmarks/bench_stage1_ranges.py --cases 512k:16 --ranges 0,2816,1024

Cases `T:G` (one sequence of T tokens, HQ = 2 G query heads over H = 2 KV heads, D = 128, bf16,
K = 96, random q and compressed keys with the real counts). Each case runs the plan's own launch
(`plan`) and the plan with each `--ranges` value forced (`ranges=N`; 0 forces one launch, the
global scratch where the rows do not fit shared memory). A variant whose estimated memory does not
fit is skipped with the reason.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import _harness as harness  # noqa: E402


def parse_case(s: str) -> tuple[int, int]:
    t, g = s.split(":")
    t = t.lower()
    T = round(float(t[:-1]) * 2**20) if t.endswith("m") else harness.parse_config(f"{t}x1")[0]
    return T, int(g)


def inputs(T: int, G: int, D: int, device, seed: int = 0):
    from infllm_cupy.testing import cu_seqlens_from_lengths

    H, HQ = 2, 2 * G
    g = torch.Generator(device=device).manual_seed(seed)
    n1, n2 = max(0, (T - 32) // 16 + 1), max(0, (T - 128) // 64 + 1)
    q = torch.randn(T, HQ, D, generator=g, device=device, dtype=torch.bfloat16)
    ck1 = (2 * torch.randn(n1, H, D, generator=g, device=device)).to(torch.bfloat16)
    ck2 = (2 * torch.randn(n2, H, D, generator=g, device=device)).to(torch.bfloat16)
    cu = [cu_seqlens_from_lengths([x], device) for x in (T, n1, n2)]
    return q, ck1, ck2, *cu


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="512k:16,1m:16,256k:1",
                   help="comma-separated T:G. Default: %(default)s")
    p.add_argument("--ranges", default="0,2816,1024",
                   help="forced range widths in blocks (multiples of 64; 0 = one launch). Default: "
                        "%(default)s")
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--topk", type=int, default=64)
    p.add_argument("--local-blocks", type=int, default=32)
    p.add_argument("--rep", type=int, default=3)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_stage1_ranges: needs a CUDA GPU; nothing to do")
        return []
    ranges = [int(x) for x in a.ranges.split(",") if x]
    if any(r < 0 or r % 64 for r in ranges):
        p.error("--ranges must be multiples of 64 (0 = one launch)")
    from infllm_cupy.stage1 import select as sel
    from infllm_cupy.stage1.plan import scratch_bytes

    dev = torch.device("cuda")
    env, t_start = harness.env_stamp(), time.perf_counter()
    recs = []
    for case in a.cases.split(","):
        T, G = parse_case(case)
        K = a.topk + a.local_blocks
        out_len = -(-T // 64)
        try:
            q, ck1, ck2, cu, cu1, cu2 = inputs(T, G, a.d, dev)
        except torch.OutOfMemoryError as e:
            recs.append({"case": case, "variant": "-", "note": f"inputs: {harness.short_error(e)}"})
            continue
        base = sel.device_stage1_plan(dev, G, a.d, torch.bfloat16, torch.bfloat16, out_len, rows=2 * T)
        print(f"\n== {case}: T = {T}, G = {G}, out_len = {out_len}; the plan: {base}", flush=True)
        ref = None
        for name, plan in [("plan", base)] + [(f"ranges={r}", dataclasses.replace(
                base, range_blocks=r, block_keys_in_smem=base.block_keys_in_smem and r == 0))
                                              for r in ranges]:
            rec = {"case": case, "variant": name, "range_blocks": plan.range_blocks}
            need = scratch_bytes(plan, 2, T, out_len, 2, K=K, HQ=2 * G)
            free = torch.cuda.mem_get_info()[0]
            if need > 0.9 * free:
                rec["note"] = (f"skipped: needs {need / 2**30:.1f} GiB beyond the inputs, "
                               f"{free / 2**30:.1f} GiB free")
                recs.append(rec)
                print(f"  {name}: {rec['note']}", flush=True)
                continue
            try:
                def run():
                    return sel.launch_select(q, ck1, ck2, cu, cu1, cu2, T, topk=a.topk,
                                             local_blocks=a.local_blocks, plan=plan)
                torch.cuda.synchronize()
                mem0 = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                out = run()
                torch.cuda.synchronize()
                rec["extra_GiB"] = (torch.cuda.max_memory_allocated() - mem0) / 2**30
                if ref is None:
                    ref = out
                else:
                    rec["identical"] = bool(torch.equal(out, ref))
                del out
                st = harness.summarize(harness.bench_gpu_time(run, warmup=0, rep=a.rep, device=dev))
                rec["ms"] = st["ms"]
            except Exception as e:  # noqa: BLE001 - one variant failing must not end the table
                rec["note"] = harness.short_error(e)
            recs.append(rec)
            print(f"  {name}: {rec}", flush=True)
            torch.cuda.empty_cache()
        q = ck1 = ck2 = ref = None
        torch.cuda.empty_cache()
    print()
    print(harness.format_table(recs, ["case", "variant", "range_blocks", "ms", "extra_GiB", "identical",
                                      "note"], max_width=100))
    print(harness.env_line(env, t_start))
    return recs


if __name__ == "__main__":
    main()
