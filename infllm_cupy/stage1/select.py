"""Launcher of kernels_cu/stage1/select.cu and select_sm90.cu (and merge_cand.cu for range passes):
InfLLM-v2 stage 1 (scores, block pooling, top-k) in one kernel.

The kernel never writes the `[H, total_q, n1]` score matrix: fine scores live in registers and in a
per-token staging row of one 64-key tile; block scores live in shared memory (`TOK x out_len` keys
per CTA) until each token's top-K is taken. Extra GPU memory is the output `[H, total_q, K]` alone,
except in one corner (block-key rows of a CTA that do not fit in shared memory even at the smallest
tile: on an H100, G = 1 beyond about 190k tokens, G = 2 beyond about 370k; half that with fp32
scores), where they go to a global scratch `[H, total_q, ceil(out_len/64)*64]` of keys.
`return_scores=True` also writes the scores and block scores (the original's stage-1 and pooling
outputs) for inspection. Ties in the block scores go to the lower block index.

Where the plan splits the key blocks into ranges (`Stage1Plan.range_blocks`, chosen where the rows
do not fit in shared memory), one range pass per range writes each token's K best (key, block)
candidates of that range, and the candidates are merged exactly (`_merge_into`); extra memory
O(total_q x K) instead of the scratch (docs/stage1.md, 9. Long context: key ranges).
"""
from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np
import torch

from .. import _jit
from .._checks import (
    HostSeqlens,
    check_aligned,
    check_flags,
    check_int_args,
    check_lengths_arg,
    check_max_seqlen,
    check_stage1_inputs,
    check_tensor,
    seqlens_host,
)
from .._dtypes import KERNEL_DTYPES
from .._kernel_arg import SM90A, check_kernel
from .._launch import CXX_TYPE, empty, launch, total_memory
from .._params import KernelParams, constants
from .._rules import (
    COMPRESSIONS,
    HEAD_DIMS,
    KV_BLOCK,
    cdiv,
    check_backend,
    check_kernel_block,
    runs_cpu,
    runs_kernels,
    selection_slots,
    smem_limits,
    softmax_scale_of,
)
from .._tma import TMAP_DTYPE, rows_map
from .cpu import cpu_stage1_scores, cpu_stage1_select
from .naive import naive_stage1_scores, naive_stage1_select, q_block_idx_checked
from .plan import (
    MAX_GROUP,
    SCRATCH_BUDGET_FRACTION,
    SM90_MAX_LGP,
    STAGE_STRIDE,
    TILE,
    Stage1Plan,
    lgp_of,
    stage1_plan,
)

SOURCE = "stage1/select.cu"
SOURCE_SM90 = "stage1/select_sm90.cu"
SCORE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
KERNEL_STRIDE, COARSE_STRIDE = (stride for _, stride in COMPRESSIONS)   # the strides the kernel is built for


SCORE_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}   # kernels_cu: `kind`

# Stage1SelectParams (kernels_cu/stage1/select_common.cuh); the sm_90a kernel's struct adds its two
# tensor maps. One declaration per source: the layout checks are appended to each.
_SELECT_FIELDS = """
    ptr q, ck1, ck2, cu_q, cu_c1, cu_c2, cache_lens, topk_idx, scores, block_scores, bs_scratch
    i32 total_q, HQ, H, G, lgp, B, n_tiles, max_seqlen_q, out_len, olp, K, max_n1, init_blocks, local_blocks
    i32 quirk, causal, kind, s1, s2c
    f32 sl2
    i32 topk_prefix, j_lo, j_hi
    ptr cand_key, cand_idx, row_bias
    i32 bias_mode
"""
SELECT_PARAMS = KernelParams(SOURCE, "Stage1SelectParams<__half, unsigned short>", _SELECT_FIELDS)
SELECT_SM90_PARAMS = KernelParams(SOURCE_SM90, "Stage1SelectSm90Params<__half, unsigned short>",
                                  _SELECT_FIELDS + "tmap tm1, tm2")
# the plan's tile and staging-row sizes (stage1/plan.py), checked against both kernels
for _src in (SOURCE, SOURCE_SM90):
    constants(_src, S1_TILE=TILE, S1_ST=STAGE_STRIDE)


