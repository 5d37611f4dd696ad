"""A/B of stage-2 kernel variants with the calls interleaved, in one process (development tool).

The before/after check of a kernel change (within 1%, forward and forward+backward,
selections a and c, 32k x 8), against the tree at bc9961f:

    mkdir -p /tmp/old && git archive bc9961f infllm_cupy kernels_cu | tar -x -C /tmp/old
    python tools/ab_fwd_interleaved.py --variants old=/tmp/old/kernels_cu:sm90a@/tmp/old/infllm_cupy \\
        new=kernels_cu:sm90a --T 32768 --B 8 --K 64 --sel a c --mode fwd
    python tools/ab_fwd_interleaved.py --variants old=/tmp/old/kernels_cu:sm90a@/tmp/old/infllm_cupy \\
        new=kernels_cu:sm90a --T 32768 --B 8 --K 64 --sel a c --mode fwdbwd

A variant is `label=DIR:KERNEL[/BWD][@PKG][%NAME=VALUE...]`:
- DIR: the kernels_cu/ tree to compile from (`_env.override(kernels_dir=DIR)` around its first call).
- KERNEL: the forward variant, BWD the backward one (`--mode fwdbwd`; default: the plan the op
  uses), by the names of tools/_plans.py: auto, sm80, sm90a, sm90a_pair, sm90a_single,
  sm90a_split, W,M,K (SM80 tiles) for the forward; auto, sm80, sm90a, sm90a_tiles, sm90a_gather,
  sm90a_split, DQ,COLS for the backward; each with optional `+FIELD=VALUE` plan fields
  (e.g. `sm90a+kv_passes=2`, `sm90a/sm90a+dkdv_passes=16`), and on the backward `+pdl=0`: the dk/dv
  passes launched one after the other (`stage2_bwd`'s `_pdl` hook, no plan field).
- @PKG: launch through the `infllm_cupy/` package folder PKG instead of this one (an older or
  newer tree whose kernels take other arguments). A package whose launchers still take `tiles`
  (before the plans, e.g. bc9961f) is called the old way: KERNEL is its `tiles` text ("sm90a",
  "sm90a_pair", ..., "W,M,K"), BWD its backward `tiles` (default: its own default), and its
  kernels folder and knobs come from the environment.
- %NAME=VALUE: environment variables set around that variant's calls only (the old API's
  launch-time knobs, e.g. `%INFLLM_CUPY_DKDV_PASSES=16`).

Each variant runs once under its tree first, and every kernel `_jit.get_kernel` hands out then is
recorded; timed calls get their variant's recorded kernels, so the trees never recompile. Each
repetition times one call of every variant in turn (CUDA events): clock and power drift, which on
an H100 moves a row by several percent within a minute, falls on all variants alike. Reports the
median per variant and its ratio to the first. Sequential timing (`ab_nvrtc_options.py`) once
showed a 10% difference between two runs of the same kernel. Calls go through the launchers
(`stage2_fwd`, `stage2_bwd`) on mask rows built once per selection, with the plan the token-level
op would build (key-range passes at `split_min` = 2 K) unless the variant says otherwise.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import os
import statistics
import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmarks._harness import flops_attn
from infllm_cupy import _env, _jit
from infllm_cupy.selections import SELECTIONS, attended_keys, make_selection, uniform_cu_seqlens
from infllm_cupy.stage2 import plan as _plan
from infllm_cupy.stage2 import sparse_bwd, sparse_fwd

from _plans import bwd_variant_named, fwd_variant_named


class Package:
    """The launcher modules of one variant: this package's, or those of the package folder `pkg`
    loaded under the name `tag` without its `__init__` files (they would register the torch ops a
    second time)."""

    def __init__(self, pkg: str | None, tag: str):
        if pkg is None:
            self.jit, self.fwd, self.bwd, self.env, self.plan = _jit, sparse_fwd, sparse_bwd, _env, _plan
            return
        for name, path in ((tag, Path(pkg)), (tag + ".stage2", Path(pkg) / "stage2")):
            if not path.is_dir():
                raise SystemExit(f"no package folder {path}")
            mod = types.ModuleType(name)
            mod.__path__ = [str(path.resolve())]
            sys.modules[name] = mod
        self.jit, self.fwd, self.bwd = (importlib.import_module(f"{tag}.{m}")
                                        for m in ("_jit", "stage2.sparse_fwd", "stage2.sparse_bwd"))
        self.old = "tiles" in inspect.signature(self.fwd.stage2_fwd).parameters
        self.env = None if self.old else importlib.import_module(f"{tag}._env")
        self.plan = None if self.old else importlib.import_module(f"{tag}.stage2.plan")

    old = False

    @contextlib.contextmanager
    def tree(self, tree: str):
        """Compile from the kernels_cu/ folder `tree` inside the block."""
        path = str(Path(tree).resolve())
        if not self.old:
            with self.env.override(kernels_dir=path):
                yield
            return
        # the old API reads its kernels folder from the environment (and caches it)
        var, saved = self.jit.KERNELS_DIR_ENV, os.environ.get(self.jit.KERNELS_DIR_ENV)
        os.environ[var] = path
        self.jit.kernels_dir.cache_clear()
        self.jit.clear_cache()
        try:
            yield
        finally:
            if saved is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = saved
            self.jit.kernels_dir.cache_clear()


@contextlib.contextmanager
def environment(env: dict):
    """`env` set in os.environ inside the block (the old API's launch-time knobs)."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def recorded(fn, pkg: Package, kernels: dict, env: dict):
    """`fn` with `pkg.jit.get_kernel` answering from `kernels` (filled on a miss) and `env` set
    during the call."""
    jit = pkg.jit
    real = jit.get_kernel

    def get_kernel(source, name, **kw):
        key = (source, name, tuple(sorted(kw.items())))
        if key not in kernels:
            kernels[key] = real(source, name, **kw)
        return kernels[key]

    def run():
        jit.get_kernel = get_kernel
        try:
            with environment(env):
                return fn()
        finally:
            jit.get_kernel = real
    return run


def parse_variant(spec: str, index: int):
    """(label, tree, fwd name, bwd name or None, Package, env) of one --variants entry."""
    label, rest = spec.split("=", 1)
    rest, *env_parts = rest.split("%")
    env = dict(e.split("=", 1) for e in env_parts)
    rest, pkg = rest.split("@", 1) if "@" in rest else (rest, None)
    tree, kernel = rest.rsplit(":", 1)
    fwd_name, bwd_name = kernel.split("/", 1) if "/" in kernel else (kernel, None)
    return label, tree, fwd_name, bwd_name, Package(pkg, f"_ab_pkg_{index}"), env


def make_work(a, pkg: Package, fwd_name: str, bwd_name, q, k, v, do, cu, masks, scale):
    """The timed call of one variant: the forward launcher (and with fwdbwd, the backward)."""
    T = a.T
    if pkg.old:
        tiles = pkg.fwd.as_tiles(tuple(int(x) for x in fwd_name.split(",")) if "," in fwd_name else fwd_name)
        params = inspect.signature(pkg.fwd.stage2_fwd).parameters
        extra = {name: value for name, value in (("split_min", 2 * a.K),
                                                 ("max_seqlen_k", T)) if name in params}
        bwd_tiles = None
        if bwd_name is not None:
            bwd_tiles = tuple(int(x) for x in bwd_name.split(",")) if "," in bwd_name else bwd_name

        def work():
            out, lse = pkg.fwd.stage2_fwd(q, k, v, cu, cu, masks, cu, q.shape[0], 1, T, True, scale, tiles,
                                          **extra)
            if a.mode == "fwdbwd":
                pkg.bwd.stage2_bwd(do, q, k, v, out, lse, cu, cu, masks, cu, q.shape[0], 1, T, T, True, scale,
                                   bwd_tiles)
        return work

    fplan, flaunch = fwd_variant_named(fwd_name, q, k, T, 2 * a.K, pkg.plan)
    if bwd_name is None:
        base = fwd_name.split("+")[0]
        bwd_name = base if base in ("auto", "sm80", "sm90a") else "auto"
    bplan, blaunch = bwd_variant_named(bwd_name, q, k, T, T, pkg.plan)
    print(f"  plans: fwd {fplan}" + (f" {flaunch}" if flaunch else "")
          + (f"\n         bwd {bplan}" + (f" {blaunch}" if blaunch else "") if a.mode == "fwdbwd" else ""),
          flush=True)

    def work():
        out, lse = pkg.fwd.stage2_fwd(q, k, v, cu, cu, masks, cu, q.shape[0], 1, T, True, scale, fplan,
                                      max_seqlen_k=T, **flaunch)
        if a.mode == "fwdbwd":
            pkg.bwd.stage2_bwd(do, q, k, v, out, lse, cu, cu, masks, cu, q.shape[0], 1, T, T, True, scale,
                               bplan, **blaunch)
    return work


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--variants", nargs="+", required=True,
                   help="label=DIR:KERNEL[/BWD][@PKG][%%NAME=VALUE...]; the first is the baseline")
    p.add_argument("--T", type=int, default=32768, help="tokens per sequence")
    p.add_argument("--B", type=int, default=2, help="sequences")
    p.add_argument("--K", type=int, default=64, help="selected 64-key blocks per token")
    p.add_argument("--sel", "--selections", dest="selections", nargs="+", default=["a", "b", "c"],
                   help="selections (a: block-shared, b: per-token, c: InfLLM-like); "
                        "comma-separated lists are accepted too")
    p.add_argument("--mode", default="fwd", choices=["fwd", "fwdbwd"])
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--block", type=int, default=0,
                   help="time blocks of this many calls per variant (after --settle untimed ones), "
                        "not single calls")
    p.add_argument("--settle", type=int, default=2)
    a = p.parse_args(argv)
    a.selections = [s for item in a.selections for s in item.split(",") if s]
    bad = [s for s in a.selections if s not in SELECTIONS]
    if bad:
        p.error(f"--sel: unknown {bad}; choose from {sorted(SELECTIONS)}")
    return a


