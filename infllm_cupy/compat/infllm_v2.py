"""The original InfLLM-v2 package's public API (`import infllm_v2`) on infllm-cupy's ops.

Same names, signatures, shapes, dtypes and semantics as OpenBMB/infllmv2_cuda_impl's `infllm_v2`
package (docs/semantics.md), so that code written
against it (the MiniCPM4 / 4.1 Hugging Face modeling file, vLLM and SGLang integrations) switches by
changing one import, or by `infllm_cupy.compat.install()`, which registers this module as `infllm_v2`.

Where the original silently ignores an argument because the feature is compiled out
(`-DFLASHATTENTION_DISABLE_{DROPOUT,ALIBI,SOFTCAP,LOCAL}`, spec section 2), we raise
NotImplementedError naming it instead, so nobody believes a dropout, ALiBi, softcap or sliding
window was applied. Arguments that change nothing in the original (`deterministic`, `num_splits`,
`return_attn_probs` of stage 1) are accepted.

Where the original is wrong by construction we compute the intended semantics rather than its bug:
any GQA group size G (the original needs G = 16, spec 4.6), fp16 (the original reinterprets it as
bf16, spec 2), and `infllmv2_attn_with_kvcache` with any number of KV heads (the original's row
offset hard-codes 2, spec 8). With G = 16, bf16 and 2 KV heads the results are the original's.
"""
from __future__ import annotations

import math
import numbers
import sys

import torch

# the package, not its names: `decode.sparse_decode` is both a function and a module of it
from .. import decode
from .._checks import (
    HostSeqlens,
    argument_names,
    check_attn_inputs,
    check_flags,
    check_int_args,
    check_max_seqlen,
    check_stage1_inputs,
    check_tensor,
    validate_values,
)
from .._dtypes import KERNEL_DTYPES
from .._rules import HEAD_DIMS
from ..decode import MAX_GROUP
from ..stage1 import pool_blocks, stage1_scores, stage1_select
from ..stage2 import sparse_attn_varlen

__all__ = [
    "infllmv2_attn_stage1",
    "infllmv2_attn_varlen_func",
    "infllmv2_attn_with_kvcache",
    "max_pooling_1d",
    "max_pooling_1d_varlen",
    "topk_to_uint64",
    "TopkToUint64Converter",
    "uint64_to_bool",
    "blockmask_to_uint64",
]

__version__ = "0.1.0"

# Stage-2 key-block size: the original hard-codes N_BLOCK_DIM = 64 in every caller of topk_to_uint64.
_BLOCK = 64


# Arguments of features the original builds without (-DFLASHATTENTION_DISABLE_{DROPOUT,ALIBI,SOFTCAP,LOCAL},
# spec section 2): it ignores them. The others it passes to its kernels with FlashAttention's meaning.
_COMPILED_OUT = ("dropout_p", "alibi_slopes", "softcap", "window_size")


def _unsupported(**args) -> None:
    """NotImplementedError for the first argument that asks for a feature we do not implement, saying what
    the original does with it: ignores it (a feature compiled out, `_COMPILED_OUT`), or passes it to its
    kernel (stage 1's `block_table`: paged compressed keys)."""
    for name, (value, default) in args.items():
        if isinstance(default, tuple):
            bad = tuple(value) != default
        elif default is None:
            bad = value is not None
        else:
            bad = value != default
        if bad:
            shown = (f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor)
                     else repr(value))
            why = ("the original InfLLM-v2 is built without this feature and ignores the argument, so no "
                   "result of either includes it" if name in _COMPILED_OUT else
                   "the original passes it to its kernel (FlashAttention's meaning); infllm-cupy's compat "
                   "layer does not implement it")
            raise NotImplementedError(f"infllm_v2 compat: {name}={shown} is not supported (only "
                                      f"{name}={default!r}); {why}")


def _int_arg(name: str, value, minimum: int = 0) -> int:
    """An int argument of the original API (a Python or numpy int, a 0-d integer tensor, or a SymInt that
    torch.compile traces) as an int, or a TypeError/ValueError naming `name`: `None`, `2.5` or `"8"` are
    refused, not converted by `int()` (which truncates a float and parses a string)."""
    if (isinstance(value, torch.Tensor) and value.dim() == 0 and not value.dtype.is_floating_point
            and not value.dtype.is_complex and value.dtype != torch.bool):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, (numbers.Integral, torch.SymInt)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}"[:200])
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value if isinstance(value, torch.SymInt) else int(value)


# the stage-1 ops' names of the original's stage-1 arguments
_STAGE1_NAMES = {"ck1": "k", "ck2": "v", "cu_seqlens_c1": "cu_seqlens_k", "cu_seqlens_c2": "cu_seqlens_v"}


# ----------------------------------------------------------------------------------------------
# Lengths the shapes fix (no read back from the device)
# ----------------------------------------------------------------------------------------------

def _uniform(cu, total: int, max_seqlen) -> bool:
    """Whether the shapes fix every length of `cu` at `max_seqlen`: `B = cu.numel() - 1` sequences of at
    most `max_seqlen` tokens each (the caller's bound, which the value checks confirm under validation) hold
    `total == B * max_seqlen` tokens only if each holds `max_seqlen`, so the offsets are `0, m, 2m, ..., B m`
    (a batch of equal-length rows, and every decode step: one query per sequence). Reads nothing."""
    return (isinstance(cu, torch.Tensor) and cu.dim() == 1 and cu.numel() >= 2
            and isinstance(max_seqlen, int) and not isinstance(max_seqlen, bool) and max_seqlen >= 0
            and total == (cu.numel() - 1) * max_seqlen)


def _uniform_offsets(B: int, n: int) -> tuple[int, ...]:
    return tuple(range(0, (B + 1) * n, n)) if n else (0,) * (B + 1)


# ----------------------------------------------------------------------------------------------
# Bit-mask helpers (topk_to_uint64.py, uint64_to_bool.py, blockmask_to_uint64.py)
# ----------------------------------------------------------------------------------------------

# Packing works on bytes: bit `j % 64` of word `j // 64` is bit `j % 8` of the word's byte `(j % 64) // 8`,
# which is byte `j // 8` of the row's words viewed as uint8 on a little-endian machine (every CUDA GPU and
# the usual hosts; a big-endian host reverses the bytes of each word). One byte of scratch per bit, no
# host loop, nothing read back to the host.
_LITTLE = sys.byteorder == "little"
_WORD_DTYPES = (torch.int64,) + ((torch.uint64,) if hasattr(torch, "uint64") else ())