def kernel_name(dtype: torch.dtype, score_dtype: torch.dtype, D: int, sm90a: bool = False,
                ranged: bool = False, packed: bool = False) -> str:
    """The instance's name expression; `ranged`: the kernel's range-pass instance (RANGED = true);
    `packed`: the sm_90a kernel's packed group sum (PACKED = true, 16-bit scores only)."""
    key = "unsigned" if score_dtype == torch.float32 else "unsigned short"
    return (f"stage1_select{'_sm90' if sm90a else ''}<{CXX_TYPE[dtype]}, {key}, {D}, "
            f"{'true' if ranged else 'false'}{', true' if packed else ''}>")


# Every instance the launcher can request: 2 input dtypes x (16-bit, 32-bit scores) x 2 head dims
# (the group shape and bf16 / fp16 scores are run-time arguments), for each of the two kernels, and
# each kernel's range-pass instance.
for _sm90a, _src in ((False, SOURCE), (True, SOURCE_SM90)):
    _jit.register_instances(_src, list(dict.fromkeys(kernel_name(dt, st, d, _sm90a, rg)
                                                     for rg in (False, True) for dt in KERNEL_DTYPES
                                                     for st in SCORE_DTYPES for d in HEAD_DIMS)),
                            sm90a=_sm90a)
# the packed group sum of the sm_90a kernel, for 16-bit scores (Stage1Plan.packed)
_jit.register_instances(SOURCE_SM90, [kernel_name(dt, torch.bfloat16, d, True, rg, True)
                                      for rg in (False, True) for dt in KERNEL_DTYPES for d in HEAD_DIMS],
                        sm90a=True)

_IDX_BITS = 31                     # merge key: (block key << 31) | (2^31 - 1 - block), one int64
_MERGE_ELEMS = 1 << 25             # elements of one merge chunk of the torch merge (bounds its temporaries)
_FINAL_ELEMS = 1 << 22             # elements of one chunk of the final conversion (32 MiB int64 temporaries)

# The range passes' merge kernel (docs/stage1.md, 9. Long context: key ranges; its paragraph "The merge
# kernel"): one instance per candidates-per-lane count NI (K <= 32 NI); past MERGE_MAX_K the torch merge runs.
MERGE_SOURCE = "stage1/merge_cand.cu"
MERGE_WARPS = 4                    # warps per CTA, one per row
MERGE_ITEMS = (1, 2, 3, 4, 6, 8, 16, 32)
MERGE_MAX_K = 32 * MERGE_ITEMS[-1]
# the kernel's candidates compare with each other (K^2 per row): measured on the H100 it merges 8x
# faster than torch at K = 96, 5.6x at 256, but 0.41x at 1024, so `_merge_into` takes it up to here
MERGE_KERNEL_UP_TO_K = 256
_jit.register_instances(MERGE_SOURCE, [f"merge_range_candidates<{n}>" for n in MERGE_ITEMS])
constants(MERGE_SOURCE, MERGE_WARPS=MERGE_WARPS)
MERGE_PARAMS = KernelParams(MERGE_SOURCE, "MergeRangeCandidatesParams", """
    ptr cand_key, cand_idx, run
    i64 rows
    i32 K, has_run
""")


def _smem_limits(device: torch.device) -> tuple[int, int]:
    """`smem_limits` of `device` (a bare "cuda": the current device): (opt-in per-block maximum,
    per-SM capacity) of dynamic shared memory, in bytes."""
    return smem_limits(device.index if device.index is not None else torch.cuda.current_device())


def device_stage1_plan(device: torch.device, G: int, D: int, dtype: torch.dtype, score_dtype: torch.dtype,
                       out_len: int, *, rows: int, kernel: str = "auto") -> Stage1Plan:
    """`stage1_plan` with `device`'s capability, shared-memory limits and scratch budget: the plan
    `stage1_select` takes for `rows` = H x total_q rows (benchmarks size their memory guards by it)."""
    return stage1_plan(torch.cuda.get_device_capability(device), G, D, dtype, score_dtype, out_len,
                       *_smem_limits(device), kernel, rows=rows, scratch_budget=scratch_budget_of(device))


def scratch_budget_of(device: torch.device) -> int:
    """Bytes the plan may give the global block-key scratch on `device` (docs/stage1.md, 9. Long
    context: key ranges): a fixed share of its memory."""
    return total_memory(device) // SCRATCH_BUDGET_FRACTION


