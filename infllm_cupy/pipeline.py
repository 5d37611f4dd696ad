"""InfLLM-v2 prefill attention, the public API (spec section 9): `infllmv2_attention`, its module form
`InfLLMv2Attention`, `infllmv2_attention_host_lengths` for callers that know the lengths, and
`naive_infllmv2_attention`, the reference of the whole pipeline.

Each entry checks its inputs once and reads both `cu_seqlens` to the host once, then runs the
prefill body of `prefill.py` (compression, stage 1 and top-k under `no_grad`, stage 2; dense
attention below `dense_len`). The configuration is `config.py`'s.
"""
from __future__ import annotations

import dataclasses

import torch

from ._checks import HostSeqlens, check_attn_inputs, check_flags, check_max_seqlen, check_tensor
from ._dtypes import REF_DTYPES
from ._rules import check_backend, check_precision, runs_cpu, runs_kernels
from .config import InfLLMv2Config, check_config
from .prefill import check_prefill_inputs, prefill


def naive_infllmv2_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                             cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                             config: InfLLMv2Config | None = None, *, return_aux: bool = False):
    r"""InfLLM-v2 prefill attention (PyTorch reference of the whole pipeline).

    Keys are mean-compressed (32/16 and 128/64), stage 1 scores them for every query token, the scores
    are max-pooled into 64-token blocks with the init and local blocks forced, the top
    `K = topk + local_blocks` blocks are kept (the forced ones among them; see `InfLLMv2Config`), and
    stage 2 attends causally (bottom-right aligned) over them. Stage 1 takes no gradient; `q`, `k`,
    `v` get theirs through stage 2. When the longest key
    sequence is shorter than `config.dense_len`, plain dense causal attention is used instead.
    Query sequences shorter than their key sequences are chunked prefill: the first `Lk - Lq` keys
    are the cache.

    Args:
        q (torch.Tensor):
            Queries `[total_q, HQ, D]` (bf16, fp16 or fp32).
        k, v (torch.Tensor):
            Keys (post-RoPE) and values `[total_k, H, D]`; `HQ` a multiple of `H`.
        cu_seqlens_q, cu_seqlens_k (torch.Tensor):
            int32 `[B+1]`; every `Lq <= Lk`.
        max_seqlen_q, max_seqlen_k (int):
            Longest query / key sequence.
        config (InfLLMv2Config, Optional):
            Default: `None` (MiniCPM4 defaults).
        return_aux (bool, Optional):
            Also return a dict of intermediates: `dense`, `ck1`, `ck2`, `cu_seqlens_c1`, `cu_seqlens_c2`,
            `scores`, `block_scores`, `topk_idx` (all None on the dense path). Default: `False`.

    Returns:
        out (torch.Tensor): `[total_q, HQ, D]` in q's dtype (and the aux dict with `return_aux`).
    """
    cfg = check_config(config)
    check_flags(return_aux=return_aux)
    check_max_seqlen("max_seqlen_q", max_seqlen_q, [])     # required here: ints, not None
    check_max_seqlen("max_seqlen_k", max_seqlen_k, [])
    host, _, _ = check_prefill_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, cfg, kernels=False,
                   host_seqlens=host, return_aux=return_aux)


