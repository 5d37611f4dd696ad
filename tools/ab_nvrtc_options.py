"""A/B of NVRTC option sets or kernel trees over the hot kernels, in one process (development tool).

    python tools/ab_nvrtc_options.py --sets base ftz --rounds 2
    python tools/ab_nvrtc_options.py --sets old=/tmp/old/kernels_cu new=kernels_cu
    python tools/ab_nvrtc_options.py --sets base nopingpong --skip-fwdbwd --T1   # forward rows only

A set is a named option set, or `label=DIR[,kernel=KERNEL]`: the kernels_cu/ tree at DIR
(`_env.override(kernels_dir=DIR)`) with the default options, and optionally the public `kernel=`
("auto", "sm80", "sm90a") of the stage-1 rows (e.g. `sm80=kernels_cu,kernel=sm80`). `--fwd` and
`--bwd` name stage-2 plans (tools/_plans.py).
For each round and each set: forget the compiled kernels, set `_jit.BASE_OPTIONS` (or the tree), then time
(CUDA events, median) the stage-2 forward and forward+backward on selections a/b/c (K = 64), at
`--T2 x --B2`, and `stage1_select` (K = 96, MiniCPM4 budget) at each `--T1` with B = 1. Rounds
alternate the sets so that clock drift shows as a difference between rounds, not between sets.
CuPy appends -ftz=true to every compile, so "base" and "ftz" build the same code (an earlier
"ftz is neutral" result compared two identical builds).
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._harness import bench_gpu_time, flops_attn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from infllm_cupy import _env, _jit
from infllm_cupy.selections import attended_keys, make_selection, uniform_cu_seqlens

from _plans import bwd_variant_named, fwd_variant_named

OPTION_SETS = {
    "base": ("-std=c++17",),
    "ftz": ("-std=c++17", "-ftz=true"),
    "fast": ("-std=c++17", "-ftz=true", "-prec-div=false", "-prec-sqrt=false"),
    # the sm_90a forward without its warpgroup ping-pong (FWD_PINGPONG in kernels_cu/stage2/ring_sm90.cuh;
    # docs/stage2_fwd.md, 4.): an A/B-only build the package never compiles
    "nopingpong": ("-std=c++17", "-DFWD_PINGPONG=0"),
}


DEFAULT_OPTIONS = _jit.BASE_OPTIONS
_SET = contextlib.ExitStack()       # the current set's `_env.override`
STAGE1_KERNEL = {"kernel": "auto"}  # the current set's stage-1 `kernel=`


def select_set(s: str) -> None:
    """Make set `s` the one `_jit` compiles with, and forget every compiled kernel."""
    _SET.close()
    STAGE1_KERNEL["kernel"] = "auto"
    if "=" in s:
        tree, *opts = s.split("=", 1)[1].split(",")
        _SET.enter_context(_env.override(kernels_dir=str(Path(tree).resolve())))
        for kv in opts:                     # label=DIR,kernel=KERNEL
            key, value = kv.split("=", 1)
            if key != "kernel":
                raise SystemExit(f"set {s!r}: only kernel=KERNEL may follow the tree, got {kv!r}")
            STAGE1_KERNEL["kernel"] = value
        _jit.BASE_OPTIONS = DEFAULT_OPTIONS
    else:
        _jit.BASE_OPTIONS = OPTION_SETS[s]
    _jit.clear_cache()


def median_ms(fn) -> float:
    return statistics.median(bench_gpu_time(fn))


def stage2_rows(T: int, B: int, K: int, bwd_kernels=(), fwd_kernels=(None,),
                skip_fwdbwd=False) -> list[tuple[str, object, float]]:
    from infllm_cupy.stage2.plan import n_mask_words
    from infllm_cupy.stage2.sparse_bwd import stage2_bwd
    from infllm_cupy.stage2.sparse_fwd import stage2_fwd, token_block_masks

    HQ, H, D = 32, 2, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    q, do = (torch.randn(B * T, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    k, v = (torch.randn(B * T, H, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    cu = uniform_cu_seqlens(B, T, "cuda")
    scale = D ** -0.5
    rows = []
    for sel in "abc":
        topk = make_selection(sel, B, T, H, K, device="cuda", seed=0)
        flop = flops_attn(float(attended_keys(topk, cu).sum()) * (HQ // H), D, "fwd")
        masks = token_block_masks(topk, cu, cu, n_mask_words(T))

        # forward plans without key-range passes (split_min None), as the rows have always been timed
        for fk in fwd_kernels:
            fplan, flaunch = fwd_variant_named(fk or "auto", q, k, T, None)

            def fwd_k(masks=masks, fplan=fplan, flaunch=flaunch):
                return stage2_fwd(q, k, v, cu, cu, masks, cu, q.shape[0], 1, T, True, scale, fplan, **flaunch)

            rows.append((f"fwd {sel} {T // 1024}k x {B} K{K} {fk or ''}", fwd_k, flop))

        default_fwd, _ = fwd_variant_named("auto", q, k, T, None)

        def fwd(masks=masks):
            return stage2_fwd(q, k, v, cu, cu, masks, cu, q.shape[0], 1, T, True, scale, default_fwd)

        for kernel in [] if skip_fwdbwd else [None, *bwd_kernels]:
            bplan, blaunch = bwd_variant_named(kernel or "auto", q, k, T, T)

            def bwd(masks=masks, fwd=fwd, bplan=bplan, blaunch=blaunch):
                out, lse = fwd()   # the forward is part of the timed work: same for every set
                return stage2_bwd(do, q, k, v, out, lse, cu, cu, masks, cu, q.shape[0], 1, T, T, True, scale,
                                  bplan, **blaunch)

            rows.append((f"fwd+bwd {sel} {T // 1024}k x {B} K{K} {kernel or ''}", bwd, 3.5 * flop))
    return rows


def stage1_rows(T: int, H: int = 2) -> list[tuple[str, object, float]]:
    from infllm_cupy.compress import compress_k
    from infllm_cupy.stage1.select import stage1_select

    HQ, D = 32, 128
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(T, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    cu = uniform_cu_seqlens(1, T, "cuda")
    ck1, cu1 = compress_k(k, cu, 32, 16, backend="kernels")
    ck2, cu2 = compress_k(k, cu, 128, 64, backend="kernels")
    # FLOP of the two score passes on visible compressed keys (causal: half of each)
    flop = 2.0 * D * T * HQ * (ck1.shape[0] + ck2.shape[0]) / 2

    def run():
        return stage1_select(q, ck1, ck2, cu, cu1, cu2, T, topk=64, local_blocks=32,
                             kernel=STAGE1_KERNEL["kernel"])

    return [(f"stage1 {T // 1024}k x 1 K96 G{HQ // H}", run, flop)]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sets", nargs="+", default=["base", "ftz"],
                   help=f"{sorted(OPTION_SETS)} or label=DIR[,kernel=KERNEL]")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--T2", type=int, default=32768)
    p.add_argument("--B2", type=int, default=2)
    p.add_argument("--T1", type=int, nargs="*", default=[65536, 131072])
    p.add_argument("--skip-stage2", action="store_true")
    p.add_argument("--H1", type=int, nargs="+", default=[2], help="KV heads of the stage-1 rows (HQ = 32)")
    p.add_argument("--K2", type=int, default=64)
    p.add_argument("--bwd", nargs="*", default=[],
                   help="also time these backward plans (tools/_plans.py names, "
                   "e.g. sm90a_gather 4,32)")
    p.add_argument("--fwd", nargs="*", default=[],
                   help="forward plans to time (default: the automatic choice), "
                   "e.g. sm90a_single sm90a_pair sm90a 4,2,64")
    p.add_argument("--skip-fwdbwd", action="store_true", help="time only the forward rows of stage 2")
    a = p.parse_args()
    rows = ([] if a.skip_stage2 else stage2_rows(a.T2, a.B2, a.K2, a.bwd, a.fwd or [None],
                                                 a.skip_fwdbwd)) + [r for T in a.T1 for H in a.H1
                                                                    for r in stage1_rows(T, H)]
    results: dict[tuple[str, str], list[float]] = {}
    for rnd in range(a.rounds):
        order = a.sets if rnd % 2 == 0 else list(reversed(a.sets))
        for s in order:
            select_set(s)
            for name, fn, _ in rows:
                fn()
                torch.cuda.synchronize()
                ms = median_ms(fn)
                results.setdefault((name, s), []).append(ms)
                print(f"round {rnd} {s.split('=')[0]:5s} {name:36s} {ms:8.2f} ms", flush=True)
    labels = [s.split("=", 1)[0] for s in a.sets]
    print(f"\n{'workload':36s} " + " ".join(f"{lb + ' ms':>10s} {'TF/s':>6s}" for lb in labels)
          + "   " + " ".join(f"{lb}/{labels[0]}" for lb in labels[1:]))
    for name, _, flop in rows:
        best = {s: min(results[(name, s)]) for s in a.sets}
        print(f"{name:36s} " + " ".join(f"{best[s]:10.2f} {flop / best[s] / 1e9:6.0f}" for s in a.sets)
              + "   " + " ".join(f"{best[a.sets[0]] / best[s]:.3f}x" for s in a.sets[1:]))


if __name__ == "__main__":
    main()
