r"""A MiniCPM4-8B-shaped model in transformers at model scale: time to first token and decode ms/step of our
backend on its 16-bit and 8-bit stage-2 plans against SDPA with a StaticCache, the prefill's time split by
kernel family, and the decode byte floor, in one process.

    python benchmarks/bench_model.py --context 128k --batch 1 --layers 32 --json benchmarks/results/model.json
    python benchmarks/bench_model.py --context 32k --layers 4 --precision 16bit,int8-fp8
    python benchmarks/bench_model.py --device cpu --dtype float32 --context 1k --layers 1 --hidden 256 \
        --intermediate 512 --hq 16 --h 2 --d 64 --vocab 128 --dense-len 256 --topk 4 --window 128 \
        --new-tokens 2

The model: LlamaForCausalLM built in code with random weights (nothing downloaded), MiniCPM4-8B's shape by
default (32 layers, hidden 4096, MLP 16384, HQ 32 / H 2 / D 128, vocab 73448; --layers, --hidden, ... to
shrink it), bf16, MiniCPM4's sparse_config (topk 64, window 2048, dense_len 8192). One batch of --batch
equal-length random prompts of --context tokens. Rows:

    sdpa_static        attn_implementation="sdpa" + StaticCache (the anchor users run)
    ours:<precision>   attn_implementation="infllm_cupy" + InfLLMv2Cache, stage 2 on the plan <precision>
                       (--precision: "16bit", "int8-fp8"; docs/stage2_q8.md); a plan that cannot run here
                       (int8-fp8 on CUDA tensors until its kernels are verified) is recorded with its error

Time to first token (`ttft_ms`): one forward of the whole prompt into an empty cache (`logits_to_keep=1`),
after a warm-up prefill, median of --rep. Decode (`decode_ms_per_step`): greedy one-token steps through
torch.compile(model.forward, mode="reduce-overhead") on CUDA (CUDA graphs; eager on CPU, noted), after
--warmup-steps, median of --rep spans of --new-tokens steps.

Split (`split_ms`): one more prefill under torch.profiler, its time summed per family: GEMM, compression,
stage 1, stage 2, dense attention, elementwise, other (`FAMILIES`). On CUDA by device kernel name (ours by
their kernels_cu names). On CPU by the aten ops' self time, each op in the family of the prefill stage it
ran under (the pipeline's stages run inside `record_function` scopes named for their family, opened by
this script around prefill.py's `run_*` stages), else by its own name, profiled on one thread (stage 2's
CPU path otherwise runs its chunks on threads outside the scopes); the keys an InfLLMv2Cache compresses
as it appends them count as elementwise there. `other_kernels` names what no family claims, so none
hides there.

Byte floor of one decode step: (weight bytes + K/V bytes the step must read) / the device copy bandwidth
measured in the same run. K/V per layer: SDPA and ours below dense_len the whole cache; ours in the sparse
regime the selected blocks, B H min(L, 64 (topk + window / 64 + 1)) D 2, plus the compressed keys stage 1
reads, B H (L / 16 + L / 64) D. The 8-bit plan leaves decode in 16 bits (same floor).
"""
from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import _harness as harness  # noqa: E402

PRECISIONS = ("16bit", "int8-fp8")
ATTN_Q8 = "infllm_cupy_int8_fp8"          # our backend registered with precision="int8-fp8"

