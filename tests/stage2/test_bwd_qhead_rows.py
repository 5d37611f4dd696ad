"""Per-query-head mask rows in the stage-2 BACKWARD (`BwdPlan.qhead="head"`, the dq and dk/dv kernels'
QH = 2 instances; docs/stage2_bwd.md, "Per-query-head mask rows"), and the public routing of
per-query-head layouts (`block_sparse_attn_varlen` with a layout of HQ heads).

CPU: the plan field and its rules, the public routing (a layout with HQ rows goes to the
per-query-head op, forward and backward; a head count matching neither H nor HQ is refused), and the
NVRTC resources of the new instances. GPU: dq, dk, dv against the float64 reference by
FlashAttention's rule (gradients 3x; outputs NaN-poisoned by the test session) on ragged lengths that
are not multiples of 64 with a 1-token sequence, G 1 to 32, D 64/128, bf16/fp16, layouts whose heads
differ inside groups, both kernels ("sm80" and "sm90a"); bit-identity with the expanded path (K/V
repeated to HQ heads, the G = 1 kernels, dK/dV summed over the group in fp32) for the plan's
variants (query-range passes, block 0 in parts, SM80 flushes, split dq rings).
"""
import dataclasses

import pytest
import torch

from infllm_cupy import _jit
from infllm_cupy.patterns import qhead_block_sparse_attn_varlen
from infllm_cupy.stage2 import ops
from infllm_cupy.stage2.attention import block_sparse_attn_varlen
from infllm_cupy.stage2.layout import BlockLayout
from infllm_cupy.stage2.plan import DEFAULT_BWD_TILES, BwdPlan, BwdTiles, bwd_plan
from infllm_cupy.testing import assert_qhead_layout_close, check_qhead_layout_grads, cu_seqlens_from_lengths

from conftest import HOPPER

NEEDS_HOPPER = pytest.mark.skipif(not HOPPER, reason="sm_90a kernels need capability 9.0")


def qhead_mask(shape, *, seed, density=0.3):
    """Random per-query-head layout mask whose heads differ inside every group (block 0 kept in most
    rows; one head's second query block selects nothing, so its rows give 0 and lse = +inf)."""
    g = torch.Generator().manual_seed(seed)
    m = torch.rand(shape, generator=g) < density
    m[..., 0] |= torch.rand(shape[:-1], generator=g) < 0.8
    if m.shape[-2] > 1:
        m[..., 1, 1, :] = False
    return m


# ------------------------------------------------------------------------------------------------ CPU


def test_bwd_plan_qhead_field():
    assert BwdPlan("sm90a").qhead == "off"
    assert BwdPlan("sm90a", qhead="head").qhead == "head"
    assert BwdPlan("sm80", qhead="head").tiles == DEFAULT_BWD_TILES
    with pytest.raises(ValueError, match=r"BwdPlan\.qhead must be one of"):
        BwdPlan("sm90a", qhead="group")
    with pytest.raises(ValueError, match=r"BwdPlan\.qhead must be one of"):
        BwdPlan("sm90a", qhead=True)
    with pytest.raises(ValueError, match="default SM80 tiles"):
        BwdPlan("sm80", BwdTiles(8, 16), qhead="head")
    with pytest.raises(ValueError, match="fixed tiles"):
        BwdPlan("sm90a", dkdv="auto", qhead="head")


def test_bwd_plan_dkdv_group_field():
    assert BwdPlan("sm90a").dkdv_group is False
    assert BwdPlan("sm90a", qhead="head", dkdv_group=True).dkdv_group is True
    with pytest.raises(ValueError, match=r"BwdPlan\.dkdv_group must be a bool"):
        BwdPlan("sm90a", qhead="head", dkdv_group=1)
    for bad in (dict(qhead="off"), dict(qhead="head", block0_parts=2), dict(kernel="sm80", qhead="head")):
        kw = {"kernel": "sm90a", **bad}
        with pytest.raises(ValueError, match="dkdv_group walks a group's per-query-head rows"):
            BwdPlan(kw.pop("kernel"), dkdv_group=True, **kw)


