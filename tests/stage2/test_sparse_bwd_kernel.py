"""Stage-2 backward kernels (launcher level: stage2_bwd) against the reference's autograd.

FlashAttention's rule for gradients: the error of dq, dk, dv against the float64 reference may be
at most 3x that of the same math done by PyTorch in the low precision (`upcast=False`). The public
autograd wiring is tested in test_sparse_bwd.py; this file pins the kernels themselves.
"""
import pytest
import torch
from conftest import HAS_GPU, STAGE2_CASES, STAGE2_IDS

from infllm_cupy.stage2.layout import BlockLayout
from infllm_cupy.stage2.sparse_bwd import (
    ALL_BWD_TILES,
    DEFAULT_BWD_TILES,
    SM90A,
    SM90A_AUTO,
    SM90A_GATHER,
    SM90A_SPLIT,
    stage2_bwd,
)
from infllm_cupy.stage2.sparse_fwd import DEFAULT_TILES, n_mask_words, stage2_fwd, token_block_masks
from infllm_cupy.testing import check_sparse_grads, cu_seqlens_from_lengths, sparse_attn_inputs

pytestmark = pytest.mark.gpu

CASES = STAGE2_CASES
HOPPER = HAS_GPU and torch.cuda.get_device_capability() == (9, 0)
NEEDS_HOPPER = pytest.mark.skipif(not HOPPER, reason="sm_90a kernels need capability 9.0")
SM90 = pytest.param(SM90A, marks=NEEDS_HOPPER)
SM90_GATHER = pytest.param(SM90A_GATHER, marks=NEEDS_HOPPER)
SM90_AUTO = pytest.param(SM90A_AUTO, marks=NEEDS_HOPPER)
SM90_SPLIT = pytest.param(SM90A_SPLIT, marks=NEEDS_HOPPER)
# every path on every case: sm_90a over fixed tiles (dq on one shared K/V ring), sm_90a gathering
# tokens (8 <= G <= 64), both split per key block by tile fill, dq on a ring per warpgroup, SM80
KERNELS = [SM90, SM90_GATHER, SM90_AUTO, SM90_SPLIT, DEFAULT_BWD_TILES]


def kernels_id(t):
    return t if isinstance(t, str) else f"dq{t.dq_warps}_cols{t.dkdv_cols}"


IDS = STAGE2_IDS


def run_kernels(q, k, v, do, cu_q, cu_k, masks, base, h_stride, q_block, mq, mk, causal, tiles=None):
    scale = q.shape[-1] ** -0.5
    out, lse = stage2_fwd(q, k, v, cu_q, cu_k, masks, base, h_stride, q_block, mq, causal, scale, DEFAULT_TILES)
    return stage2_bwd(do, q, k, v, out, lse, cu_q, cu_k, masks, base, h_stride, q_block, mq, mk, causal, scale,
                      tiles)


def token_masks(idx, cu_q, cu_k, mk):
    return token_block_masks(idx, cu_q, cu_k, n_mask_words(mk))


@pytest.mark.parametrize("tiles", KERNELS, ids=kernels_id)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_token_level_grads(case, dtype, tiles):
    lq, lk, HQ, H, D = case
    q, k, v, do, cu_q, cu_k, idx = sparse_attn_inputs(lq, lk, HQ, H, D, dtype, empty_rows=True)
    mq, mk = max(lq), max(lk)
    masks = token_masks(idx, cu_q, cu_k, mk)
    grads = run_kernels(q, k, v, do, cu_q, cu_k, masks, cu_q, q.shape[0], 1, mq, mk, True, tiles)
    check_sparse_grads(grads, q, k, v, do, cu_q, cu_k, idx, mq, mk, True)


@pytest.mark.parametrize("tiles", KERNELS, ids=kernels_id)
def test_non_finite_rows_of_the_next_sequence_stay_out(tiles):
    """Sequence 0 ends inside a key block, so the copies of that block bring sequence 1's first rows
    into masked positions (the sm_90a dq's TMA copies whole blocks; dq += dS K reads K's rows there).
    Non-finite keys and values there must not reach sequence 0's (or 2's) gradients."""
    lq = [100, 77, 64]
    q, k, v, do, cu_q, cu_k, idx = sparse_attn_inputs(lq, lq, 16, 2, 128, torch.bfloat16, K=8)
    k[100:164], v[100:164] = float("nan"), float("inf")   # all of sequence 1's first block
    masks = token_masks(idx, cu_q, cu_k, 100)
    grads = run_kernels(q, k, v, do, cu_q, cu_k, masks, cu_q, q.shape[0], 1, 100, 100, True, tiles)
    for rows in (slice(0, 100), slice(177, 241)):
        n = rows.stop - rows.start
        cu1 = cu_seqlens_from_lengths([n], "cuda")
        part = [t[rows].contiguous() for t in (q, k, v, do)]
        check_sparse_grads(tuple(g[rows].contiguous() for g in grads), *part, cu1, cu1,
                           idx[:, rows].contiguous(), n, n, True)


@pytest.mark.parametrize("tiles", [SM90, *ALL_BWD_TILES], ids=kernels_id)
def test_every_tile_shape(tiles):
    lq, HQ, H, D = [700, 129], 16, 2, 128
    q, k, v, do, cu_q, cu_k, idx = sparse_attn_inputs(lq, lq, HQ, H, D, torch.bfloat16, K=8)
    masks = token_masks(idx, cu_q, cu_k, 700)
    grads = run_kernels(q, k, v, do, cu_q, cu_k, masks, cu_q, q.shape[0], 1, 700, 700, True, tiles)
    check_sparse_grads(grads, q, k, v, do, cu_q, cu_k, idx, 700, 700, True)


