"""CuPy, imported where a kernel is compiled or launched, with an install hint when it is missing.

CuPy and the NVRTC / CUDA-header wheels are the `gpu` extra: a CPU-only install leaves them out
(every CPU tensor runs the PyTorch references), so a CUDA tensor that reaches a kernel on such an
install must say which extra to add rather than end in a bare `ModuleNotFoundError`.
"""
from __future__ import annotations

GPU_EXTRA_HINT = ('the CUDA kernels need CuPy and the CUDA runtime wheels: pip install "infllm-cupy[gpu]" '
                  '(from a checkout: pip install -e ".[gpu]"); CPU tensors run the PyTorch references '
                  'without it')


def import_cupy():
    """`import cupy`, raising ImportError with `GPU_EXTRA_HINT` when it is not installed."""
    try:
        import cupy
    except ImportError as e:   # ModuleNotFoundError, or a broken CUDA wheel underneath CuPy
        raise ImportError(f"{GPU_EXTRA_HINT} ({e})") from e
    return cupy


def import_nvrtc():
    """CuPy's thin NVRTC binding (compiles without a GPU or driver), with the same hint when missing."""
    try:
        from cupy_backends.cuda.libs import nvrtc
    except ImportError as e:
        raise ImportError(f"{GPU_EXTRA_HINT} ({e})") from e
    return nvrtc


def has_nvrtc() -> bool:
    """Whether NVRTC compiles can run here (CuPy and the NVRTC wheel installed; no GPU needed)."""
    try:
        import_nvrtc().getVersion()
    except Exception:  # noqa: BLE001 - any failure to load NVRTC means no compiles here
        return False
    return True
