"""Decode as `torch.library` custom ops (namespace `infllm_cupy`), so that a decode loop compiles with
`torch.compile(fullgraph=True)`. Design: docs/decode.md ("Custom ops and torch.compile").

    infllm_cupy::sparse_decode(q, k_cache, v_cache, seqlens, block_table, topk_idx, softmax_scale,
                               block_size) -> (out [B, HQ, D], lse float32 [B, HQ])
    infllm_cupy::sparse_decode_weights(q, k_cache, v_cache, seqlens, block_table, topk_idx, softmax_scale,
                                       block_size, per_kv_head) -> (out, lse, weights float32 [B, HQ or H, W])
    infllm_cupy::decode_select(q, ck1, ck2, seqlens, width, topk, local_blocks, init_blocks, block_size,
                               softmax_scale, score_dtype, exact, kernel) -> topk_idx int32 [H, B, K]

`block_table` and `topk_idx` are optional (None: contiguous cache; dense decode). CUDA tensors run the
kernels (`sparse_decode`; `select_on_cache` of `step.py`: the split stage-1 decode kernels), CPU tensors the
references (`naive_sparse_decode`, `naive_stage1_select`). `kernel` is the kernel generation as in every
op ("auto" | "sm80"; the decode kernels have no sm_90a form). The fake implementations give the output
shapes from the input shapes alone: W is the cache's width (`L_max`, or `max_pages * page_size`) and
`K = min(topk + local_blocks, cdiv(width, block_size))`, so `decode_select` pads the reference's
selection (sized on the longest sequence) with `-1` to that static K. Each op checks its own tensors
(under torch.compile the ops are the only Python that runs per call). No gradients: decode is inference.

`decode_step(q, cache, ...)` is `infllmv2_decode` through these ops: the same argument checks, dense/sparse
rule and stage-1 implementation (`step.py`); `DecodeCache.append` (one token per sequence) traces too, so
`append + decode_step` is one compiled region.
"""
from __future__ import annotations

import torch

from .._checks import check_bool, check_flags, check_tensor
from .._dtypes import REF_DTYPES
from .._rules import KV_BLOCK, cdiv, selection_slots, softmax_scale_of, uses_dense
from ..config import InfLLMv2Config
from .cache import DecodeCache, append_chunk_tensors, append_one_tensors
from .cache_append import append_launches, kernel_appends
from .naive import naive_sparse_decode
from .select_decode import check_compressed_keys
from .sparse_decode import sparse_decode as _sparse_decode
from .step import check_stage1, check_step_inputs, is_dense, select_on_cache, step_launches

Tensor = torch.Tensor


def _cache_tuple(k, v, seqlens, block_table):
    return (k, v, seqlens) if block_table is None else (k, v, seqlens, block_table)


def _width(k: Tensor, block_table: Tensor | None) -> int:
    return k.shape[1] * block_table.shape[1] if block_table is not None else k.shape[1]


def _kernel_block(block_size: int) -> None:
    if block_size != KV_BLOCK:
        raise ValueError(f"block_size must be {KV_BLOCK} on CUDA tensors (the decode kernel's block), got "
                         f"{block_size}")


# ------------------------------------------------------------------------------------- attention
@torch.library.custom_op("infllm_cupy::sparse_decode", mutates_args=(), device_types="cuda")
def sparse_decode_op(q: Tensor, k_cache: Tensor, v_cache: Tensor, seqlens: Tensor, block_table: Tensor | None,
                     topk_idx: Tensor | None, softmax_scale: float, block_size: int) -> tuple[Tensor, Tensor]:
    """`(out [B, HQ, D], lse float32 [B, HQ])` of decode attention over the selected (or all) blocks."""
    _kernel_block(block_size)
    return _sparse_decode(q, _cache_tuple(k_cache, v_cache, seqlens, block_table), topk_idx,
                          softmax_scale=softmax_scale, return_lse=True, backend="kernels")


@sparse_decode_op.register_kernel("cpu")
def _(q, k_cache, v_cache, seqlens, block_table, topk_idx, softmax_scale, block_size):
    return naive_sparse_decode(q, _cache_tuple(k_cache, v_cache, seqlens, block_table), topk_idx,
                               softmax_scale=softmax_scale, block_size=block_size, return_lse=True)