def _bit_weights(device) -> torch.Tensor:
    """uint8 `[1, 2, 4, ..., 128]`, built on `device` (no host-to-device copy)."""
    return torch.bitwise_left_shift(torch.ones(8, dtype=torch.int64, device=device),
                                    torch.arange(8, dtype=torch.int64, device=device)).to(torch.uint8)


def _pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """bool `[rows, 64 * n_words]` -> int64 `[rows, n_words]`: bit `j % 64` of word `j // 64` is `mask[:, j]`
    (the int64 holds the original's uint64 bit pattern; bit 63 is the sign bit)."""
    rows, width = mask.shape
    n_words = width // 64
    if n_words == 0 or rows == 0:
        return torch.zeros(rows, n_words, dtype=torch.int64, device=mask.device)
    bits = mask.reshape(rows, n_words * 8, 8).to(torch.uint8)
    data = (bits * _bit_weights(mask.device)).sum(-1, dtype=torch.uint8)      # [rows, 8 * n_words] bytes
    if not _LITTLE:
        data = data.reshape(rows, n_words, 8).flip(-1).reshape(rows, n_words * 8)
    return data.contiguous().view(torch.int64)


def _unpack_bits(words: torch.Tensor) -> torch.Tensor:
    """int64 (or uint64) `[rows, n_words]` -> bool `[rows, 64 * n_words]` (inverse of `_pack_bits`)."""
    rows, n_words = words.shape
    if n_words == 0 or rows == 0:
        return torch.zeros(rows, 64 * n_words, dtype=torch.bool, device=words.device)
    data = words.contiguous().view(torch.uint8)                                 # [rows, 8 * n_words]
    if not _LITTLE:
        data = data.reshape(rows, n_words, 8).flip(-1).reshape(rows, n_words * 8)
    return (data[..., None] & _bit_weights(words.device)).ne(0).reshape(rows, 64 * n_words)


