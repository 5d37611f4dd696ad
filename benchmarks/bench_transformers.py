r"""A MiniCPM4-style model in transformers: prefill and decode tokens/s of our backend against SDPA as users
run it, eager against eager and compiled against compiled, with each row's byte floor, in one process.

    python benchmarks/bench_transformers.py --json benchmarks/results/transformers.json   # 1,8 x 16k,64k: 3.5 min, H200
    python benchmarks/bench_transformers.py --batches 1,8 --contexts 16k,64k --rep 1 --new-tokens 32 \
        --impls sdpa_static,sdpa_static_compiled,ours,ours_graphs,ours_compiled   # short: 2.5 min, H200
    python benchmarks/bench_transformers.py --batches 1 --contexts 32k --rep 3 --new-tokens 32 \
        --impls ours,minicpm4,minicpm4_compat        # the MiniCPM4-style layer's two routes against native
    python benchmarks/bench_transformers.py --quick                  # smoke run: 12k, 2 small layers, 8 new tokens
    python benchmarks/bench_transformers.py --device cpu --dtype float32 --contexts 1k --layers 1 --hidden 256 \
        --intermediate 512 --hq 16 --h 2 --d 64 --vocab 128 --dense-len 256 --topk 4 --window 128 --new-tokens 2

The model is a LlamaForCausalLM built in code with random weights (nothing downloaded): README head config
per layer (HQ 32, H 2, D 128, MiniCPM4-8B's), hidden 4096, intermediate 16384, 4 layers by default, bf16,
MiniCPM4's `sparse_config` (topk 64, window 2048, dense_len 8192). Batches --batches (default 1,8) of
equal-length random prompts (no padding), contexts --contexts (default 16k,64k). Implementations (rows):

    sdpa_dynamic          attn_implementation="sdpa" + transformers' DynamicCache, eager (the old baseline:
                          the cache is concatenated every step; no anchor for speed)
    sdpa_static           "sdpa" + StaticCache(config, max_cache_len=N), eager          (the eager anchor)
    sdpa_static_compiled  "sdpa" + StaticCache, decode through torch.compile(model.forward,
                          mode="reduce-overhead") (CUDA graphs; prefill eager, as generate does)
                                                                                          (the compiled anchor)
    ours                  attn_implementation="infllm_cupy" + InfLLMv2Cache(config, max_cache_len=N), eager
    ours_graphs           the same with InfLLMv2Cache(..., decode_graphs=True): each layer's decode attention
                          captured once as a CUDA graph and replayed (skipped with a note where the cache
                          does not take the keyword yet)
    ours_compiled         "infllm_cupy" + InfLLMv2Cache, decode through torch.compile(model.forward,
                          mode="reduce-overhead")
    ours_dynamic          (opt-in) "infllm_cupy" + DynamicCache (decode rebuilds a DecodeCache per step and layer)
    minicpm4              (opt-in) the MiniCPM4-style layer (integrations/minicpm4.py, written against the
                          `infllm_v2` compat API) in every decoder layer, route "fused", + InfLLMv2Cache, eager
    minicpm4_compat       (opt-in) the same layer, route "compat": the original's call sequence (stage-1 score
                          matrix, max_pooling_1d_varlen, torch.topk, varlen attention), each a compat function,
                          as a MiniCPM4 checkpoint's own modeling code runs it. Both against `ours` (native)

Compiled rows: one torch.compile(model.forward, mode="reduce-overhead") per implementation and process
(transformers' own default compile config otherwise), CUDA only (on CPU they are skipped with a note).
Their warm-up takes --compile-warmup-steps (default 3) more steps than --warmup-steps, for compilation and
CUDA-graph recording, and the note gives its wall time, the graph breaks and the CUDA graphs inductor
skipped. ours_graphs takes the same extra warm-up steps (its capture).

Prefill: one eager forward of the whole prompt into an empty cache (`logits_to_keep=1`), CUDA events, after
a warm-up prefill, median of --rep (the allocator's cache is kept between them, emptied between rows).
Decode: greedy steps of one token per sequence with explicit `position_ids` (a device tensor advanced on the
device, so nothing reads a length back to the host) and argmax on the device; after the warm-up steps,
--rep spans of --new-tokens steps are timed, each one CUDA-event span with no host sync in it (the Timer
synchronizes before a span starts); decode tok/s = batch x steps / median span, ms/step = median span / steps.
Eager rows are bound by host work, whose speed varies between spans, hence the median. `torch syncs/step`
counts the synchronizing torch calls of one warm-up step (torch.cuda.set_sync_debug_mode; CuPy's own syncs are
not seen). An event per step (no host sync) finds outliers: a step over 3x the median is named in the note
(e.g. a kernel compiled inside the span), and so is memory a finished row leaves allocated ("left X GiB
allocated": something still holds its tensors).

Byte floor of one decode step = (weight bytes + K/V bytes the step must read) / the device copy bandwidth
(a large device-to-device copy measured in the same run, bytes read + written). Weight bytes: every
parameter but the input embedding table (a step reads B of its rows). K/V, per layer, L = the context:
SDPA rows all cached keys and values (B x L x H x D x 2 tensors); ours rows in the sparse regime
(L >= dense_len) the selected blocks, B x H x min(L, 64 x (topk + window/64 + 1)) x D x 2, plus the
compressed keys stage 1 reads, B x H x (L/16 + L/64) x D; below dense_len the whole cache. `x floor` =
ms/step / floor ms. `vs anchor` = the fair anchor's ms/step over the row's (> 1: the row decodes faster):
ours, ours_graphs and sdpa_dynamic against sdpa_static (eager), ours_compiled against sdpa_static_compiled,
ours_dynamic against sdpa_dynamic, the minicpm4 rows against ours; `prefill vs anchor` likewise for prefill.
Under the table, one line per such row gives both ratios with both rows' times and torch syncs per step.

A row that does not fit (torch.cuda.OutOfMemoryError) frees memory and is recorded as "skipped: out of
memory" (and the larger configs of that row after it); any other failure is recorded as the row's note
(its traceback in the JSON). After a compiled row fails, dynamo and its CUDA-graph trees start afresh
(torch._dynamo.reset(): the next compiled row compiles again), as a failed capture can leave tensors in
the graph pool that make every later compiled row fail.
Our ops' input checks that read device values are off (`_env.override(validate=False)`, as in the other
benchmarks; `--validate` keeps them). One progress line per row as it finishes; the table at the end.
"""  # noqa: E501 - verbatim commands, signatures and tables
from __future__ import annotations

