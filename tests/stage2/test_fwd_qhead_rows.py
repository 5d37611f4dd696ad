"""Per-query-head mask rows in the stage-2 forward (`FwdPlan.qhead`, the kernels' QH instances;
docs/stage2_fwd.md, "Per-query-head mask rows") and `qhead_block_sparse_attn_varlen`, which routes
layouts with one row per query head through them (docs/patterns.md, "Per query head vs per KV head").

CPU: the op's semantics against a dense masked softmax written here, the identity with the
per-KV-head op where a group's heads agree, the backward formula (expanded path, dK/dV summed over
the group), argument errors, the plan field, and NVRTC resources of the new instances. GPU: the
kernels against the float64 reference by FlashAttention's rule (outputs NaN-poisoned by the test
session), one query head per CTA ("head"), ragged lengths, G 1 to 32 (and 3), D 64/128,
bf16/fp16, every sm_90a step shape and the SM80 kernel, and bit-identity with the per-KV-head
kernels on K/V repeated to G = 1.
"""
import dataclasses
import math

import pytest
import torch

from infllm_cupy import _jit
from infllm_cupy.patterns import SparseAttention, qhead_block_sparse_attn_varlen
from infllm_cupy.stage2 import ops
from infllm_cupy.stage2.attention import block_sparse_attn_varlen
from infllm_cupy.stage2.layout import BlockLayout
from infllm_cupy.stage2.naive import naive_block_sparse_attn_varlen
from infllm_cupy.stage2.plan import DEFAULT_TILES, FwdPlan, FwdTiles
from infllm_cupy.stage2.qhead import qhead_block_sparse_attn_fwd
from infllm_cupy.testing import (
    assert_close_to_ref,
    assert_qhead_layout_close,
    cu_seqlens_from_lengths,
)

from conftest import HOPPER

NEEDS_HOPPER = pytest.mark.skipif(not HOPPER, reason="sm_90a kernel needs capability 9.0")


def qhead_mask(shape, *, seed, density=0.3, empty_rows=True):
    """Random per-query-head layout mask whose heads differ (block 0 kept in most rows; with
    `empty_rows`, one head's first row selects nothing: its rows give 0 and lse = +inf)."""
    g = torch.Generator().manual_seed(seed)
    m = torch.rand(shape, generator=g) < density
    m[..., 0] |= torch.rand(shape[:-1], generator=g) < 0.8
    if empty_rows:
        m[..., 1, 0, :] = False
    return m