def _kernel_checks(q, score_dtype, block_size, kernel_stride, coarse_kernel_stride, softmax_scale):
    if q.dtype not in KERNEL_DTYPES:
        raise TypeError(f"q must have dtype bfloat16 or float16 for backend='kernels', got "
                        f"{str(q.dtype).replace('torch.', '')}")
    if q.shape[2] not in HEAD_DIMS:
        raise ValueError(f"q has head dim {q.shape[2]}; the stage-1 kernel supports {HEAD_DIMS}")
    if score_dtype is not None and score_dtype not in SCORE_DTYPES:
        raise ValueError(f"score_dtype must be bfloat16, float16, float32 or None for backend='kernels', "
                         f"got {score_dtype!r}")
    check_kernel_block(block_size)
    for name, value, want in (("kernel_stride", kernel_stride, KERNEL_STRIDE),
                              ("coarse_kernel_stride", coarse_kernel_stride, COARSE_STRIDE)):
        if value != want:
            raise ValueError(f"{name} must be {want} for backend='kernels' (the kernel's tiling), "
                             f"got {value!r}")
    if softmax_scale is not None and (isinstance(softmax_scale, bool)
                                      or not isinstance(softmax_scale, (int, float))
                                      or not math.isfinite(softmax_scale) or softmax_scale <= 0):
        raise ValueError(f"softmax_scale must be a positive float or None, got {softmax_scale!r}")


def _require_cuda(q):
    if not q.is_cuda:
        raise ValueError(f"q must be a CUDA tensor for backend='kernels', got one on {q.device}")


