"""dkernel-like attention modules over static block patterns (docs/patterns.md, "Modules").

`SparseAttention(block_size, block_sparse_pattern)` runs any per-head block pattern and
`LocalStrideSparseAttention(...)` dkernel's local + vertical-stride pattern, both on
`block_sparse_attn_varlen` (kernels for CUDA tensors, the reference for CPU tensors), forward and
backward, with dkernel's call conventions: batch-first `[B, T, H, D]` (or `[B, H, T, D]` with
`seq_dim=2`) with optional right (`seqlens`) or left (`left_paddings`) padding, or packed
`[total, H, D]` with `cu_seqlens`; positional `sm_scale`; GQA.
"""
from __future__ import annotations

import math

import torch

from .._checks import check_bool, check_cu_seqlens, check_int_args, check_tensor, seqlens_host
from .._kernel_arg import check_kernel
from .._rules import check_backend, check_block_multiple
from ..stage2.attention import block_sparse_attn_varlen, qhead_block_sparse_attn_varlen
from ..stage2.layout import BlockLayout
from .local_stride import expand_blocks, per_kv_head


def dkernel_local_stride_mask(num_heads: int, max_seq_len: int, block_size: int, local_blocks: int,
                              vert_stride: int, *, homo_head: bool = False, num_kv_heads: int | None = None,
                              head_sliding_offset: int = 0, num_dense_heads: int = 0) -> torch.Tensor:
    """dkernel's local + vertical-stride pattern over blocks of `block_size`: bool `[P, NB, NB]`.

    Block (i, j) is kept when `j <= i` and either `i - j < local_blocks` or
    `(j + p * step + head_sliding_offset) % vert_stride == 0`, for pattern head p. There is one
    pattern head for `homo_head=True`, else one per KV head when `num_kv_heads` groups query heads
    (the G query heads of a group share it), else one per query head; `step` is
    `max(1, vert_stride // P)` (0 for homogeneous heads). The last `num_dense_heads` pattern heads are
    causal-dense. This differs from vLLM's `local_stride` by the column offset: dkernel's offset 0
    keeps block 0 at head 0, vLLM's rule `(j + h * step + 1) % vert_stride` is dkernel's offset 1.
    """
    check_int_args(1, num_heads=num_heads, max_seq_len=max_seq_len, block_size=block_size,
                   local_blocks=local_blocks, vert_stride=vert_stride)
    check_int_args(0, head_sliding_offset=head_sliding_offset, num_dense_heads=num_dense_heads)
    check_bool("homo_head", homo_head)
    if num_kv_heads is not None:
        check_int_args(1, num_kv_heads=num_kv_heads)
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
    if homo_head and num_dense_heads:
        raise ValueError("num_dense_heads must be 0 with homo_head=True (one pattern for every head)")
    n_pat = 1 if homo_head else (num_kv_heads or num_heads)
    if num_dense_heads > n_pat:
        raise ValueError(f"num_dense_heads={num_dense_heads} exceeds the {n_pat} pattern heads")
    step = 0 if homo_head else max(1, vert_stride // n_pat)
    nb = -(-max_seq_len // block_size)
    i = torch.arange(nb)[:, None]
    j = torch.arange(nb)[None, :]
    p = torch.arange(n_pat)[:, None, None]
    vertical = (j[None] + p * step + head_sliding_offset) % vert_stride == 0
    vertical = vertical | (p >= n_pat - num_dense_heads)
    return ((i >= j) & ((i - j < local_blocks) | vertical)).contiguous()


class SparseAttention(torch.nn.Module):
    r"""Attention under a static per-head block pattern, dkernel's `SparseAttention` on our kernels.

    Query block i (tokens `[i*block_size, (i+1)*block_size)` of a sequence) attends key block j when
    `block_sparse_pattern[h, i, j]`; with `causal=True` (dkernel's only mode) keys after the query
    are masked at token level, so the diagonal block is lower-triangular. `block_size` must be a
    multiple of 64 (our key blocks; ValueError otherwise). Rows with no allowed key give output 0.

    Heads of the pattern: 1 (shared), the KV head count (each group of G query heads shares its KV
    head's row: no cost) or the query head count. A per-query-head pattern whose G heads agree in
    every group collapses to the KV-head layout (`per_kv_head`); where they differ the module runs
    the layout per query head through `qhead_block_sparse_attn_varlen`: the CUDA forward and
    backward read k/v at H heads (one query head per CTA, no copy); the backward's dk, dv are summed
    over the group from per-query-head partials. The `BlockLayout` is built
    once per (head counts, device) and cached.

    Args:
        block_size (int): tokens per pattern block (queries and keys), a multiple of 64.
        block_sparse_pattern (torch.Tensor): bool (or 0/1 integer) `[NB, NB]` or `[P, NB, NB]`;
            sequences up to `NB * block_size` tokens.
        seq_dim (int, Optional): keyword-only, as all after it. Sequence axis of 4-D inputs: 1 for
            `[B, T, H, D]`, 2 for `[B, H, T, D]`. Default: 1.
        causal (bool, Optional): Default: True.
        backend, kernel (str, Optional): passed to `block_sparse_attn_varlen`. Default: "auto".
    """

    def __init__(self, block_size: int, block_sparse_pattern: torch.Tensor, *, seq_dim: int = 1,
                 causal: bool = True, backend: str = "auto", kernel: str = "auto"):
        super().__init__()
        check_block_multiple(block_size=block_size)        # dkernel's 16 and 32 are not whole key blocks
        check_tensor("block_sparse_pattern", block_sparse_pattern)
        if block_sparse_pattern.dim() == 2:
            block_sparse_pattern = block_sparse_pattern[None]
        shape = tuple(block_sparse_pattern.shape)
        if len(shape) != 3 or shape[-1] != shape[-2] or shape[-1] == 0:
            raise ValueError(f"block_sparse_pattern must be [NB, NB] or [num_heads, NB, NB] (square, "
                             f"NB > 0), got shape {shape}")
        if block_sparse_pattern.dtype != torch.bool:
            if block_sparse_pattern.is_floating_point() or block_sparse_pattern.is_complex():
                raise TypeError(f"block_sparse_pattern must be bool or integer 0/1, "
                                f"got {block_sparse_pattern.dtype}")
            block_sparse_pattern = block_sparse_pattern != 0
        if seq_dim not in (1, 2) or isinstance(seq_dim, bool):
            raise ValueError(f"seq_dim must be 1 ([B, T, H, D]) or 2 ([B, H, T, D]), got {seq_dim!r}")
        check_bool("causal", causal)
        check_backend(backend)
        check_kernel(kernel)
        self.block_size = block_size
        self.seq_dim = seq_dim
        self.causal = causal
        self.backend = backend
        self.kernel = kernel
        self.max_seqlen = block_sparse_pattern.shape[-1] * block_size
        self.register_buffer("block_sparse_pattern", block_sparse_pattern.detach().clone(), persistent=False)
        self._layouts: dict = {}

    @property
    def num_pattern_heads(self) -> int:
        return self.block_sparse_pattern.shape[0]

    def extra_repr(self) -> str:
        return (f"block_size={self.block_size}, pattern_heads={self.num_pattern_heads}, "
                f"max_seqlen={self.max_seqlen}, seq_dim={self.seq_dim}, causal={self.causal}")

    def layout_for(self, num_q_heads: int, num_kv_heads: int, device) -> tuple[BlockLayout, bool]:
        """`(layout, expand_kv)` for these head counts: the cached `BlockLayout` over 64-key blocks on
        `device`, and whether it is per query head (the pattern's query heads of a group differ:
        the call then runs `qhead_block_sparse_attn_varlen`, no K/V repeat in the CUDA kernels)."""
        device = torch.device(device)
        key = (num_q_heads, num_kv_heads, device)
        hit = self._layouts.get(key)
        if hit is not None:
            return hit
        if num_kv_heads <= 0 or num_q_heads % num_kv_heads:
            raise ValueError(f"q has {num_q_heads} heads and k has {num_kv_heads}: the query head count must "
                             f"be a positive multiple of the key/value head count")
        G = num_q_heads // num_kv_heads
        P = self.num_pattern_heads
        base = expand_blocks(self.block_sparse_pattern.cpu(), self.block_size, self.max_seqlen)
        expand = False
        if P == 1:
            layout = BlockLayout(base.mask.expand(num_kv_heads, -1, -1).contiguous(), base.q_block)
        elif P == num_kv_heads:
            layout = base
        elif P == num_q_heads:
            layout = per_kv_head(base, G)
            if layout is None:
                layout, expand = base, True
        else:
            raise ValueError(f"block_sparse_pattern has {P} heads; q has {num_q_heads} and k has "
                             f"{num_kv_heads} (the pattern needs 1, {num_kv_heads} or {num_q_heads} heads)")
        hit = (BlockLayout(layout.mask.to(device), layout.q_block), expand)
        self._layouts[key] = hit
        return hit

    def _apply(self, fn, *args, **kwargs):
        # a move (.to / .cuda) invalidates nothing in the cache, which is keyed by device, but a dtype
        # or in-place change of the pattern buffer would: start over
        self._layouts = {}
        return super()._apply(fn, *args, **kwargs)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float | None = None, *,
                cu_seqlens: torch.Tensor | None = None, max_seqlen: int | None = None,
                seqlens: torch.Tensor | None = None, left_paddings: torch.Tensor | None = None,
                cu_seqlen_q: torch.Tensor | None = None,
                cu_seqlen_k: torch.Tensor | None = None) -> torch.Tensor:
        r"""Attention of q over k, v under the pattern (prefill: queries and keys are the same tokens).

        Args:
            q, k, v (torch.Tensor): batch-first `[B, T, HQ, D]` / `[B, T, H, D]` (`seq_dim=1`) or
                `[B, HQ, T, D]` (`seq_dim=2`); or packed `[total, HQ, D]` / `[total, H, D]` with
                `cu_seqlens`. Same dtype and device; HQ a multiple of H.
            sm_scale (float, Optional): softmax scale (positional, as in dkernel). Default: `D ** -0.5`.
            cu_seqlens (torch.Tensor, Optional): keyword-only, as all after it. int32 `[B+1]`, for packed
                3-D inputs (required for them, refused for 4-D ones).
            max_seqlen (int, Optional): longest packed sequence (else read from `cu_seqlens`, one host copy).
            seqlens (torch.Tensor, Optional): `[B]` valid lengths of 4-D inputs with right padding.
            left_paddings (torch.Tensor, Optional): `[B]` pad tokens before each 4-D sequence
                (its tokens are `[left_paddings[b], T)`). Padded positions of the output are 0 and get
                no gradient; either padding costs one host copy of the lengths.
            cu_seqlen_q, cu_seqlen_k (torch.Tensor, Optional): dkernel's spelling of `cu_seqlens`; both
                must describe the same lengths (decode, one query against a longer cache, is
                `pattern_decode`).

        Returns:
            out (torch.Tensor): q's shape and dtype.
        """
        cu_seqlens = self._cu_alias(cu_seqlens, cu_seqlen_q, cu_seqlen_k)
        for name, t in (("q", q), ("k", k), ("v", v)):
            check_tensor(name, t)
        if q.dim() == 3:
            if cu_seqlens is None:
                raise ValueError("cu_seqlens is required for packed 3-D inputs q [total, HQ, D]")
            if seqlens is not None or left_paddings is not None:
                raise ValueError("seqlens and left_paddings are for 4-D inputs; packed inputs take "
                                 "cu_seqlens")
            return self._packed(q, k, v, sm_scale, cu_seqlens, max_seqlen)
        if q.dim() != 4:
            raise ValueError(f"q must be 4-D [B, T, H, D] / [B, H, T, D] or packed 3-D [total, H, D], "
                             f"got shape {tuple(q.shape)}")
        if cu_seqlens is not None:
            raise ValueError("cu_seqlens is for packed 3-D inputs; 4-D inputs take seqlens or left_paddings")
        for name, t in (("k", k), ("v", v)):
            if t.dim() != 4:
                raise ValueError(f"{name} must be 4-D like q, got shape {tuple(t.shape)}")
        if seqlens is not None and left_paddings is not None:
            raise ValueError("pass seqlens (right padding) or left_paddings, not both")
        sd = self.seq_dim
        qb, kb, vb = (t if sd == 1 else t.transpose(1, 2) for t in (q, k, v))   # [B, T, H, D]
        B, T = qb.shape[0], qb.shape[1]
        if kb.shape[:2] != (B, T) or vb.shape[:2] != (B, T):
            raise ValueError(f"k and v must have q's batch and sequence sizes {(B, T)} on dims 0 and {sd}, "
                             f"got k {tuple(k.shape)}, v {tuple(v.shape)}")
        if T > self.max_seqlen:
            raise ValueError(f"q has {T} tokens on seq_dim={sd} but the pattern covers {self.max_seqlen} "
                             f"({self.block_sparse_pattern.shape[-1]} blocks of {self.block_size})")
        if B == 0:
            return q.new_zeros(q.shape)
        if seqlens is None and left_paddings is None:
            cu = torch.arange(B + 1, dtype=torch.int32, device=q.device) * T
            out = self._run(*(t.reshape(B * T, *t.shape[2:]) for t in (qb, kb, vb)), sm_scale, cu, max(1, T))
            out = out.view(B, T, *out.shape[1:])
            return out if sd == 1 else out.transpose(1, 2)
        # padded batch: gather the valid tokens into the packed form and scatter the output back
        name, lens = ("seqlens", seqlens) if seqlens is not None else ("left_paddings", left_paddings)
        check_tensor(name, lens, ndim=1, shape=(B,), dtypes=(torch.int32, torch.int64))
        host = lens.detach().to("cpu", torch.int64)
        if bool((host < 0).any()) or bool((host > T).any()):
            raise ValueError(f"{name} must be in [0, {T}], got {host.tolist()[:16]}")
        pos = torch.arange(T)
        valid = pos[None] < host[:, None] if seqlens is not None else pos[None] >= host[:, None]   # [B, T]
        n = valid.sum(1)
        flat = valid.reshape(-1).nonzero().squeeze(1).to(q.device)
        cu = torch.zeros(B + 1, dtype=torch.int32)
        cu[1:] = n.cumsum(0).to(torch.int32)
        packed = [t.reshape(B * T, *t.shape[2:]).index_select(0, flat) for t in (qb, kb, vb)]
        out_p = self._run(*packed, sm_scale, cu.to(q.device), max(1, int(n.max())) if B else 1)
        out = out_p.new_zeros((B * T, *out_p.shape[1:])).index_copy(0, flat, out_p)
        out = out.view(B, T, *out_p.shape[1:])
        return out if sd == 1 else out.transpose(1, 2)

    @staticmethod
    def _cu_alias(cu_seqlens, cu_q, cu_k):
        given = [t for t in (cu_seqlens, cu_q, cu_k) if t is not None]
        if not given:
            return None
        first = given[0]
        for t in given[1:]:
            check_tensor("cu_seqlen_k", t)
            if t is not first and (t.shape != first.shape or not torch.equal(t.cpu(), first.cpu())):
                raise ValueError("cu_seqlen_q and cu_seqlen_k (and cu_seqlens) must describe the same "
                                 "lengths: the modules run prefill; decode over a static pattern is "
                                 "pattern_decode")
        return first

    def _packed(self, q, k, v, sm_scale, cu, max_seqlen):
        B = cu.numel() - 1 if isinstance(cu, torch.Tensor) else 0
        check_cu_seqlens("cu_seqlens", cu, total=q.shape[0], device=q.device, max_seqlen=max_seqlen,
                         batch_name="cu_seqlens")
        if k.dim() != 3 or v.dim() != 3 or k.shape[0] != q.shape[0] or v.shape[0] != q.shape[0]:
            raise ValueError(f"k and v must be packed [total, H, D] with q's {q.shape[0]} tokens, "
                             f"got k {tuple(k.shape)}, v {tuple(v.shape)}")
        if max_seqlen is None:
            max_seqlen = max(seqlens_host(cu), default=0) if B else 0
        if max_seqlen > self.max_seqlen:
            raise ValueError(f"max_seqlen={max_seqlen} exceeds the pattern's {self.max_seqlen} tokens "
                             f"({self.block_sparse_pattern.shape[-1]} blocks of {self.block_size})")
        return self._run(q, k, v, sm_scale, cu, max(1, max_seqlen))

    def _run(self, q, k, v, sm_scale, cu, max_seqlen):
        if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
            raise ValueError(f"q has {q.shape[1]} heads and k has {k.shape[1]}: the query head count must "
                             f"be a positive multiple of the key/value head count")
        if sm_scale is not None and (isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float))
                                     or not math.isfinite(sm_scale) or sm_scale <= 0):
            raise ValueError(f"sm_scale must be a positive finite float or None, got {sm_scale!r}")
        layout, expand = self.layout_for(q.shape[1], k.shape[1], q.device)
        q, k, v = (t if t.is_contiguous() else t.contiguous() for t in (q, k, v))
        # a group whose query heads differ: the per-query-head kernels on CUDA tensors, forward and
        # backward (K/V not repeated), the expanded path elsewhere (stage2/qhead.py)
        attn = qhead_block_sparse_attn_varlen if expand else block_sparse_attn_varlen
        return attn(q, k, v, cu, cu, layout, max_seqlen, max_seqlen, causal=self.causal,
                    softmax_scale=None if sm_scale is None else float(sm_scale), backend=self.backend,
                    kernel=self.kernel)


