"""The InfLLM-v2 decode step over a KV cache, as one body with a plan/run split, and chunked prefill into
the cache. Design: docs/decode.md ("The decode step", "Custom ops and torch.compile", "Chunked prefill
into the cache").

One body, `run_step`, computes every decode call: stage 1 on the cache's compressed keys (or a given
selection, or none: dense), then attention over the selected blocks, with the outputs a `StepSpec`
asks for. A `StepSpec` is the plan half: what the step computes, as values (the config's fields, the
outputs, the backend), hashable, and encoded as one string for the custom op. The run half, on CUDA
tensors, is a `StepPlan`: the step's launches prepared once per (spec, tensor shapes), holding no
device memory (every tensor, the one workspace allocation included, is re-pointed at each run), kept
in one bounded store that every entry shares. Three entries reach the body:

  * `infllmv2_decode(q, cache, ...)`: the whole step on a `DecodeCache` (eager; under torch.compile it
    calls the op);
  * `sparse_decode(q, cache, topk_idx, ...)`: attention over a given selection (or every block);
  * the custom op `infllm_cupy::infllmv2_decode(q, k_cache, v_cache, ck1, ck2, seqlens, block_table,
    topk_idx, spec)`: what compiled callers (and the transformers backend under torch.compile) run.

`infllmv2_decode` is `naive_infllmv2_decode` (the oracle) on the cache the step keeps: the same
dense/sparse rule (spec section 9: dense while the longest cache, the current token included, is
shorter than `dense_len`), the same stage 1 (non-causal over the complete compressed windows,
`cache_lens = L - 1`, spec section 4.4), the same top-k with forced init and local blocks, then
attention over the selected blocks. CUDA tensors run the kernels (the split stage-1 decode kernels,
the split-KV attention); CPU tensors under "auto" (`runs_cpu`) run the CPU implementations of stage 1
and of the attention over the selected blocks (`stage1/cpu.py`, `decode/cpu.py`);
`backend="reference"` runs the references on any device.
"""
from __future__ import annotations

import dataclasses
import functools

import torch

from .._checks import HostSeqlens, check_aligned, check_flags, check_softmax_scale, check_tensor
from .._kernel_arg import KERNELS, SM90A, check_kernel
from .._launch import Launches, empty
from .._rules import (
    COMPRESSIONS,
    KV_BLOCK,
    cdiv,
    check_backend,
    check_kernel_block,
    n_windows_of,
    runs_cpu,
    runs_kernels,
    selection_slots,
    sm_count,
    softmax_scale_of,
    uses_dense,
)
from ..config import InfLLMv2Config, check_config
from ..prefill import prefill
from ..stage1 import stage1_select
from . import fp8
from .cache import DecodeCache, cache_tensors, capturing, cu_seqlens_of, dequantized_tensors
from .cpu import Fp8Pages, cpu_sparse_decode
from .naive import check_sparse_decode_inputs, sparse_decode_checked
from .select_decode import add_select_decode, check_select_inputs, plan_for, select_decode, select_width
from .select_decode import scratch_floats as select_scratch_floats
from .sparse_decode import (
    WEIGHTS,
    DecodePlan,
    add_sparse_decode,
    check_decode_kernel_inputs,
    check_plan,
    plan_decode,
)
from .sparse_decode import scratch_floats as attention_scratch_floats

Tensor = torch.Tensor
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
    """Arguments of `infllmv2_decode`, checked once per call (what runs below takes
    them as checked); raises naming the argument. Reads no device values. Returns the config and
    whether the kernels run."""
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {WEIGHTS}, got {weights!r}")
    cfg, kern = _check_select_args(q, cache, config, backend, kernel, stage1)
    _check_current_token(cache)
    return cfg, kern