def topk_to_uint64(topk_idx: torch.Tensor, max_seqlen_k: int, block_size: int,
                   memory_buffer: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
    """Block indices -> one bit per key block, packed into 64-bit words (spec 7.1).

    Args:
        topk_idx: int32 `[num_heads, total_seqlen, k]` or `[batch, num_heads, total_seqlen, k]`.
        max_seqlen_k, block_size: `k_blocks = ceil(max_seqlen_k / block_size)`.
        memory_buffer: reused as the output when it has the output's shape and device.

    Returns:
        `(words, k_blocks)`: `words` is int64 (the uint64 bit patterns) with the last dim replaced by
        `ceil(k_blocks / 64)`; bit `j % 64` of word `j // 64` is set iff `j` is in the row. Negative
        indices (the -1 padding) and indices `>= 64 * n_words` set nothing; indices in
        `[k_blocks, 64 * n_words)` are kept, as in the original kernel.
    """
    if not isinstance(topk_idx, torch.Tensor) or topk_idx.dtype != torch.int32:
        got = topk_idx.dtype if isinstance(topk_idx, torch.Tensor) else type(topk_idx).__name__
        raise TypeError(f"topk_idx must be an int32 tensor, got {got}")
    if topk_idx.dim() not in (3, 4):
        raise ValueError(f"topk_idx must be 3-D or 4-D, got shape {tuple(topk_idx.shape)}")
    check_int_args(0, max_seqlen_k=max_seqlen_k)
    check_int_args(1, block_size=block_size)
    k_blocks = (max_seqlen_k + block_size - 1) // block_size
    n_words = (k_blocks + 63) // 64
    lead = tuple(topk_idx.shape[:-1])
    width = 64 * n_words
    flat = topk_idx.reshape(math.prod(lead), topk_idx.shape[-1]).long()
    rows = flat.shape[0]
    # One flat bit array, one spare entry at the end for the dropped indices (negative, or past the
    # last word): no host read of which entries are valid.
    row0 = torch.arange(rows, dtype=torch.int64, device=topk_idx.device)[:, None] * width
    ok = (flat >= 0) & (flat < width)
    target = torch.where(ok, row0 + flat, torch.full_like(flat, rows * width))
    bits = torch.zeros(rows * width + 1, dtype=torch.bool, device=topk_idx.device)
    bits.scatter_(0, target.reshape(-1), True)
    words = _pack_bits(bits[:-1].view(rows, width)).reshape(lead + (n_words,))
    if (memory_buffer is not None and tuple(memory_buffer.shape) == lead + (n_words,)
            and memory_buffer.device == topk_idx.device):
        memory_buffer.copy_(words)
        return memory_buffer, k_blocks
    return words, k_blocks


class TopkToUint64Converter:
    """Keeps one output buffer across `topk_to_uint64` calls (as the original's converter)."""

    def __init__(self):
        self.memory_buffer = None

    def convert(self, topk_idx: torch.Tensor, max_seqlen_k: int, block_size: int) -> tuple[torch.Tensor, int]:
        result, k_blocks = topk_to_uint64(topk_idx, max_seqlen_k, block_size, self.memory_buffer)
        self.memory_buffer = result
        return result, k_blocks

    def clear_memory(self):
        self.memory_buffer = None


def uint64_to_bool(uint64_array: torch.Tensor, last_dim_size: int) -> torch.Tensor:
    """Packed words `[..., n_words]` (int64 or uint64: the bit patterns) -> bool `[..., last_dim_size]`,
    element `j` = bit `j % 64` of word `j // 64`. `last_dim_size` may not exceed `64 * n_words` (the
    original's kernel would read past the row)."""
    if not isinstance(uint64_array, torch.Tensor) or uint64_array.dtype not in _WORD_DTYPES:
        raise TypeError(f"uint64_array must be an int64 or uint64 tensor (64-bit words), got "
                        f"{getattr(uint64_array, 'dtype', type(uint64_array))}")
    if uint64_array.dim() == 0:
        raise ValueError("uint64_array must have at least one dimension (the words of each row), got a 0-d "
                         "tensor")
    last_dim_size = _int_arg("last_dim_size", last_dim_size)
    lead = tuple(uint64_array.shape[:-1])
    n_words = uint64_array.shape[-1]
    if last_dim_size > 64 * n_words:
        raise ValueError(f"last_dim_size {last_dim_size} exceeds 64 * {n_words} words")
    bits = _unpack_bits(uint64_array.reshape(math.prod(lead), n_words))
    return bits[:, :last_dim_size].reshape(lead + (last_dim_size,))


def blockmask_to_uint64(blockmask: torch.Tensor) -> tuple[torch.Tensor, int]:
    """bool `[..., n]` -> `(int64 [..., ceil(n / 64)], n)`, the inverse of `uint64_to_bool` (a nonzero
    entry of another dtype counts as set)."""
    check_tensor("blockmask", blockmask)
    if blockmask.dim() == 0:
        raise ValueError("blockmask must have at least one dimension (the blocks of each row), got a 0-d "
                         "tensor")
    n = blockmask.shape[-1]
    n_words = (n + 63) // 64
    lead = tuple(blockmask.shape[:-1])
    flat = blockmask.reshape(math.prod(lead), n)
    flat = flat if flat.dtype == torch.bool else flat.ne(0)
    padded = torch.nn.functional.pad(flat.to(torch.uint8), (0, 64 * n_words - n))     # 0/1 bytes
    return _pack_bits(padded).reshape(lead + (n_words,)), n


# ----------------------------------------------------------------------------------------------
# Stage 1 and its pooling (infllmv2_sparse_attention.py, max_pooling_1d.py)
# ----------------------------------------------------------------------------------------------

def infllmv2_attn_stage1(q, k, v, cu_seqlens_q, cu_seqlens_k, cu_seqlens_v, max_seqlen_q, max_seqlen_k,
                         dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                         alibi_slopes=None, deterministic=False, return_attn_probs=True, block_table=None):
    """Stage-1 relevance scores of the fine compressed keys, summed over each KV group (spec 4).

    Args:
        q: `[total_q, h_q, d]` queries.
        k: fine compressed keys `[total_n1, h_kv, d]`, `cu_seqlens_k` their int32 `[B+1]` offsets.
        v: coarse compressed keys `[total_n2, h_kv, d]` (the LSE approximation; not values), with
            `cu_seqlens_v`; pass `v=k, cu_seqlens_v=cu_seqlens_k` for the exact softmax over `k`.
        max_seqlen_k: width of the output (the original slices its buffer to it).
        causal: the mask of spec 4.3, quirks included (the HF code passes True in prefill, False in decode).

    Returns:
        bf16 `[h_kv, total_q, max_seqlen_k]`; entries past a sequence's own key count and rows with no
        visible coarse key are 0. Values are unnormalised (coarse-key LSE) and can exceed 1.

    On CUDA tensors of the kernels' shapes (bf16/fp16, D 64 or 128, G <= 128) the stage-1 kernel writes
    the scores (`infllm_cupy.stage1.stage1_scores`); other inputs run the PyTorch reference. Code that
    only pools and ranks these scores gets the same blocks from `infllm_cupy.stage1_select`, which fuses
    stage 1, the pooling and the top-k in one kernel and never materialises this tensor.
    """
    _unsupported(dropout_p=(dropout_p, 0.0), window_size=(window_size, (-1, -1)), softcap=(softcap, 0.0),
                 alibi_slopes=(alibi_slopes, None), block_table=(block_table, None))
    check_flags(causal=causal)
    max_seqlen_q = _int_arg("max_seqlen_q", max_seqlen_q)
    max_seqlen_k = _int_arg("max_seqlen_k", max_seqlen_k)     # the output's width: a slice of it below
    with argument_names(**_STAGE1_NAMES):
        host = _stage1_known_lengths(q, k, v, cu_seqlens_q, cu_seqlens_k, cu_seqlens_v, max_seqlen_q,
                                     max_seqlen_k)
        if host is None:
            scores = stage1_scores(q, k, v, cu_seqlens_q, cu_seqlens_k, cu_seqlens_v, max_seqlen_q,
                                   causal=bool(causal), softmax_scale=softmax_scale,
                                   score_dtype=torch.bfloat16)
        else:   # the same kernel launch as stage1_scores', sized by the host offsets: no read back
            _, scores, _ = stage1_select(q, k, v, cu_seqlens_q, cu_seqlens_k, cu_seqlens_v, max_seqlen_q,
                                         causal=bool(causal), softmax_scale=softmax_scale, topk=0,
                                         local_blocks=0, init_blocks=0, score_dtype=torch.bfloat16,
                                         return_scores=True, host_seqlens=host)
    width = scores.shape[2]
    if width > max_seqlen_k:
        scores = scores[:, :, :max_seqlen_k].contiguous()
    elif width < max_seqlen_k:  # the original's buffer is zero-initialised up to a multiple of 128
        scores = torch.nn.functional.pad(scores, (0, max_seqlen_k - width))
    # in place: `scores` is this call's own tensor (no second [H, total_q, n1] copy)
    return scores.nan_to_num_(nan=0.0, posinf=float("inf"), neginf=float("-inf"))


def _stage1_on_kernels(q, k) -> bool:
    """Whether `stage1_scores` runs the stage-1 kernel on these inputs: CUDA tensors of its dtypes and head
    dims, at a group size the decode kernels take too (`decode.MAX_GROUP`, within the stage-1 kernel's;
    a larger group keeps the call that reads its offsets back)."""
    return (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and q.is_cuda and q.dim() == 3
            and k.dim() == 3 and q.dtype in KERNEL_DTYPES and q.shape[2] in HEAD_DIMS and k.shape[1] > 0
            and q.shape[1] % k.shape[1] == 0 and q.shape[1] // k.shape[1] <= MAX_GROUP)


def _stage1_known_lengths(q, k, v, cu_seqlens_q, cu_seqlens_k, cu_seqlens_v, max_seqlen_q: int,
                          max_seqlen_k) -> HostSeqlens | None:
    """The host offsets `stage1_select` takes (`host_seqlens`: queries and fine keys) when the shapes fix them
    (`_uniform`: `max_seqlen_q` queries and `max_seqlen_k` fine keys per sequence) and the kernel runs, after
    every check of `stage1_scores` (their one read of the offsets under validation); None otherwise.

    The kernel reads the offsets on the device; the host copy only sizes the score rows, `max_seqlen_k`
    columns, which is this function's output width either way: a sequence with more fine keys than
    `max_seqlen_k` (the original slices its buffer) has its row cut at `max_seqlen_k` by the kernel as by
    the slice, and one with fewer gets zeros there, as the original's zero-initialised buffer."""
    if not (_stage1_on_kernels(q, k) and _uniform(cu_seqlens_q, q.shape[0], max_seqlen_q)
            and _uniform(cu_seqlens_k, k.shape[0], max_seqlen_k)):
        return None
    check_max_seqlen("max_seqlen_q", max_seqlen_q, [])
    check_stage1_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, cu_seqlens_v, max_seqlen_q)
    B = cu_seqlens_q.numel() - 1
    c1 = _uniform_offsets(B, max_seqlen_k)
    return HostSeqlens(q=_uniform_offsets(B, max_seqlen_q), k=c1, c1=c1)


def max_pooling_1d(input: torch.Tensor, cache_len: int, local_blocks: int, init_blocks: int,
                   block_size: int = 64, stride: int = 16) -> torch.Tensor:
    """`max_pooling_1d_varlen` for one sequence: `input` `[num_heads, q_len, k_len]`, `k_len` fine keys.

    Returns `[num_heads, q_len, ceil((q_len + cache_len) / block_size)]` in `input`'s dtype. Device-side
    tensor code (`infllm_cupy.stage1.pool.pool_blocks`); reads nothing back to the host but the value checks.
    """
    check_tensor("input", input)
    if input.dim() != 3:
        raise ValueError(f"input must be [num_heads, q_len, k_len], got {tuple(input.shape)}")
    cache_len = _int_arg("cache_len", cache_len)
    dev = input.device
    _, q_len, k_len = input.shape
    two = torch.arange(2, dtype=torch.int32, device=dev)      # [0, 1] built on the device: no host copy
    with argument_names(kernel_stride="stride"):
        return pool_blocks(input, two * q_len, two * k_len, [cache_len], q_len, init_blocks=init_blocks,
                           local_blocks=local_blocks, block_size=block_size, kernel_stride=stride)


def max_pooling_1d_varlen(input: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                          cache_lens: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, local_blocks: int,
                          init_blocks: int, block_size: int = 64, stride: int = 16) -> torch.Tensor:
    """Stage-1 scores -> block scores with the init and local blocks forced to +inf (spec 5).

    For query row `r` of sequence `b`, `off_bq = (r + cache_lens[b]) // block_size`; block `j` is +inf
    if `j < init_blocks` or `off_bq - local_blocks <= j <= off_bq` (so `local_blocks + 1` local
    blocks), else the max of `input[h, t, 4j-1 : 4j+4]` clipped to the sequence's own fine-key count
    `cu_seqlens_k[b+1] - cu_seqlens_k[b]`, or -inf when that window is empty. Future blocks are not
    masked. Output `[num_heads, total_q, ceil((max_seqlen_q + max(cache_lens)) / block_size)]`, input dtype.

    Device-side tensor code (`infllm_cupy.stage1.pool.pool_blocks`, equal bit for bit to the reference
    `naive_pool_blocks`): no host loop. The output width needs `max(cache_lens)`: a `cache_lens` on the
    device costs one small read back to the host (as in the original, which reads it with `.item()`); one
    on the CPU (an int32 tensor the caller built from host lengths; beyond the original, whose kernel takes
    device pointers) is read on the host and copied to the device without a sync, so the call reads nothing
    back. The value checks (`INFLLM_CUPY_VALIDATE`) ride on one read. A NaN in a window gives NaN (the
    original kernel keeps a NaN only when it is the window's first entry); stage 1's scores hold no NaN.
    """
    check_tensor("input", input)
    if input.dim() != 3:
        raise ValueError(f"Expected 3D input, got {input.dim()}D")
    max_seqlen_q = _int_arg("max_seqlen_q", max_seqlen_q)
    max_seqlen_k = _int_arg("max_seqlen_k", max_seqlen_k)
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k),
                    ("cache_lens", cache_lens)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be an int32 tensor, got {type(t).__name__}")
        if t.dtype != torch.int32:
            raise TypeError(f"{name} must be int32, got {t.dtype}")
    if input.shape[2] != max_seqlen_k:
        raise ValueError(f"max_k mismatch: {input.shape[2]} vs {max_seqlen_k}")
    if cache_lens.dim() != 1:
        raise ValueError(f"cache_lens must be [batch], got shape {tuple(cache_lens.shape)}")
    if cache_lens.shape[0] != cu_seqlens_q.shape[0] - 1:
        raise ValueError(f"cache_lens batch size mismatch: {cache_lens.shape[0]} vs "
                         f"{cu_seqlens_q.shape[0] - 1}")
    # host lengths (a CPU tensor) as ints: pool_blocks copies them to the device without a sync and knows
    # the output width without reading it back
    lens = cache_lens.tolist() if cache_lens.device.type == "cpu" else cache_lens
    with argument_names(kernel_stride="stride"):
        return pool_blocks(input, cu_seqlens_q, cu_seqlens_k, lens, max_seqlen_q, init_blocks=init_blocks,
                           local_blocks=local_blocks, block_size=block_size, kernel_stride=stride)


