"""Stage 1's CPU implementation (`infllm_cupy/stage1/cpu.py`, tiles of fp32 GEMMs) against the oracle
(`naive_stage1_select`), and the backend rule that picks it (CPU tensors under "auto").

What agrees (docs/cpu.md, "Stage 1 and compression"):
- scores: both compute in fp32 with the same elementwise steps; the sums (coarse normaliser, group sum)
  run in another order, so the fp32 scores differ by a few ulps. They are held to FlashAttention's rule
  against the float64 oracle (at most 2x the oracle's own fp32 error) and, rounded to bf16/fp16, to one
  ulp of the oracle's;
- selections: exactly the oracle's with fp32 scores (no near-tie at fp32 resolution on these inputs);
  with bf16/fp16 scores the rounding can differ by one ulp on about 1e-5 of the scores, so rows are
  checked modulo near-ties (the kernels' rule, `check_modulo_ties`) and nearly all rows must be equal;
- ties: planted ties (q = 0, or fine keys drawn from three vectors: three-valued scores) go to the
  lower block index exactly as `naive_select_topk`, in every score dtype.
"""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import infllm_cupy.stage1.cpu as cpu
from infllm_cupy._checks import HostSeqlens
from infllm_cupy.compress.naive import naive_compress_k
from infllm_cupy.stage1 import stage1_scores, stage1_select
from infllm_cupy.stage1.cpu import cpu_select_topk, cpu_stage1_scores, cpu_stage1_select
from infllm_cupy.stage1.naive import (
    naive_select_topk,
    naive_stage1_scores,
    naive_stage1_select,
    q_block_idx_prefill,
)
from infllm_cupy.testing import cu_seqlens_from_lengths

# one unit in the last place of each score dtype
ULP = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}


def make_inputs(lengths_q, HQ, H, D, dtype, *, lengths_k=None, exact=False, seed=0, three_keys=False):
    """Random q and really compressed keys (keys scaled so that the softmax is not flat). `three_keys`:
    every fine key is one of three vectors (planted ties: three-valued scores in every row)."""
    lengths_k = lengths_q if lengths_k is None else lengths_k
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lengths_q), HQ, D, generator=g).to(dtype)
    k = (4 * torch.randn(sum(lengths_k), H, D, generator=g)).to(dtype)
    cu_k = cu_seqlens_from_lengths(lengths_k)
    ck1, cu1 = naive_compress_k(k, cu_k, 32, 16)
    if three_keys:
        basis = (2 * torch.randn(3, H, D, generator=g)).to(dtype)
        ck1 = basis[torch.randint(0, 3, (ck1.shape[0],), generator=g)]
    ck2, cu2 = (ck1, cu1) if exact else naive_compress_k(k, cu_k, 128, 64)
    return q, ck1, ck2, cu_seqlens_from_lengths(lengths_q), cu1, cu2


def both(inputs, max_seqlen_q, **kw):
    """(cpu, oracle) results of stage 1 with return_scores; the CPU path without return_scores (whose
    rows stop at the columns that can matter) must select the same blocks."""
    got = cpu_stage1_select(*inputs, max_seqlen_q, return_scores=True, **kw)
    want = naive_stage1_select(*inputs, max_seqlen_q, return_scores=True, **kw)
    assert torch.equal(cpu_stage1_select(*inputs, max_seqlen_q, **kw), got[0])
    return got, want


def exact_scores(inputs, max_seqlen_q, **kw):
    """The oracle's scores and block scores in float64 (inputs upcast, scores kept in float64)."""
    kw = dict(kw, score_dtype=torch.float64)
    q, ck1, ck2, *cus = inputs
    _, sc, bs = naive_stage1_select(q.double(), ck1.double(), ck2.double(), *cus, max_seqlen_q,
                                    return_scores=True, **kw)
    return sc, bs


def assert_fa_rule(name, got, want, exact):
    """FlashAttention's rule on fp32 scores: max |got - exact| <= 2 max |oracle - exact| (+ a floor of
    a few fp32 ulps of the largest score); infinities where the oracle has them."""
    inf = torch.isinf(want)
    assert torch.equal(torch.isinf(got), inf) and torch.equal(got[inf], want[inf]), f"{name}: inf positions"
    fin = ~inf
    err = (got.double()[fin] - exact[fin]).abs().max().item() if fin.any() else 0.0
    base = (want.double()[fin] - exact[fin]).abs().max().item() if fin.any() else 0.0
    floor = 4 * 2.0 ** -24 * exact[fin].abs().max().item() if fin.any() else 0.0
    assert err <= 2 * base + floor, f"{name}: {err:.3e} > 2 x {base:.3e} + {floor:.1e}"


