"""The SM80 dk/dv's two-level sums (docs/stage2_bwd.md, 12. SM80 path; issue #25): a CTA adds its
register sums to fp32 rows in global memory every `BwdPlan.dkdv_flush` query tiles, so that a key
block selected by a million tokens is not one fp32 sum over 2^18 tiles.

CPU: the plan field's checks, the allocation decision, the registered instances. GPU (launcher
level, plans built here): tiny intervals force the flushes at test sizes (checked by FlashAttention's
rule, not for equal bits: flushing changes the rounding), and a run of the flushing instance in which
no CTA reaches its interval gives the bits of the instance without flushes. Kernel outputs and the
fp32 rows are NaN-poisoned (conftest), so a sum read before it was stored fails.
"""
import dataclasses

import pytest
import torch

from infllm_cupy import _jit
from infllm_cupy.stage2 import sparse_bwd as sb
from infllm_cupy.stage2.plan import (
    ALL_BWD_TILES,
    DKDV_FLUSH_TILES,
    QT,
    BwdPlan,
    BwdTiles,
    FwdPlan,
    bwd_plan,
    n_mask_words,
    sm80_dkdv_flushes,
)
from infllm_cupy.stage2.sparse_bwd import stage2_bwd
from infllm_cupy.stage2.sparse_fwd import stage2_fwd, token_block_masks
from infllm_cupy.testing import check_sparse_grads, sparse_attn_inputs

GPU = pytest.mark.gpu
SM80_PLAN = BwdPlan("sm80", dq="sm80")


# ================================================================================================
# CPU
# ================================================================================================


def test_dkdv_flush_field_is_checked():
    assert SM80_PLAN.dkdv_flush == DKDV_FLUSH_TILES
    assert bwd_plan((8, 0), 16, 128, torch.bfloat16, 10**6, 10**6, 10**6).dkdv_flush == DKDV_FLUSH_TILES
    assert dataclasses.replace(SM80_PLAN, dkdv_flush=1).dkdv_flush == 1
    for bad in (0, -3, True, 2.0, "8", None):
        with pytest.raises(ValueError, match=r"BwdPlan.dkdv_flush must be an int >= 1"):
            dataclasses.replace(SM80_PLAN, dkdv_flush=bad)


def test_flush_rows_only_where_a_cta_can_pass_the_interval():
    """The launcher allocates the fp32 rows (and runs the flushing instance) iff a sequence has more
    than `flush` query tiles of 64 (token, head-in-group) rows: the most any one key block's CTA can sum."""
    assert DKDV_FLUSH_TILES * QT // 16 == 32768              # the default: 32k tokens at G = 16 do not flush
    assert not sm80_dkdv_flushes(32768, 16, DKDV_FLUSH_TILES)
    assert sm80_dkdv_flushes(32769, 16, DKDV_FLUSH_TILES)     # 8193 tiles
    assert sm80_dkdv_flushes(1 << 20, 16, DKDV_FLUSH_TILES)   # the 1M-token run: 2^18 tiles
    assert not sm80_dkdv_flushes(DKDV_FLUSH_TILES * QT, 1, DKDV_FLUSH_TILES)
    assert sm80_dkdv_flushes(DKDV_FLUSH_TILES * QT + 1, 1, DKDV_FLUSH_TILES)
    # tiny intervals at test sizes: 700 tokens at G = 16 are 175 tiles; a one-token sequence is one
    assert [sm80_dkdv_flushes(700, 16, f) for f in (1, 174, 175, 176)] == [True, True, False, False]
    assert not sm80_dkdv_flushes(1, 16, 1) and sm80_dkdv_flushes(5, 16, 1)


def test_both_dkdv_instances_are_registered():
    """Every SM80 tile shape has the instance without flushes (the code that ran before) and the
    flushing one, both held to no spills except the 64-column tuning shape (tests/test_jit.py compiles
    them)."""
    sets = [ks for ks in _jit.registered() if ks.source == sb.BWD_SOURCE]
    for t in ALL_BWD_TILES:
        for dt in (torch.bfloat16, torch.float16):
            for D in (64, 128):
                for flush in (False, True):
                    name = t.dkdv_name(dt, D, flush)
                    assert name.endswith(f", {'true' if flush else 'false'}>")
                    owners = [ks for ks in sets if name in ks.names]
                    assert len(owners) == 1 and owners[0].strict == (t.dkdv_cols != 64), name


# ================================================================================================
# GPU (launcher level)
# ================================================================================================
# (lengths_q, lengths_k, HQ, H, D): ragged with one-token sequences and lengths off the 64-key
# blocks (flushed rows past a sequence's last key belong to the next one), Lq < Lk, G 16, 4, 2
CASES = [
    ([700, 1, 130, 257], [700, 1, 130, 257], 16, 1, 128),
    ([513, 1, 65], [513, 1, 65], 16, 4, 64),
    ([100, 37, 5, 1], [700, 37, 64, 130], 16, 2, 64),
    ([333, 17], [333, 17], 4, 2, 128),
]
IDS = [f"Lq{'-'.join(map(str, c[0]))}_Lk{'-'.join(map(str, c[1]))}_HQ{c[2]}_H{c[3]}_D{c[4]}" for c in CASES]


