"""The pattern zoo: static and predicted block-sparsity patterns of other systems as `BlockLayout`s
that `block_sparse_attn_varlen` runs (docs/patterns.md).

- `local_stride`: vLLM's / dkernel's local + vertical-stride pattern (homogeneous or head-sliding).
- `per_kv_head`: collapse per-query-head masks to our per-KV-head layout when the groups agree.
- `to_csr`/`from_csr` (vLLM), `to_bsr`/`from_bsr` (FlashInfer), `to_block_mask`/`from_block_mask`
  (FlexAttention): other systems' formats in and out, exact or a ValueError.
- `sliding_tile`: Sliding Tile Attention's tile windows on 2-D/3-D grids, with the token permutation.
- `predict_sparge`: SpargeAttn's predicted mask (vectorised torch), `naive_predict_sparge` its loops.
- `SparseAttention`, `LocalStrideSparseAttention`: dkernel-like modules (batch-first or packed, GQA,
  per-head patterns, forward and backward); `dkernel_local_stride_mask` their local + stride rule.
- `pattern_decode`, `pattern_topk_idx`: a decode step over a static pattern through `sparse_decode`.
- `qhead_block_sparse_attn_varlen`: a layout with one row per query head, K/V not repeated in the
  CUDA forward and backward (the kernels' per-query-head mask rows); a stage-2 op
  (`infllm_cupy/stage2/attention.py`), named here for the zoo.
"""
from ..stage2.attention import qhead_block_sparse_attn_varlen
from .decode import pattern_decode, pattern_topk_idx
from .formats import from_block_mask, from_bsr, from_csr, to_block_mask, to_bsr, to_csr
from .local_stride import head_sliding_step, local_stride, local_stride_block_mask, per_kv_head
from .modules import LocalStrideSparseAttention, SparseAttention, dkernel_local_stride_mask
from .sliding_tile import sliding_tile, tile_permutation, tile_window_mask
from .sparge import naive_predict_sparge, predict_sparge

__all__ = [
    "local_stride",
    "local_stride_block_mask",
    "head_sliding_step",
    "per_kv_head",
    "to_csr", "from_csr", "to_bsr", "from_bsr", "to_block_mask", "from_block_mask",
    "sliding_tile",
    "tile_permutation",
    "tile_window_mask",
    "predict_sparge",
    "naive_predict_sparge",
    "SparseAttention",
    "LocalStrideSparseAttention",
    "dkernel_local_stride_mask",
    "pattern_decode",
    "pattern_topk_idx",
    "qhead_block_sparse_attn_varlen",
]
