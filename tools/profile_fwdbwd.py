"""Per-kernel time of one forward+backward through the public op (torch.profiler), per selection.

    python tools/profile_fwdbwd.py --T 32768 --B 2 --K 64 --sel a b c
    python tools/profile_fwdbwd.py --T 32768 --B 8 --sel a --split

`--split` also times, in the same process (CUDA events, median), the forward under no_grad, the
forward with grad, the backward of a retained graph and forward+backward, each also under
`_env.override(validate=False)` (no host copies of cu_seqlens): whether fwd+bwd is more than its parts.

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
from benchmarks._harness import add_shape_args
from infllm_cupy.selections import SELECTIONS, make_selection, uniform_cu_seqlens
from infllm_cupy.stage2 import sparse_attn_varlen


def main() -> None:
    p = argparse.ArgumentParser()
    add_shape_args(p, T=32768, B=2, D=128)
    p.add_argument("--sel", nargs="+", default=["a", "b", "c"], choices=sorted(SELECTIONS))
    p.add_argument("--split", action="store_true", help="time fwd, fwd with grad, bwd and fwd+bwd apart")
    p.add_argument("--rep", type=int, default=10)
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
        if a.split:
            split_times(q, k, v, do, cu, topk, T, a.rep)
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


def split_times(q, k, v, do, cu, topk, T, rep) -> None:
    """Median ms of the forward (no_grad / with grad), the retained backward and fwd+bwd."""
    import statistics

    from benchmarks._harness import bench_gpu_time
    from infllm_cupy import _env

    def fwd_nograd():
        with torch.no_grad():
            sparse_attn_varlen(q, k, v, cu, cu, topk, T, T)

    def fwd_grad():
        sparse_attn_varlen(q, k, v, cu, cu, topk, T, T)

    out = sparse_attn_varlen(q, k, v, cu, cu, topk, T, T)

    def bwd():
        torch.autograd.grad(out, (q, k, v), do, retain_graph=True)

    def fwdbwd():
        torch.autograd.grad(sparse_attn_varlen(q, k, v, cu, cu, topk, T, T), (q, k, v), do)

    fns = {"fwd no_grad": fwd_nograd, "fwd grad": fwd_grad, "bwd retained": bwd, "fwd+bwd": fwdbwd}
    res = {}
    for validate in ("1", "0"):
        with _env.override(validate=validate == "1"):
            for _rnd in range(2):                       # two interleaved rounds
                for name, fn in fns.items():
                    ms = statistics.median(bench_gpu_time(fn, warmup=1, rep=rep))
                    res.setdefault((name, validate), []).append(ms)
    for (name, validate), ms in res.items():
        print(f"    {name:<14} validate={validate}: " + " ".join(f"{m:8.2f}" for m in ms) + " ms")
    f, b, fb = (min(res[(n, "1")]) for n in ("fwd grad", "bwd retained", "fwd+bwd"))
    print(f"    fwd grad + bwd = {f + b:.2f} ms against fwd+bwd {fb:.2f} ms ({fb - f - b:+.2f})")


if __name__ == "__main__":
    main()
