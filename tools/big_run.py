"""Past 2^31 elements: stage-2 forward and backward at 1M tokens, and the decode cache at the
largest page count that fits, checked on sampled rows against an fp32 reference (docs/reliability.md,
"Past 2^31 elements").

    python tools/big_run.py                        # the device run: 1,048,576 x 32 x 128 bf16, H 2, K 96
    python tools/big_run.py --tokens 4096 --device cpu --cache-pages 64     # the CPU self-check (tests)

Forward and backward run through the public op (`sparse_attn_varlen`, `kernel` from `--kernels`) on
one sequence of `--tokens` tokens with selection (a) of `infllm_cupy.selections` (one random causal
selection per 64-token query block: block 0, the diagonal and random earlier blocks). Checked:
- out and lse of sampled query rows (the first, block edges, random rows and the last rows, most of
  them past element 2^31 of q) against softmax attention over the selected keys in fp32;
- dq of the same rows (row-local: dS = P (dP - delta), dq = scale dS K);
- dk and dv of sampled keys in block 0 (attended by every query), a middle block and the last
  block, summed over every query that attends them (fp32, in chunks), with the kernel's lse;
- no NaN anywhere in out, dq, dk, dv.
The decode part fills a paged `DecodeCache` of the largest page count that fits (shuffled pages, so
that every sequence has pages past element 2^31 of the pool) through `append` in ragged chunks, then
runs `sparse_decode` with selections that include the first, the last and random blocks, checked per
sequence against fp32 attention over the gathered keys, and the last compressed windows against a
fresh mean.

Tolerances: the error of a bf16 result is compared with `tol * max(1, max|ref|)` per checked
tensor (`--tol`, default 2e-2: a few bf16 ulps of O(1) outputs, loose enough for the accumulation
order, far below what an overflowed offset gives). Prints one line per check and a final verdict;
exit status 1 on any failure. On a CPU device the ops run their references, so the run checks this
tool's own reference code (the CPU test does that at small sizes).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from infllm_cupy import DecodeCache, sparse_attn_varlen, sparse_decode
from infllm_cupy.selections import block_shared, uniform_cu_seqlens

FAILURES: list[str] = []


def report(name: str, err: float, ref_max: float, tol: float, **extra) -> None:
    bound = tol * max(1.0, ref_max)
    ok = math.isfinite(err) and err <= bound
    if not ok:
        FAILURES.append(name)
    print(json.dumps({"check": name, "max_abs_err": err, "bound": bound, "ok": ok, **extra}), flush=True)


def sample_rows(T: int, n: int, g: torch.Generator) -> torch.Tensor:
    fixed = [0, 1, 63, 64, 65, T // 2, (1 << 31) // (32 * 128), T - 1]
    rnd = torch.randint(0, T, (n,), generator=g).tolist()
    last = list(range(max(0, T - 16), T))
    return torch.tensor(sorted({r for r in fixed + rnd + last if 0 <= r < T}))


def attention_rows(q, k, v, idx, dout, out, rows, scale, G):
    """fp32 reference of out, lse and dq for query rows `rows` (causal, one sequence)."""
    H = k.shape[1]
    HQ, D = q.shape[1], q.shape[2]
    ref_out = torch.empty(len(rows), HQ, D, device=q.device)
    ref_lse = torch.empty(HQ, len(rows), device=q.device)
    ref_dq = torch.empty(len(rows), HQ, D, device=q.device)
    ar = torch.arange(64, device=q.device)
    for i, t in enumerate(rows.tolist()):
        for h in range(H):
            blocks = torch.unique(idx[h, t].long())
            blocks = blocks[(blocks >= 0) & (blocks * 64 <= t)]
            keys = (blocks[:, None] * 64 + ar).flatten()
            keys = keys[keys <= t]
            hs = slice(h * G, (h + 1) * G)
            qt = q[t, hs].float()                                   # [G, D]
            kk, vv = k[keys, h].float(), v[keys, h].float()         # [n, D]
            if keys.numel() == 0:
                ref_out[i, hs], ref_lse[hs, i], ref_dq[i, hs] = 0, float("inf"), 0
                continue
            s = (qt @ kk.T) * scale                                 # [G, n]
            lse = torch.logsumexp(s, -1)
            p = torch.exp(s - lse[:, None])
            ref_out[i, hs] = p @ vv
            ref_lse[hs, i] = lse
            do = dout[t, hs].float()
            delta = (do * out[t, hs].float()).sum(-1)               # as the backward defines it: dout . out
            ds = p * (do @ vv.T - delta[:, None])
            ref_dq[i, hs] = scale * (ds @ kk)
    return ref_out, ref_lse, ref_dq


def key_grads(q, k, v, idx, dout, out, lse, keys, scale, G, chunk):
    """fp32 dk, dv of key rows `keys` (all in one 64-key block), summed over every query that
    attends them (its selection lists the block, and t >= key), with the kernel's lse."""
    _T, _HQ, D = q.shape
    H = k.shape[1]
    blk = int(keys[0]) // 64
    dk = torch.zeros(len(keys), H, D, device=q.device)
    dv = torch.zeros(len(keys), H, D, device=q.device)
    for h in range(H):
        hs = slice(h * G, (h + 1) * G)
        attends = (idx[h].long() == blk).any(-1)                  # [T]
        attends[: int(keys.min())] = False
        tq = attends.nonzero().flatten()
        kj, vj = k[keys, h].float(), v[keys, h].float()           # [m, D]
        for c0 in range(0, tq.numel(), chunk):
            t = tq[c0:c0 + chunk]
            Q, dO = q[t, hs].float(), dout[t, hs].float()          # [n, G, D]
            L = lse[hs][:, t].T                                    # [n, G]
            delta = (dO * out[t, hs].float()).sum(-1)              # [n, G]
            s = torch.einsum("ngd,md->ngm", Q, kj) * scale
            p = torch.exp(s - L[..., None])
            p = torch.where((t[:, None] >= keys[None, :])[:, None, :], p, torch.zeros_like(p))
            dv[:, h] += torch.einsum("ngm,ngd->md", p, dO)
            ds = p * (torch.einsum("ngd,md->ngm", dO, vj) - delta[..., None])
            dk[:, h] += scale * torch.einsum("ngm,ngd->md", ds, Q)
    return dk, dv


