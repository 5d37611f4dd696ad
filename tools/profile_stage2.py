"""One stage-2 forward launch per requested kernel variant, for Nsight Compute.

    ncu --kernel-name regex:stage2_fwd --section SpeedOfLight --section WarpStateStats \
        python tools/profile_stage2.py --fwd sm90a 4,2,64 --T 8192 --B 2 --K 64 --sel a

Variants are the forward names of tools/_plans.py (sm90a, sm80, sm90a_pair, sm90a_single,
sm90a_split, W,M,K, each with optional +FIELD=VALUE plan fields), run through the token-level
launcher (`ops.token_fwd`) with that plan (and, for a forced step shape, its `_force_steps`).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from infllm_cupy.selections import block_shared, infllm_like, per_token, uniform_cu_seqlens
from infllm_cupy.stage2 import ops

from _plans import fwd_variant_named

SELECTIONS = {"a": block_shared, "b": per_token, "c": infllm_like}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--fwd", nargs="+", default=["sm90a"],
                   help="forward variants (tools/_plans.py): sm90a, sm80, sm90a_pair, sm90a_single, "
                        "sm90a_split, W,M,K (SM80 tiles); +FIELD=VALUE sets a plan field")
    p.add_argument("--T", type=int, default=8192)
    p.add_argument("--B", type=int, default=2)
    p.add_argument("--K", type=int, default=64)
    p.add_argument("--sel", default="a", choices=sorted(SELECTIONS))
    a = p.parse_args()
    HQ, H, D = 32, 2, 128
    q = torch.randn(a.B * a.T, HQ, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(a.B * a.T, H, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(a.B * a.T, H, D, device="cuda", dtype=torch.bfloat16)
    cu = uniform_cu_seqlens(a.B, a.T, "cuda")
    topk = SELECTIONS[a.sel](a.B, a.T, H, a.K, device="cuda", seed=0)
    with torch.no_grad():
        for name in a.fwd:
            plan, launch = fwd_variant_named(name, q, k, a.T, 2 * a.K)
            ops.token_fwd(q, k, v, cu, cu, topk, a.T, a.T, True, D ** -0.5, plan, **launch)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
