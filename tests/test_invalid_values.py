"""Values that no call can mean are refused before anything runs or changes: each case raises a clear
error that names the argument and the rule it breaks, and leaves the state it was handed (a cache,
H2O's scores) bit-identical. One table of cases, CPU only (the checks run before any launch)."""
from __future__ import annotations

import pytest
import torch

from infllm_cupy import (
    BlockLayout,
    DecodeCache,
    InfLLMv2Config,
    block_sparse_attn_varlen,
    compress_k,
    infllmv2_attention,
    infllmv2_decode,
    sparse_attn_varlen,
    sparse_decode,
    stage1_select,
)
from infllm_cupy.compat import infllm_v2
from infllm_cupy.decode import H2O
from infllm_cupy.patterns import predict_sparge

CU = torch.tensor([0, 256], dtype=torch.int32)


def _g(seed=0):
    return torch.Generator().manual_seed(seed)


def _qkv(T=256, HQ=4, H=2, D=64):
    g = _g()
    return tuple(torch.randn(T, n, D, generator=g) for n in (HQ, H, H))


def _stage1_inputs():
    q, k, _ = _qkv()
    ck1, cu1 = compress_k(k, CU, 32, 16)
    ck2, cu2 = compress_k(k, CU, 128, 64)
    return q, ck1, ck2, CU, cu1, cu2, 256


def _decode_cache():
    cache = DecodeCache.contiguous(2, 128, 2, 64, dtype=torch.float32)
    k = torch.randn(100, 2, 64, generator=_g(1))
    cache.append(k, k.clone(), [0, 60, 100])
    return cache


def _cache_state(cache):
    return [t.clone() for t in (cache.k, cache.v, cache.ck1, cache.ck2, cache.seqlens)] + [cache.lengths()]


def _same(a, b):
    return all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(a, b))


# (id, call, exception, message fragments): each fragment must appear in the message
CASES = [
    ("config_kernel_size_below_stride", lambda: InfLLMv2Config(kernel_size=8, kernel_stride=16),
     ValueError, ["kernel_size (8) must be >= kernel_stride (16)"]),
    ("config_coarse_size_below_stride",
     lambda: InfLLMv2Config(coarse_kernel_size=32, coarse_kernel_stride=64),
     ValueError, ["coarse_kernel_size (32) must be >= coarse_kernel_stride (64)"]),
    ("config_coarse_stride_off_the_blocks", lambda: InfLLMv2Config(coarse_kernel_stride=48),
     ValueError, ["coarse_kernel_stride (48) must divide block_size (64) or be a multiple of it"]),
    ("config_softmax_scale_nan", lambda: InfLLMv2Config(softmax_scale=float("nan")),
     ValueError, ["softmax_scale must be a positive finite float"]),
    ("config_score_dtype_int", lambda: InfLLMv2Config(score_dtype=torch.int32),
     ValueError, ["score_dtype must be None or one of", "int32"]),
    ("compress_kernel_size_below_stride", lambda: compress_k(_qkv()[1], CU, 8, 16),
     ValueError, ["kernel_size (8) must be >= kernel_stride (16)"]),
    ("layout_fewer_key_columns_than_key_blocks",
     lambda: block_sparse_attn_varlen(*_qkv(), CU, CU, BlockLayout(torch.ones(2, 4, 2, dtype=torch.bool)),
                                      256, 256),
     ValueError, ["layout has 2 key-block columns", "max_seqlen_k=256 needs 4"]),
    ("sparge_cdfthreshd_above_one", lambda: predict_sparge(*_qkv()[:2], cdfthreshd=2.0),
     ValueError, ["cdfthreshd must be in [0, 1]", "2.0"]),
    ("sparge_simthreshd1_nan", lambda: predict_sparge(*_qkv()[:2], simthreshd1=float("nan")),
     ValueError, ["simthreshd1 must be in [-1, 1]", "nan"]),
    ("sparge_per_head_threshold_out_of_range",
     lambda: predict_sparge(*_qkv()[:2], cdfthreshd=torch.tensor([0.5, 0.9, -0.1, 0.5])),
     ValueError, ["cdfthreshd must be in [0, 1]"]),
    ("head_dim_zero_stage2",
     lambda: sparse_attn_varlen(torch.randn(64, 4, 0), torch.randn(64, 2, 0), torch.randn(64, 2, 0),
                                CU.new_tensor([0, 64]), CU.new_tensor([0, 64]),
                                torch.zeros(2, 64, 1, dtype=torch.int32), 64, 64),
     ValueError, ["q has head dim 0", "at least 1"]),
    ("head_dim_zero_pipeline",
     lambda: infllmv2_attention(torch.randn(64, 4, 0), torch.randn(64, 2, 0), torch.randn(64, 2, 0),
                                CU.new_tensor([0, 64])),
     ValueError, ["q has head dim 0"]),
    ("head_dim_zero_decode",
     lambda: sparse_decode(torch.randn(1, 4, 0), (torch.randn(1, 8, 2, 0), torch.randn(1, 8, 2, 0),
                                                  torch.tensor([5], dtype=torch.int32))),
     ValueError, ["q has head dim 0"]),
    ("stage1_score_dtype_int", lambda: stage1_select(*_stage1_inputs(), score_dtype=torch.int32),
     ValueError, ["score_dtype must be None or one of", "int32"]),
    ("compat_topk_to_uint64_block_size_zero",
     lambda: infllm_v2.topk_to_uint64(torch.zeros(2, 4, 3, dtype=torch.int32), 128, 0),
     ValueError, ["block_size must be >= 1, got 0"]),
    ("compat_topk_to_uint64_negative_length",
     lambda: infllm_v2.topk_to_uint64(torch.zeros(2, 4, 3, dtype=torch.int32), -1, 64),
     ValueError, ["max_seqlen_k must be >= 0, got -1"]),
]


