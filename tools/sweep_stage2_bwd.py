"""Stage-2 backward kernels: every BwdTiles variant and the sm_90a instances, at one size.

    python tools/sweep_stage2_bwd.py --T 8192 --B 2 --K 64 --sel a b c

Each variant is a backward plan (tools/_plans.py names: the SM80 tile shapes DQ,COLS, and on
capability 9.0 sm90a_tiles, sm90a_gather and sm90a, the plan's default with both instances).

Times `stage2_bwd` (launcher level, fixed forward outputs) with CUDA events after warm-up (median),
next to our forward on the same inputs, and prints effective TFLOP/s (backward = 2.5x the forward's
FLOP on attended keys). `--profile` adds one torch.profiler pass per selection with the time of each
backward kernel (delta, tile index, dq, dk/dv). Development tool; bench_stage2.py is the comparison.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._harness import add_shape_args, bench_gpu_time, flops_attn
from infllm_cupy.selections import SELECTIONS, attended_keys, make_selection, uniform_cu_seqlens

sys.path.insert(0, str(Path(__file__).resolve().parent))
from infllm_cupy.stage2.plan import ALL_BWD_TILES, DEFAULT_BWD_TILES, n_mask_words
from infllm_cupy.stage2.sparse_bwd import stage2_bwd
from infllm_cupy.stage2.sparse_fwd import stage2_fwd, token_block_masks

from _plans import bwd_variant_named, fwd_variant_named


def main() -> None:
    p = argparse.ArgumentParser()
    add_shape_args(p, T=8192, B=2, D=128)
    p.add_argument("--sel", nargs="+", default=["a", "b", "c"], choices=sorted(SELECTIONS))
    p.add_argument("--tiles", default="all",
                   help="'all' (SM80 shapes and the sm90a kernels) or 'default' (SM80 default and the sm90a "
                        "kernels)")
    p.add_argument("--profile", action="store_true")
    a = p.parse_args()
    HQ, H, D, T, B = 32, 2, a.D, a.T, a.B
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B * T, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(B * T, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(B * T, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    do = torch.randn(B * T, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
    cu = uniform_cu_seqlens(B, T, "cuda")
    scale = D ** -0.5
    hopper = torch.cuda.get_device_capability() == (9, 0)
    names = [f"{t.dq_warps},{t.dkdv_cols}"
             for t in (ALL_BWD_TILES if a.tiles == "all" else [DEFAULT_BWD_TILES])]
    names += ["sm90a_tiles", "sm90a_gather", "sm90a"] if hopper else []
    print(f"T={T} B={B} HQ={HQ} H={H} D={D} K={a.K} {torch.cuda.get_device_name()}")
    for sel in a.sel:
        topk = make_selection(sel, B, T, H, a.K, device="cuda", seed=0)
        keys = float(attended_keys(topk, cu).sum()) * (HQ // H)
        masks = token_block_masks(topk, cu, cu, n_mask_words(T))
        ft, _ = fwd_variant_named("auto", q, k, T, 2 * a.K)
        out, lse = stage2_fwd(q, k, v, cu, cu, masks, cu, q.shape[0], 1, T, True, scale, ft, max_seqlen_k=T)
        fwd = statistics.median(bench_gpu_time(
            lambda masks=masks, ft=ft: stage2_fwd(q, k, v, cu, cu, masks, cu, q.shape[0], 1, T, True, scale,
                                                  ft, max_seqlen_k=T)))
        print(f"sel {sel}: fwd {fwd:.2f} ms {flops_attn(keys, D, 'fwd') / fwd / 1e9:.0f} TFLOP/s")

        def bwd(variant, out=out, lse=lse, masks=masks):
            plan, launch = variant
            return stage2_bwd(do, q, k, v, out, lse, cu, cu, masks, cu, q.shape[0], 1, T, T, True, scale,
                              plan, **launch)

        plans = {name: bwd_variant_named(name, q, k, T, T) for name in names}
        for label, plan in plans.items():
            ms = statistics.median(bench_gpu_time(lambda plan=plan: bwd(plan)))
            print(f"  bwd {label}: {ms:.2f} ms "
                  f"{flops_attn(keys, D, 'bwd') / ms / 1e9:.0f} TFLOP/s (bwd/fwd {ms / fwd:.2f})", flush=True)
        if a.profile:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                bwd(plans[names[-1]])
                torch.cuda.synchronize()
            for ev in prof.key_averages():
                if ev.device_type == torch.autograd.DeviceType.CUDA or "stage2" in ev.key:
                    print(f"    {ev.key[:70]:<70} {ev.device_time_total / 1e3:8.2f} ms")


if __name__ == "__main__":
    main()
