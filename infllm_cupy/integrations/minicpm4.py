"""A MiniCPM4-style InfLLM-v2 attention layer written against the `infllm_v2` compat API.

The layer follows the structure of MiniCPM4's Hugging Face modeling file (`MiniCPMInfLLMv2Attention`,
docs/semantics.md; docs/integrations.md, "The MiniCPM4-style layer"),
calling only the original package's public functions as `infllm_cupy.compat.infllm_v2` offers them:

  * `kv_seq_len < dense_len`: dense varlen attention (`infllmv2_attn_varlen_func` without `topk_idx`;
    HF calls flash-attn's here);
  * otherwise: mean-compress the keys (32/16 and 128/64, kept per layer and updated incrementally),
    `infllmv2_attn_stage1` (causal in prefill, not in decode), `max_pooling_1d_varlen` with the init
    and local blocks forced, `topk(K = topk + window_size // block_size)`, blocks after the query's own
    set to -1, then `infllmv2_attn_varlen_func(..., causal=q_len != 1, topk_idx=...)`.

Decode is HF's path (spec section 8): the one query attends the whole cached K/V through the varlen
function with the selection of a non-causal stage 1 over the compressed cache. The layer knows every length
on the host, and the compat functions take what the shapes fix, so a compat decode step reads nothing back
from the device (the value checks of INFLLM_CUPY_VALIDATE aside): offsets built on the device and kept
(`_offsets`), `cache_lens` a CPU tensor (`_cache_lens`), the mask's values checked in prefill only, and the
varlen function runs the decode kernel for one query per sequence (docs/integrations.md, "The MiniCPM4-style
layer").

`route` picks how the selection runs. `"compat"` calls exactly the sequence above, each step a compat
function (stage 1 materialises the `[H, total_q, n1]` scores, pooling and top-k follow; the top-k
breaks ties to the lower block index, the package's one rule, where MiniCPM4's `torch.topk` leaves them
unspecified). `"fused"` (the default) reaches the same selection through infllm-cupy's fused paths: the
keys are compressed by the compression kernel, and `stage1_select` computes scores, pooling and top-k in
one kernel without the score matrix (same blocks). With an `InfLLMv2Cache` the fused route hands the
whole attention to the backend's attention function, which decodes on the cache's `DecodeCache`
(decode kernels, compressed keys kept by the cache) and prefills on the cache's compressed keys.

`use_minicpm4_attention(model)` swaps this layer into a Llama-style HF model (LlamaForCausalLM: same
projection names, so the weights are kept), which then generates with any HF cache. The compressed
keys are a side table on the HF cache object, keyed by `layer_idx` (the layer is handed the cache;
MiniCPM4 keeps them in its own cache layer instead).
"""
from __future__ import annotations

import torch
from torch import nn

from .._rules import HEAD_DIMS, n_windows, softmax_scale_of, uses_dense
from ..compat import infllm_v2
from ..compress import compress_k
from ..stage1 import stage1_select
from ..stage1.naive import naive_select_topk
from ..stage1.plan import MAX_GROUP
from .transformers import (
    ATTN_NAME,
    DECODE_CACHE_ATTR,  # an InfLLMv2Cache key view's DecodeCache
    config_from_sparse_config,
    infllm_cupy_attention,
    register,
)

ROUTES = ("fused", "compat")

__all__ = ["MiniCPM4SparseAttention", "use_minicpm4_attention"]

_SIDE_TABLE = "_infllm_cupy_compressed_keys"     # attribute of the HF cache: {layer_idx: _Compressed}
_OFFSETS_KEPT = 8                                  # offsets tensors a layer keeps (`_offsets`)