def stage1_select(q: torch.Tensor, ck1: torch.Tensor, ck2: torch.Tensor, cu_seqlens_q: torch.Tensor,
                  cu_seqlens_c1: torch.Tensor, cu_seqlens_c2: torch.Tensor, max_seqlen_q: int, *,
                  causal: bool = True, cache_lens=None, softmax_scale: float | None = None, topk: int = 64,
                  local_blocks: int = 32, init_blocks: int = 1, block_size: int = 64, kernel_stride: int = 16,
                  coarse_kernel_stride: int = 64, varlen_offset_quirk: bool = False,
                  score_dtype: torch.dtype | None = torch.bfloat16, return_scores: bool = False,
                  backend: str = "auto", kernel: str = "auto", host_seqlens: HostSeqlens | None = None):
    r"""InfLLM-v2 stage 1 end to end: compressed-key scores, block pooling, top-k (spec 4-6).

    Same signature and outputs as `naive_stage1_select`. For query row `r` of a sequence, KV head `h`
    and its `G` query heads: coarse-key max and normaliser per head (pass 1), fine-key weights
    `exp(scale q.ck1_i - scale m_g) / Z_g` summed over the group and rounded to `score_dtype`
    (pass 2), max-pooled to 64-token blocks over fine keys `[4j-1, 4j+4)` with the init and
    `local_blocks + 1` local blocks forced to `+inf`, and the `K = min(topk + local_blocks, out_len)`
    best blocks, ascending, with blocks after the query's own block replaced by a `-1` tail.
    Ties in the block scores go to the lower block index, as in the reference. The kernel path never
    materialises the `[H, total_q, n1]` scores.

    Args:
        q (torch.Tensor):
            `[total_q, HQ, D]`; kernels: bf16 or fp16, D in {64, 128}, `G = HQ / H` from 1 to 128.
        ck1, ck2 (torch.Tensor):
            Fine `[total_c1, H, D]` and coarse `[total_c2, H, D]` compressed keys (`compress_k` 32/16
            and 128/64), q's dtype; pass `ck1` twice (with `cu_seqlens_c1`) for exact mode.
        cu_seqlens_q, cu_seqlens_c1, cu_seqlens_c2 (torch.Tensor):
            int32 `[B+1]` on q's device.
        max_seqlen_q (int):
            Longest query sequence (sets `out_len` and the launch).
        causal (bool, Optional):
            Prefill mask of spec 4.3 (bottom-right aligned); `False` for decode. Default: `True`.
        cache_lens (torch.Tensor or list[int] or None, Optional):
            `[B]` keys before each sequence's first query (`L - 1` in decode). Default: `None` (zeros).
        softmax_scale (float, Optional):
            Default: `None` (`1 / sqrt(D)`).
        topk, local_blocks, init_blocks (int, Optional):
            Default: 64, 32, 1 (MiniCPM4: K = 96).
        block_size, kernel_stride, coarse_kernel_stride (int, Optional):
            The kernels need 64, 16, 64. Default: 64, 16, 64.
        varlen_offset_quirk (bool, Optional):
            HF's `max_seqlen_q - L_b` offset of the query block in ragged batches. Default: `False`.
        score_dtype (torch.dtype, Optional):
            dtype of the scores and block scores on which top-k runs (bf16, fp16, fp32; `None` = fp32).
            Default: `torch.bfloat16`, as the original.
        return_scores (bool, Optional):
            Also return `scores [H, total_q, max_n1]` and `block_scores [H, total_q, out_len]`.
            Default: `False`.
        backend (str, Optional):
            "auto" (the kernels for CUDA tensors, the CPU implementation `cpu_stage1_select` for CPU
            tensors), "kernels" or "reference" (the oracle `naive_stage1_select` on any device).
            Default: "auto".
        kernel (str, Optional):
            Which kernel runs on CUDA tensors: "auto" (sm_90a on compute capability 9.0 when
            G <= 32, the SM80 kernel otherwise), "sm80" or "sm90a" (ValueError on another
            capability or G > 32). Its tile shape is the plan's (stage1/plan.py). Ignored by the
            reference. Default: "auto".
        host_seqlens (HostSeqlens, Optional):
            `cu_seqlens_q` and `cu_seqlens_c1` on the host (`host_seqlens.q`, `.c1`) from a caller that
            checked every input (the pipeline): the kernel path then skips its input checks and reads
            no offsets back; the reference takes the query lengths from it (`naive_stage1_select`).
            Default: `None`.

    Returns:
        topk_idx (torch.Tensor): int32 `[H, total_q, K]`; with `return_scores`, the tuple
        `(topk_idx, scores, block_scores)`.
    """
    check_backend(backend)
    check_kernel(kernel)
    check_flags(causal=causal, varlen_offset_quirk=varlen_offset_quirk, return_scores=return_scores)
    if not runs_kernels(q, backend):
        impl = cpu_stage1_select if runs_cpu(q, backend) else naive_stage1_select
        return impl(
            q, ck1, ck2, cu_seqlens_q, cu_seqlens_c1, cu_seqlens_c2, max_seqlen_q, causal=causal,
            cache_lens=cache_lens, softmax_scale=softmax_scale, topk=topk, local_blocks=local_blocks,
            init_blocks=init_blocks, block_size=block_size, kernel_stride=kernel_stride,
            coarse_kernel_stride=coarse_kernel_stride, varlen_offset_quirk=varlen_offset_quirk,
            score_dtype=score_dtype, return_scores=return_scores, host_seqlens=host_seqlens)
    return launch_select(q, ck1, ck2, cu_seqlens_q, cu_seqlens_c1, cu_seqlens_c2, max_seqlen_q, causal=causal,
                         cache_lens=cache_lens, softmax_scale=softmax_scale, topk=topk,
                         local_blocks=local_blocks,
                         init_blocks=init_blocks, block_size=block_size, kernel_stride=kernel_stride,
                         coarse_kernel_stride=coarse_kernel_stride, varlen_offset_quirk=varlen_offset_quirk,
                         score_dtype=score_dtype, return_scores=return_scores, kernel=kernel,
                         host_seqlens=host_seqlens)


