"""The whole InfLLM-v2 decode step over a `DecodeCache` (stage 1 for decode, top-k, sparse decode), and
chunked prefill into the cache. Design: docs/decode.md ("The decode step", "Chunked prefill into the
cache").

`infllmv2_decode` is `naive_infllmv2_decode` (the oracle) on the cache the step keeps: the same
dense/sparse rule (spec section 9: dense while the longest cache, the current token included, is
shorter than `dense_len`), the same stage 1 (non-causal over the complete compressed windows,
`cache_lens = L - 1`, spec section 4.4), the same top-k with forced init and local blocks, then
attention over the selected blocks. CPU tensors run the references, CUDA tensors the kernels
(`stage1` select kernel, `sparse_decode`).
"""
from __future__ import annotations

import torch

from .._checks import check_aligned, check_backend, check_flags, check_softmax_scale, check_tensor
from .._constants import KV_BLOCK
from .._kernel_arg import check_kernel
from .._launch import cdiv, empty
from ..pipeline import (
    InfLLMv2Config,
    check_config,
    check_kernel_path,
    select_blocks,
    stages_for,
    uses_kernels,
)
from ._fast import Launches
from .cache import COMPRESSIONS, DecodeCache, _capturing
from .naive import naive_sparse_decode
from .select_decode import add_select_decode, check_select_inputs, select_decode
from .sparse_decode import (
    WEIGHTS,
    _check_kernel_inputs,
    _sm_count,
    add_sparse_decode,
    check_plan,
    plan_decode,
    sparse_decode,
)


def _check_step_inputs(q, cache, config, weights, backend, kernel) -> InfLLMv2Config:
    """Arguments of `infllmv2_decode`; raises naming the argument. Reads no device values."""
    cfg = check_config(config)
    check_backend(backend)
    check_kernel(kernel)
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {WEIGHTS}, got {weights!r}")
    if not isinstance(cache, DecodeCache):
        raise TypeError(f"cache must be a DecodeCache (the step reads its compressed keys), got "
                        f"{type(cache).__name__}")
    check_tensor("q", q, ndim=3, dtypes=(cache.dtype,), device=cache.device)
    B, HQ, D = q.shape
    if B != cache.batch:
        raise ValueError(f"q has {B} sequences but the cache has {cache.batch}")
    if D != cache.head_dim:
        raise ValueError(f"q has head dim {D} but the cache has {cache.head_dim}")
    if HQ % cache.num_heads:
        raise ValueError(f"q has {HQ} heads, not a multiple of the cache's {cache.num_heads} KV heads")
    _check_compression(cfg)
    lens = cache.lengths()          # host mirror, no device read (not advanced by graph replays)
    if lens and min(lens) < 1 and not _capturing():
        raise ValueError(f"cache: every sequence must hold at least the current token (append it before the "
                         f"step), got lengths {lens[:16]}")
    return cfg


def _check_compression(cfg: InfLLMv2Config) -> None:
    """The cache keeps ck1 32/16 and ck2 128/64 (spec section 3); a config asking for others cannot use
    them."""
    want = ((cfg.kernel_size, cfg.kernel_stride), (cfg.coarse_kernel_size, cfg.coarse_kernel_stride))
    if want != COMPRESSIONS:
        raise ValueError(f"config: the cache keeps compressions (kernel, stride) = {COMPRESSIONS}, the "
                         f"config asks for {want}")


def decode_layout(cache: DecodeCache, exact: bool = False):
    r"""Stage-1 inputs over the cache's own compressed keys, without copying them.

    The cache stores ck1 `[B, N1, H, D]` with sequence b's `n1_b` valid windows first in its row.
    Stage 1 takes packed varlen keys; instead of packing (a copy of every window), sequence b becomes
    two stage-1 sequences: b's query (one row) over windows `[b N1, b N1 + n1_b)` of the flat view,
    then a sequence with no query over the unused rest of the row `[b N1 + n1_b, (b + 1) N1)`, which
    no CTA reads. Every tensor is built on the device from `cache.seqlens` with static shapes (no
    host read, capturable).

    Returns:
        `(cu_seqlens_q, ck1, cu_seqlens_c1, ck2, cu_seqlens_c2, cache_lens)`: int32 `[2B+1]` offsets,
        flat views `[B N, H, D]`, and int32 `[2B]` cached keys before each query (`L_b - 1`; 0 for
        the query-less sequences). `exact`: ck2 and its offsets are ck1's (exact stage 1).
    """
    return layout_of(cache.ck1, cache.ck2, cache.seqlens, exact)


