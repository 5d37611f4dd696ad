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
    patterns,
    sparse_attn_varlen,
    sparse_decode,
    stage1_select,
)
from infllm_cupy.compat import infllm_v2
from infllm_cupy.decode import (
    H2O,
    decode_select,
    infllmv2_prefill_into_cache,
    naive_sparse_decode,
    plan_decode,
)
from infllm_cupy.integrations.transformers import config_from_sparse_config
from infllm_cupy.patterns import predict_sparge
from infllm_cupy.stage1 import stage1_scores

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



def _layout(heads=2, nqb=4):
    return BlockLayout(torch.ones(heads, nqb, nqb, dtype=torch.bool).tril())


def _idx(T=256):
    return torch.zeros(2, T, 2, dtype=torch.int32)


def _compat_stage1(**kw):
    """`infllm_v2.infllmv2_attn_stage1` on 256 queries and one sequence's compressed keys (15 fine, 3 coarse),
    with `kw` replacing arguments."""
    q, k, _ = _qkv()
    ck1, cu1 = compress_k(k, CU, 32, 16)
    ck2, cu2 = compress_k(k, CU, 128, 64)
    args = dict(q=q, k=ck1, v=ck2, cu_seqlens_q=CU, cu_seqlens_k=cu1, cu_seqlens_v=cu2, max_seqlen_q=256,
                max_seqlen_k=15, causal=True)
    args.update(kw)
    return infllm_v2.infllmv2_attn_stage1(**args)


def _pool(**kw):
    args = dict(input=torch.rand(2, 64, 15), cache_len=0, local_blocks=1, init_blocks=1)
    args.update(kw)
    return infllm_v2.max_pooling_1d(**args)


def _pool_varlen(**kw):
    args = dict(input=torch.rand(2, 64, 15), cu_seqlens_q=CU.new_tensor([0, 64]),
                cu_seqlens_k=CU.new_tensor([0, 15]), cache_lens=CU.new_tensor([0]), max_seqlen_q=64,
                max_seqlen_k=15, local_blocks=1, init_blocks=1)
    args.update(kw)
    return infllm_v2.max_pooling_1d_varlen(**args)


def _empty_cache():
    return DecodeCache.contiguous(2, 128, 2, 64, dtype=torch.float32)


_CFG = InfLLMv2Config(topk=4, local_blocks=1, dense_len=0)
_TUPLE_CACHE = (torch.zeros(1, 128, 2, 64), torch.zeros(1, 128, 2, 64))

