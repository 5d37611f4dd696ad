"""Key-block pairs of the sm_90a dk/dv (`BwdPlan.dkdv_pair`, `stage2_bwd_dkdv_pair_sm90`;
docs/stage2_bwd.md, "Key-block pairs").

CPU: the plan field and its rules; NVRTC resources of the pair instances (no spills, one CTA of 256
threads per SM). GPU (capability 9.0): dq, dk, dv with pairs equal the one-block plan's bit for bit
(the pair kernel's warpgroups add the same tiles in the same order) on token selections and layouts,
ragged lengths that are not multiples of 64 with a 1-token sequence (a sequence's partial last tile
keeps its blocks out of pairs), G 1 to 32, D 64/128, bf16/fp16, query-range passes with and without
PDL, block 0 in parts, per-query-head rows; and a check that the pair kernel itself computed the
paired blocks (the one-block launches dropped: their blocks stay NaN, the pairs' rows hold the bits).
"""
import dataclasses

import pytest
import torch
from conftest import HOPPER

from infllm_cupy import _jit
from infllm_cupy.selections import make_selection
from infllm_cupy.stage2 import ops, sparse_bwd
from infllm_cupy.stage2.plan import BwdPlan, bwd_plan
from infllm_cupy.testing import cu_seqlens_from_lengths

NEEDS_HOPPER = pytest.mark.skipif(not HOPPER, reason="sm_90a kernels need capability 9.0")


# ------------------------------------------------------------------------------------------------ CPU


def test_bwd_plan_dkdv_pair_field():
    assert BwdPlan("sm90a").dkdv_pair == "off"
    assert BwdPlan("sm90a", dkdv="auto", dkdv_pair="auto").dkdv_pair == "auto"
    assert BwdPlan("sm90a", dkdv_pair="all").dkdv_pair == "all"
    with pytest.raises(ValueError, match="BwdPlan.dkdv_pair must be one of"):
        BwdPlan("sm90a", dkdv_pair="yes")
    with pytest.raises(ValueError, match="BwdPlan.dkdv_pair must be one of"):
        BwdPlan("sm90a", dkdv_pair=True)
    with pytest.raises(ValueError, match="pairs fixed tiles loaded by TMA"):
        BwdPlan("sm90a", dkdv="gather", dkdv_pair="auto")
    with pytest.raises(ValueError, match="pairs fixed tiles loaded by TMA"):
        BwdPlan("sm90a", dkdv_tma=False, dkdv_pair="auto")
    with pytest.raises(ValueError, match="pairs fixed tiles loaded by TMA"):
        BwdPlan("sm80", dkdv_pair="all")


def test_pair_instances_fit_without_spills():
    """Every pair instance (both pipelining values, per-query-head rows too) compiles for sm_90a with
    no spills; 256 threads at one CTA per SM leave 255 registers a thread."""
    names = [f"stage2_bwd_dkdv_pair_sm90<{t}, {d}, {p}{qh}>" for t in ("__nv_bfloat16", "__half") for d in (64, 128)
             for p in ("true", "false") for qh in ("", ", 2")]
    rep = _jit.compile_report("stage2/sparse_bwd_sm90.cu", names, "sm_90a")
    assert {k.name for k in rep.kernels} == set(names)
    for k in rep.kernels:
        assert k.spill_stores == 0 and k.spill_loads == 0, str(k)
        assert k.registers <= 255, str(k)


# ------------------------------------------------------------------------------------------------ GPU