import argparse
import contextlib
import inspect
import itertools
import json
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import _harness as harness  # noqa: E402

IMPLS = ("sdpa_dynamic", "sdpa_static", "sdpa_static_compiled", "ours", "ours_graphs", "ours_compiled",
         "ours_dynamic", "minicpm4", "minicpm4_compat")
MINICPM4_ROUTE = {"minicpm4": "fused", "minicpm4_compat": "compat"}
DEFAULT_IMPLS = tuple(i for i in IMPLS if i != "ours_dynamic" and i not in MINICPM4_ROUTE)
ANCHOR = {"ours": "sdpa_static", "ours_graphs": "sdpa_static", "sdpa_dynamic": "sdpa_static",
          "ours_compiled": "sdpa_static_compiled", "ours_dynamic": "sdpa_dynamic",
          "minicpm4": "ours", "minicpm4_compat": "ours"}
COMPILED = ("sdpa_static_compiled", "ours_compiled")




def build_model(a, dev):
    """The model of the arguments (`harness.build_model`) with room for this script's longest run."""
    return harness.build_model(a, dev, max(a.contexts) + a.new_tokens + a.warmup_steps
                               + a.compile_warmup_steps + 64)


def context_id(T: int) -> str:
    return f"{T // 1024}k" if T % 1024 == 0 else str(T)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--contexts", default=None,
                   help="comma-separated prompt lengths (k = 1024). Default: 16k,64k "
                   "(--quick: 12k)")
    p.add_argument("--batches", default=None, help="comma-separated batch sizes (equal-length prompts). "
                   "Default: 1,8 (--quick: 1)")
    p.add_argument("--impls", default=",".join(DEFAULT_IMPLS),
                   help=f"comma-separated, of {IMPLS}. Default: all but ours_dynamic")
    p.add_argument("--quick", action="store_true", help="smoke run: 12k, batch 1, 2 layers of hidden 1024, "
                   "8 new tokens, 1 rep")
    p.add_argument("--layers", type=int, default=None, help="decoder layers. Default: 4 (--quick: 2)")
    p.add_argument("--hidden", type=int, default=None, help="hidden size. Default: 4096 (--quick: 1024)")
    p.add_argument("--intermediate", type=int, default=None, help="MLP size. Default: 16384 (--quick: 2048)")
    p.add_argument("--vocab", type=int, default=32000)
    harness.add_head_args(p)
    p.add_argument("--dense-len", type=int, default=8192)
    p.add_argument("--topk", type=int, default=64)
    p.add_argument("--window", type=int, default=2048,
                   help="sparse_config window_size (local_blocks = window / 64)")
    p.add_argument("--new-tokens", type=int, default=None,
                   help="timed decode steps. Default: 64 (--quick: 8)")
    p.add_argument("--warmup-steps", type=int, default=3,
                   help="untimed decode steps before the span. Default: 3")
    p.add_argument("--compile-warmup-steps", type=int, default=3,
                   help="extra warm-up steps of the compiled rows and ours_graphs (compilation, CUDA-graph "
                        "recording), at least 3. Default: 3")
    p.add_argument("--rep", type=int, default=None,
                   help="timed prefills, and timed decode spans of --new-tokens steps (median of each). "
                   "Default: 3 (--quick: 1)")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(harness.MODEL_DTYPES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the rows (with GPU, versions, commit) to this file")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--validate", action="store_true",
                   help="keep our ops' input checks that read values back to the host (off by default, as in "
                        "every benchmark here: they add a host sync per op)")
    a = p.parse_args(argv)
    q = a.quick
    try:
        a.contexts = [harness.parse_context(x)
                      for x in (a.contexts or ("12k" if q else "16k,64k")).split(",") if x]
        a.batches = [int(x) for x in (a.batches or ("1" if q else "1,8")).split(",") if x]
    except ValueError as e:
        p.error(f"--contexts / --batches: {e}")
    a.impls = harness.csv_choices(p, "--impls", a.impls, IMPLS)
    a.layers = a.layers or (2 if q else 4)
    a.hidden = a.hidden or (1024 if q else 4096)
    a.intermediate = a.intermediate or (2048 if q else 16384)
    a.new_tokens = a.new_tokens or (8 if q else 64)
    a.rep = a.rep or (1 if q else 3)
    for name in ("layers", "hidden", "intermediate", "vocab", "hq", "h", "d", "new_tokens", "rep"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if not a.contexts or min(a.contexts) < 1 or not a.batches or min(a.batches) < 1:
        p.error("--contexts and --batches must be positive")
    if a.warmup_steps < 0:
        p.error("--warmup-steps must be >= 0")
    if a.compile_warmup_steps < 3:
        p.error("--compile-warmup-steps must be >= 3 (compilation, then CUDA-graph recording)")
    if a.hq % a.h:
        p.error(f"--hq ({a.hq}) must be a multiple of --h ({a.h})")
    return a








class Timer:
    """CUDA events on the current stream (perf_counter on CPU); synchronizes before the start only."""

    def __init__(self, dev):
        self.cuda = dev.type == "cuda"

    def __enter__(self):
        if self.cuda:
            self.s, self.e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            self.s.record()
        else:
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self.e.record()
            self.e.synchronize()
            self.ms = self.s.elapsed_time(self.e)
        else:
            self.ms = (time.perf_counter() - self.t0) * 1e3


class Skip(Exception):
    """A row that cannot run here (recorded as its note, not as a failure)."""


def _short(e: BaseException, n: int = 200) -> str:
    """The exception's type and first line; where it has no message, where it was raised."""
    lines = [x for x in str(e).strip().splitlines() if x.strip()]
    if lines:
        return f"{type(e).__name__}: {lines[0]}"[:n]
    tb = traceback.extract_tb(e.__traceback__)
    return (f"{type(e).__name__} at {Path(tb[-1].filename).name}:{tb[-1].lineno} ({tb[-1].name})" if tb
            else type(e).__name__)[:n]


def is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.cuda.OutOfMemoryError) or "OutOfMemory" in type(e).__name__ or \
        "out of memory" in str(e).lower()[:300]