def layout_of(ck1: torch.Tensor, ck2: torch.Tensor, seqlens: torch.Tensor, exact: bool = False):
    """`decode_layout` from the tensors themselves: ck1 `[B, N1, H, D]`, ck2 `[B, N2, H, D]` (32/16 and
    128/64 windows, `n_windows(L_b)` valid ones first), `seqlens int [B]`."""
    B, dev = seqlens.shape[0], seqlens.device
    idx = torch.arange(2 * B + 1, device=dev)
    cu_q = torch.div(idx + 1, 2, rounding_mode="floor").to(torch.int32)         # 0, 1, 1, 2, 2, ...
    out = [cu_q]
    L = seqlens.long()
    for ck, (kr, st) in ((ck1, COMPRESSIONS[0]), (ck2, COMPRESSIONS[1])):
        n = torch.where(L < kr, torch.zeros_like(L), torch.div(L - kr, st, rounding_mode="floor") + 1)
        N = ck.shape[1]
        cu = torch.empty(2 * B + 1, dtype=torch.int32, device=dev)
        cu[0::2] = (torch.arange(B + 1, device=dev) * N).to(torch.int32)        # row starts
        cu[1::2] = cu[0:-1:2] + n.to(torch.int32)                                # end of the valid windows
        out += [ck.reshape(B * N, ck.shape[2], ck.shape[3]), cu]
    if exact:
        out[3], out[4] = out[1], out[2]
    cache_lens = torch.zeros(2 * B, dtype=torch.int32, device=dev)
    cache_lens[0::2] = (seqlens - 1).clamp(min=0).to(torch.int32)
    return (out[0], out[1], out[2], out[3], out[4], cache_lens)


def select_kernel(q, ck1, ck2, seqlens, out_len: int, cfg: InfLLMv2Config, kernel: str, layout=None):
    """Stage 1 for decode on CUDA tensors, `[H, B, K]` with the static `K = min(topk + local_blocks,
    out_len)`. `kernel="auto"`: the split decode kernels (`select_decode`, docs/decode.md "Stage 1 for
    decode: the split kernels"), no host read, capturable. "sm80" / "sm90a": the prefill stage-1 kernel
    of that name through `launch_select` over `layout_of`'s view, one CTA per (sequence, KV head), kept
    as a second implementation to compare against; it sizes its output on `max(cache_lens)` (a host
    read, so not capturable) and is padded here with `-1` to the static K (the same selection)."""
    if cfg.block_size != KV_BLOCK:
        raise ValueError(f"config: block_size must be {KV_BLOCK} for the kernels, got {cfg.block_size}")
    if kernel == "auto":
        return select_decode(q.contiguous(), ck1, ck2, seqlens, out_len, topk=cfg.topk,
                             local_blocks=cfg.local_blocks, init_blocks=cfg.init_blocks,
                             softmax_scale=cfg.softmax_scale, score_dtype=cfg.score_dtype,
                             exact=cfg.exact_stage1)
    from ..stage1.select import launch_select

    cu_q, k1, cu1, k2, cu2, cache_lens = layout if layout is not None else layout_of(ck1, ck2, seqlens,
                                                                                      cfg.exact_stage1)
    idx = launch_select(q.contiguous(), k1, k2, cu_q, cu1, cu2, 1, causal=False, cache_lens=cache_lens,
                        softmax_scale=cfg.softmax_scale, topk=cfg.topk, local_blocks=cfg.local_blocks,
                        init_blocks=cfg.init_blocks, block_size=cfg.block_size, score_dtype=cfg.score_dtype,
                        kernel=kernel)
    K = min(cfg.topk + cfg.local_blocks, out_len)
    return torch.nn.functional.pad(idx, (0, K - idx.shape[2]), value=-1) if idx.shape[2] < K else idx


