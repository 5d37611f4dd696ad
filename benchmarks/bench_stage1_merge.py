r"""Stage 1's key-range merge alone (docs/stage1.md, 9. Long context: key ranges; its paragraph "The
merge kernel"): the kernel `merge_range_candidates` against the torch merge (`torch.topk` over the union) that
it replaces, per range pass, and whether their running top-K are identical. GPU only.

    python benchmarks/bench_stage1_merge.py                         # the default cases below
    python benchmarks/bench_stage1_merge.py --cases 1m:96 --key-bits 32

Cases `T:K` (T tokens, H = 2 KV heads: H x T rows of K candidates; random order-preserving keys, the
candidates of two ranges with distinct blocks, ascending in block as the range kernel writes them).
Columns: `first` = the first range (kernel: sort its candidates; torch: the key conversion),
`merge` = one later range merged into the running top-K (in place; the copy that restores the
running list between repetitions is timed apart and subtracted).
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

from benchmarks._harness import bench_gpu_time, env_line, env_stamp, format_table, summarize  # noqa: E402


def parse_case(s: str) -> tuple[int, int]:
    t, k = s.lower().split(":")
    scale = 2**20 if t.endswith("m") else 2**10 if t.endswith("k") else 1
    return round(float(t.rstrip("mk")) * scale), int(k)


def candidates(H: int, T: int, K: int, first_block: int, key_bits: int, g: torch.Generator, device):
    keys = torch.randint(0, 2**key_bits, (H, T, K), generator=g, device=device, dtype=torch.int64)
    keys = (keys - (keys >= 2**31).to(torch.int64) * 2**32).to(torch.int32)     # int32 storage of uint32
    idx = (first_block + torch.arange(K, device=device, dtype=torch.int32)).expand(H, T, K).contiguous()
    return keys, idx


def time_case(sel, H: int, T: int, K: int, key_bits: int, rep: int, dev) -> dict:
    g = torch.Generator(device=dev).manual_seed(0)
    c0 = candidates(H, T, K, 0, key_bits, g, dev)
    c1 = candidates(H, T, K, 2 * K + 64, key_bits, g, dev)
    rec = {"case": f"{T}:{K}", "rows": H * T, "K": K}
    run_k, run_t = sel._merge_into_kernel(None, *c0, K), sel._merge_into_torch(None, *c0, K)
    base_k, base_t = run_k.clone(), run_t.clone()
    sel._merge_into_kernel(run_k, *c1, K)
    sel._merge_into_torch(run_t, *c1, K)
    rec["identical"] = bool(torch.equal(run_k, run_t.sort(-1, descending=True).values))

    def ms(fn):
        return summarize(bench_gpu_time(fn, warmup=1, rep=rep, device=dev))["ms"]

    rec["kernel_first_ms"] = ms(lambda: sel._merge_into_kernel(None, *c0, K))
    rec["torch_first_ms"] = ms(lambda: sel._merge_into_torch(None, *c0, K))
    copy_ms = ms(lambda: run_k.copy_(base_k))      # restores the running list between repetitions
    rec["kernel_merge_ms"] = ms(lambda: sel._merge_into_kernel(run_k.copy_(base_k), *c1, K)) - copy_ms
    rec["torch_merge_ms"] = ms(lambda: sel._merge_into_torch(run_t.copy_(base_t), *c1, K)) - copy_ms
    rec["speedup"] = rec["torch_merge_ms"] / max(rec["kernel_merge_ms"], 1e-6)
    return rec


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="128k:96,256k:96,1m:96,256k:20,256k:256,64k:1024",
                   help="comma-separated T:K (T with k = 1024, m = 2^20). Default: %(default)s")
    p.add_argument("--h", type=int, default=2)
    p.add_argument("--key-bits", type=int, default=16, choices=(16, 32))
    p.add_argument("--rep", type=int, default=10)
    a = p.parse_args(argv)
    try:
        cases = [parse_case(c) for c in a.cases.split(",") if c]
    except ValueError:
        p.error(f"--cases must be comma-separated T:K, got {a.cases!r}")
    if not torch.cuda.is_available():
        print("bench_stage1_merge: needs a CUDA GPU; nothing to do")
        return []
    from infllm_cupy.stage1 import select as sel

    if any(not 1 <= K <= sel.MERGE_MAX_K or T < 1 for T, K in cases):
        p.error(f"--cases: T >= 1 and K in [1, {sel.MERGE_MAX_K}] (the merge kernel's bound), got "
                f"{a.cases!r}")
    dev = torch.device("cuda")
    env, t_start = env_stamp(), time.perf_counter()
    recs = []
    for T, K in cases:
        rec = time_case(sel, a.h, T, K, a.key_bits, a.rep, dev)
        recs.append(rec)
        print(f"  {rec}", flush=True)
        torch.cuda.empty_cache()
    print()
    print(format_table(recs, ["case", "rows", "K", "kernel_first_ms", "torch_first_ms", "kernel_merge_ms",
                              "torch_merge_ms", "speedup", "identical"], max_width=100))
    print(env_line(env, t_start))
    return recs


if __name__ == "__main__":
    main()
