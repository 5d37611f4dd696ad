"""The stage-2 backward past 65535 key blocks (4,194,240 keys; docs/stage2_bwd.md, "Limits").

The SM80 dk/dv kernel has one CTA per key block in grid.z (CUDA: z <= 65535), so the launcher runs
it in z-chunks with a key-block offset; the other limits the launcher checks are named in its errors.

CPU: the chunking, the limit values and errors, the plan's dq past the sm_90a ring's shared memory.
GPU (launcher level): a chunked-prefill shape, 128 + 64 queries against 4,300,000 + 3,000 keys
(67,188 key blocks in the long sequence: two SM80 z-chunks, the last block 32 keys), on the SM80
and the sm_90a plans. The queries select block 0 and random blocks of a pool around block 65535
and at the causal diagonal; the reference runs on those blocks only (float64 and the low-precision
twin through `reference_sparse_grads`), and every key row outside them must be exactly zero (kernel
outputs are NaN-poisoned, conftest, so an unwritten row fails). ~11 GB of GPU memory.
"""
import pytest
import torch

from infllm_cupy._kernel_arg import SM80, SM90A
from infllm_cupy._rules import KV_BLOCK, SMEM_PER_BLOCK
from infllm_cupy.stage2 import sparse_bwd as sb
from infllm_cupy.stage2.plan import BwdPlan, BwdTiles, bwd_plan, n_mask_words
from infllm_cupy.stage2.sparse_bwd import (
    GRID_YZ_MAX,
    bwd_max_keys,
    check_bwd_limits,
    dkdv_z_chunks,
    dq_smem_limit_words,
    stage2_bwd,
)
from infllm_cupy.stage2.sparse_fwd import token_block_masks
from infllm_cupy.testing import assert_close_to_ref, cu_seqlens_from_lengths, reference_sparse_grads

from conftest import HOPPER

GPU = pytest.mark.gpu
OLD_MAX_KEYS = 65535 * KV_BLOCK   # the launcher's blanket limit before the z-chunks


# ================================================================================================
# CPU
# ================================================================================================


def test_z_chunks_cover_every_key_block_once_in_order():
    assert dkdv_z_chunks(1) == [(0, 1)]
    assert dkdv_z_chunks(65535) == [(0, 65535)]               # up to 4,194,240 keys: the one launch of before
    assert dkdv_z_chunks(65536) == [(0, 65535), (65535, 1)]
    assert dkdv_z_chunks(67188) == [(0, 65535), (65535, 1653)]  # the GPU test's 4.3M keys
    assert dkdv_z_chunks(0) == []
    for n_kb in (2, 65534, 65535 * 2, 65535 * 2 + 7, 1 << 21):
        chunks = dkdv_z_chunks(n_kb)
        assert all(0 < nz <= GRID_YZ_MAX for _, nz in chunks)
        assert [kb0 for kb0, _ in chunks] == [sum(nz for _, nz in chunks[:i]) for i in range(len(chunks))]
        assert sum(nz for _, nz in chunks) == n_kb


def test_limit_values():
    """bwd_max_keys: the SM80 dq's mask-word union in 227 KB (dq_warps 4: 98,304 B of tiles at D = 128);
    the sm_90a ring dq holds far fewer words (three unions next to a 4-stage ring)."""
    assert bwd_max_keys(128) == (SMEM_PER_BLOCK - 98304) // 4 * 32 * KV_BLOCK == 68_681_728
    assert bwd_max_keys(64) == 93_847_552
    assert bwd_max_keys(128) > OLD_MAX_KEYS
    assert bwd_max_keys(128, smem=163 * 1024) < bwd_max_keys(128)     # an A100's opt-in limit
    ring4 = BwdPlan(SM90A, dq=SM90A, dq_stages=4)
    assert dq_smem_limit_words(128, ring4) == 2888 and dq_smem_limit_words(128, BwdPlan(SM90A, dq=SM90A)) < 0
    assert dq_smem_limit_words(128, BwdPlan(SM80, BwdTiles(8, 32))) == 25344


def test_plan_takes_the_sm80_dq_past_the_ring():
    """Past the 4-stage ring's 2888 mask words (5,914,624 keys at D = 128) bwd_plan runs the SM80 dq;
    the key count no longer matters to the dk/dv kernels."""
    bf16 = torch.bfloat16
    for keys, dq in ((4_300_000, SM90A), (5_914_624, SM90A), (5_914_625, SM80), (60_000_000, SM80)):
        p = bwd_plan((9, 0), 16, 128, bf16, 128, keys, keys + 3000)
        assert (p.kernel, p.dq) == (SM90A, dq), keys
        check_bwd_limits(p, B=2, H=2, G=16, D=128, itemsize=2, total_q=192, HQ=32, max_seqlen_q=128,
                         max_seqlen_k=keys, n_words=n_mask_words(keys))
    assert bwd_plan((9, 0), 16, 64, bf16, 128, 20_000_000, 20_000_000).dq == SM90A   # D = 64: 11,080 words


