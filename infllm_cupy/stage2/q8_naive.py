"""The 8-bit stage-2 forward (`precision="int8-fp8"`, docs/stage2_q8.md): its quantization and its
attention, in PyTorch on the CPU. This is the plan's reference and its CPU implementation, and the
oracle the CUDA kernels (kernels_cu/stage2/q8_quantize.cu, q8_fwd.cu) must equal bit for bit on the
quantized operands and scales.

The scheme (docs/stage2_fwd.md §12 chose it; docs/stage2_q8.md §2 gives the scale groups):
- Q in int8, one scale per (token, query head) row: `q_scale = amax / 127`, `q8 = rint(q * (127 / amax))`.
- K smoothed by its mean over the sequence per (sequence, KV head, channel) (every score of a query row
  moves by the same amount, which the softmax ignores), then int8 with one scale per (64-key block of a
  sequence, KV head).
- V in e4m3 (saturating at 448), one scale per (sequence, KV head, channel): `v_scale = amax / 448`.
- Scores `S = int32(q8 . k8) * (q_scale * scale * log2(e) * k_scale)`, exact integer dot products;
  the online softmax in base 2 over each row's selected blocks in ascending order, one 64-key block at
  a time; `P` (in [0, 1]) times 448 rounded to e4m3; `P8 V8` summed in fp32 per block and added into
  an fp32 accumulator (rescaled by the running max), the row sum from the unrounded `P`; at the end
  `out = acc / (448 * sum) * v_scale`.

Every rounding is a single IEEE fp32 operation (multiply, divide, subtract) followed by
round-to-nearest-even to int8 or e4m3, so a kernel doing the same operations gets the same bits. The
one exception is the K mean: a sum over the sequence, here in float64 rounded to fp32; a kernel's
float64 sum in another order equals it unless the float64 sums straddle an fp32 rounding tie, so the
bit-for-bit test compares K's quantization given the kernel's own mean (`naive_q8_quantize(k_mean=)`).

No gradients: the 8-bit plan is a forward; its output refuses `backward` with an error naming it.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .._checks import (
    HostSeqlens,
    check_attn_tensors,
    check_attn_values,
    check_flags,
    check_max_seqlen,
    check_softmax_scale,
    check_tensor,
    validate_values,
)
from .._rules import KV_BLOCK, cdiv

# The largest magnitudes of the two 8-bit grids: int8's symmetric range (-128 unused, so that negation
# is exact) and e4m3's largest finite value.
INT8_MAX = 127.0
E4M3_MAX = 448.0

# A group whose largest magnitude is below this is quantized as if its amax were this: `127 / amax`
# stays finite (127 * 2^100 < fp32's max), and the values (all below 2^-100) round to 0.
AMAX_MIN = 2.0 ** -100

# Head dims above this could overflow the exactness of the int8 dot products summed in fp32 here
# (127 * 127 * D < 2^24).
MAX_HEAD_DIM = 1024

# fp32 elements of one gathered K or V slot of a chunk (`[C, 64, D]`): 4M, 16 MB.
_SLOT_ELEMS = 1 << 22

_LOG2E = math.log2(math.e)

PLAN = "precision='int8-fp8'"


class Q8Operands(NamedTuple):
    """The quantized operands of one call and their scales (what the quantization kernel writes).

    q8 int8 `[total_q, HQ, D]`, q_scale fp32 `[total_q, HQ]`; k8 int8 `[total_k, H, D]` (K less k_mean),
    k_scale fp32 `[H, total_k // 64 + B]` (block j of sequence b at `k_block_base(cu_k)[b] + j`; slots no
    block maps to are 0), k_mean fp32 `[B, H, D]`; v8 float8_e4m3fn `[total_k, H, D]`, v_scale fp32
    `[B, H, D]` (`v ~ v8 * v_scale`; `q ~ q8 * q_scale`, `k - k_mean ~ k8 * k_scale`).
    """
    q8: torch.Tensor
    q_scale: torch.Tensor
    k8: torch.Tensor
    k_scale: torch.Tensor
    k_mean: torch.Tensor
    v8: torch.Tensor
    v_scale: torch.Tensor


def k_block_base(cu_k: tuple[int, ...] | list[int]) -> list[int]:
    """The k_scale slot of block 0 of each sequence: `cu_k[b] // 64 + b`. No two sequences' blocks
    share a slot (sequence b's `cdiv(Lk, 64)` blocks end at most at the next one's base), and a kernel
    computes it from the offsets alone."""
    return [cu_k[b] // KV_BLOCK + b for b in range(len(cu_k) - 1)]


def k_scale_slots(total_k: int, batch: int) -> int:
    """Columns of `k_scale`: `total_k // 64 + B`."""
    return total_k // KV_BLOCK + batch


def quantize_int8(x: torch.Tensor, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` (fp32) on int8 with one scale per group of `amax` (fp32, broadcast against `x`):
    `(rint(x * (127 / amax)), amax / 127)`, amax floored at `AMAX_MIN`, round half to even."""
    amax = amax.clamp_min(AMAX_MIN)
    return (x * (INT8_MAX / amax)).round_().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8), amax / INT8_MAX


