r"""The decode top-k: the CTA-wide top-k launch alone, on several CTA sizes, and inside stage 1
for decode (docs/decode.md, "Stage 1 for decode: the split kernels"). GPU only; CUDA-graph replays.

    python benchmarks/bench_select_topk.py                          # 1x128k,8x128k,8x32k,1x32k (< 60 s, H100)
    python benchmarks/bench_select_topk.py --configs 1x128k --json out.json

Configs are BATCHxCONTEXT (k = 1024), README head config (HQ 32, H 2, D 128, bf16), K = topk +
local_blocks = 96 by default, full caches of CONTEXT keys. Rows (`impl`):
    topk            the top-k launch alone (`select_topk_rows`) on block scores of the config's shape
                    (positive, spread like pooled softmax sums, rounded to --score), on TOPK_THREADS
                    (512) threads, as select_decode launches it
    topk_tN         the same on N threads (--topk-threads)
    select          `select_decode` with the default plan (coarse, fine and top-k launches)
A graph holds --inner calls back to back; `us` is the replay time divided by --inner (a launch's share
of the replay gaps included). `same` (topk rows) says whether the selection equals `emulate_topk_rows`'s.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import _harness as harness  # noqa: E402

SCORES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _short(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"


def bench_config(a, B: int, L: int) -> list[dict]:
    """The rows of one config (dicts: impl, config, score, us, us_p20, us_p80, same, note)."""
    from infllm_cupy.decode.select_decode import (
        emulate_topk_rows,
        plan_select_decode,
        select_decode,
        select_topk_rows,
    )

    dev, sdt = torch.device("cuda"), SCORES[a.score]
    cfg_id = f"{B}x{L // 1024}k" if L % 1024 == 0 else f"{B}x{L}"
    g = torch.Generator(device=dev).manual_seed(0)
    try:
        cache = harness.random_cache(B, L, a.h, a.d, torch.bfloat16, dev, g)
        q = torch.randn(B, a.hq, a.d, generator=g, device=dev, dtype=torch.bfloat16)
    except torch.OutOfMemoryError as e:
        return [{"impl": "-", "config": cfg_id, "note": f"inputs: {_short(e)}"}]
    H, N1, N2 = a.h, cache.ck1.shape[1], cache.ck2.shape[1]
    out_len = -(-cache.capacity // 64)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    plan = plan_select_decode(B, H, a.hq // H, N1, N2, sms)
    nb = 16 * plan.fine_tiles * plan.fine_ranges
    # block scores: positive, a few orders of magnitude apart (pooled group sums of probabilities)
    blk = torch.exp2(torch.randn(B, H, nb, generator=g, device=dev) * 4 - 12).to(sdt).float()
    lead = torch.exp2(torch.randn(B, H, plan.fine_ranges, generator=g, device=dev) * 4 - 12).to(sdt).float()
    kw = dict(topk=a.topk, local_blocks=a.local_blocks, init_blocks=1, score_dtype=sdt)
    calls = {"topk": lambda: select_topk_rows(blk, lead, cache.seqlens, out_len, fine_tiles=plan.fine_tiles,
                                              **kw)}
    for n in a.topk_threads:
        calls[f"topk_t{n}"] = lambda n=n: select_topk_rows(
            blk, lead, cache.seqlens, out_len, fine_tiles=plan.fine_tiles, threads=n, **kw)
    calls["select"] = lambda: select_decode(q, cache.ck1, cache.ck2, cache.seqlens, out_len,
                                            softmax_scale=None, exact=False, plan=plan, **kw)
    print(f"\n== {cfg_id}: out_len {out_len}, K {min(a.topk + a.local_blocks, out_len)}, {plan}", flush=True)
    recs, results = [], {}
    want = emulate_topk_rows(blk, lead, cache.seqlens, out_len, fine_tiles=plan.fine_tiles, **kw)
    impls = ("topk", *(f"topk_t{n}" for n in a.topk_threads), "select")
    for impl in impls:
        rec = {"impl": impl, "config": cfg_id, "score": a.score}
        try:
            results[impl] = calls[impl]()
            torch.cuda.synchronize()
            times = harness.bench_gpu_time(harness.capture_graph(calls[impl], a.inner).replay, warmup=3,
                                           rep=a.rep, target_ms=300, min_rep=10, max_rep=100, device=dev)
            st = harness.summarize(times)
            rec["us"] = st["ms"] * 1e3 / a.inner
            rec["us_p20"], rec["us_p80"] = st["ms_p20"] * 1e3 / a.inner, st["ms_p80"] * 1e3 / a.inner
        except Exception as e:  # noqa: BLE001 - one row failing must not end the table
            rec["note"] = _short(e)
        recs.append(rec)
    for rec in recs:
        if rec["impl"].startswith("topk") and rec["impl"] in results:
            rec["same"] = bool(torch.equal(results[rec["impl"]].cpu(), want))
        print(f"  {rec}", flush=True)
    return recs


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="1x128k,8x128k,8x32k,1x32k", help="comma-separated BATCHxCONTEXT")
    p.add_argument("--hq", type=int, default=32)
    p.add_argument("--h", type=int, default=2)
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--topk", type=int, default=64)
    p.add_argument("--local-blocks", type=int, default=32)
    p.add_argument("--score", choices=tuple(SCORES), default="bf16", help="score dtype (the top-k key width)")
    p.add_argument("--inner", type=int, default=20, help="calls per graph replay. Default: %(default)s")
    p.add_argument("--topk-threads", default="128,256", help="topk_tN rows (multiples of 32 up to 512)")
    p.add_argument("--rep", type=int, default=None, help="timed replays; default adaptive")
    p.add_argument("--json", default=None, help="write the rows and the env stamp to this file")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_select_topk: needs a CUDA GPU; nothing to do")
        return []
    if a.inner < 1 or a.hq % a.h:
        p.error("--inner must be >= 1 and --hq a multiple of --h")
    a.topk_threads = [int(x) for x in a.topk_threads.split(",") if x]
    try:
        configs = [harness.parse_decode_config(c) for c in a.configs.split(",") if c]
    except ValueError:
        p.error(f"--configs: expected BATCHxCONTEXT entries like 8x128k, got {a.configs!r}")
    env, t_start = harness.env_stamp(), time.perf_counter()
    recs = []
    for B, L in configs:
        recs += bench_config(a, B, L)
        torch.cuda.empty_cache()
    print()
    cols = ["impl", "config", "score", "us", "us_p20", "us_p80", "same", "note"]
    print(harness.format_table(recs, cols, max_width=100))
    print(harness.env_line(env, t_start))
    if a.json:
        import json

        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps({"env": env, "rows": recs}, indent=1, default=str))
    return recs


if __name__ == "__main__":
    main()
