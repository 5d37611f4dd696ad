"""Decode: one query token per sequence against its KV cache."""
from .naive import naive_infllmv2_decode
from .sparse_decode import DecodeCache, DecodePlan, naive_sparse_decode, plan_decode, sparse_decode

__all__ = [
    "DecodeCache",
    "DecodePlan",
    "naive_sparse_decode",
    "plan_decode",
    "sparse_decode",
    "naive_infllmv2_decode",
]
