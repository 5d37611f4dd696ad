"""The one timer, FLOP convention, table and JSON format shared by every script in `benchmarks/`,
and all other code the scripts share (arguments, timing a row, configs, decode inputs): scripts import
only this module of `benchmarks/`, and tools import nothing else from it (tests/test_script_imports.py).

Timing: CUDA events recorded on torch's current stream (the stream our launchers and every anchor
use), after warm-up runs, one event pair per iteration; scripts report the median. Without CUDA
the same function falls back to `time.perf_counter` so the scripts can be smoke-tested on CPU.

FLOP: effective, counted on the keys each query actually attends (causal clipping included):
forward = 4 * D * sum over (query token, query head) of attended keys (2 matmuls of 2 FLOP per
multiply-add); backward = 2.5x and forward+backward = 3.5x the forward (FlashAttention's convention).
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.metadata
import json
import math
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
MODES = ("fwd", "bwd", "fwdbwd")
MODE_FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwdbwd": 3.5}


README_CONFIGS = "32kx8,64kx4,128kx2"   # InfLLM-v2's README benchmark: always 262,144 query tokens


def add_head_args(p: argparse.ArgumentParser) -> None:
    """`--hq`, `--h`, `--d`: query heads, key/value heads and head dim (InfLLM-v2's 32, 2, 128)."""
    p.add_argument("--hq", type=int, default=32)
    p.add_argument("--h", type=int, default=2)
    p.add_argument("--d", type=int, default=128)


def add_shape_args(p: argparse.ArgumentParser, *, T: int, B: int, K: int = 64, D: int | None = None) -> None:
    """A development tool's one shape: `--T` tokens per sequence, `--B` sequences, `--K` blocks per
    query token and, where `D` is given, `--D` the head dim."""
    p.add_argument("--T", type=int, default=T)
    p.add_argument("--B", type=int, default=B)
    p.add_argument("--K", type=int, default=K)
    if D is not None:
        p.add_argument("--D", type=int, default=D)


def add_run_args(p: argparse.ArgumentParser, *, target_ms: float, min_rep: int, max_rep: int) -> None:
    """The arguments every benchmark script shares: configs, output, shapes, repetitions, device."""
    p.add_argument("--configs", default=None,
                   help=f"comma-separated TxB (k = 1024). Default: {README_CONFIGS} (--quick: 8kx2; on CPU "
                        "512x2)")
    p.add_argument("--json", default=None, help="write all rows (with GPU, versions, commit) to this file")
    p.add_argument("--quick", action="store_true", help="smoke run: one small config, few repetitions")
    add_head_args(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=1,
                   help="untimed runs before timing (compiles kernels). Default: 1")
    p.add_argument("--rep", type=int, default=None, help="timed runs; default: adaptive (--target-ms)")
    p.add_argument("--target-ms", type=float, default=target_ms,
                   help="adaptive reps: about this much timed work")
    p.add_argument("--min-rep", type=int, default=min_rep)
    p.add_argument("--max-rep", type=int, default=max_rep)
    p.add_argument("--budget-s", type=float, default=540.0,
                   help="after this many seconds, skip the remaining rows and print the tables (0: no limit)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--no-compile", action="store_true", help="run FlexAttention eagerly (always on CPU)")


def check_run_args(p: argparse.ArgumentParser, a: argparse.Namespace, *, quick_target_ms: float,
                   quick_max_rep: int) -> None:
    """After parsing `add_run_args`' arguments: `--hq` a multiple of `--h`, and `--quick` caps the
    repetitions (`target_ms`, `max_rep`) at these values."""
    if a.hq % a.h:
        p.error("--hq must be a multiple of --h")
    if a.quick:
        a.target_ms, a.max_rep = min(a.target_ms, quick_target_ms), min(a.max_rep, quick_max_rep)


def csv_choices(p: argparse.ArgumentParser, name: str, text: str, allowed: Sequence[str]) -> list[str]:
    """The comma-separated option `name` as a list; an entry not in `allowed` is an argparse error."""
    vals = [x for x in text.split(",") if x]
    bad = [x for x in vals if x not in allowed]
    if bad:
        p.error(f"{name}: unknown {bad}; choose from {list(allowed)}")
    return vals


def print_env(env: dict[str, str]) -> None:
    """A run's opening line: the `env_stamp` (plus what a script added to it)."""
    print("env: " + ", ".join(f"{k}={v}" for k, v in env.items()), flush=True)


def env_line(env: dict[str, str], t_start: float, extra: str = "") -> str:
    """The closing line of a run: GPU, versions, commit, wall time."""
    return (f"env: {env['gpu']}, torch {env['torch']}, cuda {env['cuda']}, cupy {env['cupy']}, "
            f"triton {env.get('triton', '-')}, fla {env.get('fla', '-')}, commit {env['commit']}; "
            f"{extra + '; ' if extra else ''}wall {time.perf_counter() - t_start:.0f} s")


def bench_gpu_time(fn: Callable[[], Any], *, warmup: int = 1, rep: int | None = None,
                   target_ms: float = 800.0,
                   min_rep: int = 3, max_rep: int = 30,
                   device: str | torch.device | None = None) -> list[float]:
    r"""Per-iteration milliseconds of `fn()`.

    Args:
        fn (Callable):
            The work to time; its result is dropped.
        warmup (int):
            Untimed runs first (the first one may compile or autotune). Default: 1.
        rep (int, Optional):
            Timed runs. Default: `None`, which times one more warm-up run and picks
            `ceil(target_ms / its time)` clamped to `[min_rep, max_rep]`.
        device (str, Optional):
            `"cuda"` times with CUDA events, `"cpu"` with `time.perf_counter`.
            Default: `None` (CUDA when available).

    Returns:
        times (list[float]):
            One entry per timed run, in ms; report `statistics.median(times)`.
    """
    use_cuda = torch.cuda.is_available() if device is None else torch.device(device).type == "cuda"
    sync = torch.cuda.synchronize if use_cuda else (lambda: None)

    def timed_run() -> float:
        if not use_cuda:
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
        stream = torch.cuda.current_stream()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        fn()
        end.record(stream)
        end.synchronize()
        return start.elapsed_time(end)

    sync()
    for _ in range(warmup):
        fn()
    sync()
    if rep is None:
        est = max(timed_run(), 1e-3)
        rep = int(min(max(math.ceil(target_ms / est), min_rep), max_rep))
    if not use_cuda:
        return [timed_run() for _ in range(rep)]
    stream = torch.cuda.current_stream()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(rep)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(rep)]
    for s, e in zip(starts, ends):
        s.record(stream)
        fn()
        e.record(stream)
    sync()
    return [s.elapsed_time(e) for s, e in zip(starts, ends)]