def _limits(plan, **kw):
    args = {"B": 2, "H": 2, "G": 16, "D": 128, "itemsize": 2, "total_q": 192, "HQ": 32, "max_seqlen_q": 128,
            "max_seqlen_k": 4_300_000, "n_words": n_mask_words(4_300_000)}
    check_bwd_limits(plan, **{**args, **kw})


def test_limit_errors_name_the_limit():
    sm80 = BwdPlan(SM80)
    _limits(sm80)                                        # past the old blanket limit: fine
    _limits(sm80, max_seqlen_k=bwd_max_keys(128), n_words=n_mask_words(bwd_max_keys(128)))
    over = bwd_max_keys(128) + 1
    with pytest.raises(ValueError,
                       match=r"max_seqlen_k too long for the backward's dq.*sm80 dq at D = 128 holds at "
                                         r"most 33536 words"):
        _limits(sm80, max_seqlen_k=over, n_words=n_mask_words(over))
    ring = BwdPlan(SM90A, dq=SM90A, dq_stages=4)
    with pytest.raises(ValueError, match=r"sm90a dq at D = 128 holds at most 2888 words.*BwdPlan.dq='sm80'"):
        _limits(ring, max_seqlen_k=6_000_000, n_words=n_mask_words(6_000_000))
    with pytest.raises(ValueError, match=r"max_seqlen_q \* G must be < 2\*\*31"):
        _limits(sm80, max_seqlen_q=2**27)
    with pytest.raises(ValueError, match=r"grid.y / grid.z \(<= 65535\).*70000 sequences"):
        _limits(sm80, B=70000)
    with pytest.raises(ValueError, match=r"sm_90a dk/dv grid.*<= 2147483647"):
        _limits(BwdPlan(SM90A, dq=SM80), B=20000, H=32, max_seqlen_k=4_300_000)
    # the same shape on the SM80 dk/dv (z-chunks) passes
    _limits(sm80, B=20000, H=32)


