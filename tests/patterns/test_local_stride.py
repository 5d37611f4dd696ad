"""`local_stride` against a transcription of vLLM's mask construction (vllm/attention/ops/
blocksparse_attention/utils.py: `get_sparse_attn_mask`, `_get_sparse_attn_mask_homo_head`), written
here as explicit loops at token level so that it shares no code with the vectorised constructor."""
import pytest
import torch

from infllm_cupy import BlockLayout
from infllm_cupy.patterns import head_sliding_step, local_stride, per_kv_head


def vllm_token_mask(n_heads, max_seqlen, block_size, local_blocks, vert_stride, homo_head):
    """vLLM's dense token mask [H, max_seqlen, max_seqlen] for q_len = max_seqlen (prefill):
    the block mask expanded by kron to tokens, cut to max_seqlen, times the causal lower triangle."""
    num_blocks = -(-max_seqlen // block_size)
    # get_head_sliding_step: 0 for homogeneous heads, else max(1, int(vert_stride / n_heads))
    step = 0 if homo_head else max(1, int(vert_stride / n_heads))
    block = torch.zeros(n_heads, num_blocks, num_blocks, dtype=torch.bool)
    for h in range(n_heads):
        for qb in range(num_blocks):
            for kb in range(num_blocks):
                strided = (kb + h * step + 1) % vert_stride == 0
                block[h, qb, kb] = qb >= kb and (qb - kb < local_blocks or strided)
    full = torch.kron(block.to(torch.int32), torch.ones(block_size, block_size, dtype=torch.int32)).bool()
    full = full[:, :max_seqlen, :max_seqlen]
    causal = torch.ones(max_seqlen, max_seqlen, dtype=torch.bool).tril()
    return full, full & causal


def layout_token_mask(layout: BlockLayout, seqlen: int):
    """Our layout at token level: query t sees key s when its 64-key block is selected for t's row."""
    t = torch.arange(seqlen)
    rows = layout.mask[:, t // layout.q_block]                 # [H, T, NKB]
    return rows[:, :, t // 64]                                  # [H, T, S]


CASES = [  # (num_heads, max_seqlen, block_size, local_blocks, vert_stride, homo_head)
    (4, 640, 64, 4, 4, True),
    (4, 601, 64, 2, 3, False),
    (8, 777, 64, 3, 8, False),      # step = 1
    (2, 1000, 128, 2, 5, False),    # step = 2 (vert_stride / n_heads truncated)
    (3, 999, 128, 1, 2, True),
    (4, 1100, 192, 2, 3, False),    # odd multiple of 64: q_block 64
    (2, 1300, 256, 2, 2, False),    # q_block 128, rows repeated
    (1, 70, 64, 4, 4, True),        # a single partial block past the first
    (5, 513, 320, 1, 2, False),
]


@pytest.mark.parametrize("H,L,B,local,stride,homo", CASES)
def test_local_stride_bit_identical_to_vllm(H, L, B, local, stride, homo):
    layout = local_stride(H, L, block_size=B, local_blocks=local, vert_stride=stride, homo_head=homo)
    assert layout.q_block == (B if B <= 128 else (128 if B % 128 == 0 else 64))
    assert layout.mask.shape == (H, -(-L // layout.q_block), -(-L // 64))
    full, causal = vllm_token_mask(H, L, B, local, stride, homo)
    ours = layout_token_mask(layout, L)
    assert torch.equal(ours, full)                              # the block pattern itself
    assert torch.equal(ours & torch.ones(L, L, dtype=torch.bool).tril(), causal)   # with causal=True
    if not homo and H > 1:
        assert not torch.equal(layout.mask[0], layout.mask[1])  # heads really slide


def test_head_sliding_step_matches_vllm():
    assert head_sliding_step(4, 4, homo_head=True) == 0
    assert head_sliding_step(4, 16, homo_head=False) == 4
    assert head_sliding_step(32, 8, homo_head=False) == 1
    assert head_sliding_step(3, 8, homo_head=False) == 2


def test_local_stride_rejects_block_sizes_off_the_64_grid():
    for bad in (16, 32, 96, 100, 0):
        with pytest.raises(ValueError, match="block_size"):
            local_stride(2, 256, block_size=bad)
    with pytest.raises(TypeError, match="homo_head must be a bool"):
        local_stride(2, 256, homo_head=1)


def test_local_stride_per_kv_head():
    homo = local_stride(8, 500, block_size=128, homo_head=True, num_kv_heads=2)
    assert homo.mask.shape[0] == 2 and homo.q_block == 128
    assert torch.equal(homo.mask, local_stride(8, 500, block_size=128).mask[::4])
    with pytest.raises(ValueError, match="different patterns"):
        local_stride(8, 500, block_size=64, homo_head=False, vert_stride=8, num_kv_heads=2)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        local_stride(8, 500, num_kv_heads=3)


def test_per_kv_head_collapses_only_agreeing_groups():
    g = torch.Generator().manual_seed(0)
    base = torch.rand(3, 4, 6, generator=g) < 0.5
    agree = base.repeat_interleave(2, dim=0)                    # query heads 2g, 2g+1 share KV head g
    out = per_kv_head(agree, 2)
    assert isinstance(out, BlockLayout) and torch.equal(out.mask, base) and out.q_block == 64
    assert per_kv_head(BlockLayout(agree, 128), 2).q_block == 128
    assert torch.equal(per_kv_head(agree[None].expand(2, -1, -1, -1), 2).mask,
                       base[None].expand(2, -1, -1, -1))
    differ = agree.clone()
    differ[5, 0, 0] = ~differ[5, 0, 0]
    assert per_kv_head(differ, 2) is None
    assert torch.equal(per_kv_head(differ, 1).mask, differ)
    with pytest.raises(ValueError, match="not a multiple of G=4"):
        per_kv_head(agree, 4)
