"""Accuracy of candidate 8-bit stage-2 forward schemes, emulated in PyTorch on the CPU: the numbers the
choice of an 8-bit scheme rests on before a kernel exists (docs/stage2_fwd.md §12). Accuracy does not
depend on the hardware: e4m3 and int8 rounding, the FP8 tensor cores' 22-bit accumulator and the order
of the sums are emulated as described below; only speed needs the GPU.

For sampled query rows of a sequence (rows are independent), each scheme runs the stage-2 forward of
those rows over the InfLLM-v2 selection of the reference pipeline, as a kernel would: key blocks in
ascending order, an online softmax with a running max, P V accumulated block by block. Reported per
query head against the float64 oracle on the same bf16 inputs: cosine similarity and relative L1 of the
output (SageAttention's figures), min / max over heads; the bf16 row is our kernels' math (fp32 scores
and accumulators, P rounded to bf16 for the P V product).

Schemes (QK: the scores' product; PV: the values' product; scales as in SageAttention2 / FA3):
  bf16            q, k, v, P in bf16, fp32 accumulation (today's kernels)
  fp8             Q K^T in e4m3 (one scale per 64-row query tile and per 64-key block), P V in e4m3 (P
                  scaled by 448, V by one scale per channel), both products in the FP8 tensor cores'
                  22-bit accumulator, P V added into fp32 once per 64-key block (two-level)
  fp8-smooth      fp8 with K smoothed (its per-head mean over the sequence subtracted: softmax-invariant)
  int8-smooth     Q K^T in int8 (exact int32 sums) on smoothed K; P V as fp8 (SageAttention2's choice)
  int8-1level     int8-smooth with P V accumulated in the 22-bit accumulator across all blocks
  int8-qk         int8-smooth's Q K^T with bf16 P V (the error of the scores alone)
  fp8-pv          bf16 Q K^T with fp8 P V (the error of the values' product alone)
  int8-token      int8-smooth with one scale per query row and per key instead of per tile and block
                  (the finest groups the mma layout allows: a row scale and a column scale per score)
  int8-token-qk   int8-token's Q K^T with bf16 P V
  kv8-*           an FP8 KV cache (decode, docs/decode.md §15): K and V stored in e4m3 (kv8-e5m2-token: e5m2)
                  with one scale per KV head over the whole cache (tensor), per 64-token page (page) or per
                  token (token), dequantized to bf16 in registers; q, P and the products as bf16;
                  kv8-token-smooth stores K less its per-head mean (any fixed vector subtracted from every
                  key of a sequence leaves the softmax unchanged); kv8-kchannel scales K per channel and
                  64-token page (KIVI's grouping) and V per token

    python tools/q8_accuracy.py --tokens 8192 --heads 16 --kv-heads 1 --head-dim 128 --rows 256
"""
from __future__ import annotations

import argparse
import time

import torch

from infllm_cupy.config import InfLLMv2Config
from infllm_cupy.prefill import select_blocks
from infllm_cupy.synthetic import structured_sequence
from infllm_cupy.testing import accuracy_per_head, cu_seqlens_from_lengths

E4M3_MAX = 448.0
SCHEMES = ("bf16", "fp8", "fp8-smooth", "int8-smooth", "int8-1level", "int8-qk", "fp8-pv", "int8-token",
           "int8-token-qk", "kv8-tensor", "kv8-page", "kv8-token", "kv8-e5m2-token", "kv8-token-smooth",
           "kv8-kchannel")
# 8-bit KV caches (decode): K and V stored in 8 bits with one scale per group, dequantized to bf16 for
# bf16 products; a decode query of a cache of L keys is the prefill row L - 1 (same keys, same selection)
CACHE_GROUPS = {"kv8-tensor": "tensor", "kv8-page": "page", "kv8-token": "token", "kv8-e5m2-token": "token",
                "kv8-token-smooth": "token", "kv8-kchannel": "channel"}


