"""predict_sparge (vectorised) against naive_predict_sparge (loops) on CPU, the SpargeAttn rules one
by one on hand-built inputs, and a GPU check of the vectorised path on CUDA."""
import pytest
import torch

from infllm_cupy.patterns import naive_predict_sparge, per_kv_head, predict_sparge
from infllm_cupy.testing import cu_seqlens_from_lengths


def clustered(T, H, D, seed, noise=1.0):
    """Tokens near a few directions per 64-token stretch, so blocks are self-similar and pooled
    scores are informative (random Gaussian tokens are neither)."""
    g = torch.Generator().manual_seed(seed)
    centres = 3 * torch.randn(-(-T // 32), H, D, generator=g, dtype=torch.float64)
    x = centres.repeat_interleave(32, 0)[:T] + noise * torch.randn(T, H, D, generator=g, dtype=torch.float64)
    return x


CASES = [  # lengths, HQ, H, block_q, simthreshd1, cdfthreshd, sink, causal
    ([700], 4, 2, 128, 0.3, 0.9, 0, False),
    ([700], 4, 2, 128, 0.3, 0.9, 0, True),
    ([300, 1, 0, 517], 2, 1, 64, 0.5, 0.7, 1, True),
    ([1000, 250], 6, 2, 128, 0.6, 0.5, 2, False),
    ([640], 2, 2, 64, 0.2, 0.99, 0, True),
    ([800, 333], 4, 1, 64, 0.2, 0.8, 0, False),
]


@pytest.mark.parametrize("lens,HQ,H,bq,s1,cdf,sink,causal", CASES)
@pytest.mark.parametrize("per_query_head", [False, True])
def test_vectorised_matches_naive(lens, HQ, H, bq, s1, cdf, sink, causal, per_query_head):
    T = sum(lens)
    q, k = clustered(T, HQ, 64, seed=T), clustered(T, H, 64, seed=T + 1)
    cu = cu_seqlens_from_lengths(lens)
    kw = dict(block_q=bq, simthreshd1=s1, cdfthreshd=cdf, sink_blocks=sink, causal=causal,
              per_query_head=per_query_head)
    ours, ref = predict_sparge(q, k, cu, **kw), naive_predict_sparge(q, k, cu, **kw)
    assert ours.q_block == ref.q_block == bq
    assert ours.mask.shape == (len(lens), HQ if per_query_head else H, -(-max(lens) // bq),
                               -(-max(lens) // 64))
    assert torch.equal(ours.mask, ref.mask)
    density = ours.mask.float().mean().item()
    assert 0.0 < density < 1.0, density            # the thresholds really select something and drop something


def test_union_over_the_group_is_the_kv_head_layout():
    q, k = clustered(900, 6, 64, seed=3), clustered(900, 2, 64, seed=4)
    per_q = predict_sparge(q, k, simthreshd1=0.3, cdfthreshd=0.6, per_query_head=True)
    per_kv = predict_sparge(q, k, simthreshd1=0.3, cdfthreshd=0.6)
    assert per_q.mask.shape[0] == 6 and per_kv.mask.shape[0] == 2
    assert torch.equal(per_kv.mask, per_q.mask.view(2, 3, *per_q.mask.shape[1:]).any(1))
    if per_kv_head(per_q, 3) is not None:                # only when the group agrees
        assert torch.equal(per_kv_head(per_q, 3).mask, per_kv.mask)


def test_rules_on_hand_built_blocks():
    D = 64
    # 4 key blocks of 64 identical tokens (self-similar), each a different direction; one query block
    # of 128 identical tokens pointing at key block 2 strongly, block 0 weakly
    dirs = torch.eye(D, dtype=torch.float64)[:4] * 8
    k = dirs.repeat_interleave(64, 0)[:, None]                            # [256, 1, D]
    q = torch.zeros(256, 1, D, dtype=torch.float64)
    q[:128, 0] = 2 * dirs[2] + 0.1 * dirs[0]
    q[128:, 0] = dirs[1]
    lay = predict_sparge(q, k, block_q=128, simthreshd1=0.5, cdfthreshd=0.5)
    assert lay.mask[0, 0].tolist() == [False, False, True, False]       # the top block alone covers > 50%
    assert lay.mask[0, 1].tolist() == [False, True, False, False]
    # at least one block even when the top block alone exceeds cdfthreshd
    assert predict_sparge(q, k, simthreshd1=0.5, cdfthreshd=0.0).mask[0].sum(-1).tolist() == [1, 1]
    # a key block that is not self-similar is kept by every query block
    k2 = k.clone()
    k2[64:128, 0] = torch.randn(64, D, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    lay2 = predict_sparge(q, k2, simthreshd1=0.5, cdfthreshd=0.5)
    assert lay2.mask[0, :, 1].all()
    # a query block that is not self-similar keeps every key block (within causality)
    q2 = q.clone()
    q2[128:, 0] = torch.randn(128, D, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    lay3 = predict_sparge(q2, k, simthreshd1=0.5, cdfthreshd=0.5)
    assert lay3.mask[0, 1].all()
    lay4 = predict_sparge(q2, k, simthreshd1=0.5, cdfthreshd=0.5, causal=True)
    assert lay4.mask[0, 0].tolist() == [False, False, False, False] or lay4.mask[0, 0, :2].any()
    assert lay4.mask[0, 1].all() and not lay4.mask[0, 0, 2:].any()      # block-causal: 64 j < 128 (i+1)
    # sinks
    assert predict_sparge(q, k, simthreshd1=0.5, cdfthreshd=0.5, sink_blocks=2).mask[0, :, :2].all()


def test_rejects_bad_arguments():
    q, k = torch.randn(100, 4, 64), torch.randn(100, 2, 64)
    with pytest.raises(ValueError, match="block_q must be 64 or 128"):
        predict_sparge(q, k, block_q=256)
    with pytest.raises(ValueError, match="block_k must be 64"):
        predict_sparge(q, k, block_k=128)
    with pytest.raises(TypeError, match="causal must be a bool"):
        predict_sparge(q, k, causal=1)
    with pytest.raises(ValueError, match="cu_seqlens ends at 90"):
        predict_sparge(q, k, cu_seqlens_from_lengths([90]))
    with pytest.raises(ValueError, match="cdfthreshd must be a float or a tensor of 1 or 4 values"):
        predict_sparge(q, k, cdfthreshd=torch.ones(3))
    with pytest.raises(ValueError, match="multiple of the key/value head count"):
        predict_sparge(torch.randn(100, 3, 64), k)


def test_per_head_thresholds():
    q, k = clustered(512, 2, 64, seed=7), clustered(512, 2, 64, seed=8)
    per = predict_sparge(q, k, cdfthreshd=torch.tensor([0.3, 0.95]), simthreshd1=0.2, per_query_head=True)
    a = predict_sparge(q, k, cdfthreshd=0.3, simthreshd1=0.2, per_query_head=True)
    b = predict_sparge(q, k, cdfthreshd=0.95, simthreshd1=0.2, per_query_head=True)
    assert torch.equal(per.mask[0], a.mask[0]) and torch.equal(per.mask[1], b.mask[1])
    assert torch.equal(per.mask,
                       naive_predict_sparge(q, k, cdfthreshd=torch.tensor([0.3, 0.95]), simthreshd1=0.2,
                                                      per_query_head=True).mask)


@pytest.mark.gpu
def test_vectorised_on_cuda_matches_naive():
    lens = [3000, 777]
    T = sum(lens)
    q, k = clustered(T, 8, 128, seed=11), clustered(T, 2, 128, seed=12)
    cu = cu_seqlens_from_lengths(lens)
    kw = dict(block_q=128, simthreshd1=0.3, cdfthreshd=0.8, sink_blocks=1, causal=True)
    ours = predict_sparge(q.cuda(), k.cuda(), cu.cuda(), **kw)
    ref = naive_predict_sparge(q, k, cu, **kw)
    assert ours.mask.is_cuda
    assert torch.equal(ours.mask.cpu(), ref.mask)