@sparse_decode_op.register_fake
def _(q, k_cache, v_cache, seqlens, block_table, topk_idx, softmax_scale, block_size):
    return q.new_empty(q.shape), q.new_empty(q.shape[:2], dtype=torch.float32)


@torch.library.custom_op("infllm_cupy::sparse_decode_weights", mutates_args=(), device_types="cuda")
def sparse_decode_weights_op(q: Tensor, k_cache: Tensor, v_cache: Tensor, seqlens: Tensor,
                             block_table: Tensor | None, topk_idx: Tensor | None, softmax_scale: float,
                             block_size: int, per_kv_head: bool) -> tuple[Tensor, Tensor, Tensor]:
    """`(out, lse, weights)`: weights float32 `[B, HQ, W]`, or `[B, H, W]` summed over the group."""
    _kernel_block(block_size)
    return _sparse_decode(q, _cache_tuple(k_cache, v_cache, seqlens, block_table), topk_idx,
                          softmax_scale=softmax_scale, return_lse=True, return_attn_weights=True,
                          weights="per_kv_head" if per_kv_head else "per_head", backend="kernels")


@sparse_decode_weights_op.register_kernel("cpu")
def _(q, k_cache, v_cache, seqlens, block_table, topk_idx, softmax_scale, block_size, per_kv_head):
    return naive_sparse_decode(q, _cache_tuple(k_cache, v_cache, seqlens, block_table), topk_idx,
                               softmax_scale=softmax_scale, block_size=block_size, return_lse=True,
                               return_attn_weights=True, weights="per_kv_head" if per_kv_head else "per_head")


@sparse_decode_weights_op.register_fake
def _(q, k_cache, v_cache, seqlens, block_table, topk_idx, softmax_scale, block_size, per_kv_head):
    B, HQ, _ = q.shape
    rows = k_cache.shape[2] if per_kv_head else HQ
    return (q.new_empty(q.shape), q.new_empty((B, HQ), dtype=torch.float32),
            q.new_empty((B, rows, _width(k_cache, block_table)), dtype=torch.float32))


# ------------------------------------------------------------------------------------- selection
def _select_config(topk, local_blocks, init_blocks, block_size, softmax_scale, score_dtype, exact,
                   dense_len=0):
    return InfLLMv2Config(topk=topk, local_blocks=local_blocks, init_blocks=init_blocks,
                          block_size=block_size, softmax_scale=softmax_scale, score_dtype=score_dtype,
                          exact_stage1=exact, dense_len=dense_len)


@torch.library.custom_op("infllm_cupy::decode_select", mutates_args=(), device_types="cuda")
def decode_select_op(q: Tensor, ck1: Tensor, ck2: Tensor, seqlens: Tensor, width: int, topk: int,
                     local_blocks: int, init_blocks: int, block_size: int, softmax_scale: float,
                     score_dtype: torch.dtype, exact: bool, kernel: str) -> Tensor:
    """Stage 1 for decode over the cache's compressed keys `ck1 [B, N1, H, D]`, `ck2 [B, N2, H, D]`:
    `topk_idx int32 [H, B, K]`, `K = min(topk + local_blocks, cdiv(width, block_size))`."""
    check_stage1("decode", kernel)
    cfg = _select_config(topk, local_blocks, init_blocks, block_size, softmax_scale, score_dtype, exact)
    return select_on_cache(q, ck1, ck2, seqlens, width, cfg, kern=True, kernel=kernel)


@decode_select_op.register_kernel("cpu")
def _(q, ck1, ck2, seqlens, width, topk, local_blocks, init_blocks, block_size, softmax_scale, score_dtype,
      exact, kernel):
    check_stage1("decode", kernel)
    cfg = _select_config(topk, local_blocks, init_blocks, block_size, softmax_scale, score_dtype, exact)
    return _reference_select(q, ck1, ck2, seqlens, width, cfg)


def _reference_select(q, ck1, ck2, seqlens, width: int, cfg: InfLLMv2Config) -> Tensor:
    """The CPU kernels' stage 1: the op's tensors checked once, then the reference (`select_on_cache`), its K
    (the longest sequence's) padded with -1 to the static K."""
    check_tensor("q", q, ndim=3, dtypes=REF_DTYPES)
    check_compressed_keys(q, ck1, ck2, seqlens, exact=cfg.exact_stage1, contiguous=False)
    return select_on_cache(q, ck1, ck2, seqlens, width, cfg, kern=False)


