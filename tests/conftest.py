import importlib.util
import os

import pytest
import torch

# Every kernel output is allocated NaN-filled, so an element a kernel never writes fails its test.
os.environ.setdefault("INFLLM_CUPY_POISON", "1")


def _has_gpu() -> bool:
    if not torch.cuda.is_available() or importlib.util.find_spec("cupy") is None:
        return False
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


HAS_GPU = _has_gpu()


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU and CuPy")
    for item in items:
        if "gpu" in item.keywords and not HAS_GPU:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