def _inputs(lengths, HQ, H, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    q, k, v, dout = (torch.randn(T, n, D, generator=g).to("cuda", dtype) for n in (HQ, H, H, HQ))
    return q, k, v, dout, cu_seqlens_from_lengths(lengths, "cuda")


def _token_case(lengths, G, D, dtype, sel, seed):
    """A token selection over ragged sequences (made per sequence, K = 12), forward run once;
    returns the backward under a plan and the default plan."""
    H = 2
    q, k, v, dout, cu = _inputs(lengths, G * H, H, D, dtype, seed)
    parts = [make_selection(sel, 1, L, H, 12, device="cuda", seed=seed + i) for i, L in enumerate(lengths)]
    topk = torch.cat(parts, 1)
    Lmax = max(lengths)
    scale = D ** -0.5
    out, lse = ops.token_fwd(q, k, v, cu, cu, topk, Lmax, Lmax, True, scale, ops.fwd_plan_for(q, k, Lmax, 24))

    def bwd(plan):
        return ops.token_bwd(dout, q, k, v, out, lse, cu, cu, topk, Lmax, Lmax, True, scale, plan)
    return bwd, ops.bwd_plan_for(q, k, Lmax, Lmax)


def _assert_same(got, want, tag):
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert not torch.isnan(a).any(), f"{tag} {name}: NaN"
        assert torch.equal(a, b), f"{tag} {name}: max |diff| {float((a.float() - b.float()).abs().max())}"


PAIR_PIPE = [True, False]


@pytest.mark.gpu
@NEEDS_HOPPER
@pytest.mark.parametrize("pipe", PAIR_PIPE, ids=["pipe", "nopipe"])
@pytest.mark.parametrize("sel", ["a", "b", "c"])
@pytest.mark.parametrize("G,D,dtype", [(1, 128, torch.bfloat16), (4, 64, torch.float16), (16, 128, torch.bfloat16),
                                       (16, 64, torch.float16), (32, 128, torch.float16)],
                         ids=["g1-d128-bf16", "g4-d64-fp16", "g16-d128-bf16", "g16-d64-fp16", "g32-d128-fp16"])
def test_pairs_bit_identical_on_token_selections(G, D, dtype, sel, pipe, monkeypatch):
    """"auto" and "all" give the one-block plan's dq, dk, dv bit for bit: whole sequences (4096,
    every tile whole), ragged ones with a partial last tile and a 1-token sequence."""
    monkeypatch.setattr(sparse_bwd, "PAIR_PIPE", pipe)
    for lengths in ([4096], [1500, 1, 777]):
        bwd, base = _token_case(lengths, G, D, dtype, sel, seed=G + D + len(lengths))
        want = bwd(base)
        for mode in ("auto", "all"):
            _assert_same(bwd(dataclasses.replace(base, dkdv_pair=mode)), want, f"{lengths} {mode}")


@pytest.mark.gpu
@NEEDS_HOPPER
@pytest.mark.parametrize("variant", ["passes", "passes_nopdl", "parts", "tiles"])
def test_pairs_bit_identical_with_passes_and_parts(variant):
    """Pairs under query-range passes (PDL on and off), block 0 in parts (pair 0 then stays with the
    one-block kernel), and the fixed-tile instance alone."""
    bwd, base = _token_case([3000, 2048, 1], 16, 128, torch.bfloat16, "c", seed=7)
    extra = {"passes": {"dkdv_passes": 3, "block0_parts": 1}, "passes_nopdl": {"dkdv_passes": 2, "block0_parts": 1,
                                                                               "pdl": False},
             "parts": {"dkdv_passes": 1, "block0_parts": 3}, "tiles": {"dkdv": "tiles"}}[variant]
    base = dataclasses.replace(base, **extra)
    want = bwd(base)
    for mode in ("auto", "all"):
        got = bwd(dataclasses.replace(base, dkdv_pair=mode))
        _assert_same(got, want, mode)
        _assert_same(bwd(dataclasses.replace(base, dkdv_pair=mode)), got, f"{mode} rerun")   # deterministic


@pytest.mark.gpu
@NEEDS_HOPPER
@pytest.mark.parametrize("qhead", [False, True], ids=["kv-heads", "query-heads"])
def test_pairs_bit_identical_on_layouts(qhead):
    """A block layout of 128-token blocks (pairs of 64-key blocks with the same query tiles: what
    "auto" is for), per KV head and per query head (the QH = 2 pair instance)."""
    lengths, H, G, D = [2560, 999, 1], 2, 8, 128
    q, k, v, dout, cu = _inputs(lengths, G * H, H, D, torch.bfloat16, seed=11)
    g = torch.Generator().manual_seed(12)
    nb = -(-2560 // 128)
    m128 = torch.rand(G * H if qhead else H, nb, nb, generator=g) < 0.35
    m128[..., 0] = True
    mask = m128.repeat_interleave(2, -1).contiguous().cuda()       # 64-key blocks, 128-token query blocks
    scale = D ** -0.5
    fplan = ops.fwd_plan_for(q, k, 2560, None)
    if qhead:
        from infllm_cupy.patterns.qhead import qhead_bwd_plan
        fplan = dataclasses.replace(fplan, qhead="head")
        base = qhead_bwd_plan(torch.cuda.get_device_capability(), D, q.dtype, 2560, 2560, k.shape[0])
    else:
        base = ops.bwd_plan_for(q, k, 2560, 2560)
    out, lse = ops.layout_fwd(q, k, v, cu, cu, mask, 128, 2560, 2560, True, scale, fplan)

    def bwd(plan):
        return ops.layout_bwd(dout, q, k, v, out, lse, cu, cu, mask, 128, 2560, 2560, True, scale, plan)
    want = bwd(base)
    for mode in ("auto", "all"):
        _assert_same(bwd(dataclasses.replace(base, dkdv_pair=mode)), want, mode)


@pytest.mark.gpu
@NEEDS_HOPPER
def test_pair_kernel_computes_the_paired_blocks(monkeypatch):
    """With the one-block dk/dv launches dropped, the pair kernel alone writes every key block
    ("all", fixed tiles, whole tiles, one pass, an even block count per sequence) with the one-block
    plan's bits; outputs are NaN-poisoned in the test session, so a block it skipped would fail. So
    the bit-identity above is not the one-block kernel doing all the work."""
    lengths = [4096, 1536]
    bwd, base = _token_case(lengths, 16, 128, torch.bfloat16, "c", seed=21)
    base = dataclasses.replace(base, dkdv="tiles", dkdv_passes=1, block0_parts=1)
    want = bwd(base)
    real = sparse_bwd.launch
    dropped = []

    def only_pairs(kernel, *, name, **kw):
        if name.startswith("stage2_bwd_dkdv_sm90<"):
            dropped.append(name)
            return None
        return real(kernel, name=name, **kw)
    monkeypatch.setattr(sparse_bwd, "launch", only_pairs)
    _, dk, dv = bwd(dataclasses.replace(base, dkdv_pair="all"))
    assert dropped, "the one-block launch was not made"
    assert torch.equal(dk, want[1]) and torch.equal(dv, want[2])