# (family, pattern on the lower-cased kernel or op name), first match wins: our kernels by their
# kernels_cu names, then the dense attention kernels, then GEMMs, then elementwise and reductions
FAMILIES = (
    ("compression", r"mean_pool|compress"),
    ("stage 1", r"stage1|select_sm90|select_kernel|merge_cand|select_decode"),
    ("stage 2", r"stage2_|token_block_masks|q8_fwd|q8_quantize|q8_kv_stats"),
    ("dense attention", r"flash|fmha|cudnn|scaled_dot_product|_efficient_attention|attention"),
    ("GEMM", r"gemm|gemv|cutlass|xmma|nvjet|wgmma|aten::mm$|aten::addmm|aten::bmm|aten::matmul|aten::linear"
             r"|aten::baddbmm|aten::einsum"),
    ("elementwise", r"elementwise|vectorized|reduce|copy|cat|fill|index|gather|scatter|add|mul|div|sub|exp|"
                    r"silu|rsqrt|pow|mean|neg|where|embedding|arange|clamp|sort|topk|cumsum|masked|max|"
                    r"min|sum|softmax|round|log|abs|cos|sin|view|reshape|empty|zero|ones|full|lt|gt|eq|"
                    r"ge|le|ne|any|all|bitwise|logical|argmax|select|slice|unsqueeze|expand|permute|"
                    r"transpose|contiguous|clone|stack|split|chunk|narrow|repeat|flip|unique|nonzero|item"),
)
FAMILY_NAMES = tuple(f for f, _ in FAMILIES) + ("other",)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=tuple(harness.MODEL_DTYPES))
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--context", type=harness.parse_context, default=harness.parse_context("128k"))
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--precision", default="16bit,int8-fp8", help="our rows' stage-2 plans, comma-separated")
    p.add_argument("--no-sdpa", action="store_true", help="skip the SDPA + StaticCache row")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=16384)
    p.add_argument("--hq", type=int, default=32)
    p.add_argument("--h", type=int, default=2)
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--vocab", type=int, default=73448)
    p.add_argument("--topk", type=int, default=64)
    p.add_argument("--window", type=int, default=2048)
    p.add_argument("--dense-len", type=int, default=8192)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--warmup-steps", type=int, default=3)
    p.add_argument("--rep", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    a.precisions = harness.csv_choices(p, "--precision", a.precision, PRECISIONS)
    for name in ("layers", "context", "batch", "new_tokens", "rep"):
        if getattr(a, name) < 1:
            p.error(f"argument --{name.replace('_', '-')}: must be at least 1")
    return a


def family_of(name: str) -> str:
    n = name.lower()
    for fam, pat in FAMILIES:
        if re.search(pat, n):
            return fam
    return "other"


# prefill.py's stages and the family of the time spent under each (the CPU split's scopes)
STAGE_SCOPES = {"run_compress": "compression", "run_stage1": "stage 1", "run_sparse_attn": "stage 2",
                "run_dense_attn": "dense attention"}
SCOPE = "bench_model:"


def scoped_stages():
    """prefill.py's `run_*` stages wrapped in `record_function` scopes named for their family (the
    prefill body calls them through the module, so the wrappers are what it runs)."""
    import contextlib
    import functools

    from infllm_cupy import prefill

    stack = contextlib.ExitStack()
    for name, fam in STAGE_SCOPES.items():
        orig = getattr(prefill, name)

        @functools.wraps(orig)
        def wrapped(*args, _orig=orig, _fam=fam, **kw):
            with torch.profiler.record_function(SCOPE + _fam):
                return _orig(*args, **kw)

        setattr(prefill, name, wrapped)
        stack.callback(setattr, prefill, name, orig)
    return stack


def split_by_family(prof, dev) -> tuple[dict[str, float], list[str]]:
    """Milliseconds per family of a profiled prefill, and the names no family claimed."""
    split = dict.fromkeys(FAMILY_NAMES, 0.0)
    other: set[str] = set()
    if dev.type == "cuda":
        for ev in prof.key_averages():
            us = getattr(ev, "self_device_time_total", None) or getattr(ev, "self_cuda_time_total", 0)
            if getattr(ev, "device_type", None) != torch.autograd.DeviceType.CUDA or not us:
                continue
            fam = family_of(ev.key)
            split[fam] += us / 1e3
            if fam == "other":
                other.add(ev.key)
        return split, sorted(other)
    for ev in prof.events():
        us = ev.self_cpu_time_total
        if not ev.name.startswith("aten::") or not us:
            continue
        fam, up = None, ev.cpu_parent
        while up is not None and fam is None:
            if up.name.startswith(SCOPE):
                fam = up.name[len(SCOPE):]
            elif up.name == "aten::scaled_dot_product_attention":
                fam = "dense attention"
            up = up.cpu_parent
        fam = fam or family_of(ev.name)
        split[fam] += us / 1e3
        if fam == "other":
            other.add(ev.name)
    return split, sorted(other)


class Timer:
    def __init__(self, dev):
        self.cuda = dev.type == "cuda"

    def __enter__(self):
        if self.cuda:
            torch.cuda.synchronize()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            torch.cuda.synchronize()
        self.ms = (time.perf_counter() - self.t0) * 1e3


def make_cache(impl, cfg, max_len):
    from transformers import StaticCache

    from infllm_cupy.integrations.transformers import InfLLMv2Cache

    if impl == "sdpa_static":
        return StaticCache(config=cfg, max_cache_len=max_len)
    return InfLLMv2Cache(cfg, max_cache_len=max_len)


def run_row(a, dev, model, cfg, impl: str, ids, row: dict) -> None:
    import inspect

    from infllm_cupy.integrations.transformers import ATTN_NAME

    attn = {"sdpa_static": "sdpa", "ours:16bit": ATTN_NAME, "ours:int8-fp8": ATTN_Q8}[impl]
    model.set_attn_implementation(attn)
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    T = ids.shape[1]
    max_len = T + a.warmup_steps + a.rep * a.new_tokens + 1
    times = []
    with torch.no_grad():
        for i in range(a.rep + 1):                                   # the first one warms up
            cache = make_cache(impl, cfg, max_len)
            with Timer(dev) as t:
                logits = model(ids, logits_to_keep=1, use_cache=True, **{cache_kw: cache}).logits
            if i:
                times.append(t.ms)
        row["ttft_ms"] = statistics.median(times)
        acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA]
                                                        if dev.type == "cuda" else [])
        threads = torch.get_num_threads()
        if dev.type == "cpu":
            torch.set_num_threads(1)    # stage 2's CPU path runs chunks on threads outside the scopes
        try:
            with scoped_stages(), torch.profiler.profile(activities=acts) as prof:
                model(ids, logits_to_keep=1, use_cache=True, **{cache_kw: make_cache(impl, cfg, max_len)})
                if dev.type == "cuda":
                    torch.cuda.synchronize()
        finally:
            torch.set_num_threads(threads)
        split, other = split_by_family(prof, dev)
        row["split_ms"] = {k: round(v, 3) for k, v in split.items()}
        row["other_kernels"] = other
        fwd = model.forward
        notes = []
        if dev.type == "cuda":
            fwd = torch.compile(model.forward, mode="reduce-overhead")
        else:
            notes.append("decode eager (CPU: no CUDA graphs)")
        tok = logits[:, -1].argmax(-1, keepdim=True)
        pos = torch.full((a.batch, 1), T, dtype=torch.long, device=dev)

        def step(tok, pos):
            if dev.type == "cuda":
                torch.compiler.cudagraph_mark_step_begin()
            out = fwd(input_ids=tok, position_ids=pos, use_cache=True, **{cache_kw: cache}).logits
            return out[:, -1].argmax(-1, keepdim=True), pos + 1

        for _ in range(a.warmup_steps):
            tok, pos = step(tok, pos)
        spans = []
        for _ in range(a.rep):
            with Timer(dev) as t:
                for _ in range(a.new_tokens):
                    tok, pos = step(tok, pos)
            spans.append(t.ms)
        row["decode_ms_per_step"] = statistics.median(spans) / a.new_tokens
    if notes:
        row["note"] = "; ".join(notes)