def capture_graph(fn: Callable[[], Any], calls: int = 1, *, warmup: int = 2) -> torch.cuda.CUDAGraph:
    """A CUDA graph of `calls` calls of `fn`, after `warmup` calls on a side stream (allocations and
    lazy compiles happen outside the capture); replay it with `.replay()`."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph


def device_copy(device: torch.device, nbytes: int | None = None) -> tuple[Callable[[], Any], int]:
    """`(fn, bytes)`: a device-to-device copy of a large bf16 buffer (1 GiB read + 1 GiB written on CUDA,
    16 MiB on CPU) and the bytes it moves (read + written): time `fn` and divide, for the copy bandwidth
    that byte floors are read against. The buffers live as long as `fn`."""
    n = nbytes or ((1 << 30) if device.type == "cuda" else (1 << 24))
    src = torch.empty(n // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    return (lambda: dst.copy_(src)), 2 * src.numel() * src.element_size()


def free_gpu_memory(device: torch.device) -> None:
    """Drop unreachable tensors and hand cached blocks back (between rows and configs)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def summarize(times: Sequence[float]) -> dict[str, float]:
    """Median and the 20th/80th percentiles (ms) of a list of timings."""
    xs = sorted(times)

    def q(p: float) -> float:
        x = p * (len(xs) - 1)
        lo, hi = math.floor(x), math.ceil(x)
        return xs[lo] + (xs[hi] - xs[lo]) * (x - lo)

    return {"ms": statistics.median(xs), "ms_p20": q(0.2), "ms_p80": q(0.8)}


def flops_attn(keys: float, head_dim: int, mode: str = "fwd") -> float:
    """Effective FLOP of attention. `keys` = sum over (query token, query head) of the keys it attends."""
    return 4.0 * head_dim * float(keys) * MODE_FLOP_FACTOR[mode]


def causal_dense_keys(B: int, T: int, HQ: int) -> int:
    """`keys` of dense causal attention: every query attends itself and all earlier keys."""
    return HQ * B * T * (T + 1) // 2


def tflops(flop: float | None, ms: float | None) -> float | None:
    return None if not flop or not ms else flop / (ms * 1e-3) / 1e12


def skip_reason(skip: str, fn: Callable | None, over_budget: bool, budget_s: float) -> str:
    """Why a row is not timed, "" when it is: `skip` as given, no function to time, or the time
    budget (`--budget-s`) spent."""
    if skip or fn is None:
        return skip or "unavailable"
    if over_budget:
        return f"skipped: --budget-s {budget_s:g} s exceeded"
    return ""


