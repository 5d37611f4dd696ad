"""`python -m infllm_cupy demo`: the InfLLM-v2 pipeline on a synthetic long sequence.

On a GPU the stages with kernels run them (key compression, stage 2) and the others run the
PyTorch reference on the GPU; without a GPU everything is the CPU reference at a smaller size.
It prints what each stage took and what was selected, and writes a PNG of the selected blocks.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from .synthetic import synthetic_sequence


def _timed(fn, device):
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return out, (time.perf_counter() - t0) * 1e3


def demo(argv=None) -> int:
    from . import compress_k
    from .pipeline import InfLLMv2Config
    from .stage1 import stage1_select
    from .stage2.attention import sparse_attn_varlen
    from .viz import plot_selection, selection_density

    has_gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(prog="python -m infllm_cupy demo", description=__doc__)
    p.add_argument("--tokens", type=int, default=32768 if has_gpu else 4096)
    p.add_argument("--device", default="cuda" if has_gpu else "cpu")
    p.add_argument("--heads", type=int, default=32, help="query heads HQ")
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads H")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--needles", type=int, default=4)
    p.add_argument("--topk", type=int, default=64 if has_gpu else 8,
                   help="top-k blocks besides the local window (MiniCPM4: 64)")
    p.add_argument("--local-blocks", type=int, default=32 if has_gpu else 4,
                   help="local window in blocks (MiniCPM4: 32, so 33 forced local blocks)")
    p.add_argument("--png", default="infllm_selection.png")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    T, HQ, H, D = args.tokens, args.heads, args.kv_heads, args.head_dim
    # always sparse, even below MiniCPM's 8192-token dense fallback
    cfg = InfLLMv2Config(dense_len=0, topk=args.topk, local_blocks=args.local_blocks)
    kernels = device.type == "cuda"
    print(f"InfLLM-v2 demo on {torch.cuda.get_device_name(device) if kernels else 'CPU'}: one sequence of {T} "
          f"tokens, HQ={HQ}, H={H}, D={D}, bf16; topk={cfg.topk} + {cfg.local_blocks + 1} local + "
          f"{cfg.init_blocks} init blocks of {cfg.block_size}")
    q, k, v, needles = synthetic_sequence(T, HQ, H, D, args.needles, torch.bfloat16, device)
    cu = torch.tensor([0, T], dtype=torch.int32, device=device)

    timings = {}
    if kernels:   # compile outside the timings
        compress_k(k[:256], torch.tensor([0, 256], dtype=torch.int32, device=device))
    (ck1, cu1), timings["compress 32/16 [kernel]" if kernels else "compress 32/16 [reference]"] = _timed(
        lambda: compress_k(k, cu, cfg.kernel_size, cfg.kernel_stride), device)
    (ck2, cu2), timings["compress 128/64 [kernel]" if kernels else "compress 128/64 [reference]"] = _timed(
        lambda: compress_k(k, cu, cfg.coarse_kernel_size, cfg.coarse_kernel_stride), device)
    def select():
        return stage1_select(q, ck1, ck2, cu, cu1, cu2, T, topk=cfg.topk, local_blocks=cfg.local_blocks,
                             init_blocks=cfg.init_blocks)

    if kernels:   # compile outside the timings
        select()
    topk_idx, timings[f"stage 1 + pooling + top-k [{'kernel' if kernels else 'reference'}]"] = _timed(select, device)
    backend = "kernels" if kernels else "reference"
    if kernels:
        with torch.no_grad():
            sparse_attn_varlen(q[:256], k[:256], v[:256], torch.tensor([0, 256], dtype=torch.int32, device=device),
                               torch.tensor([0, 256], dtype=torch.int32, device=device), topk_idx[:, :256], 256, 256)
    with torch.no_grad():
        out, timings[f"stage 2 sparse attention [{backend}]"] = _timed(
            lambda: sparse_attn_varlen(q, k, v, cu, cu, topk_idx, T, T, backend=backend), device)

    print("\nstage timings (ms, one run after warm-up compiles):")
    for name, ms in timings.items():
        print(f"  {name:42s} {ms:10.1f}")

    valid = (topk_idx >= 0)
    K = topk_idx.shape[-1]
    print(f"\nselection: K = {K} slots per token and KV head; {valid.float().mean().item():.1%} of slots used "
          f"(early tokens have fewer than K causal blocks, tail -1)")
    hits = []
    for kb, qs in needles:
        sel = topk_idx[:, qs:qs + 64].long()
        hit = (sel == kb).any(-1).float().mean().item()     # over KV heads and the 64 needle queries
        hits.append(hit)
        print(f"  needle keys in block {kb:4d}, queries {qs}-{qs + 63}: selected by {hit:.0%} of (token, head) pairs")
    t = needles[0][1] + 32 if needles else T - 1
    row = topk_idx[0, t]
    print(f"  token {t}, KV head 0 selects: {row[row >= 0].tolist()}")
    last = topk_idx[0, -1]
    print(f"  the last token attends {int((last >= 0).sum())} of its {-(-T // 64)} causal blocks")
    print(f"  output finite: {bool(torch.isfinite(out.float()).all())}")

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, H if H <= 4 else 4, figsize=(6.5 * min(H, 4), 5.5), squeeze=False)
        for h, ax in enumerate(axes[0]):
            plot_selection(topk_idx.cpu(), cu.cpu(), cu.cpu(), head=h, ax=ax,
                           title=f"KV head {h}: selected blocks ({T} tokens)")
        fig.tight_layout()
        fig.savefig(args.png, dpi=110)
        print(f"\nwrote {args.png}: query block (y) against key block (x), shaded by the share of the "
              f"block's tokens that selected it")
        dens = selection_density(topk_idx.cpu(), cu.cpu(), cu.cpu())
        nqb = dens.shape[0]
        print(f"  density: {dens.sum().item() / (nqb * (nqb + 1) / 2):.1%} of the causal (query block, key block) pairs")
    except ImportError:
        print("matplotlib not installed: no PNG written")
    return 0 if all(h > 0.5 for h in hits) else 1


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m infllm_cupy demo [options]   (demo --help for the options)")
        return 0
    if argv[0] == "demo":
        return demo(argv[1:])
    print(f"unknown command {argv[0]!r}; try: python -m infllm_cupy demo")
    return 2


if __name__ == "__main__":
    sys.exit(main())