def main(argv=None) -> list[dict]:
    a = parse_args(argv)
    dev = torch.device(a.device)
    import transformers

    from infllm_cupy.integrations.transformers import register

    env = harness.env_stamp()
    env["transformers"] = transformers.__version__
    harness.print_env(env)
    register()
    register(ATTN_Q8, precision="int8-fp8")
    fn, nbytes = harness.device_copy(dev)
    copy_ms = statistics.median(harness.bench_gpu_time(fn, warmup=2, rep=10, device=dev))
    del fn
    gbps = nbytes / (copy_ms / 1e3) / 1e9
    positions = a.context + a.new_tokens * (a.rep + 1) + a.warmup_steps + 64
    model, cfg = harness.build_model(a, dev, positions)
    wbytes = harness.weight_bytes(model)
    esz = torch.tensor([], dtype=harness.MODEL_DTYPES[a.dtype]).element_size()
    g = torch.Generator().manual_seed(a.seed + 1)
    ids = torch.randint(0, a.vocab, (a.batch, a.context), generator=g).to(dev)
    impls = ([] if a.no_sdpa else ["sdpa_static"]) + [f"ours:{p}" for p in a.precisions]
    config = f"L{a.layers}-B{a.batch}-T{a.context}-HQ{a.hq}-H{a.h}-D{a.d}"
    rows = []
    for impl in impls:
        row = {"impl": impl, "config": config, "ttft_ms": None, "decode_ms_per_step": None, "note": ""}
        L = a.context + a.warmup_steps + a.rep * a.new_tokens // 2     # the cache length mid-decode
        floor_bytes = wbytes + harness.kv_floor_bytes(a, impl, a.batch, L, esz)
        row["floor_ms_per_step"] = floor_bytes / (gbps * 1e9) * 1e3
        t0 = time.perf_counter()
        try:
            run_row(a, dev, model, cfg, impl, ids, row)
        except Exception as e:  # noqa: BLE001 - a row that cannot run is recorded, not raised
            row["note"] = harness.short_error(e)
        if row["decode_ms_per_step"]:
            row["x_floor"] = row["decode_ms_per_step"] / row["floor_ms_per_step"]
        rows.append(row)
        harness.free_gpu_memory(dev)
        print(f"  {impl}: {time.perf_counter() - t0:.1f} s", flush=True)
    base = {r["impl"]: r for r in rows}
    for r in rows:
        ref = base.get("ours:16bit")
        if ref and ref is not r and ref["ttft_ms"] and r["ttft_ms"]:
            r["ttft_vs_ours16"] = r["ttft_ms"] / ref["ttft_ms"]
    print(f"copy bandwidth {gbps:.0f} GB/s; weights {wbytes / 2**30:.2f} GiB")
    cols = ["impl", "config", "ttft_ms", "ttft_vs_ours16", "decode_ms_per_step", "floor_ms_per_step",
            "x_floor", "note"]
    harness.print_table(rows, cols, title="time to first token and decode (ms)")
    split_rows = [{"impl": r["impl"], **r["split_ms"]} for r in rows if r.get("split_ms")]
    if split_rows:
        harness.print_table(split_rows, ["impl", *FAMILY_NAMES], title="prefill time by kernel family (ms)")
        for r in rows:
            if r.get("other_kernels"):
                print(f"  {r['impl']} other: {', '.join(r['other_kernels'][:20])}")
    if a.json:
        import json
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        payload = {"env": env, "args": vars(a), "rows": rows}
        Path(a.json).write_text(json.dumps(payload, indent=1, default=str))
    return rows


if __name__ == "__main__":
    main()