@pytest.mark.parametrize("tiles", KERNELS, ids=kernels_id)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_non_causal_and_short_queries(dtype, tiles):
    lq, lk = [1, 5, 90], [300, 64, 1000]
    q, k, v, do, cu_q, cu_k, idx = sparse_attn_inputs(lq, lk, 16, 2, 128, dtype)
    masks = token_masks(idx, cu_q, cu_k, 1000)
    for causal in (False, True):
        grads = run_kernels(q, k, v, do, cu_q, cu_k, masks, cu_q, q.shape[0], 1, 90, 1000, causal, tiles)
        check_sparse_grads(grads, q, k, v, do, cu_q, cu_k, idx, 90, 1000, causal)


@pytest.mark.parametrize("tiles", KERNELS, ids=kernels_id)
@pytest.mark.parametrize("q_block", [64, 128])
@pytest.mark.parametrize("per_sequence", [False, True])
def test_block_layout_grads(q_block, per_sequence, tiles):
    lq = [1000, 300, 1]
    HQ, H, D = 16, 2, 128
    q, k, v, do, cu_q, cu_k, _ = sparse_attn_inputs(lq, lq, HQ, H, D, torch.bfloat16)
    nqb, nkb = -(-1000 // q_block), -(-1000 // 64)
    shape = (len(lq), H, nqb, nkb) if per_sequence else (H, nqb, nkb)
    mask = torch.rand(shape) < 0.3
    mask[..., 0] = True
    layout = BlockLayout(mask.cuda(), q_block)
    words, base, h_stride = layout.packed(n_mask_words(1000), "cuda")
    if base is None:
        base = torch.zeros(len(lq), dtype=torch.int32, device="cuda")
    grads = run_kernels(q, k, v, do, cu_q, cu_k, words, base, h_stride, q_block, 1000, 1000, True, tiles)
    check_sparse_grads(grads, q, k, v, do, cu_q, cu_k, layout.to_topk_idx(cu_q), 1000, 1000, True)


@pytest.mark.parametrize("tiles", KERNELS, ids=kernels_id)
def test_bit_identical_across_runs(tiles):
    lq, HQ, H, D = [1500, 333], 16, 2, 128
    q, k, v, do, cu_q, cu_k, idx = sparse_attn_inputs(lq, lq, HQ, H, D, torch.bfloat16, K=16)
    masks = token_masks(idx, cu_q, cu_k, 1500)
    a = run_kernels(q, k, v, do, cu_q, cu_k, masks, cu_q, q.shape[0], 1, 1500, 1500, True, tiles)
    b = run_kernels(q, k, v, do, cu_q, cu_k, masks, cu_q, q.shape[0], 1, 1500, 1500, True, tiles)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@pytest.mark.parametrize("tiles", KERNELS, ids=kernels_id)
def test_unselected_keys_get_exactly_zero(tiles):
    # every token selects only block 0 and its own block: the keys of other blocks get dk = dv = 0
    T, HQ, H, D = 640, 16, 1, 64
    q, k, v, do, cu_q, cu_k, _ = sparse_attn_inputs([T], [T], HQ, H, D, torch.bfloat16)
    t = torch.arange(T, device="cuda")
    idx = torch.stack([torch.zeros_like(t), t // 64], -1).to(torch.int32)[None].contiguous()
    idx[0, 130:, 1] = 9   # tokens 130.. pick block 9 instead of their own: blocks 3..8 are then unselected
    masks = token_masks(idx, cu_q, cu_k, T)
    dq, dk, dv = run_kernels(q, k, v, do, cu_q, cu_k, masks, cu_q, T, 1, T, T, True, tiles)
    # block 2 (tokens 128, 129 select it) and blocks 3..8: only 0, 1, 2 and 9 may be nonzero
    for name, g in (("dk", dk), ("dv", dv)):
        assert bool((g[192:576] == 0).all()), f"{name} of keys nobody selected must be exactly 0"
        assert bool((g[:128] != 0).any())
    check_sparse_grads((dq, dk, dv), q, k, v, do, cu_q, cu_k, idx, T, T, True)


@pytest.mark.parametrize("tiles", [SM90, SM90_GATHER, SM90_AUTO], ids=kernels_id)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_block0_split_over_parts(tiles, dtype, monkeypatch):
    """Block 0 (every token selects it) is shared by several dk/dv CTAs whose fp32 sums a second
    kernel adds. Small parts force the split at test sizes: 24 parts here, so the one-token
    sequence leaves 23 of its parts empty (they must still store zeros) and the ragged lengths
    cut the runs anywhere. Results must match the reference and be the same bits twice."""
    import infllm_cupy.stage2.sparse_bwd as sb
    monkeypatch.setattr(sb, "BLOCK0_PART_TILES", 8)
    lq, HQ, H, D = [1500, 1, 333], 16, 2, 128
    assert sb.dkdv_block0_parts(1500, HQ // H) == 24
    q, k, v, do, cu_q, cu_k, idx = sparse_attn_inputs(lq, lq, HQ, H, D, dtype, K=16, empty_rows=True)
    masks = token_masks(idx, cu_q, cu_k, 1500)
    a = run_kernels(q, k, v, do, cu_q, cu_k, masks, cu_q, q.shape[0], 1, 1500, 1500, True, tiles)
    check_sparse_grads(a, q, k, v, do, cu_q, cu_k, idx, 1500, 1500, True)
    b = run_kernels(q, k, v, do, cu_q, cu_k, masks, cu_q, q.shape[0], 1, 1500, 1500, True, tiles)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
