"""Decode: one query token per sequence against its KV cache."""
from .naive import naive_infllmv2_decode

__all__ = ["naive_infllmv2_decode"]
