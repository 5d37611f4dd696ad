"""Host-side checks of the TMA tensor-map builder (infllm_cupy/_tma.py). Its argument checks run
before any driver call, so they are tested on CPU tensors; the encoding itself runs in every
sm_90a forward and backward test on the GPU."""
import pytest
import torch

from infllm_cupy._tma import TMAP_BYTES, TMAP_DTYPE, heads_map, rows_map


def test_map_is_128_opaque_bytes():
    assert TMAP_DTYPE.itemsize == TMAP_BYTES == 128


@pytest.mark.parametrize("make, match", [
    (lambda: torch.zeros(8, 2, 64, dtype=torch.float32), "16-bit"),
    (lambda: torch.zeros(8, 2, 128, dtype=torch.bfloat16)[:, :, ::2], "contiguous"),
    (lambda: torch.zeros(0, 2, 64, dtype=torch.bfloat16), "non-empty"),
    (lambda: torch.zeros(8, 1, 32, dtype=torch.float16), "multiple of 64"),
    (lambda: torch.zeros(8 * 128 + 1, dtype=torch.bfloat16)[1:].view(8, 128), "16-byte aligned"),
])
def test_bad_tensors_are_named_before_the_driver(make, match):
    with pytest.raises(ValueError, match=match):
        rows_map(make(), 64)


@pytest.mark.parametrize("make, box_heads, match", [
    (lambda: torch.zeros(8, 2, 64, dtype=torch.float32), 2, "16-bit"),
    (lambda: torch.zeros(8, 128, dtype=torch.bfloat16), 2, "3-d"),
    (lambda: torch.zeros(0, 2, 64, dtype=torch.bfloat16), 2, "non-empty"),
    (lambda: torch.zeros(8, 16, 96, dtype=torch.bfloat16), 16, "multiple of 64"),
    (lambda: torch.zeros(8, 12, 64, dtype=torch.bfloat16), 12, "dividing 64"),
    (lambda: torch.zeros(8, 8, 64, dtype=torch.bfloat16), 16, "at most 8"),
    (lambda: torch.zeros(8 * 128 + 1, dtype=torch.bfloat16)[1:].view(8, 2, 64), 2, "16-byte aligned"),
])
def test_bad_heads_maps_are_named_before_the_driver(make, box_heads, match):
    with pytest.raises(ValueError, match=match):
        heads_map(make(), box_heads)
