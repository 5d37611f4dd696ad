"""Stage 1 split over key-block ranges with an exact merge (infllm_cupy/stage1/split.py): CPU tests
of the reference against `naive_stage1_select` under our tie rule, on random and tie-heavy inputs.
Design: docs/stage1.md (9. Long context: key ranges)."""
from __future__ import annotations

import pytest
import torch

from infllm_cupy.compress.naive import naive_compress_k
from infllm_cupy.stage1.naive import naive_stage1_select, q_block_idx_prefill
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
    qb = q_block_idx_prefill(inputs[3], max_seqlen_q, varlen_offset_quirk=kw.get("varlen_offset_quirk", False),
                             cache_lens=cache)
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


LENGTHS = [3000, 1023, 383, 1, 64, 200]    # both quirks (1023: L % 16 == 15 and L % 64 == 63; 383)


@pytest.mark.parametrize("score_dtype", [torch.bfloat16, torch.float16, None], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("topk,local_blocks,init_blocks", [(8, 4, 1), (64, 32, 1), (3, 0, 2)])
def test_split_equals_single_range_random(score_dtype, topk, local_blocks, init_blocks):
    inputs = make_inputs(LENGTHS, 8, 2, 32, seed=1)
    check_split(inputs, max(LENGTHS), [16, 32, 48], score_dtype=score_dtype, topk=topk, local_blocks=local_blocks,
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
