"""A/B of two whole package trees (launchers and kernels) in one process, outputs compared bit for bit
(development tool): the check that a change of the Python-CUDA boundary (parameter structs, one
launch path) leaves the kernels' speed and results as they were.

    mkdir -p /tmp/old && git archive <commit> infllm_cupy kernels_cu | tar -x -C /tmp/old
    python tools/ab_packages.py --old /tmp/old/infllm_cupy --parts stage1,decode

The old package folder is loaded under another name without its `__init__` files (they would register
the torch ops a second time) and compiles from the kernels_cu/ folder beside it; only its launcher
modules are called. Parts:
- `stage1`: `stage1_select` (compression outside the timing) at `--stage1-configs` (T x B, README heads
  HQ 32, H 2, D 128, bf16, random inputs, K = 96);
- `decode`: one decode step, `select_decode` then `sparse_decode` on a contiguous cache (README heads,
  K = 96), `--calls` steps captured in one CUDA graph and replayed, at `--decode-configs` (B x L).
Each repetition times every package in rotated order (CUDA events), so clock drift falls on both;
prints the median per call and new / old. Exit status 1 when any output differs.
The stage-2 forward and backward have their own interleaved A/B with old packages:
`tools/ab_fwd_interleaved.py --variants old=DIR:sm90a@PKG new=kernels_cu:sm90a`.
"""
from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._harness import capture_graph
from infllm_cupy.compress import compress_k
from infllm_cupy.selections import uniform_cu_seqlens

HQ, H, D = 32, 2, 128
SAME = {True: "same bits", False: "OUTPUTS DIFFER"}
TOPK, LOCAL, INIT = 64, 32, 1


def load(folder: str | None, tag: str) -> dict:
    """The launcher modules of the package folder `folder` (None: this checkout's)."""
    if folder is None:
        return {m: importlib.import_module(f"infllm_cupy.{m}") for m in
                ("stage1.select", "decode.select_decode", "decode.sparse_decode")}
    root = Path(folder).resolve()
    for sub in ("", "stage1", "stage2", "decode", "compress", "patterns"):
        name = tag + ("." + sub if sub else "")
        mod = types.ModuleType(name)
        mod.__path__ = [str(root / sub)] if sub else [str(root)]
        sys.modules[name] = mod
    return {m: importlib.import_module(f"{tag}.{m}") for m in
            ("stage1.select", "decode.select_decode", "decode.sparse_decode")}


def parse_size(text: str) -> tuple[int, int]:
    """'32kx8' -> (32768, 8); for decode 'BxL' -> (B, L): '8x32k' -> (8, 32768)."""
    def n(t: str) -> int:
        return int(t[:-1]) * 1024 if t.endswith("k") else int(t)
    a, b = text.lower().split("x")
    return n(a), n(b)


def timed(fns: dict, rep: int) -> dict:
    """Median ms of each callable over `rep` rounds, the order rotated every round."""
    names = list(fns)
    times = {k: [] for k in names}
    for r in range(rep):
        for k in names[r % len(names):] + names[:r % len(names)]:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fns[k]()
            b.record()
            b.synchronize()
            times[k].append(a.elapsed_time(b))
    return {k: statistics.median(v) for k, v in times.items()}


