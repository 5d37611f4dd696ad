r"""InfLLM-v2 end to end (compression -> stage 1 -> top-k -> stage 2) against dense attention, in one process.

    python benchmarks/bench_pipeline.py --quick                                  # smoke run, one small config
    python benchmarks/bench_pipeline.py --configs 32kx8 --json benchmarks/results/pipeline_32k.json
    python benchmarks/bench_pipeline.py --configs 32kx8,64kx4,128kx2 --max-configs 1   # the first one only
    python benchmarks/bench_pipeline.py --configs 32kx8,128kx2 --inputs structured,random   # the selection goals
    python benchmarks/bench_pipeline.py --configs 512kx1,1Mx1 --inputs structured --impls selection,stage2,pipeline,sdpa_cudnn

Inputs (`--inputs`, comma-separated, each config runs once per mode):
    random      unit-normal q, k, v (the default): random queries pick unrelated blocks
    structured  `infllm_cupy.synthetic.structured_sequence` per sequence (sink, local context, recurring
                topics, needles; seed + b for sequence b): selections coherent as in a trained model.
                Its rows' config ids end in `-structured`
A config whose estimated peak GPU memory (inputs, the stage-1 plan's global scratch, stage 2 and the
SDPA copies; `estimate_peak_bytes`) exceeds the free memory is skipped with the reason printed.

Rows (impl), all forward under `no_grad`, on the same seeded bf16 inputs:
    selection   compression + stage 1 + top-k: `pipeline.select_blocks` on the `--backend`'s stages
                picks for `--backend` (CUDA: the compression and stage-1 kernels), only `topk_idx`
                returned (as the pipeline runs it without `return_aux`)
    stage2      stage 2 alone (`stages_for(...)["sparse_attn"]`) on the pipeline's own `topk_idx`
    pipeline    `infllmv2_attention` (sparse path, `dense_len = 0`): selection + stage 2 + host glue
    sdpa_cudnn  torch SDPA dense causal, cuDNN backend, `[B, HQ, T, D]`, enable_gqa
    flex_union  FlexAttention (compiled) with a 128x128 BlockMask over the union of the pipeline's
                `topk_idx` per 128-token query tile (infllm_cupy/selections.py): the least an exact
                FlexAttention version of the same selection computes
    selection_exact, selection_packed, pipeline_exact, pipeline_packed (not in the default list)
                `selection` / `pipeline` with the stage-1 plan's group sum forced to the exact float32
                path or to f16 pairs (`Stage1Plan.packed`, sm_90a kernel; docs/stage1.md)
Summary: per config and input mode, the ms of every row, `selection/stage2` (selection ms / stage-2 ms) and
anchor ms / pipeline ms; then the verdicts of the selection goals (`goal_verdicts`).
Memory: the selection's and the pipeline's extra GPU memory, `torch.cuda.max_memory_allocated()`
during one call minus the memory allocated before it (inputs and earlier results excluded).
TFLOP/s are effective (keys each query attends: the selection's for stage2/pipeline, the tiles' for
Flex, causal dense for SDPA); `selection` has none. Ratios: anchor ms / pipeline ms (> 1: ours faster).
The stage-1 reference takes about 0.8 s per 32k-token sequence on an H100 (T^2 growth): use
`--configs` / `--max-configs` to keep one command within its time limit.
"""  # noqa: E501 - verbatim commands, signatures and tables
from __future__ import annotations

import argparse
import contextlib
import gc
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import _harness as harness  # noqa: E402
from infllm_cupy import _env  # noqa: E402
from infllm_cupy.selections import attended_keys, to_flex_block_mask_inputs, uniform_cu_seqlens  # noqa: E402

IMPLS = ("selection", "stage2", "pipeline", "sdpa_cudnn", "flex_union", "selection_exact", "selection_packed",
         "pipeline_exact", "pipeline_packed")
DEFAULT_IMPLS = IMPLS[:5]
# rows with the stage-1 group sum forced (Stage1Plan.packed, sm_90a kernel) whatever the plan's default
ARITH = {"selection_exact": False, "selection_packed": True, "pipeline_exact": False, "pipeline_packed": True}
ANCHORS = ("sdpa_cudnn", "flex_union")
INPUTS = ("random", "structured")


