"""Key compression: mean pooling of keys over windows (InfLLM-v2 "semantic kernels")."""
from .mean_pool import compress_k
from .naive import compressed_cu_seqlens, naive_compress_k

__all__ = ["compress_k", "naive_compress_k", "compressed_cu_seqlens"]
