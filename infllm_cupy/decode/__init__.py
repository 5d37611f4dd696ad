"""Decode: one query token per sequence against its KV cache."""
from .cache import DecodeCache
from .h2o import H2O
from .naive import cache_tensors, naive_infllmv2_decode, naive_sparse_decode
from .ops import decode_step
from .sparse_decode import MAX_GROUP, DecodePlan, plan_decode, sparse_decode
from .step import decode_select, infllmv2_decode, infllmv2_prefill_into_cache

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
    "decode_step",
    "H2O",
    # for layers above that check a call before they write a cache: a cache's tensors, the largest group
    # size the decode kernels take
    "cache_tensors",
    "MAX_GROUP",
]