def timed_runs(fn: Callable[[], Any], a: argparse.Namespace, device: torch.device, *,
               warmup: int | None = None) -> list[float]:
    """`bench_gpu_time(fn)` with the repetitions `add_run_args` parsed into `a` (`warmup`: instead of
    `a.warmup`)."""
    return bench_gpu_time(fn, warmup=a.warmup if warmup is None else warmup, rep=a.rep, target_ms=a.target_ms,
                          min_rep=a.min_rep, max_rep=a.max_rep, device=device)


def time_row(row: Row, fn: Callable[[], Any], a: argparse.Namespace, device: torch.device, *,
             warmup: int | None = None) -> None:
    """Time `fn` (`timed_runs`) into `row`: median and 20th/80th percentiles (ms), repetitions, and
    TFLOP/s from `row.flop`."""
    times = timed_runs(fn, a, device, warmup=warmup)
    st = summarize(times)
    row.ms, row.ms_p20, row.ms_p80, row.reps = st["ms"], st["ms_p20"], st["ms_p80"], len(times)
    row.tflops = tflops(row.flop, row.ms)


def _version(*dists: str) -> str:
    for d in dists:
        try:
            return importlib.metadata.version(d)
        except importlib.metadata.PackageNotFoundError:
            pass
    return "-"


def _git_commit() -> str:
    # the device machine's copy of the tree may carry no .git, or a stale one (seen: a run stamped
    # with an older commit): an explicit INFLLM_CUPY_COMMIT wins
    if os.environ.get("INFLLM_CUPY_COMMIT"):
        return os.environ["INFLLM_CUPY_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                             text=True, timeout=10)
        if out.returncode == 0 and out.stdout.strip():
            dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                                   capture_output=True, text=True, timeout=10).stdout.strip()
            return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


def parse_config(s: str) -> tuple[int, int]:
    """'32kx8' -> (T=32768, B=8); 'k' means 1024, plain numbers are tokens ('1000x2')."""
    t, b = s.lower().split("x")
    T = int(float(t[:-1]) * 1024) if t.endswith("k") else int(t)
    return T, int(b)


def shape_id(B: int, T: int, HQ: int, H: int, D: int) -> str:
    t = f"{T // 1024}K" if T % 1024 == 0 else str(T)
    return f"B{B}-T{t}-HQ{HQ}-H{H}-D{D}"


def short_error(e: BaseException, n: int = 300) -> str:
    """The exception's type and first line, at most `n` characters (a row's note)."""
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0] if msg else ''}"[:n]


def causal_mask(b, h, q_idx, kv_idx):
    """FlexAttention's causal `mask_mod`."""
    return q_idx >= kv_idx


def make_fn(forward: Callable, inputs: tuple[torch.Tensor, ...], mode: str) -> Callable[[], object]:
    """The closure to time: forward under no_grad, backward of a retained graph, or both."""
    if mode == "fwd":
        def run():
            with torch.no_grad():
                return forward(*inputs)
        return run
    leaves = tuple(x.detach().requires_grad_() for x in inputs)
    do = torch.randn_like(inputs[0])             # every implementation returns a q-shaped output
    if mode == "bwd":
        out = forward(*leaves)
        if not out.requires_grad:
            raise RuntimeError("output has no grad_fn (no autograd support)")
        return lambda: torch.autograd.grad(out, leaves, do, retain_graph=True)
    if mode == "fwdbwd":
        return lambda: torch.autograd.grad(forward(*leaves), leaves, do)
    raise ValueError(mode)


def parse_decode_config(s: str) -> tuple[int, int]:
    """A decode config: '8x128k' -> (B=8, L=131072): BATCHxCONTEXT, k = 1024."""
    b, t = s.lower().split("x")
    L = int(float(t[:-1]) * 1024) if t.endswith("k") else int(t)
    return int(b), L


def n_windows(L: int, kernel: int, stride: int) -> int:
    return 0 if L < kernel else (L - kernel) // stride + 1


def random_cache(B: int, L: int, H: int, D: int, dtype, dev, g):
    """A full contiguous DecodeCache (every sequence holds L keys) with random K/V and compressed keys,
    built directly (no append, no compression pass: the timings do not depend on the values)."""
    from infllm_cupy._rules import COMPRESSIONS
    from infllm_cupy.decode.cache import DecodeCache

    k = torch.randn(B, L, H, D, generator=g, device=dev, dtype=dtype)
    v = torch.randn(B, L, H, D, generator=g, device=dev, dtype=dtype)
    ck = [torch.randn(B, n_windows(L, kr, st), H, D, generator=g, device=dev,
                      dtype=dtype) for kr, st in COMPRESSIONS]
    seqlens = torch.full((B,), L, dtype=torch.int32, device=dev)
    return DecodeCache(k, v, seqlens, None, None, ck[0], ck[1], [L] * B, [L] * B)