def make_cache(impl, cfg, max_len):
    from transformers import DynamicCache, StaticCache

    if impl.endswith("dynamic"):
        return DynamicCache()
    if impl.startswith("sdpa"):
        return StaticCache(config=cfg, max_cache_len=max_len)
    from infllm_cupy.integrations.transformers import InfLLMv2Cache

    if impl == "ours_graphs":
        try:
            return InfLLMv2Cache(cfg, max_cache_len=max_len, decode_graphs=True)
        except TypeError as e:
            if "decode_graphs" in str(e):
                raise Skip("skipped: InfLLMv2Cache does not take decode_graphs=True yet") from None
            raise
    return InfLLMv2Cache(cfg, max_cache_len=max_len)


class Bench:
    """The model, the forward's keyword names and the compiled forwards (one per implementation)."""

    def __init__(self, a, dev, model, cfg):
        self.a, self.dev, self.model, self.cfg = a, dev, model, cfg
        params = inspect.signature(model.forward).parameters
        # transformers 5.2x renames past_key_values to cache (the old name warns)
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        self.cache_position = "cache_position" in params      # older transformers index a StaticCache with it
        self.compiled: dict[str, object] = {}
        self.esz = torch.tensor([], dtype=harness.MODEL_DTYPES[a.dtype]).element_size()
        self.native_attn = [layer.self_attn for layer in model.model.layers]
        self.minicpm4: dict[str, list] = {}

    def use_attention_of(self, impl):
        """The decoder layers' attention modules for `impl`: the MiniCPM4-style layer of its route (sharing
        the projections' weights) on the minicpm4 rows, the model's own otherwise."""
        route = MINICPM4_ROUTE.get(impl)
        if route is not None and route not in self.minicpm4:
            from infllm_cupy.integrations.minicpm4 import MiniCPM4SparseAttention

            mods = []
            for i, old in enumerate(self.native_attn):
                new = MiniCPM4SparseAttention(self.cfg, getattr(old, "layer_idx", i), route=route)
                for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                    setattr(new, name, getattr(old, name))
                mods.append(new)
            self.minicpm4[route] = mods
        for layer, mod in zip(self.model.model.layers, self.minicpm4[route] if route else self.native_attn):
            layer.self_attn = mod

    def forward_for(self, impl):
        if impl not in COMPILED:
            return self.model
        if self.dev.type != "cuda":
            raise Skip("skipped: compiled rows need CUDA (reduce-overhead: CUDA graphs)")
        if impl not in self.compiled:
            import torch._dynamo.config as dc
            for name in ("cache_size_limit", "recompile_limit"):     # a silent fall-back to eager would lie
                if hasattr(dc, name):
                    setattr(dc, name, max(64, getattr(dc, name)))
            self.compiled[impl] = torch.compile(self.model.forward, mode="reduce-overhead")
        return self.compiled[impl]

    def run_row(self, impl: str, B: int, T: int, ids, row: dict) -> None:
        from infllm_cupy.integrations.transformers import ATTN_NAME

        a, dev, model = self.a, self.dev, self.model
        compiled = impl in COMPILED
        extra = a.compile_warmup_steps if (compiled or impl == "ours_graphs") else 0
        warm = a.warmup_steps + extra
        max_len = T + warm + a.rep * a.new_tokens + 1
        fwd = self.forward_for(impl)
        self.use_attention_of(impl)
        model.set_attn_implementation("sdpa" if impl.startswith("sdpa") else ATTN_NAME)
        kw = {self.cache_kw: None, "use_cache": True}
        cache = logits = None
        times = []
        for i in range(a.rep + 1):              # the first prefill warms up (kernel compiles, allocator)
            # No empty_cache between prefills (only between rows): emptying it would time cudaMalloc calls,
            # which weigh on whichever path allocates more distinct buffers.
            cache = logits = None
            cache = make_cache(impl, self.cfg, max_len)
            kw[self.cache_kw] = cache
            with Timer(dev) as t:
                logits = model(ids, logits_to_keep=1, **kw).logits
            if i:
                times.append(t.ms)
        row["prefill_ms"] = statistics.median(times)
        row["prefill_tok_s"] = B * T / (row["prefill_ms"] / 1e3)
        tok = logits[:, -1].argmax(-1, keepdim=True)
        logits = None
        row["first_token"] = int(tok[0, 0].item())
        pos = torch.full((B, 1), T, dtype=torch.long, device=dev)
        mark = torch.compiler.cudagraph_mark_step_begin if compiled else (lambda: None)

        def step(tok, pos):
            mark()
            step_kw = dict(kw, position_ids=pos)
            if self.cache_position:
                step_kw["cache_position"] = pos[0]
            out = fwd(input_ids=tok, **step_kw).logits
            return out[:, -1].argmax(-1, keepdim=True), pos + 1

        counters = None
        if compiled:
            from torch._dynamo.utils import counters
            breaks0 = sum(counters["graph_break"].values())
            skips0 = counters["inductor"]["cudagraph_skips"]
        t0 = time.perf_counter()
        for i in range(warm):
            if i == warm - 1 and dev.type == "cuda":
                with warnings.catch_warnings(record=True) as w:
                    warnings.simplefilter("always")
                    torch.cuda.set_sync_debug_mode("warn")
                    try:
                        tok, pos = step(tok, pos)
                    finally:
                        torch.cuda.set_sync_debug_mode("default")
                row["syncs_per_step"] = sum("synchronizing" in str(x.message) for x in w)
            else:
                tok, pos = step(tok, pos)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        notes = []
        if extra:
            notes.append(f"warm-up {time.perf_counter() - t0:.1f} s")
        if counters is not None:
            breaks = sum(counters["graph_break"].values()) - breaks0
            skips = counters["inductor"]["cudagraph_skips"] - skips0
            if breaks:
                notes.append(f"{breaks} graph breaks")
            if skips:
                notes.append(f"{skips} cudagraph skips")
        spans, steps = [], []
        for _ in range(a.rep):                  # --rep spans of --new-tokens steps each, median span
            marks = [torch.cuda.Event(enable_timing=True)
                     for _ in range(a.new_tokens)] if dev.type == "cuda" else []
            with Timer(dev) as t:
                for i in range(a.new_tokens):
                    tok, pos = step(tok, pos)
                    if marks:
                        marks[i].record()           # per-step events (no host sync): outliers only
            spans.append(t.ms)
            if marks:
                steps += [t.s.elapsed_time(marks[0])] + [x.elapsed_time(y)
                                                         for x, y in itertools.pairwise(marks)]
        span = statistics.median(spans)
        row["decode_ms_per_step"] = span / a.new_tokens
        row["decode_tok_s"] = B * a.new_tokens / (span / 1e3)
        if len(spans) > 1:
            row["decode_span_spread"] = max(spans) / min(spans)
            if row["decode_span_spread"] > 1.15:
                notes.append(f"decode spans {min(spans) / a.new_tokens:.2f}-{max(spans) / a.new_tokens:.2f} "
                             "ms/step")
        if steps:
            med = statistics.median(steps)
            row["step_ms_median"], row["step_ms_max"] = med, max(steps)
            if max(steps) > 3 * med:                 # e.g. a kernel compiled inside the span
                notes.append(f"slowest step {max(steps):.1f} ms (median {med:.2f})")
        if notes:
            row["note"] = "; ".join(notes)
        del cache, tok, pos