# ----------------------------------------------------------------------------------------------
# Stage 2 (infllmv2_sparse_attention.py)
# ----------------------------------------------------------------------------------------------

def _gather_pages(k_cache, v_cache, cu_seqlens_k, block_table):
    """Paged K/V as the varlen function takes them packed (FlashAttention's paged varlen layout, which
    the original passes to its kernel): sequence b's key t, `t < cu_seqlens_k[b + 1] - cu_seqlens_k[b]`,
    is at `k_cache[block_table[b, t // page_size], t % page_size]`. Returns packed `[total_k, h_kv, d]`
    copies (differentiable: the gradients flow back to the pages). Reads the lengths and the table on the
    host to check that every key has a page."""
    check_tensor("k", k_cache)          # the varlen function's k and v
    check_tensor("v", v_cache)
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError("with block_table, k and v must be [num_pages, page_size, nheads_k, headdim] of "
                         f"one shape, got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if (not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32
            or block_table.dim() != 2):
        what = getattr(block_table, "dtype", type(block_table))
        raise ValueError(f"block_table must be an int32 [batch, max_pages] tensor, got {what} "
                         f"{tuple(getattr(block_table, 'shape', ()))}")
    cu = [int(x) for x in cu_seqlens_k.tolist()]
    B, page = len(cu) - 1, k_cache.shape[1]
    if block_table.shape[0] != B:
        raise ValueError(f"block_table has {block_table.shape[0]} rows for {B} sequences (cu_seqlens_k)")
    table = block_table.cpu().long()
    rows, slots = [], []
    for b in range(B):
        L = cu[b + 1] - cu[b]
        if L <= 0:
            continue
        need = (L + page - 1) // page
        if need > table.shape[1] or bool(((table[b, :need] < 0)
                                          | (table[b, :need] >= k_cache.shape[0])).any()):
            raise ValueError(f"block_table: sequence {b} has {L} keys but no valid page for some of its "
                             f"first {need} pages")
        t = torch.arange(L)
        rows.append(table[b, t // page])
        slots.append(t % page)
    if not rows:
        return k_cache.new_empty((0, *k_cache.shape[2:])), v_cache.new_empty((0, *v_cache.shape[2:]))
    r = torch.cat(rows).to(k_cache.device)
    c = torch.cat(slots).to(k_cache.device)
    return k_cache[r, c], v_cache[r, c]


def infllmv2_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                              softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                              alibi_slopes=None, deterministic=False, return_attn_probs=False,
                              block_table=None, topk_idx=None):
    """Block-sparse varlen attention (spec 7): `infllm_cupy.sparse_attn_varlen` behind the original's API.

    Query `t` (row `r` of its sequence), head `hq`, attends the keys `c < Lk` of its sequence with
    `c // 64` in `topk_idx[hq // G, t]` and, if `causal`, `c <= r + Lk - Lq`. Negative, out-of-range
    and future indices select nothing; a row with nothing selected gives output 0 (lse +inf).
    `topk_idx=None` is dense attention. Differentiable in q, k, v.

    The original has no `block_window_size` argument (its sliding window inside stage 2 was removed;
    the local window is the forced top-k blocks, spec 5); nor does this function.

    `block_table` (int32 `[batch, max_pages]`): k and v are paged, `[num_pages, page_size, h_kv, d]`,
    FlashAttention's layout (`_gather_pages`); the keys are gathered into the packed form first.

    Returns:
        `out [total_q, h_q, d]`; with `return_attn_probs`, `(out, softmax_lse, None)` where
        softmax_lse is float32 `[h_kv, total_q * G]` (row `t * G + g`, the original's expanded layout)
        when `topk_idx` is given and `[h_q, total_q]` otherwise; the original returns no attention
        probabilities without dropout, hence None.
    """
    _unsupported(dropout_p=(dropout_p, 0.0), window_size=(window_size, (-1, -1)), softcap=(softcap, 0.0),
                 alibi_slopes=(alibi_slopes, None))
    check_tensor("q", q, ndim=3)
    check_flags(causal=causal, return_attn_probs=return_attn_probs, deterministic=deterministic)
    max_seqlen_q = _int_arg("max_seqlen_q", max_seqlen_q)
    max_seqlen_k = _int_arg("max_seqlen_k", max_seqlen_k)
    if block_table is not None:
        k, v = _gather_pages(k, v, cu_seqlens_k, block_table)
    check_tensor("k", k, ndim=3)
    T, HQ, _ = q.shape
    H = k.shape[1]
    if HQ % H:
        raise ValueError(f"the number of query heads ({HQ}) must be a multiple of the KV heads ({H})")
    sparse = topk_idx is not None
    if sparse and (not isinstance(topk_idx, torch.Tensor) or topk_idx.dtype != torch.int32):
        raise TypeError(f"topk_idx must be int32, got {getattr(topk_idx, 'dtype', type(topk_idx))}")
    if _one_query_each(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, topk_idx):
        return _varlen_decode(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_k, softmax_scale, topk_idx,
                              bool(return_attn_probs))
    if not sparse:
        nb = max((max_seqlen_k + _BLOCK - 1) // _BLOCK, 1)
        topk_idx = torch.arange(nb, dtype=torch.int32, device=q.device).expand(H, T, nb).contiguous()
    res = sparse_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, topk_idx, max_seqlen_q, max_seqlen_k,
                             causal=bool(causal), softmax_scale=softmax_scale,
                             return_lse=bool(return_attn_probs))
    if not return_attn_probs:
        return res
    out, lse = res
    if sparse:
        G = HQ // H
        lse = lse.reshape(H, G, T).transpose(1, 2).reshape(H, T * G)
    return out, lse, None


def _one_query_each(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                    topk_idx) -> bool:
    """Whether `infllmv2_attn_varlen_func` is a decode step that the decode attention runs: the shapes fix one
    query and `max_seqlen_k >= 1` keys per sequence (`_uniform`), no gradient is asked for (the decode
    attention has no backward), at least one slot per `topk_idx` row, and `decode.sparse_decode` takes the
    tensors (its reference on CPU tensors; on CUDA tensors its kernel's dtypes, head dims and group sizes).
    Other calls go to the stage-2 attention, which names what it refuses."""
    if not (isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor) and k.dim() == 3 and max_seqlen_q == 1
            and max_seqlen_k >= 1 and _uniform(cu_seqlens_q, q.shape[0], 1)
            and _uniform(cu_seqlens_k, k.shape[0], max_seqlen_k)):
        return False
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return False
    if topk_idx is not None and (topk_idx.dim() != 3 or topk_idx.shape[2] == 0):
        return False
    if not q.is_cuda:
        return True
    return (q.dtype in KERNEL_DTYPES and q.shape[2] in HEAD_DIMS
            and q.shape[1] // k.shape[1] <= MAX_GROUP)


def _varlen_decode(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_k: int, softmax_scale, topk_idx,
                   return_lse: bool):
    """`infllmv2_attn_varlen_func` on one query per sequence and `max_seqlen_k` keys each (`_one_query_each`)
    as decode attention, `decode.sparse_decode`: the packed keys viewed as a contiguous cache
    `[B, max_seqlen_k, h_kv, d]` (a view of contiguous k and v), the lengths filled on the device, and
    `topk_idx [h_kv, total_q, K]` as decode's `[h_kv, B, K]` (the same tensor: one query per sequence).

    The same attention as the stage-2 path: a query sees the keys of its sequence in its selected blocks,
    negative and out-of-range indices select nothing, a row with nothing selected gives 0 (lse +inf), and
    the causal mask, bottom-right aligned, hides none of a sequence's keys from its one query, so `causal`
    changes nothing. Checks as the stage-2 path (the offsets' values, one read, under validation only);
    reads nothing else back."""
    check_attn_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=1, max_seqlen_k=max_seqlen_k)
    T, HQ, D = q.shape
    H = k.shape[1]
    if topk_idx is not None:
        check_tensor("topk_idx", topk_idx, ndim=3, dtypes=(torch.int32,), shape=(H, T, None), device=q.device)
        topk_idx = topk_idx.contiguous()
    shape = (T, max_seqlen_k, H, D)
    seqlens = torch.full((T,), max_seqlen_k, dtype=torch.int32, device=q.device)
    cache = (_attention_view(k.reshape(shape)), _attention_view(v.reshape(shape)), seqlens)
    res = decode.sparse_decode(q.contiguous(), cache, topk_idx, softmax_scale=softmax_scale,
                               return_lse=return_lse)
    if not return_lse:
        return res
    out, lse = res                                          # lse [B, h_q]: row t, head h * G + g
    if topk_idx is not None:                                # the original's [h_kv, total_q * G]
        return out, lse.view(T, H, HQ // H).permute(1, 0, 2).reshape(H, T * (HQ // H)), None
    return out, lse.t().contiguous(), None                  # [h_q, total_q]


def _check_batch_vector(name: str, t, B: int, device) -> None:
    """`t` (the argument `name`) is an int32 tensor `[B]` on `device` (the cache's)."""
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or tuple(t.shape) != (B,):
        raise ValueError(f"{name} must be an int32 tensor [batch={B}], got "
                         f"{getattr(t, 'dtype', type(t))} {tuple(getattr(t, 'shape', ()))}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device} (the cache's), got {t.device}")


def _check_batch_idx(cache_batch_idx, B: int, n_rows: int, paged: bool, device) -> list:
    """The cache rows `cache_batch_idx` names, as host ints, checked."""
    if paged:
        raise ValueError("cache_batch_idx: not with a paged cache (block_table): the original "
                         "(FlashAttention's kvcache) refuses the pair as well")
    _check_batch_vector("cache_batch_idx", cache_batch_idx, B, device)
    rows = [int(x) for x in cache_batch_idx.tolist()]
    if any(r < 0 or r >= n_rows for r in rows):
        raise ValueError(f"cache_batch_idx: rows must be in [0, {n_rows}) (the cache's batch), got "
                         f"{rows[:16]}")
    return rows


def _check_leftpad(cache_leftpad, seqlens, B: int, paged: bool, device) -> list:
    """The left padding of each sequence's cache row as host ints, checked: int32 `[B]`, contiguous
    caches only (the original refuses it with a paged cache), `0 <= cache_leftpad[b] <= cache_seqlens[b]`."""
    if paged:
        raise ValueError("cache_leftpad: not with a paged cache (block_table): the original refuses the pair "
                         "(\"We don't support Paged KV and leftpad_k running at the same time yet\")")
    _check_batch_vector("cache_leftpad", cache_leftpad, B, device)
    pads, lens = torch.stack((cache_leftpad.to(seqlens.dtype), seqlens)).tolist()
    for b, (p, L) in enumerate(zip(pads, lens)):
        if p < 0 or p > L:
            raise ValueError(f"cache_leftpad: sequence {b} starts at {p}, outside [0, cache_seqlens = {L}] "
                             f"(its keys are positions cache_leftpad .. cache_seqlens - 1)")
    return pads


def _check_attention(q, k_cache, v_cache, block_table, B: int) -> None:
    """What the attention step needs of q, the caches and the table, checked before any write (reads no
    values): q and the caches of one dtype and device, one head dim, whole KV groups; on CUDA tensors the
    decode kernel's limits (bf16/fp16, head dim 64 or 128, group size, pages of whole 64-key blocks)."""
    check_tensor("k_cache", k_cache)
    check_tensor("v_cache", v_cache)
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache and v_cache must be [.., .., nheads_k, headdim] of one shape, got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache must have a contiguous last dimension (as the original "
                         "asserts)")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"{name} must be {q.dtype} on {q.device} (q's), got {t.dtype} on {t.device}")
    _, _, HQ, D = q.shape
    H = k_cache.shape[2]
    if k_cache.shape[3] != D:
        raise ValueError(f"q has head dim {D} but the cache {k_cache.shape[3]}")
    if H == 0 or HQ % H:
        raise ValueError(f"q has {HQ} heads, not a multiple of the cache's {H} KV heads")
    if block_table is not None:
        if (not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32
                or block_table.dim() != 2 or block_table.shape[0] != B):
            raise ValueError(f"block_table must be an int32 tensor [batch={B}, max_pages], got "
                             f"{getattr(block_table, 'dtype', type(block_table))} "
                             f"{tuple(getattr(block_table, 'shape', ()))}")
        if block_table.device != q.device:
            raise ValueError(f"block_table must be on {q.device} (q's), got {block_table.device}")
        if k_cache.shape[1] % _BLOCK:
            raise ValueError(f"k_cache: page_size {k_cache.shape[1]} must be a multiple of {_BLOCK} (a key "
                             f"block never straddles pages; the original needs a multiple of 256)")
    if q.is_cuda:
        if q.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"q: the decode kernel takes bf16 or fp16 on CUDA tensors, got {q.dtype}")
        if D not in (64, 128):
            raise ValueError(f"q: the decode kernel takes head dim 64 or 128, got {D}")
        if HQ // H > MAX_GROUP:
            raise ValueError(f"q: group size {HQ // H} > {MAX_GROUP} is not supported by the decode kernel")


