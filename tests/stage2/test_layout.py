"""BlockLayout: conversions to and from dense masks, the token-level form, the kernel packing."""
import pytest
import torch

from infllm_cupy.stage2.attention import block_sparse_attn_varlen
from infllm_cupy.stage2.cpu import cpu_block_sparse_attn_varlen, cpu_sparse_attn_varlen
from infllm_cupy.stage2.layout import BlockLayout
from infllm_cupy.stage2.naive import naive_sparse_attn_varlen
from infllm_cupy.testing import cu_seqlens_from_lengths


def test_dense_round_trip_and_128_key_blocks():
    m128 = torch.rand(2, 5, 7) < 0.4
    layout = BlockLayout.from_dense(m128, q_block=128, kv_block=128)
    assert layout.mask.shape == (2, 5, 14)
    assert torch.equal(layout.to_dense(kv_block=128), m128)
    assert torch.equal(layout.to_dense()[..., ::2], m128) and torch.equal(layout.to_dense()[..., 1::2], m128)


def test_to_topk_idx_is_ascending_with_tail_padding():
    mask = torch.tensor([[[1, 0, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]]], dtype=torch.bool)  # [H=1, NQB=3, NKB=4]
    cu = cu_seqlens_from_lengths([3, 2])
    idx = BlockLayout(mask, q_block=1).to_topk_idx(cu)
    assert idx.shape == (1, 5, 4) and idx.dtype == torch.int32
    assert idx[0].tolist() == [[0, 2, -1, -1], [-1, -1, -1, -1], [0, 1, 2, 3], [0, 2, -1, -1],
                               [-1, -1, -1, -1]]


def test_packed_bits():
    mask = torch.zeros(1, 2, 70, dtype=torch.bool)
    mask[0, 0, [0, 31, 32, 69]] = True
    mask[0, 1, 5] = True
    words, base, h_stride = BlockLayout(mask).packed(n_words=3, device="cpu")
    assert base is None and h_stride == 2
    u = words.to(torch.int64) % 2**32
    assert u.tolist() == [[1 | 1 << 31, 1, 1 << 5], [1 << 5, 0, 0]]


def test_reference_path_matches_token_level():
    """A layout is its token-level form on every CPU path: the reference (bit for bit) and the CPU
    implementation (bit for bit with its token-level call, within fp32 rounding of the reference)."""
    lq = [130, 64]
    cu = cu_seqlens_from_lengths(lq)
    q, k, v = torch.randn(194, 4, 64), torch.randn(194, 2, 64), torch.randn(194, 2, 64)
    layout = BlockLayout(torch.rand(2, 2, 3) < 0.5, q_block=128)
    idx = layout.to_topk_idx(cu)
    ref = naive_sparse_attn_varlen(q, k, v, cu, cu, idx, 130, 130)
    assert torch.equal(block_sparse_attn_varlen(q, k, v, cu, cu, layout, 130, 130, backend="reference"), ref)
    out = block_sparse_attn_varlen(q, k, v, cu, cu, layout, 130, 130)
    assert torch.equal(out, cpu_sparse_attn_varlen(q, k, v, cu, cu, idx, 130, 130))
    assert torch.equal(out, cpu_block_sparse_attn_varlen(q, k, v, cu, cu, layout, 130, 130))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layout, match", [
    (BlockLayout(torch.ones(3, 3, 3, dtype=torch.bool)), "layout has 3 KV heads but k has 2"),
    (BlockLayout(torch.ones(2, 1, 3, dtype=torch.bool)), "max_seqlen_q=130 needs 3"),
    (BlockLayout(torch.ones(3, 2, 3, 3, dtype=torch.bool)), "layout has 3 sequences"),
])
def test_bad_layouts(layout, match):
    cu = cu_seqlens_from_lengths([130, 64])
    q, k = torch.randn(194, 4, 64), torch.randn(194, 2, 64)
    with pytest.raises(ValueError, match=match):
        block_sparse_attn_varlen(q, k, k, cu, cu, layout, 130, 130)


def test_layout_rejects_non_bool():
    with pytest.raises(TypeError, match="mask must have dtype bool"):
        BlockLayout(torch.ones(1, 2, 2))
