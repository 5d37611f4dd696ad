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
    attr = _launch._LaunchAttribute(id=_launch._PROGRAMMATIC_STREAM_SERIALIZATION, value=(1).to_bytes(4, "little"))
    assert bytes(attr)[:12] == b"\x06\x00\x00\x00\x00\x00\x00\x00\x01\x00\x00\x00"


def test_programmatic_launch_rejects_python_scalars():
    # a Python int has no fixed C type: it must fail before anything reaches the driver
    with pytest.raises(TypeError, match="NumPy scalars or arrays, got int"):
        _launch._launch_programmatic(None, (1,), (32,), (np.int32(1), 3), 0, 0)