def infllmv2_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                       cu_seqlens_k: torch.Tensor | None = None, max_seqlen_q: int | None = None,
                       max_seqlen_k: int | None = None, config: InfLLMv2Config | None = None, *,
                       backend: str = "auto", return_aux: bool = False, precision: str | None = None):
    r"""InfLLM-v2 prefill attention: compression -> stage 1 -> top-k -> stage 2, on kernels where they exist.

    Same semantics as `naive_infllmv2_attention` (MiniCPM4 defaults: kernels 32/16 and 128/64,
    64-key blocks, `topk = 64` with `local_blocks = 32`: K = 96 blocks per query token, of which
    1 init and 33 local blocks are forced and 62 picked by score (`InfLLMv2Config`), dense attention
    when the longest key sequence is shorter than `dense_len = 8192`). Causal masking is aligned
    bottom-right, so a query chunk shorter than its keys (chunked prefill) sees the cache. With
    `block_size = 2`, `Lq = 2`, `Lk = 6` and a token that selected blocks `{0, 2}` (the last query):

        keys   0 1 2 3 4 5
        mask   1 1 0 0 1 1

    Which implementation runs each stage (`runs_kernels`; the `run_*` stages of prefill.py): for
    CUDA tensors with `backend` "auto" or "kernels", key compression, stage 1 (scores, pooling, top-k
    in one launch) and stage 2 are the CUDA kernels, and the dense fallback is torch SDPA per
    sequence. CPU tensors under "auto" run the stages' CPU implementations where they have one (key
    compression and stage 1: `runs_cpu`, chunked fp32 GEMMs) and the references elsewhere;
    `backend="reference"` runs every stage's reference (the oracle) on any device; `backend="kernels"`
    refuses CPU tensors (ValueError naming q), as every entry point does.

    Gradients: `q`, `k` and `v` get theirs through stage 2 (the stage-2 backward kernel on the
    kernel path, the reference's backward on CPU tensors, autograd of the reference with
    `backend="reference"`) or through the dense fallback (SDPA's own backward, or the reference's
    autograd with `backend="reference"`); compression, stage 1 and top-k run under `torch.no_grad()`
    and give none, as in InfLLM-v2 (the selection is not trained).

    Args:
        q (torch.Tensor):
            Queries `[total_q, HQ, D]`. Kernel path: bf16 or fp16, `D` in {64, 128}.
        k, v (torch.Tensor):
            Keys (post-RoPE) and values `[total_k, H, D]`, q's dtype; `HQ` a multiple of `H`.
        cu_seqlens_q (torch.Tensor):
            int32 `[B+1]`.
        cu_seqlens_k (torch.Tensor, Optional):
            int32 `[B+1]`, every `Lq <= Lk`. Default: `None` (`cu_seqlens_q`: plain prefill).
        max_seqlen_q, max_seqlen_k (int, Optional):
            Longest query / key sequence. Default: `None` (read from the `cu_seqlens`).
        config (InfLLMv2Config, Optional):
            Default: `None` (MiniCPM4 defaults). The kernel path needs `block_size = 64`.
        backend (str, Optional):
            "auto", "kernels" or "reference". Default: "auto".
        return_aux (bool, Optional):
            Also return the intermediates dict of `naive_infllmv2_attention`. Default: `False`.
        precision (str, Optional):
            Stage 2's plan, in place of `config.precision` (`InfLLMv2Config`): "16bit" or "int8-fp8"
            (the 8-bit forward, docs/stage2_q8.md: no gradients, CPU tensors only for now; the dense
            fallback stays in 16 bits). Default: `None` (the config's).

    Returns:
        out (torch.Tensor): `[total_q, HQ, D]` in q's dtype (and the aux dict with `return_aux`).

    Raises:
        ValueError: bad inputs (naming the argument), a `backend` outside `BACKENDS`, or what the
            kernel path cannot do (`config.block_size != 64`, dtype, head dim), before any launch.
        NotImplementedError: CUDA tensors on precision "int8-fp8" (its kernels are not yet verified
            on hardware).

    Host synchronisation: one device-to-host copy per call, of both `cu_seqlens` at once, by the
    checks here; the stages below take that copy and read nothing back.
    """
    cfg = with_precision(check_config(config), precision)
    check_backend(backend)
    check_flags(return_aux=return_aux)
    if cu_seqlens_k is None:
        # k shares q's cu_seqlens: a mismatch is one of the tensors the user passed, not of a
        # cu_seqlens_k they never gave.
        check_tensor("q", q, ndim=3, dtypes=REF_DTYPES)
        check_tensor("k", k, ndim=3)
        if k.shape[0] != q.shape[0]:
            raise ValueError(f"k has {k.shape[0]} rows but q has {q.shape[0]}: without cu_seqlens_k, k and v "
                             f"share q's cu_seqlens_q (pass cu_seqlens_k for keys longer than the queries)")
        cu_seqlens_k = cu_seqlens_q
    # every check here, on one host copy of both cu_seqlens; the stages below neither check nor read again
    host, max_seqlen_q, max_seqlen_k = check_prefill_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                            max_seqlen_k)
    return prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, cfg,
                   kernels=runs_kernels(q, backend), cpu=runs_cpu(q, backend), host_seqlens=host,
                   return_aux=return_aux)