def main(argv=None) -> None:
    a = parse_args(argv)
    HQ, H, D = 32, 2, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    q, do = (torch.randn(a.B * a.T, HQ, D, device="cuda", dtype=torch.bfloat16,
                         generator=g) for _ in range(2))
    k, v = (torch.randn(a.B * a.T, H, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    cu = uniform_cu_seqlens(a.B, a.T, "cuda")
    scale = D ** -0.5
    variants = [parse_variant(spec, i) for i, spec in enumerate(a.variants)]
    for label, tree, fwd_name, bwd_name, pkg, env in variants:
        print(f"{label}: tree {tree}, {'old API (tiles)' if pkg.old else 'plans'}, fwd {fwd_name}"
              + (f", bwd {bwd_name or 'default'}" if a.mode == "fwdbwd" else "")
              + (f", env {env}" if env else ""))
    print(f"{a.mode}: {'selection':10s} " + " ".join(f"{lb + ' ms':>14s} {'TF/s':>5s}" for lb, *_ in variants)
          + "   " + " ".join(f"{lb}/{variants[0][0]}" for lb, *_ in variants[1:]), flush=True)
    kernels = {label: {} for label, *_ in variants}
    for sel in a.selections:
        topk = make_selection(sel, a.B, a.T, H, a.K, device="cuda", seed=0)
        flop = flops_attn(float(attended_keys(topk, cu).sum()) * (HQ // H), D,
                          "fwd") * (3.5 if a.mode == "fwdbwd"
                                                                                        else 1)
        masks = sparse_fwd.token_block_masks(topk, cu, cu, sparse_fwd.n_mask_words(a.T))
        calls = []
        for label, tree, fwd_name, bwd_name, pkg, env in variants:
            run = recorded(make_work(a, pkg, fwd_name, bwd_name, q, k, v, do, cu, masks, scale), pkg,
                           kernels[label], env)
            with pkg.tree(tree):                # record this tree's kernels (compiles them)
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
