"""KV cache for decode: a batch's keys, values and compressed keys, contiguous or paged.

Layouts (docs/decode.md, "Cache"):
  contiguous  k, v `[B, L_max, H, D]`; token t of sequence b at `k[b, t]`.
  paged       k, v `[num_pages, page_size, H, D]` and `block_table int32 [B, max_pages]`; token t of
              sequence b at `k[block_table[b, t // page_size], t % page_size]` (FlashAttention's and
              vLLM's convention). Entries are page ids, or -1 for "no page yet" after the last
              valid one; a page belongs to one sequence at most. page_size is a multiple of 64, so a
              64-key block of the sparse selection never straddles two pages.
Compressed keys (spec section 3): `ck1 [B, N1, H, D]` (kernel 32, stride 16) and `ck2 [B, N2, H, D]`
(kernel 128, stride 64), per sequence, window i of sequence b at `ck[b, i]`; sequence b holds
`n_windows(L_b, kernel, stride)` valid windows. They follow the keys at every append (the incremental
form of spec section 3: a window is written once, when its last key arrives), so the first crossing
of `dense_len` (spec section 9, HF's "is_prefilling" branch) needs no catch-up compression: the
compressed cache is always what recompressing the whole cache would give.

Lengths live on the device (`seqlens int32 [B]`, what the kernels read) and in a host mirror (what
the checks read, so an eager step needs no device-to-host copy). A one-token `append` has static
shapes and no host synchronisation, so it can be captured in a CUDA graph; a replayed graph does not
advance the host mirror: call `sync_lengths()` after replays.
"""
from __future__ import annotations

import itertools
import math
import numbers

import torch

from .._checks import check_tensor, host_int_list
from .._dtypes import INT_DTYPES, REF_DTYPES
from .._rules import COMPRESSIONS, KV_BLOCK, n_windows, n_windows_of
from .cache_append import append_launches, kernel_appends
from .fp8 import (
    E4M3,
    RECENT,
    check_kv_dtype,
    check_verified,
    dequantize_k_pages,
    dequantize_rows,
    dequantize_v,
    quantize_k_pages,
    quantize_v,
)

MAX_PREPARED = 32      # prepared objects a cache keeps (`DecodeCache.prepared`)


