"""Kernel parameters by name (`infllm_cupy/_params.py`): the layout Python packs, the errors of a
field missing or unknown, and the compile-time checks that fail when Python and CUDA disagree on a
field's place (a reordered, retyped or missing field), on the CPU through NVRTC."""
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

from infllm_cupy import _jit, _params
from infllm_cupy._launch import Packed

REPO = Path(__file__).resolve().parents[1]
SOURCE = "compress/mean_pool.cu"
NAME = "compress_mean_pool<__half, 128>"
FIELDS = """
    ptr k, cu_seqlens_k, cu_seqlens_c, out
    i32 batch, total_c, H, kernel_size, kernel_stride
"""


def test_layout_follows_c_alignment():
    p = _params.KernelParams("tests/no_source.cu", "Layout", """
        i32 a
        ptr b
        f32 c
        tmap m
        u32 d
        i64 e
    """)
    # a 4, pad 4, b 8, c 4, pad to 64, m 128, d 4, pad 4, e 8, size rounded up to the 64-byte alignment
    assert p.offsets == {"a": 0, "b": 8, "c": 16, "m": 64, "d": 192, "e": 200}
    assert p.size == 256
    tmap = np.arange(16, dtype=np.uint64)
    packed = p.pack(a=-1, b=0xABC, c=1.5, m=tmap, d=7, e=-(2**40))
    raw = packed.words.view(np.uint8)[:p.size].tobytes()
    assert struct.unpack_from("<i", raw, 0)[0] == -1 and struct.unpack_from("<Q", raw, 8)[0] == 0xABC
    assert struct.unpack_from("<f", raw, 16)[0] == 1.5 and raw[64:192] == tmap.tobytes()
    assert struct.unpack_from("<I", raw, 192)[0] == 7 and struct.unpack_from("<q", raw, 200)[0] == -(2**40)


def test_pack_names_missing_and_unknown_fields():
    p = _params.KernelParams("tests/no_source.cu", "Named", FIELDS)
    values = dict(k=None, cu_seqlens_k=None, cu_seqlens_c=None, out=None, batch=1, total_c=2, H=3,
                  kernel_size=32, kernel_stride=16)
    assert isinstance(p.pack(**values), Packed)
    with pytest.raises(TypeError, match=r"Named: missing fields \['kernel_stride'\], unknown fields \[\]"):
        p.pack(**{k: v for k, v in values.items() if k != "kernel_stride"})
    with pytest.raises(TypeError, match=r"missing fields \[\], unknown fields \['stride'\]"):
        p.pack(**values, stride=3)
    with pytest.raises(TypeError, match="does not fit its kind"):
        p.pack(**{**values, "batch": 2**40})
    with pytest.raises(ValueError, match="field kind 'int'"):
        _params.KernelParams("tests/no_source.cu", "Bad", "int a")


def test_every_launcher_declaration_has_its_checks():
    """Each declared struct puts its static_asserts into its source's compile."""
    from infllm_cupy.compress.mean_pool import MEAN_POOL_PARAMS

    code = _jit._code(SOURCE)
    assert MEAN_POOL_PARAMS.checks() in code
    assert "static_assert((WARPS) == 4" in code


@pytest.fixture
def own_checks(monkeypatch):
    """The loader's compile-time checks, emptied for one test (restored after)."""
    monkeypatch.setattr(_jit, "_CHECKS", {})


@pytest.mark.nvrtc
def test_the_declared_layout_compiles(own_checks):
    _params.KernelParams(SOURCE, "CompressMeanPoolParams<float>", FIELDS)
    report = _jit.compile_report(SOURCE, [NAME], "sm_80")
    assert [k.name for k in report.kernels] == [NAME]


@pytest.mark.nvrtc
@pytest.mark.parametrize("planted, field", [
    ("""
        ptr k, cu_seqlens_c, cu_seqlens_k, out
        i32 batch, total_c, H, kernel_size, kernel_stride
     """, "cu_seqlens_c"),                                      # two pointers swapped
    ("""
        ptr k, cu_seqlens_k, cu_seqlens_c, out
        i32 batch, total_c, H, kernel_stride, kernel_size
     """, "kernel_stride"),                                     # two ints swapped
    ("""
        ptr k, cu_seqlens_k, cu_seqlens_c, out
        i64 batch
        i32 total_c, H, kernel_size, kernel_stride
     """, "batch"),                                             # a field's size
    ("""
        ptr k, cu_seqlens_k, cu_seqlens_c, out
        i32 batch, total_c, H, kernel_size
     """, "CompressMeanPoolParams<float>: the launcher packs"),  # a field missing at the end
])
def test_a_python_declaration_that_differs_fails_the_compile(own_checks, planted, field):
    _params.KernelParams(SOURCE, "CompressMeanPoolParams<float>", planted)
    with pytest.raises(_jit.KernelCompileError, match=rf"(?s)static assertion failed.*{field}"):
        _jit.compile_report(SOURCE, [NAME], "sm_80")


@pytest.mark.nvrtc
def test_a_cuda_struct_that_differs_fails_the_compile(own_checks, tmp_path, monkeypatch):
    dst = tmp_path / "kernels_cu"
    shutil.copytree(REPO / "kernels_cu", dst)
    src = dst / SOURCE
    text = src.read_text()
    # two entries of the field list swapped: the struct and the kernel's arguments both follow it
    k_entry, c_entry = "F(const int* __restrict__, cu_seqlens_k)", "F(const int* __restrict__, cu_seqlens_c)"
    swapped = text.replace(f"{k_entry}    /* [batch + 1] */ \\\n    {c_entry}",
                           f"{c_entry}    /* [batch + 1] */ \\\n    {k_entry}")
    assert swapped != text, "the field list's lines moved: update the planted swap"
    src.write_text(swapped)
    monkeypatch.setenv(_jit.KERNELS_DIR_ENV, str(dst))
    _jit.clear_cache()
    try:
        _params.KernelParams(SOURCE, "CompressMeanPoolParams<float>", FIELDS)
        with pytest.raises(_jit.KernelCompileError, match=r"(?s)static assertion failed.*cu_seqlens_k"):
            _jit.compile_report(SOURCE, [NAME], "sm_80")
    finally:
        monkeypatch.delenv(_jit.KERNELS_DIR_ENV)
        _jit.clear_cache()


@pytest.mark.nvrtc
def test_a_shared_constant_that_differs_fails_the_compile(own_checks):
    _params.constants(SOURCE, WARPS=8)
    with pytest.raises(_jit.KernelCompileError,
                       match=r"(?s)static assertion failed.*WARPS: infllm_cupy uses 8"):
        _jit.compile_report(SOURCE, [NAME], "sm_80")
