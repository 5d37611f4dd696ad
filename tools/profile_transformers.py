r"""Where the time of a transformers prefill (or decode) goes: ours against SDPA, under torch.profiler.

    python tools/profile_transformers.py --context 16k                   # H100: about 1 min (model build, compiles)
    python tools/profile_transformers.py --context 16k --phase decode --impls ours,ours_dynamic
    python tools/profile_transformers.py --device cpu --dtype float32 --context 1k --layers 1 --hidden 256 \
        --intermediate 512 --hq 16 --h 2 --d 64 --vocab 128 --dense-len 256 --topk 4 --window 128

Builds benchmarks/bench_transformers.py's model (same flags, forwarded: --layers, --hidden, --dense-len,
...; README head config, MiniCPM4 sparse_config, bf16, batch 1). Per implementation (`sdpa_static`, `ours` =
InfLLMv2Cache, `ours_dynamic` = DynamicCache): one warm-up run (kernel compiles), one run under
torch.profiler, one run under `torch.cuda.set_sync_debug_mode("warn")` to count host syncs. A run is a
prefill of the prompt into a fresh cache (`--phase prefill`) or, after a prefill, `--steps` decode
steps (`--phase decode`). Our ops' value checks are off, as in the benchmark (`--validate` keeps them).

Printed per implementation (under 40 lines):
  * wall ms of the profiled run (with the profiler's overhead: compare impls, not with the benchmark),
    total kernel time (sum of kernel durations) and `idle` = wall - kernel time (launch gaps, host
    syncs and host work the GPU waited for; streams do not overlap here);
  * kernel time by group: gemm, sdpa/flash, ours (InfLLM-v2 CUDA kernels: compression, stage 1, masks,
    stage 2, decode), copy/cat/index (layout conversions and cache writes), other elementwise;
  * the top kernels by total time (calls, ms, share);
  * CUDA runtime calls that block or allocate (cudaStreamSynchronize, cudaMemcpy*, cudaMalloc, ...):
    count and host ms, from the profiler (they include CuPy's);
  * host syncs torch reports (`set_sync_debug_mode`), by the Python line that caused them
    (torch-issued syncs only: a CuPy-side sync shows in the runtime-call counts instead).
On CPU the tables show CPU ops by self CPU time instead, and the sync counts are skipped.
"""  # noqa: E501 - verbatim commands, signatures and tables
from __future__ import annotations

import argparse
import collections
import sys
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import bench_transformers as bt  # noqa: E402

PHASES = ("prefill", "decode")
# Kernel groups by name fragment, first match wins (lower-cased names).
GROUPS = (
    ("ours", ("compress_mean_pool", "stage1_select", "stage2_fwd", "stage2_bwd", "token_block_masks",
              "select_decode", "sparse_decode")),
    ("sdpa/flash", ("flash", "fmha", "attention", "cudnn", "efficient")),
    ("gemm", ("gemm", "nvjet", "sm90_xmma", "cutlass", "cublas", "splitk")),
    ("copy/cat/index", ("copy", "cat", "index", "gather", "scatter", "fill", "memset", "memcpy")),
)
RUNTIME_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpyAsync",
                 "cudaMemcpy", "cudaMalloc", "cudaFree", "cudaHostAlloc", "cuMemAlloc", "cuMemFree",
                 "cuStreamSynchronize", "cuCtxSynchronize")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)      # "--h" (KV heads) is bench_transformers', not --help
    p.add_argument("--context", default="16k", help="prompt length (k = 1024). Default: 16k")
    p.add_argument("--impls", default="sdpa_static,ours", help=f"comma-separated, of {bt.IMPLS}. Default: "
                   "sdpa_static,ours")
    p.add_argument("--phase", default="prefill", choices=PHASES)
    p.add_argument("--steps", type=int, default=8, help="decode steps per run (--phase decode). Default: 8")
    p.add_argument("--top", type=int, default=15, help="kernels listed per impl. Default: 15")
    p.add_argument("--no-sync-count", action="store_true", help="skip the sync-debug run")
    a, rest = p.parse_known_args(argv)
    if a.steps < 1 or a.top < 1:
        p.error("--steps and --top must be >= 1")
    # everything else is bench_transformers' (model shape, dtype, device, --validate)
    m = bt.parse_args(["--contexts", a.context, "--impls", a.impls, "--new-tokens", str(a.steps), "--rep",
                       "1", *rest])
    return a, m


def _group(name: str) -> str:
    n = name.lower()
    for group, parts in GROUPS:
        if any(x in n for x in parts):
            return group
    return "other"


