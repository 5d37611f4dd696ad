"""The packed group sum of the sm_90a stage-1 kernel (`Stage1Plan.packed`, docs/stage1.md "Packed group
sum") against the exact float32 path of the same kernel.

The packed path rounds each token's sum over its heads through f16 pairs, so its block scores may
differ from the exact ones by one bf16 step (checked) and its selection may differ where scores are
that close. The tie rule checked here: against the exact path's block scores, with thr the K-th
largest of a row, every block more than two bf16 steps (one rounding on each side, plus a tiny
absolute floor for probabilities in f16's subnormal range) above thr is selected and none more than
two steps below it is; rows without such a near-tie are identical. On
structured inputs the attention mass the packed selection keeps is within 1e-3 of the exact one's.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from infllm_cupy.compress.naive import naive_compress_k
from infllm_cupy.stage1 import select as sel
from infllm_cupy.stage1.plan import stage1_plan
from infllm_cupy.stage1.select import launch_select
from infllm_cupy.testing import cu_seqlens_from_lengths

BF16_STEP = 2.0 ** -7          # one bf16 step, relative (8 significant bits)
# the selection's band: each path rounds its block scores once, so two blocks one step apart in the
# exact scores may change places (the band of check_modulo_ties in test_stage1_select.py)
TIE_BAND = 2 * BF16_STEP
# probabilities below f16's normal range (2^-14, scaled by 2^(11 - min(lgp, 4)) >= 2^7) keep an
# absolute error of 2^-31 each; a floor above the sum of 16 of them
ATOL = 2.0 ** -25


def sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def make_inputs(lengths_q, HQ, H, D, dtype, *, lengths_k=None, seed=0, scale=4.0, tie_heavy=False):
    """Random q and compressed keys (keys scaled so that the softmax is not flat); `tie_heavy` repeats
    a few key vectors so that many blocks score alike."""
    lengths_k = lengths_q if lengths_k is None else lengths_k
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lengths_q), HQ, D, generator=g).to(dtype)
    k = scale * torch.randn(sum(lengths_k), H, D, generator=g)
    if tie_heavy:
        k = k[torch.randint(0, 8, (k.shape[0],), generator=g)]      # 8 distinct keys, repeated
    k = k.to(dtype)
    cu_k = cu_seqlens_from_lengths(lengths_k)
    ck1, cu1 = naive_compress_k(k, cu_k, 32, 16)
    ck2, cu2 = naive_compress_k(k, cu_k, 128, 64)
    return tuple(t.cuda() for t in (q, ck1, ck2, cu_seqlens_from_lengths(lengths_q), cu1, cu2))


def plans(inputs, max_seqlen_q, cache=0, range_blocks=0):
    q, ck1 = inputs[0], inputs[1]
    limits = sel._smem_limits(q.device)
    exact = stage1_plan(torch.cuda.get_device_capability(q.device), q.shape[1] // ck1.shape[1], q.shape[2],
                        q.dtype, torch.bfloat16, -(-(max_seqlen_q + cache) // 64), *limits, "sm90a")
    exact = dataclasses.replace(exact, range_blocks=range_blocks, packed=False)
    return exact, dataclasses.replace(exact, packed=True)


def run_pair(inputs, max_seqlen_q, *, cache_lens=None, range_blocks=0, **kw):
    """(exact idx, exact block scores, packed idx, packed block scores); the selections of the range
    passes have no inspection outputs, so their scores come from a one-launch run of the same plan."""
    cache = 0 if cache_lens is None else int(torch.as_tensor(cache_lens).max())
    exact, packed = plans(inputs, max_seqlen_q, cache, range_blocks)
    kw = dict(kw, cache_lens=cache_lens)
    out = []
    for plan in (exact, packed):
        idx = launch_select(*inputs, max_seqlen_q, plan=plan, **kw)
        whole = dataclasses.replace(plan, range_blocks=0)
        idx1, _, bs = launch_select(*inputs, max_seqlen_q, plan=whole, return_scores=True, **kw)
        assert torch.equal(idx, idx1), "the range passes and the one launch must select alike"
        out += [idx, bs]
    return out


def check_tie_rule(idx_e, bs_e, idx_p, bs_p, K):
    """The packed selection against the exact path's block scores (see the module docstring)."""
    assert idx_p.shape == idx_e.shape and not torch.isnan(bs_p.float()).any()
    e, p = bs_e.double(), bs_p.double()
    fin = torch.isfinite(e)
    assert torch.equal(torch.isfinite(p), fin) and torch.equal(p[~fin], e[~fin]), "+-inf positions differ"
    err = (p - e).abs()[fin]
    tol_s = BF16_STEP * e.abs()[fin] + ATOL
    assert bool((err <= tol_s).all()), (f"{int((err > tol_s).sum())} block scores off by more than one bf16 "
                                        f"step; worst {err.max().item():.3e}")
    H, T, n = e.shape
    sel_mask = torch.zeros(H, T, n + 1, dtype=torch.bool, device=e.device)
    sel_mask.scatter_(-1, torch.where(idx_p >= 0, idx_p.long(), n), True)
    sel_mask = sel_mask[..., :n]
    # the exact path's own choice tells which blocks are causal (it selects -1 for future ones)
    thr = torch.sort(e, dim=-1, descending=True).values[..., K - 1:K]
    tol = torch.where(torch.isfinite(thr), TIE_BAND * thr.abs() + ATOL, torch.zeros_like(thr))
    sel_e = torch.zeros(H, T, n + 1, dtype=torch.bool, device=e.device)
    sel_e.scatter_(-1, torch.where(idx_e >= 0, idx_e.long(), n), True)
    clearly_above = e > thr + tol
    clearly_below = e < thr - tol
    picked_e = sel_e[..., :n]
    must = clearly_above & picked_e             # the exact path took it (so it is causal) and it is clear
    assert bool((sel_mask | ~must).all()), f"{int((must & ~sel_mask).sum())} clearly better blocks left out"
    assert bool((~sel_mask | ~clearly_below).all()), (f"{int((sel_mask & clearly_below).sum())} blocks "
                                                      "clearly below the K-th score selected")
    near = ((e - thr).abs() <= tol) & torch.isfinite(thr)
    ambiguous = (near & (picked_e | sel_mask)).any(-1)
    n_diff = int((idx_p != idx_e).any(-1)[~ambiguous].sum())
    assert n_diff == 0, f"{n_diff} rows without a near-tie differ from the exact path"
    return int((~ambiguous).sum()), ambiguous.numel()


