"""infllm-cupy: InfLLM-v2 trainable two-stage sparse attention as raw CUDA compiled at run time.

CUDA tensors run the kernels in kernels_cu/ (compiled by NVRTC through CuPy on first use); CPU
tensors run the PyTorch reference of the same op, so everything also works on a laptop. Every op
is exported next to its reference, `naive_<op>` (same signature).
"""
__version__ = "0.1.0"

from .compress import compress_k, naive_compress_k
from .config import InfLLMv2Config
from .decode import (
    H2O,
    DecodeCache,
    infllmv2_decode,
    infllmv2_prefill_into_cache,
    naive_infllmv2_decode,
    naive_sparse_decode,
    sparse_decode,
)
from .patterns import (
    LocalStrideSparseAttention,
    SparseAttention,
    from_block_mask,
    from_bsr,
    from_csr,
    local_stride,
    naive_predict_sparge,
    pattern_decode,
    per_kv_head,
    predict_sparge,
    sliding_tile,
    to_block_mask,
    to_bsr,
    to_csr,
)
from .pipeline import InfLLMv2Attention, infllmv2_attention, naive_infllmv2_attention
from .stage1 import naive_stage1_select, stage1_select
from .stage2 import (
    BlockLayout,
    block_sparse_attn_varlen,
    naive_block_sparse_attn_varlen,
    naive_dense_attn_varlen,
    naive_sparse_attn_varlen,
    sparse_attn_varlen,
)

__all__ = [
    "__version__",
    # whole pipeline
    "InfLLMv2Config",
    "InfLLMv2Attention",
    "infllmv2_attention",
    "naive_infllmv2_attention",
    # stages, each with its reference
    "compress_k",
    "naive_compress_k",
    "stage1_select",
    "naive_stage1_select",
    "BlockLayout",
    "sparse_attn_varlen",
    "naive_sparse_attn_varlen",
    "block_sparse_attn_varlen",
    "naive_block_sparse_attn_varlen",
    # decode: one query per sequence against its KV cache (the whole step, its attention alone,
    # chunked prefill into the cache, and H2O eviction scores from the step's attention weights)
    "DecodeCache",
    "infllmv2_decode",
    "infllmv2_prefill_into_cache",
    "H2O",
    "sparse_decode",
    "naive_sparse_decode",
    # references without a kernel of their own: the dense fallback (the pipeline runs it on torch
    # SDPA) and a whole decode step (selection and attention)
    "naive_dense_attn_varlen",
    "naive_infllmv2_decode",
    # the pattern zoo (docs/patterns.md): other systems' static patterns and formats as BlockLayouts,
    # and SpargeAttn's predicted mask with its loop reference
    "local_stride",
    "sliding_tile",
    "per_kv_head",
    "to_csr",
    "from_csr",
    "to_bsr",
    "from_bsr",
    "to_block_mask",
    "from_block_mask",
    "predict_sparge",
    "naive_predict_sparge",
    # dkernel-like modules on our kernels, and decode over a static pattern
    "SparseAttention",
    "LocalStrideSparseAttention",
    "pattern_decode",
]