def quantize_e4m3(x: torch.Tensor, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` (fp32) on e4m3: `(e4m3(x * (448 / amax)), amax / 448)`, saturating at +-448, round to
    nearest even (`__nv_cvt_float_to_fp8(..., __NV_SATFINITE, __NV_E4M3)`)."""
    amax = amax.clamp_min(AMAX_MIN)
    y = (x * (E4M3_MAX / amax)).clamp_(-E4M3_MAX, E4M3_MAX)
    return y.to(torch.float8_e4m3fn), amax / E4M3_MAX


def e4m3_round(x: torch.Tensor) -> torch.Tensor:
    """`x` (fp32, in [-448, 448]) rounded to e4m3, back in fp32."""
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()


def naive_q8_k_mean(k: torch.Tensor, cu_k: tuple[int, ...] | list[int]) -> torch.Tensor:
    """The mean of each sequence's keys per KV head and channel, fp32 `[B, H, D]`: summed in float64,
    divided by the length, rounded to fp32 (0 for an empty sequence)."""
    B = len(cu_k) - 1
    out = torch.zeros(B, k.shape[1], k.shape[2], dtype=torch.float32)
    for b in range(B):
        k0, k1 = cu_k[b], cu_k[b + 1]
        if k1 > k0:
            out[b] = (k[k0:k1].double().sum(0) / (k1 - k0)).float()
    return out


def naive_q8_quantize(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                      cu_seqlens_k: torch.Tensor, *, k_mean: torch.Tensor | None = None,
                      host_seqlens: HostSeqlens | None = None) -> Q8Operands:
    r"""Q, K and V on the 8-bit plan's grids with their scales (`Q8Operands`; the module docstring
    has the scheme, docs/stage2_q8.md §2 the scale groups).

    Args:
        q (torch.Tensor): `[total_q, HQ, D]`, any float dtype (bf16 / fp16 for the kernels).
        k, v (torch.Tensor): `[total_k, H, D]`, q's dtype.
        cu_seqlens_q, cu_seqlens_k (torch.Tensor): int32 `[B+1]`.
        k_mean (torch.Tensor, Optional): fp32 `[B, H, D]` to smooth K by instead of its own mean (a
            kernel's, to compare the rest bit for bit). Default: `None` (`naive_q8_k_mean`).
        host_seqlens (HostSeqlens, Optional): both offsets on the host from a caller that checked the
            inputs. Default: `None` (checked and read here).

    Returns:
        Q8Operands, on the CPU.
    """
    if host_seqlens is None:
        check_attn_tensors(q, k, v, cu_seqlens_q, cu_seqlens_k)
        host_seqlens = HostSeqlens.read(cu_seqlens_q, cu_seqlens_k)
        if validate_values():
            check_attn_values(host_seqlens, q, k)
    cu_k = host_seqlens.k
    B, H, D = len(cu_k) - 1, k.shape[1], k.shape[2]
    if k_mean is None:
        k_mean = naive_q8_k_mean(k, cu_k)
    else:
        check_tensor("k_mean", k_mean, ndim=3, dtypes=(torch.float32,), shape=(B, H, D))
        k_mean = k_mean.cpu()
    qf = q.cpu().float()
    q8, q_scale = quantize_int8(qf, qf.abs().amax(-1, keepdim=True))
    k8 = torch.empty(k.shape, dtype=torch.int8)
    k_scale = torch.zeros(H, k_scale_slots(k.shape[0], B), dtype=torch.float32)
    v8 = torch.empty(v.shape, dtype=torch.float8_e4m3fn)
    v_scale = torch.zeros(B, H, D, dtype=torch.float32)
    base = k_block_base(cu_k)
    for b in range(B):
        k0, k1 = cu_k[b], cu_k[b + 1]
        Lk = k1 - k0
        if Lk == 0:
            v_scale[b] = AMAX_MIN / E4M3_MAX     # what an empty sequence's amax gives: positive, unused
            continue
        nb = cdiv(Lk, KV_BLOCK)
        ks = k[k0:k1].cpu().float() - k_mean[b]                                   # [Lk, H, D]
        pad = torch.zeros(nb * KV_BLOCK, H, D)
        pad[:Lk] = ks
        amax = pad.abs().view(nb, KV_BLOCK, H, D).amax(dim=(1, 3))               # [nb, H]; padding is 0
        k8b, ksc = quantize_int8(pad.view(nb, KV_BLOCK, H, D), amax[:, None, :, None])
        k8[k0:k1] = k8b.view(-1, H, D)[:Lk]
        k_scale[:, base[b]:base[b] + nb] = ksc.view(nb, H).t()
        vf = v[k0:k1].cpu().float()
        v8[k0:k1], v_scale[b] = quantize_e4m3(vf, vf.abs().amax(0))
    return Q8Operands(q8.view(q.shape), q_scale.view(q.shape[:2]), k8, k_scale, k_mean, v8, v_scale)


# ------------------------------------------------------------------------------------------ attention


class _NoBackward(torch.autograd.Function):
    """The 8-bit plan's output in the graph: `backward` raises, naming the plan."""

    @staticmethod
    def forward(ctx, out, *inputs):
        return out.clone()

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(f"{PLAN} has no backward: the 8-bit stage 2 is a forward only (inference); "
                           f"train with precision='16bit' (the default)")


def refuse_grad(out: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
    """`out`, tied to `inputs` so that a backward through it raises naming the plan (no-op when no
    input needs a gradient)."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
        return _NoBackward.apply(out, *inputs)
    return out


def naive_q8_sparse_attn_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                                topk_idx: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, *,
                                causal: bool = True, softmax_scale: float | None = None,
                                return_lse: bool = False, host_seqlens: HostSeqlens | None = None,
                                operands: Q8Operands | None = None):
    r"""`sparse_attn_varlen` on the 8-bit plan (`precision="int8-fp8"`): the same selection, causal
    limit and results as `naive_sparse_attn_varlen` (64-key blocks; negative, out-of-range, future and
    repeated entries select nothing more; a row with no key gives 0 and `lse = +inf`), computed from
    `naive_q8_quantize`'s operands as the module docstring describes. CPU tensors only.

    Args:
        q (torch.Tensor): `[total_q, HQ, D]`, bf16, fp16 or fp32, `D <= 1024`.
        k, v (torch.Tensor): `[total_k, H, D]`, q's dtype, `HQ = G * H`.
        cu_seqlens_q, cu_seqlens_k (torch.Tensor): int32 `[B+1]`.
        topk_idx (torch.Tensor): int32 `[H, total_q, K]`, 64-key block indices local to each sequence.
        max_seqlen_q, max_seqlen_k (int): Longest query / key sequence (checked only).
        causal (bool, Optional): Default: `True` (bottom-right aligned).
        softmax_scale (float, Optional): Default: `None` (`1 / sqrt(D)`).
        return_lse (bool, Optional): Also return `lse`, float32 `[HQ, total_q]`, natural log: the 8-bit
            scores' (on smoothed K) plus `scale * (q . k_mean)`, the shift smoothing took off. Default:
            `False`.
        host_seqlens (HostSeqlens, Optional): both offsets on the host from a caller that checked every
            input. Default: `None`.
        operands (Q8Operands, Optional): the quantized operands to use (a kernel's, to test the
            attention alone). Default: `None` (`naive_q8_quantize`).

    Returns:
        out (torch.Tensor): `[total_q, HQ, D]` in q's dtype; and `lse` with `return_lse`. Its backward
        raises (no gradients on this plan).
    """
    check_flags(causal=causal, return_lse=return_lse)
    if host_seqlens is None:
        check_attn_tensors(q, k, v, cu_seqlens_q, cu_seqlens_k)
        check_tensor("topk_idx", topk_idx, ndim=3, dtypes=(torch.int32,),
                     shape=(k.shape[1], q.shape[0], None), device=q.device)
        host_seqlens = HostSeqlens.read(cu_seqlens_q, cu_seqlens_k)
        if validate_values():
            check_attn_values(host_seqlens, q, k)
        check_max_seqlen("max_seqlen_q", max_seqlen_q, host_seqlens.lq)
        check_max_seqlen("max_seqlen_k", max_seqlen_k, host_seqlens.lk)
    if q.is_cuda:
        raise ValueError(f"q is a CUDA tensor: {PLAN}'s reference runs on CPU tensors (move them with "
                         f".cpu())")
    if q.shape[2] > MAX_HEAD_DIM:
        raise ValueError(f"q's head dim must be at most {MAX_HEAD_DIM} on {PLAN} (int8 dot products exact "
                         f"in fp32), got {q.shape[2]}")
    scale = check_softmax_scale(softmax_scale, q.shape[2])
    with torch.no_grad():
        ops = operands if operands is not None else naive_q8_quantize(q, k, v, cu_seqlens_q, cu_seqlens_k,
                                                                      host_seqlens=host_seqlens)
        out, lse = _attend(ops, host_seqlens, topk_idx, causal, scale, q.dtype)
        if return_lse:
            lse += _mean_shift(q, ops.k_mean, host_seqlens, scale)
    out = refuse_grad(out, q, k, v)
    return (out, lse) if return_lse else out


def _mean_shift(q: torch.Tensor, k_mean: torch.Tensor, host: HostSeqlens, scale: float) -> torch.Tensor:
    """`scale * (q . k_mean)` per query head and token, fp32 `[HQ, total_q]`: what smoothing K took off
    every score of a row, which the softmax ignores but the `lse` of the unsmoothed keys includes."""
    HQ = q.shape[1]
    G = HQ // k_mean.shape[1]
    shift = torch.zeros(HQ, q.shape[0])
    for b in range(len(host.q) - 1):
        q0, q1 = host.q[b], host.q[b + 1]
        km = k_mean[b].repeat_interleave(G, 0)                                    # [HQ, D]
        shift[:, q0:q1] = (q[q0:q1].float() * km).sum(-1).t() * scale
    return shift


def _clean(idx: torch.Tensor, last: torch.Tensor, nb: int) -> torch.Tensor:
    """`idx [C, K]` sorted ascending per row, with every entry that selects nothing (negative, `>= nb`,
    wholly after the row's last key `last [C]`) and every repeat moved to the end as -1."""
    ok = (idx >= 0) & (idx < nb) & (idx * KV_BLOCK <= last[:, None])
    s = torch.where(ok, idx, nb).sort(dim=1).values
    repeat = torch.zeros_like(ok)
    repeat[:, 1:] = s[:, 1:] == s[:, :-1]
    s = torch.where(repeat, nb, s).sort(dim=1).values
    return torch.where(s == nb, -1, s)


def _attend(ops: Q8Operands, host: HostSeqlens, topk_idx, causal: bool, scale: float, dtype):
    total_q, HQ, D = ops.q8.shape
    H = ops.k8.shape[1]
    G = HQ // H
    K = topk_idx.shape[2]
    out = torch.zeros(total_q, HQ, D, dtype=dtype)
    lse = torch.full((HQ, total_q), math.inf, dtype=torch.float32)
    # the softmax scale in base 2 as the host hands it to a kernel: one fp32 value
    scale_log2 = torch.tensor(scale * _LOG2E, dtype=torch.float32)
    base = k_block_base(host.k)
    step = max(1, _SLOT_ELEMS // (KV_BLOCK * D))
    ar = torch.arange(KV_BLOCK)
    for b, (Lq, Lk) in enumerate(zip(host.lq, host.lk)):
        q0, k0 = host.q[b], host.k[b]
        if Lq == 0 or Lk == 0 or K == 0:
            continue
        nb = cdiv(Lk, KV_BLOCK)
        for h in range(H):
            heads = slice(h * G, (h + 1) * G)
            # whole blocks and a zero block (index nb) that unused slots point to
            kb = torch.zeros(nb + 1, KV_BLOCK, D)
            vb = torch.zeros(nb + 1, KV_BLOCK, D)
            kb.view(-1, D)[:Lk] = ops.k8[k0:k0 + Lk, h].float()
            vb.view(-1, D)[:Lk] = ops.v8[k0:k0 + Lk, h].float()
            ksc = torch.cat([ops.k_scale[h, base[b]:base[b] + nb], torch.zeros(1)])
            vdq = ops.v_scale[b, h]                                               # [D]
            for r0 in range(0, Lq, step):
                r1 = min(Lq, r0 + step)
                r = torch.arange(r0, r1)
                last = (r + Lk - Lq).clamp(max=Lk - 1) if causal else torch.full_like(r, Lk - 1)
                idx = _clean(topk_idx[h, q0 + r0:q0 + r1].long(), last, nb)
                qf = ops.q8[q0 + r0:q0 + r1, heads].float()                       # [C, G, D]
                row = ops.q_scale[q0 + r0:q0 + r1, heads] * scale_log2            # [C, G]
                C = r1 - r0
                m = torch.full((C, G), -math.inf)
                den = torch.zeros(C, G)
                acc = torch.zeros(C, G, D)
                for s in range(K):
                    blk = idx[:, s]
                    valid = blk >= 0
                    if not bool(valid.any()):
                        break                                  # cleaned rows: the -1 entries are last
                    j = torch.where(valid, blk, nb)
                    # exact integer dot products (|sum| <= 127^2 D < 2^24), then one fp32 factor each
                    si = torch.bmm(qf, kb[j].transpose(1, 2))                      # [C, G, 64]
                    sc = si * (row * ksc[j][:, None])[..., None]
                    keep = valid[:, None] & (j[:, None] * KV_BLOCK + ar <= last[:, None])   # [C, 64]
                    sc.masked_fill_(~keep[:, None, :], -math.inf)
                    m_new = torch.maximum(m, sc.amax(-1))
                    alive = m_new > -math.inf
                    m_sub = torch.where(alive, m_new, 0.0)
                    corr = torch.where(alive, (m - m_sub).exp2(), 0.0)
                    p = (sc - m_sub[..., None]).exp2()                             # masked: 0
                    den = den * corr + p.sum(-1)
                    pv = torch.bmm(e4m3_round(p * E4M3_MAX), vb[j])                # [C, G, D], fp32 sums
                    acc = acc * corr[..., None] + pv
                    m = m_new
                has = den > 0
                o = acc / (den * E4M3_MAX).clamp_min(1e-30)[..., None] * vdq
                out[q0 + r0:q0 + r1, heads] = torch.where(has[..., None], o, 0.0).to(dtype)
                lse[heads, q0 + r0:q0 + r1] = torch.where(has, (m + den.log2()) / _LOG2E, math.inf).t()
    return out, lse
