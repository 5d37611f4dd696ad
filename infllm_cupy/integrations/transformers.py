"""InfLLM-v2 sparse attention behind Hugging Face transformers' `attn_implementation` switch.

    from infllm_cupy.integrations.transformers import register, InfLLMv2Cache
    register()                                                   # once per process
    model = LlamaForCausalLM(config).to("cuda")                  # or from_pretrained(..., attn_implementation=...)
    model.set_attn_implementation("infllm_cupy")                 # or config._attn_implementation / the kwarg
    model.generate(ids, past_key_values=InfLLMv2Cache(model.config, max_cache_len=65536), ...)

How HF's calls map onto our ops (docs/integrations.md, "How the backend maps HF's calls"):
  * a call with several query tokens (prefill, or a chunk after a cache) runs the prefill pipeline
    (`infllmv2_attention_host_lengths`: the lengths given on the host, so no sync): dense causal
    attention while the keys are shorter than `dense_len`, else compression (an InfLLMv2Cache's
    compressed keys instead), stage 1, top-k and stage-2 sparse attention, causal mask aligned bottom-right;
  * a one-token call (decode) runs `infllmv2_decode`: on the `DecodeCache` of an `InfLLMv2Cache` (its
    compressed keys kept up to date at every append), or, with any other HF cache, on a DecodeCache built
    from the keys at every step (same results; a copy and a recompression per step and layer).

Where the compressed keys live (docs/integrations.md, "The cache"): HF's attention function is handed
the key/value tensors the cache returned, not the cache object, so a side table keyed by `layer_idx`
on the cache would be out of the function's reach without changing the model's code. Instead
`InfLLMv2Cache` is a `DynamicCache` whose layers store K/V in a `DecodeCache` (preallocated to
`max_cache_len`, compressed keys appended with the keys) and return views of it; the view carries
its `DecodeCache` as an attribute, which the attention function reads. The model code is untouched
and any HF cache still works (more slowly at decode).

The sparse hyper-parameters come from the model config's `sparse_config` dict, MiniCPM4's format
(`kernel_size`, `kernel_stride`, `init_blocks`, `block_size`, `window_size`, `topk`, `use_nope`,
`dense_len`); without one, MiniCPM4's defaults (`InfLLMv2Config()`).
"""  # noqa: E501 - verbatim commands, signatures and tables
from __future__ import annotations

import contextlib
import dataclasses
import functools
import numbers

import torch

from .._rules import COMPRESSIONS, check_backend, check_precision, n_windows, runs_kernels, uses_dense
from ..config import InfLLMv2Config
from ..decode import DecodeCache, infllmv2_decode
from ..decode.cache import h2d
from ..pipeline import infllmv2_attention_host_lengths

# InfLLMv2Cache and InfLLMv2CacheLayer come from the module's __getattr__ (transformers imported on first
# use).
__all__ = ["ATTN_NAME", "InfLLMv2Cache", "InfLLMv2CacheLayer", "config_from_sparse_config",  # noqa: F822
           "infllm_cupy_attention", "register"]

ATTN_NAME = "infllm_cupy"
# Attribute of the key view an `InfLLMv2CacheLayer` returns: its DecodeCache (see the module docstring).
DECODE_CACHE_ATTR = "_infllm_cupy_decode_cache"
_CONFIG_MEMO = "_infllm_cupy_cfg"     # on an attention module: its sparse_config and the config made of it
SPARSE_CONFIG_KEYS = ("kernel_size", "kernel_stride", "init_blocks", "block_size", "window_size", "topk",
                      "use_nope", "dense_len")


def _transformers():
    try:
        import transformers
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError('infllm_cupy.integrations.transformers needs transformers: pip install -e '
                          '".[hf]"') from e
    return transformers


