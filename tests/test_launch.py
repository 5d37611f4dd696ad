"""The ctypes side of launches (`_launch.launch`, `PreparedLaunch`), on the CPU: the driver's structs must
have cuda.h's layout and every argument must reach the driver by address with its C layout."""
import ctypes

import numpy as np
import pytest

from infllm_cupy import _launch


def test_launch_structs_match_cuda_h():
    # CUlaunchAttribute: int id, 4 pad bytes, a 64-byte value union
    assert ctypes.sizeof(_launch._LaunchAttribute) == 72
    assert _launch._LaunchAttribute.value.offset == 8
    # CUlaunchConfig: 7 unsigned ints, then CUstream, CUlaunchAttribute*, unsigned int numAttrs
    assert ctypes.sizeof(_launch._LaunchConfig) == 56
    assert (_launch._LaunchConfig.stream.offset, _launch._LaunchConfig.attrs.offset,
            _launch._LaunchConfig.num_attrs.offset) == (32, 40, 48)
    attr = _launch._LaunchAttribute(id=_launch._PROGRAMMATIC_STREAM_SERIALIZATION,
                                    value=(1).to_bytes(4, "little"))
    assert bytes(attr)[:12] == b"\x06\x00\x00\x00\x00\x00\x00\x00\x01\x00\x00\x00"
    # a c_char array initialised from bytes stops at the first NUL: a value with NULs inside (a
    # cluster's x, y, z) would lose its later bytes, so the launch copies values with memmove
    assert bytes(_launch._LaunchAttribute(id=4,
                                          value=b"\x08\x00\x00\x00\x01"))[8:13] == b"\x08\x00\x00\x00\x00"


class _Kernel:
    """A stand-in for a loaded kernel: what PreparedLaunch reads of CuPy's RawKernel."""
    max_dynamic_shared_size_bytes = 0
    kernel = type("F", (), {"ptr": 0})()


def test_programmatic_launch_sets_the_attribute_bytes(monkeypatch):
    seen = {}

    class FakeDriver:
        def cuLaunchKernelEx(self, cfg, fn, params, extra):
            c = cfg._obj                     # ctypes.byref(config)
            seen["attrs"] = [(c.attrs[i].id, bytes(c.attrs[i])[8:16]) for i in range(c.num_attrs)]
            return 0
    monkeypatch.setattr(_launch, "_driver", lambda: FakeDriver())
    _launch.PreparedLaunch(_Kernel(), name="k", grid=(8, 2), block=(128,), shared_mem=0,
                           args=(np.int32(1),)).launch(0, pdl=True)
    assert seen["attrs"] == [(6, b"\x01" + b"\x00" * 7)]


def test_launch_rejects_python_scalars():
    # a Python int has no fixed C type: it must fail before anything reaches the driver
    with pytest.raises(TypeError, match=r"NumPy scalars .*got int"):
        _launch.PreparedLaunch(_Kernel(), name="k", grid=(1,), block=(32,), shared_mem=0,
                               args=(np.int32(1), 3))


