"""The ctypes side of programmatic dependent launches (`_launch.launch(..., pdl=True)`), on the CPU:
the structs must have cuda.h's layout, or cuLaunchKernelEx would read garbage."""
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


def test_programmatic_launch_sets_the_attribute_bytes():
    seen = {}

    class FakeDriver:
        def cuLaunchKernelEx(self, cfg, fn, params, extra):
            c = cfg._obj                     # ctypes.byref(config)
            seen["attrs"] = [(c.attrs[i].id, bytes(c.attrs[i])[8:16]) for i in range(c.num_attrs)]
            return 0
    kern = type("K", (), {"kernel": type("F", (), {"ptr": 0})()})()
    orig = _launch._driver
    _launch._driver = lambda: FakeDriver()
    try:
        _launch._launch_programmatic(kern, (8, 2), (128,), (np.int32(1),), 0, 0)
    finally:
        _launch._driver = orig
    assert seen["attrs"] == [(6, b"\x01" + b"\x00" * 7)]


def test_programmatic_launch_rejects_python_scalars():
    # a Python int has no fixed C type: it must fail before anything reaches the driver
    with pytest.raises(TypeError, match="NumPy scalars or arrays, got int"):
        _launch._launch_programmatic(None, (1,), (32,), (np.int32(1), 3), 0, 0)


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
    # the driver's refusal, mocked (no GPU here): launch() turns it into the described RuntimeError
    import contextlib

    pytest.importorskip("cupy")

    class Refusing:
        max_dynamic_shared_size_bytes = 0

        def __call__(self, *a, **k):
            raise _launch._DriverError("cuLaunchKernel: error 1 (invalid argument)")

    monkeypatch.setattr(_launch.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(_launch.torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(_launch, "current_stream", lambda: None)
    with pytest.raises(RuntimeError, match=r"(?s)launch of kernel compress_mean_pool failed: cuLaunchKernel.*"
                                           r"grid=\(4,\), block=\(64,\).*arg0=int32 3"):
        _launch.launch(Refusing(), name="compress_mean_pool", grid=(4,), block=(64,), args=(np.int32(3),))


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
                       match=r"(?s)compress_mean_pool.*block=\(4096,\).*bfloat16\[100, 2, 64\]"):
        _launch.launch(kern, name="compress_mean_pool", grid=(1,), block=(4096,),
                       args=(_launch.ptr(k), _launch.ptr(out), np.int32(5)))