def finish_floor(row: dict, wbytes: int, kv: int, gbps: float | None) -> None:
    row["weight_gb"], row["kv_gb"] = wbytes / 1e9, kv / 1e9
    if gbps:
        row["floor_ms"] = (wbytes + kv) / (gbps * 1e9) * 1e3
        if row.get("decode_ms_per_step"):
            row["x_floor"] = row["decode_ms_per_step"] / row["floor_ms"]


def add_ratios(rows: list[dict]) -> list[dict]:
    """`vs_anchor` (anchor ms/step over the row's) and `prefill_vs_anchor` on each row with a fair anchor."""
    by = {(r["impl"], r["batch"], r["context"]): r for r in rows if r.get("decode_ms_per_step")}
    out = []
    for r in rows:
        anchor = ANCHOR.get(r["impl"])
        x = by.get((anchor, r["batch"], r["context"]))
        if anchor is None or not r.get("decode_ms_per_step"):
            continue
        r["anchor"] = anchor
        if x is None:
            continue
        r["vs_anchor"] = x["decode_ms_per_step"] / r["decode_ms_per_step"]
        r["prefill_vs_anchor"] = x["prefill_ms"] / r["prefill_ms"]
        out.append({"impl": r["impl"], "anchor": anchor, "batch": r["batch"], "context": r["context"],
                    "decode": r["vs_anchor"], "prefill": r["prefill_vs_anchor"]})
    return out