@decode_select_op.register_fake
def _(q, ck1, ck2, seqlens, width, topk, local_blocks, init_blocks, block_size, softmax_scale, score_dtype,
      exact, kernel):
    K = selection_slots(topk, local_blocks, cdiv(width, block_size))
    return q.new_empty((ck1.shape[2], q.shape[0], K), dtype=torch.int32)


# ---------------------------------------------------------------------------- cache and whole step
# Prepared launches of the append op, by the shapes of its tensors: a compiled caller without CUDA graphs
# calls it at every step (docs/decode.md, 11). A program holds no tensor: each call re-points them all.
_PROGRAMS: dict = {}
_MAX_PROGRAMS = 64


def _program(key, build):
    prog = _PROGRAMS.get(key)
    if prog is None:
        if len(_PROGRAMS) >= _MAX_PROGRAMS:
            _PROGRAMS.clear()
        prog = _PROGRAMS[key] = build()
    return prog


def _shapes(*tensors) -> tuple:
    return tuple((tuple(t.shape), t.dtype, t.device) if t is not None else None for t in tensors)


@torch.library.custom_op("infllm_cupy::cache_append",
                         mutates_args=("k_cache", "v_cache", "ck1", "ck2", "seqlens"), device_types="cuda")
def cache_append_op(k_new: Tensor, v_new: Tensor, k_cache: Tensor, v_cache: Tensor, ck1: Tensor, ck2: Tensor,
                    seqlens: Tensor, block_table: Tensor | None) -> None:
    """One token per sequence (`k_new`, `v_new [B, H, D]`) into a cache's tensors, as
    `DecodeCache.append`: the key and value at `seqlens[b]`, the compression windows that end there,
    then `seqlens + 1`, positions read on the device. A sequence past its capacity is left unchanged
    (nothing is read back to check it)."""
    if not kernel_appends(k_cache):
        return append_one_tensors(k_new, v_new, k_cache, v_cache, ck1, ck2, seqlens, block_table)
    k_new, v_new = k_new.contiguous(), v_new.contiguous()
    if k_new.data_ptr() % 16 or v_new.data_ptr() % 16:
        k_new, v_new = k_new.clone(), v_new.clone()
    # every tensor is re-pointed at each call: the kept program holds none (no cache outlives its user)
    bound = dict(k_new=k_new, v_new=v_new, k=k_cache, v=v_cache, ck1=ck1, ck2=ck2, seqlens=seqlens)
    if block_table is not None:
        bound["block_table"] = block_table
    prog = _program(("append",) + _shapes(k_new, k_cache, ck1, ck2, seqlens, block_table),
                    lambda: append_launches(k_new, v_new, k_cache, v_cache, ck1, ck2, seqlens,
                                            block_table).program(**bound))
    prog.run(**bound)


@cache_append_op.register_kernel("cpu")
def _(k_new, v_new, k_cache, v_cache, ck1, ck2, seqlens, block_table):
    append_one_tensors(k_new, v_new, k_cache, v_cache, ck1, ck2, seqlens, block_table)


@cache_append_op.register_fake
def _(k_new, v_new, k_cache, v_cache, ck1, ck2, seqlens, block_table):
    return None


@torch.library.custom_op("infllm_cupy::cache_append_chunk",
                         mutates_args=("k_cache", "v_cache", "ck1", "ck2", "seqlens"))
def cache_append_chunk_op(k_new: Tensor, v_new: Tensor, k_cache: Tensor, v_cache: Tensor, ck1: Tensor,
                          ck2: Tensor,
                          seqlens: Tensor, block_table: Tensor | None, starts: list[int],
                          counts: list[int]) -> None:
    """A chunk of `counts[b]` tokens per sequence (packed `[sum(counts), H, D]`) into a cache's tensors
    whose sequences hold `starts[b]` keys, as `DecodeCache.append(k_new, v_new, cu_seqlens)` (checked
    there): the keys, values, the windows they complete and the lengths. Any device."""
    append_chunk_tensors(k_new, v_new, k_cache, v_cache, ck1, ck2, seqlens, block_table, starts, counts)


@cache_append_chunk_op.register_fake
def _(k_new, v_new, k_cache, v_cache, ck1, ck2, seqlens, block_table, starts, counts):
    return None