def test_qhead_bwd_plan_is_the_expanded_plan():
    """The per-query-head backward's plan is the expanded path's (G = 1) with qhead set: the same
    passes, block-0 parts and instances, which the bit-identity tests rely on."""
    from infllm_cupy.stage2.qhead import qhead_bwd_plan
    for cap in ((9, 0), (8, 0)):
        for msq in (1000, 40000):
            p = qhead_bwd_plan(cap, 128, torch.bfloat16, msq, msq, 2 * msq, "auto")
            e = bwd_plan(cap, 1, 128, torch.bfloat16, msq, msq, 2 * msq, "auto")
            assert p == dataclasses.replace(e, qhead="head")
            assert p.dkdv == "tiles"


def test_qhead_bwd_plan_groups_dkdv_past_the_partials_budget():
    """Where the per-query-head dk/dv partials (2 x total_k x HQ x D elements, plus their fp32 sums
    with query-range passes) pass the budget, the
    sm_90a plan sums each group in its dk/dv CTA (block 0 in one part); below it, or on SM80, the
    expanded plan."""
    from infllm_cupy.stage2.qhead import qhead_bwd_plan
    total_k, HQ, D = 2 * 40000, 32, 128
    partials = 2 * total_k * HQ * D * 2
    below = qhead_bwd_plan((9, 0), D, torch.bfloat16, 40000, 40000, total_k, HQ=HQ, partials_budget=partials)
    above = qhead_bwd_plan((9, 0), D, torch.bfloat16, 40000, 40000, total_k, HQ=HQ,
                           partials_budget=partials - 1)
    assert not below.dkdv_group and above == dataclasses.replace(below, dkdv_group=True, block0_parts=1)
    assert not qhead_bwd_plan((8, 0), D, torch.bfloat16, 40000, 40000, total_k, HQ=HQ,
                              partials_budget=0).dkdv_group
    assert not qhead_bwd_plan((9, 0), D, torch.bfloat16, 40000, 40000, total_k, HQ=HQ).dkdv_group
    # with query-range passes the per-query-head fp32 sums count too (2 x 4 bytes more per element)
    long = qhead_bwd_plan((9, 0), D, torch.bfloat16, 131072, 131072, 2 * 131072, HQ=HQ,
                          partials_budget=2 * 2 * 131072 * HQ * D * 2)
    assert long.dkdv_group and long.dkdv_passes > 1


