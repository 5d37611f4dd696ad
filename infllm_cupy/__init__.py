"""infllm-cupy: InfLLM-v2 trainable two-stage sparse attention as raw CUDA compiled at run time.

CUDA tensors run the kernels in kernels_cu/ (compiled by NVRTC through CuPy on first use); CPU
tensors run the PyTorch reference of the same op, so everything also works on a laptop.
"""
__version__ = "0.1.0"

from .compress import compress_k, naive_compress_k

__all__ = ["__version__", "compress_k", "naive_compress_k"]
