"""Per-kernel time of one forward+backward through the public op (torch.profiler), per selection.

    python benchmarks/profile_fwdbwd.py --T 32768 --B 2 --K 64 --sel a b c

Lists every CUDA kernel (and memcpy/memset) that one `sparse_attn_varlen(...).backward(dout)`
launches, with its device time, so that the parts outside the dq and dk/dv kernels (mask rows,
delta, transposed indexes, dtype casts) are visible. Development tool, not a benchmark.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.selections import SELECTIONS, make_selection, uniform_cu_seqlens
from infllm_cupy.stage2 import sparse_attn_varlen


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--T", type=int, default=32768)
    p.add_argument("--B", type=int, default=2)
    p.add_argument("--K", type=int, default=64)
    p.add_argument("--D", type=int, default=128)
    p.add_argument("--sel", nargs="+", default=["a", "b", "c"], choices=sorted(SELECTIONS))
    a = p.parse_args()
    HQ, H, D, T, B = 32, 2, a.D, a.T, a.B
    g = torch.Generator(device="cuda").manual_seed(0)

    def mk(h):
        return torch.randn(B * T, h, D, device="cuda", dtype=torch.bfloat16, generator=g)

    q, k, v, do = mk(HQ).requires_grad_(), mk(H).requires_grad_(), mk(H).requires_grad_(), mk(HQ)
    cu = uniform_cu_seqlens(B, T, "cuda")
    print(f"T={T} B={B} HQ={HQ} H={H} D={D} K={a.K} {torch.cuda.get_device_name()}")
    for sel in a.sel:
        topk = make_selection(sel, B, T, H, a.K, device="cuda", seed=0)

        def step(topk=topk):
            q.grad = k.grad = v.grad = None
            sparse_attn_varlen(q, k, v, cu, cu, topk, T, T).backward(do)

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        rows = [(ev.key, ev.device_time_total / 1e3, ev.count) for ev in prof.key_averages()
                if ev.device_time_total > 0 and ev.device_type == torch.autograd.DeviceType.CUDA]
        total = sum(r[1] for r in rows)
        print(f"sel {sel}: sum of kernel times {total:.2f} ms")
        for key, ms, n in sorted(rows, key=lambda r: -r[1]):
            print(f"    {key[:80]:<80} {ms:8.3f} ms x{n}")


if __name__ == "__main__":
    main()
