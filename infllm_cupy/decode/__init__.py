"""Decode: one query token per sequence against its KV cache."""
from . import ops  # noqa: F401  (registers the cache's custom ops, which `DecodeCache.append` calls when traced)
from .cache import DecodeCache, cache_tensors
from .h2o import H2O
from .naive import naive_infllmv2_decode, naive_sparse_decode
from .sparse_decode import MAX_GROUP, DecodePlan, plan_decode
from .step import decode_select, infllmv2_decode, infllmv2_prefill_into_cache, sparse_decode

__all__ = [
    "DecodeCache",
    "DecodePlan",
    "naive_sparse_decode",
    "plan_decode",
    "sparse_decode",
    "naive_infllmv2_decode",
    "infllmv2_decode",
    "decode_select",
    "infllmv2_prefill_into_cache",
    "H2O",
    # for layers above that check a call before they write a cache: a cache's tensors, the largest group
    # size the decode kernels take
    "cache_tensors",
    "MAX_GROUP",
]
