"""infllm-cupy: InfLLM-v2 trainable two-stage sparse attention as raw CUDA compiled at run time.

CUDA tensors run the kernels in kernels_cu/ (compiled by NVRTC through CuPy on first use); CPU
tensors run the PyTorch reference of the same op, so everything also works on a laptop. Every op
is exported next to its reference, `naive_<op>` (same signature).

The top level holds InfLLM-v2: the configuration, the whole attention (function and module), its
stages and the decode step on a KV cache, each with its reference. Beside it: `infllm_cupy.decode`
(the cache's helpers: chunked prefill into a cache, H2O eviction, the custom ops),
`infllm_cupy.patterns` (other systems' sparsity patterns as `BlockLayout`s), `infllm_cupy.compat`
(the original `infllm_v2` API), `infllm_cupy.distributed` (context parallelism) and
`infllm_cupy.integrations` (transformers, MiniCPM4).
"""
__version__ = "0.1.0"

from .compress import compress_k, naive_compress_k
from .config import InfLLMv2Config
from .decode import DecodeCache, infllmv2_decode, naive_infllmv2_decode, naive_sparse_decode, sparse_decode
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
    # decode: one query per sequence against its KV cache, the whole step and its attention over a
    # given selection
    "DecodeCache",
    "infllmv2_decode",
    "naive_infllmv2_decode",
    "sparse_decode",
    "naive_sparse_decode",
    # the reference of the dense fallback (the pipeline runs it on torch SDPA)
    "naive_dense_attn_varlen",
]