# Issue 57's cases, then the others found probing the public API the same way. Silent acceptances first
# (a call that ran and returned something no caller can mean), then unclear errors (Python's or torch's
# own messages, or an argument named by another function's name for it).
CASES += [
    # ---- silent acceptances
    ("decode_select_on_an_empty_cache",
     lambda: decode_select(torch.randn(2, 4, 64), _empty_cache(), config=_CFG),
     ValueError, ["cache: every sequence must hold at least the current token", "[0, 0]"]),
    ("sparse_decode_int64_indices_on_cpu",
     lambda: sparse_decode(torch.randn(2, 4, 64), _decode_cache(), torch.zeros(2, 2, 3, dtype=torch.int64)),
     TypeError, ["topk_idx must have dtype int32, got int64"]),
    ("sparse_decode_int64_lengths_on_cpu",
     lambda: sparse_decode(torch.randn(1, 4, 64), (*_TUPLE_CACHE, torch.tensor([5]))),
     TypeError, ["seqlens must have dtype int32, got int64"]),
    ("naive_sparse_decode_int64_indices",
     lambda: naive_sparse_decode(torch.randn(2, 4, 64), _decode_cache(),
                                 torch.zeros(2, 2, 3, dtype=torch.int64)),
     TypeError, ["topk_idx must have dtype int32, got int64"]),
    ("compat_uint64_to_bool_negative_size",
     lambda: infllm_v2.uint64_to_bool(torch.zeros(2, 1, dtype=torch.int64), -1),
     ValueError, ["last_dim_size must be >= 0, got -1"]),
    ("compat_uint64_to_bool_bool_size",
     lambda: infllm_v2.uint64_to_bool(torch.zeros(2, 1, dtype=torch.int64), True),
     TypeError, ["last_dim_size must be an int, got bool"]),
    ("compat_stage1_negative_max_seqlen_k", lambda: _compat_stage1(max_seqlen_k=-3),
     ValueError, ["max_seqlen_k must be >= 0, got -3"]),
    ("sparse_config_topk_float", lambda: config_from_sparse_config({"topk": 2.7}),
     TypeError, ["sparse_config['topk'] must be an int, got float 2.7"]),
    ("sparse_config_dense_len_float", lambda: config_from_sparse_config({"dense_len": 1.5}),
     TypeError, ["sparse_config['dense_len'] must be an int, got float 1.5"]),
    ("sparse_config_topk_string", lambda: config_from_sparse_config({"topk": "8"}),
     TypeError, ["sparse_config['topk'] must be an int, got str '8'"]),
    ("stage1_cache_lens_float_entry",
     lambda: stage1_select(*_stage1_inputs(), cache_lens=[1.5]),
     TypeError, ["cache_lens must be ints, got float 1.5"]),
    ("naive_sparse_decode_float_block_size",
     lambda: naive_sparse_decode(torch.randn(2, 4, 64), _decode_cache(), block_size=2.5),
     TypeError, ["block_size must be an int, got float"]),
    ("plan_decode_zero_batch", lambda: plan_decode(0, 2, 2, 4, 132),
     ValueError, ["batch must be >= 1, got 0"]),
    ("head_sliding_step_zero_stride", lambda: patterns.head_sliding_step(4, 0, homo_head=False),
     ValueError, ["vert_stride must be >= 1, got 0"]),
    ("tile_window_mask_negative_window", lambda: patterns.tile_window_mask((2, 2), (-1, 1)),
     ValueError, ["window must be a tuple of positive ints, got (-1, 1)"]),
    ("pattern_topk_idx_negative_length",
     lambda: patterns.pattern_topk_idx(_layout(), torch.tensor([-5], dtype=torch.int32)),
     ValueError, ["seqlens must be >= 0", "[-5]"]),
    ("to_block_mask_float_block_size",
     lambda: patterns.to_block_mask(_layout(), BLOCK_SIZE=(128, 2.5)),
     ValueError, ["BLOCK_SIZE must be an int or a (Q, KV) pair, got (128, 2.5)"]),
    ("compat_varlen_causal_string",
     lambda: infllm_v2.infllmv2_attn_varlen_func(*_qkv(), CU, CU, 256, 256, causal="yes", topk_idx=_idx()),
     TypeError, ["causal must be a bool, got str 'yes'"]),
    ("compat_kvcache_int64_lengths",
     lambda: infllm_v2.infllmv2_attn_with_kvcache(torch.randn(1, 1, 4, 64), *_TUPLE_CACHE,
                                                  cache_seqlens=torch.tensor([5])),
     ValueError, ["cache_seqlens must be an int or an int32 tensor", "int64"]),
    # ---- unclear errors
    ("sparse_attn_negative_max_seqlen_q",
     lambda: sparse_attn_varlen(*_qkv(), CU, CU, _idx(), -5, 256),
     ValueError, ["max_seqlen_q must be >= 0", "got -5"]),
    ("sparse_attn_negative_max_seqlen_k",
     lambda: sparse_attn_varlen(*_qkv(), CU, CU, _idx(), 256, -5),
     ValueError, ["max_seqlen_k must be >= 0", "got -5"]),
    ("block_sparse_max_seqlen_q_none",
     lambda: block_sparse_attn_varlen(*_qkv(), CU, CU, _layout(), None, 256),
     TypeError, ["max_seqlen_q must be an int, got NoneType"]),
    ("block_sparse_cu_seqlens_q_none",
     lambda: block_sparse_attn_varlen(*_qkv(), None, CU, _layout(), 256, 256),
     TypeError, ["cu_seqlens_q must be a torch.Tensor, got NoneType"]),
    ("qhead_block_sparse_max_seqlen_q_none",
     lambda: patterns.qhead_block_sparse_attn_varlen(*_qkv(), CU, CU, _layout(4), None, 256),
     TypeError, ["max_seqlen_q must be an int, got NoneType"]),
    ("layout_to_topk_idx_list", lambda: _layout().to_topk_idx([0, 256]),
     TypeError, ["cu_seqlens_q must be a torch.Tensor, got list"]),
    ("to_bsr_head_past_the_layout", lambda: patterns.to_bsr(_layout(), R=64, C=64, head=5),
     ValueError, ["head must be in [0, 2)", "got 5"]),
    ("from_bsr_names_its_own_arguments",
     lambda: patterns.from_bsr(torch.tensor([0, 5, 3]), torch.tensor([0, 1, 2]), R=64, C=64),
     ValueError, ["indptr must start at 0", "indices.shape[-1]"]),
    ("from_block_mask_not_a_block_mask", lambda: patterns.from_block_mask(None),
     TypeError, ["block_mask must be a FlexAttention BlockMask", "got NoneType"]),
    ("head_sliding_step_zero_heads", lambda: patterns.head_sliding_step(0, 4, homo_head=False),
     ValueError, ["num_heads must be >= 1, got 0"]),
    ("to_block_mask_string_block_size", lambda: patterns.to_block_mask(_layout(), BLOCK_SIZE=(128, "a")),
     ValueError, ["BLOCK_SIZE must be an int or a (Q, KV) pair"]),
    ("compat_stage1_names_cu_seqlens_k",
     lambda: _compat_stage1(cu_seqlens_k=CU.new_tensor([0, 14])),
     ValueError, ["cu_seqlens_k must end at the total token count 15, got 14"]),
    ("compat_stage1_names_cu_seqlens_v", lambda: _compat_stage1(cu_seqlens_v=CU.new_tensor([0, 3]).long()),
     TypeError, ["cu_seqlens_v must have dtype int32, got int64"]),
    ("compat_stage1_names_k", lambda: _compat_stage1(k=None),
     TypeError, ["k must be a torch.Tensor, got NoneType"]),
    ("compat_stage1_names_v", lambda: _compat_stage1(v=torch.zeros(3, 2, 32)),
     ValueError, ["v must have shape [total_c2, H, D]"]),
    ("compat_stage1_max_seqlen_k_none", lambda: _compat_stage1(max_seqlen_k=None),
     TypeError, ["max_seqlen_k must be an int, got NoneType"]),
    ("compat_stage1_max_seqlen_q_none", lambda: _compat_stage1(max_seqlen_q=None),
     TypeError, ["max_seqlen_q must be an int, got NoneType"]),
    ("compat_uint64_to_bool_float_size",
     lambda: infllm_v2.uint64_to_bool(torch.zeros(2, 1, dtype=torch.int64), 2.5),
     TypeError, ["last_dim_size must be an int, got float 2.5"]),
    ("compat_uint64_to_bool_0d", lambda: infllm_v2.uint64_to_bool(torch.zeros((), dtype=torch.int64), 3),
     ValueError, ["uint64_array must have at least one dimension"]),
    ("compat_topk_to_uint64_list", lambda: infllm_v2.topk_to_uint64([1, 2], 128, 64),
     TypeError, ["topk_idx must be an int32 tensor, got list"]),
    ("compat_blockmask_to_uint64_list", lambda: infllm_v2.blockmask_to_uint64([True, False]),
     TypeError, ["blockmask must be a torch.Tensor, got list"]),
    ("compat_max_pooling_cache_len_none", lambda: _pool(cache_len=None),
     TypeError, ["cache_len must be an int, got NoneType"]),
    ("compat_max_pooling_names_cache_len", lambda: _pool(cache_len=-1),
     ValueError, ["cache_len must be >= 0"]),
    ("compat_max_pooling_names_stride", lambda: _pool(stride=0), ValueError, ["stride must be >= 1, got 0"]),
    ("compat_max_pooling_input_list", lambda: _pool(input=[1]), TypeError, ["input must be a torch.Tensor"]),
    ("compat_max_pooling_varlen_max_seqlen_q_none", lambda: _pool_varlen(max_seqlen_q=None),
     TypeError, ["max_seqlen_q must be an int, got NoneType"]),
    ("compat_max_pooling_varlen_names_stride", lambda: _pool_varlen(stride=0),
     ValueError, ["stride must be >= 1, got 0"]),
    ("compat_varlen_max_seqlen_q_none",
     lambda: infllm_v2.infllmv2_attn_varlen_func(*_qkv(), CU, CU, None, 256, topk_idx=_idx()),
     TypeError, ["max_seqlen_q must be an int, got NoneType"]),
    ("compat_varlen_max_seqlen_q_float_not_truncated",
     lambda: infllm_v2.infllmv2_attn_varlen_func(*_qkv(), CU, CU, 2.5, 256, topk_idx=_idx()),
     TypeError, ["max_seqlen_q must be an int, got float 2.5"]),
    ("compat_varlen_q_list",
     lambda: infllm_v2.infllmv2_attn_varlen_func([1], *_qkv()[1:], CU, CU, 256, 256, topk_idx=_idx()),
     TypeError, ["q must be a torch.Tensor, got list"]),
    ("compat_kvcache_q_list",
     lambda: infllm_v2.infllmv2_attn_with_kvcache([1], *_TUPLE_CACHE, cache_seqlens=5),
     TypeError, ["q must be a torch.Tensor, got list"]),
    ("compat_kvcache_k_cache_none",
     lambda: infllm_v2.infllmv2_attn_with_kvcache(torch.randn(1, 1, 4, 64), None, _TUPLE_CACHE[1],
                                                  cache_seqlens=5),
     TypeError, ["k_cache must be a torch.Tensor, got NoneType"]),
    ("stage1_cache_lens_int", lambda: stage1_select(*_stage1_inputs(), cache_lens=5),
     TypeError, ["cache_lens must be ints (a list, or an integer tensor), got int 5"]),
    ("stage1_cache_lens_string", lambda: stage1_select(*_stage1_inputs(), cache_lens="a"),
     TypeError, ["cache_lens must be ints (a list, or an integer tensor), got str 'a'"]),
    ("stage1_scores_ck1_none",
     lambda: stage1_scores(_stage1_inputs()[0], None, *_stage1_inputs()[2:]),
     TypeError, ["ck1 must be a torch.Tensor, got NoneType"]),
    ("naive_sparse_decode_zero_block_size",
     lambda: naive_sparse_decode(torch.randn(2, 4, 64), _decode_cache(), block_size=0),
     ValueError, ["block_size must be >= 1, got 0"]),
    ("plan_decode_string_batch", lambda: plan_decode("a", 2, 2, 4, 132), TypeError, ["batch must be an int"]),
    ("sparse_config_block_size_zero", lambda: config_from_sparse_config({"block_size": 0}),
     ValueError, ["sparse_config['block_size'] must be >= 1, got 0"]),
    ("sparse_config_topk_none", lambda: config_from_sparse_config({"topk": None}),
     TypeError, ["sparse_config['topk'] must be an int, got NoneType"]),
    ("sparse_config_use_nope_string", lambda: config_from_sparse_config({"use_nope": "no"}),
     TypeError, ["sparse_config['use_nope'] must be a bool"]),
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


@pytest.mark.parametrize("seqlens, exc, match", [
    (5, TypeError, r"seqlens must be ints, one per sequence \(a list, or an integer tensor\), got int 5"),
    ("ab", TypeError, "seqlens must be ints, one per sequence .*got str 'ab'"),
    (torch.tensor(3), TypeError, r"seqlens must be ints, one per sequence, got a tensor of dtype int64 and "
                                 r"shape \(\)"),
])
def test_decode_cache_reset_refuses_a_non_list(seqlens, exc, match):
    cache = _decode_cache()
    before = _cache_state(cache)
    with pytest.raises(exc, match=match):
        cache.reset(seqlens)
    assert _same(_cache_state(cache), before)


@pytest.mark.parametrize("cu, match", [
    ("abc", r"cu_seqlens_new must be int offsets \(a list, or an integer tensor\), got str 'abc'"),
    (5, r"cu_seqlens_new must be int offsets \(a list, or an integer tensor\), got int 5"),
    ([0, 1.5, 4], r"cu_seqlens_new must be int offsets, got float 1.5 in \[0, 1.5, 4\]"),
    ([0, True, 4], r"cu_seqlens_new must be int offsets, got bool True in \[0, True, 4\]"),
])
@pytest.mark.parametrize("entry", ["append", "prefill_into_cache"])
def test_chunk_offsets_that_are_not_ints_are_refused_and_keep_the_cache(cu, match, entry):
    """A string, an int or a float among the offsets was parsed, iterated or truncated (`[0, 1.5, 4]`
    appended a chunk of 1): now a TypeError naming cu_seqlens_new, before anything is written."""
    cache = _decode_cache()
    before = _cache_state(cache)
    k = torch.randn(4, 2, 64, generator=_g(5))
    with pytest.raises(TypeError, match=match):
        if entry == "append":
            cache.append(k, k.clone(), cu)
        else:
            infllmv2_prefill_into_cache(torch.randn(4, 4, 64), k, k.clone(), cache, cu, config=_CFG)
    assert _same(_cache_state(cache), before)


@pytest.mark.parametrize("seqlens", [None, 5, "ab"], ids=["none", "int", "str"])
def test_h2o_refuses_lengths_that_are_not_a_list_and_keeps_its_scores(seqlens):
    h2o = H2O(1, 2, 16, budget=4, recent=1)
    h2o.update(torch.rand(1, 2, 16, generator=_g()))
    before = h2o.scores.clone()
    kv = torch.randn(1, 16, 2, 8, generator=_g(3))
    kv0 = kv.clone()
    for call in (lambda: h2o.kept(seqlens), lambda: h2o.evict(kv, kv, seqlens)):
        with pytest.raises(TypeError, match="seqlens must be ints, one length per sequence"):
            call()
    assert torch.equal(h2o.scores, before) and torch.equal(kv, kv0)


def test_compat_kvcache_refusals_keep_the_caches():
    """The new keys are written only after every check: an int64 `cache_seqlens` (the original takes int32)
    or a k_cache that is not a tensor leaves both caches bit-identical."""
    g = _g(6)
    kc, vc = torch.randn(2, 128, 2, 64, generator=g), torch.randn(2, 128, 2, 64, generator=g)
    kc0, vc0 = kc.clone(), vc.clone()
    q = torch.randn(2, 1, 4, 64, generator=g)
    new = {n: torch.randn(2, 1, 2, 64, generator=g) for n in ("k", "v")}
    with pytest.raises(ValueError, match="cache_seqlens must be an int or an int32 tensor"):
        infllm_v2.infllmv2_attn_with_kvcache(q, kc, vc, cache_seqlens=torch.tensor([3, 4]), **new)
    with pytest.raises(TypeError, match=r"q must be a torch\.Tensor"):
        infllm_v2.infllmv2_attn_with_kvcache(list(q), kc, vc, cache_seqlens=3, **new)
    assert torch.equal(kc, kc0) and torch.equal(vc, vc0)
