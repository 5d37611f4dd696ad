"""A/B of stage-2 kernel variants with the calls interleaved (development tool).

    python benchmarks/ab_fwd_interleaved.py --variants old=/tmp/old/kernels_cu:sm90a new=kernels_cu:sm90a \
        new_pair=kernels_cu:sm90a_pair --T 32768 --B 2 --K 64 --reps 40 [--mode fwdbwd]

A variant is `label=DIR:TILES`: the kernels_cu/ tree at DIR and the forward `tiles` argument
("sm90a", "sm90a_pair", "sm90a_single", or "warps,m_tiles,sub_keys" for the SM80 kernel). With
`--mode fwdbwd` each call is the forward plus the default backward (`stage2_bwd`).

Each variant runs once under its tree first, and every kernel `_jit.get_kernel` hands out then is
recorded; timed calls get their variant's recorded kernels, so the trees never recompile. Each
repetition times one call of every variant in turn (CUDA events): clock and power drift, which on
an H100 moves a row by several percent within a minute, falls on all variants alike. Reports the
median per variant and its ratio to the first. Sequential timing (`ab_nvrtc_options.py`) once
showed a 10% difference between two runs of the same kernel.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._harness import flops_attn  # noqa: E402
from benchmarks.selections import attended_keys, make_selection, uniform_cu_seqlens  # noqa: E402
from infllm_cupy import _jit  # noqa: E402
from infllm_cupy.stage2 import sparse_bwd, sparse_fwd  # noqa: E402

REAL_GET_KERNEL = _jit.get_kernel


def parse_tiles(tiles: str):
    """A variant's tiles text as `stage2_fwd` takes it: an sm_90a name or an SM80 FwdTiles."""
    return sparse_fwd.as_tiles(tuple(int(x) for x in tiles.split(",")) if "," in tiles else tiles)


def use_tree(tree: str) -> None:
    os.environ[_jit.KERNELS_DIR_ENV] = str(Path(tree).resolve())
    _jit.kernels_dir.cache_clear()
    _jit.clear_cache()


def recorded(fn, kernels: dict):
    """`fn` with `_jit.get_kernel` answering from `kernels` (filled on a miss)."""
    def get_kernel(source, name, **kw):
        key = (source, name, tuple(sorted(kw.items())))
        if key not in kernels:
            kernels[key] = REAL_GET_KERNEL(source, name, **kw)
        return kernels[key]

    def run():
        _jit.get_kernel = get_kernel
        try:
            return fn()
        finally:
            _jit.get_kernel = REAL_GET_KERNEL
    return run


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--variants", nargs="+", required=True, help="label=DIR:TILES")
    p.add_argument("--T", type=int, default=32768)
    p.add_argument("--B", type=int, default=2)
    p.add_argument("--K", type=int, default=64)
    p.add_argument("--selections", default="a,b,c")
    p.add_argument("--mode", default="fwd", choices=["fwd", "fwdbwd"])
    p.add_argument("--reps", type=int, default=30)
    a = p.parse_args()
    HQ, H, D = 32, 2, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    q, do = (torch.randn(a.B * a.T, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    k, v = (torch.randn(a.B * a.T, H, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    cu = uniform_cu_seqlens(a.B, a.T, "cuda")
    scale = D ** -0.5
    variants = []
    for spec in a.variants:
        label, rest = spec.split("=", 1)
        tree, tiles = rest.rsplit(":", 1)
        variants.append((label, tree, parse_tiles(tiles), {}))
    print(f"{a.mode}: {'selection':10s} " + " ".join(f"{lb + ' ms':>14s} {'TF/s':>5s}" for lb, *_ in variants)
          + "   " + " ".join(f"{lb}/{variants[0][0]}" for lb, *_ in variants[1:]))
    for sel in a.selections.split(","):
        topk = make_selection(sel, a.B, a.T, H, a.K, device="cuda", seed=0)
        flop = flops_attn(float(attended_keys(topk, cu).sum()) * (HQ // H), D, "fwd") * (3.5 if a.mode == "fwdbwd" else 1)
        masks = sparse_fwd.token_block_masks(topk, cu, cu, sparse_fwd.n_mask_words(a.T))
        calls = []
        for label, tree, tiles, kernels in variants:
            def work(tiles=tiles, masks=masks):
                out, lse = sparse_fwd.stage2_fwd(q, k, v, cu, cu, masks, cu, q.shape[0], 1, a.T, True, scale, tiles)
                if a.mode == "fwdbwd":
                    sparse_bwd.stage2_bwd(do, q, k, v, out, lse, cu, cu, masks, cu, q.shape[0], 1, a.T, a.T, True, scale)

            use_tree(tree)                      # record this tree's kernels (compiles them)
            run = recorded(work, kernels)
            run()
            calls.append((label, run))
        torch.cuda.synchronize()
        for _, run in calls:                    # warm-up with recorded kernels only
            run()
        events = {lb: [] for lb, _ in calls}
        for _ in range(a.reps):
            for lb, run in calls:
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                run()
                e1.record()
                events[lb].append((e0, e1))
        torch.cuda.synchronize()
        med = {lb: statistics.median(e0.elapsed_time(e1) for e0, e1 in ev) for lb, ev in events.items()}
        first = med[variants[0][0]]
        print(f"{a.mode}: {sel + ' K' + str(a.K):10s} "
              + " ".join(f"{med[lb]:14.2f} {flop / med[lb] / 1e9:5.0f}" for lb, _ in calls)
              + "   " + " ".join(f"{first / med[lb]:.3f}x" for lb, _ in calls[1:]), flush=True)


if __name__ == "__main__":
    main()
