"""The package root: every op is exported next to its reference with the same call signature, and
the block-layout reference agrees with the op's CPU path."""
import inspect

import pytest
import torch

import infllm_cupy
from infllm_cupy import BlockLayout, block_sparse_attn_varlen, naive_block_sparse_attn_varlen
from infllm_cupy.testing import cu_seqlens_from_lengths

OPS = ["compress_k", "stage1_select", "sparse_attn_varlen", "block_sparse_attn_varlen", "infllmv2_attention",
       "sparse_decode"]
# Keyword-only knobs that only a reference has: other key-block sizes than the kernels' 64, and the
# low-precision twin used for tolerances.
REFERENCE_ONLY = {"block_size", "upcast"}


def _params(fn, kind):
    return [p.name for p in inspect.signature(fn).parameters.values() if p.kind == kind]


def test_all_names_resolve():
    missing = [n for n in infllm_cupy.__all__ if not hasattr(infllm_cupy, n)]
    assert not missing
    assert len(set(infllm_cupy.__all__)) == len(infllm_cupy.__all__)


@pytest.mark.parametrize("op", OPS)
def test_op_exported_with_its_reference(op):
    assert op in infllm_cupy.__all__ and f"naive_{op}" in infllm_cupy.__all__
    fn, ref = getattr(infllm_cupy, op), getattr(infllm_cupy, f"naive_{op}")
    positional = inspect.Parameter.POSITIONAL_OR_KEYWORD
    ours, theirs = _params(fn, positional), _params(ref, positional)
    assert ours == theirs[:len(ours)], (ours, theirs)
    accepted = set(inspect.signature(fn).parameters) | REFERENCE_ONLY
    assert set(inspect.signature(ref).parameters) <= accepted


def test_block_layout_reference_matches_the_op():
    lq = [130, 64]
    cu = cu_seqlens_from_lengths(lq)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(194, h, 64, generator=g) for h in (4, 2, 2))
    layout = BlockLayout(torch.rand(2, 2, 3, generator=g) < 0.5, q_block=128)
    out, lse = block_sparse_attn_varlen(q, k, v, cu, cu, layout, 130, 130, return_lse=True)
    ref, ref_lse = naive_block_sparse_attn_varlen(q, k, v, cu, cu, layout, 130, 130, return_lse=True)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    assert out.abs().sum() > 0


def test_block_layout_reference_rejects_bad_layouts():
    cu = cu_seqlens_from_lengths([130, 64])
    q, k = torch.randn(194, 4, 64), torch.randn(194, 2, 64)
    with pytest.raises(TypeError, match="layout must be a BlockLayout"):
        naive_block_sparse_attn_varlen(q, k, k, cu, cu, torch.ones(2, 3, 3, dtype=torch.bool), 130, 130)
    three_heads = BlockLayout(torch.ones(3, 3, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="layout has 3 KV heads but k has 2"):
        naive_block_sparse_attn_varlen(q, k, k, cu, cu, three_heads, 130, 130)