def _window_mean(x: torch.Tensor) -> torch.Tensor:
    """Mean over dim 1 of `[n, kernel, H, D]`, summed in fp32 (float64 for float64), rounded to x's
    dtype: the same expression as `compress.naive_compress_k`, so the two agree bit for bit on CPU."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    return x.to(acc).mean(dim=1).to(x.dtype)


def capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class DecodeCache:
    r"""Keys, values and compressed keys of a batch of sequences, for decode.

    Build with `DecodeCache.contiguous(...)` or `DecodeCache.paged(...)`; fill with `append`
    (a chunk per sequence, ragged, e.g. a prefill) and `append` of one token per sequence per step.

    Attributes:
        k, v (torch.Tensor): `[B, L_max, H, D]` (contiguous) or `[num_pages, page_size, H, D]` (paged).
        block_table (torch.Tensor or None): int32 `[B, max_pages]` (paged only).
        seqlens (torch.Tensor): int32 `[B]` on the cache's device, keys held per sequence.
        ck1, ck2 (torch.Tensor): `[B, N1, H, D]`, `[B, N2, H, D]` compressed keys (32/16, 128/64).
        page_size (int or None), capacity (int): positions one sequence can hold at most
            (L_max, or max_pages * page_size); the width of attention-weight outputs.
        graphs (bool): eager `infllmv2_decode` calls on CUDA replay a CUDA graph of the step's
            launches, captured at the first call of each (q shape, config, outputs, dense or sparse);
            the same results bit for bit, less host time per call. Default: False.

    The eager decode path keeps prepared launches and their scratch on the cache, so one cache serves
    one stream at a time (as its appends must).
    """

    def __init__(self, k, v, seqlens, block_table, page_size, ck1, ck2, host_lens, capacities, fp8=None):
        self.k, self.v, self.seqlens, self.block_table, self.page_size = k, v, seqlens, block_table, page_size
        self.ck1, self.ck2 = ck1, ck2
        # the FP8 storage's scales and 16-bit buffers (`fp8.py`), None for a 16-bit cache
        self.k_scale, self.v_scale, self.k_recent, self.v_open = fp8 if fp8 is not None else (None,) * 4
        self._host_lens = list(host_lens)
        self._capacities = list(capacities)
        # True once a one-token append ran under CUDA-graph capture or torch.compile (replays advance the
        # device lengths only), until `sync_lengths` or `reset`: the host mirror may then lag, and
        # appends must not use it
        self._host_stale = False
        # the eager fast paths' prepared launches (docs/decode.md, 6): the one-token append, and the
        # decode steps by (q shape, config, outputs) (`step.py`); None / empty until first used
        self._append_program = None
        self._kernel_appends = None    # whether cache_append.cu takes one-token appends (None: not asked yet)
        self._prepared = {}             # `prepared`: the decode steps' prepared launches, by key
        self._min_room = None           # min over sequences of capacity - length (None: recount)
        # eager `infllmv2_decode` on CUDA replays a CUDA graph of each prepared step (docs/decode.md, 6)
        self.graphs = False

    # ---------------------------------------------------------------------------------------- build
    @classmethod
    def contiguous(cls, batch: int, max_len: int, num_heads: int, head_dim: int, *,
                   dtype=torch.bfloat16, device="cpu", kv_dtype=None) -> DecodeCache:
        """An empty contiguous cache `[batch, max_len, num_heads, head_dim]`; `kv_dtype`: the storage
        of K and V, None (`dtype`) or `torch.float8_e4m3fn` (docs/decode.md §16)."""
        _check_sizes(batch=batch, max_len=max_len, num_heads=num_heads, head_dim=head_dim)
        if dtype not in REF_DTYPES:
            raise TypeError(f"dtype must be one of {REF_DTYPES}, got {dtype}")
        store = check_kv_dtype(kv_dtype, dtype) or dtype
        shape = (batch, max_len, num_heads, head_dim)
        k = torch.zeros(shape, dtype=store, device=device)
        v = torch.zeros(shape, dtype=store, device=device)
        return cls._with_compressed(k, v, None, None, [max_len] * batch, dtype)

    @classmethod
    def paged(cls, num_pages: int, page_size: int, num_heads: int, head_dim: int, block_table: torch.Tensor,
              *, dtype=torch.bfloat16, device="cpu", kv_dtype=None) -> DecodeCache:
        """An empty paged cache `[num_pages, page_size, num_heads, head_dim]` with `block_table`
        int32 `[B, max_pages]` (checked: entries in [0, num_pages) then -1 tail, no page twice);
        `kv_dtype` as in `contiguous`."""
        _check_sizes(num_pages=num_pages, page_size=page_size, num_heads=num_heads, head_dim=head_dim)
        if page_size % KV_BLOCK:
            raise ValueError(f"page_size must be a multiple of {KV_BLOCK} (a key block never straddles "
                             f"pages), got {page_size}")
        if dtype not in REF_DTYPES:
            raise TypeError(f"dtype must be one of {REF_DTYPES}, got {dtype}")
        store = check_kv_dtype(kv_dtype, dtype) or dtype
        shape = (num_pages, page_size, num_heads, head_dim)
        k = torch.zeros(shape, dtype=store, device=device)
        v = torch.zeros(shape, dtype=store, device=device)
        caps = _check_block_table(block_table, num_pages, page_size, k.device)
        return cls._with_compressed(k, v, block_table.contiguous(), page_size, caps, dtype)

    @classmethod
    def _with_compressed(cls, k, v, block_table, page_size, caps, dtype):
        B = len(caps)
        R, S, H, D = k.shape
        dev = k.device
        width = block_table.shape[1] * page_size if block_table is not None else S
        ck = [torch.zeros((B, n_windows(width, kr, st), H, D), dtype=dtype, device=dev)
              for kr, st in COMPRESSIONS]
        seqlens = torch.zeros(B, dtype=torch.int32, device=dev)
        fp8 = None
        if k.dtype == E4M3:
            fp8 = (torch.zeros((R, -(-S // KV_BLOCK), H, D), dtype=torch.float32, device=dev),
                   torch.zeros((R, S, H), dtype=torch.float32, device=dev),
                   torch.zeros((B, RECENT, H, D), dtype=dtype, device=dev),
                   torch.zeros((B, KV_BLOCK, H, D), dtype=dtype, device=dev))
        return cls(k, v, seqlens, block_table, page_size, ck[0], ck[1], [0] * B, caps, fp8)

    # ------------------------------------------------------------------------------------ queries
    @property
    def batch(self) -> int:
        return self.seqlens.shape[0]

    @property
    def num_heads(self) -> int:
        return self.k.shape[2]

    @property
    def head_dim(self) -> int:
        return self.k.shape[3]

    @property
    def dtype(self) -> torch.dtype:
        """The queries', new keys' and compressed keys' dtype (the K/V storage's: `kv_dtype`)."""
        return self.ck1.dtype

    @property
    def kv_dtype(self) -> torch.dtype:
        """The storage of K and V: `dtype`, or `torch.float8_e4m3fn` (docs/decode.md §16)."""
        return self.k.dtype

    @property
    def is_fp8(self) -> bool:
        return self.k_scale is not None

    @property
    def bytes_per_token(self) -> float:
        """Bytes of K and V storage one cached token takes over all KV heads, scales included (the
        open page's 16-bit buffers, a fixed cost per sequence, are in `nbytes`)."""
        H, D = self.num_heads, self.head_dim
        if not self.is_fp8:
            return 2 * H * D * self.k.element_size()
        return H * (2 * D + 4 * D / KV_BLOCK + 4)      # e4m3 K and V, K's channel scales per page, V's

    @property
    def nbytes(self) -> int:
        """Bytes of every tensor the cache holds (K/V storage, scales, 16-bit buffers, compressed keys,
        lengths, block table)."""
        ts = (self.k, self.v, self.ck1, self.ck2, self.seqlens, self.block_table, self.k_scale, self.v_scale,
              self.k_recent, self.v_open)
        return sum(t.numel() * t.element_size() for t in ts if t is not None)

    @property
    def device(self) -> torch.device:
        return self.k.device

    @property
    def is_paged(self) -> bool:
        return self.block_table is not None

    @property
    def capacity(self) -> int:
        """Positions one sequence can address: L_max, or max_pages * page_size."""
        return self.block_table.shape[1] * self.page_size if self.is_paged else self.k.shape[1]

    def capacities(self) -> list[int]:
        """Positions each sequence can hold (paged: its leading valid pages times page_size)."""
        return list(self._capacities)

    def lengths(self) -> list[int]:
        """Keys per sequence, from the host mirror (no device read)."""
        return list(self._host_lens)

    @property
    def lengths_in_sync(self) -> bool:
        """Whether `lengths()` (the host mirror) equals the device lengths: False after one-token appends
        under CUDA-graph capture or torch.compile (replays advance the device lengths only), until
        `sync_lengths()` or `reset()`."""
        return not self._host_stale

    def current_lengths(self) -> list[int]:
        """The lengths: the host mirror, refreshed from the device (one copy) only when it lags."""
        return self.lengths() if not self._host_stale else self.sync_lengths()

    def prepared(self, key, build, valid=None):
        """The object this cache keeps under `key` (the decode step's prepared launches, docs/decode.md
        §6), built by `build()` when missing or when `valid(entry)` is False. At most `MAX_PREPARED` are
        kept: a caller that makes a new config object per call cannot grow the store without bound."""
        entry = self._prepared.get(key)
        if entry is None or (valid is not None and not valid(entry)):
            entry = build()
            if len(self._prepared) >= MAX_PREPARED:
                self._prepared.clear()
            self._prepared[key] = entry
        return entry

    @property
    def n_prepared(self) -> int:
        """How many prepared objects the cache keeps (`prepared`)."""
        return len(self._prepared)

    def max_len(self) -> int:
        """The longest sequence: HF's `kv_seq_len`, which picks the dense path below `dense_len`
        (spec section 9). The compressed keys are current whichever path a step takes."""
        return max(self._host_lens, default=0)

    def compressed_lens(self) -> tuple[torch.Tensor, torch.Tensor]:
        """int32 `[B]` valid windows per sequence of ck1 and ck2 (on the device, no sync)."""
        n1, n2 = (n_windows_of(self.seqlens, kr, st).to(torch.int32) for kr, st in COMPRESSIONS)
        return n1, n2

    def sync_lengths(self) -> list[int]:
        """Refresh the host mirror from the device lengths (one device-to-host copy), e.g. after
        replaying a captured step; returns the lengths."""
        self._host_lens = [int(x) for x in self.seqlens.cpu().tolist()]
        self._host_stale = False
        self._min_room = None
        return list(self._host_lens)

    def positions(self, b: int, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Storage indices `(row, slot)` of positions [start, stop) of sequence b: `k[row, slot]`."""
        t = torch.arange(start, stop, device=self.device)
        if not self.is_paged:
            return torch.full_like(t, b), t
        return self.block_table[b, t // self.page_size].long(), t % self.page_size

    def gather(self, b: int, stop: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values `[L_b, H, D]` of sequence b (a copy for paged and FP8 caches; an FP8 cache's
        read as `dequantized` reads them)."""
        L = self._host_lens[b] if stop is None else stop
        if not self.is_paged and not self.is_fp8:
            return self.k[b, :L], self.v[b, :L]
        return self._read(b, 0, L)

    def _read(self, b: int, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        r, s = self.positions(b, start, stop)
        if not self.is_fp8:
            return self.k[r, s], self.v[r, s]
        dt = self.dtype
        # per token, the pages' expression (`dequantize_k_pages`): the same fp32 product and rounding
        k = dequantize_k_pages(self.k[r, s].unsqueeze(-3), self.k_scale[r, s // KV_BLOCK], dt).squeeze(-3)
        v = dequantize_v(self.v[r, s], self.v_scale[r, s], dt)
        L = self._host_lens[b]
        o = max(L - L % KV_BLOCK, start)                       # the open page's part of [start, stop)
        if o < stop:
            t = torch.arange(o, stop, device=self.device)
            k[o - start:] = self.k_recent[b, t % RECENT]
            v[o - start:] = self.v_open[b, t % KV_BLOCK]
        return k, v

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V in `dtype`, in the cache's layout: a 16-bit cache's own `k`, `v`; for an FP8 cache its
        stored pages read as the kernels read them and each sequence's open page from its 16-bit buffers
        (positions past a sequence's length unspecified). Device ops with static shapes, no host read:
        what the references, and a step traced by torch.compile, attend over."""
        if not self.is_fp8:
            return self.k, self.v
        return dequantized_tensors(self.k, self.v, self.seqlens, self.block_table, self.fp8_tensors())

    def read_kv(self, kernels: bool, what: str) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V as a step on this cache reads them: `k`, `v`, or an FP8 cache's `dequantized()` on
        the references' path. On the kernels' path an FP8 cache gives its stored e4m3 `k`, `v` (the
        kernels take `fp8_tensors()` with them) and refuses (`fp8.not_verified`, naming `what`) until
        their GPU tests have passed on hardware (`fp8.VERIFIED_ON_HARDWARE`)."""
        if not self.is_fp8:
            return self.k, self.v
        if kernels:
            check_verified(what)
            return self.k, self.v
        return self.dequantized()

    def fp8_tensors(self) -> tuple | None:
        """`(k_scale, v_scale, k_recent, v_open)` of an FP8 cache (`fp8.py`), None for a 16-bit one."""
        return (self.k_scale, self.v_scale, self.k_recent, self.v_open) if self.is_fp8 else None

    def packed(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`(k, v, cu_seqlens)` packed varlen `[total, H, D]`, as the prefill/stage-2 APIs take them."""
        ks, vs = zip(*(self.gather(b) for b in range(self.batch))) if self.batch else ((), ())
        return torch.cat(ks), torch.cat(vs), cu_seqlens_of(self._host_lens, self.device)

    def packed_compressed(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """`(ck1, cu_seqlens_c1, ck2, cu_seqlens_c2)` packed varlen, as stage 1 takes them."""
        out = []
        for ck, (kr, st) in zip((self.ck1, self.ck2), COMPRESSIONS):
            n = [n_windows(L, kr, st) for L in self._host_lens]
            out += [torch.cat([ck[b, :n[b]] for b in range(self.batch)]), cu_seqlens_of(n, self.device)]
        return tuple(out)

    # ------------------------------------------------------------------------------------ updates
    def set_block_table(self, block_table: torch.Tensor) -> None:
        """Replace the block table (e.g. pages granted to growing sequences). Checked like the
        constructor's, and every sequence's current keys must keep their pages."""
        if not self.is_paged:
            raise ValueError("block_table: this cache is contiguous")
        check_tensor("block_table", block_table, shape=tuple(self.block_table.shape), dtypes=(torch.int32,),
                     device=self.device)
        caps = _check_block_table(block_table, self.k.shape[0], self.page_size, self.device)
        for b, L in enumerate(self._host_lens):
            used = -(-L // self.page_size)
            if caps[b] < L or not torch.equal(block_table[b, :used], self.block_table[b, :used]):
                raise ValueError(f"block_table: sequence {b} holds {L} keys; its first {used} pages must "
                                 "stay")
        self.block_table.copy_(block_table)
        self._capacities = caps
        self._min_room = None

    def reset(self, seqlens=None) -> None:
        """Forget the contents (all lengths 0), or truncate to `seqlens` (ints, each <= the current
        length; the compressed keys of the kept prefix are unchanged, those past it unused)."""
        if seqlens is None:
            new = [0] * self.batch
        elif isinstance(seqlens, torch.Tensor):
            new = seqlens.tolist() if seqlens.dim() == 1 else None
            if new is None or any(isinstance(n, bool) or not isinstance(n, numbers.Integral) for n in new):
                dt = str(seqlens.dtype).replace("torch.", "")
                raise TypeError(f"seqlens must be ints, one per sequence, got a tensor of dtype {dt} and "
                                f"shape {tuple(seqlens.shape)}")
        else:
            new = host_int_list("seqlens", seqlens, what="ints, one per sequence")
        if len(new) != self.batch or any(n < 0 or n > L for n, L in zip(new, self._host_lens)):
            raise ValueError(f"seqlens must have {self.batch} entries, each in [0, its current length "
                             f"{self._host_lens[:8]}], got {new[:8]}")
        if self.is_fp8:
            self._reopen(new)
        self.seqlens.copy_(torch.tensor(new, dtype=torch.int32))
        self._host_lens = new
        self._host_stale = False
        self._min_room = None

    def append(self, k_new: torch.Tensor, v_new: torch.Tensor, cu_seqlens_new=None) -> None:
        r"""Write new keys and values after each sequence's last, and the compression windows they complete.

        Args:
            k_new, v_new (torch.Tensor):
                One token per sequence `[B, H, D]` (or `[B, 1, H, D]`); or, with `cu_seqlens_new`,
                a ragged chunk per sequence packed as `[total_new, H, D]`.
            cu_seqlens_new (torch.Tensor or list of int, Optional):
                Chunk boundaries `[B+1]` (int32 tensor or ints, from 0, non-decreasing); a sequence
                may receive 0 tokens. Default: None (one token each).

        Every check runs before anything is written, and a failed check leaves the cache unchanged:
        shapes, dtypes and device against the cache's, and each sequence's new length against its
        capacity (`L_max`, or its valid pages times page_size). The one-token form has static
        shapes and reads nothing back from the device (under CUDA-graph capture the capacity check,
        which reads the host mirror, is skipped); the chunk form reads `cu_seqlens_new` on the host.
        """
        B, H, D = self.batch, self.num_heads, self.head_dim
        if cu_seqlens_new is None:
            dt, dev = self.dtype, self.k.device
            if not (type(k_new) is torch.Tensor and type(v_new) is torch.Tensor and k_new.dtype == dt
                    and v_new.dtype == dt and k_new.shape == (B, H, D) and v_new.shape == (B, H, D)
                    and k_new.device == dev and v_new.device == dev):     # else the checks name what differs
                for name, t in (("k_new", k_new), ("v_new", v_new)):
                    check_tensor(name, t, dtypes=(self.dtype,), device=self.device)
                    check_tensor(name, t, shape=(B, 1, H, D) if t.dim() == 4 else (B, H, D))
            k_new = k_new.reshape(B, H, D)
            v_new = v_new.reshape(B, H, D)
            if torch.compiler.is_compiling():
                # traced: the op keeps the cache's tensors whole; the host mirror lags from here on
                if self.is_fp8:
                    torch.ops.infllm_cupy.cache_append_fp8(k_new, v_new, self.k, self.v, self.ck1, self.ck2,
                                                           self.seqlens, self.block_table,
                                                           *self.fp8_tensors())
                else:
                    torch.ops.infllm_cupy.cache_append(k_new, v_new, self.k, self.v, self.ck1, self.ck2,
                                                       self.seqlens, self.block_table)
                self._host_stale = True
                return
            in_capture = capturing()
            if not in_capture:
                self._check_room()
            if self._append_kernel_ok():
                # the kernel reads dense [B, H, D] rows in 16-byte pieces
                if not (k_new.is_contiguous() and v_new.is_contiguous()) or k_new.data_ptr() % 16 or \
                        v_new.data_ptr() % 16:
                    k_new, v_new = k_new.clone(memory_format=torch.contiguous_format), \
                        v_new.clone(memory_format=torch.contiguous_format)
                if self._append_program is None:
                    self._append_program = append_launches(k_new, v_new, self.k, self.v, self.ck1, self.ck2,
                                                           self.seqlens, self.block_table).program(
                        k_new=k_new, v_new=v_new)
                self._append_program.run(k_new=k_new, v_new=v_new)
            elif (not in_capture and not self._host_stale and not self.is_paged and not self.is_fp8
                  and len(set(self._host_lens)) == 1):
                self._append_one_at(self._host_lens[0], k_new, v_new)
            else:
                self._append_one(k_new, v_new)
            if in_capture:
                self._host_stale = True
            else:
                self._host_lens = [L + 1 for L in self._host_lens]
                self._min_room -= 1
            return
        counts = _chunk_counts(cu_seqlens_new, B)
        total = sum(counts)
        for name, t in (("k_new", k_new), ("v_new", v_new)):
            check_tensor(name, t, shape=(total, H, D), dtypes=(self.dtype,), device=self.device)
        self._check_capacity(counts)
        if torch.compiler.is_compiling():
            # traced (a compiled prefill): one op, the lengths known on the host as in eager
            if self.is_fp8:
                torch.ops.infllm_cupy.cache_append_chunk_fp8(k_new, v_new, self.k, self.v, self.ck1, self.ck2,
                                                             self.seqlens, self.block_table,
                                                             *self.fp8_tensors(), list(self._host_lens),
                                                             counts)
            else:
                torch.ops.infllm_cupy.cache_append_chunk(k_new, v_new, self.k, self.v, self.ck1, self.ck2,
                                                         self.seqlens,
                                                         self.block_table, list(self._host_lens), counts)
            self._host_lens = [L + n for L, n in zip(self._host_lens, counts)]
            self._min_room = None
            return
        self._append_chunks(k_new, v_new, counts)

    def _append_kernel_ok(self) -> bool:
        if self._kernel_appends is None:
            self._kernel_appends = kernel_appends(self.k)
        return self._kernel_appends

    def _check_room(self) -> None:
        """Every sequence can take one more token (the capacity check of a one-token append, O(1) while
        the room is counted)."""
        if self._min_room is None:
            self._min_room = min((c - L for c, L in zip(self._capacities, self._host_lens)), default=1)
        if self._min_room < 1:
            self._check_capacity([1] * self.batch)

    def _check_capacity(self, counts) -> None:
        for b, (L, n, cap) in enumerate(zip(self._host_lens, counts, self._capacities)):
            if L + n > cap:
                what = (f"{cap // self.page_size} valid pages of {self.page_size}" if self.is_paged
                        else f"L_max = {cap}")
                raise ValueError(f"k_new: appending {n} token(s) to sequence {b} (holding {L}) passes its "
                                 f"capacity ({what})")

    def _slots(self, pos: torch.Tensor, b: torch.Tensor):
        """Storage (row, slot) of position tensor `pos` of sequences `b` (same shapes)."""
        if not self.is_paged:
            return b, pos
        page = self.block_table[b, torch.div(pos, self.page_size, rounding_mode="floor")].long()
        return page, pos % self.page_size

    def _append_one(self, k_new, v_new) -> None:
        append_one_tensors(k_new, v_new, self.k, self.v, self.ck1, self.ck2, self.seqlens, self.block_table,
                           self.fp8_tensors())

    def _append_one_at(self, L: int, k_new, v_new) -> None:
        # Eager step of a contiguous cache whose sequences all hold L keys (HF's batches), the host
        # mirror exact: the same writes as `_append_one` with host positions, so a slice copy per
        # tensor and a window mean only when one completes (every 16th / 64th step), instead of some
        # forty small launches per step. Same values: `_window_mean` over the same [B, kr, H, D] keys.
        self.k[:, L] = k_new
        self.v[:, L] = v_new
        for ck, (kr, st) in zip((self.ck1, self.ck2), COMPRESSIONS):
            first = L + 1 - kr                                         # window [first, L] ends at the new key
            if first >= 0 and first % st == 0 and first // st < ck.shape[1]:
                ck[:, first // st] = _window_mean(self.k[:, first:L + 1])
        self.seqlens.add_(1)

    def _append_chunks(self, k_new, v_new, counts) -> None:
        if self.is_fp8:
            return self._append_chunks_fp8(k_new, v_new, counts)
        B = self.batch
        starts = self._host_lens
        n_dev = h2d(torch.tensor(counts, dtype=torch.long), self.device)
        # output_size: the total is known on the host; without it repeat_interleave reads it back (a sync)
        seq = torch.repeat_interleave(torch.arange(B, device=self.device), n_dev, output_size=sum(counts))
        first = torch.cumsum(n_dev, 0) - n_dev                                                 # chunk offsets
        local = torch.arange(sum(counts), device=self.device) - first[seq]
        pos = h2d(torch.tensor(starts, dtype=torch.long), self.device)[seq] + local
        row, slot = self._slots(pos, seq)
        self.k[row, slot] = k_new
        self.v[row, slot] = v_new
        for ck, (kr, st) in zip((self.ck1, self.ck2), COMPRESSIONS):
            for b, (L0, n) in enumerate(zip(starts, counts)):
                lo, hi = n_windows(L0, kr, st), n_windows(L0 + n, kr, st)   # windows completed by this chunk
                if hi <= lo:
                    continue
                t = (torch.arange(lo, hi, device=self.device)[:, None] * st
                     + torch.arange(kr, device=self.device)[None, :])      # [hi - lo, kr]
                r, s = self._slots(t, torch.full_like(t, b))
                ck[b, lo:hi] = _window_mean(self.k[r, s])
        self.seqlens.add_(n_dev.to(torch.int32))
        self._host_lens = [L + n for L, n in zip(starts, counts)]
        self._min_room = None

    def _append_chunks_fp8(self, k_new, v_new, counts) -> None:
        # Per sequence, on the host lengths: the chunk after the unquantized keys of the last 128
        # positions (`k_recent`) and the open page's values (`v_open`); the windows it completes from
        # those unquantized keys (the 16-bit cache's compressed keys, bit for bit), the pages it fills
        # quantized, the last 128 keys and the open page's values back into the 16-bit buffers.
        dev, off = self.device, 0
        k_recent, v_open = self.k_recent, self.v_open
        for b, (L0, n) in enumerate(zip(self._host_lens, counts)):
            kn, vn, off = k_new[off:off + n], v_new[off:off + n], off + n
            if n == 0:
                continue
            L1 = L0 + n
            lo, o = max(0, L0 - RECENT), L0 - L0 % KV_BLOCK            # ring start, open page start
            ku = torch.cat([k_recent[b, torch.arange(lo, L0, device=dev) % RECENT], kn])   # positions lo..L1
            vu = torch.cat([v_open[b, torch.arange(o, L0, device=dev) % KV_BLOCK], vn])     # positions o..L1
            for ck, (kr, st) in zip((self.ck1, self.ck2), COMPRESSIONS):
                w0, w1 = n_windows(L0, kr, st), n_windows(L1, kr, st)
                if w1 > w0:
                    t = (torch.arange(w0, w1, device=dev)[:, None] * st
                         + torch.arange(kr, device=dev)[None, :]) - lo
                    ck[b, w0:w1] = _window_mean(ku[t])
            full = (L1 - o) // KV_BLOCK                                 # pages this chunk fills
            if full:
                m = full * KV_BLOCK
                k8, ks = quantize_k_pages(ku[o - lo:o - lo + m].view(full, KV_BLOCK, *ku.shape[1:]))
                v8, vs = quantize_v(vu[:m])
                r, s = self.positions(b, o, o + m)
                self.k[r, s] = k8.flatten(0, 1)
                self.v[r, s] = v8
                self.v_scale[r, s] = vs
                self.k_scale[r[::KV_BLOCK], s[::KV_BLOCK] // KV_BLOCK] = ks
            t = torch.arange(max(lo, L1 - RECENT), L1, device=dev)
            k_recent[b, t % RECENT] = ku[t - lo]
            t = torch.arange(L1 - L1 % KV_BLOCK, L1, device=dev)
            v_open[b, t % KV_BLOCK] = vu[t - o]
        n_dev = h2d(torch.tensor(counts, dtype=torch.int32), dev)
        self.seqlens.add_(n_dev)
        self._host_lens = [L + n for L, n in zip(self._host_lens, counts)]
        self._min_room = None

    def _reopen(self, new: list[int]) -> None:
        """Before an FP8 cache is truncated to `new`: the 16-bit buffers of each shortened sequence
        filled for its new length (the unquantized keys of its last 128 positions, the open page's values).
        Positions the buffers no longer hold come from their stored pages, dequantized: compression
        windows over them, and the reopened page once it is quantized again, then read those numbers."""
        for b, (L1, L0) in enumerate(zip(new, self._host_lens)):
            if L1 == L0:
                continue
            lo, keep = max(0, L1 - RECENT), max(0, L0 - RECENT)        # the buffer holds [keep, L0) exactly
            if lo < min(L1, keep):
                k, _ = self._read(b, lo, min(L1, keep))
                self.k_recent[b, torch.arange(lo, min(L1, keep), device=self.device) % RECENT] = k
            o = L1 - L1 % KV_BLOCK
            if o < L1 and o != L0 - L0 % KV_BLOCK:                      # a page quantized before: read back
                _, v = self._read(b, o, L1)
                self.v_open[b, torch.arange(o, L1, device=self.device) % KV_BLOCK] = v

    def recompress(self) -> None:
        """Recompute ck1/ck2 of every sequence from its keys (a cache filled by hand through `k`; an FP8
        cache's keys as it reads them)."""
        for ck, (kr, st) in zip((self.ck1, self.ck2), COMPRESSIONS):
            for b, L in enumerate(self._host_lens):
                n = n_windows(L, kr, st)
                if n and self.is_fp8:
                    t = (torch.arange(n, device=self.device)[:, None] * st
                         + torch.arange(kr, device=self.device))
                    ck[b, :n] = _window_mean(self.gather(b)[0][t])
                elif n:
                    t = (torch.arange(n, device=self.device)[:, None] * st
                         + torch.arange(kr, device=self.device))
                    r, s = self._slots(t, torch.full_like(t, b))
                    ck[b, :n] = _window_mean(self.k[r, s])


def append_chunk_tensors(k_new, v_new, k, v, ck1, ck2, seqlens, block_table, starts, counts,
                         fp8=None) -> None:
    """A chunk of `counts[b]` tokens per sequence (packed `[sum(counts), H, D]`) into a cache's tensors
    whose sequences hold `starts[b]` keys, as `DecodeCache.append(k_new, v_new, cu_seqlens)` (which
    checks them): the keys, values, the windows they complete and the lengths. `fp8`: an FP8 cache's
    `fp8_tensors()`."""
    page = k.shape[1] if block_table is not None else None
    width = k.shape[1] * block_table.shape[1] if block_table is not None else k.shape[1]
    view = DecodeCache(k, v, seqlens, block_table, page, ck1, ck2, starts, [width] * len(starts), fp8)
    view._append_chunks(k_new, v_new, list(counts))


def append_one_tensors(k_new, v_new, k, v, ck1, ck2, seqlens, block_table, fp8=None) -> None:
    """One token per sequence into a cache's tensors, in torch ops with device-side positions (static
    shapes, capturable): the key and value at `seqlens[b]`, the windows that end there, then the
    lengths + 1. What `cache_append.cu` does in one launch; the CPU path and the op's CPU kernel.
    `fp8`: an FP8 cache's `fp8_tensors()`: the key and value go to its 16-bit buffers, the windows read
    the unquantized keys there, and a page whose 64th key this is is quantized into `k`, `v`."""
    B = seqlens.shape[0]
    dev = k.device
    paged = block_table is not None
    page = k.shape[1]
    capacity = block_table.shape[1] * page if paged else k.shape[1]

    def slots(pos, b):
        if not paged:
            return b, pos
        return block_table[b, torch.div(pos, page, rounding_mode="floor")].long(), pos % page

    b = torch.arange(B, device=dev)
    pos = seqlens.long()
    if fp8 is None:
        row, slot = slots(pos, b)
        k[row, slot] = k_new
        v[row, slot] = v_new
    else:
        k_scale, v_scale, k_recent, v_open = fp8
        k_recent[b, pos % RECENT] = k_new
        v_open[b, pos % KV_BLOCK] = v_new
    L = pos + 1
    # each step recomputes the window that ends at the new key for every sequence and writes it only
    # where that window is complete now
    for ck, (kr, st) in zip((ck1, ck2), COMPRESSIONS):
        if ck.shape[1] == 0:
            continue
        first = L - kr                                             # window [first, L) ends at the new key
        done = (first >= 0) & (torch.remainder(first, st) == 0)
        i = torch.div(first.clamp(min=0), st, rounding_mode="floor").clamp(max=ck.shape[1] - 1)
        t = first.clamp(min=0)[:, None] + torch.arange(kr, device=dev)[None, :]   # [B, kr]
        if fp8 is None:
            r, s = slots(t.clamp(max=capacity - 1), b[:, None].expand(-1, kr))
            win = _window_mean(k[r, s])                            # [B, H, D]
        else:
            win = _window_mean(k_recent[b[:, None], t % RECENT])   # kr <= 128: the buffer holds them all
        ck[b, i] = torch.where(done[:, None, None], win, ck[b, i])
    if fp8 is not None:
        # quantize every sequence's open page and store it where this key filled it (static shapes)
        full = (L % KV_BLOCK) == 0
        t = (pos - pos % KV_BLOCK)[:, None] + torch.arange(KV_BLOCK, device=dev)[None, :]   # [B, 64]
        k8, ks = quantize_k_pages(k_recent[b[:, None], t % RECENT])
        v8, vs = quantize_v(v_open)
        # a page not full is written back unchanged; its positions are the sequence's own (< capacity)
        r, s = slots(t.clamp(max=capacity - 1), b[:, None].expand(-1, KV_BLOCK))
        m = full[:, None, None, None]
        k[r, s] = torch.where(m, k8, k[r, s])
        v[r, s] = torch.where(m, v8, v[r, s])
        v_scale[r, s] = torch.where(m[..., 0], vs, v_scale[r, s])
        r0, s0 = r[:, 0], s[:, 0] // KV_BLOCK
        k_scale[r0, s0] = torch.where(m[:, 0], ks, k_scale[r0, s0])
    seqlens.add_(1)


def dequantized_tensors(k, v, seqlens, block_table, fp8) -> tuple[torch.Tensor, torch.Tensor]:
    """`DecodeCache.dequantized` on a cache's tensors (`fp8`: its `fp8_tensors()`)."""
    k_scale, v_scale, k_recent, v_open = fp8
    kd, vd = dequantize_rows(k, v, k_scale, v_scale, k_recent.dtype)
    R, S, H, D = k.shape
    B, dev = seqlens.shape[0], k.device
    L = seqlens.long()
    t = (L - L % KV_BLOCK)[:, None] + torch.arange(KV_BLOCK, device=dev)[None, :]     # [B, 64] open page
    live = t < L[:, None]
    b = torch.arange(B, device=dev)[:, None].expand(-1, KV_BLOCK)
    if block_table is not None:
        page = torch.div(t, S, rounding_mode="floor").clamp(max=block_table.shape[1] - 1)
        row = block_table[b, page].long()
        slot = t % S
    else:
        row, slot = b, t.clamp(max=S - 1)
    # positions past a length go to a scratch row: the writes that count never collide
    row = torch.where(live, row, R)
    kd = torch.cat([kd, kd.new_zeros(1, S, H, D)])
    vd = torch.cat([vd, vd.new_zeros(1, S, H, D)])
    kd[row, slot] = k_recent[b, t % RECENT]
    vd[row, slot] = v_open[b, t % KV_BLOCK]
    return kd[:R], vd[:R]


# -------------------------------------------------------------------------------------- helpers
def cache_tensors(cache):
    """`(k, v, seqlens, block_table, width)` of a DecodeCache (an FP8 cache's K and V `dequantized()`)
    or of a tuple `(k_cache, v_cache, seqlens[, block_table])`; width = positions a sequence can
    address (L_max or pages x page_size)."""
    if isinstance(cache, DecodeCache):
        # an FP8 cache's K and V as the references read them (a kernel launcher refuses it first)
        return (*cache.read_kv(False, "cache"), cache.seqlens, cache.block_table, cache.capacity)
    if not isinstance(cache, (tuple, list)) or len(cache) not in (3, 4):
        raise TypeError("cache must be a DecodeCache or a tuple (k_cache, v_cache, seqlens[, block_table])")
    k, v, seqlens = cache[:3]
    bt = cache[3] if len(cache) == 4 else None
    check_tensor("k_cache", k, ndim=4)
    check_tensor("v_cache", v, shape=tuple(k.shape), dtypes=(k.dtype,), device=k.device)
    # int32 as the kernels take it (`check_decode_kernel_inputs`): a CPU call accepts what a GPU call does
    check_tensor("seqlens", seqlens, ndim=1, dtypes=(torch.int32,))
    if bt is not None:
        check_tensor("block_table", bt, ndim=2, dtypes=(torch.int32,))
        if bt.shape[0] != seqlens.shape[0]:
            raise ValueError(f"block_table has {bt.shape[0]} rows but seqlens has {seqlens.shape[0]} "
                             "sequences")
        return k, v, seqlens, bt, bt.shape[1] * k.shape[1]
    if k.shape[0] != seqlens.shape[0]:
        raise ValueError(f"k_cache holds {k.shape[0]} sequences but seqlens has {seqlens.shape[0]}")
    return k, v, seqlens, None, k.shape[1]


def h2d(t: torch.Tensor, device) -> torch.Tensor:
    """A small host tensor on `device`, without a host sync: torch's blocking host-to-device copy
    synchronizes the stream, a non-blocking one from pinned memory does not (the pinned block is
    reused only after the copy, torch's caching host allocator records it on the stream)."""
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def cu_seqlens_of(lengths, device) -> torch.Tensor:
    """int32 `[len + 1]` offsets of host `lengths` on `device`, copied without a host sync (`h2d`)."""
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    if lengths:
        cu[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0).to(torch.int32)
    return h2d(cu, device)


def _check_sizes(**sizes) -> None:
    for name, v in sizes.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")


def _chunk_counts(cu, B: int) -> list[int]:
    if isinstance(cu, torch.Tensor):
        check_tensor("cu_seqlens_new", cu, ndim=1, dtypes=INT_DTYPES)
        c = [int(x) for x in cu.cpu().tolist()]
    else:
        c = host_int_list("cu_seqlens_new", cu, what="int offsets")
    if len(c) != B + 1 or c[0] != 0 or any(b < a for a, b in itertools.pairwise(c)):
        raise ValueError(f"cu_seqlens_new must be {B + 1} non-decreasing offsets from 0, got {c[:16]}")
    return [b - a for a, b in itertools.pairwise(c)]


def _check_block_table(bt, num_pages: int, page_size: int, device: torch.device) -> list[int]:
    """Capacity of each sequence (leading valid pages x page_size) of a checked block table."""
    check_tensor("block_table", bt, ndim=2, dtypes=(torch.int32,), device=device)
    t = bt.cpu().long()
    if bool(((t < -1) | (t >= num_pages)).any()):
        bad = t[(t < -1) | (t >= num_pages)][0].item()
        raise ValueError(f"block_table: entry {bad} is out of range [0, {num_pages}) (or -1 for no page)")
    valid = t >= 0
    # -1 only after the last valid page: a sequence's pages are a prefix of its row
    if bool((valid[:, 1:] & ~valid[:, :-1]).any()):
        b = int((valid[:, 1:] & ~valid[:, :-1]).any(1).nonzero()[0])
        raise ValueError(f"block_table: row {b} has a page after a -1 entry (-1 marks the unused tail)")
    used = t[valid]
    if used.numel() != torch.unique(used).numel():
        vals, cnt = torch.unique(used, return_counts=True)
        raise ValueError(f"block_table: page {int(vals[cnt > 1][0])} is listed twice (shared between "
                         f"sequences or within one)")
    return [int(n) * page_size for n in valid.sum(1).tolist()]


def max_blocks(capacity: int) -> int:
    """64-key blocks that `capacity` positions span."""
    return math.ceil(capacity / KV_BLOCK)
