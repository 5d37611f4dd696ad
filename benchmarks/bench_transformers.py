r"""A MiniCPM4-style model in transformers: prefill and decode tokens/s with our backend against SDPA, in one process.

    python benchmarks/bench_transformers.py                          # 16k and 64k, 4 layers (about 2 min, H100)
    python benchmarks/bench_transformers.py --quick                  # smoke run: 12k, 2 small layers, 8 new tokens
    python benchmarks/bench_transformers.py --device cpu --dtype float32 --contexts 1k --layers 1 --hidden 256 \
        --intermediate 512 --hq 16 --h 2 --d 64 --vocab 128 --dense-len 256 --topk 4 --window 128 --new-tokens 2

The model is a LlamaForCausalLM built in code with random weights (nothing downloaded): README head config
per layer (HQ 32, H 2, D 128, MiniCPM4-8B's), hidden 4096, intermediate 16384, 4 layers by default, bf16,
MiniCPM4's `sparse_config` (topk 64, window 2048, dense_len 8192). Batch 1. Implementations (rows):

    sdpa            attn_implementation="sdpa" with HF's DynamicCache (the default setup)
    ours            attn_implementation="infllm_cupy" with InfLLMv2Cache (prefill: the InfLLM-v2 pipeline on the
                    kernels; decode: infllmv2_decode on the cache's compressed keys)
    ours_dynamic    attn_implementation="infllm_cupy" with HF's DynamicCache (decode rebuilds a DecodeCache per
                    step and layer; shows what InfLLMv2Cache saves)

Prefill: one forward of the whole prompt into an empty cache (`logits_to_keep=1`), CUDA events, after a
warm-up prefill, median of --rep (the allocator's cache is kept between them, emptied between implementations). Decode: after the prefill, --warmup-steps untimed steps, then --new-tokens
greedy steps (model forward of one token, argmax on the device, no host sync in the loop) timed as one
CUDA-event span: tokens/s = new tokens / span. Ratios ours / sdpa are printed per context. Our ops' input
checks that read device values are off (`_env.override(validate=False)`, as in the other benchmarks;
`--validate` keeps them).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._harness import csv_choices, env_line, env_stamp, format_table, free_gpu_memory  # noqa: E402

IMPLS = ("sdpa", "ours", "ours_dynamic")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def parse_context(text: str) -> int:
    t = text.strip().lower()
    return int(float(t[:-1]) * 1024) if t.endswith("k") else int(t)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", default=None, help="comma-separated prompt lengths (k = 1024). Default: 16k,64k "
                   "(--quick: 12k)")
    p.add_argument("--impls", default=",".join(IMPLS), help=f"comma-separated, of {IMPLS}. Default: all")
    p.add_argument("--quick", action="store_true", help="smoke run: 12k, 2 layers of hidden 1024, 8 new tokens, 1 rep")
    p.add_argument("--layers", type=int, default=None, help="decoder layers. Default: 4 (--quick: 2)")
    p.add_argument("--hidden", type=int, default=None, help="hidden size. Default: 4096 (--quick: 1024)")
    p.add_argument("--intermediate", type=int, default=None, help="MLP size. Default: 16384 (--quick: 2048)")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--hq", type=int, default=32)
    p.add_argument("--h", type=int, default=2)
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--dense-len", type=int, default=8192)
    p.add_argument("--topk", type=int, default=64)
    p.add_argument("--window", type=int, default=2048, help="sparse_config window_size (local_blocks = window / 64)")
    p.add_argument("--new-tokens", type=int, default=None, help="timed decode steps. Default: 64 (--quick: 8)")
    p.add_argument("--warmup-steps", type=int, default=3)
    p.add_argument("--rep", type=int, default=None, help="timed prefills (median). Default: 3 (--quick: 1)")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the rows (with GPU, versions, commit) to this file")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--validate", action="store_true",
                   help="keep our ops' input checks that read values back to the host (off by default, as in "
                        "every benchmark here: they add a host sync per op)")
    a = p.parse_args(argv)
    q = a.quick
    a.contexts = [parse_context(x) for x in (a.contexts or ("12k" if q else "16k,64k")).split(",") if x]
    a.impls = csv_choices(p, "--impls", a.impls, IMPLS)
    a.layers = a.layers or (2 if q else 4)
    a.hidden = a.hidden or (1024 if q else 4096)
    a.intermediate = a.intermediate or (2048 if q else 16384)
    a.new_tokens = a.new_tokens or (8 if q else 64)
    a.rep = a.rep or (1 if q else 3)
    for name in ("layers", "hidden", "intermediate", "vocab", "hq", "h", "d", "new_tokens", "rep"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if a.hq % a.h:
        p.error(f"--hq ({a.hq}) must be a multiple of --h ({a.h})")
    return a


def build_model(a, dev):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate,
                      num_hidden_layers=a.layers, num_attention_heads=a.hq, num_key_value_heads=a.h, head_dim=a.d,
                      max_position_embeddings=max(a.contexts) + a.new_tokens + a.warmup_steps + 64,
                      initializer_range=0.02)
    cfg.sparse_config = dict(kernel_size=32, kernel_stride=16, init_blocks=1, block_size=64, window_size=a.window,
                             topk=a.topk, use_nope=False, dense_len=a.dense_len)
    torch.manual_seed(a.seed)
    old = torch.get_default_dtype()
    torch.set_default_dtype(DTYPES[a.dtype])        # build the weights in the run's dtype, on the device
    try:
        with torch.device(dev):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    return model.eval(), cfg


class Timer:
    """CUDA events on the current stream (perf_counter on CPU)."""

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


def make_cache(impl, cfg, max_len):
    from transformers import DynamicCache

    from infllm_cupy.integrations.transformers import InfLLMv2Cache

    return InfLLMv2Cache(cfg, max_cache_len=max_len) if impl == "ours" else DynamicCache()


def bench_impl(a, model, cfg, impl, ids, dev) -> dict:
    from infllm_cupy.integrations.transformers import ATTN_NAME

    model.set_attn_implementation("sdpa" if impl == "sdpa" else ATTN_NAME)
    T = ids.shape[1]
    max_len = T + a.warmup_steps + a.new_tokens + 1
    row = {"impl": impl, "context": T}
    with torch.no_grad():
        times, cache, logits = [], None, None
        for i in range(a.rep + 1):                   # the first prefill warms up (kernel compiles, allocator)
            # No empty_cache between prefills (only between implementations): emptying it would time
            # cudaMalloc calls, which weigh on whichever path allocates more distinct buffers.
            cache = None
            cache = make_cache(impl, cfg, max_len)
            with Timer(dev) as t:
                logits = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
            if i:
                times.append(t.ms)
        row["prefill_ms"] = statistics.median(times)
        row["prefill_tok_s"] = T / (row["prefill_ms"] / 1e3)
        tok = logits[:, -1].argmax(-1, keepdim=True)
        row["first_token"] = int(tok.item())

        def step(tok):
            out = model(tok, past_key_values=cache, use_cache=True).logits
            return out[:, -1].argmax(-1, keepdim=True)

        for _ in range(a.warmup_steps):
            tok = step(tok)
        with Timer(dev) as t:
            for _ in range(a.new_tokens):
                tok = step(tok)
        row["decode_ms_per_token"] = t.ms / a.new_tokens
        row["decode_tok_s"] = a.new_tokens / (t.ms / 1e3)
    del cache
    free_gpu_memory(dev)
    return row


def main(argv=None) -> list[dict]:
    a = parse_args(argv)
    dev = torch.device(a.device)
    t0 = time.perf_counter()
    env = env_stamp()
    import transformers

    from infllm_cupy.integrations.transformers import register

    env["transformers"] = transformers.__version__
    print("env: " + ", ".join(f"{k}={v}" for k, v in env.items()), flush=True)
    register()
    model, cfg = build_model(a, dev)
    rows = []
    g = torch.Generator().manual_seed(a.seed + 1)
    from infllm_cupy import _env

    with warnings.catch_warnings(), _env.override(validate=a.validate):
        warnings.simplefilter("ignore", FutureWarning)     # transformers 5.2x: past_key_values -> cache
        for T in a.contexts:
            ids = torch.randint(0, a.vocab, (1, T), generator=g).to(dev)
            for impl in a.impls:
                try:
                    rows.append(bench_impl(a, model, cfg, impl, ids, dev))
                except Exception as e:  # noqa: BLE001 - e.g. OOM: record it, go on
                    rows.append({"impl": impl, "context": T, "note": f"failed: {type(e).__name__}: {str(e)[:200]}"})
                    free_gpu_memory(dev)
                print(format_table(rows[-1:], list(rows[-1])), flush=True)
    ratios = []
    for T in a.contexts:
        by = {r["impl"]: r for r in rows if r["context"] == T and "prefill_tok_s" in r}
        for impl in ("ours", "ours_dynamic"):
            if impl in by and "sdpa" in by:
                ratios.append({"context": T, "impl": f"{impl} / sdpa",
                               "prefill": by[impl]["prefill_tok_s"] / by["sdpa"]["prefill_tok_s"],
                               "decode": by[impl]["decode_tok_s"] / by["sdpa"]["decode_tok_s"]})
    cols = ["impl", "context", "prefill_ms", "prefill_tok_s", "decode_ms_per_token", "decode_tok_s", "note"]
    print(f"\n### transformers LlamaForCausalLM, {a.layers} layers, hidden {a.hidden}, HQ {a.hq} / H {a.h} / D {a.d}, "
          f"{a.dtype}, batch 1, {a.new_tokens} new tokens; sparse_config topk {a.topk}, window {a.window}, "
          f"dense_len {a.dense_len}\n")
    print(format_table(rows, cols))
    print("\n### ratios of tokens/s (ours / sdpa; > 1: ours faster)\n")
    print(format_table(ratios, ["context", "impl", "prefill", "decode"]) if ratios else "(no ratio computable)")
    print(env_line(env, t0), flush=True)
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps({"env": env, "argv": sys.argv[1:] if argv is None else list(argv),
                                            "ratios": ratios, "rows": [{**r, **env} for r in rows]}, indent=1))
    return rows


if __name__ == "__main__":
    main()
