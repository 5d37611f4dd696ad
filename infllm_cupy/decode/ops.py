"""The cache's writes as `torch.library` custom ops (namespace `infllm_cupy`), so that
`cache.append(k, v)` traces inside `torch.compile(fullgraph=True)` with the step (`infllmv2_decode`,
whose op `infllm_cupy::infllmv2_decode` lives with its body in `step.py`). Design: docs/decode.md
("Custom ops and torch.compile").

    infllm_cupy::cache_append(k_new, v_new, k_cache, v_cache, ck1, ck2, seqlens, block_table)
    infllm_cupy::cache_append_chunk(k_new, v_new, k_cache, v_cache, ck1, ck2, seqlens, block_table, starts,
                                    counts)

    infllm_cupy::cache_append_fp8(..., block_table, k_scale, v_scale, k_recent, v_open)
    infllm_cupy::cache_append_chunk_fp8(..., block_table, k_scale, v_scale, k_recent, v_open, starts, counts)

They mutate the cache's tensors (keys, values, the compression windows they complete, the lengths; an
FP8 cache's scales and 16-bit buffers, docs/decode.md §16).
"""
from __future__ import annotations

import torch

from .cache import append_chunk_tensors, append_one_tensors
from .cache_append import append_launches, kernel_appends

Tensor = torch.Tensor


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


_FP8_MUTATES = ("k_cache", "v_cache", "ck1", "ck2", "seqlens", "k_scale", "v_scale", "k_recent", "v_open")


@torch.library.custom_op("infllm_cupy::cache_append_fp8", mutates_args=_FP8_MUTATES)
def cache_append_fp8_op(k_new: Tensor, v_new: Tensor, k_cache: Tensor, v_cache: Tensor, ck1: Tensor,
                        ck2: Tensor, seqlens: Tensor, block_table: Tensor | None, k_scale: Tensor,
                        v_scale: Tensor, k_recent: Tensor, v_open: Tensor) -> None:
    """`cache_append` into an FP8 cache (torch ops on any device: no kernel writes FP8 pages yet)."""
    append_one_tensors(k_new, v_new, k_cache, v_cache, ck1, ck2, seqlens, block_table,
                       (k_scale, v_scale, k_recent, v_open))


@cache_append_fp8_op.register_fake
def _(k_new, v_new, k_cache, v_cache, ck1, ck2, seqlens, block_table, k_scale, v_scale, k_recent, v_open):
    return None


@torch.library.custom_op("infllm_cupy::cache_append_chunk_fp8", mutates_args=_FP8_MUTATES)
def cache_append_chunk_fp8_op(k_new: Tensor, v_new: Tensor, k_cache: Tensor, v_cache: Tensor, ck1: Tensor,
                              ck2: Tensor, seqlens: Tensor, block_table: Tensor | None, k_scale: Tensor,
                              v_scale: Tensor, k_recent: Tensor, v_open: Tensor, starts: list[int],
                              counts: list[int]) -> None:
    """`cache_append_chunk` into an FP8 cache."""
    append_chunk_tensors(k_new, v_new, k_cache, v_cache, ck1, ck2, seqlens, block_table, starts, counts,
                         (k_scale, v_scale, k_recent, v_open))


@cache_append_chunk_fp8_op.register_fake
def _(k_new, v_new, k_cache, v_cache, ck1, ck2, seqlens, block_table, k_scale, v_scale, k_recent, v_open,
      starts, counts):
    return None


__all__ = ["cache_append_chunk_fp8_op", "cache_append_chunk_op", "cache_append_fp8_op", "cache_append_op"]