def decode_select(q: torch.Tensor, cache: DecodeCache, *, config: InfLLMv2Config | None = None,
                  backend: str = "auto", kernel: str = "auto") -> torch.Tensor:
    r"""Stage 1 for decode: `topk_idx int32 [H, B, K]` of one query per sequence over its cache.

    Non-causal scores over the complete compressed windows of each sequence's cache (the cache's
    own ck1/ck2), pooling with the init blocks and the local window ending at block
    `(L_b - 1) // 64` forced, top-K, blocks after the query's own block `-1`. CPU tensors (or
    `backend="reference"`) run `naive_stage1_select`, with `K = min(topk + local_blocks,
    cdiv(max L, 64))` as `naive_infllmv2_decode`; the kernels size K on the cache's width
    (`cdiv(capacity, 64)`) so that shapes stay the same from step to step (extra slots are `-1`).
    `kernel`: "auto" runs the split decode kernels (`select_decode`), "sm80" / "sm90a" the prefill
    stage-1 kernel (`select_kernel`).
    """
    cfg = check_config(config)
    check_backend(backend)
    check_kernel(kernel)
    if uses_kernels(q, backend) and kernel == "auto":
        return select_kernel(q, cache.ck1, cache.ck2, cache.seqlens, cdiv(cache.capacity, cfg.block_size),
                             cfg, kernel)
    lay = decode_layout(cache, exact=cfg.exact_stage1)
    cu_q, ck1, cu_c1, ck2, cu_c2, cache_lens = lay
    if not uses_kernels(q, backend):
        from ..stage1.naive import naive_stage1_select

        return naive_stage1_select(
            q, ck1, ck2, cu_q, cu_c1, cu_c2, 1, causal=False, cache_lens=cache_lens,
            softmax_scale=cfg.softmax_scale, topk=cfg.topk, local_blocks=cfg.local_blocks,
            init_blocks=cfg.init_blocks, block_size=cfg.block_size, kernel_stride=cfg.kernel_stride,
            coarse_kernel_stride=cfg.coarse_kernel_stride, varlen_offset_quirk=cfg.varlen_offset_quirk,
            score_dtype=cfg.score_dtype)
    return select_kernel(q, cache.ck1, cache.ck2, cache.seqlens, cdiv(cache.capacity, cfg.block_size), cfg,
                         kernel, lay)


def infllmv2_decode(q: torch.Tensor, cache: DecodeCache, *, config: InfLLMv2Config | None = None,
                    return_attn_weights: bool = False, weights: str = "per_head", return_lse: bool = False,
                    return_topk_idx: bool = False, backend: str = "auto", kernel: str = "auto"):
    r"""One InfLLM-v2 decode step: the current token's query against its sequence's cache.

    The new token's key and value must already be in the cache (`cache.append(k, v)`; HF's decode
    path, spec section 8). While the longest cache (current token included: HF's `kv_seq_len`,
    `cache.max_len()`, a host value) is shorter than `config.dense_len`, every sequence attends
    densely to its whole cache; from there on, stage 1 picks `K = topk + local_blocks` blocks per
    (sequence, KV head) from the cache's compressed keys (`decode_select`) and attention reads those
    blocks only (`sparse_decode`). Same results as `naive_infllmv2_decode` on the packed cache.

    Args:
        q (torch.Tensor):
            `[B, HQ, D]`, one token per sequence, the cache's dtype and device; heads `h*G ..
            h*G+G-1` on KV head h. Kernels: bf16/fp16, D in {64, 128}, G <= 64.
        cache (DecodeCache):
            Contiguous or paged; compressions 32/16 and 128/64 (the config's must match).
        config (InfLLMv2Config, Optional): Default: MiniCPM4's. Kernels need `block_size = 64`.
        return_attn_weights (bool, Optional): Also return the float32 probabilities over the cache's
            width W (`cache.capacity`), 0 where not selected or past `L_b`: `[B, HQ, W]`
            (`weights="per_head"`) or summed over each group `[B, H, W]` (`"per_kv_head"`).
        return_lse (bool, Optional): Also return lse float32 `[B, HQ]` (natural log).
        return_topk_idx (bool, Optional): Also return the selection `int32 [H, B, K]` (None on the
            dense path).
        backend (str, Optional): "auto" (kernels for CUDA tensors, references for CPU), "kernels"
            or "reference".
        kernel (str, Optional): stage 1 on CUDA tensors: "auto" runs the split decode kernels
            (`select_decode`); "sm80" or "sm90a" the prefill stage-1 kernel of that name with one CTA
            per (sequence, KV head) (slower at long contexts; the same selection).

    Returns:
        out `[B, HQ, D]` in q's dtype, then lse, weights and topk_idx as asked, in that order.

    Host synchronisation on the kernel path: none. The dense/sparse choice reads the cache's host
    mirror of the lengths, the stage-1 layout and `cache_lens` are built on the device, the stage-1
    output is sized on the cache's width and `sparse_decode` reads nothing back, so the step (with
    `cache.append`) captures in a CUDA graph; the graph keeps the path (dense or sparse) it was
    captured on (the op `infllm_cupy::infllmv2_decode` decides on the device instead). The reference
    path reads lengths on the host.

    Eager calls on a CUDA cache (`kernel="auto"`) reuse prepared launches kept on the cache, one set per
    (q shape, config, outputs, path), after the first call's full checks (docs/decode.md, 6); with
    `cache.graphs` they replay a CUDA graph of them.
    """
    if kernel == "auto" and backend in _FAST_BACKENDS and isinstance(cache, DecodeCache) and cache.k.is_cuda:
        fast = _fast_step(q, cache, config, return_attn_weights, weights, return_lse, return_topk_idx)
        if fast is not None:
            return fast
    check_flags(return_attn_weights=return_attn_weights, return_lse=return_lse,
                return_topk_idx=return_topk_idx)
    cfg = _check_step_inputs(q, cache, config, weights, backend, kernel)
    kern = uses_kernels(q, backend)
    topk_idx = None
    if cache.max_len() >= cfg.dense_len:
        topk_idx = decode_select(q, cache, config=cfg, backend=backend, kernel=kernel)
    if kern:
        res = sparse_decode(q, cache, topk_idx, softmax_scale=cfg.softmax_scale, return_lse=return_lse,
                            return_attn_weights=return_attn_weights, weights=weights, backend="kernels")
    else:
        res = naive_sparse_decode(q, cache, topk_idx, softmax_scale=cfg.softmax_scale,
                                  block_size=cfg.block_size, return_lse=return_lse,
                                  return_attn_weights=return_attn_weights, weights=weights)
    res = list(res) if isinstance(res, tuple) else [res]
    if return_topk_idx:
        res.append(topk_idx)
    return res[0] if len(res) == 1 else tuple(res)