def make_inputs(B: int, T: int, HQ: int, H: int, D: int, device, seed: int = 0, dtype=torch.bfloat16):
    """Seeded packed `q [B*T, HQ, D]`, `k, v [B*T, H, D]` and uniform `cu_seqlens` `[B+1]`."""
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(B * T, HQ, D, generator=g, device=device, dtype=dtype)
    k = torch.randn(B * T, H, D, generator=g, device=device, dtype=dtype)
    v = torch.randn(B * T, H, D, generator=g, device=device, dtype=dtype)
    return q, k, v, uniform_cu_seqlens(B, T, device)


def make_structured_inputs(B: int, T: int, HQ: int, H: int, D: int, device, seed: int = 0,
                           dtype=torch.bfloat16):
    """`make_inputs`' layout from `structured_sequence` (README-head defaults: sink, local context,
    topics, needles), sequence b drawn with seed `seed + b` on the CPU and moved one at a time."""
    from infllm_cupy.synthetic import structured_sequence

    parts = [structured_sequence(T, HQ, H, D, dtype=dtype, device=device, seed=seed + b) for b in range(B)]
    q, k, v = (torch.cat([getattr(s, name) for s in parts]) for name in ("q", "k", "v"))
    return q, k, v, uniform_cu_seqlens(B, T, device)


