"""The public `kernel=` argument of the ops, shared by the stage-1 and stage-2 plans and the decode ops
(whose kernels have only the sm80 form: `decode/step.py`, `check_stage1`).

    "auto"   the fastest kernel the device runs (sm_90a on capability 9.0 where it applies)
    "sm80"   the mma.sync kernels (any GPU from capability 8.0, the H100 included)
    "sm90a"  the Hopper kernels (wgmma, TMA); only on capability 9.0

Everything finer (tile shapes, step shapes, passes) is a field of a plan (`stage2/plan.py`,
`stage1/plan.py`), chosen from shapes and the device, never by the caller of a public op.
"""
from __future__ import annotations

SM80, SM90A = "sm80", "sm90a"   # the two kernel families; plans name the one they run
KERNELS = ("auto", SM80, SM90A)
SM90A_CAPABILITY = (9, 0)   # sm_90a code runs on exactly this capability (H100, H200)


def check_kernel(kernel) -> str:
    """`kernel` must be one of `KERNELS`; returns it."""
    if not isinstance(kernel, str) or kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    return kernel


def wants_sm90a(kernel: str, capability, what: str) -> bool:
    """Whether the sm_90a kernel runs: for "auto" on capability 9.0, for "sm90a" always (on another
    capability it raises ValueError naming `what`), never for "sm80"."""
    check_kernel(kernel)
    hopper = tuple(capability) == SM90A_CAPABILITY if capability is not None else False
    if kernel == "sm90a" and not hopper:
        raise ValueError(f"kernel='sm90a' needs a device of compute capability 9.0 (H100, H200) for {what}; "
                         f"this one has {capability}")
    return kernel == "sm90a" or (kernel == "auto" and hopper)
