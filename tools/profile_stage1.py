"""Two `stage1_select` launches (K = 96) on random inputs, for Nsight Compute (development tool).

    ncu --kernel-name regex:stage1_select --launch-skip 1 --launch-count 1 \
        --section SpeedOfLight --section WarpStateStats python tools/profile_stage1.py --T 32768

`--packed` / `--exact`: the sm_90a plan's group sum forced to f16 pairs or to float32
(`Stage1Plan.packed`); default: the plan's own choice.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from infllm_cupy.compress import compress_k
from infllm_cupy.selections import uniform_cu_seqlens
from infllm_cupy.stage1 import select as sel
from infllm_cupy.stage1.select import stage1_select


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--T", type=int, default=32768)
    p.add_argument("--B", type=int, default=1)
    arith = p.add_mutually_exclusive_group()
    arith.add_argument("--packed", action="store_true", help="force Stage1Plan.packed = True (sm_90a)")
    arith.add_argument("--exact", action="store_true", help="force Stage1Plan.packed = False")
    a = p.parse_args()
    if a.packed or a.exact:
        real = sel.stage1_plan

        def plan(*args, **kw):
            pl = real(*args, **kw)
            return dataclasses.replace(pl, packed=a.packed) if pl.kernel == "sm90a" else pl
        sel.stage1_plan = plan
    HQ, H, D = 32, 2, 128
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(a.B * a.T, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(a.B * a.T, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    cu = uniform_cu_seqlens(a.B, a.T, "cuda")
    ck1, cu1 = compress_k(k, cu, 32, 16, backend="kernels")
    ck2, cu2 = compress_k(k, cu, 128, 64, backend="kernels")
    for _ in range(2):
        stage1_select(q, ck1, ck2, cu, cu1, cu2, a.T, topk=64, local_blocks=32)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
