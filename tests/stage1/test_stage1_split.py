"""Stage 1 split over key-block ranges with an exact merge: CPU tests of the reference
(infllm_cupy/stage1/split.py) against `naive_stage1_select` under our tie rule, on random and
tie-heavy inputs; the range plan (CPU); GPU tests of the kernels' range passes against their one
launch. Design: docs/stage1.md (9. Long context: key ranges)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from infllm_cupy.compress.naive import naive_compress_k
from infllm_cupy.stage1 import select as sel
from infllm_cupy.stage1.naive import naive_stage1_select, q_block_idx_prefill
from infllm_cupy.stage1.plan import Stage1Plan, range_blocks_for, scratch_bytes, stage1_plan
from infllm_cupy.stage1.select import launch_select, stage1_select
from infllm_cupy.stage1.split import (
    block_ranges,
    finish_candidates,
    merge_candidates,
    range_candidates,
    split_stage1_select,
)
from infllm_cupy.testing import cu_seqlens_from_lengths


def own_topk(block_scores, q_blocks, K):
    """The K largest (ties to the lower index), ascending, blocks after the query block -> -1."""
    order = torch.sort(block_scores.float(), dim=-1, descending=True, stable=True).indices[..., :K]
    idx = order.sort(dim=-1).values
    return idx.masked_fill(idx > q_blocks.long()[None, :, None], -1).to(torch.int32)


def make_inputs(lengths, HQ, H, D, *, seed, ties=False, exact=False, lengths_k=None):
    """Random q and compressed keys; `ties=True` quantises q and k to a few levels (many equal
    scores, equal block scores across ranges)."""
    lengths_k = lengths if lengths_k is None else lengths_k
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lengths), HQ, D, generator=g)
    k = 4 * torch.randn(sum(lengths_k), H, D, generator=g)
    if ties:
        q = torch.randint(-1, 2, q.shape, generator=g).float()
        k = torch.randint(0, 2, k.shape, generator=g).float()
    cu_k = cu_seqlens_from_lengths(lengths_k)
    ck1, cu1 = naive_compress_k(k, cu_k, 32, 16)
    ck2, cu2 = (ck1, cu1) if exact else naive_compress_k(k, cu_k, 128, 64)
    return q, ck1, ck2, cu_seqlens_from_lengths(lengths), cu1, cu2


def check_split(inputs, max_seqlen_q, range_blocks_list, **kw):
    """The split path equals our tie rule on the reference's own block scores, for every range size;
    returns how many rows had ties at their K-th score (so a test can require some)."""
    idx, _, bs = naive_stage1_select(*inputs, max_seqlen_q, return_scores=True, **kw)
    cache = kw.get("cache_lens")
    qb = q_block_idx_prefill(inputs[3], max_seqlen_q,
                             varlen_offset_quirk=kw.get("varlen_offset_quirk", False), cache_lens=cache)
    K = idx.shape[-1]
    want = own_topk(bs, qb, K)
    for rb in range_blocks_list:
        got = split_stage1_select(*inputs, max_seqlen_q, range_blocks=rb, **kw)
        assert got.dtype == torch.int32 and got.shape == want.shape
        n_bad = int((got != want).any(-1).sum())
        assert n_bad == 0, f"range_blocks={rb}: {n_bad} rows differ from the single-range top-K"
    if K == 0:
        return 0
    kth = torch.sort(bs.float(), dim=-1, descending=True).values[..., K - 1:K]
    return int(((bs.float() == kth).sum(-1) > 1).sum())


LENGTHS = [2000, 1023, 383, 1, 64, 200]    # both quirks (1023: L % 16 == 15 and L % 64 == 63; 383)


@pytest.mark.parametrize("score_dtype", [torch.bfloat16, torch.float16, None], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("topk,local_blocks,init_blocks", [(8, 4, 1), (64, 32, 1), (3, 0, 2)])
def test_split_equals_single_range_random(score_dtype, topk, local_blocks, init_blocks):
    inputs = make_inputs(LENGTHS, 8, 2, 32, seed=1)
    check_split(inputs, max(LENGTHS), [16, 48], score_dtype=score_dtype, topk=topk, local_blocks=local_blocks,
                init_blocks=init_blocks)


@pytest.mark.parametrize("seed", [2, 3])
def test_split_equals_single_range_tie_heavy(seed):
    """Quantised q and k: many block scores tie across range boundaries, where the merge must keep
    the lower index."""
    inputs = make_inputs([2500, 700], 4, 2, 16, seed=seed, ties=True)
    n_tied = check_split(inputs, 2500, [16, 32], topk=8, local_blocks=2)
    assert n_tied > 100, f"the inputs were meant to be tie-heavy ({n_tied} rows with a tie at the K-th score)"


def test_split_all_scores_equal():
    """q = 0: every fine score of a row is the same, so the selection is decided by the tie rule alone."""
    q, ck1, ck2, cu, cu1, cu2 = make_inputs([2100], 4, 1, 16, seed=4)
    check_split((torch.zeros_like(q), ck1, ck2, cu, cu1, cu2), 2100, [16, 48], topk=5, local_blocks=1)


def test_split_exact_mode_quirk_chunked_and_decode():
    # exact mode (ck2 = ck1: the coarse pass on the fine keys)
    check_split(make_inputs([1500, 333], 6, 2, 32, seed=5, exact=True), 1500, [16], topk=6, local_blocks=3)
    # ragged batch with HF's offset quirk
    check_split(make_inputs([1500, 333], 4, 2, 32, seed=6), 1500, [32], topk=6, local_blocks=3,
                varlen_offset_quirk=True)
    # chunked prefill: queries after cached keys
    lq, lk = [300, 200], [2300, 1200]
    check_split(make_inputs(lq, 4, 2, 32, seed=7, lengths_k=lk), 300, [16, 32], topk=6, local_blocks=3,
                cache_lens=[2000, 1000])
    # decode: one query per sequence, every key visible
    lk = [2500, 63, 1300]
    q, ck1, ck2, _, cu1, cu2 = make_inputs(lk, 4, 2, 32, seed=8)
    inputs = (q[:3].contiguous(), ck1, ck2, cu_seqlens_from_lengths([1, 1, 1]), cu1, cu2)
    check_split(inputs, 1, [16], topk=6, local_blocks=3, causal=False, cache_lens=[L - 1 for L in lk])


def test_merge_ties_go_to_the_lower_index():
    s = torch.tensor([[[5.0, 3.0, 3.0]]])
    a = (s, torch.tensor([[[7, 2, 9]]]))
    b = (torch.tensor([[[3.0, 3.0, 1.0]]]), torch.tensor([[[0, 12, 4]]]))
    ms, mi = merge_candidates(a, b, 4)
    assert mi.tolist() == [[[7, 0, 2, 9]]] and ms.tolist() == [[[5.0, 3.0, 3.0, 3.0]]]
    # a range's candidates: best first, ties to the lower index, global indices
    cs, ci = range_candidates(torch.tensor([[[1.0, float("inf"), 1.0, 2.0, 1.0]]]), 32, 3)
    assert ci.tolist() == [[[33, 35, 32]]] and cs.tolist() == [[[float("inf"), 2.0, 1.0]]]
    assert finish_candidates(torch.tensor([[[40, 3, 17]]]), torch.tensor([20])).tolist() == [[[3, 17, -1]]]


def test_block_ranges():
    assert block_ranges(100, 32) == [(0, 32), (32, 64), (64, 96), (96, 100)]
    assert block_ranges(0, 16) == []
    with pytest.raises(ValueError, match="range_blocks must be a multiple of 16"):
        block_ranges(100, 24)
    with pytest.raises(ValueError, match="range_blocks"):
        block_ranges(100, 0)
    with pytest.raises(TypeError, match="range_blocks"):
        block_ranges(100, 16.0)


def test_split_rejects_bad_arguments():
    inputs = make_inputs([300], 4, 2, 32, seed=9)
    with pytest.raises(ValueError, match="range_blocks must be a multiple of 16"):
        split_stage1_select(*inputs, 300, range_blocks=20)
    with pytest.raises(ValueError, match="block_size must be 4 \\* kernel_stride"):
        split_stage1_select(*inputs, 300, range_blocks=16, block_size=128)
    with pytest.raises(ValueError, match="max_seqlen_q"):
        split_stage1_select(*inputs, 200, range_blocks=16)
    with pytest.raises(TypeError, match="causal"):
        split_stage1_select(*inputs, 300, range_blocks=16, causal=1)


# ================================================================================================
# the kernels' range passes (GPU) and their plan (CPU)
# ================================================================================================

H100 = (227 * 1024, 228 * 1024)   # (opt-in per-block, per-SM) dynamic shared memory


def test_range_plan_on_h100_shapes():
    bf16 = torch.bfloat16
    # README head config (G = 16, D = 128): 128k tokens (2048 blocks) fit two CTAs per SM: one launch;
    # 512k tokens (8192 blocks) fit one CTA's rows, but ranges of 2816 blocks at two CTAs per SM were
    # faster (docs/stage1.md §9), with the rows in shared memory kept for inspection calls
    assert stage1_plan((9, 0), 16, 128, bf16, bf16, 2048, *H100) == Stage1Plan("sm90a", 8, True, 0, 0)
    assert stage1_plan((9, 0), 16, 128, bf16, bf16, 8192, *H100) == Stage1Plan("sm90a", 8, True, 0, 2816)
    # past shared memory: the global scratch while it fits the budget, ranges beyond it
    p256 = dict(rows=2 * 2**18, scratch_budget=10 * 2**30)      # [2, 256k, 4096] int16: 4 GiB
    assert stage1_plan((9, 0), 1, 128, bf16, bf16, 4096, *H100, **p256) == Stage1Plan("sm90a", 8, False, 0, 0)
    assert stage1_plan((9, 0), 1, 128, bf16, bf16, 4096, *H100, rows=2 * 2**18, scratch_budget=2**32 - 1) \
        == stage1_plan((9, 0), 1, 128, bf16, bf16, 4096, *H100)
    assert stage1_plan((8, 0), 1, 128, bf16, bf16, 4096, *H100, **p256) == Stage1Plan("sm80", 4, False, 0, 0)
    # 1M tokens do not: ranges of 2816 blocks, two CTAs per SM
    p = stage1_plan((9, 0), 16, 128, bf16, bf16, 16384, *H100)
    assert p == Stage1Plan("sm90a", 8, False, 0, 2816)
    assert p.smem_bytes(16, 128, 2, 16384, 2) <= 228 * 1024 // 2 - 1024
    # SM80: the fewest tokens per CTA, the widest ranges
    # (two CTAs per SM hold 1088 blocks, under RANGE_MIN_TWO_PER_SM: one CTA per SM, wider ranges)
    assert stage1_plan((8, 0), 1, 128, bf16, bf16, 8192, *H100) == Stage1Plan("sm80", 1, False, 0, 2880)
    # a range is the widest multiple of 64 that fits; none fits -> 0
    rb = range_blocks_for("sm90a", 8, 1, 128, 2, 4, *H100)
    assert rb == 192 and Stage1Plan("sm90a", 8, False, 0, rb).smem_bytes(1, 128, 2, 10**6, 4) <= H100[0]
    assert Stage1Plan("sm90a", 8, False, 0, rb + 64).smem_bytes(1, 128, 2, 10**6, 4) > H100[0]
    assert range_blocks_for("sm90a", 8, 1, 128, 2, 4, 64 * 1024, 64 * 1024) == 0
    # memory: the scratch [H, total_q, olp] against the candidates O(total_q x K)
    assert scratch_bytes(Stage1Plan("sm90a", 8, False), 2, 2**20, 16384, 2) == 2 * 2**20 * 16384 * 2
    assert scratch_bytes(p, 2, 2**20, 16384, 2, K=96, HQ=32) == 2 * 2**20 * 96 * 16 + 2**20 * 32 * 4
    assert scratch_bytes(Stage1Plan("sm90a", 8, True), 2, 2**20, 8192, 2) == 0
    for bad in (-64, 32, 1.0, True):
        with pytest.raises(ValueError, match="range_blocks"):
            Stage1Plan("sm90a", 8, False, 0, bad)


def gpu_inputs(lengths, HQ, H, D, *, seed, ties=False, exact=False, lengths_k=None, dtype=torch.bfloat16):
    q, ck1, ck2, cu, cu1, cu2 = make_inputs(lengths, HQ, H, D, seed=seed, ties=ties, exact=exact,
                                            lengths_k=lengths_k)
    return tuple(t.to("cuda") for t in (q.to(dtype), ck1.to(dtype), ck2.to(dtype), cu, cu1, cu2))


def default_plan(inputs, max_seqlen_q, kernel="auto", score_dtype=torch.bfloat16, cache=0):
    q, ck1 = inputs[0], inputs[1]
    sdt = torch.float32 if score_dtype is None else score_dtype
    return stage1_plan(torch.cuda.get_device_capability(q.device), q.shape[1] // ck1.shape[1], q.shape[2],
                       q.dtype, sdt, -(-(max_seqlen_q + cache) // 64), *sel._smem_limits(q.device), kernel)


def check_ranges(inputs, max_seqlen_q, range_blocks, kernel, *, score_dtype=torch.bfloat16, cache=0, **kw):
    """Range passes (`range_blocks`) against the one-launch selection of the same kernel: identical."""
    one = stage1_select(*inputs, max_seqlen_q, backend="kernels", kernel=kernel, score_dtype=score_dtype,
                        **kw)
    base = dataclasses.replace(default_plan(inputs, max_seqlen_q, kernel, score_dtype, cache), range_blocks=0,
                               block_keys_in_smem=True)
    plan = dataclasses.replace(base, range_blocks=range_blocks)
    got = launch_select(*inputs, max_seqlen_q, plan=plan, score_dtype=score_dtype, **kw)
    assert got.shape == one.shape and not bool((got == -(2**30)).any())
    n_bad = int((got != one).any(-1).sum())
    assert n_bad == 0, f"{n_bad} rows of the range passes differ from the one launch"
    return got


def pytest_generate_tests(metafunc):
    if metafunc.definition.get_closest_marker("gpu") is not None and "kernel" in metafunc.fixturenames:
        metafunc.parametrize("kernel", ["auto", "sm80"])


RANGE_CASES = [     # (lengths, HQ, H, D): both quirks, G in {1, 4, 16, 24, 64}
    ([11500, 1023, 383, 1, 64, 200], 32, 2, 128),
    ([9000, 5000], 2, 2, 64),
    ([7000, 335], 8, 2, 128),
    ([6000], 24, 1, 128),
    ([5000, 700], 64, 1, 64),
]


@pytest.mark.gpu
@pytest.mark.parametrize("score_dtype", [torch.bfloat16, None], ids=["bf16", "fp32"])
@pytest.mark.parametrize("case", RANGE_CASES, ids=lambda c: f"L{c[0][0]}_HQ{c[1]}_H{c[2]}_D{c[3]}")
def test_range_passes_equal_one_launch(case, score_dtype, kernel):
    lengths, HQ, H, D = case
    inputs = gpu_inputs(lengths, HQ, H, D, seed=11)
    L = max(lengths)
    for rb, topk, lb in ((64, 8, 4), (128, 64, 32)):
        check_ranges(inputs, L, rb, kernel, score_dtype=score_dtype, topk=topk, local_blocks=lb)


@pytest.mark.gpu
def test_range_passes_tie_heavy_quirk_chunked_decode_exact(kernel):
    L = 8000
    check_ranges(gpu_inputs([L, 900], 16, 2, 64, seed=12, ties=True), L, 64, kernel, topk=8, local_blocks=2)
    check_ranges(gpu_inputs([L, 900], 16, 2, 64, seed=13), L, 64, kernel, topk=8, local_blocks=2,
                 varlen_offset_quirk=True, init_blocks=3)
    check_ranges(gpu_inputs([3000, 1500], 16, 2, 64, seed=14, exact=True), 3000, 64, kernel, topk=8,
                 local_blocks=2)
    lq, lk = [700, 300], [9000, 5000]
    inputs = gpu_inputs(lq, 16, 2, 64, seed=15, lengths_k=lk)
    cache = torch.tensor([8300, 4700], dtype=torch.int32, device="cuda")
    check_ranges(inputs, 700, 64, kernel, cache=8300, topk=8, local_blocks=2, cache_lens=cache)
    lk = [9000, 63, 5000]
    q, ck1, ck2, _, cu1, cu2 = gpu_inputs(lk, 16, 2, 64, seed=16)
    idx = torch.tensor([8999, 9062, 14062], device="cuda")
    dec = (q[idx].contiguous(), ck1, ck2, torch.arange(4, dtype=torch.int32, device="cuda"), cu1, cu2)
    cache = torch.tensor([L - 1 for L in lk], dtype=torch.int32, device="cuda")
    check_ranges(dec, 1, 64, kernel, cache=8999, topk=8, local_blocks=2, causal=False, cache_lens=cache)


@pytest.mark.gpu
def test_planned_ranges_match_the_scratch_and_use_less_memory(kernel):
    """G = 1 with fp32 scores past ~15k tokens: the plan splits into ranges (sm_90a) where it used
    the global scratch; the selection is the scratch launch's, and the extra memory is far below
    the scratch's [H, total_q, olp] (410 MB here; the ranges' candidates and merge about 60 MB)."""
    L = 80000
    inputs = gpu_inputs([L], 1, 1, 64, seed=17)
    plan = default_plan(inputs, L, kernel, None)
    if plan.range_blocks == 0:
        plan = dataclasses.replace(plan, block_keys_in_smem=False, range_blocks=range_blocks_for(
            plan.kernel, plan.warps, 1, 64, 2, 4, *sel._smem_limits(inputs[0].device)))
    assert plan.range_blocks >= 64
    kw = {"topk": 8, "local_blocks": 4, "score_dtype": None}
    scratch = launch_select(*inputs, L,
                            plan=dataclasses.replace(plan, range_blocks=0, block_keys_in_smem=False), **kw)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    got = launch_select(*inputs, L, plan=plan, **kw)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert torch.equal(got, scratch)
    scratch_size = L * (-(-L // 4096) * 64) * 4          # [H = 1, total_q, olp] fp32 keys
    assert extra < scratch_size / 4, (extra, scratch_size)
    # inspection outputs are not written by range passes: the launcher falls back to one launch
    idx, _sc, bs = launch_select(*inputs, L, plan=plan, return_scores=True, **kw)
    assert torch.equal(idx, scratch) and not torch.isnan(bs).any()


def test_bench_stage1_ranges_script_starts():
    """The range benchmark starts: without a GPU it says so; with one, it rejects a bad range width."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_stage1_ranges.py"
    bad = subprocess.run([sys.executable, str(script), "--ranges", "100"], capture_output=True, text=True,
                         timeout=120)
    if not torch.cuda.is_available():
        assert bad.returncode == 0 and "needs a CUDA GPU" in bad.stdout
    else:
        assert bad.returncode == 2 and "multiples of 64" in bad.stderr