def stage1_scores(q: torch.Tensor, ck1: torch.Tensor, ck2: torch.Tensor, cu_seqlens_q: torch.Tensor,
                  cu_seqlens_c1: torch.Tensor, cu_seqlens_c2: torch.Tensor, max_seqlen_q: int, *,
                  causal: bool = True, softmax_scale: float | None = None,
                  score_dtype: torch.dtype | None = torch.bfloat16, backend: str = "auto",
                  kernel: str = "auto") -> torch.Tensor:
    r"""The stage-1 score matrix `[H, total_q, max_n1]`: `naive_stage1_scores` on the kernels.

    Same arguments and result as `naive_stage1_scores` (fine-key weights under the coarse-key
    normaliser, summed over each KV group, rounded to `score_dtype`; zeros past a sequence's own `n1`
    and in rows with no visible coarse key). On CUDA tensors of the kernels' shapes (bf16 or fp16,
    D in {64, 128}, G <= 128) the stage-1 kernel runs with `return_scores` and no top-k (its block
    scores are computed and dropped); CPU tensors under "auto" the CPU implementation
    (`cpu_stage1_scores`, chunked fp32 GEMMs); other inputs, and `backend="reference"`, the reference.
    The fused `stage1_select` never materialises this tensor: it exists for callers whose API returns
    it (the `infllm_v2` compat layer's `infllmv2_attn_stage1`) and for inspection. `backend="kernels"`
    on CPU tensors raises the ValueError of every entry (`runs_kernels`).
    """
    check_backend(backend)
    check_kernel(kernel)
    check_flags(causal=causal)
    check_tensor("q", q)
    check_tensor("ck1", ck1)
    G = q.shape[1] // max(ck1.shape[1], 1) if q.dim() == 3 and ck1.dim() == 3 else 0
    # the backend rule, and under "auto" the kernel's shapes as well: the compat layer's stage 1 takes
    # any shape (its docstring), so "auto" runs the reference on CUDA inputs the kernel lacks
    on_kernels = runs_kernels(q, backend) and (
        backend == "kernels"
        or (q.dtype in KERNEL_DTYPES and q.shape[-1] in HEAD_DIMS and 1 <= G <= MAX_GROUP))
    if not on_kernels:
        impl = cpu_stage1_scores if runs_cpu(q, backend) else naive_stage1_scores
        return impl(q, ck1, ck2, cu_seqlens_q, cu_seqlens_c1, cu_seqlens_c2, max_seqlen_q, causal=causal,
                    softmax_scale=softmax_scale, score_dtype=score_dtype)
    _, scores, _ = launch_select(q, ck1, ck2, cu_seqlens_q, cu_seqlens_c1, cu_seqlens_c2, max_seqlen_q,
                                 causal=causal, softmax_scale=softmax_scale, topk=0, local_blocks=0,
                                 init_blocks=0, score_dtype=score_dtype, return_scores=True, kernel=kernel)
    return scores