def _check_current_token(cache: DecodeCache) -> None:
    """A decode query is the cache's last token: a sequence with none (an empty cache) has no query
    position and no block to select (ValueError naming `cache`). Reads the host mirror, no device value;
    skipped while a CUDA graph captures (replays advance the lengths the mirror does not see)."""
    lens = cache.lengths()          # host mirror, no device read (not advanced by graph replays)
    if lens and min(lens) < 1 and not capturing():
        raise ValueError(f"cache: every sequence must hold at least the current token (append it before the "
                         f"step), got lengths {lens[:16]}")


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
                    stage1: str = "decode", kernel: str = "auto", static_k: bool = True,
                    width_k: int | None = None, cpu: bool = False) -> torch.Tensor:
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

    Otherwise, with `cpu` (`runs_cpu`: CPU tensors under "auto"), the CPU implementation of stage 1
    (`stage1_select` on CPU: chunked fp32 GEMMs, one query row per sequence), else the reference
    (`naive_stage1_select`), each over `layout_of`'s view without its checks (the caller checked q
    against the keys, and the view is built here), K sized on the longest sequence as
    `naive_infllmv2_decode`, or padded with -1 to the static K with `static_k` (to `width_k` where
    given: a device-decided step's rows, `select_width`).
    """
    K = selection_slots(cfg.topk, cfg.local_blocks, cdiv(width, cfg.block_size))
    if width_k is not None:
        K = width_k
    if kern:
        check_kernel_block(cfg.block_size, "config: block_size")
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
        idx = stage1_select(q, k1, k2, cu_q, cu1, cu2, 1, causal=False, cache_lens=cache_lens,
                            softmax_scale=cfg.softmax_scale, topk=cfg.topk, local_blocks=cfg.local_blocks,
                            init_blocks=cfg.init_blocks, block_size=cfg.block_size,
                            kernel_stride=cfg.kernel_stride, coarse_kernel_stride=cfg.coarse_kernel_stride,
                            varlen_offset_quirk=cfg.varlen_offset_quirk, score_dtype=cfg.score_dtype,
                            backend="auto" if cpu else "reference", host_seqlens=layout)
        if not static_k:
            return idx
    return torch.nn.functional.pad(idx, (0, K - idx.shape[2]), value=-1) if idx.shape[2] < K else idx


def decode_select(q: torch.Tensor, cache: DecodeCache, *, config: InfLLMv2Config | None = None,
                  backend: str = "auto", kernel: str = "auto", stage1: str = "decode") -> torch.Tensor:
    r"""Stage 1 for decode: `topk_idx int32 [H, B, K]` of one query per sequence over its cache.

    Non-causal scores over the complete compressed windows of each sequence's cache (the cache's
    own ck1/ck2), pooling with the init blocks and the local window ending at block
    `(L_b - 1) // 64` forced, top-K, blocks after the query's own block `-1`. CPU tensors run the
    CPU implementation of stage 1 under "auto" and `naive_stage1_select` under `backend="reference"`
    (as CUDA tensors do), with `K = min(topk + local_blocks, cdiv(max L, 64))` as
    `naive_infllmv2_decode`; the kernels size K on the cache's width
    (`cdiv(capacity, 64)`) so that shapes stay the same from step to step (extra slots are `-1`).
    `kernel`: the kernel generation, "auto" | "sm80" | "sm90a" as in every op; the decode kernels
    have only the sm80 form. `stage1` (keyword): "decode" runs the split decode kernels
    (`select_decode`), "prefill" the prefill stage-1 kernel (one CTA per (sequence, KV head); the
    same selection, for comparison).
    """
    cfg, kern = _check_select_args(q, cache, config, backend, kernel, stage1)
    _check_current_token(cache)
    return select_on_cache(q, cache.ck1, cache.ck2, cache.seqlens, cache.capacity, cfg, kern=kern,
                           stage1=stage1, kernel=kernel, static_k=kern, cpu=runs_cpu(q, backend))


# ------------------------------------------------------------------------------------------ the plan
SELECT = ("stage1", "given", "dense")


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """What one decode call computes, as values: the plan half of the step (hashable, one string for
    the custom op: `encode` / `decode`).

    Attributes:
        select (str): "stage1": stage 1 on the cache's compressed keys picks the blocks; "given": the
            call passes `topk_idx`; "dense": every block.
        topk, local_blocks, init_blocks, exact, score_dtype (str): stage 1's (`InfLLMv2Config`).
        dense_len (int): with "stage1", > 0 applies spec section 9's rule inside the step from the
            device lengths (a dense step's rows list every block; what compiled and captured steps
            run); 0 always selects (an eager caller decided the path on the host).
        static_k (bool): the reference's selection padded with -1 to the kernels' static width
            (`select_width`), as the op's shapes need; False: sized on the longest sequence, as
            `naive_infllmv2_decode`.
        block_size (int): the key block (the kernels take 64 only).
        softmax_scale (float or None): None is `1 / sqrt(D)`.
        return_lse (bool), weights (str: "" none, "per_head", "per_kv_head"), return_topk_idx (bool):
            the outputs after `out`, in that order.
        backend (str): "auto", "kernels" or "reference" (the op honours it on CUDA tensors too).
        decode_plan (tuple or None): a `DecodePlan`'s fields (`sparse_decode(plan=...)`), None for
            `plan_decode`'s.
    """
    select: str
    topk: int = 0
    local_blocks: int = 0
    init_blocks: int = 0
    exact: bool = False
    score_dtype: str = "float32"
    dense_len: int = 0
    static_k: bool = True
    block_size: int = KV_BLOCK
    softmax_scale: float | None = None
    return_lse: bool = False
    weights: str = ""
    return_topk_idx: bool = False
    backend: str = "auto"
    decode_plan: tuple | None = None

    def encode(self) -> str:
        """The spec as one string (the custom op's argument); `StepSpec.decode` inverts it."""
        return _encode(self)

    @staticmethod
    def decode(text: str) -> StepSpec:
        return _decode(text)

    @property
    def score(self) -> torch.dtype:
        return getattr(torch, self.score_dtype)

    def config(self) -> InfLLMv2Config:
        """The stage-1 fields as a config (the reference's selection takes one)."""
        return _config_of(self)

    def plan(self) -> DecodePlan | None:
        if self.decode_plan is None:
            return None
        rt, ns, per, mg, pdl = self.decode_plan
        return DecodePlan(rt, ns, per, merge_groups=mg, pdl=pdl)

    def n_outputs(self) -> int:
        return 1 + self.return_lse + bool(self.weights) + self.return_topk_idx


def _encode(spec: StepSpec) -> str:
    # str() of each field joined (not repr of the tuple: torch.compile traces this, and its dynamo traces
    # str() of constants where some versions refuse repr() of a tuple); floats print exactly
    text = ""
    for name in _FIELD_NAMES:
        v = getattr(spec, name)
        if type(v) is tuple:
            v = "/".join([str(x) for x in v])
        text = text + ";" + str(v) if text else str(v)
    return text


@functools.lru_cache(maxsize=256)
def _decode(text: str) -> StepSpec:
    try:
        parts = text.split(";")
        if len(parts) != len(_FIELD_NAMES):
            raise ValueError(f"{len(parts)} fields, not {len(_FIELD_NAMES)}")
        return StepSpec(*[_parse(name, p) for name, p in zip(_FIELD_NAMES, parts)])
    except (ValueError, TypeError) as e:
        raise ValueError(f"spec: not a StepSpec's encoding ({e}): {text[:200]!r}") from None


def _parse(name: str, text: str):
    kind = _FIELD_KINDS[name]
    if text == "None" and kind in ("float?", "plan?"):
        return None
    if kind == "bool":
        if text not in ("True", "False"):
            raise ValueError(f"{name}: {text!r} is not a bool")
        return text == "True"
    if kind == "int":
        return int(text)
    if kind == "float?":
        return float(text)
    if kind == "plan?":
        rt, ns, per, mg, pdl = text.split("/")
        return (int(rt), int(ns), int(per), int(mg), pdl == "True")
    return text


_FIELD_NAMES = tuple(f.name for f in dataclasses.fields(StepSpec))
_FIELD_KINDS = {"select": "str", "topk": "int", "local_blocks": "int", "init_blocks": "int", "exact": "bool",
                "score_dtype": "str", "dense_len": "int", "static_k": "bool", "block_size": "int",
                "softmax_scale": "float?", "return_lse": "bool", "weights": "str", "return_topk_idx": "bool",
                "backend": "str", "decode_plan": "plan?"}


@functools.lru_cache(maxsize=64)
def _config_of(spec: StepSpec) -> InfLLMv2Config:
    return InfLLMv2Config(topk=spec.topk, local_blocks=spec.local_blocks, init_blocks=spec.init_blocks,
                          block_size=spec.block_size, softmax_scale=spec.softmax_scale,
                          score_dtype=spec.score, exact_stage1=spec.exact, dense_len=max(spec.dense_len, 0))


def step_spec(cfg: InfLLMv2Config, *, select: str, device_dense: bool = False, return_lse: bool = False,
              weights: str = "", return_topk_idx: bool = False, backend: str = "auto",
              static_k: bool = True) -> StepSpec:
    """The spec of a step with `cfg`'s stage 1: `select` as `StepSpec.select`; `device_dense` keeps the
    config's dense rule inside the step (spec section 9, decided on the device)."""
    return StepSpec(select, cfg.topk, cfg.local_blocks, cfg.init_blocks, cfg.exact_stage1,
                    str(cfg.score_dtype).removeprefix("torch."),
                    max(cfg.dense_len, 0) if device_dense and select == "stage1" else 0, static_k,
                    cfg.block_size, cfg.softmax_scale, return_lse, weights, return_topk_idx, backend)


def attention_spec(*, given: bool, softmax_scale, return_lse: bool, weights: str, backend: str,
                   plan: DecodePlan | None) -> StepSpec:
    """The spec of `sparse_decode`: attention over a given selection, or over every block."""
    dp = (None if plan is None
          else (plan.row_tiles, plan.num_splits, plan.per_split, plan.merge_groups, plan.pdl))
    return StepSpec("given" if given else "dense", softmax_scale=softmax_scale, return_lse=return_lse,
                    weights=weights, backend=backend, decode_plan=dp)


# ------------------------------------------------------------------------------------------ the body
def run_step(q, k, v, ck1, ck2, seqlens, block_table, topk_idx, spec: StepSpec, *, kernels: bool,
             host_lens: list[int] | None = None, kv8=None) -> list:
    """The decode step: `[out, lse?, weights?, topk_idx?]` as `spec` asks (a dense step's topk_idx
    decided on the host is None), on arguments its caller checked (`infllmv2_decode`, `sparse_decode`,
    the op). `kernels`: the prepared launches (`StepPlan`); otherwise the references, with the lengths
    `host_lens` where the caller knows them (else read from `seqlens`). `kv8`: an FP8 cache's
    `fp8_tensors()` with its e4m3 `k`, `v`: the kernels read them, the CPU implementation dequantizes
    the rows it gathers (`Fp8Pages`), the references read the whole cache dequantized."""
    if kernels:
        return plan_step(spec, q, k, v, ck1, ck2, seqlens, block_table, topk_idx, kv8).run(
            q, k, v, ck1, ck2, seqlens, block_table, topk_idx, kv8)
    if kv8 is not None and runs_cpu(q, spec.backend):
        k_scale, v_scale, k_recent, v_open = kv8
        k, v = Fp8Pages(k, k_scale, k_recent, is_k=True), Fp8Pages(v, v_scale, v_open, is_k=False)
    elif kv8 is not None:
        k, v = dequantized_tensors(k, v, seqlens, block_table, kv8)
    return _reference_step(q, k, v, ck1, ck2, seqlens, block_table, topk_idx, spec, host_lens)


def _reference_step(q, k, v, ck1, ck2, seqlens, bt, topk_idx, spec: StepSpec, host_lens) -> list:
    """The step without the kernels: the references, or with `runs_cpu` the CPU implementations."""
    width = k.shape[1] * bt.shape[1] if bt is not None else k.shape[1]
    idx = attend = topk_idx if spec.select == "given" else None
    if spec.select == "stage1":
        lens = host_lens if host_lens is not None else [int(x) for x in seqlens.cpu().tolist()]
        kout = select_width(spec.topk, spec.local_blocks, cdiv(width, spec.block_size), spec.dense_len)
        if uses_dense(spec.dense_len, max(lens, default=0)):
            idx = _dense_rows(lens, k.shape[2], kout, spec.block_size, q.device) if spec.static_k else None
        else:
            idx = attend = select_on_cache(q, ck1, ck2, seqlens, width, spec.config(), kern=False,
                                           static_k=spec.static_k, width_k=kout,
                                           cpu=runs_cpu(q, spec.backend))
    scale = softmax_scale_of(spec.softmax_scale, q.shape[2])
    # CPU tensors under "auto": the selected blocks only (cpu.py); else the reference over every key
    attention = cpu_sparse_decode if runs_cpu(q, spec.backend) else sparse_decode_checked
    res = attention(q, k, v, seqlens, bt, width, attend, scale=scale, block_size=spec.block_size,
                    return_lse=True, return_attn_weights=bool(spec.weights),
                    weights=spec.weights or "per_head")
    out, lse, w = res if spec.weights else (*res, None)
    return _asked(spec, out, lse, w, idx)


def _dense_rows(lens, H: int, width: int, block_size: int, device) -> torch.Tensor:
    """A dense step's selection rows as the device-decided kernels write them: blocks `0 .. cdiv(L_b,
    block_size) - 1`, then -1 (`[H, B, width]`)."""
    j = torch.arange(width, dtype=torch.int32)
    n = torch.tensor([cdiv(L, block_size) for L in lens], dtype=torch.int32)
    rows = torch.where(j[None, :] < n[:, None], j[None, :], torch.full_like(j, -1)[None, :])
    return rows[None].expand(H, -1, -1).contiguous().to(device)


def _asked(spec: StepSpec, out, lse, w, idx) -> list:
    res = [out]
    if spec.return_lse:
        res.append(lse)
    if spec.weights:
        res.append(w)
    if spec.return_topk_idx:
        res.append(idx)
    return res


# --------------------------------------------------------------------------------------- the run half
class StepPlan:
    """A decode step's launches for one (spec, tensor shapes), prepared once (docs/decode.md, 6): built
    after every check of the kernels' requirements; it holds no device memory, so any call of the same
    shapes runs it (the eager entries, the op, a captured graph). `run` allocates the outputs asked
    for and one fp32 workspace (stage 1's scratch, the merge's partials, the outputs not asked for),
    re-points every tensor field and launches on torch's current stream."""

    __slots__ = ("any_rows", "outs", "program", "spec", "work")

    def __init__(self, spec: StepSpec, program, outs, work: int, any_rows: bool):
        self.spec, self.program, self.outs, self.work = spec, program, outs, work
        self.any_rows = any_rows

    def run(self, q, k, v, ck1, ck2, seqlens, block_table, topk_idx, kv8=None) -> list:
        dev = q.device
        fresh = {name: empty(shape, dtype=dtype, device=dev) for name, shape, dtype in self.outs}
        work = torch.empty(self.work, dtype=torch.float32, device=dev)
        bind = dict(q=q, k=k, v=v, seqlens=seqlens, work=work, **fresh)
        if self.any_rows:            # a contiguous cache's row length: its width, the rows' stride
            bind["seq_rows"] = bind["W"] = k.shape[1]
        if self.spec.select == "stage1":
            bind["ck1"] = ck1
            if not self.spec.exact:
                bind["ck2"] = ck2
        elif self.spec.select == "given":
            bind["topk_idx_in"] = topk_idx
        if block_table is not None:
            bind["block_table"] = block_table
        if kv8 is not None:
            bind.update(zip(KV8_FIELDS, kv8))
        self.program.run(**bind)
        idx = fresh.get("topk_idx", topk_idx if self.spec.select == "given" else None)
        return _asked(self.spec, fresh["out"], fresh.get("lse"), fresh.get("weights"), idx)


_PLANS: dict = {}
_MAX_PLANS = 256


def _signature(t) -> tuple | None:
    """What a prepared step depends on in a tensor: shape, dtype, device, layout (not its address or
    values)."""
    return None if t is None else (t.shape, t.dtype, t.device, t.is_contiguous())


def _any_rows(spec: StepSpec, block_table) -> bool:
    """Whether a plan serves a contiguous cache of any row length: attention over a given selection
    without weights depends on the length only through two int fields that each run writes (the
    compat layer's decode hands caches one key longer at every step)."""
    return spec.select == "given" and not spec.weights and block_table is None


KV8_FIELDS = ("k_scale", "v_scale", "k_recent", "v_open")   # an FP8 cache's tensors, as the kernel names them


def plan_step(spec: StepSpec, q, k, v, ck1, ck2, seqlens, block_table, topk_idx, kv8=None) -> StepPlan:
    """The `StepPlan` of these tensors' shapes, from the store, or built after every check of the
    kernels' requirements (raising as they do). A call whose tensors are not 16-byte aligned goes to
    the checks, which name it."""
    if _any_rows(spec, block_table) and k.shape == v.shape and k.dim() == 4:
        kv = (k.shape[0], k.shape[2], k.shape[3], k.dtype, k.device, k.is_contiguous(), v.dtype, v.device,
              v.is_contiguous())
    else:
        kv = (_signature(k), _signature(v))
    key = (spec, _signature(q), kv, _signature(ck1), _signature(ck2), _signature(seqlens),
           _signature(block_table), _signature(topk_idx),
           None if kv8 is None else tuple(_signature(t) for t in kv8))
    plan = _PLANS.get(key)
    aligned = not ((q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15)
    if kv8 is not None:
        aligned = aligned and not ((kv8[0].data_ptr() | kv8[2].data_ptr() | kv8[3].data_ptr()) & 15)
    if plan is None or not aligned:
        plan = _build_plan(spec, q, k, v, ck1, ck2, seqlens, block_table, topk_idx, kv8)
        if len(_PLANS) >= _MAX_PLANS:
            del _PLANS[next(iter(_PLANS))]          # the oldest entry
        _PLANS[key] = plan
    return plan


def n_plans() -> int:
    """How many prepared steps the store holds."""
    return len(_PLANS)


def _build_plan(spec: StepSpec, q, k, v, ck1, ck2, seqlens, bt, topk_idx, kv8=None) -> StepPlan:
    check_kernel_block(spec.block_size, "config: block_size" if spec.select == "stage1" else "block_size")
    given = topk_idx if spec.select == "given" else None
    B, HQ, D, H, G, _K = check_decode_kernel_inputs(q, k, v, seqlens, bt, given, kv8)
    check_aligned(q=q, k_cache=k, v_cache=v)
    if kv8 is not None:
        check_aligned(**dict(zip(KV8_FIELDS, kv8)))
    scale = check_softmax_scale(spec.softmax_scale, D)
    width = k.shape[1] * bt.shape[1] if bt is not None else k.shape[1]
    out_len = cdiv(width, KV_BLOCK)
    dev = q.device
    splan, sdt, kout = None, None, 0
    if spec.select == "stage1":
        sdt = check_select_inputs(q, ck1, ck2, seqlens, score_dtype=spec.score, exact=spec.exact,
                                  dense_len=spec.dense_len, q_checked=True)
        splan = plan_for(q.shape, ck1.shape, None if spec.exact else ck2.shape, spec.exact, dev.index)
        kout = select_width(spec.topk, spec.local_blocks, out_len, spec.dense_len)
    n_entries = {"stage1": kout, "given": _K, "dense": out_len}[spec.select]
    plan = spec.plan() or plan_decode(B, H, G, n_entries, sm_count(dev.index))
    check_plan(plan, G, n_entries, D, n_entries if spec.select != "dense" else 0, kv8=kv8 is not None)
    # the outputs asked for are their own tensors; the rest lives in the workspace (16-byte pieces)
    outs = [("out", (B, HQ, D), q.dtype)]
    if spec.return_lse:
        outs.append(("lse", (B, HQ), torch.float32))
    if spec.weights:
        outs.append(("weights", (B, HQ if spec.weights == "per_head" else H, width), torch.float32))
    if spec.return_topk_idx and spec.select == "stage1":
        outs.append(("topk_idx", (H, B, kout), torch.int32))
    n_sel = select_scratch_floats(q.shape, H, splan) if splan is not None else 0
    n_att = attention_scratch_floats(q.shape, H, width, plan, bool(spec.weights))
    n_lse = 0 if spec.return_lse else 4 * cdiv(B * HQ, 4)
    n_idx = 4 * cdiv(H * B * kout, 4) if splan is not None and not spec.return_topk_idx else 0
    work = torch.empty(n_sel + n_att + n_lse + n_idx, dtype=torch.float32, device=dev)
    fresh = {name: empty(shape, dtype=dtype, device=dev) for name, shape, dtype in outs}
    lse = fresh.get("lse", work[n_sel + n_att:n_sel + n_att + B * HQ])
    run = Launches(dev)
    if splan is not None:
        idx = fresh.get("topk_idx")
        if idx is None:
            at = n_sel + n_att + n_lse
            idx = work[at:at + H * B * kout].view(torch.int32).view(H, B, kout)
        add_select_decode(run, q, ck1, ck2, seqlens, out_len, topk=spec.topk, local_blocks=spec.local_blocks,
                          init_blocks=spec.init_blocks, softmax_scale=scale, score_dtype=sdt,
                          exact=spec.exact, plan=splan, dense_len=spec.dense_len, topk_idx=idx,
                          scratch=work[:n_sel])
    else:
        idx = given
    add_sparse_decode(run, q, k, v, seqlens, bt, width, idx, scale=scale, plan=plan,
                      return_attn_weights=bool(spec.weights), weights=spec.weights or "per_head",
                      out=fresh["out"], lse=lse, w_out=fresh.get("weights"),
                      scratch=work[n_sel:n_sel + n_att], kv8=kv8)
    bind = dict(q=q, k=k, v=v, seqlens=seqlens, work=work, **fresh)
    if splan is not None:
        bind["ck1"] = ck1
        if not spec.exact:
            bind["ck2"] = ck2
    if given is not None:
        bind["topk_idx_in"] = given
    if bt is not None:
        bind["block_table"] = bt
    if kv8 is not None:
        bind.update(zip(KV8_FIELDS, kv8))
    any_rows = _any_rows(spec, bt)
    program = run.program(strict=True, scalars=("seq_rows", "W") if any_rows else (), **bind)
    return StepPlan(spec, program, outs, work.numel(), any_rows)


# ------------------------------------------------------------------------- graphs of the eager entry
class StepGraph:
    """A CUDA graph of one `StepPlan` on one cache (`DecodeCache.graphs`): captured at its first call on
    static copies of q and the outputs (after running the launches once, which loads every kernel);
    later calls copy q in, replay and return clones of the outputs. The same launches on the same
    plan: the same bits."""

    __slots__ = ("graph", "plan", "static")

    def __init__(self, plan: StepPlan):
        self.plan, self.graph, self.static = plan, None, None

    def run(self, q, cache: DecodeCache) -> list:
        tensors = (cache.k, cache.v, cache.ck1, cache.ck2, cache.seqlens, cache.block_table, None,
                   cache.fp8_tensors())
        if self.graph is None:
            static_q = q.clone()
            self.plan.run(static_q, *tensors)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                res = self.plan.run(static_q, *tensors)
            self.graph, self.static = graph, (static_q, res)
        else:
            self.static[0].copy_(q)
        self.graph.replay()
        return [t.clone() if t is not None else None for t in self.static[1]]


# ----------------------------------------------------------------------------------- the entries
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
    blocks only. Same results as `naive_infllmv2_decode` on the packed cache.

    Args:
        q (torch.Tensor):
            `[B, HQ, D]`, one token per sequence, the cache's dtype and device; heads `h*G ..
            h*G+G-1` on KV head h. Kernels: bf16/fp16, D in {64, 128}, G <= 64.
        cache (DecodeCache): the cache, the current token's key and value appended.
        config (InfLLMv2Config, Optional): Default: MiniCPM4's. Its compressions must be the cache's
            (32/16 and 128/64); the kernels need `block_size` 64.
        return_attn_weights (bool, Optional): Also return the float32 probabilities over the cache's
            width W (`cache.capacity`), 0 where not selected or past `L_b`: `[B, HQ, W]`
            (`weights="per_head"`) or summed over each group `[B, H, W]` (`"per_kv_head"`).
        return_lse (bool, Optional): Also return lse float32 `[B, HQ]` (natural log).
        return_topk_idx (bool, Optional): Also return the selection `int32 [H, B, K]`: None on a dense
            step decided on the host; a step decided on the device (under torch.compile, or when the
            host mirror lags after captured or compiled appends) returns the rows it attended, every
            block of each sequence on a dense step (docs/decode.md, 6).
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
    mirror of the lengths, the stage-1 output is sized on the cache's width and the attention reads
    nothing back, so the step (with `cache.append`) captures in a CUDA graph; the graph keeps the path
    (dense or sparse) it was captured on. Under torch.compile the step is the custom op
    `infllm_cupy::infllmv2_decode`, which decides dense or sparse on the device (`fullgraph=True`
    works; `cache.append` traces too). The reference path reads lengths on the host.

    Every call runs `run_step`; on CUDA tensors its launches are prepared once per (config, outputs,
    shapes) and shared with the op and `sparse_decode` (docs/decode.md, 6); with `cache.graphs` eager
    calls replay a CUDA graph of them. The arguments are checked at a configuration's first call;
    later calls check only what can change between calls.
    """
    if torch.compiler.is_compiling():
        return _traced_step(q, cache, config, return_attn_weights, weights, return_lse, return_topk_idx,
                            backend, kernel, stage1)
    if (stage1 == "decode" and kernel in _DECODE_KERNELS and type(cache) is DecodeCache
            and (not cache.is_fp8 or fp8.VERIFIED_ON_HARDWARE)):
        fast = _prepared_step(q, cache, config, return_attn_weights, weights, return_lse, return_topk_idx,
                              backend)
        if fast is not None:
            return fast
    check_flags(return_attn_weights=return_attn_weights, return_lse=return_lse,
                return_topk_idx=return_topk_idx)
    cfg, kern = check_step_inputs(q, cache, config, weights, backend, kernel, stage1)
    w = weights if return_attn_weights else ""
    if kern:
        q = q.contiguous()
        if q.data_ptr() % 16:
            q = q.clone()
    topk_idx = None
    if not cache.lengths_in_sync and kern:
        spec = step_spec(cfg, select="stage1", device_dense=True, return_lse=return_lse, weights=w,
                         return_topk_idx=return_topk_idx, backend=backend)
    elif is_dense(cache, cfg):
        spec = step_spec(cfg, select="dense", return_lse=return_lse, weights=w, backend=backend)
    elif kern and stage1 == "prefill":
        topk_idx = select_on_cache(q, cache.ck1, cache.ck2, cache.seqlens, cache.capacity, cfg, kern=True,
                                   stage1=stage1, kernel=kernel)
        spec = step_spec(cfg, select="given", return_lse=return_lse, weights=w,
                         return_topk_idx=return_topk_idx, backend=backend)
    else:
        spec = step_spec(cfg, select="stage1", return_lse=return_lse, weights=w,
                         return_topk_idx=return_topk_idx, backend=backend, static_k=kern)
    if kern and stage1 == "decode" and kernel in _DECODE_KERNELS and backend in _FAST_BACKENDS:
        # later calls of this configuration take the prepared path
        path = {"stage1": "device" if spec.dense_len else "stage1", "dense": "dense"}[spec.select]
        _remember_spec(config, return_lse, w, return_topk_idx, backend, path, spec)
    # an FP8 cache passes its e4m3 storage and `kv8`; `read_kv` refuses the kernels until verified on hardware
    k, v = cache.read_kv(True, "infllmv2_decode") if kern else (cache.k, cache.v)
    res = run_step(q, k, v, cache.ck1, cache.ck2, cache.seqlens, cache.block_table, topk_idx,
                   spec, kernels=kern, host_lens=None if kern else cache.current_lengths(),
                   kv8=cache.fp8_tensors())
    if return_topk_idx and spec.select == "dense":
        res.append(None)
    return res[0] if len(res) == 1 else tuple(res)


_DECODE_KERNELS = ("auto", "sm80")     # `kernel=` values that run the decode kernels
_SPECS: dict = {}                      # (id(config), outputs, backend, path) -> (config, StepSpec)


def _prepared_step(q, cache: DecodeCache, config, return_attn_weights, weights, return_lse, return_topk_idx,
                   backend):
    """`infllmv2_decode` on a CUDA cache through its prepared `StepPlan`, checking only what can differ
    between calls of one configuration; None where the checked path must run (its first call, anything
    unusual: that path raises what is wrong)."""
    if not (type(q) is torch.Tensor and q.is_cuda and cache.k.is_cuda and backend in _FAST_BACKENDS):
        return None
    if (type(return_attn_weights) is not bool or type(return_lse) is not bool
            or type(return_topk_idx) is not bool or weights not in WEIGHTS):
        return None
    k = cache.k
    if (q.dim() != 3 or q.dtype != cache.dtype or q.get_device() != k.get_device() or q.shape[2] != k.shape[3]
            or q.shape[0] != cache.seqlens.shape[0] or q.shape[1] % k.shape[2]):
        return None          # the checked path names what differs
    if not q.is_contiguous():
        q = q.contiguous()
    if q.data_ptr() % 16:
        return None
    if not cache.lengths_in_sync:
        path = "device"      # the mirror lags (captured or compiled appends): decided on the device
    else:
        lens = cache.lengths()
        if not lens or min(lens) < 1:
            return None      # the checked path raises, naming the lengths
        path = "dense" if max(lens) < (_DEFAULT_DENSE if config is None else config.dense_len) else "stage1"
    w = weights if return_attn_weights else ""
    key = (id(config), return_lse, w, return_topk_idx, backend, path)
    entry = _SPECS.get(key)
    if entry is None or entry[0] is not config:
        return None          # first call of this configuration: the checked path builds the entry
    spec = entry[1]
    if cache.graphs:
        g = cache.prepared((spec, q.shape, q.dtype, q.device),
                           lambda: StepGraph(plan_step(spec, q, *_cache_args(cache), cache.fp8_tensors())))
        res = g.run(q, cache)
    else:
        res = run_step(q, *_cache_args(cache), spec, kernels=True, kv8=cache.fp8_tensors())
    if return_topk_idx and path == "dense":
        res.append(None)
    return res[0] if len(res) == 1 else tuple(res)


def _cache_args(cache: DecodeCache) -> tuple:
    return cache.k, cache.v, cache.ck1, cache.ck2, cache.seqlens, cache.block_table, None


def _remember_spec(config, return_lse, w, return_topk_idx, backend, path, spec) -> None:
    if len(_SPECS) >= 256:
        _SPECS.clear()
    _SPECS[(id(config), return_lse, w, return_topk_idx, backend, path)] = (config, spec)


_DEFAULT_DENSE = InfLLMv2Config().dense_len
_FAST_BACKENDS = ("auto", "kernels")


def _traced_step(q, cache, config, return_attn_weights, weights, return_lse, return_topk_idx, backend, kernel,
                 stage1):
    """`infllmv2_decode` inside torch.compile: the arguments' checks (traced once), then the op, which
    decides dense or sparse on the device and honours `backend`."""
    check_flags(return_attn_weights=return_attn_weights, return_lse=return_lse,
                return_topk_idx=return_topk_idx)
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {WEIGHTS}, got {weights!r}")
    if stage1 != "decode":
        raise ValueError("stage1='prefill' reads lengths on the host and cannot run under torch.compile; use "
                         "stage1='decode'")
    cfg, kern = _check_select_args(q, cache, config, backend, kernel, stage1)
    spec = step_spec(cfg, select="stage1", device_dense=True, return_lse=return_lse,
                     weights=weights if return_attn_weights else "", return_topk_idx=return_topk_idx,
                     backend=backend)
    k, v = cache.read_kv(kern, "infllmv2_decode")
    kv8 = (cache.fp8_tensors() if kern else None) or (None,) * 4
    res = infllmv2_decode_op(q, k, v, cache.ck1, cache.ck2, cache.seqlens, cache.block_table,
                             None, spec.encode(), *kv8)
    return res[0] if len(res) == 1 else tuple(res)


def sparse_decode(q: torch.Tensor, cache, topk_idx: torch.Tensor | None = None, *,
                  softmax_scale: float | None = None, return_lse: bool = False,
                  return_attn_weights: bool = False, weights: str = "per_head",
                  plan: DecodePlan | None = None, backend: str = "auto"):
    r"""Decode attention of one query token per sequence over the selected 64-key blocks of its cache.

    Sequence b attends to the positions `t < L_b` whose block `t // 64` is listed in
    `topk_idx[h, b]` (all blocks when `topk_idx` is None), non-causally: the cache already holds
    the current token. Same semantics as `naive_sparse_decode`, which CPU tensors run.

    Args:
        q (torch.Tensor):
            `[B, HQ, D]` bf16/fp16, D in {64, 128}, the cache's dtype; G = HQ / H in [1, 64].
        cache (DecodeCache or tuple):
            A `DecodeCache`, or `(k_cache, v_cache, seqlens[, block_table])` as in
            `naive_sparse_decode` (contiguous `[B, L_max, H, D]`, or paged
            `[num_pages, page_size, H, D]` with page_size a multiple of 64 and `block_table int32
            [B, max_pages]`; `seqlens` int32 `[B]`). Tuples are trusted: the table and the lengths are
            not read on the host (a DecodeCache checked them when they were written).
        topk_idx (torch.Tensor, Optional):
            int32 `[H, B, K]` block indices local to each sequence; -1 padding, out-of-range and
            repeated entries ignored. Default: None (dense decode over every block).
        softmax_scale (float, Optional): Default: `D ** -0.5`.
        return_lse (bool, Optional): Also return lse float32 `[B, HQ]` (natural log; +inf where
            nothing is selected).
        return_attn_weights (bool, Optional): Also return float32 probabilities over every position
            of the cache's width W (L_max or max_pages * page_size), 0 where not selected or past
            `L_b`: `[B, HQ, W]` (`weights="per_head"`) or summed over the group `[B, H, W]`
            (`"per_kv_head"`).
        plan (DecodePlan, Optional): Default: `plan_decode(...)` for these shapes and this GPU.
        backend (str, Optional): "auto" (kernels for CUDA tensors, reference for CPU), "kernels" or
            "reference".

    Returns:
        out `[B, HQ, D]` in q's dtype, then lse and weights if asked for.

    The step's body (`run_step`) with a given selection: its launches are prepared once per shapes and
    reused, it reads nothing back from the device (a step can be captured in a CUDA graph), and under
    torch.compile it is the custom op `infllm_cupy::infllmv2_decode`.
    """
    check_backend(backend)
    check_flags(return_lse=return_lse, return_attn_weights=return_attn_weights)
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {WEIGHTS}, got {weights!r}")
    if plan is not None and not isinstance(plan, DecodePlan):
        raise TypeError(f"plan must be a DecodePlan or None, got {type(plan).__name__}")
    spec = attention_spec(given=topk_idx is not None, softmax_scale=softmax_scale, return_lse=return_lse,
                          weights=weights if return_attn_weights else "", backend=backend, plan=plan)
    if not torch.compiler.is_compiling() and not runs_kernels(q, backend):
        # the references (`naive_sparse_decode`'s checks, then the body's reference path)
        k, v, seqlens, bt, _ = check_sparse_decode_inputs(q, cache, topk_idx, weights)
        check_softmax_scale(softmax_scale, q.shape[2])
        res = run_step(q, k, v, None, None, seqlens, bt, topk_idx, spec, kernels=False)
        return res[0] if len(res) == 1 else tuple(res)
    k, v, seqlens, bt = _attention_cache(cache)
    kv8 = None
    if type(cache) is DecodeCache and cache.is_fp8:
        kern = runs_kernels(q, backend)
        k, v = cache.read_kv(kern, "sparse_decode")
        kv8 = cache.fp8_tensors() if kern else None
    if softmax_scale is not None:
        check_softmax_scale(softmax_scale, 1)
    if torch.compiler.is_compiling():
        res = infllmv2_decode_op(q, k, v, None, None, seqlens, bt, topk_idx, spec.encode(),
                                 *(kv8 or (None,) * 4))
    else:
        if not (type(q) is torch.Tensor and q.is_contiguous()):
            check_tensor("q", q, ndim=3, contiguous=True)
        res = run_step(q, k, v, None, None, seqlens, bt, topk_idx, spec, kernels=True, kv8=kv8)
    return res[0] if len(res) == 1 else tuple(res)


def _attention_cache(cache) -> tuple:
    """`(k, v, seqlens, block_table or None)` of a DecodeCache or a tuple, without reading or checking
    the tensors (the prepared step checks them at its first call of these shapes)."""
    if type(cache) is DecodeCache:
        return cache.k, cache.v, cache.seqlens, cache.block_table
    if (isinstance(cache, (tuple, list)) and len(cache) in (3, 4)
            and all(isinstance(t, torch.Tensor) for t in cache)):
        return (*cache[:3], cache[3] if len(cache) == 4 else None)
    k, v, seqlens, bt, _ = cache_tensors(cache)         # raises, naming what is wrong
    return k, v, seqlens, bt


# ------------------------------------------------------------------------------------ the custom op
@torch.library.custom_op("infllm_cupy::infllmv2_decode", mutates_args=(), device_types="cuda")
def infllmv2_decode_op(q: Tensor, k_cache: Tensor, v_cache: Tensor, ck1: Tensor | None, ck2: Tensor | None,
                       seqlens: Tensor, block_table: Tensor | None, topk_idx: Tensor | None,
                       spec: str, k_scale: Tensor | None = None, v_scale: Tensor | None = None,
                       k_recent: Tensor | None = None, v_open: Tensor | None = None) -> list[Tensor]:
    """The decode step (`run_step`) on a cache's tensors, `spec` a `StepSpec.encode()`: `[out, lse?,
    weights?, topk_idx?]` as the spec asks. With `select="stage1"` and `dense_len > 0` the dense/sparse
    rule of spec section 9 is decided on the device from `seqlens`, so a captured graph follows the
    lengths at every replay. The spec's backend is honoured ("reference" runs the references on CUDA
    tensors too). An FP8 cache (docs/decode.md §16) passes its e4m3 `k_cache`, `v_cache` with
    `k_scale, v_scale, k_recent, v_open` (`DecodeCache.fp8_tensors()`): the kernels read them (refused
    until verified on hardware, `fp8.check_verified`), the references read them dequantized."""
    s = StepSpec.decode(spec)
    kern = runs_kernels(q, s.backend)
    kv8 = _op_kv8(k_scale, v_scale, k_recent, v_open)
    if kv8 is not None:
        if kern:
            fp8.check_verified("infllm_cupy::infllmv2_decode")
        else:
            k_cache, v_cache = dequantized_tensors(k_cache, v_cache, seqlens, block_table, kv8)
            kv8 = None
    _check_op(q, k_cache, v_cache, seqlens, block_table, ck1, ck2, topk_idx, s, kern)
    if kern:
        q = q.contiguous()
        if q.data_ptr() % 16:
            q = q.clone()
    res = run_step(q, k_cache, v_cache, ck1, ck2, seqlens, block_table, topk_idx, s, kernels=kern, kv8=kv8)
    return _op_outputs(res, s)


def _op_kv8(k_scale, v_scale, k_recent, v_open) -> tuple | None:
    kv8 = (k_scale, v_scale, k_recent, v_open)
    if all(t is None for t in kv8):
        return None
    if any(t is None for t in kv8):
        raise ValueError("k_scale, v_scale, k_recent, v_open: an FP8 cache passes all four (fp8_tensors())")
    return kv8


@infllmv2_decode_op.register_kernel("cpu")
def _(q, k_cache, v_cache, ck1, ck2, seqlens, block_table, topk_idx, spec, k_scale=None, v_scale=None,
      k_recent=None, v_open=None):
    s = StepSpec.decode(spec)
    runs_kernels(q, s.backend)          # "kernels" on CPU tensors raises, naming q
    kv8 = _op_kv8(k_scale, v_scale, k_recent, v_open)
    if kv8 is not None:
        k_cache, v_cache = dequantized_tensors(k_cache, v_cache, seqlens, block_table, kv8)
    _check_op(q, k_cache, v_cache, seqlens, block_table, ck1, ck2, topk_idx, s, False)
    res = run_step(q, k_cache, v_cache, ck1, ck2, seqlens, block_table, topk_idx, s, kernels=False)
    return _op_outputs(res, s)


@infllmv2_decode_op.register_fake
def _(q, k_cache, v_cache, ck1, ck2, seqlens, block_table, topk_idx, spec, k_scale=None, v_scale=None,
      k_recent=None, v_open=None):
    s = StepSpec.decode(spec)
    B, HQ, _ = q.shape
    H = k_cache.shape[2]
    width = k_cache.shape[1] * block_table.shape[1] if block_table is not None else k_cache.shape[1]
    res = [q.new_empty(q.shape)]
    if s.return_lse:
        res.append(q.new_empty((B, HQ), dtype=torch.float32))
    if s.weights:
        res.append(q.new_empty((B, HQ if s.weights == "per_head" else H, width), dtype=torch.float32))
    if s.return_topk_idx:
        kout = select_width(s.topk, s.local_blocks, cdiv(width, s.block_size), s.dense_len)
        res.append(topk_idx.clone() if s.select == "given" else q.new_empty((H, B, kout), dtype=torch.int32))
    return res


def _check_op(q, k, v, seqlens, bt, ck1, ck2, topk_idx, s: StepSpec, kern: bool) -> None:
    """What the op's tensors must hold for its spec beyond what the kernels' plan checks (under
    torch.compile the op is all that runs per call); the references' input checks on their path."""
    if kern:
        check_tensor("q", q, ndim=3)
    else:
        check_sparse_decode_inputs(q, (k, v, seqlens) if bt is None else (k, v, seqlens, bt),
                                   topk_idx if s.select == "given" else None, s.weights or "per_head")
    if s.select == "stage1" and (ck1 is None or (ck2 is None and not s.exact)):
        raise ValueError("ck1 and ck2: a spec with select='stage1' needs the cache's compressed keys")
    if s.select == "given" and topk_idx is None:
        raise ValueError("topk_idx: a spec with select='given' needs a selection")
    if s.select == "dense" and s.return_topk_idx:
        raise ValueError("spec: a dense step has no selection to return (return_topk_idx)")
    if not kern and s.select == "stage1" and s.return_topk_idx and not s.static_k:
        raise ValueError("spec: the op's selection has a static width (static_k=True)")


def _op_outputs(res: list, s: StepSpec) -> list:
    # a custom op returns fresh tensors: a given selection handed back is copied
    if s.return_topk_idx and s.select == "given":
        res[-1] = res[-1].clone()
    return res


def is_dense(cache: DecodeCache, cfg: InfLLMv2Config) -> bool:
    """The dense/sparse rule of spec section 9 (`uses_dense`) on the cache's host mirror: the longest
    cache, the current token included (HF's `kv_seq_len`)."""
    return uses_dense(cfg.dense_len, cache.max_len())


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
    return prefill(q, k, v, cu_seqlens_of(n_new, cache.device), cu_k, max(n_new, default=0), max_k, cfg,
                   kernels=kernels, cpu=runs_cpu(q, backend), host_seqlens=host, return_aux=return_aux,
                   compressed=compressed)