# ------------------------------------------------------------------------------------------ config
def config_from_sparse_config(sparse_config: dict | None, *,
                              softmax_scale: float | None = None) -> InfLLMv2Config:
    """MiniCPM4's `sparse_config` dict (HF config attribute) -> `InfLLMv2Config`.

    `window_size // block_size` is `local_blocks`; the coarse compression is 4x the fine one (MiniCPM4's
    `CompressK(kernel_size * 4, kernel_stride * 4)`). `use_nope=True` (stage 1 on pre-RoPE keys) is not
    supported: the attention function only sees post-RoPE keys. None gives MiniCPM4's defaults.
    """
    if sparse_config is None:
        sparse_config = {}
    if not isinstance(sparse_config, dict):
        raise TypeError("sparse_config must be a dict (MiniCPM4's format) or None, got "
                        f"{type(sparse_config).__name__}")
    unknown = sorted(set(sparse_config) - set(SPARSE_CONFIG_KEYS))
    if unknown:
        raise ValueError(f"sparse_config: unknown key(s) {unknown}; expected some of "
                         f"{list(SPARSE_CONFIG_KEYS)}")
    use_nope = sparse_config.get("use_nope", False)
    if not isinstance(use_nope, bool):
        raise TypeError(f"sparse_config['use_nope'] must be a bool, got {type(use_nope).__name__} "
                        f"{use_nope!r}")
    if use_nope:
        raise NotImplementedError("sparse_config: use_nope=True (stage 1 on pre-RoPE keys) is not supported; "
                                  "the attention function receives post-RoPE keys only")
    d = InfLLMv2Config()

    def entry(key: str, default: int, minimum: int) -> int:
        # an int as MiniCPM4's code uses it (a range, a slice, torch.topk's k): 2.7 or "8" is refused, not
        # truncated or parsed by int()
        val = sparse_config.get(key, default)
        if isinstance(val, bool) or not isinstance(val, numbers.Integral):
            raise TypeError(f"sparse_config['{key}'] must be an int, got {type(val).__name__} {val!r}")
        if val < minimum:
            raise ValueError(f"sparse_config['{key}'] must be >= {minimum}, got {val}")
        return int(val)

    block = entry("block_size", d.block_size, 1)
    window = entry("window_size", d.local_blocks * block, 0)
    if window % block:
        raise ValueError(f"sparse_config: window_size ({window}) must be a multiple of block_size ({block})")
    ks = entry("kernel_size", d.kernel_size, 1)
    st = entry("kernel_stride", d.kernel_stride, 1)
    return InfLLMv2Config(kernel_size=ks, kernel_stride=st, coarse_kernel_size=4 * ks,
                          coarse_kernel_stride=4 * st,
                          block_size=block, topk=entry("topk", d.topk, 0),
                          local_blocks=window // block,
                          init_blocks=entry("init_blocks", d.init_blocks, 0),
                          dense_len=entry("dense_len", d.dense_len, -1),
                          softmax_scale=softmax_scale)


def _config_of(module, scaling) -> InfLLMv2Config:
    """The module's InfLLMv2Config, converted once per (sparse_config, scaling) and kept on the module
    (the memo is checked by identity of the config dict first: a decode step pays one comparison)."""
    sc = getattr(getattr(module, "config", None), "sparse_config", None)
    memo = getattr(module, _CONFIG_MEMO, None)
    if memo is not None and memo[0] is sc and memo[1] == scaling and memo[2] == sc:   # same dict, unchanged
        return memo[3]
    cfg = config_from_sparse_config(sc, softmax_scale=None if scaling is None else float(scaling))
    with contextlib.suppress(AttributeError):   # a module that refuses attributes: convert every call
        setattr(module, _CONFIG_MEMO, (sc, scaling, sc.copy() if isinstance(sc, dict) else sc, cfg))
    return cfg


# --------------------------------------------------------------------------------------- attention
def _check_padding(attention_mask) -> None:
    # The mask function registered with us (FlashAttention's) returns None unless a row has padding or the
    # keys are static (an InfLLMv2Cache's); a 4-D mask is a custom one we cannot honour.
    if attention_mask is not None and (attention_mask.dim() != 2 or not bool(attention_mask.all())):
        raise NotImplementedError(
            "infllm_cupy attention: attention_mask with padding (left- or right-padded batches) or a custom "
            f"{attention_mask.dim()}-D mask is not supported; run sequences of equal length per batch "
            "(e.g. batch 1) without padding")


