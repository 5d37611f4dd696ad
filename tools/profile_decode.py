r"""A few decode calls at one config, for Nsight Compute (docs/decode.md, 13. Measured).

    ncu --clock-control none -k regex:"decode|topk" --launch-skip 8 \
        python tools/profile_decode.py --config 8x32k --what sparse
    --what sparse        sparse_decode over K = topk + local_blocks random blocks (stage 2 alone)
    --what dense_weights sparse_decode over every block with return_attn_weights=True
    --what step          infllmv2_decode (stage 1, top-k, stage 2)

README head config (HQ 32, H 2, D 128, bf16). Four warm-up calls, then --calls calls; eager launches,
so each kernel shows separately (ncu serialises them anyway).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._harness import parse_decode_config, random_cache, random_selection  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="8x32k")
    p.add_argument("--what", choices=("sparse", "dense_weights", "step"), default="sparse")
    p.add_argument("--calls", type=int, default=2)
    p.add_argument("--topk", type=int, default=64)
    p.add_argument("--local-blocks", type=int, default=32)
    a = p.parse_args()
    from infllm_cupy.config import InfLLMv2Config
    from infllm_cupy.decode import sparse_decode
    from infllm_cupy.decode.step import infllmv2_decode

    B, L = parse_decode_config(a.config)
    HQ, H, D, dev = 32, 2, 128, torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    cache = random_cache(B, L, H, D, torch.bfloat16, dev, g)
    q = torch.randn(B, HQ, D, generator=g, device=dev, dtype=torch.bfloat16)
    topk_idx = random_selection(B, H, L, a.topk, a.local_blocks, dev, g)
    cfg = InfLLMv2Config(topk=a.topk, local_blocks=a.local_blocks, dense_len=0)
    fn = {"sparse": lambda: sparse_decode(q, cache, topk_idx),
          "dense_weights": lambda: sparse_decode(q, cache, None, return_attn_weights=True),
          "step": lambda: infllmv2_decode(q, cache, config=cfg)}[a.what]
    for _ in range(4 + a.calls):
        fn()
    torch.cuda.synchronize()
    print(f"profile_decode: {a.config} {a.what} done")


if __name__ == "__main__":
    main()