def assert_within_ulp(name, got, want, dtype):
    """Elementwise within one ulp of the score dtype; +-inf exactly where the oracle has them."""
    g, w = got.double(), want.double()
    inf = torch.isinf(w)
    assert torch.equal(torch.isinf(g), inf) and torch.equal(g[inf], w[inf]), f"{name}: inf positions"
    bad = (g - w)[~inf].abs() > ULP[dtype] * w[~inf].abs()
    assert not bool(bad.any()), f"{name}: {int(bad.sum())} elements more than one ulp off"


def check_modulo_ties(idx, ref_idx, ref_bs, q_blocks, K, dtype):
    """The kernels' rule against the oracle's own block scores (thr = the K-th largest): every selected
    block scores >= thr and every causal block left out <= thr, up to two ulps; rows without a near-tie
    at thr equal the oracle's exactly. Returns the share of rows equal to the oracle's."""
    r = ref_bs.double()
    thr = torch.sort(r, dim=-1, descending=True).values[..., K - 1:K]
    tol = torch.where(torch.isfinite(thr), 2 * ULP[dtype] * thr.abs(), torch.zeros_like(thr))
    valid = idx >= 0
    out_len = r.shape[-1]
    sel = torch.zeros(*idx.shape[:2], out_len + 1, dtype=torch.bool)
    sel.scatter_(-1, torch.where(valid, idx.long(), out_len), True)
    sel = sel[..., :out_len]
    causal = torch.arange(out_len)[None, None] <= q_blocks.long()[None, :, None]
    assert bool(((r >= thr - tol) | ~sel).all()), "a selected block scores below the K-th oracle score"
    assert bool(((r <= thr + tol) | sel | ~causal).all()), "a causal block left out beats the K-th score"
    near = ((r - thr).abs() <= tol) & causal
    ambiguous = (near.sum(-1) > 1) | ((near.sum(-1) > 0) & ((r >= thr - tol).sum(-1) > K))
    differ = (idx != ref_idx).any(-1)
    assert not bool((differ & ~ambiguous).any()), "an unambiguous row differs from the oracle"
    return 1.0 - differ.float().mean().item()


# (lengths, HQ, H, D, dtype): ragged batches with lengths not multiples of 16 or 64 (both quirks:
# L % 16 == 15 at 335 and 1023, L % 64 == 63 at 383, 1023, 191), 1-token sequences and sequences
# shorter than one fine window, G from 1 to 32, head dims 16 to 128, every input dtype
CASES = [
    ([1000], 32, 2, 128, torch.bfloat16),
    ([1023, 335, 383, 127, 64, 1, 200], 16, 1, 128, torch.bfloat16),
    ([2000, 700], 8, 1, 64, torch.float16),
    ([513, 130, 17, 1], 4, 2, 64, torch.float32),
    ([900, 40], 4, 4, 128, torch.bfloat16),
    ([777, 191], 16, 4, 64, torch.float32),
    ([600, 100, 1], 32, 1, 128, torch.float16),
    ([450, 320], 24, 2, 96, torch.bfloat16),
    ([333, 1, 65], 6, 2, 16, torch.float64),
    ([1200, 31], 2, 2, 32, torch.float32),
    ([700], 3, 1, 80, torch.bfloat16),
]
IDS = [f"L{'-'.join(map(str, c[0]))}_HQ{c[1]}_H{c[2]}_D{c[3]}_{str(c[4])[6:]}" for c in CASES]


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_cpu_select_equals_oracle_with_fp32_scores(case):
    lengths, HQ, H, D, dtype = case
    inputs = make_inputs(lengths, HQ, H, D, dtype, seed=len(lengths))
    kw = dict(topk=5, local_blocks=2, score_dtype=torch.float32)
    (idx, sc, bs), (ref_idx, ref_sc, ref_bs) = both(inputs, max(lengths), **kw)
    assert torch.equal(idx, ref_idx)
    ex_sc, ex_bs = exact_scores(inputs, max(lengths), **kw)
    assert_fa_rule("scores", sc, ref_sc, ex_sc)
    assert_fa_rule("block_scores", bs, ref_bs, ex_bs)
    # the default path (no return_scores) selects the same blocks
    assert torch.equal(cpu_stage1_select(*inputs, max(lengths), **kw), idx)


