"""SM clock, power and throttle reasons while a workload runs without pause (development tool).

    python tools/clock_probe.py --T 32768 --B 8 --seconds 8

Runs ours (selection a, K = 64) and FlexAttention (`flex_same`, as bench_stage2.py) forward+backward,
and ours backward only, each back to back for `--seconds`, while `nvidia-smi -lms 100` samples the
GPU. Prints per workload: ms per iteration, median SM clock, median power draw, and the throttle
reasons seen. Why: a single profiled iteration of ours is ~10% shorter than the median of a
sustained run; this says whether sustained runs lose clock speed, and whether the anchors do too.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._harness import add_shape_args
from infllm_cupy.selections import (
    block_shared,
    make_selection,
    split_blocks,
    to_flex_block_mask_inputs,
    uniform_cu_seqlens,
)
from infllm_cupy.stage2 import sparse_attn_varlen

QUERY = "clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active"


def sample_while(fn, seconds: float, sync=torch.cuda.synchronize) -> tuple[float, list[list[str]]]:
    """Run `fn` back to back for `seconds` under nvidia-smi sampling; (ms per call, samples)."""
    fn()
    sync()
    smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", "-lms",
                            "100"],
                           stdout=subprocess.PIPE, text=True)
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        fn()
        n += 1
        if n % 4 == 0:
            sync()
    sync()
    el = time.perf_counter() - t0
    smi.terminate()
    out = smi.communicate()[0]
    rows = [[x.strip() for x in line.split(",")] for line in out.splitlines() if line.count(",") == 3]
    return el * 1e3 / n, rows


def report(name: str, ms: float, rows: list[list[str]]) -> None:
    rows = rows[len(rows) // 5:]                 # drop the ramp
    clk = statistics.median(float(r[0]) for r in rows)
    pw = statistics.median(float(r[1]) for r in rows)
    temp = max(float(r[2]) for r in rows)
    reasons = sorted({r[3] for r in rows})
    print(f"{name:<16} {ms:8.2f} ms/iter  SM clock median {clk:6.0f} MHz (min "
          f"{min(float(r[0]) for r in rows):.0f})  power {pw:5.0f} W  max temp {temp:.0f} C  throttle "
          f"{reasons}  ({len(rows)} samples)",
          flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    add_shape_args(p, T=32768, B=8)
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--no-flex", action="store_true")
    a = p.parse_args()
    HQ, H, D, T, B = 32, 2, 128, a.T, a.B
    g = torch.Generator(device="cuda").manual_seed(0)

    def mk(h):
        return torch.randn(B * T, h, D, device="cuda", dtype=torch.bfloat16, generator=g)

    q, k, v, do = mk(HQ).requires_grad_(), mk(H).requires_grad_(), mk(H).requires_grad_(), mk(HQ)
    cu = uniform_cu_seqlens(B, T, "cuda")
    topk = make_selection("a", B, T, H, a.K, device="cuda", seed=0)
    print(f"T={T} B={B} {torch.cuda.get_device_name()}", flush=True)
    idle = subprocess.run(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits"],
                          check=False, capture_output=True, text=True).stdout.strip()
    print(f"idle: {idle}", flush=True)

    def ours_fb():
        torch.autograd.grad(sparse_attn_varlen(q, k, v, cu, cu, topk, T, T), (q, k, v), do)

    out = sparse_attn_varlen(q, k, v, cu, cu, topk, T, T)

    def ours_b():
        torch.autograd.grad(out, (q, k, v), do, retain_graph=True)

    work = {"ours fwd+bwd": ours_fb, "ours bwd": ours_b}
    if not a.no_flex:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention
        flex = torch.compile(flex_attention, dynamic=False)
        sel = split_blocks(block_shared(B, T, H, a.K // 2, block_size=128, device="cuda", seed=a.K), 2)
        fb = to_flex_block_mask_inputs(sel, B, T, HQ)
        bm = BlockMask.from_kv_blocks(fb.kv_num_blocks, fb.kv_indices, fb.full_kv_num_blocks,
                                      fb.full_kv_indices,
                                      BLOCK_SIZE=(128, 128), mask_mod=lambda b, h, qi, ki: qi >= ki,
                                      seq_lengths=(T, T))
        qt, kt, vt = (x.detach().view(B, T, x.shape[1], D).transpose(1, 2).contiguous().requires_grad_()
                      for x in (q, k, v))
        dot = do.view(B, T, HQ, D).transpose(1, 2).contiguous()

        def flex_fb():
            torch.autograd.grad(flex(qt, kt, vt, block_mask=bm, enable_gqa=True), (qt, kt, vt), dot)

        work["flex fwd+bwd"] = flex_fb
    for _rnd in range(2):
        for name, fn in work.items():
            report(name, *sample_while(fn, a.seconds))


if __name__ == "__main__":
    main()