def _check_unsupported(module, attention_mask, dropout, kwargs) -> None:
    if dropout:
        raise NotImplementedError(f"infllm_cupy attention: dropout={dropout!r} is not supported (eval mode, "
                                  f"or attention_dropout=0)")
    for name in ("sliding_window", "softcap", "s_aux"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"infllm_cupy attention: {name}={kwargs[name]!r} is not supported")
    for name in ("cu_seq_lens_q", "cu_seq_lens_k"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"infllm_cupy attention: {name} (packed sequences in one row) is not "
                                      f"supported; pass one sequence per batch row")
    if getattr(module, "is_causal", True) is False or kwargs.get("is_causal", True) is False:
        raise NotImplementedError("infllm_cupy attention: is_causal=False (bidirectional attention) is not "
                                  "supported; InfLLM-v2 is causal")
    if not torch.compiler.is_compiling():     # traced: the prefill op checks the mask's values
        _check_padding(attention_mask)


def infllm_cupy_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                          value: torch.Tensor,
                          attention_mask: torch.Tensor | None, scaling: float | None = None,
                          dropout: float = 0.0, *, backend: str = "auto", precision: str | None = None,
                          **kwargs):
    """HF attention function: `query [B, HQ, Lq, D]`, `key`/`value [B, H, Lk, D]` (the cache's keys,
    current ones included) -> `([B, Lq, HQ, D], None)`.

    Every sequence of the batch has the same length (no padding). With an `InfLLMv2Cache` (whose key
    view spans the whole preallocated cache and carries its `DecodeCache`): `Lq == 1` runs
    `infllmv2_decode` on it (inside torch.compile through its custom op, which decides dense or sparse on
    the device and honours `backend`), `Lq > 1` the prefill pipeline over its first `L` keys. With
    another HF cache: `Lq > 1` runs the prefill pipeline (`infllmv2_attention_host_lengths`, the first
    `Lk - Lq` keys as the cache, causal bottom-right), `Lq == 1` `infllmv2_decode` on a `DecodeCache`
    built from the keys at every step. Attention weights are not returned (None). `precision`: the
    prefill's stage-2 plan in place of the config's ("16bit" or "int8-fp8", `register`'s); decode
    steps stay in 16 bits.
    """
    cache = getattr(key, DECODE_CACHE_ATTR, None)
    if query.dim() != 4 or key.dim() != 4 or value.shape != key.shape:
        raise ValueError(f"query must be [B, HQ, Lq, D] and key/value [B, H, Lk, D] of one shape, got "
                         f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
    _B, _HQ, Lq, _D = query.shape
    decode = Lq == 1 and cache is not None
    # the padding check reads the mask's values: once per prefill, never in a decode step (a batch
    # without padding at prefill has none later; generate appends ones)
    _check_unsupported(module, None if decode else attention_mask, dropout, kwargs)
    cfg = _config_of(module, scaling)
    if precision is not None and check_precision(precision) != cfg.precision:
        cfg = dataclasses.replace(cfg, precision=precision)
    if decode:
        # eager: the step's prepared launches; under torch.compile the step's op (dense or sparse decided
        # on the device, `backend` honoured)
        out = infllmv2_decode(query[:, :, 0], cache, config=cfg, backend=backend)
        return out.unsqueeze(1), None
    ck1 = ck2 = None
    if cache is not None:
        # compiled or captured steps advance the device lengths only: the mirror is refreshed where it lags
        Lk = max(cache.current_lengths(), default=0)
        if cache.is_fp8:
            # the layer's views hold e4m3 bytes: attend over the pages as the references read them
            key, value = (t.transpose(1, 2) for t in cache.dequantized())
        key, value = key[:, :, :Lk], value[:, :, :Lk]
        if _cache_compression_matches(cfg):
            ck1, ck2 = cache.ck1, cache.ck2
    elif (attention_mask is not None and attention_mask.dim() == 2
          and attention_mask.shape[-1] != key.shape[2]):
        raise NotImplementedError(
            f"infllm_cupy attention: the keys span {key.shape[2]} positions but the attention mask "
            f"{attention_mask.shape[-1]} (a static cache that is not an InfLLMv2Cache, e.g. StaticCache); "
            "use InfLLMv2Cache")
    if Lq > key.shape[2]:
        raise ValueError(f"query has {Lq} tokens but key only {key.shape[2]}: the keys must include the "
                         "queries' own")
    if Lq == 1 and cache is None:
        return _decode_on_keys(query, key, value, cfg, backend), None
    grad = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)
    if torch.compiler.is_compiling() and not grad:
        # one opaque op: dynamo traces none of the pipeline's host-driven code (lengths, plans, launches).
        # With gradients (training) the pipeline is traced as before: its stage-2 ops carry the backward.
        return torch.ops.infllm_cupy.infllmv2_prefill(
            query, key, value, ck1, ck2, attention_mask, cfg.kernel_size, cfg.kernel_stride,
                                                      cfg.coarse_kernel_size,
            cfg.coarse_kernel_stride, cfg.block_size, cfg.topk, cfg.local_blocks, cfg.init_blocks,
                                                      cfg.dense_len,
            cfg.exact_stage1, cfg.varlen_offset_quirk, cfg.softmax_scale, cfg.score_dtype, backend,
            cfg.precision), None
    return prefill_attention(query, key, value, ck1, ck2, cfg, backend), None