def stage1_case(pkgs: dict, T: int, B: int, rep: int) -> tuple[dict, bool]:
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(B * T, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(B * T, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    cu = uniform_cu_seqlens(B, T, "cuda")
    ck1, cu1 = compress_k(k, cu, 32, 16)
    ck2, cu2 = compress_k(k, cu, 128, 64)
    kw = dict(topk=TOPK, local_blocks=LOCAL, init_blocks=INIT)
    fns = {name: (lambda m=m: m["stage1.select"].stage1_select(q, ck1, ck2, cu, cu1, cu2, T, **kw))
           for name, m in pkgs.items()}
    outs = {name: f() for name, f in fns.items()}
    first = next(iter(outs.values()))
    same = all(torch.equal(o, first) for o in outs.values())
    return timed(fns, rep), same


def decode_case(pkgs: dict, B: int, L: int, rep: int, calls: int) -> tuple[dict, bool]:
    g = torch.Generator(device="cuda").manual_seed(2)
    q = torch.randn(B, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
    kc = torch.randn(B, L, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    vc = torch.randn(B, L, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    seqlens = torch.full((B,), L, dtype=torch.int32, device="cuda")
    cu = uniform_cu_seqlens(B, L, "cuda")
    ck1, _ = compress_k(kc.reshape(B * L, H, D), cu, 32, 16)
    ck2, _ = compress_k(kc.reshape(B * L, H, D), cu, 128, 64)
    ck1, ck2 = ck1.view(B, -1, H, D), ck2.view(B, -1, H, D)
    out_len = -(-L // 64)
    graphs, outs = {}, {}
    for name, m in pkgs.items():
        def step(m=m):
            idx = m["decode.select_decode"].select_decode(
                q, ck1, ck2, seqlens, out_len, topk=TOPK, local_blocks=LOCAL, init_blocks=INIT,
                softmax_scale=None, score_dtype=torch.bfloat16, exact=False)
            return idx, m["decode.sparse_decode"].sparse_decode(q, (kc, vc, seqlens), idx)
        outs[name] = step()                       # compiles, and the output to compare
        torch.cuda.synchronize()
        graphs[name] = capture_graph(step, calls, warmup=1)
    first = next(iter(outs.values()))
    same = all(torch.equal(o[0], first[0]) and torch.equal(o[1], first[1]) for o in outs.values())
    ms = timed({name: gr.replay for name, gr in graphs.items()}, rep)
    return {k: v / calls for k, v in ms.items()}, same


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--old", required=True,
                   help="the old infllm_cupy/ package folder (kernels_cu/ beside it)")
    p.add_argument("--parts", default="stage1,decode")
    p.add_argument("--stage1-configs", default="32kx8,128kx2")
    p.add_argument("--decode-configs", default="1x128k,8x32k,64x32k")
    p.add_argument("--rep", type=int, default=15)
    p.add_argument("--calls", type=int, default=20, help="decode steps per captured graph")
    a = p.parse_args(argv)
    pkgs = {"old": load(a.old, "infllm_cupy_ab_old"), "new": load(None, "")}
    ok = True
    rows = []
    parts = a.parts.split(",")
    if "stage1" in parts:
        for c in a.stage1_configs.split(","):
            T, B = parse_size(c)
            ms, same = stage1_case(pkgs, T, B, a.rep)
            ok &= same
            rows.append(("stage1", c, ms, same))
            print(f"stage1 {c}: old {ms['old']:.3f} ms, new {ms['new']:.3f} ms, "
                  f"new/old {ms['new'] / ms['old']:.4f}, {SAME[same]}", flush=True)
    if "decode" in parts:
        for c in a.decode_configs.split(","):
            B, L = parse_size(c)
            ms, same = decode_case(pkgs, B, L, a.rep, a.calls)
            ok &= same
            rows.append(("decode", c, ms, same))
            print(f"decode {c}: old {1e3 * ms['old']:.2f} us, new {1e3 * ms['new']:.2f} us, "
                  f"new/old {ms['new'] / ms['old']:.4f}, {SAME[same]}", flush=True)
    print("\n| part | config | old | new | new / old | outputs |\n|---|---|---|---|---|---|")
    for part, c, ms, same in rows:
        unit, f = ("ms", 1.0) if part == "stage1" else ("us per step", 1e3)
        print(f"| {part} | {c} | {f * ms['old']:.3f} {unit} | {f * ms['new']:.3f} {unit} | "
              f"{ms['new'] / ms['old']:.4f} | {'same bits' if same else 'differ'} |")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