@pytest.mark.parametrize("score_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_cpu_select_low_precision_scores_equal_oracle_modulo_near_ties(case, score_dtype):
    lengths, HQ, H, D, dtype = case
    inputs = make_inputs(lengths, HQ, H, D, dtype, seed=len(lengths))
    kw = dict(topk=5, local_blocks=2, score_dtype=score_dtype)
    (idx, sc, bs), (ref_idx, ref_sc, ref_bs) = both(inputs, max(lengths), **kw)
    assert_within_ulp("scores", sc, ref_sc, score_dtype)
    assert_within_ulp("block_scores", bs, ref_bs, score_dtype)
    q_blocks = q_block_idx_prefill(inputs[3], max(lengths))
    same = check_modulo_ties(idx, ref_idx, ref_bs, q_blocks, ref_idx.shape[-1], score_dtype)
    assert same >= 0.999, f"only {same:.4%} of the rows equal the oracle's"
    # our indices are exactly the top-K of our own block scores under the tie rule
    assert torch.equal(idx, naive_select_topk(bs, q_blocks, topk=5, local_blocks=2))


@pytest.mark.parametrize("score_dtype", [torch.bfloat16, torch.float16, torch.float32, None],
                         ids=["bf16", "fp16", "fp32", "compute"])
@pytest.mark.parametrize("plant", ["q_zero", "three_keys"])
def test_planted_ties_go_to_the_lower_block_exactly(plant, score_dtype):
    # q = 0: every visible fine key scores the same; three_keys: every fine key is one of three vectors,
    # so every row holds three values, each many times. Both pick exactly the oracle's blocks.
    lengths = [1000, 333, 64, 1]
    inputs = make_inputs(lengths, 16, 2, 64, torch.bfloat16, three_keys=plant == "three_keys")
    if plant == "q_zero":
        inputs = (torch.zeros_like(inputs[0]), *inputs[1:])
    kw = dict(topk=6, local_blocks=2, score_dtype=score_dtype)
    (idx, _, bs), (ref_idx, _, ref_bs) = both(inputs, 1000, **kw)
    assert torch.equal(idx, ref_idx)
    assert torch.equal(bs.isinf(), ref_bs.isinf())
    # the ties are real: most rows hold several equal finite block scores
    fin = bs[..., :-1].isfinite()
    assert bool(((bs[..., 1:] == bs[..., :-1]) & fin).any(-1).float().mean() > 0.5)


def test_ties_last_token_by_hand():
    # q = 0, last token of sequence 0 (block 15): K = 5, forced 0, 14 and 15, then the two lowest others
    inputs = make_inputs([1000, 700], 8, 2, 64, torch.float32)
    inputs = (torch.zeros_like(inputs[0]), *inputs[1:])
    idx = cpu_stage1_select(*inputs, 1000, topk=4, local_blocks=1)
    assert idx[:, 999].tolist() == [[0, 1, 2, 14, 15]] * 2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("width", [1, 7, 64, 300])
def test_cpu_select_topk_is_the_oracles_on_three_valued_scores(width, dtype):
    # every score one of seven values (+-inf, +-0.0 among them): ties everywhere, resolved by index
    g = torch.Generator().manual_seed(width)
    vals = torch.tensor([float("-inf"), -1.5, -0.0, 0.0, 0.25, 3.0, float("inf")])
    bs = vals[torch.randint(0, 7, (2, 40, width), generator=g)].to(dtype)
    q_blocks = torch.randint(0, width, (40,), generator=g, dtype=torch.int32)
    for topk, local in ((1, 0), (3, 2), (width, 0), (0, 0), (5, 1)):
        want = naive_select_topk(bs, q_blocks, topk=topk, local_blocks=local)
        assert torch.equal(cpu_select_topk(bs, q_blocks, topk=topk, local_blocks=local), want), (topk, local)


@pytest.mark.parametrize("topk,local_blocks,init_blocks", [(64, 32, 1), (3, 2, 1), (0, 3, 1), (5, 0, 3),
                                                           (2, 1, 0), (0, 0, 0)])
def test_budgets_and_forced_future_init_blocks(topk, local_blocks, init_blocks):
    # init_blocks = 3: blocks 1 and 2 are forced (+inf) for the tokens of block 0 as well, take slots
    # and become -1; K = 0 gives empty rows
    lengths = [900, 130, 17]
    inputs = make_inputs(lengths, 8, 2, 64, torch.bfloat16)
    kw = dict(topk=topk, local_blocks=local_blocks, init_blocks=init_blocks, score_dtype=torch.float32)
    (idx, _, bs), (ref_idx, _, ref_bs) = both(inputs, 900, **kw)
    assert torch.equal(idx, ref_idx)
    assert torch.equal(bs.isinf(), ref_bs.isinf()) and idx.shape == ref_idx.shape


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("exact", [False, True], ids=["lse", "exact"])
def test_chunked_prefill_cache_lens_and_modes(causal, exact):
    # query chunks shorter than their keys (bottom-right aligned), cache_lens > 0, exact mode
    lq, lk = [300, 70, 1, 129], [1000, 70, 400, 600]
    cache = [k - q for q, k in zip(lq, lk)]
    inputs = make_inputs(lq, 16, 2, 64, torch.bfloat16, lengths_k=lk, exact=exact)
    for cache_lens in (cache, torch.tensor(cache, dtype=torch.int32)):
        kw = dict(topk=4, local_blocks=2, causal=causal, cache_lens=cache_lens, score_dtype=torch.float32)
        (idx, sc, bs), (ref_idx, ref_sc, ref_bs) = both(inputs, 300, **kw)
        assert torch.equal(idx, ref_idx)
        ex_sc, ex_bs = exact_scores(inputs, 300, **kw)
        assert_fa_rule("scores", sc, ref_sc, ex_sc)
        assert_fa_rule("block_scores", bs, ref_bs, ex_bs)


@pytest.mark.parametrize("G", [1, 2, 16, 32])
def test_decode_rows(G):
    # one query per sequence, non-causal, cache_lens = L - 1 (spec 4.4): the decode step's stage 1
    lk = [1000, 64, 129, 2000, 31]
    inputs = make_inputs([1] * len(lk), 2 * G, 2, 128, torch.bfloat16, lengths_k=lk)
    kw = dict(causal=False, cache_lens=[L - 1 for L in lk], topk=8, local_blocks=2, score_dtype=torch.float32)
    (idx, _, _), (ref_idx, _, _) = both(inputs, 1, **kw)
    assert torch.equal(idx, ref_idx)


def test_varlen_offset_quirk_and_oversized_max_seqlen_q():
    # the quirk offsets the query block by max_seqlen_q - L_b; an oversized max_seqlen_q widens the
    # oracle's rows (out_len) and the quirk's offsets; the CPU path's rows stay as wide as the data
    lengths = [500, 130, 1]
    inputs = make_inputs(lengths, 8, 2, 64, torch.bfloat16)
    for max_q in (500, 4000):
        for quirk in (False, True):
            kw = dict(topk=30, local_blocks=2, varlen_offset_quirk=quirk, score_dtype=torch.float32)
            (idx, _, bs), (ref_idx, _, ref_bs) = both(inputs, max_q, **kw)
            assert torch.equal(idx, ref_idx), (max_q, quirk)
            assert bs.shape == ref_bs.shape and torch.equal(bs.isinf(), ref_bs.isinf())


def test_tiles_and_column_chunks(monkeypatch):
    # tiny tiles: many query tiles per sequence, fine keys in several column chunks per tile
    lengths = [2100, 300]
    inputs = make_inputs(lengths, 4, 2, 32, torch.bfloat16)
    kw = dict(topk=5, local_blocks=2, score_dtype=torch.float32)
    want = naive_stage1_select(*inputs, 2100, **kw)
    monkeypatch.setattr(cpu, "TILE_ELEMS", 4096)
    monkeypatch.setattr(cpu, "MIN_TILE_ROWS", 2)
    monkeypatch.setattr(cpu, "FINE_MIN_COLS", 32)
    assert torch.equal(cpu_stage1_select(*inputs, 2100, **kw), want)


@pytest.mark.parametrize("block_size,kernel_stride,coarse", [(32, 16, 64), (128, 16, 64), (64, 32, 128)])
def test_other_block_sizes_and_strides(block_size, kernel_stride, coarse):
    # the reference's generality: any block size that is a multiple of the fine stride
    lengths = [1100, 200]
    g = torch.Generator().manual_seed(3)
    q = torch.randn(sum(lengths), 4, 32, generator=g)
    k = 4 * torch.randn(sum(lengths), 2, 32, generator=g)
    cu = cu_seqlens_from_lengths(lengths)
    ck1, cu1 = naive_compress_k(k, cu, 2 * kernel_stride, kernel_stride)
    ck2, cu2 = naive_compress_k(k, cu, 2 * coarse, coarse)
    kw = dict(topk=4, local_blocks=1, block_size=block_size, kernel_stride=kernel_stride,
              coarse_kernel_stride=coarse, score_dtype=torch.float32)
    (idx, _, bs), (ref_idx, _, ref_bs) = both((q, ck1, ck2, cu, cu1, cu2), 1100, **kw)
    assert torch.equal(idx, ref_idx) and bs.shape == ref_bs.shape


def test_host_seqlens_and_empty_batch():
    inputs = make_inputs([300, 0, 90], 4, 2, 32, torch.float32)
    host = HostSeqlens.from_lengths([300, 0, 90], [])
    kw = dict(topk=3, local_blocks=1, score_dtype=torch.float32)
    assert torch.equal(cpu_stage1_select(*inputs, 300, host_seqlens=host, **kw),
                       naive_stage1_select(*inputs, 300, **kw))
    empty = make_inputs([0, 0], 4, 2, 32, torch.float32)
    got, want = both(empty, 0, **kw)
    assert all(a.shape == b.shape for a, b in zip(got, want))


def test_stage1_scores_on_cpu():
    lengths = [700, 65, 1]
    inputs = make_inputs(lengths, 16, 2, 64, torch.bfloat16)
    for score_dtype in (torch.bfloat16, torch.float32):
        got = cpu_stage1_scores(*inputs, 700, score_dtype=score_dtype)
        want = naive_stage1_scores(*inputs, 700, score_dtype=score_dtype)
        assert torch.equal(stage1_scores(*inputs, 700, score_dtype=score_dtype), got)       # "auto" on CPU
        assert torch.equal(stage1_scores(*inputs, 700, score_dtype=score_dtype, backend="reference"), want)
        if score_dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
        else:
            assert_within_ulp("scores", got, want, score_dtype)


def test_backend_rule_auto_is_the_cpu_implementation_reference_the_oracle(monkeypatch):
    inputs = make_inputs([400, 130], 8, 2, 32, torch.float32)
    calls = []
    monkeypatch.setattr("infllm_cupy.stage1.select.cpu_stage1_select",
                        lambda *a, **k: calls.append("cpu") or cpu_stage1_select(*a, **k))
    monkeypatch.setattr("infllm_cupy.stage1.select.naive_stage1_select",
                        lambda *a, **k: calls.append("naive") or naive_stage1_select(*a, **k))
    kw = dict(topk=4, local_blocks=2, return_scores=True)
    got = stage1_select(*inputs, 400, **kw)
    ref = stage1_select(*inputs, 400, backend="reference", **kw)
    assert calls == ["cpu", "naive"]
    assert torch.equal(got[0], ref[0])
    assert all(torch.equal(a, b) for a, b in zip(ref, naive_stage1_select(*inputs, 400, **kw)))


@pytest.mark.parametrize("bad, match", [
    (dict(q=torch.zeros(10, 8, 32, dtype=torch.int32)), "q must have dtype"),
    (dict(ck2=torch.zeros(3, 3, 32)), "ck2 must have shape"),
    (dict(max_seqlen_q=5), "max_seqlen_q"),
    (dict(max_seqlen_q=-1), "max_seqlen_q"),
    (dict(topk=-1), "topk"),
    (dict(block_size=40), "block_size"),
    (dict(cache_lens=[1]), "cache_lens"),
    (dict(score_dtype=torch.int32), "score_dtype"),
    (dict(causal="yes"), "causal"),
])
def test_cpu_select_raises_as_the_oracle(bad, match):
    inputs = dict(zip(("q", "ck1", "ck2", "cu_seqlens_q", "cu_seqlens_c1", "cu_seqlens_c2"),
                      make_inputs([300, 90], 8, 2, 32, torch.float32)))
    kw = dict(inputs, max_seqlen_q=300, topk=3, local_blocks=1)
    kw.update(bad)
    errors = []
    for fn in (cpu_stage1_select, naive_stage1_select):
        with pytest.raises((ValueError, TypeError), match=match) as e:
            fn(**kw)
        errors.append((type(e.value), str(e.value)))
    assert errors[0] == errors[1]


def test_oversized_max_seqlen_q_costs_no_memory():
    # issue 57: max_seqlen_q = 10^8 for 512 tokens made the oracle's rows 1.56M blocks wide (20.5 GB
    # of fp32 scores at 2 heads); the CPU path sizes its rows from the data. Peak RSS of a fresh process
    # (ru_maxrss), after a warm-up call at the true length, must not grow by more than 64 MiB.
    code = textwrap.dedent("""
        import resource, torch
        from infllm_cupy.compress.naive import naive_compress_k
        from infllm_cupy.stage1 import stage1_select
        from infllm_cupy.testing import cu_seqlens_from_lengths
        g = torch.Generator().manual_seed(0)
        q = torch.randn(512, 32, 128, generator=g).bfloat16()
        k = torch.randn(512, 2, 128, generator=g).bfloat16()
        cu = cu_seqlens_from_lengths([512])
        ck1, cu1 = naive_compress_k(k, cu, 32, 16)
        ck2, cu2 = naive_compress_k(k, cu, 128, 64)
        a = stage1_select(q, ck1, ck2, cu, cu1, cu2, 512, topk=64, local_blocks=32)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        b = stage1_select(q, ck1, ck2, cu, cu1, cu2, 10 ** 8, topk=64, local_blocks=32)
        grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
        # K = min(96, out_len): 8 blocks at the true length, 96 slots (the tail -1) at 10^8
        ok = torch.equal(b[..., :8], a) and bool((b[..., 8:] == -1).all()) and b.shape[-1] == 96
        print(grown, ok)
    """)
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr
    grown_kib, ok = res.stdout.split()
    assert ok == "True"
    assert int(grown_kib) < 64 * 1024, f"peak RSS grew by {int(grown_kib) / 1024:.0f} MiB"


def test_tiles_on_threads_same_bits_for_any_thread_count_and_errors_propagate(monkeypatch):
    # every torch call of a tile runs on one thread: 1, 2 or 3 threads give the same bits; torch's
    # thread count is restored, also when a tile raises (the error reaches the caller)
    inputs = make_inputs([1500, 700, 33], 16, 2, 64, torch.bfloat16)
    kw = dict(topk=5, local_blocks=2, score_dtype=torch.float32, return_scores=True)
    before = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            results.append(cpu_stage1_select(*inputs, 1500, **kw))
            assert torch.get_num_threads() == n
        for r in results[1:]:
            assert all(torch.equal(a, b) for a, b in zip(r, results[0]))
        torch.set_num_threads(2)
        calls = []

        def broken(self, b, start, *a):
            calls.append(start)
            if start == 0:
                raise RuntimeError("tile failed")
            return tile(self, b, start, *a)

        tile = cpu._Run._tile
        monkeypatch.setattr(cpu._Run, "_tile", broken)
        with pytest.raises(RuntimeError, match="tile failed"):
            cpu_stage1_select(*inputs, 1500, **kw)
        assert torch.get_num_threads() == 2 and calls
    finally:
        torch.set_num_threads(before)


def test_strided_inputs():
    # q and the compressed keys as views with strides of their own (a slice of wider heads, every other
    # key row): the same selection and scores as their contiguous copies
    q, ck1, ck2, cu, cu1, cu2 = make_inputs([700, 90], 8, 2, 32, torch.bfloat16)
    wide = torch.zeros(q.shape[0], 16, 32, dtype=q.dtype)
    wide[:, ::2] = q
    rows1 = torch.zeros(2 * ck1.shape[0], 2, 32, dtype=ck1.dtype)
    rows1[::2] = ck1
    kw = dict(topk=4, local_blocks=1, score_dtype=torch.float32, return_scores=True)
    got = cpu_stage1_select(wide[:, ::2], rows1[::2], ck2, cu, cu1, cu2, 700, **kw)
    want = cpu_stage1_select(q, ck1, ck2, cu, cu1, cu2, 700, **kw)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert torch.equal(got[0], naive_stage1_select(q, ck1, ck2, cu, cu1, cu2, 700, **kw)[0])
