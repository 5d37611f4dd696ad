r"""InfLLM-v2 block selection (compression + stage 1 + top-k), step by step, against dense attention.

    python benchmarks/bench_stage1.py --quick                                    # smoke run, one small config
    python benchmarks/bench_stage1.py --configs 32kx8 --json benchmarks/results/stage1_32k.json
    python benchmarks/bench_stage1.py --configs 32kx8,64kx4,128kx2 --max-configs 2

Rows (impl), all under `no_grad`, with the implementations `stages_for(q, --backend)` picks:
    compress_fine    key compression 32/16 (`stages["compress_k"]`)
    compress_coarse  key compression 128/64
    stage1_select    scores + block pooling + top-k from the compressed keys (`stages["stage1_select"]`,
                     as the pipeline calls it without `return_aux`: only `topk_idx` returned)
    scores, pool, topk
                     the three steps of `stage1_select` separately, timed where `--backend` picks the
                     reference (the CUDA kernels and the CPU implementation fuse them)
    selection        all of it as the pipeline runs it (`pipeline.select_blocks`)
    sdpa_cudnn       dense causal SDPA (cuDNN) on the same inputs, the scale to compare with
Memory: each step's extra GPU memory (`torch.cuda.max_memory_allocated()` during one call minus what
was allocated before it). The stage-1 reference takes about 0.8 s per 32k-token sequence on an H100
(T^2 growth), and its fp32 score matrix `[H, B*T, T/16]` dominates memory at 128k: use `--configs` /
`--max-configs` to keep one command within its time limit.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import bench_pipeline as bp  # noqa: E402
from benchmarks._harness import Row, causal_dense_keys, env_stamp, print_env, short_error  # noqa: E402

IMPLS = ("compress_fine", "compress_coarse", "stage1_select", "scores", "pool", "topk", "selection",
         "sdpa_cudnn")
STEPS = ("scores", "pool", "topk")


def bench_config(r: bp.Runner, T: int, B: int) -> dict:
    """Time every requested row on one `(T, B)`; returns the memory record of the config."""
    from infllm_cupy._rules import runs_kernels
    from infllm_cupy.prefill import select_blocks
    from infllm_cupy.stage1.naive import (
        naive_pool_blocks,
        naive_select_topk,
        naive_stage1_scores,
        naive_stage1_select,
        q_block_idx_prefill,
    )

    a = r.args
    HQ, D = a.hq, a.d
    cfg_id, cfg, K, q, k, v, cu, stages, cache_lens, n_q_rows = bp.config_setup(r, T, B)
    mem = {"config": cfg_id}
    with torch.no_grad():
        (ck1, cu1), (ck2, cu2) = (stages["compress_k"](k, cu, cfg.kernel_size, cfg.kernel_stride),
                                  stages["compress_k"](k, cu, cfg.coarse_kernel_size,
                                                       cfg.coarse_kernel_stride))
    stage1_kw = {"causal": True, "cache_lens": cache_lens, "softmax_scale": cfg.softmax_scale,
                 "topk": cfg.topk,
                 "local_blocks": cfg.local_blocks, "init_blocks": cfg.init_blocks,
                 "block_size": cfg.block_size,
                 "kernel_stride": cfg.kernel_stride, "coarse_kernel_stride": cfg.coarse_kernel_stride,
                 "varlen_offset_quirk": cfg.varlen_offset_quirk, "score_dtype": cfg.score_dtype}
    fns = {
        "compress_fine": lambda: stages["compress_k"](k, cu, cfg.kernel_size, cfg.kernel_stride),
        "compress_coarse": lambda: stages["compress_k"](k, cu, cfg.coarse_kernel_size,
                                                        cfg.coarse_kernel_stride),
        "stage1_select": lambda: stages["stage1_select"](q, ck1, ck2, cu, cu1, cu2, T, return_scores=False,
                                                         **stage1_kw),
        "selection": lambda: select_blocks(q, k, cu, cu, T, cache_lens, True, cfg,
                                           kernels=runs_kernels(q, a.backend), need_scores=False),
    }
    # The reference's three steps, on inputs made once by the step before.
    scores = block_scores = q_blocks = None
    if stages["stage1_select"] is naive_stage1_select and any(s in a.impls for s in STEPS):
        with torch.no_grad():
            scores = naive_stage1_scores(q, ck1, ck2, cu, cu1, cu2, T, causal=True,
                                         softmax_scale=cfg.softmax_scale,
                                         score_dtype=cfg.score_dtype, kernel_stride=cfg.kernel_stride,
                                         coarse_kernel_stride=cfg.coarse_kernel_stride)
            block_scores = naive_pool_blocks(scores, cu, cu1, cache_lens, T, init_blocks=cfg.init_blocks,
                                             local_blocks=cfg.local_blocks, block_size=cfg.block_size,
                                             kernel_stride=cfg.kernel_stride)
            q_blocks = q_block_idx_prefill(cu, T, block_size=cfg.block_size,
                                           varlen_offset_quirk=cfg.varlen_offset_quirk, cache_lens=cache_lens)
        fns["scores"] = lambda: naive_stage1_scores(q, ck1, ck2, cu, cu1, cu2, T, causal=True,
                                                    softmax_scale=cfg.softmax_scale,
                                                    score_dtype=cfg.score_dtype,
                                                    kernel_stride=cfg.kernel_stride,
                                                    coarse_kernel_stride=cfg.coarse_kernel_stride)
        fns["pool"] = lambda: naive_pool_blocks(scores, cu, cu1, cache_lens, T, init_blocks=cfg.init_blocks,
                                                local_blocks=cfg.local_blocks, block_size=cfg.block_size,
                                                kernel_stride=cfg.kernel_stride)
        fns["topk"] = lambda: naive_select_topk(block_scores, q_blocks, topk=cfg.topk,
                                                local_blocks=cfg.local_blocks)
    for impl in IMPLS[:-1]:
        if impl not in a.impls:
            continue
        fn = fns.get(impl)
        skip = "" if fn is not None else "stage 1 is fused here: its steps are timed with --backend reference"
        r.time(Row(impl, cfg_id, "-", K, "fwd"), fn, None, n_q_rows, D, skip, memory=mem)
    if "sdpa_cudnn" in a.impls:
        try:
            (fn, note), skip = bp.sdpa_cudnn_fn(q, k, v, B, T), ""
        except Exception as e:  # noqa: BLE001
            fn, note, skip = None, "", f"setup: {short_error(e)}"
        r.time(Row("sdpa_cudnn", cfg_id, "-", None, "fwd", note=note), fn, causal_dense_keys(B, T, HQ),
               n_q_rows, D, skip)
    return mem


def summary(rows: list[Row], memory: list[dict]) -> list[dict]:
    """One line per config: ms of every row, the selection against dense SDPA, and each step's memory."""
    by = {(x.config, x.impl): x for x in rows}
    out = []
    for m in memory:
        c = m["config"]
        rec = {"config": c, **{f"{i}_ms": (by[(c, i)].ms if (c, i) in by else None) for i in IMPLS}}
        sel, dense = rec["selection_ms"], rec["sdpa_cudnn_ms"]
        rec["selection/sdpa"] = sel / dense if sel and dense else None
        rec.update({k: v for k, v in m.items() if k.endswith("_GiB")})
        out.append(rec)
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    bp.add_common_args(p, IMPLS)
    return bp.finish_args(p, p.parse_args(argv), IMPLS)


def main(argv=None) -> list[Row]:
    a = parse_args(argv)
    dev = torch.device(a.device)
    env = env_stamp()
    print_env(env)
    from infllm_cupy.prefill import stage_names, stages_for

    for name, impl in stage_names(stages_for(torch.empty(0, device=dev), a.backend)).items():
        print(f"stage {name:14s} {impl}")
    check = ("check skipped (--skip-check)" if a.skip_check
             else bp.check_against_reference(dev, a.backend, a.hq, a.h, a.d))
    print(check, flush=True)
    r = bp.Runner(a, dev)
    memory = r.run_configs(lambda T, B: bench_config(r, T, B), env, check)
    recs = summary(r.rows, memory)
    mem_cols = [f"{i}_GiB" for i in IMPLS if any(f"{i}_GiB" in rec for rec in recs)]
    cols = ["config", *[f"{i}_ms" for i in IMPLS], "selection/sdpa", *mem_cols]
    return r.report("All rows (ms = median)",
                    "Per config: ms of each step, selection ms / dense SDPA ms, extra GPU memory of each "
                    "step (GiB)",
                    recs, cols, env, check, memory)


if __name__ == "__main__":
    main()