def _short(name: str, width: int = 78) -> str:
    return name if len(name) <= width else name[:width - 3] + "..."


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _runner(m, model, cfg, impl, ids, phase, steps):
    """A callable doing one run (a fresh cache each time; decode runs prefill first, untimed)."""
    T = ids.shape[1]
    max_len = T + 2 * steps + 8

    def prefill():
        cache = bt.make_cache(impl, cfg, max_len)
        logits = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
        return cache, logits[:, -1].argmax(-1, keepdim=True)

    if phase == "prefill":
        return lambda: prefill(), None

    state = {}

    def setup():                                    # outside the profiled span
        state["cache"], state["tok"] = prefill()

    def decode():
        tok, cache = state["tok"], state["cache"]
        for _ in range(steps):
            tok = model(tok, past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
        return tok

    return decode, setup


def _kernel_rows(prof, on_cuda):
    """[(name, calls, total_us)] of kernels (CUDA) or of CPU ops by self time (CPU)."""
    rows = []
    for e in prof.key_averages():
        if on_cuda:
            if e.device_type != torch.autograd.DeviceType.CUDA:
                continue
            us = e.self_device_time_total
        else:
            us = e.self_cpu_time_total
        if us > 0:
            rows.append((e.key, e.count, us))
    return sorted(rows, key=lambda r: -r[2])


def _runtime_rows(prof):
    out = {}
    for e in prof.key_averages():
        if e.key in RUNTIME_CALLS and e.device_type == torch.autograd.DeviceType.CPU:
            out[e.key] = (e.count, e.cpu_time_total)
    return out


def _count_syncs(fn, setup):
    """Host syncs torch reports during fn(), by the Python line (file:line) that caused them."""
    if setup is not None:
        setup()
    torch.cuda.synchronize()
    sites = collections.Counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for w in caught:
        if "synchroniz" in str(w.message).lower():
            f = Path(w.filename)
            try:
                f = f.relative_to(ROOT)
            except ValueError:
                f = Path(*f.parts[-2:])
            sites[f"{f}:{w.lineno}"] += 1
    torch.cuda.synchronize()
    return sites


def profile_impl(a, m, model, cfg, impl, ids, dev) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from infllm_cupy.integrations.transformers import ATTN_NAME

    model.set_attn_implementation("sdpa" if impl.startswith("sdpa") else ATTN_NAME)
    on_cuda = dev.type == "cuda"
    fn, setup = _runner(m, model, cfg, impl, ids, a.phase, a.steps)
    with torch.no_grad():
        if setup is not None:
            setup()
        fn()                                        # warm-up: compiles, allocator
        if setup is not None:
            setup()
        _sync(dev)
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
        with profile(activities=acts) as prof:
            t0 = time.perf_counter()
            fn()
            _sync(dev)
            wall_ms = (time.perf_counter() - t0) * 1e3
        sites = _count_syncs(fn, setup) if on_cuda and not a.no_sync_count else None
    return {"impl": impl, "wall_ms": wall_ms, "kernels": _kernel_rows(prof, on_cuda),
            "runtime": _runtime_rows(prof) if on_cuda else {}, "sites": sites}


def report(a, r, on_cuda, n_tokens) -> list[str]:
    what = "kernel" if on_cuda else "CPU op (self CPU time)"
    total = sum(us for _, _, us in r["kernels"]) / 1e3
    lines = [f"== {r['impl']}: {a.phase}, {n_tokens} token(s) ==",
             f"wall {r['wall_ms']:.2f} ms (profiled)   {what} time {total:.2f} ms"
             + (f"   idle (wall - kernel) {r['wall_ms'] - total:.2f} ms" if on_cuda else "")]
    if on_cuda:
        groups = collections.Counter()
        for name, _, us in r["kernels"]:
            groups[_group(name)] += us / 1e3
        lines.append("by group (ms): " + ", ".join(f"{g} {ms:.2f}" for g, ms in groups.most_common()))
    lines.append(f"{'calls':>6} {'ms':>9} {'share':>6}  {what}")
    for name, calls, us in r["kernels"][:a.top]:
        lines.append(f"{calls:>6} {us / 1e3:>9.3f} {100 * us / 1e3 / max(total, 1e-9):>5.1f}%  "
                     f"{_short(name)}")
    if on_cuda:
        rt = r["runtime"]
        lines.append("runtime calls (count, host ms): " + (", ".join(
            f"{k} {n} / {us / 1e3:.2f}" for k, (n, us) in sorted(rt.items())) or "none recorded"))
        if r["sites"] is not None:
            n = sum(r["sites"].values())
            lines.append(f"host syncs torch reports (set_sync_debug_mode): {n}"
                         + (" at:" if n else ""))
            for site, c in r["sites"].most_common(8):
                lines.append(f"    {c:>4}  {site}")
    return lines


def main(argv=None) -> list[dict]:
    a, m = parse_args(argv)
    dev = torch.device(m.device)
    from infllm_cupy import _env
    from infllm_cupy.integrations.transformers import register

    register()
    model, cfg = bt.build_model(m, dev)
    T = m.contexts[0]
    ids = torch.randint(0, m.vocab, (1, T), generator=torch.Generator().manual_seed(m.seed + 1)).to(dev)
    print(f"### profile_transformers: {a.phase} at context {T}, {m.layers} layers, hidden {m.hidden}, "
          f"HQ {m.hq} / H {m.h} / D {m.d}, {m.dtype}, batch 1, topk {m.topk}, window {m.window}, "
          f"dense_len {m.dense_len}, device "
          f"{torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'cpu'}, "
          f"torch {torch.__version__}")
    results = []
    with warnings.catch_warnings(), _env.override(validate=m.validate):
        warnings.simplefilter("ignore", FutureWarning)
        for impl in m.impls:
            r = profile_impl(a, m, model, cfg, impl, ids, dev)
            results.append(r)
            print("\n".join(report(a, r, dev.type == "cuda", T if a.phase == "prefill" else a.steps)),
                  flush=True)
            print()
    if len(results) > 1:
        base = results[0]
        print("wall ms vs " + base["impl"] + ": " + ", ".join(
            f"{r['impl']} {r['wall_ms']:.2f} ({r['wall_ms'] / base['wall_ms']:.2f}x)" for r in results))
    return results


if __name__ == "__main__":
    main()
