"""The sm_90a stage-1 kernel's key-tile ring (`Stage1Plan.key_stages`, template NS): the plan's choice
(CPU) and the deeper rings' outputs against the 2-stage kernel, bit for bit (GPU, capability 9.0).
docs/stage1.md, 3. The sm_90a kernel, its key-tile ring."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from infllm_cupy.compress.naive import naive_compress_k
from infllm_cupy.stage1 import plan as pl
from infllm_cupy.stage1 import select as sel
from infllm_cupy.stage1.plan import KEY_STAGES, KEY_STAGES_MAX, Stage1Plan, deepest_ring, smem_bytes_sm90, stage1_plan
from infllm_cupy.stage1.select import launch_select
from infllm_cupy.testing import cu_seqlens_from_lengths

from conftest import HAS_GPU

H100 = (227 * 1024, 228 * 1024)   # (opt-in per-block, per-SM) dynamic shared memory
TWO_PER_SM = H100[1] // 2 - 1024
BF16, FP32 = torch.bfloat16, torch.float32


# --------------------------------------------------------------------------------------------
# CPU: layout, plan, names
# --------------------------------------------------------------------------------------------
def test_ring_smem_layout():
    # each stage is one 64-key tile of D elements: 16 KB at D = 128 in 16-bit types
    for D, lgp in ((64, 0), (128, 4), (128, 5)):
        base = smem_bytes_sm90(D, 2, lgp, 512, 2, True)
        assert smem_bytes_sm90(D, 2, lgp, 512, 2, True, 2) == base
        for ns in (3, 4):
            assert smem_bytes_sm90(D, 2, lgp, 512, 2, True, ns) - base == (ns - 2) * 64 * D * 2
    p = Stage1Plan("sm90a", 8, True, 0, 0, 3)
    assert p.smem_bytes(16, 128, 2, 2048, 2) == smem_bytes_sm90(128, 2, 4, 2048, 2, True, 3)


def test_default_plan_follows_the_switches():
    """The plan's ring follows KEY_STAGES_MAX and RING_RANGES_MIN (2 and 0 until a device A/B says
    otherwise, tools/ab_stage1_ring.py: then no plan takes a deeper ring)."""
    from infllm_cupy.stage1.plan import RING_RANGES_MIN

    for G in (1, 2, 16, 32):
        for out_len in (64, 512, 2048, 8192, 16384):
            for sdt in (BF16, FP32):
                kw = dict(rows=2 * 64 * out_len, scratch_budget=10 * 2**30)
                p = stage1_plan((9, 0), G, 128, BF16, sdt, out_len, *H100, **kw)
                assert p == stage1_plan((9, 0), G, 128, BF16, sdt, out_len, *H100, max_key_stages=KEY_STAGES_MAX,
                                        ring_ranges_min=RING_RANGES_MIN, **kw)
                assert p.key_stages <= KEY_STAGES_MAX
                if KEY_STAGES_MAX == 2:
                    assert p == stage1_plan((9, 0), G, 128, BF16, sdt, out_len, *H100, max_key_stages=2,
                                            ring_ranges_min=0, **kw)
                    assert p.key_stages == 2, p


@pytest.mark.parametrize("G", [1, 2, 16, 32])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("sdt", [BF16, FP32], ids=["bf16keys", "fp32keys"])
def test_deeper_ring_keeps_occupancy(G, D, sdt):
    """max_key_stages = 4 (ranges kept): the plan is the 2-stage plan but for the ring, which is the deepest that
    keeps the CTAs per SM (two stay two, one stays one); one stage more would not."""
    kb = 4 if sdt == FP32 else 2
    seen = set()
    for out_len in (64, 300, 512, 1024, 1536, 2048, 3000, 4096, 8192, 16384):
        kw = dict(rows=2 * 64 * out_len, scratch_budget=2**30)
        p2 = stage1_plan((9, 0), G, D, BF16, sdt, out_len, *H100, max_key_stages=2, **kw)
        p4 = stage1_plan((9, 0), G, D, BF16, sdt, out_len, *H100, max_key_stages=4, ring_ranges_min=0, **kw)
        assert dataclasses.replace(p4, key_stages=2) == p2
        b2, b4 = (p.smem_bytes(G, D, 2, out_len, kb) for p in (p2, p4))
        limit = TWO_PER_SM if b2 <= TWO_PER_SM else H100[0]
        assert b4 <= limit, (out_len, p4)
        if p4.key_stages < 4:
            deeper = dataclasses.replace(p4, key_stages=p4.key_stages + 1)
            assert deeper.smem_bytes(G, D, 2, out_len, kb) > limit, (out_len, p4)
        seen.add(p4.key_stages)
        p3 = stage1_plan((9, 0), G, D, BF16, sdt, out_len, *H100, max_key_stages=3, ring_ranges_min=0, **kw)
        assert p3.key_stages == min(3, p4.key_stages)
    assert 4 in seen     # short rows: the deepest ring


def test_ring_choice_at_the_readme_config():
    """G = 16, D = 128, bf16 (16 KB key tiles): 32k tokens take 4 stages, 64k 3, 128k stays at 2
    (a third stage would leave one CTA per SM), the global scratch 4 (small CTAs), 512k's ranges
    of 2816 blocks 2 (narrower ranges for a deeper ring are the A/B's question, not the plan's)."""
    def ns(out_len, **kw):
        return stage1_plan((9, 0), 16, 128, BF16, BF16, out_len, *H100, max_key_stages=4, ring_ranges_min=0, **kw)
    assert ns(512).key_stages == 4 and ns(1024).key_stages == 3 and ns(2048).key_stages == 2
    p = ns(8192, rows=2 * 2**19, scratch_budget=2**40)
    assert p.range_blocks == 2816 and p.key_stages == 2
    p = ns(16384 * 3, rows=2 * 3 * 2**20, scratch_budget=2**40)
    assert not p.block_keys_in_smem and p.range_blocks == 0 and p.key_stages == 4
    # the SM80 kernel has its fixed double buffer
    assert stage1_plan((8, 0), 16, 128, BF16, BF16, 512, *H100, max_key_stages=4).key_stages == 2
    assert deepest_ring(Stage1Plan("sm80", 4), 16, 128, 2, 512, 2, *H100, 4) == Stage1Plan("sm80", 4)


def test_ring_may_narrow_the_ranges():
    """ring_ranges_min > 0 (off by default): a plan at two CTAs per SM whose deeper ring would drop
    it to one splits its rows into the widest ranges that keep two, if they are that wide."""
    def plan(out_len, ns, rr, **kw):
        return stage1_plan((9, 0), 16, 128, BF16, BF16, out_len, *H100, max_key_stages=ns, ring_ranges_min=rr, **kw)
    # 128k (out_len 2048): 3 stages fit two per SM with ranges of 1792 blocks, 4 with 768
    assert (plan(2048, 3, 1024).key_stages, plan(2048, 3, 1024).range_blocks) == (3, 1792)
    assert (plan(2048, 4, 1024).key_stages, plan(2048, 4, 1024).range_blocks) == (3, 1792)
    assert (plan(2048, 4, 64).key_stages, plan(2048, 4, 64).range_blocks) == (4, 768)
    assert plan(2048, 4, 2048) == plan(2048, 2, 0)             # no range that wide: today's plan
    # 512k: today's ranges of 2816 narrow to 1792 for 3 stages
    big = dict(rows=2 * 2**19, scratch_budget=2**40)
    assert (plan(8192, 3, 1024, **big).key_stages, plan(8192, 3, 1024, **big).range_blocks) == (3, 1792)
    # where the deeper ring fits as it is, no ranges; the block keys stay in shared memory
    p = plan(512, 4, 64)
    assert (p.key_stages, p.range_blocks) == (4, 0)
    for out_len in (1024, 2048, 8192):
        p = plan(out_len, 4, 64, **big)
        assert p.block_keys_in_smem and p.smem_bytes(16, 128, 2, out_len, 2) <= TWO_PER_SM
    with pytest.raises(ValueError, match="ring_ranges_min must be"):
        plan(512, 3, 100)
    with pytest.raises(ValueError, match="ring_ranges_min must be"):
        plan(512, 3, True)


@pytest.mark.parametrize("bad", [1, 5, True, 3.0, "3"])
def test_key_stages_checked(bad):
    with pytest.raises(ValueError, match="key_stages must be one of"):
        Stage1Plan("sm90a", 8, key_stages=bad)
    with pytest.raises(ValueError, match="max_key_stages must be one of"):
        stage1_plan((9, 0), 16, 128, BF16, BF16, 512, *H100, max_key_stages=bad)
    with pytest.raises(ValueError, match="key_stages must be 2 for the SM80 kernel"):
        sel.kernel_name(BF16, BF16, 128, False, False, 3)
    with pytest.raises(ValueError, match="key_stages must be one of"):
        Stage1Plan("sm80", 4, key_stages=3)


def test_ring_instances_named_and_registered():
    from infllm_cupy import _jit

    assert KEY_STAGES == (2, 3, 4)
    # NS = 2 is the template's default: today's names (and machine code) unchanged
    assert sel.kernel_name(BF16, BF16, 128, True) == "stage1_select_sm90<__nv_bfloat16, unsigned short, 128, false>"
    assert sel.kernel_name(BF16, BF16, 128, True, key_stages=2) == sel.kernel_name(BF16, BF16, 128, True)
    assert sel.kernel_name(torch.float16, FP32, 64, True, True, 4) == "stage1_select_sm90<__half, unsigned, 64, true, 4>"
    names = {n for ks in _jit.registered() if ks.source == sel.SOURCE_SM90 for n in ks.names}
    want = {sel.kernel_name(dt, st, d, True, rg, ns) for ns in KEY_STAGES for rg in (False, True)
            for dt in (BF16, torch.float16) for st in (BF16, FP32) for d in (64, 128)}
    assert names == want and len(want) == 48
    assert pl.KEY_STAGES is sel.KEY_STAGES


# --------------------------------------------------------------------------------------------
# GPU (capability 9.0): deeper rings give the 2-stage kernel's outputs, bit for bit
# --------------------------------------------------------------------------------------------
HOPPER = HAS_GPU and torch.cuda.get_device_capability() == (9, 0)
hopper = pytest.mark.skipif(not HOPPER, reason="the sm_90a kernel needs compute capability 9.0")

# (lengths, HQ, H, D, dtype): ragged, one-token and sub-tile sequences, sequences with more key tiles
# than any ring holds (5300 tokens: 5 coarse + 21 fine tiles at a stride of 16 / 64), G 1, 2, 16,
# 24 (padded to 32), 32, D 64 and 128, bf16 and fp16
RING_CASES = [
    ([5300, 700, 33, 2100], 16, 1, 128, torch.bfloat16),
    ([4500, 1, 200], 32, 1, 64, torch.float16),
    ([6000, 127, 1300], 2, 2, 128, torch.float16),
    ([3900, 64 * 20 + 63], 4, 2, 64, torch.bfloat16),
    ([3000, 500], 24, 1, 128, torch.bfloat16),
    ([2500, 64], 1, 1, 64, torch.bfloat16),
]


def ring_inputs(lengths, HQ, H, D, dtype, seed):
    """Fresh random q and really compressed keys (keys scaled so that the softmax is not flat)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lengths), HQ, D, generator=g).to(dtype)
    k = (4 * torch.randn(sum(lengths), H, D, generator=g)).to(dtype)
    cu_k = cu_seqlens_from_lengths(lengths)
    ck1, cu1 = naive_compress_k(k, cu_k, 32, 16)
    ck2, cu2 = naive_compress_k(k, cu_k, 128, 64)
    return tuple(t.to("cuda") for t in (q, ck1, ck2, cu_k, cu1, cu2))