def ratio_lines(rows: list[dict], ratios: list[dict]) -> list[str]:
    """One line per row with an anchor that ran: its decode and prefill against the anchor's (the anchor's
    time over the row's: the minicpm4 rows as a share of native speed), with both times and, where counted,
    both rows' torch syncs per decode step."""
    by = {(r["impl"], r["batch"], r["context"]): r for r in rows}
    out = []
    for x in ratios:
        r, an = by[(x["impl"], x["batch"], x["context"])], by[(x["anchor"], x["batch"], x["context"])]
        syncs = ""
        if r.get("syncs_per_step") is not None and an.get("syncs_per_step") is not None:
            syncs = f"; torch syncs/step {r['syncs_per_step']} against {an['syncs_per_step']}"
        ms, ms_an = r["decode_ms_per_step"], an["decode_ms_per_step"]
        out.append(f"{x['impl']} / {x['anchor']} {x['batch']}x{context_id(x['context'])}: decode "
                   f"{x['decode']:.2f}x ({ms:.2f} against {ms_an:.2f} ms/step{syncs}), prefill "
                   f"{x['prefill']:.2f}x ({r['prefill_ms']:.1f} against {an['prefill_ms']:.1f} ms)")
    return out


COLUMNS = {"impl": "impl", "batch": "batch", "context": "context", "prefill_ms": "prefill ms",
           "decode_tok_s": "decode tok/s", "decode_ms_per_step": "ms/step", "floor_ms": "floor ms",
           "x_floor": "x floor", "anchor": "anchor", "vs_anchor": "vs anchor",
           "prefill_vs_anchor": "prefill vs anchor", "syncs_per_step": "torch syncs/step", "note": "note"}