# ------------------------------------------------------------------------------ the eager fast path
class StepProgram:
    """One decode step's launches on one cache, prepared (docs/decode.md, 6): built by the first call
    with a given q shape and dtype, config, outputs and path (dense or sparse), after the full checks;
    later calls check only what can change between calls (q's identity-free properties, the lengths)
    and re-point q and the outputs they allocate. Stage-1 and merge scratch belong to the program.

    `run(q, graphs=True)` replays a CUDA graph of the same launches instead, captured at its first
    such call on static copies of q and the outputs (the outputs returned are clones): the same
    kernels on the same plan, so the same bits as the launches."""

    __slots__ = ("config", "graph", "outs", "program", "static")

    def __init__(self, config, program, outs):
        self.config, self.program, self.outs = config, program, outs
        self.graph = self.static = None

    def run(self, q: torch.Tensor, graphs: bool = False) -> dict:
        if graphs:
            return self._replay(q)
        fresh = {name: empty(shape, dtype=dtype, device=q.device)
                 for name, (shape, dtype) in self.outs.items()}
        self.program.run(q=q, **fresh)
        return fresh

    def _replay(self, q: torch.Tensor) -> dict:
        if self.graph is None:
            # the first call runs the launches on the static buffers (loading every kernel), then captures
            static = {name: torch.empty(shape, dtype=dtype, device=q.device)
                      for name, (shape, dtype) in self.outs.items()}
            static["q"] = q.clone()
            self.program.run(**static)
            result = {name: static[name].clone() for name in self.outs}
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.program.run(**static)
            self.graph, self.static = graph, static
            return result
        self.static["q"].copy_(q)
        self.graph.replay()
        return {name: self.static[name].clone() for name in self.outs}


