"""What `topk` means (MiniCPM4's definition, docs/semantics.md): K = topk + local_blocks slots per query
token, the forced init and local blocks inside them; configurations that cannot keep every forced block
are refused."""
from __future__ import annotations

import pytest
import torch

from infllm_cupy.compress.naive import naive_compress_k
from infllm_cupy.config import InfLLMv2Config
from infllm_cupy.pipeline import naive_infllmv2_attention
from infllm_cupy.stage1.naive import naive_stage1_select


def forced_blocks(t: int, init_blocks: int, local_blocks: int, block_size: int = 64) -> set[int]:
    """The blocks stage 1 forces for prefill token `t`: the init blocks and the local window ending at
    the token's own block (local_blocks + 1 blocks)."""
    qb = t // block_size
    return set(range(min(init_blocks, qb + 1))) | set(range(max(0, qb - local_blocks), qb + 1))


def select(T: int, topk: int, local_blocks: int, init_blocks: int, seed: int = 0) -> torch.Tensor:
    """Stage 1 of the reference (which, like the original, takes any topk) on random data."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, 4, 32, generator=g)
    k = torch.randn(T, 2, 32, generator=g)
    cu = torch.tensor([0, T], dtype=torch.int32)
    ck1, cu1 = naive_compress_k(k, cu, 32, 16)
    ck2, cu2 = naive_compress_k(k, cu, 128, 64)
    return naive_stage1_select(q, ck1, ck2, cu, cu1, cu2, T, topk=topk, local_blocks=local_blocks,
                               init_blocks=init_blocks, score_dtype=torch.float32)


@pytest.mark.parametrize("init_blocks, local_blocks", [(1, 2), (2, 3), (0, 2), (1, 0)])
def test_smallest_topk_keeps_exactly_the_forced_blocks(init_blocks, local_blocks):
    """topk = init_blocks + 1 fills K = topk + local_blocks with the forced blocks; one less drops some."""
    T = 1024
    topk = init_blocks + 1
    idx = select(T, topk, local_blocks, init_blocks)
    assert idx.shape == (2, T, topk + local_blocks)          # K = topk + local_blocks slots
    for t in range(T):
        want = forced_blocks(t, init_blocks, local_blocks)
        for h in range(2):
            got = {int(x) for x in idx[h, t] if x >= 0}
            assert got == want, (t, h, got, want)            # nothing left over for scored picks
    # one slot fewer: tokens whose init and local blocks do not overlap lose a forced block
    short = select(T, topk - 1, local_blocks, init_blocks)
    t = T - 1
    assert {int(x) for x in short[0, t] if x >= 0} < forced_blocks(t, init_blocks, local_blocks)


def test_scored_picks_are_topk_minus_the_forced():
    """MiniCPM4's split, scaled down: K = topk + local_blocks = 1 init + (local_blocks + 1) local + the
    rest by score."""
    T, topk, local_blocks = 1024, 5, 2
    idx = select(T, topk, local_blocks, 1)
    t = T - 1
    row = {int(x) for x in idx[0, t] if x >= 0}
    forced = forced_blocks(t, 1, local_blocks)
    assert forced <= row and len(row - forced) == topk - 1 - 1 == len(row) - (1 + local_blocks + 1)


@pytest.mark.parametrize("topk, init_blocks", [(0, 1), (1, 1), (2, 2), (3, 3), (0, 0)])
def test_config_refuses_a_topk_that_drops_forced_blocks(topk, init_blocks):
    with pytest.raises(ValueError,
                       match=rf"topk must be at least init_blocks \+ 1 = {init_blocks + 1}, got {topk}"):
        InfLLMv2Config(topk=topk, init_blocks=init_blocks)


@pytest.mark.parametrize("topk, init_blocks", [(2, 1), (1, 0), (4, 3), (64, 1)])
def test_config_accepts_the_smallest_topk_that_keeps_them(topk, init_blocks):
    cfg = InfLLMv2Config(topk=topk, init_blocks=init_blocks, local_blocks=2, dense_len=0)
    T = 512
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(T, h, 16, generator=g) for h in (2, 1, 1))
    cu = torch.tensor([0, T], dtype=torch.int32)
    _, aux = naive_infllmv2_attention(q, k, v, cu, cu, T, T, cfg, return_aux=True)
    idx = aux["topk_idx"]
    assert idx.shape[-1] == min(topk + 2, T // 64)
    for t in (T - 1, T // 2, 100):
        assert forced_blocks(t, init_blocks, 2) <= {int(x) for x in idx[0, t] if x >= 0}
