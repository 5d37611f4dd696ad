"""A/B of split-KV decode plan variants (and the kernels of an older tree), interleaved CUDA-graph
replays in one process (development tool; docs/decode.md, sections 3-5).

    mkdir -p /tmp/old && git archive b3c8198 kernels_cu | tar -x -C /tmp/old   # fp32 logits round trip
    python tools/ab_decode.py --old-tree /tmp/old/kernels_cu --variants default

Configs (README head shape: HQ 32, H 2, D 128, bf16, contiguous cache, K = 96 selected blocks in
InfLLM-v2's shape; `--configs`): `BxL_MODE[_W]` for B x L in 1x128k, 8x32k, 8x128k, 64x32k, MODE
sparse or dense, W absent (no weights), `w` (weights per query head) or `wk` (summed per KV head);
the default list is `DEFAULT_CONFIGS`. Variants (`--variants`, `label:FIELD=VALUE+FIELD=VALUE` over
the plan `plan_decode` gives the config, e.g. `mg32:merge_groups=32`, `pdl0:pdl=0`; `default` is the
plan itself): the default list times the merge at a few group counts and without programmatic
dependent launch.
With `--old-tree DIR`, variant `old` launches that tree's kernels with the launch of commit b3c8198
(the split kernel stores fp32 logits, in place in the per-head weights or in an fp32 scratch for
the per-KV-head sum) on the same plan's splits, its positional parameters compiled without this
checkout's layout checks. With `--tree LABEL=DIR` (repeatable), variant LABEL launches the kernels of
DIR (a kernels_cu/ folder whose kernels take the fields that decode/sparse_decode.py declares,
SPLIT_PARAMS, MERGE_PARAMS and WEIGHTS_PARAMS, as arguments or as one struct: a launch hands the
driver each field's address, and a kernel of one struct argument reads all of it from the first; the
layout checks fail the compile of any other) with this checkout's launch and the default plan.
With `--kernel-times`, each variant also runs `--calls` eager calls (no PDL: it applies under
capture only) under the PyTorch profiler and prints its kernels' mean device time per call (split,
merge, weights pass), so that a change in the sum can be placed.

Each variant's call (split, merge and, with weights, the weights pass: one `sparse_decode` step) is
captured `--calls` times in one CUDA graph; each repetition replays every variant's graph once in
rotated order (clock and power drift fall on all alike) and the median per call is reported, with
the ratio to the first variant and the K/V bytes per second. Before timing, every variant's output
(out, lse, weights) is compared with the first variant's: `same bits`, or the largest difference,
and FAIL past fp32-reassociation size (out 2e-2, lse 1e-3, weights 1e-5 absolute; weights are compared
relative to the larger value too, 2e-3, because the fp16 relative probabilities differ from fp32
logits by design: docs/decode.md, 5. Attention weights).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import math
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._harness import capture_graph, random_selection
from infllm_cupy import _env, _jit
from infllm_cupy._launch import CXX_TYPE, Launches, ptr
from infllm_cupy._rules import cdiv

# the package exports a function of that name
SD = importlib.import_module("infllm_cupy.decode.sparse_decode")

SIZES = {"1x128k": (1, 131072), "8x32k": (8, 32768), "8x128k": (8, 131072), "16x32k": (16, 32768),
         "64x32k": (64, 32768)}
WEIGHT_MODES = {"": None, "_w": "per_head", "_wk": "per_kv_head"}
CONFIGS = {f"{size}_{mode}{w}": (B, L, mode == "sparse", wm)     # name: (B, L, sparse, weights mode or None)
           for size, (B, L) in SIZES.items() for mode in ("sparse",
                                                          "dense") for w, wm in WEIGHT_MODES.items()}
DEFAULT_CONFIGS = ["8x32k_sparse", "8x32k_sparse_w", "8x32k_dense", "8x32k_dense_w", "1x128k_sparse"]
DEFAULT_VARIANTS = ["default", "mg2:merge_groups=2",
                    "mg8:merge_groups=8", "mg32:merge_groups=32", "pdl0:pdl=0"]
TOL = {"out": 2e-2, "lse": 1e-3, "weights": 1e-5}


def parse_variant(spec: str):
    """(label, {plan field: value}) of one --variants entry."""
    label, _, rest = spec.partition(":")
    fields = {}
    for part in filter(None, rest.split("+")):
        name, _, val = part.partition("=")
        if name == "pdl":
            fields[name] = val.lower() in ("1", "true", "yes")
        elif name in ("merge_groups", "num_splits", "per_split", "row_tiles"):
            fields[name] = int(val)
        else:
            raise SystemExit(f"--variants {spec!r}: unknown plan field {name!r}")
    return label, fields


def old_call(tree: str, q, cache, topk, plan, weights, scale: float):
    """The launch of commit b3c8198 (the kernels of `tree`): same plan; `weights` None, "per_head" or
    "per_kv_head"."""
    k, v, seqlens = cache
    B, HQ, D = q.shape
    H, width = k.shape[2], k.shape[1]
    G, K = HQ // H, (topk.shape[2] if topk is not None else 0)
    S, dev = plan.num_splits, q.device
    n_o, n_l = B * HQ * S * D, B * HQ * S
    scratch = torch.empty(n_o + n_l + B * HQ, dtype=torch.float32, device=dev)
    o_part, lse_part, lse2 = scratch[:n_o], scratch[n_o:n_o + n_l], scratch[n_o + n_l:]
    out = torch.empty((B, HQ, D), dtype=q.dtype, device=dev)
    lse = torch.empty((B, HQ), dtype=torch.float32, device=dev)
    w_out = logits = None
    if weights:
        w_out = torch.empty((B, HQ if weights == "per_head" else H, width), dtype=torch.float32, device=dev)
        logits = w_out if weights == "per_head" else torch.empty((B, HQ, width), dtype=torch.float32,
                                                                 device=dev)
    null = np.uint64(0)
    run = Launches(dev)
    run.add(SD.SOURCE, f"sparse_decode_split<{CXX_TYPE[q.dtype]}, {D}, {plan.row_tiles}>", (S, H, B),
            (128 * plan.row_tiles,), plan.split_smem_bytes(D, topk is not None, K),
            (ptr(q), ptr(k), ptr(v), ptr(seqlens), null, np.int32(0), np.int32(0), np.int32(width),
             ptr(topk) if topk is not None else null, np.int32(K), np.int32(B), np.int32(H), np.int32(G),
             np.int32(plan.per_split), np.float32(scale * math.log2(math.e)), ptr(o_part), ptr(lse_part),
             ptr(logits) if weights else null, np.int32(width)))
    nt = plan.merge_threads(D)
    run.add(SD.SOURCE, f"sparse_decode_merge<{CXX_TYPE[q.dtype]}, {D}>", (B * HQ,), (nt,), 16 * nt + 4 * S,
            (ptr(o_part), ptr(lse_part), np.int32(S), ptr(out), ptr(lse), ptr(lse2)), pdl=plan.pdl)
    if weights:
        run.add(SD.SOURCE, "sparse_decode_weights", (cdiv(width, SD.WCHUNK), H, B), (SD.WCHUNK // 4,), 0,
                (ptr(logits), ptr(lse2), ptr(seqlens), ptr(topk) if topk is not None else null, np.int32(K),
                 np.int32(B), np.int32(H), np.int32(G), np.int32(width), np.int32(weights == "per_kv_head"),
                 ptr(w_out)), pdl=plan.pdl)
    with positional_tree(tree):
        run.run()
    return (out, lse, w_out) if weights else (out, lse)


@contextlib.contextmanager
def positional_tree(tree: str):
    """Compiles from `tree` without the layout checks of this checkout's parameter structs: the kernels
    of commit b3c8198 take positional parameters, and the checks name structs that tree lacks."""
    checks = _jit._CHECKS.pop(SD.SOURCE, None)
    try:
        with _env.override(kernels_dir=tree):
            yield
    finally:
        if checks is not None:
            _jit._CHECKS[SD.SOURCE] = checks


def kernel_times(fn, calls: int) -> dict[str, float]:
    """{kernel kind: mean device microseconds per call} of `calls` eager calls of `fn`."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for ev in prof.key_averages():
        us = getattr(ev, "device_time_total", None)
        if us is None:
            us = ev.cuda_time_total
        if us <= 0:
            continue
        kind = next((k for k in ("split", "merge", "weights") if f"sparse_decode_{k}" in ev.key), "other")
        out[kind] = out.get(kind, 0.0) + us / calls
    return out


