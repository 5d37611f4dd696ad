"""Drop-in replacements for other packages' APIs on infllm-cupy's ops.

`infllm_cupy.compat.infllm_v2` offers the public functions of the original InfLLM-v2 package
(`infllm_v2`, OpenBMB/infllmv2_cuda_impl) with the same signatures, shapes and semantics. Nothing is
registered at import; `install()` makes `import infllm_v2` resolve to it.
"""
import sys

__all__ = ["install"]


def install() -> None:
    """Register `infllm_cupy.compat.infllm_v2` as `infllm_v2` in `sys.modules` (opt-in).

    Existing code that does `import infllm_v2` or `from infllm_v2 import ...` then runs on our ops.
    Replaces an `infllm_v2` that was already imported.
    """
    from . import infllm_v2

    sys.modules["infllm_v2"] = infllm_v2
