"""Query-block layouts: one KV-block selection per query block and KV head.

This is the form of static patterns (local + vertical stride, per-head masks) and of the
block-level kernels users compare against (FlexAttention's BlockMask, dkernel, vLLM). The same
stage-2 kernel runs them: each query block becomes one bitmask row shared by its tokens.
"""
from __future__ import annotations

import dataclasses

import torch

from .._checks import check_max_seqlen, check_tensor
from .._rules import KV_BLOCK, check_block_multiple


@dataclasses.dataclass(frozen=True)
class BlockLayout:
    r"""Which 64-key blocks each query block attends, per KV head.

    `mask[h, i, j]` (or `mask[b, h, i, j]` for one layout per sequence) is True when the tokens
    `[i*q_block, (i+1)*q_block)` of a sequence attend keys `[64j, 64j+64)` of the same sequence
    under KV head h (and all its G query heads). Causality is applied on top at token level when
    the op is called with `causal=True`; entries past a sequence's length are ignored. For
    `q_block = 64`, 4 query blocks and a local window of 2 plus block 0:

        1 0 0 0
        1 1 0 0
        1 1 1 0
        1 0 1 1

    Attributes:
        mask (torch.Tensor): bool `[H, NQB, NKB]` (shared by all sequences) or `[B, H, NQB, NKB]`.
        q_block (int): query tokens per row of the layout (64 or 128 in the usual patterns).
    """
    mask: torch.Tensor
    q_block: int = 64

    def __post_init__(self):
        check_tensor("mask", self.mask, dtypes=(torch.bool,))
        if self.mask.dim() not in (3, 4):
            raise ValueError("mask must be [H, NQB, NKB] or [B, H, NQB, NKB], got shape "
                             f"{tuple(self.mask.shape)}")
        if isinstance(self.q_block, bool) or not isinstance(self.q_block, int) or self.q_block <= 0:
            raise ValueError(f"q_block must be a positive int, got {self.q_block!r}")

    @classmethod
    def from_dense(cls, mask: torch.Tensor, q_block: int = 64, kv_block: int = 64) -> BlockLayout:
        """From a boolean block mask whose key blocks have `kv_block` keys (a multiple of 64)."""
        check_tensor("mask", mask, dtypes=(torch.bool,))
        check_block_multiple(kv_block=kv_block)
        return cls(mask.repeat_interleave(kv_block // KV_BLOCK, dim=-1).contiguous(), q_block)

    def to_dense(self, kv_block: int = 64) -> torch.Tensor:
        """The boolean mask with key blocks of `kv_block` keys (a block is set if any 64-block in it is)."""
        check_block_multiple(kv_block=kv_block)
        r = kv_block // KV_BLOCK
        m = self.mask
        pad = (-m.shape[-1]) % r
        if pad:
            m = torch.nn.functional.pad(m, (0, pad))
        return m.view(*m.shape[:-1], m.shape[-1] // r, r).any(-1)

    @property
    def per_sequence(self) -> bool:
        return self.mask.dim() == 4

    @property
    def num_kv_heads(self) -> int:
        return self.mask.shape[-3]

    def check_against(self, H: int, batch: int, max_seqlen_q: int, max_seqlen_k: int,
                      num_q_heads: int | None = None) -> None:
        """Raise unless the layout covers `H` KV heads, `batch` sequences, `max_seqlen_q` queries and
        `max_seqlen_k` keys (`num_q_heads`: q's heads, named in the message where a layout per query
        head would also do). A layout with fewer key-block columns than the keys have blocks is
        refused rather than read as "the missing blocks are not selected"."""
        if self.num_kv_heads != H:
            alt = (f" or q's {num_q_heads} query heads (one row per query head)"
                   if num_q_heads is not None and num_q_heads != H else "")
            raise ValueError(f"layout has {self.num_kv_heads} KV heads but k has {H}: a layout has one row "
                             f"per KV head{alt}")
        if self.per_sequence and self.mask.shape[0] != batch:
            raise ValueError(f"layout has {self.mask.shape[0]} sequences but cu_seqlens_q has {batch}")
        need = -(-max_seqlen_q // self.q_block)
        if self.mask.shape[-2] < need:
            raise ValueError(f"layout has {self.mask.shape[-2]} query blocks of {self.q_block}; "
                             f"max_seqlen_q={max_seqlen_q} needs {need}")
        # max_seqlen_k's own type and value checks come later, from the op's checks
        need = -(-max_seqlen_k // KV_BLOCK) if isinstance(max_seqlen_k, (int, torch.SymInt)) else 0
        if self.mask.shape[-1] < need:
            raise ValueError(f"layout has {self.mask.shape[-1]} key-block columns of {KV_BLOCK} keys; "
                             f"max_seqlen_k={max_seqlen_k} needs {need} (one column per key block)")

    def to_topk_idx(self, cu_seqlens_q: torch.Tensor) -> torch.Tensor:
        """InfLLM-v2's token-level form: int32 `[H, total_q, K]`, ascending, -1 tail padding."""
        check_tensor("cu_seqlens_q", cu_seqlens_q, ndim=1)
        m = self.mask if self.per_sequence else self.mask[None]
        B = cu_seqlens_q.numel() - 1
        K = max(1, int(m.sum(-1).max()) if m.numel() else 1)
        nkb = m.shape[-1]
        # ascending selected indices first: sort keys put unselected blocks after all selected ones
        keys = torch.where(m, torch.arange(nkb, device=m.device), nkb + torch.arange(nkb, device=m.device))
        rows = keys.sort(-1).values[..., :K]
        rows = torch.where(rows < nkb, rows, torch.full_like(rows, -1)).to(torch.int32)   # [B|1, H, NQB, K]
        lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long().to(m.device)
        seq = torch.repeat_interleave(torch.arange(B, device=m.device), lens)
        pos = torch.arange(seq.numel(), device=m.device) - cu_seqlens_q[:-1].long().to(m.device)[seq]
        qb = pos // self.q_block
        # one gather of each token's row: [T, H, K] (never [T, H, NQB, K], tens of GB at 32k tokens)
        b = seq if self.per_sequence else torch.zeros_like(seq)
        return rows[b, :, qb].permute(1, 0, 2).contiguous()

    def packed(self, n_words: int, device) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Bitmask rows for the kernel: (`words` int32 `[rows, n_words]`, `mask_base` int32 `[B or 1]`
        in rows, `h_stride` in rows)."""
        m = self.mask.to(device)
        nkb = m.shape[-1]
        width = n_words * 32
        m = m[..., :width] if nkb >= width else torch.nn.functional.pad(m, (0, width - nkb))
        bits = m.reshape(-1, n_words, 32).to(torch.int64) << torch.arange(32, device=device)
        words = bits.sum(-1)
        words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
        H, NQB = self.mask.shape[-3], self.mask.shape[-2]
        if self.per_sequence:
            base = torch.arange(self.mask.shape[0], device=device, dtype=torch.int32) * (H * NQB)
        else:
            base = None
        return words, base, NQB


def check_layout_call(layout, q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k) -> int:
    """What a call with a layout checks before it reads the layout against its inputs: the layout's type,
    q and k as 3-D tensors, `cu_seqlens_q` as a 1-D tensor and both maximum lengths as ints >= 0, each a
    TypeError/ValueError naming the argument. Returns the batch size."""
    if not isinstance(layout, BlockLayout):
        raise TypeError(f"layout must be a BlockLayout, got {type(layout).__name__}")
    check_tensor("q", q, ndim=3)
    check_tensor("k", k, ndim=3)
    check_tensor("cu_seqlens_q", cu_seqlens_q, ndim=1)
    check_max_seqlen("max_seqlen_q", max_seqlen_q, [])
    check_max_seqlen("max_seqlen_k", max_seqlen_k, [])
    return cu_seqlens_q.numel() - 1