def test_check_qhead_layout_grads_passes_the_reference_and_fails_a_perturbed_gradient():
    """The launcher-level gradient check the GPU tests use: the reference's own low-precision
    gradients pass, and one element moved by far more than the rule allows fails."""
    from infllm_cupy.stage2.naive import naive_block_sparse_attn_varlen
    lengths, HQ, H, D = [150, 40], 4, 2, 16
    g = torch.Generator().manual_seed(71)
    q, k, v, dout = (torch.randn(sum(lengths), n, D, generator=g).to(torch.bfloat16) for n in (HQ, H, H, HQ))
    cu = cu_seqlens_from_lengths(lengths)
    lay = BlockLayout(qhead_mask((HQ, 3, 3), seed=72), 64)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = naive_block_sparse_attn_varlen(leaves[0], *(x.repeat_interleave(HQ // H, 1) for x in leaves[1:]),
                                         cu, cu, lay, 150, 150, upcast=False)
    grads = list(torch.autograd.grad(out, leaves, dout))
    check_qhead_layout_grads(grads, q, k, v, dout, cu, cu, lay, 150, 150)
    grads[1] = grads[1].clone()
    grads[1][3, 1, 5] += 1.0
    with pytest.raises(AssertionError, match="dk"):
        check_qhead_layout_grads(grads, q, k, v, dout, cu, cu, lay, 150, 150)


def test_public_op_routes_per_query_head_layouts():
    """`block_sparse_attn_varlen` with a layout of HQ heads (HQ != H) is the per-query-head op, forward
    and gradients (CPU: both the expanded reference)."""
    lengths, HQ, H, D = [150, 40], 8, 2, 16
    torch.manual_seed(21)
    T = sum(lengths)
    leaves = [torch.randn(T, n, D, dtype=torch.float64, requires_grad=True) for n in (HQ, H, H)]
    cu = cu_seqlens_from_lengths(lengths)
    lay = BlockLayout(qhead_mask((HQ, 3, 3), seed=22))
    out, lse = block_sparse_attn_varlen(*leaves, cu, cu, lay, 150, 150, return_lse=True)
    ref_leaves = [x.detach().clone().requires_grad_() for x in leaves]
    ref, ref_lse = qhead_block_sparse_attn_varlen(*ref_leaves, cu, cu, lay, 150, 150, return_lse=True)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    dout = torch.randn_like(out)
    for name, g, r in zip(("dq", "dk", "dv"), torch.autograd.grad(out, leaves, dout),
                          torch.autograd.grad(ref, ref_leaves, dout)):
        assert torch.equal(g, r), name
    # the reference backend routes too
    out_r = block_sparse_attn_varlen(*(x.detach() for x in leaves), cu, cu, lay, 150, 150,
                                     backend="reference")
    torch.testing.assert_close(out_r, out.detach(), atol=1e-12, rtol=1e-12)


def test_qhead_bwd_custom_op_opcheck():
    """Registration of `infllm_cupy::qhead_block_sparse_attn_bwd`: schema, fake tensors and AOT
    dispatch (torch.compile) on the CPU implementation (the expanded path)."""
    from infllm_cupy.stage2.qhead import qhead_block_sparse_attn_bwd, qhead_block_sparse_attn_fwd
    torch.manual_seed(23)
    T, HQ, H, D = 100, 4, 2, 16
    q, dout = torch.randn(T, HQ, D), torch.randn(T, HQ, D)
    k, v = torch.randn(T, H, D), torch.randn(T, H, D)
    cu = cu_seqlens_from_lengths([60, 40])
    mask = qhead_mask((HQ, 1, 1), seed=24)
    out, lse = qhead_block_sparse_attn_fwd(q, k, v, cu, cu, mask, 64, 60, 60, True, 0.25, "auto")
    res = torch.library.opcheck(qhead_block_sparse_attn_bwd,
                                (dout, q, k, v, out, lse, cu, cu, mask, 64, 60, 60, True, 0.25, "auto"))
    assert set(res.values()) in ({"SUCCESS"}, {"SUCCESS", "SKIP"}), res


def test_public_op_refuses_a_layout_of_neither_head_count():
    q, k = torch.randn(64, 4, 16), torch.randn(64, 2, 16)
    cu = cu_seqlens_from_lengths([64])
    with pytest.raises(ValueError, match=r"layout has 3 KV heads but k has 2: .* or q's 4 query heads"):
        block_sparse_attn_varlen(q, k, k, cu, cu, BlockLayout(torch.ones(3, 1, 1, dtype=torch.bool)), 64, 64)


@pytest.mark.nvrtc
@pytest.mark.parametrize("D", [64, 128])
def test_qhead_bwd_instances_compile_without_more_spills(D):
    """The QH = 2 backward instances against their per-KV-head twins (bf16; tests/test_jit.py
    compiles every registered instance): sm_90a no spills, no serialised wgmma, registers within 8 of
    the twin's; SM80 no more spills than the twin."""
    T = "__nv_bfloat16"
    pairs = [("stage2/sparse_bwd_dq_sm90.cu", f"stage2_bwd_dq_ring_sm90<{T}, {D}, 4>"),
             ("stage2/sparse_bwd_sm90.cu", f"stage2_bwd_dkdv_sm90<{T}, {D}, false>")]
    for src, base in pairs:
        rep = _jit.compile_report(src, [base, base[:-1] + ", 2>"], "sm_90a")
        res = {k.name: k for k in rep.kernels}
        assert "C7511" not in rep.log, rep.log
        qh, twin = res[base[:-1] + ", 2>"], res[base]
        assert qh.spill_stores == 0 and qh.spill_loads == 0, str(qh)
        assert qh.registers <= twin.registers + 8, (str(qh), str(twin))
    for base in (DEFAULT_BWD_TILES.dq_name(torch.bfloat16, D),
                 DEFAULT_BWD_TILES.dkdv_name(torch.bfloat16, D)):
        rep = _jit.compile_report("stage2/sparse_bwd.cu", [base, base[:-1] + ", 2>"], "sm_80")
        res = {k.name: k for k in rep.kernels}
        qh, twin = res[base[:-1] + ", 2>"], res[base]
        assert qh.spill_stores <= twin.spill_stores and qh.spill_loads <= twin.spill_loads, (str(qh),
                                                                                             str(twin))


@pytest.mark.nvrtc
def test_dkdv_group_instances_compile_without_spills():
    """The QH = 3 dk/dv instances (a group's query heads per CTA, BwdPlan.dkdv_group): no spills, no
    serialised wgmma (at D = 128 without the in-warpgroup pipelining, which left no registers)."""
    names = [f"stage2_bwd_dkdv_sm90<{t}, {d}, false, 3>" for t in ("__nv_bfloat16", "__half") for d in (64,
                                                                                                        128)]
    rep = _jit.compile_report("stage2/sparse_bwd_sm90.cu", names, "sm_90a")
    assert "C7511" not in rep.log, rep.log
    assert {k.name for k in rep.kernels} == set(names)
    for k in rep.kernels:
        assert k.spill_stores == 0 and k.spill_loads == 0, str(k)


# ------------------------------------------------------------------------------------------------ GPU

KERNELS = [pytest.param("sm90a", marks=NEEDS_HOPPER), "sm80"]


def gpu_inputs(lengths, HQ, H, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    q, k, v = (torch.randn(T, n, D, generator=g).to("cuda", dtype) for n in (HQ, H, H))
    return q, k, v, cu_seqlens_from_lengths(lengths, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("D,dtype", [(64, torch.float16), (128, torch.bfloat16)],
                         ids=["d64-fp16", "d128-bf16"])
@pytest.mark.parametrize("G", [1, 2, 4, 8, 16, 32])
def test_qhead_bwd_matches_reference(G, D, dtype, kernel):
    """The public entry's gradients (per-query-head forward and backward kernels, no K/V repeat) on
    ragged lengths with a 1-token sequence and a per-sequence layout whose heads differ in every
    group, against the float64 reference on K/V repeated to HQ heads."""
    lengths, H, q_block = [700, 130, 1], 2, 64
    HQ = G * H
    q, k, v, cu = gpu_inputs(lengths, HQ, H, D, dtype, seed=G * 10 + D)
    mask = qhead_mask((len(lengths), HQ, -(-700 // q_block), -(-700 // 64)), seed=G + D)
    lay = BlockLayout(mask.cuda(), q_block)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = qhead_block_sparse_attn_varlen(*leaves, cu, cu, lay, 700, 700, backend="kernels", kernel=kernel)
    assert_qhead_layout_close(out, q, k, v, leaves, cu, cu, lay, 700, 700)


def _variant_plans(variant, q, k, max_seqlen):
    """(per-query-head plan, expanded plan, the launchers' keywords): the same plan but for qhead; for
    "sm90a_nopdl" the dk/dv passes launched one after the other (`stage2_bwd`'s `_pdl` hook), for
    "sm90a_dq_split" split dq rings in every CTA (its `_force_dq_steps` hook)."""
    kernel = "sm80" if variant.startswith("sm80") else "sm90a"
    base = bwd_plan(torch.cuda.get_device_capability(), 1, q.shape[2], q.dtype, max_seqlen, max_seqlen,
                    k.shape[0], kernel=kernel)
    extra = {"sm80": {}, "sm80_flush": {"dkdv_flush": 3}, "sm90a": {},
             "sm90a_passes": {"dkdv_passes": 3, "block0_parts": 1},
             "sm90a_parts": {"dkdv_passes": 1, "block0_parts": 4}, "sm90a_dq_split": {},
             "sm90a_nopdl": {"dkdv_passes": 2, "block0_parts": 1}}[variant]
    base = dataclasses.replace(base, **extra)
    launch = {"sm90a_nopdl": {"_pdl": False}, "sm90a_dq_split": {"_force_dq_steps": "split"}}.get(variant, {})
    return dataclasses.replace(base, qhead="head"), base, launch


VARIANTS = ["sm80", "sm80_flush"] + [pytest.param(v, marks=NEEDS_HOPPER) for v in
                                     ("sm90a", "sm90a_passes", "sm90a_parts", "sm90a_dq_split",
                                      "sm90a_nopdl")]


@pytest.mark.gpu
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("G", [1, 4, 16])
def test_qhead_bwd_bit_identical_to_expanded(variant, G):
    """dq, dk, dv of the per-query-head backward equal, bit for bit, the expanded path's: K/V repeated
    to HQ heads, the G = 1 kernels under the same plan, dK/dV summed over the group in fp32 (the
    kernels differ only in the K/V address, and the sum is the same computation). Also run twice:
    deterministic."""
    lengths, H, D = [900, 200, 1], 2, 128
    HQ = G * H
    q, k, v, cu = gpu_inputs(lengths, HQ, H, D, torch.bfloat16, seed=31 + G)
    mask = qhead_mask((HQ, -(-900 // 64), -(-900 // 64)), seed=32 + G).cuda()
    g = torch.Generator().manual_seed(33)
    dout = torch.randn(q.shape, generator=g).to("cuda", q.dtype)
    fwd = dataclasses.replace(ops.fwd_plan_for(q, k, 900, None, kernel="sm80" if variant.startswith("sm80")
                                               else "sm90a"), qhead="head")
    out, lse = ops.layout_fwd(q, k, v, cu, cu, mask, 64, 900, 900, True, D ** -0.5, fwd)
    plan_qh, plan_x, launch = _variant_plans(variant, q, k, 900)
    got = ops.layout_bwd(dout, q, k, v, out, lse, cu, cu, mask, 64, 900, 900, True, D ** -0.5, plan_qh,
                         **launch)
    again = ops.layout_bwd(dout, q, k, v, out, lse, cu, cu, mask, 64, 900, 900, True, D ** -0.5, plan_qh,
                           **launch)
    ke, ve = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    dq, dke, dve = ops.layout_bwd(dout, q, ke, ve, out, lse, cu, cu, mask, 64, 900, 900, True, D ** -0.5,
                                  plan_x, **launch)
    want = (dq, dke.view(-1, H, G, D).sum(2, dtype=torch.float32).to(k.dtype),
            dve.view(-1, H, G, D).sum(2, dtype=torch.float32).to(v.dtype))
    for name, a, b, w in zip(("dq", "dk", "dv"), got, again, want):
        assert a.shape == w.shape, name
        assert not torch.isnan(a).any(), name
        assert torch.equal(a, w), name
        assert torch.equal(a, b), name


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", KERNELS)
def test_public_op_routes_per_query_head_layouts_on_gpu(kernel):
    """`block_sparse_attn_varlen` with a layout of HQ heads runs the per-query-head op (bit-equal
    outputs and gradients), and its gradients pass the rule against the reference."""
    lengths, HQ, H, D, dtype = [333, 64, 1], 16, 2, 128, torch.bfloat16
    q, k, v, cu = gpu_inputs(lengths, HQ, H, D, dtype, seed=41)
    lay = BlockLayout(qhead_mask((HQ, 6, 6), seed=42).cuda(), 64)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = block_sparse_attn_varlen(*leaves, cu, cu, lay, 333, 333, kernel=kernel)
    qh_leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    qh = qhead_block_sparse_attn_varlen(*qh_leaves, cu, cu, lay, 333, 333, kernel=kernel)
    assert torch.equal(out, qh)
    dout = torch.randn_like(out)
    for name, a, b in zip(("dq", "dk", "dv"), torch.autograd.grad(out, leaves, dout, retain_graph=True),
                          torch.autograd.grad(qh, qh_leaves, dout)):
        assert torch.equal(a, b), name
    assert_qhead_layout_close(out, q, k, v, leaves, cu, cu, lay, 333, 333)


@pytest.mark.gpu
@NEEDS_HOPPER
@pytest.mark.parametrize("variant", ["one_pass", "passes", "passes_nopdl"])
@pytest.mark.parametrize("G,D,dtype",
                         [(1, 128, torch.bfloat16), (4, 64, torch.float16), (16, 128, torch.bfloat16),
                                       (32, 128, torch.float16)], ids=["g1-d128-bf16", "g4-d64-fp16",
                                                                        "g16-d128-bf16", "g32-d128-fp16"])
def test_dkdv_group_matches_reference(G, D, dtype, variant):
    """BwdPlan.dkdv_group (one dk/dv CTA per (key block, KV head) over the group's query heads, sums
    in fp32 in the kernel) against the float64 reference with K/V repeated to HQ heads, by
    FlashAttention's rule, on ragged lengths with a 1-token sequence and heads that differ in every
    group; dq is the partials plan's bit for bit (the same kernel), and a second run gives the same
    bits (deterministic)."""
    lengths, H = [900, 200, 1], 2
    HQ = G * H
    q, k, v, cu = gpu_inputs(lengths, HQ, H, D, dtype, seed=51 + G)
    mask = qhead_mask((HQ, -(-900 // 64), -(-900 // 64)), seed=52 + G).cuda()
    g = torch.Generator().manual_seed(53)
    dout = torch.randn(q.shape, generator=g).to("cuda", q.dtype)
    fwd = dataclasses.replace(ops.fwd_plan_for(q, k, 900, None, kernel="sm90a"), qhead="head")
    out, lse = ops.layout_fwd(q, k, v, cu, cu, mask, 64, 900, 900, True, D ** -0.5, fwd)
    base = dataclasses.replace(bwd_plan(torch.cuda.get_device_capability(), 1, D, dtype, 900, 900, k.shape[0],
                                        kernel="sm90a"), qhead="head", block0_parts=1)
    base = dataclasses.replace(base, **{"one_pass": {"dkdv_passes": 1}, "passes": {"dkdv_passes": 3},
                                        "passes_nopdl": {"dkdv_passes": 2}}[variant])
    pdl = variant != "passes_nopdl"     # False: the passes launched one after the other (`_pdl` hook)
    group = dataclasses.replace(base, dkdv_group=True)
    got = ops.layout_bwd(dout, q, k, v, out, lse, cu, cu, mask, 64, 900, 900, True, D ** -0.5, group,
                         _pdl=pdl)
    again = ops.layout_bwd(dout, q, k, v, out, lse, cu, cu, mask, 64, 900, 900, True, D ** -0.5, group,
                           _pdl=pdl)
    partials = ops.layout_bwd(dout, q, k, v, out, lse, cu, cu, mask, 64, 900, 900, True, D ** -0.5, base,
                              _pdl=pdl)
    for name, a, b in zip(("dq", "dk", "dv"), got, again):
        assert torch.equal(a, b), f"{name}: not deterministic"
    check_qhead_layout_grads([x.cpu() for x in got], *(x.cpu() for x in (q, k, v, dout)), cu.cpu(), cu.cpu(),
                             BlockLayout(mask.cpu(), 64), 900, 900)
    assert torch.equal(got[0], partials[0])


@pytest.mark.gpu
@NEEDS_HOPPER
@pytest.mark.parametrize("G", [4, 16])
def test_public_op_sums_groups_in_the_kernel_past_the_budget(G, monkeypatch):
    """With the partials budget at 0 the public op's backward runs the QH = 3 dk/dv (seen in the
    launches) and its gradients pass the rule against the float64 reference."""
    import infllm_cupy.stage2.qhead as qh
    from infllm_cupy.stage2 import sparse_bwd
    monkeypatch.setattr(qh, "total_memory", lambda device: 0)
    names = []
    real = sparse_bwd.launch

    def spy(kernel, *, name, **kw):
        names.append(name)
        return real(kernel, name=name, **kw)
    monkeypatch.setattr(sparse_bwd, "launch", spy)
    lengths, H, D = [700, 130, 1], 2, 128
    HQ = G * H
    q, k, v, cu = gpu_inputs(lengths, HQ, H, D, torch.bfloat16, seed=61 + G)
    lay = BlockLayout(qhead_mask((len(lengths), HQ, 11, 11), seed=62 + G).cuda(), 64)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = qhead_block_sparse_attn_varlen(*leaves, cu, cu, lay, 700, 700, backend="kernels", kernel="sm90a")
    assert_qhead_layout_close(out, q, k, v, leaves, cu, cu, lay, 700, 700)
    assert any(n.startswith("stage2_bwd_dkdv_sm90<") and n.endswith(", 3>") for n in names), names
