"""The whole InfLLM-v2 decode step over a `DecodeCache` (stage 1 for decode, top-k, sparse decode), and
chunked prefill into the cache. Design: docs/decode.md ("The decode step", "Chunked prefill into the
cache").

`infllmv2_decode` is `naive_infllmv2_decode` (the oracle) on the cache the step keeps: the same
dense/sparse rule (spec section 9: dense while the longest cache, the current token included, is
shorter than `dense_len`), the same stage 1 (non-causal over the complete compressed windows,
`cache_lens = L - 1`, spec section 4.4), the same top-k with forced init and local blocks, then
attention over the selected blocks. CPU tensors run the references, CUDA tensors the kernels
(the split stage-1 decode kernels, `sparse_decode`). `decode_select` and the ops' `decode_step` share
this module's checks, dense/sparse rule and stage 1 (docs/decode.md, "The decode step").
"""
from __future__ import annotations

import torch

from .._checks import HostSeqlens, check_aligned, check_flags, check_softmax_scale, check_tensor
from .._kernel_arg import KERNELS, SM90A, check_kernel
from .._launch import Launches, empty
from .._rules import (
    COMPRESSIONS,
    KV_BLOCK,
    cdiv,
    check_backend,
    n_windows_of,
    runs_kernels,
    selection_slots,
    uses_dense,
)
from ..config import InfLLMv2Config, check_config
from ..prefill import prefill
from ..stage1 import naive_stage1_select, stage1_select
from .cache import DecodeCache, capturing
from .naive import sparse_decode_checked
from .select_decode import add_select_decode, check_select_inputs, select_decode
from .sparse_decode import (
    WEIGHTS,
    add_sparse_decode,
    check_decode_kernel_inputs,
    check_plan,
    plan_decode,
    sm_count,
)

STAGE1 = ("decode", "prefill")   # the `stage1=` argument: which stage-1 kernel runs on CUDA tensors


def check_stage1(stage1, kernel) -> None:
    """`stage1` must be one of `STAGE1` and `kernel` (the kernel generation, as in every op:
    `_kernel_arg`) one that exists for it. The decode kernels (stage 1 for decode, `sparse_decode`)
    are mma.sync kernels with no sm_90a form, so "sm90a" needs `stage1="prefill"` (the prefill
    stage-1 kernel, which has one)."""
    check_kernel(kernel)
    if not isinstance(stage1, str) or stage1 not in STAGE1:
        hint = (" (the kernel generation is `kernel=`; stage1='prefill' runs the prefill stage-1 kernel)"
                if isinstance(stage1, str) and stage1 in KERNELS else "")
        raise ValueError(f"stage1 must be one of {STAGE1}, got {stage1!r}{hint}")
    if kernel == SM90A and stage1 == "decode":
        raise ValueError("kernel='sm90a': the decode kernels (stage 1 for decode, sparse_decode) have no "
                         "sm_90a form (their mma.sync kernels run on every GPU from capability 8.0, the "
                         "H100 included); pass kernel='auto' or 'sm80', or stage1='prefill' for stage 1 "
                         "on the prefill stage-1 kernel's sm_90a form")


def _check_select_args(q, cache, config, backend, kernel, stage1) -> tuple[InfLLMv2Config, bool]:
    """Arguments of `decode_select` (and of the step): raises naming the argument; reads no device
    values. Returns the config and whether the kernels run (`runs_kernels`)."""
    cfg = check_config(config)
    check_backend(backend)
    check_stage1(stage1, kernel)
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
    return cfg, runs_kernels(q, backend)


def check_step_inputs(q, cache, config, weights, backend, kernel,
                      stage1="decode") -> tuple[InfLLMv2Config, bool]:
    """Arguments of `infllmv2_decode` and `decode_step`, checked once per call (what runs below takes
    them as checked); raises naming the argument. Reads no device values. Returns the config and
    whether the kernels run."""
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {WEIGHTS}, got {weights!r}")
    cfg, kern = _check_select_args(q, cache, config, backend, kernel, stage1)
    lens = cache.lengths()          # host mirror, no device read (not advanced by graph replays)
    if lens and min(lens) < 1 and not capturing():
        raise ValueError(f"cache: every sequence must hold at least the current token (append it before the "
                         f"step), got lengths {lens[:16]}")
    return cfg, kern


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
        n = n_windows_of(L, kr, st)
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


