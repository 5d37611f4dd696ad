"""A/B of stage-2 kernel variants with the calls interleaved (development tool).

    python tools/ab_fwd_interleaved.py --variants old=/tmp/old/kernels_cu:sm90a new=kernels_cu:sm90a \
        new_pair=kernels_cu:sm90a_pair --T 32768 --B 2 --K 64 --reps 40 [--mode fwdbwd]

A variant is `label=DIR:TILES[@PKG]`: the kernels_cu/ tree at DIR and the forward `tiles` argument
("sm90a", "sm90a_pair", "sm90a_single", "sm90a_split", or "warps,m_tiles,sub_keys" for the SM80
kernel). With `--mode fwdbwd` each call is the forward plus the default backward (`stage2_bwd`).
`@PKG` launches through the `infllm_cupy/` package folder PKG instead of this one, for a tree whose
kernels take other arguments (e.g. `git archive OLD infllm_cupy kernels_cu | tar -x -C /tmp/old`, then
`old=/tmp/old/kernels_cu:sm90a@/tmp/old/infllm_cupy`). Trailing `%NAME=VALUE` parts set environment
variables around that variant's calls only (launch-time knobs), e.g.
`pdl=kernels_cu:sm90a%INFLLM_CUPY_DKDV_PDL=1%INFLLM_CUPY_DKDV_PASSES=16`.

Each variant runs once under its tree first, and every kernel `_jit.get_kernel` hands out then is
recorded; timed calls get their variant's recorded kernels, so the trees never recompile. Each
repetition times one call of every variant in turn (CUDA events): clock and power drift, which on
an H100 moves a row by several percent within a minute, falls on all variants alike. Reports the
median per variant and its ratio to the first. Sequential timing (`ab_nvrtc_options.py`) once
showed a 10% difference between two runs of the same kernel.
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import os
import statistics
import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._harness import flops_attn
from infllm_cupy.selections import attended_keys, make_selection, uniform_cu_seqlens
from infllm_cupy import _jit
from infllm_cupy.stage2 import sparse_bwd, sparse_fwd


def launchers(pkg: str | None, tag: str):
    """(_jit, sparse_fwd, sparse_bwd) of this package, or of the package folder `pkg`, loaded under
    the name `tag` without its `__init__` files (they would register the torch ops a second time)."""
    if pkg is None:
        return _jit, sparse_fwd, sparse_bwd
    for name, path in ((tag, Path(pkg)), (tag + ".stage2", Path(pkg) / "stage2")):
        mod = types.ModuleType(name)
        mod.__path__ = [str(path.resolve())]
        sys.modules[name] = mod
    return tuple(importlib.import_module(f"{tag}.{m}") for m in ("_jit", "stage2.sparse_fwd", "stage2.sparse_bwd"))


def parse_tiles(tiles: str, fwd_module):
    """A variant's tiles text as `stage2_fwd` takes it: an sm_90a name or an SM80 FwdTiles."""
    return fwd_module.as_tiles(tuple(int(x) for x in tiles.split(",")) if "," in tiles else tiles)


def use_tree(jit, tree: str) -> None:
    os.environ[jit.KERNELS_DIR_ENV] = str(Path(tree).resolve())
    jit.kernels_dir.cache_clear()
    jit.clear_cache()


def recorded(fn, jit, kernels: dict, env: dict | None = None):
    """`fn` with `jit.get_kernel` answering from `kernels` (filled on a miss) and the variables
    `env` set in os.environ during the call."""
    real = jit.get_kernel
    env = env or {}

    def get_kernel(source, name, **kw):
        key = (source, name, tuple(sorted(kw.items())))
        if key not in kernels:
            kernels[key] = real(source, name, **kw)
        return kernels[key]

    def run():
        jit.get_kernel = get_kernel
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            return fn()
        finally:
            jit.get_kernel = real
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    return run


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--variants", nargs="+", required=True, help="label=DIR:TILES[@PKG][%%NAME=VALUE...]")
    p.add_argument("--T", type=int, default=32768)
    p.add_argument("--B", type=int, default=2)
    p.add_argument("--K", type=int, default=64)
    p.add_argument("--selections", default="a,b,c")
    p.add_argument("--mode", default="fwd", choices=["fwd", "fwdbwd"])
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--block", type=int, default=0,
                   help="time blocks of this many calls per variant (after --settle untimed ones), "
                        "not single calls")
    p.add_argument("--settle", type=int, default=2)
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
        rest, *env_parts = rest.split("%")
        env = dict(e.split("=", 1) for e in env_parts)
        rest, pkg = rest.split("@", 1) if "@" in rest else (rest, None)
        tree, tiles = rest.rsplit(":", 1)
        mods = launchers(pkg, f"_ab_pkg_{len(variants)}")
        variants.append((label, tree, parse_tiles(tiles, mods[1]), mods, {}, env))
    print(f"{a.mode}: {'selection':10s} " + " ".join(f"{lb + ' ms':>14s} {'TF/s':>5s}" for lb, *_ in variants)
          + "   " + " ".join(f"{lb}/{variants[0][0]}" for lb, *_ in variants[1:]))
    for sel in a.selections.split(","):
        topk = make_selection(sel, a.B, a.T, H, a.K, device="cuda", seed=0)
        flop = flops_attn(float(attended_keys(topk, cu).sum()) * (HQ // H), D, "fwd") * (3.5 if a.mode == "fwdbwd" else 1)
        masks = sparse_fwd.token_block_masks(topk, cu, cu, sparse_fwd.n_mask_words(a.T))
        calls = []
        for label, tree, tiles, (jit, fwd, bwd), kernels, env in variants:
            # the token-level op's key-range pass threshold, where the tree's launcher has one
            extra = {"split_min": 2 * a.K} if "split_min" in inspect.signature(fwd.stage2_fwd).parameters else {}

            def work(extra=extra, tiles=tiles, masks=masks, fwd=fwd, bwd=bwd):
                out, lse = fwd.stage2_fwd(q, k, v, cu, cu, masks, cu, q.shape[0], 1, a.T, True, scale, tiles,
                                          **extra)
                if a.mode == "fwdbwd":
                    bwd.stage2_bwd(do, q, k, v, out, lse, cu, cu, masks, cu, q.shape[0], 1, a.T, a.T, True, scale)

            use_tree(jit, tree)                 # record this tree's kernels (compiles them)
            run = recorded(work, jit, kernels, env)
            run()
            calls.append((label, run))
        torch.cuda.synchronize()
        for _, run in calls:                    # warm-up with recorded kernels only
            run()
        events = {lb: [] for lb, _ in calls}
        per = max(a.block, 1)
        for rep in range(a.reps):
            r = rep % len(calls)                # rotated, so every variant follows every other
            for lb, run in calls[r:] + calls[:r]:
                for _ in range(a.settle if a.block else 0):
                    run()
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                for _ in range(per):
                    run()
                e1.record()
                events[lb].append((e0, e1))
        torch.cuda.synchronize()
        med = {lb: statistics.median(e0.elapsed_time(e1) / per for e0, e1 in ev) for lb, ev in events.items()}
        first = med[variants[0][0]]
        print(f"{a.mode}: {sel + ' K' + str(a.K):10s} "
              + " ".join(f"{med[lb]:14.2f} {flop / med[lb] / 1e9:5.0f}" for lb, _ in calls)
              + "   " + " ".join(f"{first / med[lb]:.3f}x" for lb, _ in calls[1:]), flush=True)


if __name__ == "__main__":
    main()
