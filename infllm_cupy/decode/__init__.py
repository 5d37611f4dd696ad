"""Decode: one query token per sequence against its KV cache."""
from .naive import naive_infllmv2_decode
from .sparse_decode import DecodeCache, DecodePlan, naive_sparse_decode, plan_decode, sparse_decode  # noqa: F401

__all__ = ["naive_infllmv2_decode"]