def e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round to float8 e4m3 (saturating at +-448), back in float32."""
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()


def fp22(x: torch.Tensor) -> torch.Tensor:
    """Truncate float32 to the FP8 tensor cores' accumulator: 8 exponent bits, 13 mantissa bits."""
    return (x.contiguous().view(torch.int32) & ~((1 << 10) - 1)).view(torch.float32)


def chunked_dot_fp22(a: torch.Tensor, b: torch.Tensor, chunk: int = 32) -> torch.Tensor:
    """`a @ b` ([..., n, k] x [..., k, m]) as the FP8 tensor cores accumulate it: fp32 sums of `chunk`
    products (one instruction's k), each added into a 22-bit accumulator."""
    acc = None
    for s in range(0, a.shape[-1], chunk):
        part = a[..., s:s + chunk] @ b[..., s:s + chunk, :]
        acc = part if acc is None else fp22(acc + part)
    return fp22(acc)


def quant(x: torch.Tensor, scale: torch.Tensor, kind: str) -> torch.Tensor:
    """`x / scale` rounded to e4m3 ("fp8") or to int8 ("int8"), as float32 values."""
    y = x / scale
    return e4m3(y) if kind == "fp8" else y.round().clamp(-127, 127)


def sample_inputs(kind: str, T: int, HQ: int, H: int, D: int, seed: int):
    if kind == "structured":
        s = structured_sequence(T, HQ, H, D, dtype=torch.bfloat16, seed=seed)
        return s.q, s.k, s.v
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(T, n, D, generator=g).bfloat16() for n in (HQ, H, H))


