"""Launchers of the 8-bit stage-2 forward (`precision="int8-fp8"`, docs/stage2_q8.md): the quantization
kernel (kernels_cu/stage2/q8_quantize.cu) and the attention kernel (kernels_cu/stage2/q8_fwd.cu).

The kernels have not yet run on a GPU: until their GPU tests (tests/stage2/test_q8_fwd.py) have passed
on one, every CUDA tensor on this plan is refused (`check_q8_device`) and CPU tensors run the plan's
reference (stage2/q8_naive.py)."""
from __future__ import annotations

import torch

from .q8_naive import PLAN

# Flipped once the GPU tests of the 8-bit kernels pass on a GPU (docs/stage2_q8.md, "Status").
VERIFIED_ON_HARDWARE = False


def check_q8_device(t: torch.Tensor, name: str = "q") -> None:
    """Raise NotImplementedError for a CUDA tensor `name` on the 8-bit plan while its kernels are not
    verified on hardware (`VERIFIED_ON_HARDWARE`)."""
    if isinstance(t, torch.Tensor) and t.is_cuda and not VERIFIED_ON_HARDWARE:
        raise NotImplementedError(
            f"{PLAN} on CUDA tensors ({name} is on {t.device}): the 8-bit kernels are not yet verified on "
            f"hardware (they compile, but their GPU tests have never run); run this plan on CPU tensors "
            f"(its reference) or use precision='16bit' on the GPU")