def compare(res, base) -> tuple[str, bool]:
    if all(torch.equal(a, b) for a, b in zip(res, base)):
        return "same bits", True
    parts, ok = [], True
    for name, a, b in zip(("out", "lse", "weights"), res, base):
        fin = torch.isfinite(b) & torch.isfinite(a)
        if not torch.equal(torch.isfinite(a), torch.isfinite(b)):
            parts.append(f"{name} inf pattern differs")
            ok = False
            continue
        d = (a.float()[fin] - b.float()[fin]).abs().max().item() if bool(fin.any()) else 0.0
        good = d <= TOL[name]
        if name == "weights" and not good:      # fp16 relative probabilities: 2^-11 relative by design
            x, y = a.float()[fin], b.float()[fin]
            rel = ((x - y).abs() - 1e-7).clamp_min(0) / torch.maximum(x.abs(), y.abs()).clamp_min(1e-30)
            r = rel.max().item()
            good = r <= 2e-3
            parts.append(f"weights rel {r:.1e}")
        ok &= good
        parts.append(f"{name} {d:.1e}")
    return ", ".join(parts) + ("" if ok else "  FAIL"), ok


def run_config(name: str, a, variants) -> bool:
    B, L, sparse, weights = CONFIGS[name]
    HQ, H, D, dtype = 32, 2, 128, torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(0)
    k = torch.randn(B, L, H, D, generator=g, device="cuda", dtype=dtype)
    v = torch.randn(B, L, H, D, generator=g, device="cuda", dtype=dtype)
    seqlens = torch.full((B,), L, dtype=torch.int32, device="cuda")
    q = torch.randn(B, HQ, D, generator=g, device="cuda", dtype=dtype)
    cache = (k, v, seqlens)
    topk = random_selection(B, H, L, a.topk, a.local_blocks, "cuda", g) if sparse else None
    n_entries = topk.shape[2] if sparse else cdiv(L, 64)
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    base_plan = SD.plan_decode(B, H, HQ // H, n_entries, sms)
    kv_bytes = 2 * B * H * D * 2 * (n_entries * 64 if sparse else L)
    scale = D ** -0.5

    calls = []
    for label, fields in variants:
        if label in a.trees:
            tree = a.trees[label]
            plan = dataclasses.replace(base_plan, **fields)

            def fn(plan=plan, tree=tree):
                with _env.override(kernels_dir=tree):
                    return SD.sparse_decode(q, cache, topk, return_lse=True,
                                            return_attn_weights=weights is not None,
                                            weights=weights or "per_head", plan=plan)
            desc = f"kernels of {tree}, S {plan.num_splits} x {plan.per_split}"
        elif label == "old":
            def fn(plan=dataclasses.replace(base_plan, **fields)):  # noqa: B008 - bound per variant
                return old_call(a.old_tree, q, cache, topk, plan, weights, scale)
            desc = f"old kernels ({a.old_tree}), {base_plan.num_splits} splits"
        else:
            plan = dataclasses.replace(base_plan, **fields)
            if "num_splits" not in fields and "per_split" in fields:
                plan = dataclasses.replace(plan, num_splits=cdiv(n_entries, plan.per_split))
            def fn(plan=plan):
                return SD.sparse_decode(q, cache, topk, return_lse=True,
                                        return_attn_weights=weights is not None,
                                        weights=weights or "per_head", plan=plan)
            desc = (f"S {plan.num_splits} x {plan.per_split}, merge "
                    f"{plan.merge_threads(D)} threads, pdl {plan.pdl}")
        calls.append((label, fn, desc))
    print(f"\n{name}: B {B} L {L} "
          f"{'K ' + str(n_entries) if sparse else 'dense'}{' + weights ' + weights if weights else ''}, "
          f"{kv_bytes / 1e6:.1f} MB of K/V", flush=True)
    ok = True
    base = None
    for label, fn, desc in calls:
        res = fn()
        torch.cuda.synchronize()
        if base is None:
            base, note = res, "reference"
        else:
            note, good = compare(res, base)
            ok &= good
        print(f"  {label:10s} {desc:60s} {note}", flush=True)
    graphs = [(label, capture_graph(fn, a.calls, warmup=1)) for label, fn, _ in calls]
    torch.cuda.synchronize()
    times = {label: [] for label, _ in graphs}
    for rep in range(a.reps):
        r = rep % len(graphs)
        for label, graph in graphs[r:] + graphs[:r]:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            graph.replay()
            e1.record()
            times[label].append((e0, e1))
    torch.cuda.synchronize()
    med = {lb: statistics.median(e0.elapsed_time(e1) * 1e3 / a.calls for e0, e1 in ev)
           for lb, ev in times.items()}
    first = med[graphs[0][0]]
    for label, _ in graphs:
        print(f"  {label:10s} {med[label]:9.2f} us  {first / med[label]:.3f}x of {graphs[0][0]}  "
              f"{kv_bytes / med[label] / 1e6:7.0f} GB/s K/V", flush=True)
    if a.kernel_times:
        for label, fn, _ in calls:
            kt = kernel_times(fn, a.calls)
            print(f"  {label:10s} eager kernels: " + ", ".join(f"{k} {v:.2f}" for k, v in kt.items())
                  + f", sum {sum(kt.values()):.2f} us", flush=True)
    return ok


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS, choices=list(CONFIGS),
                   help="BxL_MODE[_w|_wk]")
    p.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS)
    p.add_argument("--old-tree", default=None,
                   help="a kernels_cu/ folder of commit b3c8198 (git archive): adds variant `old`")
    p.add_argument("--tree", action="append", default=[], metavar="LABEL=DIR",
                   help="variant LABEL: the kernels of DIR (a kernels_cu/ folder) with this checkout's "
                        "launch")
    p.add_argument("--kernel-times", action="store_true",
                   help="per-kernel eager device times (PyTorch profiler)")
    p.add_argument("--topk", type=int, default=64)
    p.add_argument("--local-blocks", type=int, default=32)
    p.add_argument("--calls", type=int, default=20, help="calls per graph replay")
    p.add_argument("--reps", type=int, default=60, help="replays per variant")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    variants = [parse_variant(s) for s in a.variants]
    if a.old_tree:
        if not (Path(a.old_tree) / "decode" / "sparse_decode.cu").is_file():
            raise SystemExit(f"--old-tree {a.old_tree}: no decode/sparse_decode.cu there")
        variants.insert(0, ("old", {}))
    a.trees = {}
    for spec in a.tree:
        label, sep, tree = spec.partition("=")
        if not sep or not label or label in ("old", "default") or label in a.trees:
            raise SystemExit(f"--tree {spec!r}: expected LABEL=DIR with a new label")
        if not (Path(tree) / "decode" / "sparse_decode.cu").is_file():
            raise SystemExit(f"--tree {spec!r}: no decode/sparse_decode.cu under {tree}")
        a.trees[label] = tree
    variants[1 if a.old_tree else 0:1 if a.old_tree else 0] = [(label, {}) for label in a.trees]
    results = [run_config(c, a, variants) for c in a.configs]   # every config runs, failed or not
    ok = all(results)
    print("\nall outputs agree" if ok else "\nSOME OUTPUTS DIFFER (FAIL above)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