# ================================================================================================
# GPU (launcher level)
# ================================================================================================
LQ, LK = [128, 64], [4_300_000, 3000]
HQ, H, D = 32, 2, 128
N_KB = -(-LK[0] // KV_BLOCK)                             # 67,188
# blocks the long sequence's queries pick from: 0, both sides of 65535, and the last four (the
# causal diagonal cuts the last one; four keep the cut where the reference's compacted keys put it)
POOL = sorted({0, 1, 777, 32768, 65533, 65534, 65535, 65536, 65537, 66000,
               67000} | set(range(N_KB - 4, N_KB)))
PICKS = 7    # per (KV head, token): block 0, PICKS random pool blocks and one -1


def _selection(gen, dev):
    """topk_idx [H, total_q, PICKS + 2] of the full problem, the same in compacted block numbers,
    and the key rows (global) of the compacted keys."""
    n1 = -(-LK[1] // KV_BLOCK)
    rows, rows_c = [], []
    for lq, pool in ((LQ[0], POOL), (LQ[1], list(range(n1)))):
        pool_t = torch.tensor(pool)
        pick = pool_t[torch.randint(len(pool), (H, lq, PICKS), generator=gen)]
        full = torch.cat([torch.zeros(H, lq, 1, dtype=torch.long), pick, torch.full((H, lq, 1), -1)], -1)
        lut = torch.full((max(pool) + 1,), -1, dtype=torch.long)
        lut[pool_t] = torch.arange(len(pool))
        rows.append(full)
        rows_c.append(torch.where(full >= 0, lut[full.clamp(min=0)], -1))
    keys = []
    for b, pool in enumerate((POOL, range(n1))):
        ks = sum(LK[:b])
        for j in pool:
            keys.append(torch.arange(ks + j * KV_BLOCK, ks + min((j + 1) * KV_BLOCK, LK[b])))
    idx = torch.cat(rows, 1).to(torch.int32).to(dev)
    idx_c = torch.cat(rows_c, 1).to(torch.int32).to(dev)
    return idx, idx_c, torch.cat(keys).to(dev)


@pytest.fixture(scope="module")
def long_case():
    dev, dt = "cuda", torch.bfloat16
    gen = torch.Generator().manual_seed(33)
    cuda_gen = torch.Generator(device=dev).manual_seed(33)
    total_k = sum(LK)
    q = torch.randn(sum(LQ), HQ, D, generator=cuda_gen, device=dev, dtype=dt)
    k = torch.randn(total_k, H, D, generator=cuda_gen, device=dev, dtype=dt)
    v = torch.randn(total_k, H, D, generator=cuda_gen, device=dev, dtype=dt)
    do = torch.randn(sum(LQ), HQ, D, generator=cuda_gen, device=dev, dtype=dt)
    idx, idx_c, keys = _selection(gen, dev)
    cu_q, cu_k = cu_seqlens_from_lengths(LQ, dev), cu_seqlens_from_lengths(LK, dev)
    lk_c = [int((keys < LK[0]).sum()), LK[1]]
    cu_kc = cu_seqlens_from_lengths(lk_c, dev)
    k_c, v_c = k[keys].contiguous(), v[keys].contiguous()
    ref_out, ref_lse, ref = reference_sparse_grads(q, k_c, v_c, do, cu_q, cu_kc, idx_c, max(LQ), max(lk_c),
                                                   True, exact=True)
    _, _, lowp = reference_sparse_grads(q, k_c, v_c, do, cu_q, cu_kc, idx_c, max(LQ), max(lk_c), True,
                                        exact=False)
    masks = token_block_masks(idx, cu_q, cu_k, n_mask_words(max(LK)))
    out = ref_out.to(dt)                      # the backward's inputs from the float64 forward
    lse = ref_lse.float().contiguous()
    yield {"q": q, "k": k, "v": v, "do": do, "cu_q": cu_q, "cu_k": cu_k, "masks": masks, "out": out,
           "lse": lse, "keys": keys, "ref": ref, "lowp": lowp}


def _plan(kernel):
    if kernel == SM80:
        return BwdPlan(SM80)
    plan = bwd_plan((9, 0), HQ // H, D, torch.bfloat16, max(LQ), max(LK), sum(LK), kernel=SM90A)
    assert (plan.dq, plan.dq_stages, plan.dkdv, plan.dkdv_passes) == (SM90A, 4, "auto", 1), plan
    return plan


@GPU
@pytest.mark.parametrize("kernel", [SM80, pytest.param(SM90A, marks=pytest.mark.skipif(
    not HOPPER, reason="sm_90a kernels need capability 9.0"))])
def test_backward_past_65535_key_blocks(long_case, kernel, monkeypatch):
    c = long_case
    plan = _plan(kernel)
    launched = []
    real = sb.launch

    def spy(kern, *, name, grid, **kw):
        launched.append((name, tuple(grid)))
        return real(kern, name=name, grid=grid, **kw)

    monkeypatch.setattr(sb, "launch", spy)
    dq, dk, dv = stage2_bwd(c["do"], c["q"], c["k"], c["v"], c["out"], c["lse"], c["cu_q"], c["cu_k"],
                            c["masks"],
                            c["cu_q"], c["q"].shape[0], 1, max(LQ), max(LK), True, D ** -0.5, plan)
    torch.cuda.synchronize()
    monkeypatch.setattr(sb, "launch", real)
    if kernel == SM80:
        kv = [g for n, g in launched if n.startswith("stage2_bwd_dkdv<")]
        assert kv == [(H, 2, 65535), (H, 2, N_KB - 65535)], kv
    else:
        kv = [g for n, g in launched if n.startswith("stage2_bwd_dkdv_sm90<")]
        assert kv == [(H * 2 * N_KB,)] * 2, kv                  # "auto": both instances, block 0 whole

    keys = c["keys"]
    assert_close_to_ref("dq", dq, c["ref"][0], c["lowp"][0], mult=3)
    for name, g, r, lp in (("dk", dk, c["ref"][1], c["lowp"][1]), ("dv", dv, c["ref"][2], c["lowp"][2])):
        assert_close_to_ref(name, g[keys], r, lp, mult=3)
        # blocks past the first z-chunk (and past 65535 * 64 keys) got real gradients
        for j in (65535, 65536, 67000, N_KB - 1):
            rows = (keys >= j * KV_BLOCK) & (keys < min((j + 1) * KV_BLOCK, LK[0]))   # the long sequence's
            assert rows.any() and bool((g[keys[rows]].float().abs().sum(-1) > 0).any()), (name, j)
        g[keys] = 0            # every other key row: exactly zero (NaN, an unwritten row, counts too)
        assert int(torch.count_nonzero(g)) == 0, f"{name}: rows outside the selected blocks are not all zero"
    del dq, dk, dv
    torch.cuda.empty_cache()


@GPU
def test_launcher_refuses_keys_past_the_dq_shared_memory():
    """Past the SM80 dq's mask words the launcher names the limit before it allocates anything."""
    keys = bwd_max_keys(128) + 1
    q, do, out = (torch.randn(1, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    k, v = (torch.randn(1, 1, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    lse = torch.zeros(2, 1, device="cuda")
    cu = torch.tensor([0, 1], dtype=torch.int32, device="cuda")
    masks = torch.zeros(1, 1, n_mask_words(keys), dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match=r"sm80 dq at D = 128 holds at most 33536 words"):
        stage2_bwd(do, q, k, v, out, lse, cu, cu, masks, cu, 1, 1, 1, keys, True, 128 ** -0.5, BwdPlan(SM80))