class LocalStrideSparseAttention(SparseAttention):
    r"""dkernel's `LocalStrideSparseAttention`: local + vertical-stride blocks (Phi-3-small), causal.

    The pattern is `dkernel_local_stride_mask(num_heads, max_seq_len, block_size, local_blocks,
    vert_stride, ...)`: one per query head (or per KV head with `num_kv_heads`, shared by its G query
    heads; or one for all with `homo_head=True`), vertical columns sliding by head. `max_seq_len` is
    rounded up to a multiple of `block_size`. Call as `SparseAttention`.

    Args:
        num_heads (int): query heads.
        max_seq_len (int): longest sequence.
        block_size (int): a multiple of 64.
        local_blocks (int): blocks of the local band (the diagonal included).
        vert_stride (int): one column block in every `vert_stride` beyond the band.
        homo_head (bool, Optional): keyword-only, as all after it. Same columns for every head.
            Default: False (dkernel's default).
        num_kv_heads (int, Optional): patterns per KV head (dkernel's GQA form). Default: None.
        head_sliding_offset (int, Optional): column offset of head 0 (0 keeps block 0). Default: 0.
        num_dense_heads (int, Optional): last pattern heads that are causal-dense. Default: 0.
        seq_dim, causal, backend, kernel: as `SparseAttention`.
    """

    def __init__(self, num_heads: int, max_seq_len: int, block_size: int, local_blocks: int,
                 vert_stride: int, *,
                 homo_head: bool = False, num_kv_heads: int | None = None, head_sliding_offset: int = 0,
                 num_dense_heads: int = 0, seq_dim: int = 1, causal: bool = True, backend: str = "auto",
                 kernel: str = "auto"):
        check_int_args(1, block_size=block_size)
        mask = dkernel_local_stride_mask(num_heads, max_seq_len, block_size, local_blocks, vert_stride,
                                         homo_head=homo_head, num_kv_heads=num_kv_heads,
                                         head_sliding_offset=head_sliding_offset,
                                         num_dense_heads=num_dense_heads)
        super().__init__(block_size, mask, seq_dim=seq_dim, causal=causal, backend=backend, kernel=kernel)
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.local_blocks, self.vert_stride, self.homo_head = local_blocks, vert_stride, homo_head
