"""A/B of kernel trees over stage 1 for decode (`select_decode`: coarse, fine and top-k launches), in
one process with interleaved CUDA-graph replays (development tool; docs/decode.md, 14. Stage 1 for
decode: the split kernels).

    mkdir -p /tmp/old && git archive HEAD~1 kernels_cu | tar -x -C /tmp/old
    python tools/ab_select_decode.py old=/tmp/old/kernels_cu new=kernels_cu

Each tree (`label=DIR`, the first is the baseline) is made current with `_env.override(kernels_dir=DIR)`
(the launcher is this checkout's, so the trees must share its launch contract). Per config
(`--configs`, BATCHxCONTEXT, README head config: HQ 32, H 2, D 128, bf16, K = 64 + 32, full caches)
and plan variant (`default`: `plan_select_decode`'s plan; `short`: one-tile fine and coarse ranges, the
most range boundaries), every tree's `topk_idx` is compared with the baseline's (`same bits` or FAIL), then
each tree's call is captured `--inner` times in one graph, and each repetition replays every tree's graph
once in rotated order (clock drift falls on all alike); the median per call and the ratio to the
baseline are printed. Exit status 1 when a selection differs.
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
sys.path.insert(0, str(ROOT))
from benchmarks._harness import capture_graph, parse_decode_config, random_cache  # noqa: E402
from infllm_cupy import _env  # noqa: E402

VARIANTS = ("default", "short")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trees", nargs="+", help="label=DIR kernels_cu/ trees; the first is the baseline")
    p.add_argument("--configs", default="1x128k,8x128k,8x32k", help="comma-separated BATCHxCONTEXT")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"plan variants among {VARIANTS}")
    p.add_argument("--inner", type=int, default=20, help="calls per graph replay")
    p.add_argument("--reps", type=int, default=30, help="rotations of the replays")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("ab_select_decode: needs a CUDA GPU; nothing to do")
        return 0
    trees = []
    for t in a.trees:
        label, sep, d = t.partition("=")
        if not sep or not (Path(d) / "decode" / "select_decode.cu").is_file():
            p.error(f"tree {t!r}: expected label=DIR with DIR/decode/select_decode.cu")
        trees.append((label, str(Path(d).resolve())))
    variants = [v for v in a.variants.split(",") if v]
    if bad := [v for v in variants if v not in VARIANTS]:
        p.error(f"--variants: unknown {bad}; expected among {VARIANTS}")

    from infllm_cupy.decode.select_decode import plan_select_decode, select_decode

    dev, t0, failed = torch.device("cuda"), time.perf_counter(), False
    HQ, H, D, kw = 32, 2, 128, dict(topk=64, local_blocks=32, init_blocks=1, score_dtype=torch.bfloat16)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    print(f"{torch.cuda.get_device_name(dev)}; trees " + ", ".join(f"{lb}={d}" for lb, d in trees))
    for cfg in a.configs.split(","):
        B, L = parse_decode_config(cfg)
        g = torch.Generator(device=dev).manual_seed(0)
        cache = random_cache(B, L, H, D, torch.bfloat16, dev, g)
        q = torch.randn(B, HQ, D, generator=g, device=dev, dtype=torch.bfloat16)
        out_len = -(-cache.capacity // 64)
        base = plan_select_decode(B, H, HQ // H, cache.ck1.shape[1], cache.ck2.shape[1], sms)
        for var in variants:
            plan = {"default": base, "short": dataclasses.replace(
                base, fine_tiles=1, fine_ranges=-(-(cache.ck1.shape[1] + 4) // 64), coarse_tiles=1,
                coarse_ranges=max(1, -(-cache.ck2.shape[1] // 64)))}[var]

            def call(plan=plan):
                return select_decode(q, cache.ck1, cache.ck2, cache.seqlens, out_len, softmax_scale=None,
                                     exact=False, plan=plan, **kw)

            graphs, ref = [], None
            for label, d in trees:
                with _env.override(kernels_dir=d):
                    out = call()
                    torch.cuda.synchronize()
                    same = "baseline" if ref is None else ("same bits" if torch.equal(out, ref) else "FAIL")
                    failed |= same == "FAIL"
                    ref = out if ref is None else ref
                    graphs.append((label, capture_graph(call, a.inner), same))
            times = {label: [] for label, _, _ in graphs}
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            for _, gr, _ in graphs:
                gr.replay()
            for r in range(a.reps):
                for i in range(len(graphs)):
                    label, gr, _ = graphs[(i + r) % len(graphs)]
                    start.record()
                    gr.replay()
                    end.record()
                    end.synchronize()
                    times[label].append(start.elapsed_time(end) * 1e3 / a.inner)
            b0 = statistics.median(times[graphs[0][0]])
            for label, _, same in graphs:
                us = statistics.median(times[label])
                print(f"{cfg:8} {var:8} {label:10} {us:9.2f} us  x{us / b0:.3f}  {same}", flush=True)
        cache = q = None
        torch.cuda.empty_cache()
    print(f"{time.perf_counter() - t0:.0f} s" + ("; SELECTIONS DIFFER" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