def _decode_on_keys(query, key, value, cfg, backend):
    """Decode with another HF cache: decode semantics (non-causal stage 1 over the cache, spec section 8)
    need a DecodeCache; build one from the keys (a copy and a recompression per step and layer). The
    prefill pipeline on one query would run the causal stage 1 of chunked prefill, which can pick other
    blocks."""
    B, _HQ, _, D = query.shape
    H, Lk = key.shape[1], key.shape[2]
    k = key.transpose(1, 2).reshape(B * Lk, H, D)
    v = value.transpose(1, 2).reshape(B * Lk, H, D)
    dc = DecodeCache.contiguous(B, Lk, H, D, dtype=key.dtype, device=key.device)
    dc.append(k, v, [b * Lk for b in range(B + 1)])
    return infllmv2_decode(query[:, :, 0].contiguous(), dc, config=cfg, backend=backend).unsqueeze(1)


def prefill_attention(query, key, value, ck1, ck2, cfg: InfLLMv2Config,
                      backend: str = "auto") -> torch.Tensor:
    """The attention function's prefill (`Lq > 1`, every row the same length): `query [B, HQ, Lq, D]`,
    `key`/`value [B, H, Lk, D]` (the cache first, the queries' own keys last) -> `[B, Lq, HQ, D]`.
    `ck1`/`ck2`: an InfLLMv2Cache's compressed keys `[B, N, H, D]` (the first windows of each row valid
    for Lk keys), or None to compress here. The op `infllm_cupy::infllmv2_prefill` runs it inside
    torch.compile."""
    B, HQ, Lq, D = query.shape
    H, Lk = key.shape[1], key.shape[2]
    if (Lq == Lk and uses_dense(cfg.dense_len, Lk) and runs_kernels(query, backend)
            and cfg.precision == "16bit"):
        # The pipeline's dense branch on the kernel path is torch SDPA per sequence (causal, GQA); rows
        # of equal length make it one SDPA call on HF's own layout: no packing, no host reads. (The
        # 8-bit plan goes through the pipeline, which refuses CUDA tensors until its kernels are verified.)
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True,
                                                               scale=cfg.softmax_scale, enable_gqa=True)
        return out.transpose(1, 2).contiguous()
    # packed varlen: a view for batch 1 (an InfLLMv2Cache's storage row), a copy otherwise
    k = key.transpose(1, 2).reshape(B * Lk, H, D)
    v = value.transpose(1, 2).reshape(B * Lk, H, D)
    q = query.transpose(1, 2).reshape(B * Lq, HQ, D)
    steps = torch.arange(B + 1, dtype=torch.int32)
    # Lengths are known here (no padding), so the pipeline reads nothing back from the device; an
    # InfLLMv2Cache already compressed these keys at `update` (docs/integrations.md, "The cache"),
    # so the pipeline does not compress them a second time.
    compressed = None
    if ck1 is not None and not uses_dense(cfg.dense_len, Lk):
        compressed = []
        for ck, (kr, st) in zip((ck1, ck2), COMPRESSIONS):
            n = n_windows(Lk, kr, st)
            compressed += [ck[:, :n].reshape(B * n, H, D), h2d(steps * n, query.device)]
    out = infllmv2_attention_host_lengths(q, k, v, h2d(steps * Lq, query.device),
                                          h2d(steps * Lk, query.device),
                                          [Lq] * B, [Lk] * B, cfg, backend=backend,
                                          compressed=None if compressed is None else tuple(compressed))
    return out.view(B, Lq, HQ, D)