def table(rows: list[dict]) -> str:
    recs = [{COLUMNS[k]: (context_id(r[k]) if k == "context" else r.get(k)) for k in COLUMNS} for r in rows]
    return harness.format_table(recs, list(COLUMNS.values()), max_width=90)


def main(argv=None) -> list[dict]:
    a = parse_args(argv)
    dev = torch.device(a.device)
    t0 = time.perf_counter()
    env = harness.env_stamp()
    import transformers

    from infllm_cupy.integrations.transformers import register

    env["transformers"] = transformers.__version__
    harness.print_env(env)
    register()
    fn, nbytes = harness.device_copy(dev)
    copy_ms = statistics.median(harness.bench_gpu_time(fn, warmup=3, rep=20, device=dev))
    del fn
    harness.free_gpu_memory(dev)
    gbps = nbytes / (copy_ms * 1e6)
    model, cfg = build_model(a, dev)
    bench = Bench(a, dev, model, cfg)
    wbytes = harness.weight_bytes(model)
    print(f"copy bandwidth {gbps:.0f} GB/s (read + written); weights a decode step reads {wbytes / 1e9:.3g} "
          f"GB; model forward keyword {bench.cache_kw!r}", flush=True)
    rows: list[dict] = []
    oom: dict[str, list[tuple[int, int]]] = {}
    from infllm_cupy import _env

    configs = [(B, T) for B in a.batches for T in a.contexts]
    with warnings.catch_warnings(), _env.override(validate=a.validate), torch.no_grad():
        warnings.simplefilter("ignore", FutureWarning)     # transformers 5.2x: past_key_values -> cache
        for B, T in configs:
            g = torch.Generator().manual_seed(a.seed + 1)
            ids = torch.randint(0, a.vocab, (B, T), generator=g).to(dev)
            for impl in a.impls:
                row = {"impl": impl, "batch": B, "context": T}
                mem_before = torch.cuda.memory_allocated() / 2**30 if dev.type == "cuda" else 0.0
                failed = False
                small = [(b, t) for b, t in oom.get(impl, []) if b <= B and t <= T]
                try:
                    if small:
                        raise Skip(f"skipped: out of memory ({small[0][0]}x{context_id(small[0][1])} did not "
                                   "fit)")
                    bench.run_row(impl, B, T, ids, row)
                except Skip as e:
                    row["note"] = str(e)
                except Exception as e:  # noqa: BLE001 - a row must never end the run
                    failed = True
                    if is_oom(e):
                        row = {"impl": impl, "batch": B, "context": T, "note": "skipped: out of memory"}
                        oom.setdefault(impl, []).append((B, T))
                    else:
                        row = {"impl": impl, "batch": B, "context": T, "note": f"failed: {_short(e)}",
                               "traceback": "".join(traceback.format_exception(e))[-3000:]}   # in the JSON
                if failed:
                    # outside the except block: the traceback's frames (and their tensors) are gone
                    if dev.type == "cuda":
                        with contextlib.suppress(Exception):
                            torch.cuda.synchronize()
                    if impl in COMPILED:
                        # a failed compiled row can leave CUDA-graph trees in a state where every later
                        # compiled row fails (seen: tensors left in the graph pool); start them afresh
                        with contextlib.suppress(Exception):
                            torch._dynamo.reset()
                        with contextlib.suppress(Exception):
                            from torch._inductor.cudagraph_trees import reset_cudagraph_trees
                            reset_cudagraph_trees()
                        bench.compiled.clear()
                harness.free_gpu_memory(dev)
                finish_floor(row, wbytes, harness.kv_floor_bytes(a, impl, B, T, bench.esz), gbps)
                if dev.type == "cuda":
                    row["mem_after_gib"] = torch.cuda.memory_allocated() / 2**30
                    left = row["mem_after_gib"] - mem_before
                    if left > 0.1:                   # something still holds the row's tensors
                        row["note"] = (row.get("note", "") + "; " if row.get("note") else "") + \
                            f"left {left:.2f} GiB allocated"
                rows.append(row)
                print(progress(row, time.perf_counter() - t0), flush=True)
            del ids
    ratios = add_ratios(rows)
    largest = {}
    for r in rows:
        if r.get("decode_ms_per_step") and r["batch"] * r["context"] >= largest.get(r["impl"], (0, 0, 0))[0]:
            largest[r["impl"]] = (r["batch"] * r["context"], r["batch"], r["context"])
    print(f"\n### transformers LlamaForCausalLM, {a.layers} layers, hidden {a.hidden}, HQ {a.hq} / H {a.h} / "
          f"D {a.d}, {a.dtype}, {a.new_tokens} timed decode steps; sparse_config topk {a.topk}, window "
          f"{a.window}, dense_len {a.dense_len}; copy bandwidth {gbps:.0f} GB/s, weights {wbytes / 1e9:.3g} "
          "GB\n")
    print(table(rows))
    print("\nvs anchor: the fair anchor's ms/step over the row's (> 1: faster than the anchor); "
          "x floor: ms/step over the byte floor")
    for line in ratio_lines(rows, ratios):
        print(line)
    print("largest batch x context that ran: " + (", ".join(
        f"{i} {b}x{context_id(t)}" for i, (_, b, t) in largest.items()) or "none"))
    print(harness.env_line(env, t0), flush=True)
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps({
            "env": env, "argv": sys.argv[1:] if argv is None else list(argv), "copy_gbps": gbps,
            "weight_bytes": wbytes, "ratios": ratios,
            "largest": {i: f"{b}x{context_id(t)}" for i, (_, b, t) in largest.items()},
            "rows": [{**r, **env} for r in rows]}, indent=1))
    return rows


def progress(row: dict, elapsed: float) -> str:
    def f(k, fmt):
        return "-" if row.get(k) is None else format(row[k], fmt)
    head = f"[{elapsed:5.0f} s] {row['impl']:<21} {row['batch']}x{context_id(row['context'])}"
    if row.get("decode_ms_per_step") is None:
        return f"{head}: {row.get('note', '')}"
    return (f"{head}: prefill {f('prefill_ms', '.1f')} ms, decode {f('decode_tok_s', '.1f')} tok/s, "
            f"{f('decode_ms_per_step', '.2f')} ms/step ({f('x_floor', '.1f')} x floor {f('floor_ms', '.2f')} "
            f"ms), torch syncs/step {f('syncs_per_step', 'd')}"
            + (f"; {row['note']}" if row.get("note") else ""))



if __name__ == "__main__":
    main()