def sm90_plan(inputs, max_seqlen_q, score_dtype, **fields):
    q, ck1 = inputs[0], inputs[1]
    p = stage1_plan((9, 0), q.shape[1] // ck1.shape[1], q.shape[2], q.dtype, score_dtype,
                    -(-max_seqlen_q // 64), *sel._smem_limits(q.device), "sm90a")
    return dataclasses.replace(p, **fields)


def assert_same(got, want, what):
    got, want = (got,) if torch.is_tensor(got) else got, (want,) if torch.is_tensor(want) else want
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.shape == b.shape and a.dtype == b.dtype, what
        # outputs are NaN-poisoned at allocation (conftest): an unwritten element fails both checks
        assert not (torch.isnan(a).any() if a.is_floating_point() else (a == -(2**30)).any()), f"{what}[{i}] unwritten"
        n_bad = int((a != b).reshape(a.shape[0], a.shape[1], -1).any(-1).sum())
        assert n_bad == 0, f"{what}[{i}]: {n_bad} rows differ from the 2-stage kernel"


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("ns", [3, 4])
@pytest.mark.parametrize("case", RING_CASES, ids=lambda c: f"L{c[0][0]}_G{c[1] // c[2]}_D{c[3]}")
def test_deeper_ring_equals_two_stages(case, ns):
    lengths, HQ, H, D, dtype = case
    inputs = ring_inputs(lengths, HQ, H, D, dtype, seed=100 + ns + HQ)
    L = max(lengths)
    for sdt in (BF16, FP32):
        kw = dict(score_dtype=sdt, topk=16, local_blocks=8)
        two = sm90_plan(inputs, L, sdt, key_stages=2, range_blocks=0)
        deep = dataclasses.replace(two, key_stages=ns)
        assert_same(launch_select(*inputs, L, plan=deep, **kw), launch_select(*inputs, L, plan=two, **kw),
                    f"ns={ns} topk_idx {sdt}")
        assert_same(launch_select(*inputs, L, plan=deep, return_scores=True, **kw),
                    launch_select(*inputs, L, plan=two, return_scores=True, **kw), f"ns={ns} scores {sdt}")
    # block keys in the global scratch (the plan's choice past shared memory)
    kw = dict(score_dtype=BF16, topk=64, local_blocks=32)
    two = sm90_plan(inputs, L, BF16, key_stages=2, range_blocks=0, block_keys_in_smem=False)
    assert_same(launch_select(*inputs, L, plan=dataclasses.replace(two, key_stages=ns), **kw),
                launch_select(*inputs, L, plan=two, **kw), f"ns={ns} scratch")


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("ns", [3, 4])
def test_deeper_ring_range_passes(ns):
    """Range passes (the coarse bias kept by the first, loaded by the others; a tile of overlap in
    front of each range) on a deeper ring: the 2-stage passes' selection, and the one launch's."""
    for lengths, HQ, H, D, dtype in (([9000, 1023, 1], 32, 2, 128, torch.bfloat16), ([7000, 335], 4, 2, 64,
                                                                                      torch.float16)):
        inputs = ring_inputs(lengths, HQ, H, D, dtype, seed=7 + ns)
        L = max(lengths)
        one = launch_select(*inputs, L, plan=sm90_plan(inputs, L, BF16, range_blocks=0), topk=8, local_blocks=4)
        for rb in (64, 128):
            kw = dict(topk=8, local_blocks=4)
            two = sm90_plan(inputs, L, BF16, key_stages=2, range_blocks=rb, block_keys_in_smem=True)
            got = launch_select(*inputs, L, plan=dataclasses.replace(two, key_stages=ns), **kw)
            assert_same(got, launch_select(*inputs, L, plan=two, **kw), f"ns={ns} ranges={rb}")
            assert_same(got, one, f"ns={ns} ranges={rb} vs one launch")
        # the scores asked for: the launcher drops the ranges and runs one launch on the ring
        deep = sm90_plan(inputs, L, BF16, key_stages=ns, range_blocks=64, block_keys_in_smem=True)
        two = dataclasses.replace(deep, key_stages=2, range_blocks=0)
        assert_same(launch_select(*inputs, L, plan=deep, return_scores=True, topk=8, local_blocks=4),
                    launch_select(*inputs, L, plan=two, return_scores=True, topk=8, local_blocks=4),
                    f"ns={ns} ranges dropped for the scores")


@pytest.mark.gpu
@hopper
def test_deeper_ring_decode_and_chunked():
    """Decode (one query per sequence, causal = False, every compressed key visible) and a chunked
    prefill (queries after a cache): the tiles start at other offsets."""
    lk = [4000, 1, 127, 2047, 64 * 40 + 63]
    q, ck1, ck2, _, cu1, cu2 = ring_inputs(lk, 32, 2, 128, torch.bfloat16, seed=31)
    last = (cu_seqlens_from_lengths(lk)[1:].long() - 1).to("cuda")
    dec = (q[last].contiguous(), ck1, ck2, torch.arange(len(lk) + 1, dtype=torch.int32, device="cuda"), cu1, cu2)
    cache = torch.tensor([L - 1 for L in lk], dtype=torch.int32, device="cuda")
    kw = dict(causal=False, cache_lens=cache, topk=64, local_blocks=32)
    p = stage1_plan((9, 0), 16, 128, BF16, BF16, -(-max(lk) // 64), *sel._smem_limits(q.device), "sm90a")
    want = launch_select(*dec, 1, plan=p, **kw)
    for ns in (3, 4):
        assert_same(launch_select(*dec, 1, plan=dataclasses.replace(p, key_stages=ns), **kw), want, f"decode ns={ns}")
    lq, lk = [700, 300], [5000, 2600]
    q, ck1, ck2, _, cu1, cu2 = ring_inputs(lk, 16, 1, 64, torch.float16, seed=32)
    starts = cu_seqlens_from_lengths(lk)[:-1].tolist()
    qc = torch.cat([q[s + k - n:s + k] for s, k, n in zip(starts, lk, lq)])
    cu_q = cu_seqlens_from_lengths(lq, "cuda")
    cache = torch.tensor([k - n for k, n in zip(lk, lq)], dtype=torch.int32, device="cuda")
    p = stage1_plan((9, 0), 16, 64, torch.float16, BF16, -(-max(lk) // 64), *sel._smem_limits(q.device), "sm90a")
    kw = dict(cache_lens=cache, topk=16, local_blocks=8)
    want = launch_select(qc, ck1, ck2, cu_q, cu1, cu2, max(lq), plan=p, **kw)
    for ns in (3, 4):
        got = launch_select(qc, ck1, ck2, cu_q, cu1, cu2, max(lq), plan=dataclasses.replace(p, key_stages=ns), **kw)
        assert_same(got, want, f"chunked ns={ns}")
