"""Kernel parameters by name: one C struct per kernel, declared once in Python and checked against the
CUDA source when NVRTC compiles it.

A kernel's fields are one list macro in its `.cu` file (kernels_cu/common/params.cuh) that makes both a
struct, the layout declared here, and the kernel's argument list: the same fields in the same order. The
launcher fills the struct by name, and a launch hands the driver each field's bytes as one argument
(`_launch.PreparedLaunch`; real arguments rather than one `__grid_constant__` struct, because NVVM
optimises `__restrict__` arguments in ways it does not optimise a struct's fields):

    MEAN_POOL = KernelParams("compress/mean_pool.cu", "CompressMeanPoolParams<float>", '''
        ptr k, cu_seqlens_k, cu_seqlens_c, out
        i32 batch, total_c, H, kernel_size, kernel_stride
    ''')
    launch(kernel, name=..., grid=..., block=..., params=MEAN_POOL.pack(k=k, out=out, ...))

`pack` refuses a missing or unknown field by name, so an argument cannot be dropped or shifted. The
declaration mirrors the struct in the `.cu` file field by field; `checks()` turns it into
`static_assert`s on each field's offset and size and on the struct's size, which the loader appends
to the source it compiles (`_jit.register_checks`). A field reordered, retyped, added or removed on
one side only fails the compile with a message naming the field: on the CPU (the test suite compiles
every kernel with NVRTC) and on GPUs whose NVRTC has `__builtin_offsetof` (older ones check the
struct's size only).
Constants both sides use (tile sizes, ring depths) are checked the same way with `constants`.

Field kinds: `ptr` (any device pointer: a tensor, None for null, or an int address), `i32`, `u32`,
`i64`, `f32`, `tmap` (a 128-byte `CUtensorMap`, 64-byte aligned: `TmaMap` in
kernels_cu/common/wgmma_sm90.cuh).
"""
from __future__ import annotations

import struct

import numpy as np
import torch

from . import _jit
from ._launch import Packed, describe_pointer, ptr

# kind: (size, alignment, struct-module code)
_KINDS = {"ptr": (8, 8, "Q"), "i64": (8, 8, "q"), "i32": (4, 4, "i"), "u32": (4, 4, "I"), "f32": (4, 4, "f"),
          "tmap": (128, 64, "128s")}


class KernelParams:
    """The parameter struct of the kernels of one source. `c_type` is the struct as the static checks
    name it (one instance of a template: the layout does not depend on the element type, every
    pointer being 8 bytes); `fields` lists `kind name, name, ...` lines in the struct's order."""

    __slots__ = ("_name_set", "_pack", "c_type", "field_offsets", "kinds", "names", "offsets",
                 "offsets_array", "size", "source", "words")

    def __init__(self, source: str, c_type: str, fields: str):
        self.source, self.c_type = source, c_type
        names, kinds = [], {}
        for line in fields.strip().splitlines():
            kind, _, rest = line.strip().partition(" ")
            if kind not in _KINDS:
                raise ValueError(f"{c_type}: field kind {kind!r} is not one of {tuple(_KINDS)}")
            for name in (n.strip() for n in rest.split(",")):
                if not name.isidentifier() or name in kinds:
                    raise ValueError(f"{c_type}: bad or repeated field name {name!r}")
                names.append(name)
                kinds[name] = kind
        offsets, fmt, at, align = {}, "<", 0, 1
        for name in names:
            size, a, code = _KINDS[kinds[name]]
            pad = -at % a
            fmt += f"{pad}x" * (pad > 0) + code
            offsets[name] = at = at + pad
            at += size
            align = max(align, a)
        tail = -at % align
        fmt += f"{tail}x" * (tail > 0)
        self.names, self.kinds, self.offsets, self.size = tuple(names), kinds, offsets, at + tail
        self.field_offsets = tuple(offsets[n] for n in names)
        self._name_set = frozenset(names)
        self.offsets_array = np.array(self.field_offsets, dtype=np.uint64)   # plus a buffer's address
        self._pack = struct.Struct(fmt)
        assert self._pack.size == self.size
        self.words = -(-self.size // 8)
        _jit.register_checks(source, self.checks())

    def pack(self, **values) -> Packed:
        """The struct packed for `_launch.launch(params=...)`, every field given by name (pointers as
        tensors, None or int addresses; tensor maps as `_tma` arrays)."""
        if values.keys() != self._name_set:
            missing = [n for n in self.names if n not in values]
            unknown = [n for n in values if n not in self.kinds]
            raise TypeError(f"{self.c_type}: missing fields {missing}, unknown fields {unknown}")
        ordered = []
        for name in self.names:
            v, kind = values[name], self.kinds[name]
            if kind == "ptr":
                v = 0 if v is None else int(ptr(v)) if isinstance(v, torch.Tensor) else int(v)
            elif kind == "tmap":
                v = np.ascontiguousarray(v).tobytes()
            ordered.append(v)
        words = np.zeros(self.words, dtype=np.uint64)
        try:
            self._pack.pack_into(words, 0, *ordered)     # straight into the launch's buffer
        except struct.error as e:
            raise TypeError(f"{self.c_type}: a field does not fit its kind ({e}); fields "
                            f"{dict(zip(self.names, ordered))}") from None
        return Packed(words, self)

    def checks(self) -> str:
        """`static_assert`s of every field's offset and size and of the struct's size."""
        t = self.c_type
        lines = [f"// {t}: the layout the launcher packs (as declared in infllm_cupy)",
                 # NVRTC before 13.5 or so lacks the builtin: there only the size is checked (the CPU
                 # compile of the test suite checks every field)
                 "#if defined(__has_builtin)", "#if __has_builtin(__builtin_offsetof)"]
        for name in self.names:
            size = _KINDS[self.kinds[name]][0]
            lines.append(f'static_assert(__builtin_offsetof({t}, {name}) == {self.offsets[name]} && '
                         f'sizeof((({t}*)0)->{name}) == {size}, "{t}::{name}: the launcher packs it at byte '
                         f'{self.offsets[name]}, {size} bytes ({self.kinds[name]})");')
        lines += ["#endif", "#endif"]
        lines.append(f'static_assert(sizeof({t}) == {self.size}, '
                     f'"{t}: the launcher packs {self.size} bytes");')
        return "\n".join(lines)

    def describe(self, words: np.ndarray) -> str:
        """The packed fields in words (pointers by the tensors they came from, when known)."""
        vals = self._pack.unpack(words.view(np.uint8)[:self.size].tobytes())
        out = []
        for name, v in zip(self.names, vals):
            kind = self.kinds[name]
            if kind == "ptr":
                out.append(f"{name}={describe_pointer(v)}")
            elif kind == "tmap":
                out.append(f"{name}=tensor map")
            else:
                out.append(f"{name}={v!r}")
        return ", ".join(out)


def constants(source: str, **values: int) -> None:
    """Check at compile time that `source` defines each name (a macro or constexpr) with the value
    Python uses."""
    lines = [f'static_assert(({name}) == {int(v)}, "{name}: infllm_cupy uses {int(v)}");'
             for name, v in values.items()]
    _jit.register_checks(source, "\n".join(lines))