def random_selection(B: int, H: int, L: int, topk: int, local_blocks: int, dev, g) -> torch.Tensor:
    """int32 `[H, B, K]`, K = min(topk + local_blocks, blocks): InfLLM-v2's shape of a selection (block 0,
    the local_blocks + 1 blocks ending at the last one, random distinct others), distinct and valid."""
    from infllm_cupy._rules import KV_BLOCK

    nb = -(-L // KV_BLOCK)
    K = min(topk + local_blocks, nb)
    local = min(local_blocks + 1, nb - 1)
    n_rand = K - 1 - local
    mid = nb - 1 - local                                     # candidates 1 .. mid
    parts = [torch.zeros(H * B, 1, dtype=torch.long, device=dev),
             torch.rand(H * B, mid, generator=g, device=dev).argsort(-1)[:, :n_rand] + 1,
             torch.arange(nb - local, nb, device=dev).expand(H * B, local)]
    return torch.cat(parts, 1).sort(-1).values.to(torch.int32).view(H, B, K).contiguous()


def env_stamp() -> dict[str, str]:
    """GPU, library versions and commit: stamped on every JSON row and printed above the table."""
    gpu = (torch.cuda.get_device_name() if torch.cuda.is_available()
           else f"cpu ({platform.processor() or 'none'})")
    try:
        import infllm_cupy
        ours = getattr(infllm_cupy, "__version__", None) or _version("infllm-cupy", "infllm_cupy")
    except Exception:  # noqa: BLE001 - the package may be mid-edit; the stamp must not fail
        ours = _version("infllm-cupy", "infllm_cupy")
    return {
        "gpu": gpu,
        "cuda": str(torch.version.cuda),
        "torch": torch.__version__,
        "cupy": _version("cupy-cuda13x", "cupy-cuda12x", "cupy"),
        "triton": _version("triton"),
        "fla": _version("fla-core", "flash-linear-attention"),
        "infllm_cupy": ours,
        "commit": _git_commit(),
    }


@dataclasses.dataclass
class Row:
    """One timed (implementation, shape, selection, K, mode); `ms` is None when it failed or was skipped."""
    impl: str
    config: str
    selection: str = "-"
    K: int | None = None
    mode: str = "fwd"
    ms: float | None = None
    ms_p20: float | None = None
    ms_p80: float | None = None
    reps: int = 0
    keys_per_q: float | None = None
    flop: float | None = None
    tflops: float | None = None
    ratios: dict[str, float] = dataclasses.field(default_factory=dict)
    note: str = ""


def _fmt(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        if x != x:
            return "nan"
        return f"{x:.1f}" if abs(x) >= 100 else f"{x:.2f}" if abs(x) >= 1 else f"{x:.3f}"
    return str(x)


def format_table(records: Sequence[dict[str, Any]], columns: Sequence[str], *, max_width: int = 60) -> str:
    """Aligned text table of `records` (dicts) over `columns`; numbers right-aligned, text left-aligned."""
    cells = [[_fmt(r.get(c))[:max_width] for c in columns] for r in records]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    numeric = [all(isinstance(r.get(c), (int, float)) or r.get(c) is None for r in records) for c in columns]

    def line(vals: Sequence[str]) -> str:
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(vals, widths,
                                                                                numeric)).rstrip()

    out = [line(columns), line(["-" * w for w in widths])]
    out += [line(row) for row in cells]
    return "\n".join(out)


def markdown_table(records: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    """GitHub-markdown table of `records` over `columns` (the form the README and notes take):
    None as "-", booleans as yes/no, numbers to three significant digits below 100."""
    def cell(x: Any) -> str:
        if x is None:
            return "-"
        if isinstance(x, bool):
            return "yes" if x else "no"
        if isinstance(x, float):
            return f"{x:.0f}" if abs(x) >= 100 else f"{x:.3g}"
        return str(x).replace("|", "/")
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in columns) + " |" for r in records]
    return "\n".join(lines)