def _check_rotary(cos, sin, q, lens: list[int], n_new: int) -> None:
    for name, t in (("rotary_cos", cos), ("rotary_sin", sin)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.shape != cos.shape:
            raise ValueError(f"{name} must be [seqlen_ro, rotary_dim / 2] (both of one shape), got "
                             f"{tuple(getattr(t, 'shape', ()))}")
        if t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"{name} must be {q.dtype} on {q.device} (q's), got {t.dtype} on {t.device}")
    rd = 2 * cos.shape[1]
    if rd % 16 or rd > q.shape[-1]:
        raise ValueError(f"rotary_cos: rotary_dim = 2 x {cos.shape[1]} = {rd} must be a multiple of 16 and "
                         f"at most headdim {q.shape[-1]}")
    need = max(lens) + n_new if lens else 0
    if need > cos.shape[0]:
        raise ValueError(f"rotary_cos: {cos.shape[0]} positions, the new keys reach position {need - 1}")


def _rotate(x, cos, sin, pos, interleaved: bool):
    """Rotary embedding of `x [B, S, h, d]` at positions `pos [B, S]` over its first rotary_dim dims,
    FlashAttention's kvcache formula (fp32, rounded to x's dtype): interleaved pairs (2i, 2i + 1), or the
    halves (i, i + rotary_dim / 2)."""
    rd = 2 * cos.shape[1]
    c = cos.float()[pos][:, :, None]                    # [B, S, 1, rd / 2]
    s = sin.float()[pos][:, :, None]
    xr = x[..., :rd].float()
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        out = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
    else:
        x1, x2 = xr[..., :rd // 2], xr[..., rd // 2:]
        out = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
    return torch.cat((out.to(x.dtype), x[..., rd:]), dim=-1)


def _check_new_kv(k_cache, v_cache, k, v, lens: list[int], block_table, rows=None) -> None:
    """Everything `_append_new_kv` needs, checked before it writes anything (a failed call leaves the
    caches as they were): shapes, dtype and device against the caches', and every new position inside
    its sequence's cache (paged: on a page of the table, not -1). `lens`: the lengths on the host; reads
    the table on the host."""
    B = len(lens)
    for name, t in (("k", k), ("v", v)):
        if (not isinstance(t, torch.Tensor) or t.dim() != 4 or t.shape[0] != B
                or t.shape[2:] != k_cache.shape[2:]):
            raise ValueError(f"{name} must be [batch={B}, seqlen_new, nheads_k={k_cache.shape[2]}, "
                             f"headdim={k_cache.shape[3]}], got {tuple(getattr(t, 'shape', ()))}")
        if t.dtype != k_cache.dtype or t.device != k_cache.device:
            raise ValueError(f"{name} must be {k_cache.dtype} on {k_cache.device} (the cache's), got "
                             f"{t.dtype} on {t.device}")
    if v.shape != k.shape:
        raise ValueError(f"k and v must have one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    n = k.shape[1]
    page = k_cache.shape[1]
    if block_table is None:
        if rows is None and k_cache.shape[0] != B:
            raise ValueError(f"k_cache holds {k_cache.shape[0]} sequences, q {B} (or pass cache_batch_idx)")
        for b, L in enumerate(lens):
            if L < 0 or L + n > page:
                raise ValueError(f"cache_seqlens: sequence {b} holds {L} keys; the cache ({page} positions) "
                                 f"cannot take {n} more")
        return
    table = block_table.cpu()
    for b, L in enumerate(lens):
        if n == 0:
            continue
        first, last = L // page, (L + n - 1) // page
        if (L < 0 or last >= table.shape[1]
                or bool(((table[b, first:last + 1] < 0)
                         | (table[b, first:last + 1] >= k_cache.shape[0])).any())):
            raise ValueError(f"block_table: sequence {b} (holding {L} keys) has no valid page for positions "
                             f"{L} .. {L + n - 1} (pages {first} .. {last} of its row)")


def _append_new_kv(k_cache, v_cache, k, v, seqlens, block_table, rows=None):
    """Write the new keys/values of each sequence at `seqlens[b]` onwards, in place, in one indexed write
    per cache (paged or not; cache row `rows[b]` of a contiguous cache, b without `rows`); the inputs
    checked by `_check_new_kv`."""
    B, S_new = k.shape[:2]
    dev = k_cache.device
    pos = seqlens.to(dev, torch.int64)[:, None] + torch.arange(S_new, device=dev)      # [B, S_new]
    if block_table is None:
        r = (torch.arange(B, device=dev) if rows is None else torch.tensor(rows, dtype=torch.int64).to(dev))
        k_cache[r[:, None], pos] = k
        v_cache[r[:, None], pos] = v
    else:
        page = k_cache.shape[1]
        pages = block_table.to(dev, torch.int64).gather(1, pos // page)
        k_cache[pages, pos % page] = k
        v_cache[pages, pos % page] = v


def _attention_view(t: torch.Tensor) -> torch.Tensor:
    """`t` itself when the decode kernel can read it (contiguous, 16-byte aligned), else a dense copy (taken
    after the new keys are written, so it holds them)."""
    if t.is_contiguous() and t.data_ptr() % 16 == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def infllmv2_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                               cache_seqlens: int | torch.Tensor | None = None,
                               cache_batch_idx: torch.Tensor | None = None,
                               cache_leftpad: torch.Tensor | None = None,
                               block_table: torch.Tensor | None = None, softmax_scale=None, causal=False,
                               window_size=(-1, -1), softcap=0.0, rotary_interleaved=True, alibi_slopes=None,
                               num_splits=0, return_softmax_lse=False, topk_idx=None):
    """Decode attention over a (paged) KV cache with a block selection (spec 8): `infllm_cupy.sparse_decode`.

    Args:
        q: `[B, 1, h_q, d]` (one query token per sequence; longer queries raise NotImplementedError).
        k_cache, v_cache: `[B_cache, S, h_kv, d]`, or `[num_pages, page_size, h_kv, d]` with `block_table`
            int32 `[B, max_pages]` (page_size a multiple of 64 here; the original needs 256).
        k, v: optional new `[B, S_new, h_kv, d]`, written in place at `cache_seqlens` before attending
            (they need `cache_seqlens`, as in the original).
        cache_seqlens: int or int32 `[B]`, where each sequence's keys end (None: the whole cache width).
        topk_idx: int32 `[B, h_kv, 1, K]` block indices local to each sequence (-1 padding); None = dense.
        return_softmax_lse: also return float32 lse `[B, h_q, 1]`.

    With one query the causal mask (bottom-right aligned) allows every cached key, so `causal`
    changes nothing. `num_splits` is a performance knob and is ignored.

    FlashAttention's kvcache arguments, as the original passes them on:
        rotary_cos, rotary_sin: `[seqlen_ro, rotary_dim / 2]` (q's dtype, rotary_dim a multiple of 16, at
            most d), with `k`/`v` only: q is rotated at position `cache_seqlens[b]` and the new keys at
            `cache_seqlens[b] + i`, over their first rotary_dim dims (`rotary_interleaved`: pairs (0, 1),
            (2, 3), ...; else GPT-NeoX halves), in fp32 then rounded, before the keys are written.
        cache_batch_idx: int32 `[B]`, the cache row of each sequence (contiguous caches); attention reads
            a gathered copy of those rows.
        cache_leftpad: int32 `[B]` (contiguous caches): sequence b's keys are cache positions
            `cache_leftpad[b] .. cache_seqlens[b] - 1` (plus the new keys), so block `j` of `topk_idx` is
            positions `cache_leftpad[b] + 64 j ..`; the new keys are still written at `cache_seqlens[b]` and
            rotated there. Attention reads a gathered copy of the shifted rows.

    Every check runs before the new keys are written: a call that raises leaves k_cache and v_cache
    bit-identical. The checks read `cache_seqlens`, `cache_batch_idx`, `cache_leftpad` and the table on the
    host when they are needed to place a write or a gather.
    """
    _unsupported(window_size=(window_size, (-1, -1)), softcap=(softcap, 0.0),
                 alibi_slopes=(alibi_slopes, None))
    check_tensor("q", q)
    if q.dim() != 4:
        raise ValueError(f"q must be [batch, seqlen, nheads, headdim], got {tuple(q.shape)}")
    B, Lq, _HQ, _D = q.shape
    if Lq != 1:
        raise NotImplementedError(
            "infllm_v2 compat: infllmv2_attn_with_kvcache supports one query token per sequence (q seqlen "
            f"1), got {Lq}. The original passes longer queries to FlashAttention's kvcache kernel, but its "
            "block mask assumes one query token per sequence (G = 16 rows, 2 KV heads), so only seqlen 1 is "
            f"defined with topk_idx; use infllmv2_attn_varlen_func for several query tokens")
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together")
    if k is not None and cache_seqlens is None:
        raise ValueError("k and v are written at cache_seqlens: pass cache_seqlens with them (the original "
                         "requires it too)")
    paged = block_table is not None
    _check_attention(q, k_cache, v_cache, block_table, B)
    H = k_cache.shape[2]
    width = block_table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1]
    if cache_seqlens is None:
        seqlens = torch.full((B,), width, dtype=torch.int32, device=q.device)
    elif isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        seqlens = torch.full((B,), cache_seqlens, dtype=torch.int32, device=q.device)
    elif isinstance(cache_seqlens, torch.Tensor) and cache_seqlens.dtype == torch.int32:   # as the original
        if cache_seqlens.device != q.device:
            raise ValueError(f"cache_seqlens must be on {q.device} (q's), got {cache_seqlens.device}")
        seqlens = cache_seqlens
    else:
        raise ValueError(f"cache_seqlens must be an int or an int32 tensor [batch={B}], got "
                         f"{getattr(cache_seqlens, 'dtype', type(cache_seqlens))}")
    if seqlens.shape != (B,):
        raise ValueError(f"cache_seqlens must be an int or [batch={B}], got shape {tuple(seqlens.shape)}")
    # the lengths on the host, read once for every check that needs them (none reads them again)
    lens = None
    if isinstance(cache_seqlens, int):
        lens = [cache_seqlens] * B
    elif cache_seqlens is not None and (validate_values() or k is not None):
        lens = [int(x) for x in seqlens.tolist()]
    if lens is not None:
        bad = [b for b, L in enumerate(lens) if not 0 <= L <= width]
        if bad:
            raise ValueError(f"cache_seqlens must be in [0, {width}] (the keys each sequence holds, at most "
                             f"the cache's {width} positions), got {lens[bad[0]]} for sequence {bad[0]}")
    # every check before the new keys are written: a failed call leaves the caches unchanged
    sel = None
    if topk_idx is not None:
        if not isinstance(topk_idx, torch.Tensor) or topk_idx.dtype != torch.int32:
            raise TypeError("topk_idx must be an int32 tensor, got "
                            f"{getattr(topk_idx, 'dtype', type(topk_idx))}")
        if topk_idx.dim() != 4 or tuple(topk_idx.shape[:3]) != (B, H, 1):
            raise ValueError(f"topk_idx must be [batch, nheads_k, 1, K] = [{B}, {H}, 1, K], "
                             f"got {tuple(topk_idx.shape)}")
        if topk_idx.device != q.device:
            raise ValueError(f"topk_idx must be on {q.device} (q's), got {topk_idx.device}")
        sel = topk_idx[:, :, 0, :].permute(1, 0, 2).contiguous()  # our layout [h_kv, B, K]
    rows = None
    if cache_batch_idx is not None:
        rows = _check_batch_idx(cache_batch_idx, B, k_cache.shape[0], paged, q.device)
    elif not paged and k_cache.shape[0] != B:
        raise ValueError(f"k_cache holds {k_cache.shape[0]} sequences, q {B} (or pass cache_batch_idx)")
    pads = None
    if cache_leftpad is not None:
        pads = _check_leftpad(cache_leftpad, seqlens, B, paged, q.device)
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("rotary_cos and rotary_sin must be given together")
    if rotary_cos is not None:
        if k is None:
            raise ValueError("rotary_cos/rotary_sin rotate the new keys and q: they need k and v "
                             "(FlashAttention's rule)")
        _check_rotary(rotary_cos, rotary_sin, q, lens, k.shape[1] if isinstance(k, torch.Tensor) else 0)
    if k is not None:
        _check_new_kv(k_cache, v_cache, k, v, lens, block_table, rows)
    # ---- checks done: the writes ----
    if k is not None:
        if rotary_cos is not None:
            pos = seqlens.long()[:, None]
            q = _rotate(q, rotary_cos, rotary_sin, pos, rotary_interleaved)
            k = _rotate(k, rotary_cos, rotary_sin, pos + torch.arange(k.shape[1], device=q.device),
                        rotary_interleaved)
        _append_new_kv(k_cache, v_cache, k, v, seqlens, block_table, rows)
        seqlens = seqlens + k.shape[1]
    if rows is not None or pads is not None:
        # one gather: sequence b reads cache row rows[b] from position pads[b] on
        S = k_cache.shape[1]
        r = torch.tensor(rows if rows is not None else list(range(B)), dtype=torch.int64).to(q.device)
        if pads is not None:
            start = cache_leftpad.to(torch.int64)
            p = (start[:, None] + torch.arange(S, device=q.device)).clamp_(max=S - 1)
            k_cache, v_cache = k_cache[r[:, None], p], v_cache[r[:, None], p]
            seqlens = seqlens - cache_leftpad
        else:
            k_cache, v_cache = k_cache.index_select(0, r), v_cache.index_select(0, r)
    cache = (_attention_view(k_cache), _attention_view(v_cache), seqlens.to(torch.int32).contiguous())
    cache = cache + ((block_table.contiguous(),) if paged else ())
    res = decode.sparse_decode(q[:, 0].contiguous(), cache, sel, softmax_scale=softmax_scale,
                        return_lse=bool(return_softmax_lse))
    if return_softmax_lse:
        out, lse = res
        return out.unsqueeze(1), lse.unsqueeze(-1)
    return res.unsqueeze(1)