def test_prepared_launch_hands_the_driver_each_argument_by_address(monkeypatch):
    # cuLaunchKernel reads sizeof(parameter) bytes from each address: each field of a parameter struct
    # is one kernel argument (kernels_cu/common/params.cuh) at its own address inside the packed
    # struct, and a plain scalar sits in the low bytes of its own slot
    import struct

    from infllm_cupy._params import KernelParams

    decl = KernelParams("tests/no_source.cu", "TestParams", """
        ptr a
        i32 n
        f32 x
        i64 m
    """)
    seen = {}

    class FakeDriver:
        def cuLaunchKernel(self, fn, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
            seen["fields"] = [ctypes.string_at(params[i], size) for i, size in enumerate((8, 4, 4, 8))]
            seen["struct"] = ctypes.string_at(params[0], decl.size)   # the fields in the struct's layout
            seen["scalar"] = ctypes.string_at(params[4], 4)
            seen["launch"] = (gx, gy, gz, bx, by, bz, smem, stream)
            return 0
    monkeypatch.setattr(_launch, "_driver", lambda: FakeDriver())
    packed = decl.pack(a=0x1234, n=-3, x=0.5, m=2**40)
    _launch.PreparedLaunch(_Kernel(), name="k", grid=(4, 2), block=(64,), shared_mem=100,
                           args=(packed, np.int32(7))).launch(99)
    assert decl.field_offsets == (0, 8, 12, 16)
    assert seen["fields"] == [struct.pack("<Q", 0x1234), struct.pack("<i", -3), struct.pack("<f", 0.5),
                              struct.pack("<q", 2**40)]
    assert seen["struct"] == struct.pack("<Qifq", 0x1234, -3, 0.5, 2**40)
    assert seen["scalar"] == struct.pack("<i", 7)
    assert seen["launch"] == (4, 2, 1, 64, 1, 1, 100, 99)


# ------------------------------------------------------------------------------------------------
# a failed launch names the kernel and its arguments' shapes (docs/reliability.md, "The run-time
# compiler under faults")
# ------------------------------------------------------------------------------------------------
def test_launch_error_names_kernel_grid_and_argument_shapes():
    import torch

    q = torch.zeros(7, 4, 64, dtype=torch.bfloat16)
    _launch._remember(0x7000, q)
    err = _launch.launch_error("stage2_fwd<__nv_bfloat16, 64>", (3, 2), (128,), 49152,
                               (np.uint64(0x7000), np.uint64(0x9990), np.uint64(0), np.int32(7),
                                np.float32(0.125),
                                np.zeros(128, np.uint8)), RuntimeError("CUDA_ERROR_INVALID_VALUE"))
    msg = str(err)
    assert "stage2_fwd<__nv_bfloat16, 64>" in msg and "CUDA_ERROR_INVALID_VALUE" in msg
    assert "grid=(3, 2), block=(128,), dynamic shared memory=49152 B" in msg
    assert "arg0=bfloat16[7, 4, 64]@0x7000" in msg and "arg1=pointer@0x9990" in msg and "arg2=nullptr" in msg
    assert "arg3=int32 7" in msg and "arg4=float32 0.125" in msg and "arg5=array uint8[128]" in msg


def test_failed_launch_raises_with_the_description(monkeypatch):
    # the driver's refusal, mocked (no GPU here): launch() turns it into the described RuntimeError,
    # with the parameter struct's fields by name
    import torch

    from infllm_cupy.compress.mean_pool import MEAN_POOL_PARAMS

    class FakeDriver:
        def cuLaunchKernel(self, *a):
            return 1
    monkeypatch.setattr(_launch, "_driver", lambda: FakeDriver())
    monkeypatch.setattr(_launch, "_error_string", lambda res: "invalid argument")
    monkeypatch.setattr(_launch, "raw_stream", lambda index: 0)
    monkeypatch.setattr(_launch.torch.cuda, "current_device", lambda: 0)
    k = torch.zeros(7, 4, 64, dtype=torch.bfloat16)
    _launch._remember(0x7000, k)
    params = MEAN_POOL_PARAMS.pack(k=0x7000, cu_seqlens_k=0x9990, cu_seqlens_c=None, out=0x8000, batch=1,
                                   total_c=3, H=4, kernel_size=32, kernel_stride=16)
    with pytest.raises(RuntimeError, match=r"(?s)launch of kernel compress_mean_pool failed: cuLaunchKernel: "
                                           r"error 1 \(invalid argument\).*grid=\(4, 1, 1\), "
                                           r"block=\(64, 1, 1\).*"
                                           r"k=bfloat16\[7, 4, 64\]@0x7000, cu_seqlens_k=pointer@0x9990, "
                                           r"cu_seqlens_c=nullptr, .*batch=1, total_c=3"):
        _launch.launch(_Kernel(), name="compress_mean_pool", grid=(4,), block=(64,), params=params)


@pytest.mark.gpu
def test_a_real_failed_launch_names_the_kernel_and_shapes():
    import torch

    from infllm_cupy import _jit
    from infllm_cupy.compress import mean_pool

    k = torch.randn(100, 2, 64, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(5, 2, 64, device="cuda", dtype=torch.bfloat16)
    kern = _jit.get_kernel(mean_pool.SOURCE, "compress_mean_pool<__nv_bfloat16, 64>")
    # 4096 threads per block: every GPU refuses the launch itself
    with pytest.raises(RuntimeError,
                       match=r"(?s)compress_mean_pool.*block=\(4096, 1, 1\).*k=bfloat16\[100, 2, 64\]"):
        _launch.launch(kern, name="compress_mean_pool", grid=(1,), block=(4096,),
                       params=mean_pool.MEAN_POOL_PARAMS.pack(
                           k=k, cu_seqlens_k=None, cu_seqlens_c=None, out=out, batch=1, total_c=5, H=2,
                           kernel_size=32, kernel_stride=16))