def estimate_peak_bytes(B: int, T: int, HQ: int, H: int, D: int, K: int, device: torch.device) -> dict:
    """Estimated GPU bytes of one config: `inputs` (q, k, v), `selection` (compressed keys, `topk_idx`
    and the stage-1 plan's global block-key scratch, if the plan has one), `stage2` (its output),
    `sdpa` (the `[B, heads, T, D]` copies and output) and `peak` = inputs + `topk_idx` kept + the
    largest of the rows' extras."""
    from infllm_cupy.stage1 import plan as s1plan
    from infllm_cupy.stage1.select import device_stage1_plan

    total, el = B * T, 2
    inputs = total * (HQ + 2 * H) * D * el
    out_len = -(-T // 64)
    topk_bytes = H * total * K * 4
    ck_bytes = (total // 16 + total // 64 + 2 * B) * H * D * el
    scratch = 0
    if device.type == "cuda":
        G = HQ // H
        plan = device_stage1_plan(device, G, D, torch.bfloat16, torch.bfloat16, out_len, rows=H * total)
        scratch = s1plan.scratch_bytes(plan, H, total, out_len, 2, K=K, HQ=HQ)
    sel = ck_bytes + topk_bytes + scratch
    stage2 = total * HQ * D * el
    sdpa = inputs + total * HQ * D * el
    peak = inputs + topk_bytes + max(sel, stage2 + ck_bytes, sdpa)
    return {"inputs": inputs, "selection": sel, "scratch": scratch, "stage2": stage2, "sdpa": sdpa,
            "peak": peak, "topk_idx": topk_bytes, "compressed_keys": ck_bytes}


def memory_skip_reason(B: int, T: int, HQ: int, H: int, D: int, K: int, device: torch.device) -> str:
    """Why the config cannot fit in the free GPU memory (with 5% and 1 GiB slack), or ""."""
    if device.type != "cuda":
        return ""
    est = estimate_peak_bytes(B, T, HQ, H, D, K, device)
    free, _ = torch.cuda.mem_get_info(device)
    if est["peak"] <= 0.95 * free - 2**30:
        return ""
    gib = lambda x: f"{x / 2**30:.1f} GiB"  # noqa: E731
    return (f"skipped: estimated peak {gib(est['peak'])} > free {gib(free)} (inputs {gib(est['inputs'])}, "
            f"stage-1 block-key scratch {gib(est['scratch'])}, SDPA copies {gib(est['sdpa'])})")


def extra_memory(fn: Callable[[], object], device: torch.device) -> tuple[float | None, object]:
    """GiB that one `fn()` call allocates at its peak beyond what was allocated before; and its result."""
    if device.type != "cuda":
        return None, fn()
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30, out


def tie_free_inputs(lengths, HQ: int, H: int, D: int, device, seed: int = 0, dtype=torch.bfloat16):
    """Inputs on which every backend picks the same blocks: keys are multiples of 1/8 in [-1, 1], so
    their window means are exact in fp32 and round the same way whichever code computes them."""
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q = torch.randn(total, HQ, D, generator=g)
    k = torch.randint(-8, 9, (total, H, D), generator=g) / 8.0
    v = torch.randn(total, H, D, generator=g)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths).cumsum(0)
    return q.to(device, dtype), k.to(device, dtype), v.to(device, dtype), cu.to(device)


def check_against_reference(device: torch.device, backend: str, HQ: int, H: int, D: int) -> str:
    """The pipeline on `backend` against the reference pipeline on a reduced ragged shape: identical
    `topk_idx` (fp32 scores, tie-free keys) and output error at most 2x that of the reference done in
    bf16 (FlashAttention's rule) against the float64 reference. Returns a one-line verdict."""
    from infllm_cupy.config import InfLLMv2Config
    from infllm_cupy.pipeline import infllmv2_attention, naive_infllmv2_attention
    from infllm_cupy.stage2.naive import naive_sparse_attn_varlen
    from infllm_cupy.testing import max_abs_err

    try:
        lengths = [1000, 2049, 333]
        q, k, v, cu = tie_free_inputs(lengths, HQ, H, D, device, seed=1234)
        cfg = InfLLMv2Config(topk=4, local_blocks=2, dense_len=0, score_dtype=torch.float32)
        L = max(lengths)
        with torch.no_grad():
            out, aux = infllmv2_attention(q, k, v, cu, cu, L, L, cfg, backend=backend, return_aux=True)
            _, ref_aux = naive_infllmv2_attention(q, k, v, cu, cu, L, L, cfg, return_aux=True)
            idx = ref_aux["topk_idx"]
            ref = naive_sparse_attn_varlen(q.double(), k.double(), v.double(), cu, cu, idx, L, L)
            lowp = naive_sparse_attn_varlen(q, k, v, cu, cu, idx, L, L, upcast=False)
        same = torch.equal(aux["topk_idx"], idx)
        err, base = max_abs_err(out, ref), max_abs_err(lowp, ref)
        ok = same and not bool(torch.isnan(out).any()) and err <= 2 * base + 1e-5
        return (f"check {'PASSED' if ok else 'FAILED'}: topk_idx {'identical' if same else 'DIFFERENT'}, "
                f"max|out - ref64| = {err:.2e} (bf16 reference {base:.2e})")
    except Exception as e:  # noqa: BLE001 - the verdict is reported, the timings still run
        return f"check FAILED: {harness.short_error(e)}"


class Runner:
    """Times rows, records failures in `row.note` instead of raising, and keeps a time budget."""

    def __init__(self, args, device: torch.device):
        self.args, self.device = args, device
        self.rows: list[harness.Row] = []
        self.t_start = time.perf_counter()

    def over_budget(self) -> bool:
        return self.args.budget_s > 0 and time.perf_counter() - self.t_start > self.args.budget_s

    def time(self, row: harness.Row, fn: Callable[[], object] | None, keys: float | None, n_q_rows: int,
             D: int, skip: str = "", memory: dict | None = None,
             keep: Callable[[object], object] | None = None) -> harness.Row:
        """Time `fn` into `row`. With `memory`, the first warm-up run also records its extra GPU memory
        as `memory[f"{row.impl}_GiB"]`, and `keep(result)` of that run is stored in `self.kept`."""
        a = self.args
        self.kept = None
        if keys is not None:
            row.keys_per_q = keys / n_q_rows
            row.flop = harness.flops_attn(keys, D, row.mode)
        why = harness.skip_reason(skip, fn, self.over_budget(), a.budget_s)
        if why:
            row.note = why
        else:
            try:
                def run():
                    with torch.no_grad():
                        return fn()
                warmup = a.warmup
                if memory is not None:
                    memory[f"{row.impl}_GiB"], out = extra_memory(run, self.device)
                    self.kept = keep(out) if keep else None
                    del out
                    warmup = max(0, warmup - 1)
                harness.time_row(row, run, a, self.device, warmup=warmup)
            except Exception as e:  # noqa: BLE001 - one row failing must not kill the table
                row.note = (row.note + "; " if row.note else "") + harness.short_error(e)
            finally:
                self.free()
        self.rows.append(row)
        print(f"  {row.impl:<10} {row.config} K={row.K} ms={row.ms if row.ms is None else round(row.ms, 3)} "
              f"TFLOP/s={row.tflops if row.tflops is None else round(row.tflops, 1)} {row.note}", flush=True)
        return row

    def free(self):
        harness.free_gpu_memory(self.device)

    def run_configs(self, bench_config: Callable[[int, int], dict], env: dict, check: str) -> list[dict]:
        """`bench_config(T, B)` for every `--configs` entry (a failing config becomes a row with a note),
        writing the JSON after each; returns the configs' memory records."""
        a, memory = self.args, []
        with no_validation(a.validate):
            for cfg in tqdm(a.configs, unit="config", disable=None):
                T, B = cfg[:2]
                try:
                    memory.append(bench_config(*cfg))
                except Exception as e:  # noqa: BLE001 - e.g. OOM building inputs: record it, go on
                    self.rows.append(harness.Row("config", harness.shape_id(B, T, a.hq, a.h, a.d),
                                                 note=f"config failed: {harness.short_error(e)}"))
                    print(f"config {T}x{B} failed: {harness.short_error(e)}", flush=True)
                self.free()     # the config's inputs went out of scope with bench_config
                if a.json:
                    harness.write_json(self.rows, a.json, env,
                                       extra={"check": check, "memory": memory, "argv": sys.argv[1:]})
        return memory

    def report(self, title: str, heading: str, recs: list[dict], cols: list[str], env: dict, check: str,
               memory: list[dict]) -> list[harness.Row]:
        """Print every row, then the per-config summary `recs` in `cols` (read from the tail), the check
        and the env line; write the final JSON. Returns the rows."""
        harness.print_table(self.rows, title=title)
        print(f"\n{heading}")
        print(harness.format_table(recs, cols) if recs else "(no configs ran)")
        print(f"\n{check}")
        print(harness.env_line(env, self.t_start), flush=True)
        if self.args.json:
            harness.write_json(self.rows, self.args.json, env,
                               extra={"check": check, "memory": memory, "summary": recs,
                                                              "argv": sys.argv[1:]})
        return self.rows


def load_flex(device: torch.device, compile_: bool):
    """`(flex_attention or its compiled form, BlockMask, "")`, or `(None, None, reason)`."""
    try:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention
    except Exception as e:  # noqa: BLE001
        return None, None, f"flex_attention not importable: {harness.short_error(e)}"
    if device.type == "cuda" and compile_:
        return torch.compile(flex_attention, dynamic=False), BlockMask, ""
    return flex_attention, BlockMask, ""


def flex_union_fn(flex, BlockMask, topk_idx, q, k, v, B: int, T: int, HQ: int):
    """`(fn, keys)`: FlexAttention over the 128x128 tiles covering `topk_idx` on `[B, heads, T, D]` copies."""
    fb = to_flex_block_mask_inputs(topk_idx, B, T, HQ)
    bm = BlockMask.from_kv_blocks(fb.kv_num_blocks, fb.kv_indices, fb.full_kv_num_blocks, fb.full_kv_indices,
                                  BLOCK_SIZE=(128, 128), mask_mod=harness.causal_mask, seq_lengths=(T, T))
    qt, kt, vt = (x.view(B, T, x.shape[1], x.shape[2]).transpose(1, 2).contiguous() for x in (q, k, v))
    return (lambda: flex(qt, kt, vt, block_mask=bm, enable_gqa=True)), fb.keys


def sdpa_cudnn_fn(q, k, v, B: int, T: int) -> tuple[Callable[[], object], str]:
    """`(fn, note)`: dense causal SDPA on the cuDNN backend (any backend on CPU) on `[B, heads, T, D]`
    copies. If the backend refuses GQA, K/V are repeated to `HQ` heads and the note says so."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qt, kt, vt = (x.view(B, T, x.shape[1], x.shape[2]).transpose(1, 2).contiguous() for x in (q, k, v))
    backends = [SDPBackend.CUDNN_ATTENTION] if q.is_cuda else [SDPBackend.MATH,
                                                               SDPBackend.EFFICIENT_ATTENTION]

    def call(kk, vv, gqa):
        with sdpa_kernel(backends), torch.no_grad():
            return torch.nn.functional.scaled_dot_product_attention(qt, kk, vv, is_causal=True,
                                                                    enable_gqa=gqa)

    try:
        call(kt, vt, True)
        return (lambda: call(kt, vt, True)), ""
    except RuntimeError as e:
        G = q.shape[1] // k.shape[1]
        kr, vr = (x.repeat_interleave(G, dim=1) for x in (kt, vt))
        return (lambda: call(kr, vr, False)), f"KV repeated to HQ heads ({harness.short_error(e)[:80]})"


def config_id(B: int, T: int, HQ: int, H: int, D: int, inputs: str = "random") -> str:
    """The rows' config id: the shape, with `-structured` for the structured inputs."""
    return harness.shape_id(B, T, HQ, H, D) + ("" if inputs == "random" else f"-{inputs}")


def config_setup(r: Runner, T: int, B: int, inputs: str = "random") -> tuple:
    """What every row of one `(T, B)` shares: `(cfg_id, cfg, K, q, k, v, cu, stages, cache_lens,
    n_q_rows)` with the MiniCPM4 config at `--topk` / `--local-blocks` and seeded inputs of the
    given kind (`random` or `structured`)."""
    from infllm_cupy.config import InfLLMv2Config
    from infllm_cupy.prefill import stages_for

    a = r.args
    cfg_id = config_id(B, T, a.hq, a.h, a.d, inputs)
    cfg = InfLLMv2Config(topk=a.topk, local_blocks=a.local_blocks, dense_len=0)
    K = cfg.topk + cfg.local_blocks
    print(f"\n== {cfg_id}: topk {cfg.topk} + local {cfg.local_blocks} (K = {K}), backend {a.backend}, "
          f"{inputs} inputs", flush=True)
    make = make_structured_inputs if inputs == "structured" else make_inputs
    q, k, v, cu = make(B, T, a.hq, a.h, a.d, r.device, a.seed)
    cache_lens = torch.zeros(B, dtype=torch.int32, device=r.device)
    return cfg_id, cfg, K, q, k, v, cu, stages_for(q, a.backend), cache_lens, B * T * a.hq


def bench_config(r: Runner, T: int, B: int, flex, BlockMask, flex_note: str = "",
                 inputs: str = "random") -> dict:
    """Time every requested row on one `(T, B)` and input kind; returns the memory record of the config
    (a config that cannot fit gets one row per requested impl, each with the reason)."""
    from infllm_cupy._rules import runs_kernels
    from infllm_cupy.pipeline import infllmv2_attention
    from infllm_cupy.prefill import select_blocks

    a = r.args
    HQ, H, D = a.hq, a.h, a.d
    skip = memory_skip_reason(B, T, HQ, H, D, a.topk + a.local_blocks, r.device)
    if skip:
        cfg_id = config_id(B, T, HQ, H, D, inputs)
        print(f"\n== {cfg_id}: {skip}", flush=True)
        for impl in a.impls:
            r.rows.append(harness.Row(impl, cfg_id, "-", a.topk + a.local_blocks, "fwd", note=skip))
        return {"config": cfg_id, "inputs": inputs, "T": T, "B": B, "skipped": skip}
    cfg_id, cfg, K, q, k, v, cu, stages, cache_lens, n_q_rows = config_setup(r, T, B, inputs)
    if r.device.type == "cuda":     # which stage-1 launch runs: one, or key-range passes (docs/stage1.md, 9.)
        from infllm_cupy.stage1.select import device_stage1_plan
        plan = device_stage1_plan(r.device, HQ // H, D, q.dtype, torch.bfloat16, -(-T // 64), rows=H * T * B)
        print(f"  stage-1 plan: {plan}", flush=True)

    def selection():
        return select_blocks(q, k, cu, cu, T, cache_lens, True, cfg, kernels=runs_kernels(q, a.backend),
                             need_scores=False)

    def pipeline():
        return infllmv2_attention(q, k, v, cu, cu, T, T, cfg, backend=a.backend)

    mem = {"config": cfg_id, "inputs": inputs, "T": T, "B": B, "topk_idx_GiB": H * B * T * K * 4 / 2**30}
    topk_idx = None
    if "selection" in a.impls:
        r.time(harness.Row("selection", cfg_id, "-", K, "fwd"), selection, None, n_q_rows, D, memory=mem,
               keep=lambda aux: aux["topk_idx"])
        topk_idx = r.kept
    if topk_idx is None:     # not requested, or it failed: the other rows still need the selection
        with torch.no_grad():
            topk_idx = selection()["topk_idx"]
    r.free()
    keys = (HQ // H) * int(attended_keys(topk_idx, cu).sum())

    def stage2():
        return stages["sparse_attn"](q, k, v, cu, cu, topk_idx, T, T, causal=True, block_size=cfg.block_size)

    if "stage2" in a.impls:
        r.time(harness.Row("stage2", cfg_id, "-", K, "fwd"), stage2, keys, n_q_rows, D)
    if "pipeline" in a.impls:
        r.time(harness.Row("pipeline", cfg_id, "-", K, "fwd"), pipeline, keys, n_q_rows, D, memory=mem)
    for impl, packed in ARITH.items():
        if impl in a.impls:
            fn = selection if impl.startswith("selection") else pipeline
            with forced_stage1(packed=packed):
                r.time(harness.Row(impl, cfg_id, "-", K, "fwd"), fn, None if fn is selection else keys,
                       n_q_rows, D)
    if "sdpa_cudnn" in a.impls:
        try:
            (fn, note), skip = sdpa_cudnn_fn(q, k, v, B, T), ""
        except Exception as e:  # noqa: BLE001
            fn, note, skip = None, "", f"setup: {harness.short_error(e)}"
        r.time(harness.Row("sdpa_cudnn", cfg_id, "-", None, "fwd", note=note), fn,
               harness.causal_dense_keys(B, T, HQ), n_q_rows, D, skip)
        fn = None
        r.free()
    if "flex_union" in a.impls:
        fn, fkeys, skip = None, None, flex_note
        if flex is not None:
            try:
                fn, fkeys = flex_union_fn(flex, BlockMask, topk_idx, q, k, v, B, T, HQ)
            except Exception as e:  # noqa: BLE001
                skip = f"setup: {harness.short_error(e)}"
        r.time(harness.Row("flex_union", cfg_id, "-", K, "fwd"), fn, fkeys, n_q_rows, D, skip)
    return mem


def summary(rows: list[harness.Row], memory: list[dict]) -> list[dict]:
    """One line per config: ms of every row, selection / stage 2, anchor ms / pipeline ms, the
    selection's share of the pipeline and memory."""
    by = {(x.config, x.impl): x for x in rows}
    out = []
    for m in memory:
        c = m["config"]
        ms = {i: (by[(c, i)].ms if (c, i) in by else None) for i in IMPLS}
        pipe = ms["pipeline"]
        rec = {"config": c, "inputs": m.get("inputs", "random"), "T": m.get("T"), "B": m.get("B"),
               **{f"{i}_ms": ms[i] for i in IMPLS}}
        rec["selection/stage2"] = ms["selection"] / ms["stage2"] if ms["selection"] and ms["stage2"] else None
        for arith in ("exact", "packed"):
            sel_ms, pipe_ms = ms[f"selection_{arith}"], ms[f"pipeline_{arith}"]
            rec[f"selection_{arith}/stage2"] = sel_ms / ms["stage2"] if sel_ms and ms["stage2"] else None
            rec[f"sdpa_cudnn/pipeline_{arith}"] = (ms["sdpa_cudnn"] / pipe_ms if ms["sdpa_cudnn"] and pipe_ms
                                                   else None)
        for i in ANCHORS:
            rec[f"{i}/pipeline"] = ms[i] / pipe if ms[i] and pipe else None
            if (c, "pipeline") in by and ms[i] and pipe:
                by[(c, "pipeline")].ratios[i] = ms[i] / pipe
        rec["selection_share"] = ms["selection"] / pipe if ms["selection"] and pipe else None
        rec["sel_mem_GiB"], rec["pipe_mem_GiB"] = m.get("selection_GiB"), m.get("pipeline_GiB")
        rec["topk_idx_GiB"] = m.get("topk_idx_GiB")
        out.append(rec)
    return out


# The selection and pipeline goals (H100, README head config, K = 96): (T, B, inputs or None for every kind,
# column, "min" / "max", target, label). The selection goals were stated on the pipeline's own selection.
GOALS = (
    (32768, 8, "structured", "sdpa_cudnn/pipeline", "min", 2.0,
     "whole pipeline vs dense cuDNN SDPA, 32k x 8"),
    (131072, 2, "structured", "sdpa_cudnn/pipeline", "min", 5.0,
     "whole pipeline vs dense cuDNN SDPA, 128k x 2"),
    (131072, 2, None, "selection/stage2", "max", 0.20, "selection / stage 2, 128k x 2"),
    (32768, 8, None, "selection/stage2", "max", 0.10, "selection / stage 2, 32k x 8"),
    (524288, 1, None, "selection/stage2", "max", 0.35, "selection / stage 2, 512k x 1"),
    (524288, 1, None, "sel_mem_GiB", "mem", 4.0, "selection extra memory O(total_q x K), 512k x 1"),
)


def goal_verdicts(recs: list[dict]) -> list[dict]:
    """Every goal of `GOALS` whose config ran (per input kind): value, target, met. The memory goal
    compares the selection's extra GPU memory with 4x `topk_idx` (O(total_q x K))."""
    out = []
    for T, B, inputs, col, kind, target, label in GOALS:
        for rec in recs:
            if rec.get("T") != T or rec.get("B") != B or (inputs is not None and rec.get("inputs") != inputs):
                continue
            value = rec.get(col)
            if kind == "mem":
                bound = target * rec["topk_idx_GiB"] if rec.get("topk_idx_GiB") else None
                met = None if value is None or bound is None else value <= bound
                want = f"<= {bound:.2f} GiB (4 x topk_idx)" if bound else "-"
            else:
                met = None if value is None else (value >= target if kind == "min" else value <= target)
                want = f"{'>=' if kind == 'min' else '<='} {target:g}"
            out.append({"goal": f"{label} ({rec['inputs']} inputs)", "value": value, "target": want,
                        "met": "not run" if met is None else ("MET" if met else "NOT MET")})
    return out


def add_common_args(p: argparse.ArgumentParser, impls: tuple[str, ...]) -> None:
    harness.add_run_args(p, target_ms=1000.0, min_rep=2, max_rep=10)
    p.add_argument("--max-configs", type=int, default=0, help="run only the first N configs (0: all)")
    p.add_argument("--backend", default="auto", choices=("auto", "kernels", "reference"),
                   help="stage implementations (infllm_cupy.prefill.stages_for). Default: auto")
    p.add_argument("--topk", type=int, default=64,
                   help="blocks picked by score (MiniCPM4: 64); K = topk + local_blocks, forced blocks "
                        "included")
    p.add_argument("--local-blocks", type=int, default=32, help="local window in blocks (MiniCPM4: 32)")
    p.add_argument("--impls", default=",".join(impls), help=f"subset of {','.join(impls)}")
    p.add_argument("--skip-check", action="store_true", help="skip the check against the reference pipeline")
    p.add_argument("--validate", action="store_true",
                   help="keep the launchers' value checks (a host sync per call) while timing")


def finish_args(p: argparse.ArgumentParser, a, impls: tuple[str, ...]):
    dev = torch.device(a.device)
    if a.configs is None:
        a.configs = ("8kx2" if dev.type == "cuda" else "512x2") if a.quick else harness.README_CONFIGS
    a.configs = [harness.parse_config(c) for c in a.configs.split(",") if c]
    if a.max_configs > 0:
        a.configs = a.configs[:a.max_configs]
    a.impls = harness.csv_choices(p, "--impls", a.impls, impls)
    harness.check_run_args(p, a, quick_target_ms=300.0, quick_max_rep=5)
    return a


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    add_common_args(p, IMPLS)
    p.set_defaults(impls=",".join(DEFAULT_IMPLS))
    p.add_argument("--inputs", default="random",
                   help=f"comma-separated input kinds, each config runs once per kind: {','.join(INPUTS)}. "
                        f"Default: random")
    p.add_argument("--stage1-range-blocks", type=int, default=0,
                   help="force stage 1's key-range split with ranges of this many blocks (a multiple of 64) "
                        "wherever K fits one (docs/stage1.md, 9. Long context: key ranges); 0: the plan's "
                        "choice")
    a = p.parse_args(argv)
    if a.stage1_range_blocks < 0 or a.stage1_range_blocks % 64:
        p.error(f"--stage1-range-blocks must be 0 or a positive multiple of 64, got {a.stage1_range_blocks}")
    if a.configs:       # "1Mx1": M = 1024k
        a.configs = re.sub(r"(\d+(?:\.\d+)?)[mM]x", lambda m: f"{round(float(m.group(1)) * 1024)}kx",
                           a.configs)
    a = finish_args(p, a, IMPLS)
    a.inputs = harness.csv_choices(p, "--inputs", a.inputs, INPUTS)
    if not a.inputs:
        p.error("--inputs must name at least one of " + ",".join(INPUTS))
    a.configs = [(T, B, inputs) for T, B in a.configs for inputs in a.inputs]
    return a


@contextlib.contextmanager
def forced_stage1(**fields):
    """While active, every sm_90a stage-1 plan of the kernels has `fields` (e.g. `packed=True`)."""
    import dataclasses

    from infllm_cupy.stage1 import select as sel

    real = sel.stage1_plan

    def plan(*args, **kw):
        p = real(*args, **kw)
        return dataclasses.replace(p, **fields) if p.kernel == "sm90a" else p
    sel.stage1_plan = plan
    try:
        yield
    finally:
        sel.stage1_plan = real


@contextlib.contextmanager
def forced_stage1_ranges(range_blocks: int):
    """While active, every stage-1 plan of the kernels splits into ranges of `range_blocks` blocks
    (0: no change): to measure the split against one launch where both fit."""
    if not range_blocks:
        yield
        return
    import dataclasses

    from infllm_cupy.stage1 import select as sel

    real = sel.stage1_plan
    sel.stage1_plan = lambda *args, **kw: dataclasses.replace(real(*args, **kw), range_blocks=range_blocks)
    try:
        yield
    finally:
        sel.stage1_plan = real


def no_validation(keep: bool):
    """`_env.override(validate=False)` unless `keep`: the launchers' host reads of `cu_seqlens` are
    not timed."""
    return contextlib.nullcontext() if keep else _env.override(validate=False)


def main(argv=None) -> list[harness.Row]:
    a = parse_args(argv)
    dev = torch.device(a.device)
    env = harness.env_stamp()
    harness.print_env(env)
    from infllm_cupy.prefill import stage_names, stages_for

    probe = torch.empty(0, device=dev)
    for name, impl in stage_names(stages_for(probe, a.backend)).items():
        print(f"stage {name:14s} {impl}")
    check = "check skipped (--skip-check)" if a.skip_check else check_against_reference(dev, a.backend, a.hq,
                                                                                        a.h,
                                                                                          a.d)
    print(check, flush=True)
    flex, BlockMask, flex_note = (load_flex(dev, not a.no_compile) if "flex_union" in a.impls
                                  else (None, None, "not requested"))
    r = Runner(a, dev)
    with forced_stage1_ranges(a.stage1_range_blocks):
        if a.stage1_range_blocks:
            print(f"stage 1: key ranges of {a.stage1_range_blocks} blocks forced (--stage1-range-blocks)")
        memory = r.run_configs(lambda T, B, inputs: bench_config(r, T, B, flex, BlockMask, flex_note, inputs),
                               env, check)
    ran = {x.impl for x in r.rows}
    arith = [c for x in ("exact", "packed") if f"selection_{x}" in ran or f"pipeline_{x}" in ran
             for c in (f"selection_{x}/stage2", f"sdpa_cudnn/pipeline_{x}")]
    cols = ["config", *[f"{i}_ms" for i in IMPLS if i in ran], "selection/stage2", *arith,
            *[f"{i}/pipeline" for i in ANCHORS],
            "selection_share", "sel_mem_GiB", "pipe_mem_GiB"]
    recs = summary(r.rows, memory)
    rows = r.report("All rows (ms = median; TFLOP/s effective on attended keys; keys_per_q per query head)",
                    "Per config: ms of each row, selection ms / stage-2 ms, anchor ms / pipeline ms (> 1: "
                    "ours faster), selection share of the pipeline, extra GPU memory (GiB)", recs, cols, env,
                    check, memory)
    gl = goal_verdicts(recs)
    print("\n### Goals (selection and pipeline; H100, README head config, K = 96)")
    print(harness.format_table(gl, ["goal", "value", "target", "met"], max_width=80) if gl
          else "(no config of a goal ran: 32kx8, 128kx2, 512kx1)")
    if a.json:
        harness.write_json(rows, a.json, env, extra={"check": check, "memory": memory, "summary": recs,
                                                     "goals": gl, "argv": sys.argv[1:]})
    return rows


if __name__ == "__main__":
    main()
