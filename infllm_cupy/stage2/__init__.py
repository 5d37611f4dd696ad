"""Stage 2: attention over the selected key blocks (and dense varlen attention for the fallback)."""
from .attention import block_sparse_attn_varlen, qhead_block_sparse_attn_varlen, sparse_attn_varlen
from .layout import BlockLayout
from .naive import naive_block_sparse_attn_varlen, naive_dense_attn_varlen, naive_sparse_attn_varlen
from .q8_naive import Q8Operands, naive_q8_quantize, naive_q8_sparse_attn_varlen

__all__ = [
    "BlockLayout",
    "Q8Operands",
    "block_sparse_attn_varlen",
    "naive_block_sparse_attn_varlen",
    "naive_dense_attn_varlen",
    "naive_q8_quantize",
    "naive_q8_sparse_attn_varlen",
    "naive_sparse_attn_varlen",
    "qhead_block_sparse_attn_varlen",
    "sparse_attn_varlen",
]