def _fast_step(q, cache: DecodeCache, config, return_attn_weights, weights, return_lse, return_topk_idx):
    """`infllmv2_decode` through a `StepProgram` of the cache, or None where the general path must run
    (not a CUDA tensor of the cache's kind: the general path then raises its error)."""
    if not (type(q) is torch.Tensor and q.is_cuda and q.dim() == 3):
        return None
    if not q.is_contiguous():
        q = q.contiguous()
    if (type(return_attn_weights) is not bool or type(return_lse) is not bool
            or type(return_topk_idx) is not bool):
        return None                                       # the general path names the flag
    if weights not in WEIGHTS or (config is not None and type(config) is not InfLLMv2Config):
        return None
    if q.data_ptr() % 16:
        return None
    if cache._host_stale:
        dense = None        # the mirror lags (captured or compiled appends): the kernels decide on the device
    else:
        lens = cache._host_lens
        if lens and min(lens) < 1:
            return None                                   # the general path raises, naming the lengths
        dense = max(lens, default=0) < (config.dense_len if config is not None else _DEFAULT_DENSE)
    key = (id(config), q.shape, q.dtype, q.get_device(), return_attn_weights, weights, return_lse,
           return_topk_idx, dense)
    entry = cache._step_programs.get(key)
    if entry is None or entry.config is not config:
        entry = _build_step(q, cache, config, return_attn_weights, weights, return_lse, return_topk_idx,
                            dense=dense)
        if len(cache._step_programs) >= _MAX_PROGRAMS:    # a config object per call: keep memory bounded
            cache._step_programs.clear()
        cache._step_programs[key] = entry
    fresh = entry.run(q, cache.graphs)
    res = [fresh["out"]]
    if return_lse:
        res.append(fresh["lse"])
    if return_attn_weights:
        res.append(fresh["weights"])
    if return_topk_idx:
        res.append(fresh.get("topk_idx"))
    return res[0] if len(res) == 1 else tuple(res)


_DEFAULT_DENSE = InfLLMv2Config().dense_len
_FAST_BACKENDS = ("auto", "kernels")
_MAX_PROGRAMS = 32


def _build_step(q, cache, config, return_attn_weights, weights, return_lse, return_topk_idx, *,
                dense: bool | None):
    """A `StepProgram` after every check of the general path (raises as it does)."""
    check_flags(return_attn_weights=return_attn_weights, return_lse=return_lse,
                return_topk_idx=return_topk_idx)
    cfg = _check_step_inputs(q, cache, config, weights, "kernels", "auto")
    if cfg.block_size != KV_BLOCK:
        raise ValueError(f"config: block_size must be {KV_BLOCK} for the kernels, got {cfg.block_size}")
    run, res = step_launches(q, cache.k, cache.v, cache.ck1, cache.ck2, cache.seqlens, cache.block_table,
                             cache.capacity, cfg, dense=dense, return_attn_weights=return_attn_weights,
                             weights=weights)
    out, lse, w, topk_idx = res
    outs = {"out": ((tuple(out.shape)), out.dtype)}
    dyn = {"out": out}
    for name, t, asked in (("lse", lse, return_lse), ("weights", w, return_attn_weights),
                           ("topk_idx", topk_idx, return_topk_idx)):
        if asked and t is not None:
            outs[name] = (tuple(t.shape), t.dtype)
            dyn[name] = t
    return StepProgram(config, run.program(q=q, **dyn), outs)


def step_launches(q, k, v, ck1, ck2, seqlens, block_table, width: int, cfg: InfLLMv2Config, *,
                  dense: bool | None, return_attn_weights: bool = False, weights: str = "per_head"):
    """The launches of one decode step (stage 1 unless dense, then `sparse_decode`) after their checks:
    `(Launches, (out, lse, weights or None, topk_idx or None))`. `dense`: the path, or None to decide
    it on the device from the lengths at every run (spec section 9: stage 1's rows then list every block
    while the longest sequence is shorter than `cfg.dense_len`; what a captured or compiled step runs)."""
    B, HQ, D = q.shape
    H = k.shape[2]
    G = HQ // H
    out_len = cdiv(width, KV_BLOCK)
    run = Launches(q.device)
    topk_idx = None
    if not dense:
        sdt = check_select_inputs(q, ck1, ck2, seqlens, score_dtype=cfg.score_dtype, exact=cfg.exact_stage1)
        topk_idx = add_select_decode(run, q, ck1, ck2, seqlens, out_len, topk=cfg.topk,
                                     local_blocks=cfg.local_blocks,
                                     init_blocks=cfg.init_blocks, softmax_scale=cfg.softmax_scale,
                                     score_dtype=sdt,
                                     exact=cfg.exact_stage1,
                                     dense_len=max(cfg.dense_len, 0) if dense is None else 0)
    _check_kernel_inputs(q, k, v, seqlens, block_table, topk_idx)
    check_aligned(q=q, k_cache=k, v_cache=v)
    scale = check_softmax_scale(cfg.softmax_scale, D)
    n_entries = topk_idx.shape[2] if topk_idx is not None else out_len
    plan = plan_decode(B, H, G, n_entries, _sm_count(q.device.index))
    check_plan(plan, G, n_entries, D, topk_idx.shape[2] if topk_idx is not None else 0)
    out, lse, w = add_sparse_decode(run, q, k, v, seqlens, block_table, width, topk_idx, scale=scale,
                                    plan=plan, return_attn_weights=return_attn_weights, weights=weights)
    return run, (out, lse, w, topk_idx)


