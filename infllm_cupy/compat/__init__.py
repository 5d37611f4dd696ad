"""Drop-in replacements for other packages' APIs on infllm-cupy's ops.

`infllm_cupy.compat.infllm_v2` offers the public functions of the original InfLLM-v2 package
(`infllm_v2`, OpenBMB/infllmv2_cuda_impl) with the same signatures, shapes and semantics. Nothing is
registered at import; `install()` makes `import infllm_v2` and its submodule paths resolve to it.
"""
import sys
import types

from . import infllm_v2

__all__ = ["install", "SUBMODULES"]

# The original package's submodules and the public names each defines (its `__init__` re-exports them),
# so that `from infllm_v2.max_pooling_1d import max_pooling_1d_varlen` and the like keep working.
SUBMODULES = {
    "infllmv2_sparse_attention": ("infllmv2_attn_stage1", "infllmv2_attn_varlen_func",
                                  "infllmv2_attn_with_kvcache"),
    "max_pooling_1d": ("max_pooling_1d", "max_pooling_1d_varlen"),
    "topk_to_uint64": ("topk_to_uint64", "TopkToUint64Converter"),
    "uint64_to_bool": ("uint64_to_bool",),
    "blockmask_to_uint64": ("blockmask_to_uint64",),
}


def install() -> None:
    """Register `infllm_cupy.compat.infllm_v2` as the package `infllm_v2` in `sys.modules` (opt-in), with
    the original's submodules (`infllm_v2.max_pooling_1d`, `infllm_v2.topk_to_uint64`, ...; `SUBMODULES`)
    as modules holding the same function objects.

    Existing code that does `import infllm_v2`, `from infllm_v2 import ...` or imports a submodule then
    runs on our ops. Replaces an `infllm_v2` (and its submodules) that was already imported.
    """
    sys.modules["infllm_v2"] = infllm_v2
    for name, names in SUBMODULES.items():
        sub = types.ModuleType(f"infllm_v2.{name}", f"infllm_v2.{name} of infllm-cupy's compat layer "
                                                    f"(infllm_cupy.compat.infllm_v2)")
        for n in names:
            setattr(sub, n, getattr(infllm_v2, n))
        sub.__all__ = list(names)
        sys.modules[sub.__name__] = sub