def _rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def _rope(q, k, cos, sin):
    """Llama's rotary embedding on `[B, heads, L, D]` (post-RoPE keys feed compression, as MiniCPM4's
    `use_nope=False`)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _windows(k: torch.Tensor, lo: int, hi: int, kernel: int, stride: int) -> torch.Tensor:
    """Means of windows `[i*stride, i*stride + kernel)`, i in [lo, hi), of `k [B, L, H, D]` -> `[B, hi-lo, H,
    D]` (summed in fp32 and rounded to k's dtype, as `naive_compress_k`)."""
    idx = (torch.arange(lo, hi, device=k.device)[:, None] * stride
           + torch.arange(kernel, device=k.device)[None, :])
    acc = torch.float64 if k.dtype == torch.float64 else torch.float32
    return k[:, idx].to(acc).mean(dim=2).to(k.dtype)


def _compress(k: torch.Tensor, kernel: int, stride: int, *, kernels: bool) -> torch.Tensor:
    """Every window of `k [B, L, H, D]` -> `[B, n, H, D]`: with `kernels`, the compression kernel on CUDA
    tensors of its shapes; `_windows` otherwise."""
    B, L, H, D = k.shape
    n = n_windows(L, kernel, stride)
    if not (kernels and k.is_cuda and D in HEAD_DIMS and n > 0
            and k.dtype in (torch.bfloat16, torch.float16, torch.float32)):
        return _windows(k, 0, n, kernel, stride)
    cu = torch.arange(B + 1, dtype=torch.int32, device=k.device) * L
    ck, _ = compress_k(k.reshape(B * L, H, D), cu, kernel, stride)
    return ck.view(B, n, H, D)


class _Compressed:
    """One layer's compressed keys: `ck1 [B, n1, H, D]`, `ck2 [B, n2, H, D]` over the first `length` keys."""

    def __init__(self, ck1, ck2, length):
        self.ck1, self.ck2, self.length = ck1, ck2, length


class MiniCPM4SparseAttention(nn.Module):
    """MiniCPM4's InfLLM-v2 attention (HF `MiniCPMInfLLMv2Attention`'s structure) on the compat API.

    Args:
        config: a Llama-style HF config (`hidden_size`, `num_attention_heads`, `num_key_value_heads`,
            optional `head_dim`, `attention_bias`) with MiniCPM4's `sparse_config` dict (`kernel_size`,
            `kernel_stride`, `init_blocks`, `block_size`, `window_size`, `topk`, `dense_len`; missing keys
            take MiniCPM4's values). `use_nope=True` raises NotImplementedError.
        layer_idx (int): this layer's index in the cache.
        route (str, keyword-only): "fused" (default) or "compat" (the module docstring says what each runs).
    """

    def __init__(self, config, layer_idx: int, *, route: str = "fused"):
        super().__init__()
        if route not in ROUTES:
            raise ValueError(f"route must be one of {ROUTES}, got {route!r}")
        self.route = route

        self.config = config
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.scaling = softmax_scale_of(None, self.head_dim)
        self.is_causal = True
        bias = bool(getattr(config, "attention_bias", False))
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        sc = config_from_sparse_config(getattr(config, "sparse_config", None))   # checks the dict
        self.kernel_size, self.kernel_stride = sc.kernel_size, sc.kernel_stride
        self.block_size, self.init_blocks, self.local_blocks = sc.block_size, sc.init_blocks, sc.local_blocks
        self.topk = sc.topk + sc.local_blocks          # HF: sparse_config["topk"] + window_size // block_size
        self.dense_len = sc.dense_len
        # the fused stage-1 kernel's tiling (block 64, fine keys 32/16, coarse keys 128/64)
        self._fusable = (self.block_size, self.kernel_size, self.kernel_stride) == (64, 32, 16)
        self._offsets_memo: dict[tuple, torch.Tensor] = {}

    def _fused(self, x: torch.Tensor) -> bool:
        """Whether the fused route runs for activations like `x`: on CUDA the kernels' dtypes, head dims and
        groups only (elsewhere the references, any shape)."""
        if self.route != "fused" or not self._fusable:
            return False
        return not x.is_cuda or (x.dtype in (torch.bfloat16, torch.float16) and self.head_dim in HEAD_DIMS
                                 and self.num_heads // self.num_kv_heads <= MAX_GROUP)

    def _offsets(self, B: int, n: int, device) -> torch.Tensor:
        """int32 `[0, n, 2n, ..., B n]` on `device` (the varlen offsets of B rows of n tokens), built on the
        device (no host copy) and kept (the `_OFFSETS_KEPT` most recently used): a decode step's query
        offsets repeat at every step, the compressed keys' for 16 and 64 steps."""
        memo, key = self._offsets_memo, (B, n, device)
        cu = memo.pop(key, None)
        if cu is None:
            if len(memo) >= _OFFSETS_KEPT:          # the least recently used goes (dicts keep their order)
                memo.pop(next(iter(memo)))
            cu = torch.arange(B + 1, dtype=torch.int32, device=device) * n
        memo[key] = cu
        return cu

    @staticmethod
    def _cache_lens(B: int, n: int) -> torch.Tensor:
        """The pooling's `cache_lens`, `n` keys before every sequence's queries, as a CPU int32 tensor: the
        lengths are host ints here, and the compat pooling reads a CPU tensor on the host (its output width)
        and copies it to the device without a sync, where a device tensor would cost a read back."""
        return torch.full((B,), n, dtype=torch.int32)

    # -------------------------------------------------------------------------------- compressed keys
    def _compressed_keys(self, cache, k: torch.Tensor, q_len: int) -> _Compressed:
        """ck1/ck2 of `k [B, Lk, H, D]`: the side table's, extended by the windows the new `q_len` keys
        complete; recompressed from scratch when there is none or it does not end where the new keys
        start (MiniCPM4's "is_prefilling" branch: first crossing of dense_len, or a fresh prompt)."""
        B, Lk = k.shape[:2]
        fine = (self.kernel_size, self.kernel_stride)
        coarse = (4 * self.kernel_size, 4 * self.kernel_stride)
        table = None
        if cache is not None:
            table = getattr(cache, _SIDE_TABLE, None)
            if table is None:
                table = {}
                setattr(cache, _SIDE_TABLE, table)
        st = None if table is None else table.get(self.layer_idx)
        if st is None or st.length != Lk - q_len or st.ck1.shape[0] != B:
            kernels = self._fused(k)
            st = _Compressed(_compress(k, *fine, kernels=kernels), _compress(k, *coarse, kernels=kernels), Lk)
        else:
            parts = []
            for ck, (kr, s) in ((st.ck1, fine), (st.ck2, coarse)):
                lo, hi = ck.shape[1], n_windows(Lk, kr, s)
                parts.append(torch.cat([ck, _windows(k, lo, hi, kr, s)], dim=1) if hi > lo else ck)
            st = _Compressed(parts[0], parts[1], Lk)
        if table is not None:
            table[self.layer_idx] = st
        return st

    # ------------------------------------------------------------------------------------ attention
    def _sparse_attention(self, q, k, v, cu_q, cu_k, B, q_len, kv_len, cache):
        """Compress, stage 1, pooling, top-k, varlen sparse attention (HF `compressed_attention` and
        forward)."""
        dev = q.device
        H, D = self.num_kv_heads, self.head_dim
        st = self._compressed_keys(cache, k.view(B, kv_len, H, D), q_len)
        n1, n2 = st.ck1.shape[1], st.ck2.shape[1]
        cu_c1, cu_c2 = self._offsets(B, n1, dev), self._offsets(B, n2, dev)
        with torch.no_grad():
            if self._fused(q):    # scores, pooling and top-k in one kernel: the same topk_idx
                topk_idx = stage1_select(
                    q, st.ck1.reshape(B * n1, H, D), st.ck2.reshape(B * n2, H, D), cu_q, cu_c1, cu_c2, q_len,
                    causal=q_len != 1, cache_lens=[kv_len - q_len] * B, softmax_scale=self.scaling,
                    topk=self.topk - self.local_blocks, local_blocks=self.local_blocks,
                                         init_blocks=self.init_blocks)
                return infllm_v2.infllmv2_attn_varlen_func(q, k, v, cu_q, cu_k, q_len, kv_len,
                                                           softmax_scale=self.scaling, causal=q_len != 1,
                                                           topk_idx=topk_idx)
            score = infllm_v2.infllmv2_attn_stage1(
                q, st.ck1.reshape(B * n1, H, D), st.ck2.reshape(B * n2, H, D), cu_q, cu_c1, cu_c2, q_len, n1,
                softmax_scale=self.scaling, causal=q_len != 1)
            block_score = infllm_v2.max_pooling_1d_varlen(
                score, cu_q, cu_c1, self._cache_lens(B, kv_len - q_len), q_len, n1,
                local_blocks=self.local_blocks, init_blocks=self.init_blocks, block_size=self.block_size,
                stride=self.kernel_stride)
            # K = topk + window_size // block_size best blocks; a query's own block is the last it may
            # select (spec section 6: strict '>')
            if q_len == 1:
                q_idx = torch.full((B,), (kv_len - 1) // self.block_size, dtype=torch.int64, device=dev)
            else:
                q_idx = ((torch.arange(q_len, device=dev) + kv_len - q_len) // self.block_size).repeat(B)
            topk_idx = naive_select_topk(block_score, q_idx, topk=self.topk, local_blocks=0)
        return infllm_v2.infllmv2_attn_varlen_func(q, k, v, cu_q, cu_k, q_len, kv_len,
                                                   softmax_scale=self.scaling,
                                                   causal=q_len != 1, topk_idx=topk_idx)

    def forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None,
                past_key_values=None, cache=None, **kwargs):
        # transformers renamed the decoder layers' `past_key_values` argument to `cache` (5.2x); take either
        cache = cache if cache is not None else past_key_values
        B, q_len, _ = hidden_states.shape
        # the padding check reads the mask's values: once per prefill, never in a decode step (a batch without
        # padding at prefill has none later; generate appends ones), as the backend's attention function
        decode = q_len == 1 and cache is not None
        if attention_mask is not None and (attention_mask.dim() != 2
                                           or (not decode and not bool(attention_mask.all()))):
            raise NotImplementedError("MiniCPM4SparseAttention: attention_mask with padding (or a custom 4-D "
                                      "mask) is not supported; run sequences of equal length per batch "
                                      "without padding")
        if position_embeddings is None:
            raise ValueError("position_embeddings (cos, sin) are required (the model's rotary embedding)")
        HQ, H, D = self.num_heads, self.num_kv_heads, self.head_dim
        q = self.q_proj(hidden_states).view(B, q_len, HQ, D).transpose(1, 2)
        k = self.k_proj(hidden_states).view(B, q_len, H, D).transpose(1, 2)
        v = self.v_proj(hidden_states).view(B, q_len, H, D).transpose(1, 2)
        q, k = _rope(q, k, *position_embeddings)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
            dc = getattr(k, DECODE_CACHE_ATTR, None)
            if dc is not None and self._fused(q):
                # an InfLLMv2Cache: the backend's attention function on its DecodeCache and compressed keys
                out, _ = infllm_cupy_attention(self, q, k, v, None, self.scaling)
                return self.o_proj(out.reshape(B, q_len, HQ * D)), None
            if dc is not None:               # an InfLLMv2Cache's static views: its first L keys are the cache
                L = max(dc.current_lengths(), default=0)
                k, v = k[:, :, :L], v[:, :, :L]
        kv_len = k.shape[2]
        # varlen, unpadded (every row one sequence of the same length)
        q = q.transpose(1, 2).reshape(B * q_len, HQ, D)
        k = k.transpose(1, 2).reshape(B * kv_len, H, D)
        v = v.transpose(1, 2).reshape(B * kv_len, H, D)
        cu_q, cu_k = self._offsets(B, q_len, q.device), self._offsets(B, kv_len, q.device)
        if not uses_dense(self.dense_len, kv_len):           # MiniCPM4: dense_len = -1 means always sparse
            out = self._sparse_attention(q, k, v, cu_q, cu_k, B, q_len, kv_len, cache)
        else:
            out = infllm_v2.infllmv2_attn_varlen_func(q, k, v, cu_q, cu_k, q_len, kv_len,
                                                      softmax_scale=self.scaling, causal=q_len != 1)
        out = self.o_proj(out.reshape(B, q_len, HQ * D))
        return out, None


def use_minicpm4_attention(model: nn.Module, *, route: str = "fused") -> nn.Module:
    """Replace every decoder layer's `self_attn` of a Llama-style HF causal LM (`model.model.layers[i]`)
    by `MiniCPM4SparseAttention(..., route=route)` with the same weights, in place; returns the model.

    Also registers the `infllm_cupy` attention name and selects it, so that the model builds no dense
    attention mask (its mask function gives None, or the padding mask that the layer refuses).
    """
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise TypeError(f"model must be a Llama-style HF causal LM with model.model.layers, got "
                        f"{type(model).__name__}")
    for i, layer in enumerate(layers):
        old = layer.self_attn
        new = MiniCPM4SparseAttention(model.config, getattr(old, "layer_idx", i), route=route)
        new.load_state_dict(old.state_dict())
        layer.self_attn = new.to(device=old.q_proj.weight.device, dtype=old.q_proj.weight.dtype)
    register()
    model.set_attn_implementation(ATTN_NAME)
    return model