def setup_flex(device: torch.device, *, compile_: bool, backward: bool):
    """`(flex, BlockMask)`: FlexAttention, compiled on CUDA unless `compile_` is False. A benchmark
    compiles one kernel per mask shape, so dynamo's recompile limit is raised; with `backward`, the
    compiled backward's donated buffers are turned off (they refuse retain_graph=True, which the
    backward timing uses)."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
    if device.type != "cuda" or not compile_:
        return flex_attention, BlockMask
    import torch._dynamo.config as dynamo_config
    for name in ("cache_size_limit", "recompile_limit"):
        if hasattr(dynamo_config, name):
            setattr(dynamo_config, name, max(64, getattr(dynamo_config, name)))
    if backward:
        try:
            import torch._functorch.config as functorch_config
            functorch_config.donated_buffer = False
        except Exception:  # noqa: BLE001
            pass
    return torch.compile(flex_attention, dynamic=False), BlockMask


ROW_COLUMNS = ("impl", "config", "selection", "K", "mode", "ms", "tflops", "keys_per_q", "reps", "note")


def print_table(rows: Sequence[Row | dict[str, Any]], columns: Sequence[str] = ROW_COLUMNS, *,
                title: str | None = None) -> None:
    records = [dataclasses.asdict(r) if isinstance(r, Row) else r for r in rows]
    if title:
        print(f"\n{title}")
    print(format_table(records, columns), flush=True)


def write_json(rows: Sequence[Row], path: str | os.PathLike, env: dict[str, str] | None = None,
               extra: dict[str, Any] | None = None) -> None:
    """Write `{"env": ..., "rows": [...]}`; every row also carries the env stamp (GPU, versions, commit)."""
    env = env_stamp() if env is None else env
    payload = {"env": env, **(extra or {}), "rows": [{**dataclasses.asdict(r), **env} for r in rows]}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(payload, indent=1, default=str))


def fp32_gemm_rate(n: int = 2048, rep: int = 3) -> float:
    """The CPU's fp32 GEMM rate in GFLOP/s, the floor the CPU implementations are measured against
    (docs/cpu.md): the best of `rep` timed `torch.matmul` calls on `n x n` fp32 squares, after one
    untimed call, with torch's current thread count."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = math.inf
    for _ in range(rep):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best / 1e9


# ------------------------------------------------ the MiniCPM4-shaped model (bench_transformers, bench_model)
MODEL_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def parse_context(text: str) -> int:
    """A context length: an int, or thousands of 1024 tokens with a `k` suffix (`16k`, `1.5k`)."""
    t = text.strip().lower()
    return int(float(t[:-1]) * 1024) if t.endswith("k") else int(t)


def build_model(a: argparse.Namespace, dev, max_positions: int):
    """A Llama of MiniCPM4-8B's attention shape from the arguments `a` (`vocab`, `hidden`, `intermediate`,
    `layers`, `hq`, `h`, `d`, `window`, `topk`, `dense_len`, `seed`, `dtype`): random weights in `a.dtype`
    built on `dev`, and its config carrying MiniCPM4's `sparse_config`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate,
                      num_hidden_layers=a.layers, num_attention_heads=a.hq, num_key_value_heads=a.h,
                      head_dim=a.d, max_position_embeddings=max_positions, initializer_range=0.02)
    cfg.sparse_config = dict(kernel_size=32, kernel_stride=16, init_blocks=1, block_size=64,
                             window_size=a.window, topk=a.topk, use_nope=False, dense_len=a.dense_len)
    torch.manual_seed(a.seed)
    old = torch.get_default_dtype()
    torch.set_default_dtype(MODEL_DTYPES[a.dtype])          # the weights in the run's dtype, on the device
    try:
        with torch.device(dev):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    return model.eval(), cfg


def weight_bytes(model) -> int:
    """Bytes of the parameters a decode step reads: all but the input embedding table (B rows of it are
    read), unless that table is tied to the LM head."""
    emb = model.get_input_embeddings().weight
    tied = any(p is emb for n, p in model.named_parameters() if "lm_head" in n) or \
        model.get_output_embeddings().weight is emb
    return sum(p.numel() * p.element_size() for p in model.parameters() if tied or p is not emb)


def kv_floor_bytes(a: argparse.Namespace, impl: str, B: int, L: int, esz: int) -> int:
    """K/V bytes one decode step must read over all layers at context L: every key and value for SDPA
    rows (`impl` "sdpa*") and below `dense_len`; else the selected blocks (topk + the window's blocks +
    the query's own) and both compressed keys."""
    per_layer_all = B * L * a.h * a.d * 2 * esz
    if impl.startswith("sdpa") or L < a.dense_len:
        return a.layers * per_layer_all
    keys = min(L, 64 * (a.topk + a.window // 64 + 1))
    sel = B * a.h * keys * a.d * 2 * esz
    ck = B * a.h * (L // 16 + L // 64) * a.d * esz
    return a.layers * (sel + ck)
