"""Stage 2: attention over the selected key blocks (and dense varlen attention for the fallback)."""
from .naive import naive_dense_attn_varlen, naive_sparse_attn_varlen

__all__ = ["naive_dense_attn_varlen", "naive_sparse_attn_varlen"]