def infllmv2_attention_host_lengths(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                    cu_seqlens_q: torch.Tensor,
                                    cu_seqlens_k: torch.Tensor, seqlens_q: list[int], seqlens_k: list[int],
                                    config: InfLLMv2Config | None = None, *, backend: str = "auto",
                                    compressed: tuple | None = None) -> torch.Tensor:
    r"""`infllmv2_attention` for a caller that knows the sequence lengths on the host (the transformers
    integration, docs/integrations.md "How the backend maps HF's calls"): the lengths are not read back
    from `cu_seqlens_*` (a device-to-host sync per call), and `compressed` may hand over k's compressed
    keys (e.g. a `DecodeCache`'s) instead of compressing k again. Same outputs as `infllmv2_attention`
    when `compressed` is what `compress_k` gives for k.

    Args:
        q, k, v, cu_seqlens_q, cu_seqlens_k, config, backend:
            As in `infllmv2_attention` (`cu_seqlens_k` required).
        seqlens_q, seqlens_k (list[int]):
            Per-sequence query and key lengths, the differences of `cu_seqlens_q` / `cu_seqlens_k`
            (trusted: only their sums and `Lq <= Lk` are checked, on the host).
        compressed (tuple, Optional):
            `(ck1, cu_seqlens_c1, ck2, cu_seqlens_c2)` of k with the config's kernel sizes and strides
            (packed varlen, as `compress_k` returns them), or None to compress here. Default: `None`.

    Returns:
        out (torch.Tensor): `[total_q, HQ, D]` in q's dtype.
    """
    cfg = check_config(config)
    check_backend(backend)
    check_attn_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k)
    for name, lens, total, cu in (("seqlens_q", seqlens_q, q.shape[0], cu_seqlens_q),
                                  ("seqlens_k", seqlens_k, k.shape[0], cu_seqlens_k)):
        if (not isinstance(lens, (list, tuple)) or len(lens) != cu.numel() - 1
                or any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in lens)
                or sum(lens) != total):
            raise ValueError(f"{name} must be {cu.numel() - 1} non-negative ints summing to {total}, got "
                             f"{list(lens)[:16] if isinstance(lens, (list, tuple)) else lens!r}")
    if any(a > b for a, b in zip(seqlens_q, seqlens_k)):
        raise ValueError(f"seqlens_q: every query length must be <= its key length, got {seqlens_q} vs "
                         f"{seqlens_k}")
    if compressed is not None:
        if not isinstance(compressed, (tuple, list)) or len(compressed) != 4:
            raise ValueError("compressed must be (ck1, cu_seqlens_c1, ck2, cu_seqlens_c2) or None")
        for name, t in zip(("ck1", "ck2"), compressed[0::2]):
            check_tensor(name, t, ndim=3, dtypes=(k.dtype,), shape=(None, k.shape[1], k.shape[2]),
                         device=k.device)
        for name, t in zip(("cu_seqlens_c1", "cu_seqlens_c2"), compressed[1::2]):
            check_tensor(name, t, shape=(cu_seqlens_k.numel(),), dtypes=(torch.int32,), device=k.device)
    # the offsets on the host from the given lengths: nothing below reads cu_seqlens back
    host = HostSeqlens.from_lengths(seqlens_q, seqlens_k)
    return prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, max(seqlens_q, default=0), max(seqlens_k, default=0),
                   cfg, kernels=runs_kernels(q, backend), cpu=runs_cpu(q, backend), host_seqlens=host,
                   compressed=compressed)


def with_precision(cfg: InfLLMv2Config, precision: str | None) -> InfLLMv2Config:
    """`cfg` with `precision` in place of its own (checked, naming the argument), or `cfg` for None."""
    if precision is None or check_precision(precision) == cfg.precision:
        return cfg
    return dataclasses.replace(cfg, precision=precision)      # the config's own checks run again


class InfLLMv2Attention(torch.nn.Module):
    r"""`infllmv2_attention` as a module that holds its configuration (no parameters).

    Args:
        config (InfLLMv2Config, Optional):
            Default: `None` (MiniCPM4 defaults).
        backend (str, Optional):
            "auto", "kernels" or "reference" (see `infllmv2_attention`). Default: "auto".
        precision (str, Optional):
            Stage 2's plan in place of `config.precision`: "16bit" or "int8-fp8" (see
            `infllmv2_attention`). Default: `None` (the config's).

    Example:
        >>> attn = InfLLMv2Attention(InfLLMv2Config(dense_len=0))
        >>> out = attn(q, k, v, cu_seqlens)            # q [total, HQ, D], k, v [total, H, D]
    """

    def __init__(self, config: InfLLMv2Config | None = None, *, backend: str = "auto",
                 precision: str | None = None):
        super().__init__()
        self.config = with_precision(check_config(config), precision)
        self.backend = check_backend(backend)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                cu_seqlens_k: torch.Tensor | None = None, max_seqlen_q: int | None = None,
                max_seqlen_k: int | None = None) -> torch.Tensor:
        r"""Attention output `[total_q, HQ, D]`.

        Args:
            q (torch.Tensor):
                `[total_q, HQ, D]`.
            k, v (torch.Tensor):
                `[total_k, H, D]`.
            cu_seqlens_q (torch.Tensor):
                int32 `[B+1]`.
            cu_seqlens_k (torch.Tensor, Optional):
                int32 `[B+1]`. Default: `None` (`cu_seqlens_q`).
            max_seqlen_q, max_seqlen_k (int, Optional):
                Default: `None` (computed from the `cu_seqlens`, one host read).
        """
        return infllmv2_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  self.config, backend=self.backend)

    def extra_repr(self) -> str:
        return f"backend={self.backend!r}, config={self.config}"