def select_on_cache(q, ck1, ck2, seqlens, width: int, cfg: InfLLMv2Config, *, kern: bool,
                    stage1: str = "decode", kernel: str = "auto", static_k: bool = True) -> torch.Tensor:
    """Stage 1 for decode over the cache's compressed keys (`ck1 [B, N1, H, D]`, `ck2 [B, N2, H, D]`,
    `seqlens int32 [B]`, `width` its positions per sequence), `topk_idx int32 [H, B, K]`, on arguments
    checked by the caller (`check_stage1` among them): the one implementation of `decode_select`, the
    step's selection and the `decode_select` op.

    `kern` (CUDA tensors): `stage1="decode"` runs the split decode kernels (`select_decode`, docs/decode.md
    "Stage 1 for decode: the split kernels"), no host read, capturable; `stage1="prefill"` the prefill
    stage-1 kernel of generation `kernel` through `launch_select` over `layout_of`'s view, one CTA per
    (sequence, KV head), kept as a second implementation to compare against (it sizes its output on
    `max(cache_lens)`, a host read, so not capturable). Both launchers check the tensors for their
    kernels. K is static, `min(topk + local_blocks, cdiv(width, 64))`, padded with -1 (the same
    selection).

    Otherwise the reference (`naive_stage1_select` over `layout_of`'s view, without its checks: the
    caller checked q against the keys, and the view is built here), K sized on the longest sequence as
    `naive_infllmv2_decode`, or padded with -1 to the static K with `static_k`.
    """
    K = selection_slots(cfg.topk, cfg.local_blocks, cdiv(width, cfg.block_size))
    if kern:
        if cfg.block_size != KV_BLOCK:
            raise ValueError(f"config: block_size must be {KV_BLOCK} for the kernels, got {cfg.block_size}")
        if stage1 == "decode":
            return select_decode(q.contiguous(), ck1, ck2, seqlens, cdiv(width, KV_BLOCK), topk=cfg.topk,
                                 local_blocks=cfg.local_blocks, init_blocks=cfg.init_blocks,
                                 softmax_scale=cfg.softmax_scale, score_dtype=cfg.score_dtype,
                                 exact=cfg.exact_stage1)
    cu_q, k1, cu1, k2, cu2, cache_lens = layout_of(ck1, ck2, seqlens, cfg.exact_stage1)
    if kern:
        idx = stage1_select(q.contiguous(), k1, k2, cu_q, cu1, cu2, 1, causal=False, cache_lens=cache_lens,
                            softmax_scale=cfg.softmax_scale, topk=cfg.topk, local_blocks=cfg.local_blocks,
                            init_blocks=cfg.init_blocks, block_size=cfg.block_size,
                            score_dtype=cfg.score_dtype, backend="kernels", kernel=kernel)
    else:
        # the layout's query lengths, known without reading cu_q back: 1, 0, 1, 0, ... (stage 1 reads no
        # key lengths from this)
        layout = HostSeqlens.from_lengths([1, 0] * seqlens.shape[0], [])
        idx = naive_stage1_select(q, k1, k2, cu_q, cu1, cu2, 1, causal=False, cache_lens=cache_lens,
                                  softmax_scale=cfg.softmax_scale, topk=cfg.topk,
                                  local_blocks=cfg.local_blocks, init_blocks=cfg.init_blocks,
                                  block_size=cfg.block_size, kernel_stride=cfg.kernel_stride,
                                  coarse_kernel_stride=cfg.coarse_kernel_stride,
                                  varlen_offset_quirk=cfg.varlen_offset_quirk, score_dtype=cfg.score_dtype,
                                  host_seqlens=layout)
        if not static_k:
            return idx
    return torch.nn.functional.pad(idx, (0, K - idx.shape[2]), value=-1) if idx.shape[2] < K else idx


def decode_select(q: torch.Tensor, cache: DecodeCache, *, config: InfLLMv2Config | None = None,
                  backend: str = "auto", kernel: str = "auto", stage1: str = "decode") -> torch.Tensor:
    r"""Stage 1 for decode: `topk_idx int32 [H, B, K]` of one query per sequence over its cache.

    Non-causal scores over the complete compressed windows of each sequence's cache (the cache's
    own ck1/ck2), pooling with the init blocks and the local window ending at block
    `(L_b - 1) // 64` forced, top-K, blocks after the query's own block `-1`. CPU tensors (or
    `backend="reference"`) run `naive_stage1_select`, with `K = min(topk + local_blocks,
    cdiv(max L, 64))` as `naive_infllmv2_decode`; the kernels size K on the cache's width
    (`cdiv(capacity, 64)`) so that shapes stay the same from step to step (extra slots are `-1`).
    `kernel`: the kernel generation, "auto" | "sm80" | "sm90a" as in every op; the decode kernels
    have only the sm80 form. `stage1` (keyword): "decode" runs the split decode kernels
    (`select_decode`), "prefill" the prefill stage-1 kernel (one CTA per (sequence, KV head); the
    same selection, for comparison).
    """
    cfg, kern = _check_select_args(q, cache, config, backend, kernel, stage1)
    return select_on_cache(q, cache.ck1, cache.ck2, cache.seqlens, cache.capacity, cfg, kern=kern,
                           stage1=stage1, kernel=kernel, static_k=kern)