@torch.library.custom_op("infllm_cupy::infllmv2_prefill", mutates_args=())
def _prefill_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, ck1: torch.Tensor | None,
                ck2: torch.Tensor | None, attention_mask: torch.Tensor | None, kernel_size: int,
                kernel_stride: int,
                coarse_kernel_size: int, coarse_kernel_stride: int, block_size: int, topk: int,
                local_blocks: int, init_blocks: int,
                dense_len: int, exact_stage1: bool, varlen_offset_quirk: bool, softmax_scale: float | None,
                score_dtype: torch.dtype, backend: str, precision: str) -> torch.Tensor:
    """`prefill_attention` as an op (any device: CUDA tensors run the kernels, CPU tensors the CPU paths,
    `backend="reference"` the references), after the padding check on `attention_mask`."""
    _check_padding(attention_mask)
    cfg = InfLLMv2Config(kernel_size=kernel_size, kernel_stride=kernel_stride,
                         coarse_kernel_size=coarse_kernel_size,
                         coarse_kernel_stride=coarse_kernel_stride, block_size=block_size, topk=topk,
                         local_blocks=local_blocks, init_blocks=init_blocks, dense_len=dense_len,
                         exact_stage1=exact_stage1, varlen_offset_quirk=varlen_offset_quirk,
                         softmax_scale=softmax_scale, score_dtype=score_dtype, precision=precision)
    return prefill_attention(query, key, value, ck1, ck2, cfg, backend)


@_prefill_op.register_fake
def _(query, key, value, ck1, ck2, attention_mask, *args):
    B, HQ, Lq, D = query.shape
    return query.new_empty((B, Lq, HQ, D))


def _cache_compression_matches(cfg: InfLLMv2Config) -> bool:
    """Whether a DecodeCache's compressed keys (fixed kernel/stride pairs) are the config's."""
    return ((cfg.kernel_size, cfg.kernel_stride),
            (cfg.coarse_kernel_size, cfg.coarse_kernel_stride)) == COMPRESSIONS


def register(name: str = ATTN_NAME, *, backend: str = "auto", precision: str | None = None) -> str:
    """Register the attention function (and FlashAttention's mask function, which gives None or the 2-D
    padding mask) under `name` in transformers' `AttentionInterface` / `AttentionMaskInterface`.

    After this, `attn_implementation=name` (from_pretrained, the config, `set_attn_implementation`) runs
    InfLLM-v2. `backend` ("auto", "kernels", "reference") is passed to our ops; `precision` ("16bit" or
    "int8-fp8", `InfLLMv2Config`), when given, replaces the config's plan for the prefill's stage 2.
    Idempotent; returns `name`.
    """
    check_backend(backend)
    if precision is not None:
        check_precision(precision)
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty str, got {name!r}")
    _transformers()
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    given = {k: v for k, v in (("backend", backend), ("precision", precision))
             if v is not None and not (k == "backend" and v == "auto")}
    fn = functools.partial(infllm_cupy_attention, **given) if given else infllm_cupy_attention
    AttentionInterface.register(name, fn)
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS["flash_attention_2"])
    return name


