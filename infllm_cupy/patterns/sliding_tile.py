"""Sliding Tile Attention (STA) for video DiTs as a `BlockLayout` (docs/patterns.md, "Sliding tile").

Tokens on a (T, H, W) or (H, W) grid, row-major, are grouped into tiles; every tile attends the
tiles of a window around its own, whole tiles only. At the grid's edge the window is shifted
inward, not cut (STA clamps the window centre), so every tile attends the same number of tiles
when the window fits the grid. The layout works on the tiled order, where each tile's tokens are
contiguous: permute q, k, v with `perm` before the op and the output with `inv_perm` after.
"""
from __future__ import annotations

import math

import torch

from .._rules import KV_BLOCK
from ..stage2.layout import BlockLayout


def _dims(name: str, value, n: int | None) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or any(isinstance(v, bool) or not isinstance(v, int) or v <= 0
                                                    for v in value):
        raise ValueError(f"{name} must be a tuple of positive ints, got {value!r}")
    if n is None and len(value) not in (2, 3):
        raise ValueError(f"{name} must be (T, H, W) or (H, W), got {value!r}")
    if n is not None and len(value) != n:
        raise ValueError(f"{name} must have {n} entries like grid, got {value!r}")
    return tuple(value)


def tile_permutation(grid, tile) -> tuple[torch.Tensor, torch.Tensor]:
    """(`perm`, `inv_perm`), int64 `[N]`: `x[perm]` lists the tokens tile by tile (tiles row-major
    over the tile grid, tokens row-major inside a tile); `y[inv_perm]` undoes it."""
    grid = _dims("grid", grid, None)
    tile = _dims("tile", tile, len(grid))
    for g, t, ax in zip(grid, tile, range(len(grid))):
        if g % t:
            raise ValueError(f"grid={grid} is not divisible by tile={tile} along axis {ax}: STA needs whole "
                             "tiles")
    n = len(grid)
    idx = torch.arange(math.prod(grid)).reshape(grid)
    # split each axis into (tiles, within-tile), then order all tile axes before all within-tile axes
    split = idx.reshape(*[d for g, t in zip(grid, tile) for d in (g // t, t)])
    perm = split.permute(*range(0, 2 * n, 2), *range(1, 2 * n, 2)).reshape(-1)
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel())
    return perm, inv


def tile_window_mask(tiles, window) -> torch.Tensor:
    """bool `[NT, NT]` over tiles (row-major): tile q attends tile k when along every axis k lies
    in the window of `window[a]` tiles around q, shifted inward at the edges: it starts at
    `clamp(q - window // 2, 0, n - window)` (all tiles when the window exceeds the grid)."""
    tiles = _dims("tiles", tiles, len(tiles) if isinstance(tiles, (tuple, list)) and tiles else None)
    window = _dims("window", window, len(tiles))
    masks = []
    for n, w in zip(tiles, window):
        q = torch.arange(n)
        start = (q - w // 2).clamp(min=0, max=max(n - w, 0))
        k = torch.arange(n)
        masks.append((k[None] >= start[:, None]) & (k[None] < start[:, None] + w))
    out = masks[0]
    for m in masks[1:]:
        a, b = out.shape[0], m.shape[0]
        out = (out[:, None, :, None] & m[None, :, None, :]).reshape(a * b, a * b)
    return out


def sliding_tile(grid, tile, window, *, num_heads: int = 1) -> tuple[BlockLayout, torch.Tensor, torch.Tensor]:
    """STA's pattern: `(layout, perm, inv_perm)` for a `grid` of (T, H, W) or (H, W) tokens in tiles
    of `tile` tokens (dividing the grid; the tile volume a multiple of 64, ValueError otherwise) and
    a `window` counted in tiles per axis (STA's `window_size`; its mask_mod takes the same window
    times the tile in tokens).

    The layout (same for `num_heads` KV heads, non-causal) is over the tiled token order:
    `q[perm]`, `k[perm]`, `v[perm]` in, `out[inv_perm]` back. `q_block` is 128 when the tile volume
    is a multiple of 128, else 64.
    """
    grid = _dims("grid", grid, None)
    tile = _dims("tile", tile, len(grid))
    window = _dims("window", window, len(grid))
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
        raise ValueError(f"num_heads must be a positive int, got {num_heads!r}")
    vol = math.prod(tile)
    if vol % KV_BLOCK:
        raise ValueError(f"tile={tile} has {vol} tokens, not a multiple of {KV_BLOCK}: tiles must map onto "
                         f"whole {KV_BLOCK}-key blocks")
    perm, inv = tile_permutation(grid, tile)
    tiles = tuple(g // t for g, t in zip(grid, tile))
    tmask = tile_window_mask(tiles, window)
    q_block = 128 if vol % 128 == 0 else KV_BLOCK
    m = tmask.repeat_interleave(vol // q_block, 0).repeat_interleave(vol // KV_BLOCK, 1)
    return BlockLayout(m[None].expand(num_heads, -1, -1).contiguous(), q_block), perm, inv