@torch.library.custom_op("infllm_cupy::infllmv2_decode", mutates_args=(), device_types="cuda")
def infllmv2_decode_op(q: Tensor, k_cache: Tensor, v_cache: Tensor, ck1: Tensor, ck2: Tensor, seqlens: Tensor,
                       block_table: Tensor | None, topk: int, local_blocks: int, init_blocks: int,
                       dense_len: int, softmax_scale: float, score_dtype: torch.dtype, exact: bool) -> Tensor:
    """`out [B, HQ, D]` of one InfLLM-v2 decode step on a cache's tensors, the dense/sparse rule of
    spec section 9 decided on the device from `seqlens` (every sequence shorter than `dense_len`:
    dense), so that a captured graph follows the lengths at every replay. Same function as
    `infllmv2_decode` (whose eager path decides on the host: the dense split differs, not the result
    beyond rounding)."""
    cfg = _select_config(topk, local_blocks, init_blocks, KV_BLOCK, softmax_scale, score_dtype, exact,
                         dense_len)
    q = q.contiguous()
    if q.data_ptr() % 16:
        q = q.clone()
    # built at every call, not kept: under torch.compile's CUDA graphs (where this op runs at warm-up and
    # recording only) a kept program's scratch would stay alive in the graph's pool, which cudagraph
    # trees refuse; eager callers take `infllmv2_decode`'s kept programs instead
    run, (out, *_) = step_launches(q, k_cache, v_cache, ck1, ck2, seqlens, block_table,
                                   _width(k_cache, block_table), cfg, dense=None)
    run.run()
    return out


@infllmv2_decode_op.register_kernel("cpu")
def _(q, k_cache, v_cache, ck1, ck2, seqlens, block_table, topk, local_blocks, init_blocks, dense_len,
      softmax_scale, score_dtype, exact):
    cache = _cache_tuple(k_cache, v_cache, seqlens, block_table)
    cfg = _select_config(topk, local_blocks, init_blocks, KV_BLOCK, softmax_scale, score_dtype, exact,
                         dense_len)
    topk_idx = None
    if not uses_dense(cfg.dense_len, int(seqlens.max())):
        topk_idx = _reference_select(q, ck1, ck2, seqlens, _width(k_cache, block_table), cfg)
    return naive_sparse_decode(q, cache, topk_idx, softmax_scale=softmax_scale, block_size=KV_BLOCK)


@infllmv2_decode_op.register_fake
def _(q, k_cache, v_cache, ck1, ck2, seqlens, block_table, topk, local_blocks, init_blocks, dense_len,
      softmax_scale, score_dtype, exact):
    return q.new_empty(q.shape)


# -------------------------------------------------------------------------------------- the step
def decode_step(q: Tensor, cache: DecodeCache, *, config: InfLLMv2Config | None = None,
                dense: bool | None = None, return_attn_weights: bool = False, weights: str = "per_head",
                kernel: str = "auto"):
    r"""`infllmv2_decode` through the custom ops: `(out, lse)` or `(out, lse, weights)`.

    Same semantics as `infllmv2_decode` (its checks, `is_dense`, stage 1 on the split decode kernels:
    `kernel` "auto" or "sm80"), but every tensor operation is an op that torch.compile keeps whole
    (`fullgraph=True`). `dense`: the path, or None for the rule of spec section 9 on `cache.max_len()`
    (a host int: inside a compiled region, pass it from outside to avoid a guard on the lengths). The
    selection's K is always sized on the cache's width.
    """
    check_flags(return_attn_weights=return_attn_weights)
    if dense is not None:
        check_bool("dense", dense)
    cfg, _ = check_step_inputs(q, cache, config, weights, "auto", kernel)
    if dense is None:
        dense = is_dense(cache, cfg)
    scale = softmax_scale_of(cfg.softmax_scale, q.shape[2])
    topk_idx = None
    if not dense:
        topk_idx = decode_select_op(q, cache.ck1, cache.ck2, cache.seqlens, cache.capacity, cfg.topk,
                                    cfg.local_blocks, cfg.init_blocks, cfg.block_size, scale, cfg.score_dtype,
                                    cfg.exact_stage1, kernel)
    args = (q, cache.k, cache.v, cache.seqlens, cache.block_table, topk_idx, scale, cfg.block_size)
    if return_attn_weights:
        return sparse_decode_weights_op(*args, weights == "per_kv_head")
    return sparse_decode_op(*args)


__all__ = ["decode_select_op", "decode_step", "sparse_decode_op", "sparse_decode_weights_op"]