def infllmv2_decode(q: torch.Tensor, cache: DecodeCache, *, config: InfLLMv2Config | None = None,
                    return_attn_weights: bool = False, weights: str = "per_head", return_lse: bool = False,
                    return_topk_idx: bool = False, backend: str = "auto", kernel: str = "auto",
                    stage1: str = "decode"):
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
        return_topk_idx (bool, Optional): Also return the selection `int32 [H, B, K]`: None on a dense
            step decided on the host; a step decided on the device (the host mirror lags after captured
            or compiled appends) returns the rows it attended, every block of each sequence
            (docs/decode.md, 6).
        backend (str, Optional): "auto" (kernels for CUDA tensors, references for CPU), "kernels"
            or "reference".
        kernel (str, Optional): the kernel generation, "auto" | "sm80" | "sm90a" as in every op
            (`_kernel_arg`). The decode kernels have only the sm80 form (mma.sync, any GPU from
            capability 8.0): "auto" and "sm80" run them; "sm90a" needs `stage1="prefill"`.
        stage1 (str, Optional): stage 1 on CUDA tensors: "decode" (default) runs the split decode
            kernels (`select_decode`); "prefill" the prefill stage-1 kernel (generation `kernel`), one
            CTA per (sequence, KV head): slower at long contexts, the same selection, not capturable.

    Returns:
        out `[B, HQ, D]` in q's dtype, then lse, weights and topk_idx as asked, in that order.

    Host synchronisation on the kernel path: none. The dense/sparse choice reads the cache's host
    mirror of the lengths, the stage-1 layout and `cache_lens` are built on the device, the stage-1
    output is sized on the cache's width and `sparse_decode` reads nothing back, so the step (with
    `cache.append`) captures in a CUDA graph; the graph keeps the path (dense or sparse) it was
    captured on (the op `infllm_cupy::infllmv2_decode` decides on the device instead). The reference
    path reads lengths on the host.

    Eager calls on a CUDA cache (`stage1="decode"`) reuse prepared launches kept on the cache, one set
    per (q shape, config, outputs, path), after the first call's full checks (docs/decode.md, 6); with
    `cache.graphs` they replay a CUDA graph of them.

    Checks: the arguments once, here (`check_step_inputs`); on CUDA tensors the kernels' own
    requirements once more (`step_launches`); what runs below takes them as checked.
    """
    if (kernel in _FAST_KERNELS and stage1 == "decode" and backend in _FAST_BACKENDS
            and isinstance(cache, DecodeCache) and cache.k.is_cuda):
        fast = _fast_step(q, cache, config, return_attn_weights, weights, return_lse, return_topk_idx)
        if fast is not None:
            return fast
    check_flags(return_attn_weights=return_attn_weights, return_lse=return_lse,
                return_topk_idx=return_topk_idx)
    cfg, kern = check_step_inputs(q, cache, config, weights, backend, kernel, stage1)
    dense = is_dense(cache, cfg)
    keys = (cache.ck1, cache.ck2, cache.seqlens, cache.capacity, cfg)      # what stage 1 reads
    if kern:
        # q as the prepared path takes it (a contiguous copy where it is not); stage 1 among the step's
        # launches unless it runs on the prefill kernel
        q = q.contiguous()
        topk_idx = None
        if not dense and stage1 != "decode":
            topk_idx = select_on_cache(q, *keys, kern=True, stage1=stage1, kernel=kernel)
        run, (out, lse, w, topk_idx) = step_launches(
            q, cache.k, cache.v, cache.ck1, cache.ck2, cache.seqlens, cache.block_table, cache.capacity, cfg,
            dense=dense, topk_idx=topk_idx, return_attn_weights=return_attn_weights, weights=weights)
        run.run()
    else:
        topk_idx = None if dense else select_on_cache(q, *keys, kern=False, static_k=False)
        res = sparse_decode_checked(q, cache.k, cache.v, cache.seqlens, cache.block_table, cache.capacity,
                                     topk_idx, scale=check_softmax_scale(cfg.softmax_scale, q.shape[2]),
                                     block_size=cfg.block_size, return_lse=True,
                                     return_attn_weights=return_attn_weights, weights=weights)
        out, lse, w = res if return_attn_weights else (*res, None)
    return _results(out, lse, w, topk_idx, return_lse, return_attn_weights, return_topk_idx)


def is_dense(cache: DecodeCache, cfg: InfLLMv2Config) -> bool:
    """The dense/sparse rule of spec section 9 (`uses_dense`) on the cache's host mirror: the longest
    cache, the current token included (HF's `kv_seq_len`)."""
    return uses_dense(cfg.dense_len, cache.max_len())


def _results(out, lse, w, topk_idx, return_lse: bool, return_attn_weights: bool, return_topk_idx: bool):
    """out, then lse, weights and topk_idx as asked, in that order (one tensor alone)."""
    res = [out]
    if return_lse:
        res.append(lse)
    if return_attn_weights:
        res.append(w)
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
    if not cache.lengths_in_sync:
        dense = None        # the mirror lags (captured or compiled appends): the kernels decide on the device
    else:
        lens = cache.lengths()
        if lens and min(lens) < 1:
            return None                                   # the general path raises, naming the lengths
        dense = max(lens, default=0) < (config.dense_len if config is not None else _DEFAULT_DENSE)
    key = (id(config), q.shape, q.dtype, q.get_device(), return_attn_weights, weights, return_lse,
           return_topk_idx, dense)
    entry = cache.prepared(key, lambda: _build_step(q, cache, config, return_attn_weights, weights,
                                                    return_lse, return_topk_idx, dense=dense),
                           valid=lambda e: e.config is config)   # an id() may come back for a new config
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
_FAST_KERNELS = ("auto", "sm80")     # `kernel=` values that run the decode kernels


def _build_step(q, cache, config, return_attn_weights, weights, return_lse, return_topk_idx, *,
                dense: bool | None):
    """A `StepProgram` after every check of the general path (raises as it does)."""
    check_flags(return_attn_weights=return_attn_weights, return_lse=return_lse,
                return_topk_idx=return_topk_idx)
    cfg, _ = check_step_inputs(q, cache, config, weights, "kernels", "auto")
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
                  dense: bool | None, return_attn_weights: bool = False, weights: str = "per_head",
                  topk_idx: torch.Tensor | None = None):
    """The launches of one decode step (stage 1 unless dense, then `sparse_decode`) after their checks:
    `(Launches, (out, lse, weights or None, topk_idx or None))`. `dense`: the path, or None to decide
    it on the device from the lengths at every run (spec section 9: stage 1's rows then list every block
    while the longest sequence is shorter than `cfg.dense_len`; what a captured or compiled step runs).
    `topk_idx`: a selection made elsewhere (the prefill stage-1 kernel), attended instead of stage 1's.

    The kernels' requirements are checked here once for the whole step (q by `sparse_decode`'s checks,
    the compressed keys against it by `select_decode`'s); the step's arguments were checked by its caller
    (`infllmv2_decode`, the op)."""
    if cfg.block_size != KV_BLOCK:
        raise ValueError(f"config: block_size must be {KV_BLOCK} for the kernels, got {cfg.block_size}")
    B, _HQ, D, H, G, _K = check_decode_kernel_inputs(q, k, v, seqlens, block_table, topk_idx)
    check_aligned(q=q, k_cache=k, v_cache=v)
    scale = check_softmax_scale(cfg.softmax_scale, D)
    out_len = cdiv(width, KV_BLOCK)
    run = Launches(q.device)
    if not dense and topk_idx is None:
        sdt = check_select_inputs(q, ck1, ck2, seqlens, score_dtype=cfg.score_dtype, exact=cfg.exact_stage1,
                                  q_checked=True)
        topk_idx = add_select_decode(run, q, ck1, ck2, seqlens, out_len, topk=cfg.topk,
                                     local_blocks=cfg.local_blocks,
                                     init_blocks=cfg.init_blocks, softmax_scale=cfg.softmax_scale,
                                     score_dtype=sdt,
                                     exact=cfg.exact_stage1,
                                     dense_len=max(cfg.dense_len, 0) if dense is None else 0)
    n_entries = topk_idx.shape[2] if topk_idx is not None else out_len
    plan = plan_decode(B, H, G, n_entries, sm_count(q.device.index))
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
    kernels = runs_kernels(q, backend)                 # before the append: a refused call writes nothing
    before = cache.lengths()
    cache.append(k_new, v_new, cu_seqlens_new)          # checks everything before writing
    after = cache.lengths()
    n_new = [a - b for a, b in zip(after, before)]
    k, v, cu_k = cache.packed()
    max_k = max(after, default=0)
    # the lengths are the cache's host mirror: the prefill body reads no cu_seqlens back, and takes the
    # cache's compressed keys instead of compressing k again
    host = HostSeqlens.from_lengths(n_new, after)
    compressed = None if uses_dense(cfg.dense_len, max_k) else cache.packed_compressed()
    return prefill(q, k, v, _cu(n_new, cache.device), cu_k, max(n_new, default=0), max_k, cfg,
                   kernels=kernels, host_seqlens=host, return_aux=return_aux,
                   compressed=compressed)


def _cu(lengths, device) -> torch.Tensor:
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    if lengths:
        cu[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0).to(torch.int32)
    return cu.to(device)