def stage2(args, kernel: str, dev: torch.device) -> None:
    T, HQ, H, D, K = args.tokens, args.heads, args.kv_heads, args.head_dim, args.topk
    G = HQ // H
    dt = torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(args.seed)
    t0 = time.perf_counter()
    idx = block_shared(1, T, H, K, device=dev, seed=args.seed)            # [H, T, K]
    q = torch.randn(T, HQ, D, device=dev, dtype=dt, generator=g)
    k = torch.randn(T, H, D, device=dev, dtype=dt, generator=g)
    v = torch.randn(T, H, D, device=dev, dtype=dt, generator=g)
    cu = uniform_cu_seqlens(1, T, device=dev)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    out, lse = sparse_attn_varlen(*leaves, cu, cu, idx, T, T, return_lse=True, kernel=kernel)
    dout = torch.randn(T, HQ, D, device=dev, dtype=dt, generator=g)
    dq, dk, dv = torch.autograd.grad(out, leaves, dout)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    q, k, v, out = q.detach(), k.detach(), v.detach(), out.detach()
    tag = f"stage2[{kernel}] T={T} HQ={HQ} H={H} D={D} K={K} q elements={q.numel()}"
    print(json.dumps({"run": tag, "seconds": round(elapsed, 2),
                      "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30,
                                        1) if dev.type == "cuda" else None}),
          flush=True)
    for name, x in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
        n_nan = int(torch.isnan(x).sum())
        if n_nan:
            FAILURES.append(f"{tag}: NaN in {name}")
        print(json.dumps({"check": f"{tag}: no NaN in {name}", "nan": n_nan, "ok": n_nan == 0}), flush=True)
    scale = D ** -0.5
    gh = torch.Generator().manual_seed(args.seed + 1)
    rows = sample_rows(T, args.rows, gh).to(dev)
    ref_out, ref_lse, ref_dq = attention_rows(q, k, v, idx, dout, out, rows, scale, G)
    fin = torch.isfinite(ref_lse)
    report(f"{tag}: out rows", (out[rows].float() - ref_out).abs().max().item(), ref_out.abs().max().item(),
           args.tol, rows=len(rows), past_2_31=int((rows * HQ * D >= 2**31).sum()))
    report(f"{tag}: lse rows", (lse[:, rows][fin] - ref_lse[fin]).abs().max().item(), 0.0, 1e-3)
    report(f"{tag}: dq rows", (dq[rows].float() - ref_dq).abs().max().item(), ref_dq.abs().max().item(),
           args.tol)
    nb = -(-T // 64)
    for blk in sorted({0, nb // 2, nb - 1}):
        lo, hi = blk * 64, min(T, blk * 64 + 64)
        keys = torch.unique(torch.tensor([lo, lo + 1, (lo + hi) // 2, hi - 1])).to(dev)
        rdk, rdv = key_grads(q, k, v, idx, dout, out, lse, keys, scale, G, args.chunk)
        report(f"{tag}: dk keys of block {blk}", (dk[keys].float() - rdk).abs().max().item(),
               rdk.abs().max().item(), args.tol)
        report(f"{tag}: dv keys of block {blk}", (dv[keys].float() - rdv).abs().max().item(),
               rdv.abs().max().item(), args.tol)
    del q, k, v, out, lse, dout, dq, dk, dv, leaves, idx


def decode(args, dev: torch.device) -> None:
    H, HQ, D, ps, B = args.kv_heads, args.heads, args.head_dim, args.page_size, args.batch
    dt = torch.bfloat16
    # k and v pages, plus the compressed keys the cache keeps (1/16 and 1/64 of k)
    per_page = ps * H * D * dt.itemsize * (2 + 1 / 16 + 1 / 64)
    pages = args.cache_pages or int(args.cache_fraction * torch.cuda.mem_get_info(dev)[0] / per_page)
    pages -= pages % B
    per = pages // B
    g = torch.Generator().manual_seed(args.seed + 2)
    table = torch.randperm(pages, generator=g).view(B, per).to(torch.int32).to(dev)   # shuffled pages
    t0 = time.perf_counter()
    cache = DecodeCache.paged(pages, ps, H, D, table, dtype=dt, device=dev)
    cap = per * ps
    lens = [cap - i * 37 for i in range(B)]                    # full and nearly full sequences
    # filled through the public append in ragged chunks (the compression windows they complete are
    # computed as they land), `--append-chunk` tokens per call over the batch
    gd = torch.Generator(device=dev).manual_seed(args.seed + 3)
    done = [0] * B
    step = max(1, args.append_chunk // B)
    while done != lens:
        counts = [min(step, L - n) for L, n in zip(lens, done)]
        kn = torch.randn(sum(counts), H, D, device=dev, dtype=dt, generator=gd)
        vn = torch.randn(sum(counts), H, D, device=dev, dtype=dt, generator=gd)
        cu = torch.tensor([0] + counts, dtype=torch.int64).cumsum(0).to(torch.int32).to(dev)
        cache.append(kn, vn, cu)
        done = [n + c for n, c in zip(done, counts)]
    del kn, vn
    q = torch.randn(B, HQ, D, generator=g).to(dev, dt)
    K = args.topk
    sel = []
    for L in lens:
        nb = -(-L // 64)
        sel.append(torch.cat([torch.tensor([0, nb - 1, nb // 2]),
                              torch.randint(0, nb, (K - 3,), generator=g)]))
    idx = torch.stack(sel, 0)[None].expand(H, B, K).contiguous().to(torch.int32).to(dev)
    out, lse = sparse_decode(q, cache, idx, return_lse=True)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    tag = (f"decode pages={pages} page_size={ps} B={B} L={lens[0]} cache elements={cache.k.numel()} "
           f"({cache.k.numel() / 2**31:.1f} x 2^31)")
    print(json.dumps({"run": tag, "seconds": round(time.perf_counter() - t0, 2)}), flush=True)
    G = HQ // H
    scale = D ** -0.5
    err, ref_max, err_lse = 0.0, 0.0, 0.0
    ar = torch.arange(64)
    for b, L in enumerate(lens):
        for h in range(H):
            blocks = torch.unique(idx[h, b].long().cpu())
            pos = (blocks[:, None] * 64 + ar).flatten()
            pos = pos[pos < L].to(dev)
            r, s = table[b][pos // ps].long(), pos % ps
            kk, vv = cache.k[r, s, h].float(), cache.v[r, s, h].float()
            hs = slice(h * G, (h + 1) * G)
            lg = (q[b, hs].float() @ kk.T) * scale
            ref = torch.softmax(lg, -1) @ vv
            err = max(err, (out[b, hs].float() - ref).abs().max().item())
            ref_max = max(ref_max, ref.abs().max().item())
            err_lse = max(err_lse, (lse[b, hs] - torch.logsumexp(lg, -1)).abs().max().item())
        # the compressed keys at the end of the sequence (its pages may lie past 2^31 elements):
        # the last complete fine and coarse windows against a fresh mean
        for name, ck, (kr, st) in (("ck1", cache.ck1, (32, 16)), ("ck2", cache.ck2, (128, 64))):
            n = (L - kr) // st + 1
            if n < 1:
                continue
            pos = torch.arange((n - 1) * st, (n - 1) * st + kr, device=dev)
            want = cache.k[table[b][pos // ps].long(), pos % ps].float().mean(0)
            report(f"{tag}: {name} last window of sequence {b}",
                   (ck[b, n - 1].float() - want).abs().max().item(), want.abs().max().item(), args.tol)
    report(f"{tag}: out", err, ref_max, args.tol)
    report(f"{tag}: lse", err_lse, 0.0, 1e-3)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=1 << 20)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=128, choices=[64, 128])
    p.add_argument("--topk", type=int, default=96)
    p.add_argument("--kernels", default="auto,sm80", help="comma-separated stage-2 kernel arguments to run")
    p.add_argument("--rows", type=int, default=200,
                   help="random query rows checked (plus fixed and last rows)")
    p.add_argument("--chunk", type=int, default=1 << 16, help="queries per step of the dk/dv reference")
    p.add_argument("--page-size", type=int, default=256)
    p.add_argument("--batch", type=int, default=4, help="decode sequences")
    p.add_argument("--cache-pages", type=int, default=0, help="decode cache pages (0: the largest that fits)")
    p.add_argument("--cache-fraction", type=float, default=0.75,
                   help="share of free GPU memory for the cache")
    p.add_argument("--append-chunk", type=int, default=1 << 21, help="tokens per cache.append while filling")
    p.add_argument("--skip", default="", help="comma-separated parts to skip: stage2, decode")
    p.add_argument("--tol", type=float, default=2e-2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA GPU: run with --device cpu (small sizes) to check the tool itself", file=sys.stderr)
        return 2
    if args.heads % args.kv_heads:
        p.error("--heads must be a multiple of --kv-heads")
    skip = set(filter(None, args.skip.split(",")))
    if "stage2" not in skip:
        for kernel in filter(None, args.kernels.split(",")):
            stage2(args, kernel, dev)
            if dev.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
    if "decode" not in skip:
        decode(args, dev)
    print(json.dumps({"verdict": "PASS" if not FAILURES else "FAIL", "failures": FAILURES}), flush=True)
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