def row_keys(topk_idx: torch.Tensor, rows: torch.Tensor, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Key positions `[H, R, K * 64]` of each sampled row's selected blocks (ascending) and their validity
    (selected, causal, inside the sequence)."""
    blocks = topk_idx[:, rows].long()                                               # [H, R, K]
    keys = (blocks.clamp(min=0)[..., None] * 64 + torch.arange(64)).flatten(-2)     # [H, R, K*64]
    ok = (blocks >= 0)[..., None].expand(*blocks.shape, 64).flatten(-2)
    ok &= (keys <= rows[None, :, None]) & (keys < T)
    return keys.clamp(max=T - 1), ok


def cache_roundtrip(x: torch.Tensor, group: str, e5m2: bool = False) -> torch.Tensor:
    """K or V `[T, H, D]` stored in FP8 with one scale per `group` ("tensor": per KV head; "page": per 64
    tokens and KV head; "token": per token and KV head), read back to bf16 as a kernel would."""
    fmax = 57344.0 if e5m2 else E4M3_MAX
    fp8 = torch.float8_e5m2 if e5m2 else torch.float8_e4m3fn
    a = x.float().abs()
    if group == "tensor":
        amax = a.amax(dim=(0, 2), keepdim=True)
    elif group in ("page", "channel"):
        T = x.shape[0]
        pad = (-T) % 64
        dims = (1, 3) if group == "page" else (1,)
        pages = torch.nn.functional.pad(a, (0, 0, 0, 0, 0, pad)).view(-1, 64, *x.shape[1:]).amax(dim=dims)
        amax = pages.repeat_interleave(64, 0)[:T]
        amax = amax[..., None] if group == "page" else amax
    else:
        amax = a.amax(dim=2, keepdim=True)
    sc = amax.clamp_min(1e-30) / fmax
    return ((x.float() / sc).clamp(-fmax, fmax).to(fp8).float() * sc).bfloat16()


def run_scheme(scheme: str, q, k, v, rows, keys, ok, G: int, scale: float) -> torch.Tensor:
    """The output `[R, HQ, D]` of the sampled rows under `scheme` (float32), emulated block by block."""
    T, HQ, D = q.shape
    H = k.shape[1]
    R = rows.numel()
    if scheme in CACHE_GROUPS:
        e5m2 = "e5m2" in scheme
        group = CACHE_GROUPS[scheme]
        if scheme.endswith("smooth"):
            k = (k.float() - k.float().mean(0, keepdim=True)).bfloat16()           # softmax-invariant
        k = cache_roundtrip(k, group, e5m2)
        v = cache_roundtrip(v, "token" if group == "channel" else group, e5m2)
        scheme = "bf16"
    qf, kf, vf = q.float(), k.float(), v.float()
    if scheme.endswith("smooth") or scheme.startswith("int8"):
        kf = kf - kf.mean(0, keepdim=True)                                          # softmax-invariant
    qk_kind = "int8" if scheme.startswith("int8") else "fp8"
    qk8 = scheme not in ("bf16", "fp8-pv")              # Q K^T in 8 bits
    pv8 = scheme not in ("bf16", "int8-qk", "int8-token-qk")             # P V in 8 bits
    per_token = scheme.startswith("int8-token")
    qmax = 127.0 if qk_kind == "int8" else E4M3_MAX
    out = torch.empty(R, HQ, D)
    # a query tile: 64 rows of (token, head) pairs, G heads of a token together (the forward's packing)
    tile_tokens = max(1, 64 // G)
    vscale = vf.abs().amax(0).clamp_min(1e-30) / E4M3_MAX                          # [H, D] per channel
    for h in range(H):
        qh = qf[rows, h * G:(h + 1) * G]                                            # [R, G, D]
        if qk8:
            tile = rows // tile_tokens
            # one scale per tile: the max over the tile's tokens (all of the sequence's, not only sampled)
            per_tok = qf[:, h * G:(h + 1) * G].abs().amax(dim=(1, 2))               # [T]
            ntile = -(-T // tile_tokens)
            tmax = torch.nn.functional.pad(per_tok, (0, ntile * tile_tokens - T)).view(ntile, -1).amax(1)
            qs = (tmax[tile].clamp_min(1e-30) / qmax)[:, None, None]                # [R, 1, 1]
            if per_token:
                qs = qh.abs().amax(-1, keepdim=True).clamp_min(1e-30) / qmax          # [R, G, 1]
            q8 = quant(qh, qs, qk_kind)
        kk, ok_h = keys[h], ok[h]                                                   # [R, n]
        n = kk.shape[1]
        m = torch.full((R, G), float("-inf"))
        den = torch.zeros(R, G)
        acc = torch.zeros(R, G, D)
        for b0 in range(0, n, 64):
            kb = kf[kk[:, b0:b0 + 64], h]                                           # [R, 64, D]
            vb = vf[kk[:, b0:b0 + 64], h]
            valid = ok_h[:, b0:b0 + 64]                                             # [R, 64]
            if not bool(valid.any()):
                continue
            if not qk8:
                s = torch.einsum("rgd,rkd->rgk", qh, kb)                            # bf16 inputs, fp32 sums
            else:
                ks = kb.abs().amax(dim=(1, 2), keepdim=True).clamp_min(1e-30) / qmax  # per 64-key block
                if per_token:
                    ks = kb.abs().amax(-1, keepdim=True).clamp_min(1e-30) / qmax      # [R, 64, 1] per key
                k8 = quant(kb, ks, qk_kind)
                if qk_kind == "int8":
                    s = torch.einsum("rgd,rkd->rgk", q8, k8)                        # exact int32 sums
                else:
                    s = chunked_dot_fp22(q8, k8.transpose(1, 2))
                s = s * qs * ks.transpose(1, 2)
            s = (s * scale).masked_fill(~valid[:, None, :], float("-inf"))
            m_new = torch.maximum(m, s.amax(-1))
            alive = torch.isfinite(m_new)
            corr = torch.where(alive, torch.exp(m - m_new), torch.zeros_like(m))
            p = torch.where(alive[..., None], torch.exp(s - m_new[..., None]), torch.zeros_like(s))
            den = den * corr + p.sum(-1)
            if not pv8:
                pv = torch.einsum("rgk,rkd->rgd", p.bfloat16().float(), vb)
            else:
                p8 = e4m3(p * E4M3_MAX)
                v8 = e4m3(vb / vscale[h])
                pv = chunked_dot_fp22(p8, v8) * (vscale[h] / E4M3_MAX)
            acc = acc * corr[..., None] + pv
            if scheme == "int8-1level":                 # no fp32 level: the sum stays in the accumulator
                acc = fp22(acc)
            m = m_new
        out[:, h * G:(h + 1) * G] = acc / den.clamp_min(1e-30)[..., None]
    return out


def oracle(q, k, v, rows, keys, ok, G: int, scale: float) -> torch.Tensor:
    """The float64 output of the sampled rows over the same keys."""
    H = k.shape[1]
    out = torch.empty(rows.numel(), q.shape[1], q.shape[2], dtype=torch.float64)
    for h in range(H):
        qh = q[rows, h * G:(h + 1) * G].double()
        kh, vh = k[keys[h], h].double(), v[keys[h], h].double()                     # [R, n, D]
        s = torch.einsum("rgd,rnd->rgn", qh, kh) * scale
        s = s.masked_fill(~ok[h][:, None, :], float("-inf"))
        out[:, h * G:(h + 1) * G] = torch.einsum("rgn,rnd->rgd", torch.softmax(s, -1), vh)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--heads", type=int, default=16, help="query heads HQ")
    p.add_argument("--kv-heads", type=int, default=1)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--topk", type=int, default=64)
    p.add_argument("--local-blocks", type=int, default=32)
    p.add_argument("--rows", type=int, default=256, help="query rows sampled from the second half")
    p.add_argument("--inputs", default="random,structured")
    p.add_argument("--schemes", default=",".join(SCHEMES))
    p.add_argument("--chunk", type=int, default=32, help="rows per emulation chunk (memory)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    schemes = a.schemes.split(",")
    bad = [s for s in schemes if s not in SCHEMES]
    if bad:
        p.error(f"argument --schemes: unknown {bad}; choose from {SCHEMES}")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    T, HQ, H, D = a.tokens, a.heads, a.kv_heads, a.head_dim
    G = HQ // H
    scale = D ** -0.5
    cfg = InfLLMv2Config(topk=a.topk, local_blocks=a.local_blocks, dense_len=0)
    print(f"T={T} HQ={HQ} H={H} D={D} K={a.topk + a.local_blocks} rows={a.rows}; per head: cosine min, "
          f"relative L1 max against the float64 oracle")
    for kind in a.inputs.split(","):
        t0 = time.time()
        q, k, v = sample_inputs(kind, T, HQ, H, D, a.seed)
        cu = cu_seqlens_from_lengths([T])
        sel = select_blocks(q, k, cu, cu, T, None, True, cfg, need_scores=False)["topk_idx"]
        g = torch.Generator().manual_seed(a.seed + 1)
        rows = (T // 2 + torch.randperm(T - T // 2, generator=g)[:a.rows]).sort().values
        keys, ok = row_keys(sel, rows, T)
        ref = torch.cat([oracle(q, k, v, rows[i:i + a.chunk], keys[:, i:i + a.chunk], ok[:, i:i + a.chunk],
                                G, scale) for i in range(0, rows.numel(), a.chunk)])
        print(f"\n{kind} (selection and oracle {time.time() - t0:.0f} s)")
        for scheme in schemes:
            t1 = time.time()
            out = torch.cat([run_scheme(scheme, q, k, v, rows[i:i + a.chunk], keys[:, i:i + a.chunk],
                                        ok[:, i:i + a.chunk], G, scale)
                             for i in range(0, rows.numel(), a.chunk)])
            acc = accuracy_per_head(out, ref)
            cos, l1 = acc["cosine"], acc["rel_l1"]
            print(f"  {scheme:12s} cosine min {cos.min().item():.6f} (mean {cos.mean().item():.6f})  "
                  f"rel L1 max {l1.max().item():.4f} (mean {l1.mean().item():.4f})  "
                  f"[{time.time() - t1:.0f} s]", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