@pytest.mark.parametrize("call, exc, fragments", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_invalid_value_is_refused_naming_the_argument(call, exc, fragments):
    with pytest.raises(exc) as e:
        call()
    for f in fragments:
        assert f in str(e.value), (f, str(e.value))


# ---------------------------------------------------------------------- cases with state to keep


def test_h2o_update_refuses_non_finite_or_negative_weights_and_keeps_its_scores():
    h2o = H2O(1, 2, 16, budget=4, recent=1)
    h2o.update(torch.rand(1, 2, 16, generator=_g()))
    before = h2o.scores.clone()
    for bad in (float("nan"), float("inf"), -0.5):
        w = torch.rand(1, 2, 16, generator=_g(2))
        w[0, 1, 3] = bad
        with pytest.raises(ValueError, match="weights must be finite and >= 0"):
            h2o.update(w)
        assert torch.equal(h2o.scores, before), bad
    with pytest.raises(TypeError, match="weights must be a float tensor"):
        h2o.update(torch.ones(1, 2, 16, dtype=torch.int64))
    assert torch.equal(h2o.scores, before)


@pytest.mark.parametrize("seqlens, exc, match", [
    ([3, 4, 5], ValueError, r"seqlens must have one length per sequence \(2\), got 3"),
    (torch.tensor([3]), ValueError, r"seqlens must have one length per sequence \(2\), got 1"),
    (["a", 3], TypeError, "seqlens must be ints"),
    ([3, 17], ValueError, r"seqlens must be in \[0, 16\]"),
    (torch.tensor([3.0, 4.0]), TypeError, "seqlens must hold integers"),
])
def test_h2o_kept_and_evict_refuse_bad_lengths(seqlens, exc, match):
    h2o = H2O(2, 2, 16, budget=4, recent=1)
    h2o.update(torch.rand(2, 2, 16, generator=_g()))
    before = h2o.scores.clone()
    with pytest.raises(exc, match=match):
        h2o.kept(seqlens)
    kv = torch.randn(2, 16, 2, 8, generator=_g(3))
    with pytest.raises(exc, match=match):
        h2o.evict(kv, kv.clone(), seqlens)
    assert torch.equal(h2o.scores, before)


@pytest.mark.parametrize("seqlens, exc, match", [
    (["a", "b"], TypeError, "seqlens must be ints"),
    ([1.5, 2], TypeError, "seqlens must be ints"),
    ([True, 2], TypeError, "seqlens must be ints"),
    ([10], ValueError, "seqlens must have 2 entries"),
    ([-1, 10], ValueError, r"each in \[0, its current length"),
    ([10, 41], ValueError, r"each in \[0, its current length \[60, 40\]\]"),
])
def test_decode_cache_reset_refuses_bad_lengths_and_keeps_the_cache(seqlens, exc, match):
    cache = _decode_cache()
    before = _cache_state(cache)
    with pytest.raises(exc, match=match):
        cache.reset(seqlens)
    assert _same(_cache_state(cache), before)
    cache.reset([10, 40])                                 # the valid call still works
    assert cache.lengths() == [10, 40]


@pytest.mark.parametrize("cache_seqlens", [[-3, 10], [10, 129]], ids=["negative", "past_the_cache"])
@pytest.mark.parametrize("new_kv", [False, True], ids=["attend", "append"])
def test_compat_kvcache_refuses_lengths_outside_the_cache(cache_seqlens, new_kv):
    g = _g(4)
    kc, vc = torch.randn(2, 128, 2, 64, generator=g), torch.randn(2, 128, 2, 64, generator=g)
    kc0, vc0 = kc.clone(), vc.clone()
    q = torch.randn(2, 1, 4, 64, generator=g)
    kv = {n: torch.randn(2, 1, 2, 64, generator=g) for n in ("k", "v")} if new_kv else {}
    with pytest.raises(ValueError, match="cache_seqlens"):
        infllm_v2.infllmv2_attn_with_kvcache(q, kc, vc, cache_seqlens=torch.tensor(cache_seqlens,
                                                                                    dtype=torch.int32), **kv)
    assert torch.equal(kc, kc0) and torch.equal(vc, vc0)
    with pytest.raises(ValueError, match=r"cache_seqlens must be in \[0, 128\]"):
        infllm_v2.infllmv2_attn_with_kvcache(q, kc, vc, cache_seqlens=cache_seqlens[0] if cache_seqlens[0] < 0
                                             else cache_seqlens[1])


def test_decode_with_head_dim_zero_is_refused_before_the_cache_changes():
    with pytest.raises(ValueError, match="head_dim"):
        DecodeCache.contiguous(1, 128, 2, 0, dtype=torch.float32)
    cache = _decode_cache()
    before = _cache_state(cache)
    with pytest.raises(ValueError, match="q has head dim 0 but the cache has 64"):
        infllmv2_decode(torch.randn(2, 4, 0), cache)
    assert _same(_cache_state(cache), before)
