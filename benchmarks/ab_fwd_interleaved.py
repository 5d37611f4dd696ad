"""A/B of stage-2 forward variants with the calls interleaved (development tool).

    python benchmarks/ab_fwd_interleaved.py --variants old=/tmp/old/kernels_cu:sm90a new=kernels_cu:sm90a \
        new_pair=kernels_cu:sm90a_pair --T 32768 --B 2 --K 64 --reps 40

A variant is `label=DIR:TILES`: the kernels_cu/ tree at DIR and the forward `tiles` argument. Every
variant's kernel is compiled first and held; then each repetition times one call of every
variant in turn (CUDA events), so that clock and power drift, which on an H100 moves a row by
several percent within a minute, falls on all variants alike. Reports the median per variant and
its ratio to the first. Sequential timing (`ab_nvrtc_options.py`) once showed a 10% difference
between two runs of the same kernel.
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
from infllm_cupy.stage2 import sparse_fwd  # noqa: E402


def load_variant(tree: str, tiles: str, dtype_name: str, D: int):
    """The forward kernel of `tree` for `tiles`, compiled now and held."""
    os.environ[_jit.KERNELS_DIR_ENV] = str(Path(tree).resolve())
    _jit.kernels_dir.cache_clear()
    _jit.clear_cache()
    t = sparse_fwd.as_tiles(tiles)
    if t in sparse_fwd.SM90A_FWD:
        return _jit.get_kernel(sparse_fwd.SM90_SOURCE, f"stage2_fwd_sm90<{dtype_name}, {D}>", sm90a=True)
    return _jit.get_kernel(sparse_fwd.FWD_SOURCE, t.name(torch.bfloat16, D))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--variants", nargs="+", required=True, help="label=DIR:TILES")
    p.add_argument("--T", type=int, default=32768)
    p.add_argument("--B", type=int, default=2)
    p.add_argument("--K", type=int, default=64)
    p.add_argument("--selections", default="a,b,c")
    p.add_argument("--reps", type=int, default=30)
    a = p.parse_args()
    HQ, H, D = 32, 2, 128
    variants = []
    for v in a.variants:
        label, rest = v.split("=", 1)
        tree, tiles = rest.rsplit(":", 1)
        variants.append((label, tiles, load_variant(tree, tiles, "__nv_bfloat16", D)))
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(a.B * a.T, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(a.B * a.T, H, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    cu = uniform_cu_seqlens(a.B, a.T, "cuda")
    real_get_kernel = _jit.get_kernel
    print(f"{'selection':10s} " + " ".join(f"{lb + ' ms':>14s} {'TF/s':>5s}" for lb, _, _ in variants)
          + "   " + " ".join(f"{lb}/{variants[0][0]}" for lb, _, _ in variants[1:]))
    for sel in a.selections.split(","):
        topk = make_selection(sel, a.B, a.T, H, a.K, device="cuda", seed=0)
        flop = flops_attn(float(attended_keys(topk, cu).sum()) * (HQ // H), D, "fwd")
        masks = sparse_fwd.token_block_masks(topk, cu, cu, sparse_fwd.n_mask_words(a.T))

        def call(kernel, tiles):
            _jit.get_kernel = lambda *args, **kw: kernel
            try:
                sparse_fwd.stage2_fwd(q, k, v, cu, cu, masks, cu, q.shape[0], 1, a.T, True, D ** -0.5,
                                      sparse_fwd.as_tiles(tiles))
            finally:
                _jit.get_kernel = real_get_kernel

        for _, tiles, kernel in variants:       # warm-up
            call(kernel, tiles)
        events = {lb: [] for lb, _, _ in variants}
        for _ in range(a.reps):
            for lb, tiles, kernel in variants:
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                call(kernel, tiles)
                e1.record()
                events[lb].append((e0, e1))
        torch.cuda.synchronize()
        med = {lb: statistics.median(e0.elapsed_time(e1) for e0, e1 in ev) for lb, ev in events.items()}
        first = med[variants[0][0]]
        print(f"{sel + ' K' + str(a.K):10s} " + " ".join(f"{med[lb]:14.2f} {flop / med[lb] / 1e9:5.0f}" for lb, _, _ in variants)
              + "   " + " ".join(f"{first / med[lb]:.3f}x" for lb, _, _ in variants[1:]), flush=True)


if __name__ == "__main__":
    main()