def launch_select(
    q: torch.Tensor, ck1: torch.Tensor, ck2: torch.Tensor,
    cu_seqlens_q: torch.Tensor, cu_seqlens_c1: torch.Tensor, cu_seqlens_c2: torch.Tensor,
    max_seqlen_q: int, *, causal: bool = True, cache_lens=None, softmax_scale: float | None = None,
    topk: int = 64, local_blocks: int = 32, init_blocks: int = 1,
    block_size: int = 64, kernel_stride: int = 16, coarse_kernel_stride: int = 64,
    varlen_offset_quirk: bool = False, score_dtype: torch.dtype | None = torch.bfloat16,
    return_scores: bool = False, kernel: str = "auto", plan: Stage1Plan | None = None,
    host_seqlens: HostSeqlens | None = None,
):
    """`stage1_select` on the kernels: every check, then one launch as `plan` says (None: the
    `stage1_plan` of these shapes for `kernel`). Same arguments and outputs as `stage1_select`."""
    check_kernel(kernel)
    # ---- checks, all before any launch
    if host_seqlens is None:
        check_max_seqlen("max_seqlen_q", max_seqlen_q, [])    # its bound rides on the cu_seqlens_q check
        G = check_stage1_inputs(q, ck1, ck2, cu_seqlens_q, cu_seqlens_c1, cu_seqlens_c2, max_seqlen_q)
    else:
        G = q.shape[1] // ck1.shape[1]                         # checked by the caller
    _kernel_checks(q, score_dtype, block_size, kernel_stride, coarse_kernel_stride, softmax_scale)
    if G > MAX_GROUP:
        raise ValueError(f"q has {q.shape[1]} heads for {ck1.shape[1]} KV heads (G = {G}); the stage-1 "
                         f"kernel supports G <= {MAX_GROUP}")
    _require_cuda(q)
    check_int_args(0, topk=topk, local_blocks=local_blocks, init_blocks=init_blocks)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    B = cu_seqlens_q.numel() - 1
    if isinstance(cache_lens, torch.Tensor) and cache_lens.device != q.device and cache_lens.is_cuda:
        raise ValueError(f"cache_lens must be on {q.device} or the CPU, got {cache_lens.device}")
    cache = check_lengths_arg("cache_lens", cache_lens, B, q.device)
    if cache_lens is None or B == 0:
        max_cache = 0
    elif isinstance(cache_lens, torch.Tensor):
        max_cache = int(cache_lens.max())          # one device-to-host copy for a CUDA tensor
    else:
        max_cache = max(int(x) for x in cache_lens)
    if max_cache + max_seqlen_q >= 2**31 - 64:
        raise ValueError(f"cache_lens + max_seqlen_q must stay below 2^31, got {max_cache} + {max_seqlen_q}")
    sdt = torch.float32 if score_dtype is None else score_dtype

    total_q, HQ, D = q.shape
    H = ck1.shape[1]
    out_len = cdiv(max_seqlen_q + max_cache, KV_BLOCK)
    smem_max, _smem_sm = _smem_limits(q.device)
    if plan is None:
        plan = device_stage1_plan(q.device, G, D, q.dtype, sdt, out_len, rows=ck1.shape[1] * q.shape[0],
                                  kernel=kernel)
    K = selection_slots(topk, local_blocks, out_len)
    if not return_scores:
        max_n1 = 0
    elif host_seqlens is None:
        max_n1 = max(seqlens_host(cu_seqlens_c1), default=0)
    else:
        max_n1 = max((b - a for a, b in itertools.pairwise(host_seqlens.c1)), default=0)
    ranged = plan.range_blocks > 0 and not return_scores and 0 < K <= plan.range_blocks
    # range passes allocate their output after their candidate buffers are freed (peak memory)
    topk_idx = None if ranged else empty((H, total_q, K), dtype=torch.int32, device=q.device)
    scores = empty((H, total_q, max_n1), dtype=sdt, device=q.device) if return_scores else None
    block_scores = empty((H, total_q, out_len), dtype=sdt, device=q.device) if return_scores else None
    if total_q == 0 or H == 0 or out_len == 0 or (K == 0 and not return_scores):
        if topk_idx is None:
            topk_idx = empty((H, total_q, K), dtype=torch.int32, device=q.device)
        return (topk_idx, scores, block_scores) if return_scores else topk_idx

    lgp = lgp_of(G)
    olp = cdiv(out_len, 64) * 64
    key_bytes = 4 if sdt == torch.float32 else 2
    sm90a = plan.kernel == SM90A
    tok = plan.tokens_per_cta(G)
    if tok == 0 or (sm90a and lgp > SM90_MAX_LGP):
        raise ValueError(f"the plan's {plan.kernel} CTA of {plan.warps} warps cannot hold a token's G = {G} "
                         "rows")
    n_tiles = cdiv(max_seqlen_q, tok)
    if n_tiles * B * H >= 2**31:
        raise ValueError(f"too many CTAs ({n_tiles} token tiles x {B} sequences x {H} heads)")
    if plan.range_blocks and not ranged:       # inspection outputs or K wider than a range: one launch
        plan = dataclasses.replace(plan, range_blocks=0)
    scratch = None
    if not plan.block_keys_in_smem and not ranged:
        scratch = torch.empty((H, total_q, olp), dtype=torch.int32 if key_bytes == 4 else torch.int16,
                              device=q.device)
    shared = plan.smem_bytes(G, D, q.element_size(), out_len, key_bytes)
    if shared > smem_max:
        raise ValueError(f"the stage-1 kernel needs {shared} B of shared memory for D = {D}, G = {G}; "
                         f"this device allows {smem_max}")

    q, ck1, ck2 = (t.contiguous() for t in (q, ck1, ck2))
    check_aligned(q=q, ck1=ck1, ck2=ck2)   # 16-byte rows: cp.async (both kernels), TMA (sm_90a)
    cache_dev = cache.to(torch.int32).contiguous() if cache_lens is not None else None
    scale = softmax_scale_of(softmax_scale, D)
    # the full launch's fields; a range pass replaces olp and the range fields
    fields = dict(q=q, ck1=ck1, ck2=ck2, cu_q=cu_seqlens_q, cu_c1=cu_seqlens_c1, cu_c2=cu_seqlens_c2,
                  cache_lens=cache_dev, topk_idx=topk_idx, scores=scores, block_scores=block_scores,
                  bs_scratch=scratch, total_q=total_q, HQ=HQ, H=H, G=G, lgp=lgp, B=B, n_tiles=n_tiles,
                  max_seqlen_q=max_seqlen_q, out_len=out_len, olp=olp, K=K, max_n1=max_n1,
                  init_blocks=init_blocks, local_blocks=local_blocks, quirk=1 if varlen_offset_quirk else 0,
                  causal=1 if causal else 0, kind=SCORE_KIND[sdt], s1=KERNEL_STRIDE, s2c=COARSE_STRIDE,
                  sl2=scale * 1.4426950408889634, topk_prefix=plan.topk_prefix,
                  j_lo=0, j_hi=out_len, cand_key=None, cand_idx=None, row_bias=None, bias_mode=0)

    name = kernel_name(q.dtype, sdt, D, sm90a, ranged, packed=plan.packed and sdt != torch.float32)
    kernel_fn = _jit.get_kernel(SOURCE_SM90, name, sm90a=True) if sm90a else _jit.get_kernel(SOURCE, name)
    decl = SELECT_SM90_PARAMS if sm90a else SELECT_PARAMS
    if sm90a:   # the key tiles come by TMA (docs/stage1.md, 3.): a map per compressed-key tensor
        fields.update(tm1=_key_map(ck1), tm2=_key_map(ck2))
    if not ranged:
        launch(kernel_fn, name=name, grid=(n_tiles * B * H,), block=(32 * plan.warps,), shared_mem=shared,
               params=decl.pack(**fields))
        return (topk_idx, scores, block_scores) if return_scores else topk_idx

    # ---- range passes (docs/stage1.md, 9. Long context: key ranges): the first keeps each row's
    # coarse-pass bias for the others; each writes K candidates per token, merged into `run`
    W = plan.range_blocks
    ranges = [(j, min(out_len, j + W)) for j in range(0, out_len, W)]
    # filled: a later pass loads every row's bias up front, also for CTAs without coarse tiles, whose
    # biases the first pass never stores (and the loads never use): defined values for initcheck
    row_bias = torch.full((total_q, HQ), float("inf"), dtype=torch.float32, device=q.device) \
        if len(ranges) > 1 else None
    cand_key = torch.empty((H, total_q, K), dtype=torch.int32, device=q.device)
    cand_idx = torch.empty((H, total_q, K), dtype=torch.int32, device=q.device)
    run = None
    for i, (j_lo, j_hi) in enumerate(ranges):
        bias_mode = 0 if row_bias is None else (1 if i == 0 else 2)
        launch(kernel_fn, name=name, grid=(n_tiles * B * H,), block=(32 * plan.warps,), shared_mem=shared,
               params=decl.pack(**fields | dict(olp=64 + W, j_lo=j_lo, j_hi=j_hi, cand_key=cand_key,
                                                cand_idx=cand_idx, row_bias=row_bias, bias_mode=bias_mode)))
        run = _merge_into(run, cand_key, cand_idx, K)
    del cand_key, cand_idx, row_bias
    lq = seqlens_host(cu_seqlens_q) if host_seqlens is None else host_seqlens.lq
    q_blocks = q_block_idx_checked(cu_seqlens_q, lq, cache, max_seqlen_q,
                                   varlen_offset_quirk=varlen_offset_quirk)
    return _run_to_topk(run, q_blocks)