def dense_qhead_attn(q, k, v, lengths, mask, q_block, causal, scale):
    """out [total, HQ, D] and lse [HQ, total] by a dense masked softmax per sequence and query head
    (float64), the token mask read from `mask[(b,) hq, t // q_block, c // 64]`."""
    HQ, H = q.shape[1], k.shape[1]
    G = HQ // H
    out = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.full((HQ, q.shape[0]), math.inf, dtype=torch.float64)
    s0 = 0
    for b, L in enumerate(lengths):
        mb = mask[b] if mask.dim() == 4 else mask
        t = torch.arange(L)
        allowed = mb[:, t // q_block][:, :, t // 64]                      # [HQ, L, L]
        if causal:
            allowed = allowed & (t[None, :, None] >= t[None, None, :])
        qs, ks, vs = (x[s0:s0 + L].double() for x in (q, k, v))
        kk, vv = ks.repeat_interleave(G, 1), vs.repeat_interleave(G, 1)
        s = torch.einsum("thd,chd->htc", qs, kk) * scale
        s = s.masked_fill(~allowed, -math.inf)
        lg = torch.logsumexp(s, -1)                                         # [HQ, L]
        p = torch.where(allowed, torch.exp(s - lg[..., None].clamp(max=1e300)), torch.zeros(()))
        p = torch.nan_to_num(p)
        out[s0:s0 + L] = torch.einsum("htc,chd->thd", p, vv)
        lse[:, s0:s0 + L] = torch.where(torch.isinf(lg), math.inf, lg)
        s0 += L
    return out, lse


# ------------------------------------------------------------------------------------------------ CPU


@pytest.mark.parametrize("per_sequence", [False, True])
@pytest.mark.parametrize("q_block", [64, 128])
@pytest.mark.parametrize("causal", [True, False])
def test_qhead_op_matches_dense_masked_softmax(per_sequence, q_block, causal):
    lengths, HQ, H, D = [300, 70, 1], 6, 2, 16
    torch.manual_seed(1)
    T = sum(lengths)
    q, k, v = torch.randn(T, HQ, D), torch.randn(T, H, D), torch.randn(T, H, D)
    cu = cu_seqlens_from_lengths(lengths)
    shape = ((len(lengths),) if per_sequence else ()) + (HQ, -(-300 // q_block), -(-300 // 64))
    mask = qhead_mask(shape, seed=2)
    out, lse = qhead_block_sparse_attn_varlen(q, k, v, cu, cu, BlockLayout(mask, q_block), 300, 300,
                                              causal=causal, return_lse=True)
    ref, ref_lse = dense_qhead_attn(q, k, v, lengths, mask, q_block, causal, D ** -0.5)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    fin = ~torch.isinf(ref_lse)
    torch.testing.assert_close(lse.double()[fin], ref_lse[fin], atol=1e-5, rtol=1e-5)
    assert bool((out[torch.isinf(ref_lse).T] == 0).all())


def test_qhead_op_equals_kv_layout_when_groups_agree():
    lengths, HQ, H, D = [200, 65], 8, 2, 16
    torch.manual_seed(3)
    T = sum(lengths)
    q, k, v = torch.randn(T, HQ, D), torch.randn(T, H, D), torch.randn(T, H, D)
    cu = cu_seqlens_from_lengths(lengths)
    kv = qhead_mask((H, 4, 4), seed=4)
    a = qhead_block_sparse_attn_varlen(q, k, v, cu, cu, BlockLayout(kv.repeat_interleave(HQ // H, 0)), 200,
                                       200)
    b = block_sparse_attn_varlen(q, k, v, cu, cu, BlockLayout(kv), 200, 200)
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_qhead_custom_op_gradients_on_cpu():
    """The op's autograd formula (K/V expanded, the per-KV-head backward at G = 1, dK/dV summed over
    the group) against autograd through the dense float64 softmax."""
    lengths, HQ, H, D = [150, 40], 8, 2, 16
    torch.manual_seed(5)
    T = sum(lengths)
    leaves = [torch.randn(T, HQ, D, dtype=torch.float64, requires_grad=True),
              torch.randn(T, H, D, dtype=torch.float64, requires_grad=True),
              torch.randn(T, H, D, dtype=torch.float64, requires_grad=True)]
    cu = cu_seqlens_from_lengths(lengths)
    mask = qhead_mask((HQ, 3, 3), seed=6)
    out, _ = qhead_block_sparse_attn_fwd(*leaves, cu, cu, mask, 64, 150, 150, True, D ** -0.5, "auto")
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, leaves, dout)
    ref_leaves = [x.detach().clone().requires_grad_() for x in leaves]
    ref = torch.cat([_dense_diff(*(x[s:s + L] for x in ref_leaves), mask, D ** -0.5)
                     for s, L in zip([0, 150], lengths)])
    want = torch.autograd.grad(ref, ref_leaves, dout)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        torch.testing.assert_close(g, w, atol=1e-9, rtol=1e-7, msg=name)


def test_qhead_custom_op_opcheck():
    """Registration of `infllm_cupy::qhead_block_sparse_attn_fwd`: schema, autograd, fake tensors and
    AOT dispatch (torch.compile) on the CPU implementation."""
    torch.manual_seed(13)
    T, HQ, H, D = 100, 4, 2, 16
    q = torch.randn(T, HQ, D, requires_grad=True)
    k, v = (torch.randn(T, H, D, requires_grad=True) for _ in range(2))
    cu = cu_seqlens_from_lengths([60, 40])
    mask = qhead_mask((HQ, 1, 1), seed=14, empty_rows=False)
    res = torch.library.opcheck(qhead_block_sparse_attn_fwd, (q, k, v, cu, cu, mask, 64, 60, 60, True, 0.25,
                                                             "auto"))
    assert set(res.values()) == {"SUCCESS"}, res


def _dense_diff(q, k, v, mask, scale):
    """Differentiable dense masked causal attention of one sequence (rows with no key give 0)."""
    L, HQ, H = q.shape[0], q.shape[1], k.shape[1]
    t = torch.arange(L)
    allowed = mask[:, t // 64][:, :, t // 64] & (t[:, None] >= t[None, :])
    s = torch.einsum("thd,chd->htc", q, k.repeat_interleave(HQ // H, 1)) * scale
    p = torch.softmax(s.masked_fill(~allowed, -math.inf), -1).nan_to_num()
    return torch.einsum("htc,chd->thd", p, v.repeat_interleave(HQ // H, 1))


def test_qhead_argument_errors():
    q, k = torch.randn(64, 4, 16), torch.randn(64, 2, 16)
    cu = cu_seqlens_from_lengths([64])
    with pytest.raises(TypeError, match="layout must be a BlockLayout"):
        qhead_block_sparse_attn_varlen(q, k, k, cu, cu, torch.ones(4, 1, 1, dtype=torch.bool), 64, 64)
    with pytest.raises(ValueError, match="layout has 2 heads but q has 4"):
        qhead_block_sparse_attn_varlen(q, k, k, cu, cu, BlockLayout(torch.ones(2, 1, 1, dtype=torch.bool)),
                                       64, 64)
    with pytest.raises(ValueError, match="multiple of the key/value head count"):
        qhead_block_sparse_attn_varlen(torch.randn(64, 3, 16), k, k, cu, cu,
                                       BlockLayout(torch.ones(3, 1, 1, dtype=torch.bool)), 64, 64)
    with pytest.raises(TypeError, match="causal must be a bool"):
        qhead_block_sparse_attn_varlen(q, k, k, cu, cu, BlockLayout(torch.ones(4, 1, 1, dtype=torch.bool)),
                                       64, 64, causal=1)
    with pytest.raises(ValueError, match="backend"):
        qhead_block_sparse_attn_varlen(q, k, k, cu, cu, BlockLayout(torch.ones(4, 1, 1, dtype=torch.bool)),
                                       64, 64, backend="fast")


def test_fwd_plan_qhead_field():
    assert FwdPlan("sm90a").qhead == "off"
    assert FwdPlan("sm90a", qhead="head").qhead == "head"
    assert FwdPlan("sm80", qhead="head").tiles == DEFAULT_TILES
    with pytest.raises(ValueError, match=r"FwdPlan\.qhead must be one of"):
        FwdPlan("sm90a", qhead=True)
    with pytest.raises(ValueError, match=r"FwdPlan\.qhead must be one of"):
        FwdPlan("sm90a", qhead="group")  # the union walk, removed (docs/stage2_fwd.md, 9. Tried and not kept)
    with pytest.raises(ValueError, match="default SM80 tiles"):
        FwdPlan("sm80", FwdTiles(8, 1, 64), qhead="head")
    with pytest.raises(ValueError, match="needs kv_passes=1"):
        FwdPlan("sm90a", kv_passes=2, qhead="head")


@pytest.mark.nvrtc
@pytest.mark.parametrize("D", [64, 128])
def test_qhead_instances_compile_without_more_spills(D):
    """The QH = 2 ("head") instances against their per-KV-head twins (bf16;
    tests/test_jit.py compiles every registered instance): sm_90a no spills, no serialised wgmma, the
    same registers; SM80 (MT = 2, which spills already) at most 8 more bytes (D = 64 on sm_80: 0 -> 8)."""
    base = f"stage2_fwd_sm90<__nv_bfloat16, {D}, 6>"
    rep = _jit.compile_report("stage2/sparse_fwd_sm90.cu", [base, base[:-1] + ", 2>"], "sm_90a")
    res = {k.name: k for k in rep.kernels}
    assert "C7511" not in rep.log, rep.log
    qh = res[base[:-1] + ", 2>"]
    assert qh.spill_stores == 0 and qh.spill_loads == 0, str(qh)
    assert qh.registers == res[base].registers, (str(qh), str(res[base]))
    base = DEFAULT_TILES.name(torch.bfloat16, D)
    rep = _jit.compile_report("stage2/sparse_fwd.cu", [base, base[:-1] + ", 2>"], "sm_80")
    res = {k.name: k for k in rep.kernels}
    qh, twin = res[base[:-1] + ", 2>"], res[base]
    assert qh.spill_stores <= twin.spill_stores + 8 and qh.spill_loads <= twin.spill_loads + 8, (str(qh),
                                                                                                 str(twin))


# ------------------------------------------------------------------------------------------------ GPU

# "sm90a": the plan's per-CTA step choice; the others force one step shape in every CTA; "sm80": the
# SM80 kernel (default tiles)
VARIANTS = [pytest.param(v, marks=NEEDS_HOPPER) for v in ("sm90a", "sm90a_pair", "sm90a_single",
                                                          "sm90a_split")] \
    + ["sm80"]
# the launchers' `_force_steps` per variant (None: each CTA chooses)
STEP = {"sm90a": None, "sm90a_pair": "pair", "sm90a_single": "single", "sm90a_split": "split", "sm80": None}


def qhead_plan(variant, q, k, max_seqlen_k):
    if variant == "sm80":
        return FwdPlan("sm80", qhead="head")
    plan = ops.fwd_plan_for(q, k, max_seqlen_k, None, kernel="sm90a")
    return dataclasses.replace(plan, qhead="head")


def gpu_inputs(lengths, HQ, H, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    q, k, v = (torch.randn(T, n, D, generator=g).to("cuda", dtype) for n in (HQ, H, H))
    return q, k, v, cu_seqlens_from_lengths(lengths, "cuda")


def check_qhead_out(out, lse, q, k, v, cu, mask, q_block, mx, causal):
    G = q.shape[1] // k.shape[1]
    ke, ve = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    lay = BlockLayout(mask.cuda(), q_block)
    ref, ref_lse = naive_block_sparse_attn_varlen(q.double(), ke.double(), ve.double(), cu, cu, lay, mx, mx,
                                                  causal=causal, return_lse=True)
    lowp = naive_block_sparse_attn_varlen(q, ke, ve, cu, cu, lay, mx, mx, causal=causal, upcast=False)
    assert_close_to_ref("out", out, ref, lowp, mult=2)
    empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), empty), "lse must be +inf exactly on rows with no allowed key"
    assert not torch.isnan(lse).any()
    if (~empty).any():
        err = (lse[~empty].double() - ref_lse[~empty]).abs().max().item()
        assert err <= 1e-4 * max(1.0, ref_lse[~empty].abs().max().item()), f"lse error {err}"
    assert bool((out[empty.T] == 0).all()), "rows with no allowed key must be exactly 0"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("G", [1, 2, 3, 4, 8, 16, 32])
def test_qhead_kernel_matches_reference(G, D, dtype):
    """The public entry (the plan's kernel for the device) on ragged lengths, per-sequence layout."""
    lengths, H, q_block = [700, 130, 1], 2, 64
    HQ = G * H
    q, k, v, cu = gpu_inputs(lengths, HQ, H, D, dtype, seed=G * 10 + D)
    mask = qhead_mask((len(lengths), HQ, -(-700 // q_block), -(-700 // 64)), seed=G + D)
    out, lse = qhead_block_sparse_attn_varlen(q, k, v, cu, cu, BlockLayout(mask, q_block), 700, 700,
                                              return_lse=True, backend="kernels")
    check_qhead_out(out, lse, q, k, v, cu, mask, q_block, 700, True)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("G,D,dtype,q_block,causal", [(16, 128, torch.bfloat16, 64, True),
                                                     (4, 64, torch.float16, 128, True),
                                                     (8, 128, torch.bfloat16, 128, False),
                                                     (3, 64, torch.bfloat16, 64, True)])
def test_qhead_kernel_variants(variant, G, D, dtype, q_block, causal):
    lengths, H = [1000, 300, 1], 2
    HQ = G * H
    q, k, v, cu = gpu_inputs(lengths, HQ, H, D, dtype, seed=7)
    mask = qhead_mask((HQ, -(-1000 // q_block), -(-1000 // 64)), seed=8)
    out, lse = ops.layout_fwd(q, k, v, cu, cu, mask.cuda(), q_block, 1000, 1000, causal, D ** -0.5,
                              qhead_plan(variant, q, k, 1000), _force_steps=STEP[variant])
    check_qhead_out(out, lse, q, k, v, cu, mask, q_block, 1000, causal)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("G", [1, 4, 16])
def test_qhead_kernel_equals_expanded_kernel(variant, G):
    """The per-query-head forward ("head") equals the per-KV-head op on K/V repeated to G = 1, bit
    for bit, at any G (at G = 1 it is that instance's launch)."""
    lengths, H, D = [900, 200], 2, 128
    HQ = G * H
    q, k, v, cu = gpu_inputs(lengths, HQ, H, D, torch.bfloat16, seed=9)
    plan = qhead_plan(variant, q, k, 900)
    per_q = qhead_mask((HQ, -(-900 // 64), -(-900 // 64)), seed=10).cuda()    # heads differ inside groups
    out, lse = ops.layout_fwd(q, k, v, cu, cu, per_q, 64, 900, 900, True, D ** -0.5, plan,
                              _force_steps=STEP[variant])
    ke, ve = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    ref, ref_lse = ops.layout_fwd(q, ke, ve, cu, cu, per_q, 64, 900, 900, True, D ** -0.5,
                                  dataclasses.replace(plan, qhead="off"), _force_steps=STEP[variant])
    assert torch.equal(out, ref)
    assert torch.equal(lse, ref_lse)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_module_per_query_head_pattern_forward_and_backward(dtype):
    """SparseAttention with a per-query-head pattern whose groups differ: the QH forward and backward
    (no K/V repeat), against the float64 reference by FlashAttention's rule."""
    lengths, HQ, H, D, bs = [640, 200], 8, 2, 64, 128
    nb = 5
    pat = qhead_mask((HQ, nb, nb), seed=11, empty_rows=False).tril()
    attn = SparseAttention(bs, pat)
    layout, per_q = attn.layout_for(HQ, H, "cuda")
    assert per_q
    q, k, v, cu = gpu_inputs(lengths, HQ, H, D, dtype, seed=12)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = attn(*leaves, cu_seqlens=cu, max_seqlen=640)
    assert_qhead_layout_close(out, q, k, v, leaves, cu, cu, layout, 640, 640)