def sm80_grads(q, k, v, do, cu_q, cu_k, idx, mq, mk, plan, monkeypatch, causal=True):
    """dq, dk, dv of the SM80 forward's out and lse under the backward `plan`, and the names of
    the dk/dv kernels it launched."""
    names = []
    real = sb.launch

    def spy(kernel, *, name, **kw):
        if name.startswith("stage2_bwd_dkdv<"):
            names.append(name)
        return real(kernel, name=name, **kw)

    monkeypatch.setattr(sb, "launch", spy)
    scale = q.shape[-1] ** -0.5
    masks = token_block_masks(idx, cu_q, cu_k, n_mask_words(mk))
    out, lse = stage2_fwd(q, k, v, cu_q, cu_k, masks, cu_q, q.shape[0], 1, mq, causal, scale, FwdPlan("sm80"))
    grads = stage2_bwd(do, q, k, v, out, lse, cu_q, cu_k, masks, cu_q, q.shape[0], 1, mq, mk, causal, scale,
                       plan)
    monkeypatch.setattr(sb, "launch", real)
    return grads, names


@GPU
@pytest.mark.parametrize("flush", [1, 3])
@pytest.mark.parametrize("cols", [16, 32, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_flushed_dkdv_meets_the_rule(case, dtype, cols, flush, monkeypatch):
    """Flushes after every tile or every 3: CTAs that flush many times, once, or never (few tiles),
    key blocks past a sequence's end, keys nobody selected (exact zeros), rows selecting nothing.
    Against the reference by the 3x rule, then twice for the same bits (the sums keep a fixed order)."""
    lq, lk, HQ, H, D = case
    q, k, v, do, cu_q, cu_k, idx = sparse_attn_inputs(lq, lk, HQ, H, D, dtype, empty_rows=True)
    mq, mk = max(lq), max(lk)
    plan = BwdPlan("sm80", BwdTiles(4, cols), dq="sm80", dkdv_flush=flush)
    assert sm80_dkdv_flushes(mq, HQ // H, flush)
    grads, names = sm80_grads(q, k, v, do, cu_q, cu_k, idx, mq, mk, plan, monkeypatch)
    assert names == [plan.tiles.dkdv_name(dtype, D, True)]
    empty_rows, _ = check_sparse_grads(grads, q, k, v, do, cu_q, cu_k, idx, mq, mk, True)
    assert empty_rows.any()
    again, _ = sm80_grads(q, k, v, do, cu_q, cu_k, idx, mq, mk, plan, monkeypatch)
    for x, y in zip(grads, again):
        assert torch.equal(x, y)


@GPU
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_flushing_instance_without_flushes_gives_the_same_bits(dtype, monkeypatch):
    """Every token selects only its own key block, so at G = 16 each key block's CTA sums exactly
    16 tiles (64 tokens x 16 rows) while the longest sequence has 175. An interval of 16 then runs
    the flushing instance with its fp32 rows allocated but never reached: the bits of the default
    plan's instance without flushes. An interval of 15 flushes once per full block (the rule)."""
    lq, HQ, H, D = [700, 130, 1], 32, 2, 128
    q, k, v, do, cu_q, cu_k, _ = sparse_attn_inputs(lq, lq, HQ, H, D, dtype)
    own = torch.cat([torch.arange(n) // 64 for n in lq]).to(torch.int32)
    idx = own[None, :, None].expand(H, -1, 1).contiguous().cuda()
    base, base_names = sm80_grads(q, k, v, do, cu_q, cu_k, idx, 700, 700, SM80_PLAN, monkeypatch)
    assert base_names == [SM80_PLAN.tiles.dkdv_name(dtype, D, False)]
    check_sparse_grads(base, q, k, v, do, cu_q, cu_k, idx, 700, 700, True)
    for flush in (16, 15):
        plan = dataclasses.replace(SM80_PLAN, dkdv_flush=flush)
        grads, names = sm80_grads(q, k, v, do, cu_q, cu_k, idx, 700, 700, plan, monkeypatch)
        assert names == [plan.tiles.dkdv_name(dtype, D, True)]
        if flush == 16:
            for x, y in zip(base, grads):
                assert torch.equal(x, y)
        else:
            check_sparse_grads(grads, q, k, v, do, cu_q, cu_k, idx, 700, 700, True)
            assert torch.equal(grads[0], base[0])      # dq does not depend on the dk/dv kernel


@GPU
def test_default_plan_at_test_sizes_runs_without_flushes(monkeypatch):
    """The plan's interval at ordinary lengths: the instance without flushes and no fp32 rows."""
    lq = [700, 1]
    q, k, v, do, cu_q, cu_k, idx = sparse_attn_inputs(lq, lq, 16, 2, 64, torch.bfloat16)
    allocated = []
    real_empty = sb.empty
    monkeypatch.setattr(sb, "empty", lambda shape, *, dtype, device: (allocated.append(dtype),
                                                                       real_empty(shape, dtype=dtype,
                                                                                  device=device))[1])
    grads, names = sm80_grads(q, k, v, do, cu_q, cu_k, idx, 700, 700, SM80_PLAN, monkeypatch)
    assert names == [SM80_PLAN.tiles.dkdv_name(torch.bfloat16, 64, False)]
    assert torch.float32 not in allocated
    check_sparse_grads(grads, q, k, v, do, cu_q, cu_k, idx, 700, 700, True)