GQA = [(1, 1), (2, 1), (3, 1), (4, 1), (8, 1), (12, 1), (16, 1), (24, 1), (32, 1)]


@pytest.mark.gpu
@pytest.mark.skipif(not sm90(), reason="the packed group sum is a plan of the sm_90a kernel")
@pytest.mark.parametrize("G,H", GQA, ids=[f"G{g}" for g, _ in GQA])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_packed_against_exact_random(G, H, D, dtype):
    lengths = [1500, 335, 383, 1, 64, 130]   # ragged, L % 16 == 15, L % 64 == 63, one token
    inputs = make_inputs(lengths, G * H, H, D, dtype, seed=G + D)
    K = 64 + 32
    ie, be, ip, bp = run_pair(inputs, max(lengths), topk=64, local_blocks=32)
    rows, total = check_tie_rule(ie, be, ip, bp, min(K, be.shape[-1]))
    assert rows >= 0.5 * total, f"only {rows}/{total} rows without a near-tie"


@pytest.mark.gpu
@pytest.mark.skipif(not sm90(), reason="the packed group sum is a plan of the sm_90a kernel")
@pytest.mark.parametrize("G", [4, 16, 32])
@pytest.mark.parametrize("seed", [0, 1])
def test_packed_against_exact_tie_heavy(G, seed):
    lengths = [2000, 700]
    inputs = make_inputs(lengths, G * 2, 2, 128, torch.bfloat16, seed=seed, tie_heavy=True)
    ie, be, ip, bp = run_pair(inputs, max(lengths), topk=16, local_blocks=2)
    check_tie_rule(ie, be, ip, bp, min(18, be.shape[-1]))


