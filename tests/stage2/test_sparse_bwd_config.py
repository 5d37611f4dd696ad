"""CPU checks of the backward launcher's configuration: kernel choice and the transposed index's layout."""
import pytest
import torch

from infllm_cupy.stage2.sparse_bwd import (
    DEFAULT_BWD_TILES,
    KERNEL_ENV,
    QT,
    SM90A,
    SM90A_AUTO,
    SM90A_GATHER,
    BwdTiles,
    as_bwd_tiles,
    tile_index,
)


def test_kernel_choice(monkeypatch):
    monkeypatch.delenv(KERNEL_ENV, raising=False)
    if not torch.cuda.is_available():
        assert as_bwd_tiles(None) == DEFAULT_BWD_TILES
    assert as_bwd_tiles(SM90A) == SM90A
    assert as_bwd_tiles((8, 64)) == BwdTiles(8, 64)
    monkeypatch.setenv(KERNEL_ENV, SM90A_GATHER)
    assert as_bwd_tiles(None) == SM90A_GATHER
    monkeypatch.setenv(KERNEL_ENV, SM90A_AUTO)
    assert as_bwd_tiles(None) == SM90A_AUTO
    monkeypatch.setenv(KERNEL_ENV, "4,16")
    assert as_bwd_tiles(None) == BwdTiles(4, 16)
    assert as_bwd_tiles(SM90A) == SM90A            # an explicit choice beats the environment


@pytest.mark.parametrize("bad, err", [("fast", ValueError), ("3,32", ValueError), ("4,33", ValueError)])
def test_bad_kernel_choice_names_the_variable(monkeypatch, bad, err):
    monkeypatch.setenv(KERNEL_ENV, bad)
    with pytest.raises(err, match="INFLLM_CUPY_BWD_KERNEL|dq_warps"):
        as_bwd_tiles(None)


def test_bad_tiles_argument():
    with pytest.raises(TypeError, match="backward kernel"):
        as_bwd_tiles("sm80")
    with pytest.raises(ValueError, match="dq_warps"):
        BwdTiles(5, 32)


@pytest.mark.parametrize("tile_rows", [QT, 16, 24])
def test_tile_index_offsets_fit_the_allocation(tile_rows):
    # ut_off[b] = NKB * sum of earlier sequences' words; the per-head allocation must cover them all
    G, max_k = 16, 5000
    for lens in ([1], [63, 64, 65], [5000, 1, 2047, 2048, 2049], [7] * 40):
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        ut_off, per_head = tile_index(cu, G, max_k, sum(lens), tile_rows)
        nkb = -(-max_k // 64)
        words = [-(-(L * G) // (tile_rows * 32)) for L in lens]
        want = [0]
        for w in words:
            want.append(want[-1] + w * nkb)
        assert ut_off.tolist() == want
        assert want[-1] <= per_head
