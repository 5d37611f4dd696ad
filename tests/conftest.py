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

# Stage-2 kernel cases, forward and backward: (lengths_q, lengths_k, HQ, H, D). Ragged batches,
# lengths not multiples of 64, one-token sequences, G from 1 to 32 (a non-power of two among them),
# queries shorter than keys (bottom-right causal alignment) and a sequence past 2048 tokens.
STAGE2_CASES = [
    ([1000], [1000], 32, 2, 128),
    ([1, 63, 64, 65, 300], [1, 63, 64, 65, 300], 16, 1, 64),
    ([513, 1], [513, 1], 8, 2, 128),
    ([200, 777], [200, 777], 32, 1, 128),
    ([333, 17], [333, 17], 2, 2, 64),
    ([129, 70], [129, 70], 4, 2, 64),
    ([129, 70], [129, 70], 1, 1, 128),
    ([260], [260], 24, 2, 128),
    ([100, 37, 5], [700, 37, 64], 16, 1, 128),
    ([2100, 90], [2100, 90], 4, 2, 64),
]
STAGE2_IDS = [f"Lq{'-'.join(map(str, c[0]))}_Lk{'-'.join(map(str, c[1]))}_HQ{c[2]}_H{c[3]}_D{c[4]}"
              for c in STAGE2_CASES]


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU and CuPy")
    for item in items:
        if "gpu" in item.keywords and not HAS_GPU:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