@pytest.mark.gpu
@pytest.mark.skipif(not sm90(), reason="the packed group sum is a plan of the sm_90a kernel")
@pytest.mark.parametrize("quirk", [False, True])
@pytest.mark.parametrize("G", [8, 16])
def test_packed_quirks_chunks_and_decode(quirk, G):
    """The varlen offset quirk, a chunked prefill (queries after a cache) and decode (one query per
    sequence, everything visible)."""
    lengths = [1100, 300, 70]
    inputs = make_inputs(lengths, G * 2, 2, 64, torch.bfloat16)
    ie, be, ip, bp = run_pair(inputs, max(lengths), topk=64, local_blocks=32, varlen_offset_quirk=quirk)
    check_tie_rule(ie, be, ip, bp, min(96, be.shape[-1]))
    lk, lq = [1500, 700, 383], [200, 64, 383]
    q, ck1, ck2, cu_q, cu1, cu2 = make_inputs(lq, G * 2, 2, 128, torch.float16, lengths_k=lk)
    cache = torch.tensor([a - b for a, b in zip(lk, lq)], dtype=torch.int32, device="cuda")
    ie, be, ip, bp = run_pair((q, ck1, ck2, cu_q, cu1, cu2), max(lq), cache_lens=cache, topk=64,
                              local_blocks=32)
    check_tie_rule(ie, be, ip, bp, min(96, be.shape[-1]))
    lk = [4000, 1, 127, 2047, 64 * 40 + 63]
    q, ck1, ck2, _, cu1, cu2 = make_inputs(lk, G * 2, 2, 128, torch.bfloat16)
    qd = q[(cu_seqlens_from_lengths(lk)[1:].long() - 1).cuda()].contiguous()
    cu_q = torch.arange(len(lk) + 1, dtype=torch.int32, device="cuda")
    cache = torch.tensor([L - 1 for L in lk], dtype=torch.int32, device="cuda")
    ie, be, ip, bp = run_pair((qd, ck1, ck2, cu_q, cu1, cu2), 1, causal=False, cache_lens=cache, topk=64,
                              local_blocks=32)
    check_tie_rule(ie, be, ip, bp, min(96, be.shape[-1]))


@pytest.mark.gpu
@pytest.mark.skipif(not sm90(), reason="the packed group sum is a plan of the sm_90a kernel")
def test_packed_key_ranges():
    """Range passes (row biases stored and reloaded, candidates merged) select as one launch does."""
    lengths = [20000]
    inputs = make_inputs(lengths, 32, 2, 128, torch.bfloat16)
    ie, be, ip, bp = run_pair(inputs, max(lengths), range_blocks=128, topk=64, local_blocks=32)
    check_tie_rule(ie, be, ip, bp, 96)


@pytest.mark.gpu
@pytest.mark.skipif(not sm90(), reason="the packed group sum is a plan of the sm_90a kernel")
@pytest.mark.parametrize("HQ,H", [(32, 2), (16, 2), (8, 2)])
def test_packed_keeps_the_attention_mass_on_structured_inputs(HQ, H):
    from infllm_cupy.compress import compress_k
    from infllm_cupy.synthetic import structured_sequence
    from infllm_cupy.viz import attention_mass_captured

    T = 8192
    s = structured_sequence(T, HQ, H, 128, dtype=torch.bfloat16, device="cuda", seed=3)
    cu = torch.tensor([0, T], dtype=torch.int32, device="cuda")
    ck1, cu1 = compress_k(s.k, cu, 32, 16)
    ck2, cu2 = compress_k(s.k, cu, 128, 64)
    inputs = (s.q, ck1, ck2, cu, cu1, cu2)
    ie, be, ip, bp = run_pair(inputs, T, topk=64, local_blocks=32)
    check_tie_rule(ie, be, ip, bp, 96)
    kept = attention_mass_captured(s.q, s.k, cu, {"exact": ie, "packed": ip}, progress=False)
    m_e, m_p = kept["exact"].mass.nanmean().item(), kept["packed"].mass.nanmean().item()
    assert abs(m_e - m_p) <= 1e-3, f"kept attention mass {m_p:.5f} (packed) against {m_e:.5f} (exact)"


def test_packed_plan_field():
    """`packed` is a bool of sm_90a plans (the SM80 kernel has no packed path)."""
    from infllm_cupy.stage1.plan import Stage1Plan

    assert Stage1Plan("sm90a", 8, packed=True).packed
    with pytest.raises(ValueError, match="packed"):
        Stage1Plan("sm90a", 8, packed=1)
    with pytest.raises(ValueError, match="packed"):
        Stage1Plan("sm80", 4, packed=True)
