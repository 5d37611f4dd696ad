"""How much of the causal prefix a stage-2 query tile walks: the union of its tokens' selections (CPU).

    python tools/tile_union.py                                  # 16k, MiniCPM4's sparse_config, random inputs
    python tools/tile_union.py --T 65536 --inputs random,structured --tile-tokens 1,2,4,8

The stage-2 forward computes a 64-row query tile (4 tokens at G = 16) over the union of its tokens'
selected 64-key blocks, masking per row (docs/stage2_fwd.md, 2. Inputs and the bitmask rows). Per
input kind this runs the reference selection (`naive_stage1_select`, one KV head, G query heads) and
prints, as shares of dense causal work (each token's whole causal prefix, in 64-key blocks):
`token` the blocks the tokens select themselves, and per tile size the blocks their union covers.
`random` is unit-normal q and k (what a random-weight model's layers give: neighbouring tokens choose
independently); `structured` is `infllm_cupy.synthetic.structured_sequence` (sink, local context,
topics, needles: neighbours choose alike, as in a trained model). The 16k prefill gap is read
from these numbers in docs/integrations.md ("Where a prefill's time goes").
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from infllm_cupy.compress.naive import naive_compress_k
from infllm_cupy.stage1.naive import naive_stage1_select
from infllm_cupy.synthetic import structured_sequence

BLOCK = 64


def inputs(kind: str, T: int, G: int, D: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    if kind == "random":
        g = torch.Generator().manual_seed(seed)
        return (torch.randn(T, G, D, generator=g).bfloat16(), torch.randn(T, 1, D, generator=g).bfloat16())
    s = structured_sequence(T, G, 1, D, seed=seed)
    return s.q, s.k


def shares(topk_idx: torch.Tensor, T: int, tile_tokens: list[int]) -> dict[str, float]:
    """Selected blocks over causal-prefix blocks: per token, and per tile of t tokens (their union)."""
    nb = T // BLOCK
    idx = topk_idx.long()
    sel = torch.zeros(T, nb + 1, dtype=torch.bool)
    sel.scatter_(1, torch.where(idx >= 0, idx, nb), True)
    sel = sel[:, :nb]
    own = torch.arange(T) // BLOCK + 1                       # blocks in token t's causal prefix
    out = {"token": sel.sum().item() / own.sum().item()}
    for t in tile_tokens:
        union = sel.view(T // t, t, nb).any(1).sum().item()
        prefix = own.view(T // t, t).max(1).values.sum().item()   # a tile's prefix: its last token's
        out[f"union of {t}"] = union / prefix
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--T", type=int, default=16384, help="tokens (a multiple of 64 and of every tile size)")
    p.add_argument("--G", type=int, default=16, help="query heads per KV head")
    p.add_argument("--D", type=int, default=128)
    p.add_argument("--topk", type=int, default=64, help="sparse_config topk (the local window comes on top)")
    p.add_argument("--window", type=int, default=2048,
                   help="sparse_config window_size (local blocks = window / 64)")
    p.add_argument("--inputs", default="random,structured")
    p.add_argument("--tile-tokens", default="1,2,4,8", help="tokens per tile (G = 16: 4 per 64-row tile)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    tiles = [int(x) for x in a.tile_tokens.split(",")]
    if a.T % BLOCK or any(a.T % t for t in tiles):
        raise SystemExit(f"--T must be a multiple of {BLOCK} and of each --tile-tokens, got {a.T}")
    cu = torch.tensor([0, a.T], dtype=torch.int32)
    for kind in a.inputs.split(","):
        q, k = inputs(kind, a.T, a.G, a.D, a.seed)
        ck1, cu1 = naive_compress_k(k, cu, 32, 16)
        ck2, cu2 = naive_compress_k(k, cu, 128, 64)
        idx = naive_stage1_select(q, ck1, ck2, cu, cu1, cu2, a.T, topk=a.topk, local_blocks=a.window // BLOCK,
                                  init_blocks=1)[0]
        row = ", ".join(f"{name} {v:.3f}" for name, v in shares(idx, a.T, tiles).items())
        print(f"T {a.T} {kind:<10} share of dense causal work: {row}", flush=True)


if __name__ == "__main__":
    main()
