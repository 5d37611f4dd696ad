"""sliding_tile: the tiling permutation round-trips, and the layout equals a brute-force token-level
construction of STA's rule (written per token pair, from coordinates, as STA's FlexAttention
mask_mod states it: window centre clamped to [w//2, n-1-(w//2 + w%2 - 1)] in tiles)."""
import itertools

import pytest
import torch

from infllm_cupy.patterns import sliding_tile, tile_permutation


def sta_token_mask(grid, tile, window):
    """[N, N] over the ORIGINAL (row-major) token order: query token attends key token when, along
    every axis, the key's tile index lies in the query tile's clamped window."""
    coords = list(itertools.product(*[range(g) for g in grid]))
    N = len(coords)
    out = torch.zeros(N, N, dtype=torch.bool)
    ntiles = [g // t for g, t in zip(grid, tile)]
    for qi, qc in enumerate(coords):
        for ki, kc in enumerate(coords):
            ok = True
            for a in range(len(grid)):
                qt, kt, w, n = qc[a] // tile[a], kc[a] // tile[a], window[a], ntiles[a]
                left, right = w // 2, w // 2 + (w % 2 - 1)
                centre = min(max(qt, left), n - 1 - right) if left <= n - 1 - right else n - 1 - right
                ok = ok and centre - left <= kt <= centre + right
            out[qi, ki] = ok
    return out


@pytest.mark.parametrize("grid,tile", [((8, 16), (4, 16)), ((4, 6, 8), (2, 2, 4)), ((3, 4, 4), (1, 4, 4))])
def test_permutation_round_trip_and_contiguous_tiles(grid, tile):
    perm, inv = tile_permutation(grid, tile)
    N = torch.tensor(grid).prod().item()
    assert sorted(perm.tolist()) == list(range(N))
    x = torch.randn(N, 3)
    assert torch.equal(x[perm][inv], x) and torch.equal(x[inv][perm], x)
    vol = torch.tensor(tile).prod().item()
    coords = torch.stack(torch.meshgrid(*[torch.arange(g) for g in grid], indexing="ij"), -1).reshape(N, -1)
    tile_of = (coords[perm] // torch.tensor(tile))           # tiled order: each run of vol tokens is one tile
    for s in range(0, N, vol):
        assert (tile_of[s:s + vol] == tile_of[s]).all()


@pytest.mark.parametrize("grid,tile,window", [
    ((8, 32), (4, 16), (1, 1)),
    ((16, 32), (4, 16), (3, 1)),          # edge rows shift their window inward
    ((16, 16), (8, 8), (2, 2)),           # even window: one more tile before than after
    ((4, 8, 8), (2, 4, 8), (1, 3, 1)),
    ((4, 8, 16), (1, 8, 8), (3, 2, 2)),
    ((6, 8, 8), (2, 4, 8), (5, 3, 1)),    # window wider than the tile grid along t: all tiles
])
def test_layout_equals_brute_force_sta(grid, tile, window):
    layout, _perm, inv = sliding_tile(grid, tile, window, num_heads=2)
    N = torch.tensor(grid).prod().item()
    vol = torch.tensor(tile).prod().item()
    assert layout.q_block == (128 if vol % 128 == 0 else 64)
    assert layout.mask.shape == (2, N // layout.q_block, N // 64)
    t = torch.arange(N)
    tiled = layout.mask[0][t // layout.q_block][:, t // 64]            # over the tiled order
    original = tiled[inv][:, inv]                                       # back to row-major tokens
    assert torch.equal(original, sta_token_mask(grid, tile, window))
    assert torch.equal(layout.mask[0], layout.mask[1])


def test_sliding_tile_rejects():
    with pytest.raises(ValueError, match="not a multiple of 64"):
        sliding_tile((8, 8), (4, 4), (1, 1))
    with pytest.raises(ValueError, match="not divisible by tile"):
        sliding_tile((10, 16), (4, 16), (1, 1))
    with pytest.raises(ValueError, match="window must have 3 entries"):
        sliding_tile((4, 8, 8), (1, 8, 8), (1, 1))
    with pytest.raises(ValueError, match=r"grid must be \(T, H, W\) or \(H, W\)"):
        sliding_tile((64,), (64,), (1,))


def test_sta_attention_through_the_op_equals_masked_dense_attention():
    """Permute in, run the block-sparse reference with the layout, permute out: the same as dense
    attention under STA's token mask in the grid order."""
    from infllm_cupy import naive_block_sparse_attn_varlen
    from infllm_cupy.testing import cu_seqlens_from_lengths

    grid, tile, window = (4, 8, 8), (2, 4, 8), (1, 3, 1)
    layout, perm, inv = sliding_tile(grid, tile, window, num_heads=1)
    N = 256
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(N, h, 32, generator=g, dtype=torch.float64) for h in (2, 1, 1))
    cu = cu_seqlens_from_lengths([N])
    out = naive_block_sparse_attn_varlen(q[perm], k[perm], v[perm], cu, cu, layout, N, N, causal=False)[inv]
    allowed = sta_token_mask(grid, tile, window)
    s = torch.einsum("qhd,kd->hqk", q, k[:, 0]) * 32 ** -0.5
    ref = torch.einsum("hqk,kd->qhd", s.masked_fill(~allowed, float("-inf")).softmax(-1), v[:, 0])
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