# ------------------------------------------------------------------------------------------- cache
def _make_classes():
    _transformers()
    from transformers.cache_utils import Cache, StaticLayer

    class InfLLMv2CacheLayer(StaticLayer):
        """One layer's K/V in a `DecodeCache` (contiguous `[B, max_cache_len, H, D]`, compressed keys kept
        at every append). Static shapes, as transformers' `StaticLayer`: `update` returns `[B, H,
        max_cache_len, D]` views of the whole storage, tagged with the DecodeCache (the attention
        function reads the valid length from it), so a compiled decode step sees the same tensors at
        every step."""

        def __init__(self, max_cache_len: int, kv_dtype=None, **kwargs):
            if isinstance(max_cache_len, bool) or not isinstance(max_cache_len, int) or max_cache_len < 1:
                raise ValueError(f"max_cache_len must be a positive int, got {max_cache_len!r}")
            if kv_dtype is not None and kv_dtype is not torch.float8_e4m3fn:
                raise ValueError(f"kv_dtype must be None (the model's dtype) or torch.float8_e4m3fn, got "
                                 f"{kv_dtype!r}")
            super().__init__(max_cache_len, **kwargs)
            self.decode_cache: DecodeCache | None = None
            self.decode_graphs = False
            self.kv_dtype = kv_dtype

        def lazy_initialization(self, key_states, value_states, *args, **kwargs) -> None:
            B, H, _, D = key_states.shape
            self.device = key_states.device
            c = DecodeCache.contiguous(B, self.max_cache_len, H, D, dtype=key_states.dtype,
                                       device=key_states.device, kv_dtype=self.kv_dtype)
            c.graphs = self.decode_graphs
            self.decode_cache = c
            self.keys = c.k.transpose(1, 2)
            self.values = c.v.transpose(1, 2)
            setattr(self.keys, DECODE_CACHE_ATTR, c)
            if not torch.compiler.is_compiling():
                # fixed addresses: a compiled step's CUDA graph reads and writes them in place
                fp8 = c.fp8_tensors() or ()
                for t in (c.k, c.v, c.ck1, c.ck2, c.seqlens, self.keys, self.values, *fp8):
                    torch._dynamo.mark_static_address(t)
            self.is_initialized = True

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            c = self.decode_cache
            B, H, n, D = key_states.shape
            if (B, H, D) != (c.batch, c.num_heads, c.head_dim) or key_states.dtype != c.dtype:
                raise ValueError(f"key_states: [B, H, n, D] = {tuple(key_states.shape)} {key_states.dtype} "
                                 f"does not match this cache's batch {c.batch}, {c.num_heads} heads, head "
                                 f"dim {c.head_dim}, {c.dtype}")
            k = key_states.transpose(1, 2)
            v = value_states.transpose(1, 2)
            if n == 1:
                if not torch.compiler.is_compiling() and c.lengths_in_sync:
                    self._check_room(1)
                c.append(k.reshape(B, H, D), v.reshape(B, H, D))
            else:
                c.current_lengths()
                self._check_room(n)
                c.append(k.reshape(B * n, H, D), v.reshape(B * n, H, D), [b * n for b in range(B + 1)])
            return self.keys, self.values

        def _check_room(self, n: int) -> None:
            L = self.decode_cache.max_len()
            if L + n > self.max_cache_len:
                raise ValueError(f"max_cache_len: the cache holds {L} tokens and cannot take {n} more "
                                 f"(max_cache_len = {self.max_cache_len}); build InfLLMv2Cache with a larger "
                                 "one")

        def get_seq_length(self):
            """Tokens held: a host int while the host mirror is current (eager), else (inside torch.compile,
            or after compiled steps) the first sequence's device length, as StaticLayer's."""
            if not self.is_initialized:
                return 0
            c = self.decode_cache
            if torch.compiler.is_compiling() or not c.lengths_in_sync:
                return c.seqlens[0]
            return c.max_len()

        def reset(self) -> None:
            if self.is_initialized:
                self.decode_cache.reset()

        def crop(self, tokens_to_remove: int) -> None:
            if not self.is_initialized or tokens_to_remove == 0:
                return
            c = self.decode_cache
            L = max(c.current_lengths(), default=0)
            keep = L - abs(tokens_to_remove) if tokens_to_remove < 0 else tokens_to_remove
            c.reset([max(keep, 0)] * c.batch)

        def _unsupported(self, *args, **kwargs):
            raise NotImplementedError("InfLLMv2Cache: reordering, repeating, selecting batch rows and "
                                      "offloading are not supported (beam search, contrastive search); use "
                                      "greedy or sampling")

        reorder_cache = batch_repeat_interleave = batch_select_indices = offload = prefetch = _unsupported

    class InfLLMv2Cache(Cache):
        """A static cache whose layers keep K/V and InfLLM-v2's compressed keys in `DecodeCache`s, so that
        decode runs `infllmv2_decode` (stage 1 on the compressed cache, sparse split-KV attention) instead of
        re-reading every key. Contiguous, preallocated to `max_cache_len` tokens per sequence; batch and
        dtype are fixed by the first update. Compileable, as transformers' StaticCache: `generate` on a
        GPU compiles its decode steps (`generation_config.disable_compile=True` keeps them eager), and
        `torch.compile(model.forward, mode="reduce-overhead")` captures them in CUDA graphs.

        Args:
            config: the model config (its decoder's `num_hidden_layers` sets the layer count), or None with
                `num_layers`.
            max_cache_len (int): tokens per sequence (prompt and generated).
            num_layers (int, Optional): layer count when `config` is None.
            decode_graphs (bool, Optional): eager decode steps replay a CUDA graph of each layer's
                attention, captured at its first step (per path, dense or sparse): for callers that do not
                compile (`DecodeCache.graphs`). Default: False.
            kv_dtype (torch.dtype, Optional): the K/V storage, `DecodeCache`'s: None (the model's dtype)
                or `torch.float8_e4m3fn` (docs/decode.md §16; on CUDA tensors the decode kernels refuse it
                until verified on hardware: `register(backend="reference")`). Default: None.
        """

        def __init__(self, config=None, *, max_cache_len: int, num_layers: int | None = None,
                     decode_graphs: bool = False, kv_dtype=None):
            if num_layers is None:
                if config is None:
                    raise ValueError("InfLLMv2Cache needs config or num_layers")
                num_layers = config.get_text_config(decoder=True).num_hidden_layers
            if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
                raise ValueError(f"num_layers must be a positive int, got {num_layers!r}")
            if not isinstance(decode_graphs, bool):
                raise TypeError(f"decode_graphs must be a bool, got {decode_graphs!r}")
            layers = [InfLLMv2CacheLayer(max_cache_len, kv_dtype) for _ in range(num_layers)]
            for layer in layers:
                layer.decode_graphs = decode_graphs
            Cache.__init__(self, layers=layers)

        def decode_caches(self) -> list:
            """The layers' DecodeCache objects (None for a layer not yet written)."""
            return [layer.decode_cache for layer in self.layers]

    return InfLLMv2CacheLayer, InfLLMv2Cache


@functools.cache
def _classes():
    return _make_classes()


def __getattr__(name):
    # The cache classes subclass transformers' and are built on first access, so that importing this
    # module (and the package) never needs transformers.
    if name == "InfLLMv2CacheLayer":
        return _classes()[0]
    if name == "InfLLMv2Cache":
        return _classes()[1]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