def infllmv2_prefill_into_cache(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, cache: DecodeCache,
                                cu_seqlens_new, *, config: InfLLMv2Config | None = None,
                                backend: str = "auto", return_aux: bool = False):
    r"""Chunked prefill: append a chunk of new tokens per sequence, then attend causally over the cache.

    The chunk's keys and values are written to the cache (`cache.append`, which also writes the
    compression windows they complete); then the chunk's queries attend with InfLLM-v2 prefill
    semantics, causal mask aligned bottom-right (query row r of a chunk of `n_b` sees key
    `c <= r + L_b - n_b`), over every key of the sequence: `naive_infllmv2_attention` on the packed
    cache, with the cache's compressed keys instead of recompressing (equal bit for bit on CPU).
    CUDA tensors run stage 1 and the stage-2 kernels (`sparse_attn_varlen` with `cache_lens`), or
    SDPA below `dense_len`.

    Args:
        q (torch.Tensor): `[total_new, HQ, D]` queries of the new tokens, packed like `k_new`.
        k_new, v_new (torch.Tensor): `[total_new, H, D]` in the cache's dtype.
        cache (DecodeCache): the cache to extend.
        cu_seqlens_new (torch.Tensor or list of int): `[B+1]` chunk offsets (a sequence may get 0).
        config (InfLLMv2Config, Optional): Default: MiniCPM4's.
        backend (str, Optional): "auto", "kernels" or "reference".
        return_aux (bool, Optional): Also return the intermediates dict (as `naive_infllmv2_attention`).

    Returns:
        out `[total_new, HQ, D]` (and the aux dict). Packs the cache's keys (a copy of each
        sequence's keys, `cache.packed()`) and reads the lengths on the host: a prefill step, not a
        captured one.
    """
    from ..pipeline import dense_aux

    check_flags(return_aux=return_aux)
    cfg = check_config(config)
    check_backend(backend)
    _check_compression(cfg)
    if not isinstance(cache, DecodeCache):
        raise TypeError(f"cache must be a DecodeCache, got {type(cache).__name__}")
    check_tensor("q", q, ndim=3, dtypes=(cache.dtype,), device=cache.device)
    check_tensor("k_new", k_new, ndim=3)
    if q.shape[0] != k_new.shape[0]:
        raise ValueError(f"q has {q.shape[0]} tokens but k_new has {k_new.shape[0]}")
    if q.shape[2] != cache.head_dim or q.shape[1] % cache.num_heads:
        raise ValueError(f"q must have shape [total_new, a multiple of {cache.num_heads}, {cache.head_dim}], "
                         f"got {tuple(q.shape)}")
    stages = stages_for(q, backend)
    kern = uses_kernels(q, backend)
    before = cache.lengths()
    cache.append(k_new, v_new, cu_seqlens_new)          # checks everything before writing
    after = cache.lengths()
    n_new = [a - b for a, b in zip(after, before)]
    dev = cache.device
    cu_q = _cu(n_new, dev)
    k, v, cu_k = cache.packed()
    max_q, max_k = max(n_new, default=0), max(after, default=0)
    if max_k < cfg.dense_len:
        out = stages["dense_attn"](q, k, v, cu_q, cu_k, causal=True, softmax_scale=cfg.softmax_scale)
        return (out, dense_aux()) if return_aux else out
    if kern:
        check_kernel_path(cfg, q, k, v)
    ck1, cu1, ck2, cu2 = cache.packed_compressed()
    cache_lens = torch.tensor(before, dtype=torch.int32, device=dev)
    aux = select_blocks(stages, q, k, cu_q, cu_k, max_q, cache_lens, True, cfg, ck1=ck1, cu_seqlens_c1=cu1,
                        ck2=ck2, cu_seqlens_c2=cu2, need_scores=return_aux)
    out = stages["sparse_attn"](q, k, v, cu_q, cu_k, aux["topk_idx"], max_q, max_k, causal=True,
                                softmax_scale=cfg.softmax_scale, block_size=cfg.block_size)
    return (out, dict(dense=False, **aux)) if return_aux else out


def _cu(lengths, device) -> torch.Tensor:
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    if lengths:
        cu[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0).to(torch.int32)
    return cu.to(device)