def _run_to_topk(run: torch.Tensor, q_blocks: torch.Tensor) -> torch.Tensor:
    """The merged run's blocks as `topk_idx`: int32 `[H, total_q, K]`, ascending per row, blocks after
    the token's query block (`q_blocks[t]`) as -1. Token chunks bound the int64 temporaries."""
    H, T, K = run.shape
    out = empty((H, T, K), dtype=torch.int32, device=run.device)
    qb = q_blocks.to(run.device, torch.int32)
    low = (1 << _IDX_BITS) - 1
    step = max(1, _FINAL_ELEMS // max(1, H * K))
    for t in range(0, T, step):
        idx = (low - (run[:, t:t + step] & low)).to(torch.int32).sort(dim=-1).values
        out[:, t:t + step] = idx.masked_fill(idx > qb[None, t:t + step, None], -1)
    return out


def _key_map(ck: torch.Tensor) -> np.ndarray:
    """The sm_90a kernel's tensor map over compressed keys `[n, H, D]` (checked aligned): boxes of 64
    rows by 64 elements of the `[n, H * D]` view; a zero map for an empty tensor (no tile reads it)."""
    if ck.shape[0] == 0:
        return np.zeros(1, dtype=TMAP_DTYPE)
    return rows_map(ck.view(ck.shape[0], -1), KV_BLOCK)


def _merge_into(run: torch.Tensor | None, cand_key: torch.Tensor, cand_idx: torch.Tensor,
                K: int) -> torch.Tensor:
    """The top-K of the union of the running candidates and one range's, as int64 merge keys
    `(block key << 31) | (2^31 - 1 - block)`: larger is better, ties to the lower block (the block
    keys are the kernels' order-preserving score keys, zero-extended from 16 or 32 bits). `run`
    None: the first range. The merge kernel up to `MERGE_KERNEL_UP_TO_K` (its rows sorted
    descending), the torch merge beyond (unsorted rows); the final step sorts by block index either way."""
    if K <= MERGE_KERNEL_UP_TO_K:
        return _merge_into_kernel(run, cand_key, cand_idx, K)
    return _merge_into_torch(run, cand_key, cand_idx, K)


def _merge_into_kernel(run: torch.Tensor | None, cand_key: torch.Tensor, cand_idx: torch.Tensor,
                       K: int) -> torch.Tensor:
    """`_merge_into` on kernels_cu/stage1/merge_cand.cu, in place in `run` (which must be sorted
    descending per row, as this function leaves it); returns `run`, or a new `[H, total_q, K]` int64
    holding the sorted candidates when `run` is None. `cand_key` / `cand_idx`: int32 `[H, total_q, K]`."""
    if not 1 <= K <= MERGE_MAX_K:
        raise ValueError(f"K must be in [1, {MERGE_MAX_K}] for the merge kernel, got {K}")
    if cand_key.shape != cand_idx.shape or cand_key.dim() != 3 or cand_key.shape[-1] != K:
        raise ValueError(f"cand_key and cand_idx must both have shape [H, total_q, K = {K}], got "
                         f"{tuple(cand_key.shape)} and {tuple(cand_idx.shape)}")
    if cand_key.dtype != torch.int32 or cand_idx.dtype != torch.int32:
        raise TypeError(f"cand_key and cand_idx must be int32, got {cand_key.dtype} and {cand_idx.dtype}")
    if run is not None and (run.shape != cand_key.shape or run.dtype != torch.int64
                            or not run.is_contiguous()):
        raise ValueError(f"run must be a contiguous int64 tensor of shape {tuple(cand_key.shape)}, got "
                         f"{run.dtype} {tuple(run.shape)}")
    out = empty(tuple(cand_key.shape), dtype=torch.int64, device=cand_key.device) if run is None else run
    rows = cand_key.shape[0] * cand_key.shape[1]
    ni = next(n for n in MERGE_ITEMS if 32 * n >= K)
    name = f"merge_range_candidates<{ni}>"
    launch(_jit.get_kernel(MERGE_SOURCE, name), name=name, grid=(cdiv(rows, MERGE_WARPS),),
           block=(32 * MERGE_WARPS,), shared_mem=MERGE_WARPS * 2 * K * 8,
           params=MERGE_PARAMS.pack(cand_key=cand_key, cand_idx=cand_idx, run=out, rows=rows, K=K,
                                    has_run=0 if run is None else 1))
    return out


def _merge_into_torch(run: torch.Tensor | None, cand_key: torch.Tensor, cand_idx: torch.Tensor,
                      K: int) -> torch.Tensor:
    """`_merge_into` in torch ops (the reference of the merge kernel, and the path past
    `MERGE_MAX_K`): `torch.topk` over the union, chunked over tokens; rows unsorted."""
    new = (((cand_key.to(torch.int64) & 0xFFFFFFFF) << _IDX_BITS)
           | ((1 << _IDX_BITS) - 1 - cand_idx.to(torch.int64)))
    if run is None:
        return new
    H, T, _ = run.shape
    step = max(1, _MERGE_ELEMS // max(1, H * 2 * K))
    for t in range(0, T, step):
        both = torch.cat([run[:, t:t + step], new[:, t:t + step]], dim=-1)
        run[:, t:t + step] = torch.topk(both, K, dim=-1, sorted=False).values
    return run
