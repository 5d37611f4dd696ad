"""Stage-2 backward: the plan (CPU), the custom ops on CPU (registration, gradients, torch.compile),
the kernels at the launcher level (every plan variant) and the public autograd wiring on CUDA.

FlashAttention's rule for gradients: the error of dq, dk, dv against the float64 reference's
autograd may be at most 3x that of the same math done by PyTorch in the low precision
(`upcast=False`). Kernel outputs are NaN-poisoned (conftest sets INFLLM_CUPY_POISON=1), so an
element the backward never writes fails. Variants the plan never picks by itself (SM80 tile
shapes, the sm_90a dk/dv instances alone, forced pass counts, plain launches instead of PDL) run at
the launcher level (`stage2_bwd`, `ops.token_bwd`) with a `BwdPlan` built here.
"""
import copy
import dataclasses

import pytest
import torch

from infllm_cupy import _jit
from infllm_cupy.config import InfLLMv2Config
from infllm_cupy.pipeline import InfLLMv2Attention
from infllm_cupy.stage2 import naive as s2
from infllm_cupy.stage2 import ops
from infllm_cupy.stage2 import sparse_bwd as sb
from infllm_cupy.stage2.attention import block_sparse_attn_varlen, sparse_attn_varlen
from infllm_cupy.stage2.cpu import cpu_sparse_attn_varlen
from infllm_cupy.stage2.layout import BlockLayout
from infllm_cupy.stage2.naive import naive_sparse_attn_varlen, naive_sparse_attn_varlen_bwd
from infllm_cupy.stage2.plan import (
    ALL_BWD_TILES,
    DEFAULT_BWD_TILES,
    GATHER_G,
    QT,
    BwdPlan,
    BwdTiles,
    FwdPlan,
    FwdTiles,
    bwd_plan,
    dkdv_block0_parts,
    dkdv_passes,
    n_mask_words,
)
from infllm_cupy.stage2.sparse_bwd import stage2_bwd, tile_index
from infllm_cupy.stage2.sparse_fwd import stage2_fwd, token_block_masks
from infllm_cupy.testing import (
    assert_close_to_ref,
    check_sparse_grads,
    cu_seqlens_from_lengths,
    random_topk_idx,
    rel_l2_err,
    sparse_attn_inputs,
)

from conftest import HOPPER, STAGE2_CASES, STAGE2_IDS

GPU = pytest.mark.gpu
NEEDS_HOPPER = pytest.mark.skipif(not HOPPER, reason="sm_90a kernels need capability 9.0")
DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])


# ================================================================================================
# CPU: the backward plan
# ================================================================================================


def test_bwd_plan():
    """sm_90a on capability 9.0: dq on the ring (SM80 dq past TMA's int32 rows), both dk/dv
    instances where 8 <= G <= 64, TMA where G divides 64, passes by size, block 0 in parts only
    without passes; SM80 elsewhere or when asked."""
    bf16 = torch.bfloat16
    # README shape at 32k: G = 16, D = 128: 8 passes, no parts
    assert bwd_plan((9, 0), 16, 128, bf16, 32768, 32768, 65536) == BwdPlan(
        "sm90a", DEFAULT_BWD_TILES, dq="sm90a", dq_stages=4, dkdv="auto", dkdv_tma=True,
        dkdv_passes=8, block0_parts=1)
    short = bwd_plan((9, 0), 16, 64, bf16, 8192, 8192, 16384)        # one pass: block 0 in 2 parts
    assert (short.dkdv_passes, short.block0_parts, short.dq_stages) == (1, 2, 6)
    g12 = bwd_plan((9, 0), 12, 128, bf16, 1000, 1000, 2000)
    assert (g12.dkdv, g12.dkdv_tma) == ("auto", False)
    g4 = bwd_plan((9, 0), 4, 128, bf16, 1000, 1000, 2000)
    assert (g4.dkdv, g4.dkdv_tma) == ("tiles", True)
    assert bwd_plan((9, 0), 128, 64, bf16, 100, 100, 200).dkdv == "tiles"
    assert bwd_plan((9, 0), 16, 128, bf16, 1000, 1000, 2**31).dq == "sm80"
    assert bwd_plan((9, 0), 16, 128, bf16, 1, 1, 1).dkdv_passes == 1
    sm80 = BwdPlan("sm80", BwdTiles(4, 32), dq="sm80")
    for cap, kernel in (((8, 0), "auto"), ((9, 0), "sm80"), ((8, 6), "sm80"), ((12, 0), "auto")):
        assert bwd_plan(cap, 16, 128, bf16, 1000, 1000, 2000, kernel=kernel) == sm80
    assert bwd_plan((9, 0), 16, 128, bf16, 1000, 1000, 2000, kernel="sm90a").kernel == "sm90a"
    with pytest.raises(ValueError, match=r"kernel='sm90a' needs a device of compute capability 9\.0"):
        bwd_plan((8, 0), 16, 128, bf16, 1000, 1000, 2000, kernel="sm90a")
    for bad in ("sm90a_auto", "sm90a_gather", "4,32", None):
        with pytest.raises(ValueError, match="kernel must be one of"):
            bwd_plan((9, 0), 16, 128, bf16, 1000, 1000, 2000, kernel=bad)


def test_bwd_plan_fields_are_checked():
    with pytest.raises(ValueError, match="dq_warps"):
        BwdTiles(5, 32)
    for bad in (dict(kernel="sm90a_auto"), dict(kernel="sm90a", dq="sm70"), dict(kernel="sm80", dq="sm90a"),
                dict(kernel="sm80", dkdv_passes=2),
                dict(kernel="sm90a", dkdv="both"), dict(kernel="sm90a", dkdv_passes=0),
                dict(kernel="sm90a", dkdv_passes=2, block0_parts=2), dict(kernel="sm90a", block0_parts=33),
                dict(kernel="sm90a", dq_stages=5)):
        with pytest.raises(ValueError, match="BwdPlan"):
            BwdPlan(**bad)


def test_block0_parts_and_passes_policy():
    # about 1024 query tiles of 64 rows per part of block 0, at most 32
    assert [dkdv_block0_parts(n, 16) for n in (1, 4096, 4097, 32768, 131072, 10**6)] == [1, 1, 2, 8, 32, 32]
    assert dkdv_block0_parts(1500, 8, part_tiles=8) == 24
    # one pass per 32 MB of a sequence's Q and dO per KV head, at most 8, at most one per token
    assert [dkdv_passes(n, 16, 128, 2) for n in (1, 3, 4096, 8192, 32768, 131072)] == [1, 1, 1, 2, 8, 8]


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


def test_backward_parameter_structs_are_checked_in_their_sources():
    """Every backward kernel takes one parameter struct, declared in the launcher: each declaration's
    static_asserts (and the constants the launcher shares with the kernels) go into its source's
    compile (tests/test_jit.py compiles them), and a field missing from a launch is refused by name."""
    decls = (sb.DELTA_PARAMS, sb.TILES_PARAMS, sb.DQ_PARAMS, sb.DKDV_PARAMS, sb.DKDV_SM90_PARAMS,
             sb.DKDV_PARTS_PARAMS, sb.DQ_RING_PARAMS)
    for decl in decls:
        assert decl.checks() in _jit._code(decl.source), decl.c_type
    assert {d.source for d in decls} == {sb.BWD_SOURCE, sb.SM90_SOURCE, sb.RING_SOURCE}
    for source in (sb.BWD_SOURCE, sb.SM90_SOURCE):
        assert f"static_assert((QT) == {QT}" in _jit._code(source)
    assert "static_assert((NC) == 2" in _jit._code(sb.RING_SOURCE)
    fields = {n: None if sb.DKDV_PARTS_PARAMS.kinds[n] == "ptr" else 1 for n in sb.DKDV_PARTS_PARAMS.names}
    del fields["split0"]
    with pytest.raises(TypeError, match=r"missing fields \['split0'\]"):
        sb.DKDV_PARTS_PARAMS.pack(**fields)


# ================================================================================================
# CPU: the custom ops (ops.py) on the reference: registration (opcheck), gradients (gradcheck and
# against the reference's autograd), torch.compile without graph breaks, the pipeline module's
# backward. CPU tensors run the reference inside the same ops as the kernels.
# ================================================================================================

# ragged, one-token sequences, lengths across 64-key block edges, G = 2
LQ = [70, 1, 131]
OP_HQ, OP_H, OP_D = 4, 2, 8      # heads, KV heads and head dim of the CPU op tests


def make_cpu(lq, lk=None, dtype=torch.float64, K=4, seed=0, grad=True, **sel):
    lk = lq if lk is None else lk
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lq), OP_HQ, OP_D, generator=g, dtype=dtype)
    k = torch.randn(sum(lk), OP_H, OP_D, generator=g, dtype=dtype)
    v = torch.randn(sum(lk), OP_H, OP_D, generator=g, dtype=dtype)
    if grad:
        q, k, v = (t.requires_grad_() for t in (q, k, v))
    idx = random_topk_idx(OP_H, lq, lk, K, generator=g, **sel)      # -1, duplicates, out-of-range, future
    return q, k, v, cu_seqlens_from_lengths(lq), cu_seqlens_from_lengths(lk), idx


def make_layout(batch, nqb, nkb, q_block=64, per_sequence=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (batch, OP_H, nqb, nkb) if per_sequence else (OP_H, nqb, nkb)
    return BlockLayout(torch.rand(shape, generator=g) < 0.5, q_block)


# -------------------------------------------------------------------------------------- registration


def test_opcheck_token_level():
    q, k, v, cu, _, idx = make_cpu(LQ, dtype=torch.float32, empty_rows=True)
    args = (q, k, v, cu, cu, idx, 131, 131, True, 0.3, "auto")
    torch.library.opcheck(ops.sparse_attn_fwd, args)
    out, lse = ops.sparse_attn_fwd(*(a.detach() if isinstance(a, torch.Tensor) else a for a in args))
    dout = torch.randn_like(out)
    torch.library.opcheck(ops.sparse_attn_bwd,
                          (dout, q.detach(), k.detach(), v.detach(), out, lse, cu, cu, idx,
                                                131, 131, True, 0.3, "auto"))


def test_opcheck_block_layout():
    q, k, v, cu, _, _ = make_cpu(LQ, dtype=torch.float64)
    layout = make_layout(len(LQ), 3, 3)
    args = (q, k, v, cu, cu, layout.mask, 64, 131, 131, True, 0.3, "sm80")
    torch.library.opcheck(ops.block_sparse_attn_fwd, args)
    out, lse = ops.block_sparse_attn_fwd(*(a.detach() if isinstance(a, torch.Tensor) else a for a in args))
    dout = torch.randn_like(out)
    torch.library.opcheck(ops.block_sparse_attn_bwd,
                          (dout, q.detach(), k.detach(), v.detach(), out, lse, cu, cu,
                                                      layout.mask, 64, 131, 131, True, 0.3, "sm80"))


def test_kernel_argument():
    """`kernel` is the ops' only kernel choice ("auto", "sm80", "sm90a"), checked before the op on
    CPU tensors too, and named in the error; the schemas carry it as a plain string, no test variant."""
    q, k, v, cu, _, idx = make_cpu(LQ)
    layout = make_layout(len(LQ), 3, 3)
    for bad in ("fast", "sm90a_pair", "4,2,64", None, ""):
        with pytest.raises(ValueError, match="kernel must be one of"):
            sparse_attn_varlen(q, k, v, cu, cu, idx, 131, 131, kernel=bad)
        with pytest.raises(ValueError, match="kernel must be one of"):
            block_sparse_attn_varlen(q, k, v, cu, cu, layout, 131, 131, kernel=bad)
    with pytest.raises(TypeError):
        sparse_attn_varlen(q, k, v, cu, cu, idx, 131, 131, True, None, False, "auto", "sm80")   # keyword-only
    with pytest.raises(TypeError):
        sparse_attn_varlen(q, k, v, cu, cu, idx, 131, 131, tiles="sm90a")                        # no tiles=
    for name in ("sparse_attn_fwd", "sparse_attn_bwd", "block_sparse_attn_fwd", "block_sparse_attn_bwd"):
        schema = str(getattr(torch.ops.infllm_cupy, name).default._schema)
        assert schema.count("str kernel") == 1 and "tiles" not in schema, schema
    for kernel in ("auto", "sm80", "sm90a"):               # CPU tensors: the CPU implementation, any kernel
        assert torch.equal(sparse_attn_varlen(q, k, v, cu, cu, idx, 131, 131, kernel=kernel),
                           cpu_sparse_attn_varlen(q, k, v, cu, cu, idx, 131, 131))


@pytest.mark.parametrize("kernel", ["auto", "sm80", "sm90a"])
def test_backward_op_gets_the_kernel_argument(kernel, monkeypatch):
    """The autograd formula hands the forward's `kernel` to the backward op (so `kernel="sm80"`
    forces the SM80 backward on an H100 as well)."""
    seen = []
    real = ops.sparse_attn_bwd

    def spy(*args):
        seen.append(args[-1])
        return real(*args)

    monkeypatch.setattr(ops, "sparse_attn_bwd", spy)
    q, k, v, cu, _, idx = make_cpu(LQ)
    torch.autograd.grad(sparse_attn_varlen(q, k, v, cu, cu, idx, 131, 131, kernel=kernel).sum(), (q, k, v))
    assert seen == [kernel]
    real_block = ops.block_sparse_attn_bwd
    seen.clear()
    monkeypatch.setattr(ops, "block_sparse_attn_bwd", lambda *a: (seen.append(a[-1]), real_block(*a))[1])
    layout = make_layout(len(LQ), 3, 3)
    torch.autograd.grad(block_sparse_attn_varlen(q, k, v, cu, cu, layout, 131, 131, kernel=kernel).sum(),
                        (q, k, v))
    assert seen == [kernel]


# ------------------------------------------------------------------------------------------ gradients


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_gradcheck_token_level(causal):
    # queries shorter than keys (bottom-right causal), rows with no usable index
    q, k, v, cuq, cuk, idx = make_cpu([70, 1, 100], [150, 1, 100], empty_rows=True)

    def f(q, k, v):
        return sparse_attn_varlen(q, k, v, cuq, cuk, idx, 100, 150, causal=causal)

    assert torch.autograd.gradcheck(f, (q, k, v), fast_mode=True)


@pytest.mark.parametrize("q_block", [64, 128])
def test_gradcheck_block_layout(q_block):
    q, k, v, cu, _, _ = make_cpu(LQ)
    layout = make_layout(len(LQ), -(-131 // q_block), 3, q_block)

    def f(q, k, v):
        return block_sparse_attn_varlen(q, k, v, cu, cu, layout, 131, 131)

    assert torch.autograd.gradcheck(f, (q, k, v), fast_mode=True)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_op_grads_equal_reference_autograd(causal, monkeypatch):
    # 16-row query chunks, so that dk and dv accumulate over several chunks of the reference backward
    monkeypatch.setattr(s2, "_CHUNK_ELEMS", 1)
    q, k, v, cuq, cuk, idx = make_cpu([70, 1, 131, 5], [90, 1, 131, 64], empty_rows=True)
    out, lse = sparse_attn_varlen(q, k, v, cuq, cuk, idx, 131, 131, causal=causal, return_lse=True)
    ref = naive_sparse_attn_varlen(q, k, v, cuq, cuk, idx, 131, 131, causal=causal)
    # float64: the CPU implementation's forward equals the reference's up to rounding; the backward is
    # the reference's written out
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), do)
    want = torch.autograd.grad(ref, (q, k, v), do)
    for g, w in zip(grads, want):
        torch.testing.assert_close(g, w, atol=1e-12, rtol=1e-10)
    # exact zeros: rows with no allowed key get dq = 0; keys nobody attends get dk = dv = 0
    empty = torch.isinf(lse).T
    assert empty.any() and bool((grads[0][empty] == 0).all())
    unused = (want[2] == 0).all(-1)
    assert unused.any() and bool((grads[1][unused] == 0).all()) and bool((grads[2][unused] == 0).all())


def test_reference_bwd_in_low_precision_and_checks():
    # the written-out backward in bf16 computes in fp32, like the upcast reference's autograd
    q, k, v, cu, _, idx = make_cpu(LQ, dtype=torch.bfloat16)
    do = torch.randn(q.shape, dtype=torch.bfloat16)
    grads = naive_sparse_attn_varlen_bwd(do, q, k, v, cu, cu, idx, 131, 131)
    want = torch.autograd.grad(naive_sparse_attn_varlen(q, k, v, cu, cu, idx, 131, 131), (q, k, v), do)
    for g, w in zip(grads, want):
        assert g.dtype == torch.bfloat16
        torch.testing.assert_close(g, w, atol=2e-2, rtol=2e-2)
    with pytest.raises(ValueError, match="dout must have shape"):
        naive_sparse_attn_varlen_bwd(do[:-1], q, k, v, cu, cu, idx, 131, 131)


def test_lse_has_no_gradient_and_selection_gets_none():
    q, k, v, cu, _, idx = make_cpu(LQ)
    out, lse = sparse_attn_varlen(q, k, v, cu, cu, idx, 131, 131, return_lse=True)
    assert out.requires_grad and not lse.requires_grad
    # lse does not contribute: the gradient of out.sum() + lse.sum() is that of out.sum()
    a = torch.autograd.grad(out.sum() + lse.sum(), (q, k, v), retain_graph=True)
    b = torch.autograd.grad(out.sum(), (q, k, v))
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    layout = make_layout(len(LQ), 3, 3)
    out, lse = block_sparse_attn_varlen(q, k, v, cu, cu, layout, 131, 131, return_lse=True)
    assert out.requires_grad and not lse.requires_grad and not layout.mask.requires_grad
    with torch.no_grad():
        assert not sparse_attn_varlen(q, k, v, cu, cu, idx, 131, 131).requires_grad


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_cpu_auto_is_the_cpu_implementation_and_reference_the_oracle(dtype):
    """CPU tensors under "auto" run the CPU implementation (stage2/cpu.py) inside the op, within
    FlashAttention's rule of the oracle; backend="reference" is the oracle itself."""
    q, k, v, cu, _, idx = make_cpu(LQ, dtype=dtype, grad=False)
    out, lse = sparse_attn_varlen(q, k, v, cu, cu, idx, 131, 131, return_lse=True)
    want, want_lse = cpu_sparse_attn_varlen(q, k, v, cu, cu, idx, 131, 131, return_lse=True)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    ref, ref_lse = naive_sparse_attn_varlen(q, k, v, cu, cu, idx, 131, 131, return_lse=True)
    assert torch.equal(sparse_attn_varlen(q, k, v, cu, cu, idx, 131, 131, backend="reference"), ref)
    exact = naive_sparse_attn_varlen(*(t.double() for t in (q, k, v)), cu, cu, idx, 131, 131)
    lowp = naive_sparse_attn_varlen(q, k, v, cu, cu, idx, 131, 131, upcast=False)
    assert_close_to_ref("out", out, exact, lowp)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
    with pytest.raises((ValueError, TypeError), match=r"CUDA tensor|q must have dtype"):
        sparse_attn_varlen(q, k, v, cu, cu, idx, 131, 131, backend="kernels")
    with pytest.raises(ValueError, match="cu_seqlens_q must"):       # value checks run in eager mode
        sparse_attn_varlen(q, k, v, cu.flip(0), cu, idx, 131, 131)


# ------------------------------------------------------------------------------------------ compile


class TinyOpAttention(torch.nn.Module):
    """q/k/v projections, stage-2 attention, output projection; selection and lengths are inputs."""

    def __init__(self, E=16, layout_form=False, q_block=64):
        super().__init__()
        self.qkv = torch.nn.Linear(E, (OP_HQ + 2 * OP_H) * OP_D)
        self.o = torch.nn.Linear(OP_HQ * OP_D, E)
        self.layout_form, self.q_block = layout_form, q_block

    def forward(self, x, cu, sel, max_seqlen: int):
        T = x.shape[0]
        q, k, v = self.qkv(x).split([OP_HQ * OP_D, OP_H * OP_D, OP_H * OP_D], dim=-1)
        q, k, v = q.reshape(T, OP_HQ, OP_D), k.reshape(T, OP_H, OP_D), v.reshape(T, OP_H, OP_D)
        if self.layout_form:
            o, lse = block_sparse_attn_varlen(q, k, v, cu, cu, BlockLayout(sel, self.q_block), max_seqlen,
                                              max_seqlen, return_lse=True)
        else:
            o, lse = sparse_attn_varlen(q, k, v, cu, cu, sel, max_seqlen, max_seqlen, return_lse=True)
        return self.o(o.reshape(T, OP_HQ * OP_D)), lse


def _compile_matches_eager(model, batches):
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")     # fullgraph: no graph break
    for x, cu, sel, L in batches:
        outs = []
        for m in (compiled, model):
            y, lse = m(x, cu, sel, L)
            assert not lse.requires_grad
            model.zero_grad()
            (y.square().sum()).backward()
            outs.append((y, lse, [p.grad.clone() for p in model.parameters()]))
        (y1, lse1, g1), (y2, lse2, g2) = outs
        torch.testing.assert_close(y1, y2, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(lse1, lse2, atol=1e-6, rtol=1e-6)
        for a, b in zip(g1, g2):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_compile_token_level_matches_eager():
    g = torch.Generator().manual_seed(1)
    model = TinyOpAttention()
    batches = []
    for lens in ([70, 1, 131], [100, 64]):          # the second batch recompiles with dynamic shapes
        batches.append((torch.randn(sum(lens), 16, generator=g), cu_seqlens_from_lengths(lens),
                        random_topk_idx(OP_H, lens, lens, 3, generator=g), max(lens)))
    _compile_matches_eager(model, batches)


def test_compile_block_layout_matches_eager():
    model = TinyOpAttention(layout_form=True)
    lens = [70, 1, 131]
    x = torch.randn(sum(lens), 16)
    batches = [(x, cu_seqlens_from_lengths(lens), make_layout(3, 3, 3).mask, 131),
               (x, cu_seqlens_from_lengths(lens), make_layout(3, 3, 3, per_sequence=False, seed=1).mask, 131)]
    _compile_matches_eager(model, batches)


def test_pipeline_module_backward_on_cpu():
    lengths = [300, 130]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(sum(lengths), h, 16, generator=g).requires_grad_() for h in (4, 2, 2))
    cu = cu_seqlens_from_lengths(lengths)
    cfg = InfLLMv2Config(topk=2, local_blocks=1, dense_len=0, kernel_size=16, kernel_stride=8, block_size=32)
    out = InfLLMv2Attention(cfg)(q, k, v, cu)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    for x, gr in zip((q, k, v), grads):
        assert gr.shape == x.shape and bool(torch.isfinite(gr).all()) and gr.abs().sum() > 0


# ================================================================================================
# GPU: the kernels at the launcher level (stage2_bwd), every plan variant on every case
# ================================================================================================
# sm_90a variants: (dk/dv instance, dq ring step forced through `_force_dq_steps`, None: each CTA's
# choice). "sm90a": fixed tiles, dq on one shared K/V ring;
# "sm90a_gather": gathered tokens; "sm90a_auto": both, split per key block by tile fill (the plan's
# default); "sm90a_split": fixed tiles, dq on a ring per warpgroup. Where G is outside 8..64 the
# gathering instances cannot run and the variant falls back to fixed tiles, as the plan does.
SM90_VARIANTS = {"sm90a": ("tiles", "single"), "sm90a_gather": ("gather", None),
                 "sm90a_auto": ("auto", None), "sm90a_split": ("tiles", "split")}
def test_forced_dq_steps_are_checked():
    """The dq's step shape is each CTA's choice; the test hook forces only the shapes the dq has."""
    assert sb._dq_step_mode(None) == sb.DQ_STEPS_AUTO
    assert sb._dq_step_mode("split") == sb.FORCED_DQ_STEPS["split"]
    for bad in ("pair", "auto", 1):
        with pytest.raises(ValueError, match="_force_dq_steps forces one of"):
            sb._dq_step_mode(bad)


SM90 = pytest.param("sm90a", marks=NEEDS_HOPPER)
SM90_GATHER = pytest.param("sm90a_gather", marks=NEEDS_HOPPER)
SM90_AUTO = pytest.param("sm90a_auto", marks=NEEDS_HOPPER)
SM90_SPLIT = pytest.param("sm90a_split", marks=NEEDS_HOPPER)
KERNELS = [SM90, SM90_GATHER, SM90_AUTO, SM90_SPLIT, DEFAULT_BWD_TILES]
CASES, IDS = STAGE2_CASES, STAGE2_IDS


def kernels_id(t):
    return t if isinstance(t, str) else f"dq{t.dq_warps}_cols{t.dkdv_cols}"


def bwd_plan_of(variant, q, k, mq, mk, **fields) -> tuple[BwdPlan, dict]:
    """The backward plan of a test variant (a BwdTiles: the SM80 kernels with that shape; else a key
    of SM90_VARIANTS), with `fields` replaced, and the keywords `stage2_bwd` takes with it."""
    if isinstance(variant, BwdTiles):
        return dataclasses.replace(BwdPlan("sm80", variant, dq="sm80"), **fields), {}
    dkdv, dq_step = SM90_VARIANTS[variant]
    if not GATHER_G[0] <= q.shape[1] // k.shape[1] <= GATHER_G[1]:
        dkdv = "tiles"
    plan = dataclasses.replace(ops.bwd_plan_for(q, k, mq, mk, kernel="sm90a"), dkdv=dkdv, **fields)
    return plan, {"_force_dq_steps": dq_step}


def run_kernels(q, k, v, do, cu_q, cu_k, masks, base, h_stride, q_block, mq, mk, causal, variant, **fields):
    """dq, dk, dv of the SM80 forward's out and lse, by the backward launcher under `variant`'s plan."""
    scale = q.shape[-1] ** -0.5
    out, lse = stage2_fwd(q, k, v, cu_q, cu_k, masks, base, h_stride, q_block, mq, causal, scale,
                          FwdPlan("sm80"))
    plan, hooks = bwd_plan_of(variant, q, k, mq, mk, **fields)
    return stage2_bwd(do, q, k, v, out, lse, cu_q, cu_k, masks, base, h_stride, q_block, mq, mk, causal,
                      scale, plan, **hooks)


def token_masks(idx, cu_q, cu_k, mk):
    return token_block_masks(idx, cu_q, cu_k, n_mask_words(mk))


@GPU
@pytest.mark.parametrize("tiles", KERNELS, ids=kernels_id)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_token_level_grads_every_plan(case, dtype, tiles):
    lq, lk, HQ, H, D = case
    q, k, v, do, cu_q, cu_k, idx = sparse_attn_inputs(lq, lk, HQ, H, D, dtype, empty_rows=True)
    mq, mk = max(lq), max(lk)
    masks = token_masks(idx, cu_q, cu_k, mk)
    grads = run_kernels(q, k, v, do, cu_q, cu_k, masks, cu_q, q.shape[0], 1, mq, mk, True, tiles)
    check_sparse_grads(grads, q, k, v, do, cu_q, cu_k, idx, mq, mk, True)


@GPU
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


@GPU
@pytest.mark.parametrize("tiles", [SM90, *ALL_BWD_TILES], ids=kernels_id)
def test_every_tile_shape(tiles):
    lq, HQ, H, D = [700, 129], 16, 2, 128
    q, k, v, do, cu_q, cu_k, idx = sparse_attn_inputs(lq, lq, HQ, H, D, torch.bfloat16, K=8)
    masks = token_masks(idx, cu_q, cu_k, 700)
    grads = run_kernels(q, k, v, do, cu_q, cu_k, masks, cu_q, q.shape[0], 1, 700, 700, True, tiles)
    check_sparse_grads(grads, q, k, v, do, cu_q, cu_k, idx, 700, 700, True)


@GPU
@pytest.mark.parametrize("tiles", KERNELS, ids=kernels_id)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_non_causal_and_short_queries(dtype, tiles):
    lq, lk = [1, 5, 90], [300, 64, 1000]
    q, k, v, do, cu_q, cu_k, idx = sparse_attn_inputs(lq, lk, 16, 2, 128, dtype)
    masks = token_masks(idx, cu_q, cu_k, 1000)
    for causal in (False, True):
        grads = run_kernels(q, k, v, do, cu_q, cu_k, masks, cu_q, q.shape[0], 1, 90, 1000, causal, tiles)
        check_sparse_grads(grads, q, k, v, do, cu_q, cu_k, idx, 90, 1000, causal)


@GPU
@pytest.mark.parametrize("tiles", KERNELS, ids=kernels_id)
@pytest.mark.parametrize("q_block", [64, 128])
@pytest.mark.parametrize("per_sequence", [False, True])
def test_block_layout_grads_every_plan(q_block, per_sequence, tiles):
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


@GPU
@pytest.mark.parametrize("tiles", KERNELS, ids=kernels_id)
def test_bit_identical_across_runs_every_plan(tiles):
    lq, HQ, H, D = [1500, 333], 16, 2, 128
    q, k, v, do, cu_q, cu_k, idx = sparse_attn_inputs(lq, lq, HQ, H, D, torch.bfloat16, K=16)
    masks = token_masks(idx, cu_q, cu_k, 1500)
    a = run_kernels(q, k, v, do, cu_q, cu_k, masks, cu_q, q.shape[0], 1, 1500, 1500, True, tiles)
    b = run_kernels(q, k, v, do, cu_q, cu_k, masks, cu_q, q.shape[0], 1, 1500, 1500, True, tiles)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@GPU
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


@GPU
@pytest.mark.parametrize("tiles", [SM90, SM90_GATHER, SM90_AUTO], ids=kernels_id)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_block0_split_over_parts(tiles, dtype):
    """Block 0 (every token selects it) is shared by several dk/dv CTAs whose fp32 sums a second
    kernel adds. Small parts force the split at test sizes: 24 parts here, so the one-token
    sequence leaves 23 of its parts empty (they must still store zeros) and the ragged lengths
    cut the runs anywhere. Results must match the reference and be the same bits twice."""
    lq, HQ, H, D = [1500, 1, 333], 16, 2, 128
    parts = dkdv_block0_parts(1500, HQ // H, part_tiles=8)
    assert parts == 24
    q, k, v, do, cu_q, cu_k, idx = sparse_attn_inputs(lq, lq, HQ, H, D, dtype, K=16, empty_rows=True)
    masks = token_masks(idx, cu_q, cu_k, 1500)
    fields = {"block0_parts": parts, "dkdv_passes": 1}
    a = run_kernels(q, k, v, do, cu_q, cu_k, masks, cu_q, q.shape[0], 1, 1500, 1500, True, tiles, **fields)
    check_sparse_grads(a, q, k, v, do, cu_q, cu_k, idx, 1500, 1500, True)
    b = run_kernels(q, k, v, do, cu_q, cu_k, masks, cu_q, q.shape[0], 1, 1500, 1500, True, tiles, **fields)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


# ================================================================================================
# GPU: the public ops' gradients (custom ops -> forward and backward kernels), torch.compile, training
# ================================================================================================
# (lengths_q, lengths_k, HQ, H, D): ragged batches with lengths that are not multiples of 64,
# one-token sequences, G in {1, 2, 4, 8, 12, 16, 32}, D in {64, 128}, queries shorter than keys
OP_CASES = [
    ([1, 63, 130, 257, 700], [1, 63, 130, 257, 700], 16, 1, 128),     # G = 16
    ([1, 63, 130, 257, 700], [1, 63, 130, 257, 700], 2, 2, 64),       # G = 1
    ([700, 130, 1], [700, 130, 1], 4, 2, 128),                        # G = 2
    ([513, 1, 65], [513, 1, 65], 16, 4, 64),                          # G = 4
    ([257, 1, 300], [257, 1, 300], 16, 2, 64),                        # G = 8
    ([333, 17], [333, 17], 24, 2, 128),                               # G = 12
    ([1000, 1], [1000, 1], 32, 1, 128),                               # G = 32
    ([100, 37, 5, 1], [700, 37, 64, 130], 16, 2, 64),                 # chunked prefill (Lq < Lk), G = 8
]
OP_IDS = [f"Lq{'-'.join(map(str, c[0]))}_Lk{'-'.join(map(str, c[1]))}_HQ{c[2]}_H{c[3]}_D{c[4]}"
          for c in OP_CASES]


def op_grads(fn, q, k, v, do, *args, **kw):
    """(out, lse, (dq, dk, dv)) of `fn(q, k, v, *args, return_lse=True, **kw)` through autograd."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse = fn(*leaves, *args, return_lse=True, **kw)
    assert out.requires_grad and not lse.requires_grad
    return out.detach(), lse, torch.autograd.grad(out, leaves, do)


def check(out, grads, q, k, v, do, cu_q, cu_k, idx, mq, mk, causal):
    return check_sparse_grads(grads, q, k, v, do, cu_q, cu_k, idx, mq, mk, causal, out=out)


def launcher_grads(q, k, v, do, cu_q, cu_k, idx, mq, mk, causal=True, pdl=True, **bwd_fields):
    """(out, (dq, dk, dv)): the default forward plan, then the token-level backward launcher
    (`ops.token_bwd`) under the default backward plan with `bwd_fields` replaced; `pdl=False`: the
    dk/dv passes launched one after the other (the launcher's `_pdl` hook)."""
    scale = q.shape[-1] ** -0.5
    out, lse = ops.token_fwd(q, k, v, cu_q, cu_k, idx, mq, mk, causal, scale,
                             ops.fwd_plan_for(q, k, mk, 2 * idx.shape[2]))
    plan = dataclasses.replace(ops.bwd_plan_for(q, k, mq, mk), **bwd_fields)
    return out, ops.token_bwd(do, q, k, v, out, lse, cu_q, cu_k, idx, mq, mk, causal, scale, plan, _pdl=pdl)


# ------------------------------------------------------------------------------------- token level


@GPU
@DTYPES
@pytest.mark.parametrize("case", OP_CASES, ids=OP_IDS)
def test_token_level_grads(case, dtype):
    lq, lk, HQ, H, D = case
    q, k, v, do, cu_q, cu_k, idx = sparse_attn_inputs(lq, lk, HQ, H, D, dtype, empty_rows=True)
    mq, mk = max(lq), max(lk)
    out, _, grads = op_grads(sparse_attn_varlen, q, k, v, do, cu_q, cu_k, idx, mq, mk, backend="kernels")
    empty_rows, unused = check(out, grads, q, k, v, do, cu_q, cu_k, idx, mq, mk, True)
    assert empty_rows.any() and unused.any(), "the case must exercise both exact-zero rules"


@GPU
@DTYPES
def test_non_causal_grads(dtype):
    lq, lk = [1, 5, 90, 63], [300, 64, 1000, 63]          # decode-like rows against long caches
    q, k, v, do, cu_q, cu_k, idx = sparse_attn_inputs(lq, lk, 16, 2, 128, dtype)
    out, _, grads = op_grads(sparse_attn_varlen, q, k, v, do, cu_q, cu_k, idx, 90, 1000, causal=False,
                             backend="kernels")
    check(out, grads, q, k, v, do, cu_q, cu_k, idx, 90, 1000, False)


TILES = [None, FwdTiles(8, 1, 64), FwdTiles(4, 2, 32),
         pytest.param("sm90a",
                      marks=pytest.mark.skipif(not HOPPER, reason="sm_90a kernel needs capability 9.0"))]


@GPU
@pytest.mark.parametrize("tiles", TILES,
                         ids=lambda t: "default" if t is None else str(t) if isinstance(t, str)
                         else f"w{t.warps}m{t.m_tiles}k{t.sub_keys}")
def test_backward_after_every_forward_kernel(tiles):
    # the backward reads the forward's out and lse, whichever forward kernel wrote them: the public
    # op (default, kernel="sm90a") or the forward launcher under an SM80 plan of that tile shape
    lq = [700, 129, 1]
    q, k, v, do, cu_q, cu_k, idx = sparse_attn_inputs(lq, lq, 16, 2, 128, torch.bfloat16, empty_rows=True)
    if not isinstance(tiles, FwdTiles):
        out, _, grads = op_grads(sparse_attn_varlen, q, k, v, do, cu_q, cu_k, idx, 700, 700,
                                 backend="kernels", kernel=tiles or "auto")
    else:
        scale = 128 ** -0.5
        out, lse = ops.token_fwd(q, k, v, cu_q, cu_k, idx, 700, 700, True, scale, FwdPlan("sm80", tiles))
        grads = ops.token_bwd(do, q, k, v, out, lse, cu_q, cu_k, idx, 700, 700, True, scale,
                              ops.bwd_plan_for(q, k, 700, 700))
    check(out, grads, q, k, v, do, cu_q, cu_k, idx, 700, 700, True)


@GPU
@pytest.mark.parametrize("kernel", ["sm80", pytest.param("sm90a", marks=NEEDS_HOPPER)])
def test_kernel_argument_reaches_the_backward(kernel, monkeypatch):
    """`kernel=` picks the backward's kernels too: "sm80" runs the mma.sync dq and dk/dv (on an
    H100 as well), "sm90a" the ring dq and the sm_90a dk/dv; the gradients pass either way."""
    names = []
    real = sb.launch
    monkeypatch.setattr(sb, "launch", lambda *a, **kw: (names.append(kw["name"]), real(*a, **kw))[1])
    lq = [700, 129, 1]
    q, k, v, do, cu_q, cu_k, idx = sparse_attn_inputs(lq, lq, 16, 2, 128, torch.bfloat16, empty_rows=True)
    out, _, grads = op_grads(sparse_attn_varlen, q, k, v, do, cu_q, cu_k, idx, 700, 700, backend="kernels",
                             kernel=kernel)
    check(out, grads, q, k, v, do, cu_q, cu_k, idx, 700, 700, True)
    sm90 = [n for n in names if "_sm90<" in n]
    assert (len(sm90) > 0) == (kernel == "sm90a"), names
    assert any(n.startswith("stage2_bwd_dq") for n in names) and any("dkdv" in n for n in names), names


@GPU
def test_junk_indices_give_the_clean_gradients():
    lq = [300, 129]
    q, k, v, do, cu_q, cu_k, _ = sparse_attn_inputs(lq, lq, 16, 1, 64, torch.bfloat16)
    clean = random_topk_idx(1, lq, lq, 5, junk=False).cuda()
    junk = torch.cat([clean, clean.flip(-1), torch.full_like(clean, -1), clean + 1000, -clean - 2,
                      torch.full_like(clean, 5 + 7)], dim=-1)
    _, _, a = op_grads(sparse_attn_varlen, q, k, v, do, cu_q, cu_k, clean, 300, 300)
    _, _, b = op_grads(sparse_attn_varlen, q, k, v, do, cu_q, cu_k, junk, 300, 300)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@GPU
def test_bit_identical_across_runs():
    lq = [1500, 333, 1]
    q, k, v, do, cu_q, cu_k, idx = sparse_attn_inputs(lq, lq, 16, 2, 128, torch.bfloat16, K=16)
    _, _, a = op_grads(sparse_attn_varlen, q, k, v, do, cu_q, cu_k, idx, 1500, 1500)
    _, _, b = op_grads(sparse_attn_varlen, q, k, v, do, cu_q, cu_k, idx, 1500, 1500)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@GPU
@pytest.mark.skipif(not HOPPER, reason="the query-range passes are the sm_90a dk/dv's")
@pytest.mark.parametrize("passes", [3, 8])
@DTYPES
@pytest.mark.parametrize("case", OP_CASES, ids=OP_IDS)
def test_query_range_passes(case, dtype, passes):
    """The sm_90a dk/dv in query-range passes (forced by the plan; real sizes take them from 8k
    tokens on): fp32 sums carried through the passes, the last one writing dk, dv; key blocks with
    tiles in some passes only, passes a block has no tile in, keys no query picked (exact zeros),
    both instances of dkdv="auto", and ranges that cut a sequence's tiles unevenly. Twice, bit for bit."""
    empty_rows, unused = check_twice(case, dtype, dkdv_passes=passes, block0_parts=1)
    assert empty_rows.any() and unused.any()


def check_twice(case, dtype, **bwd_fields):
    """The kernels' gradients of `case` (with empty rows; backward plan fields `bwd_fields`) against
    the reference, then a second run bit for bit; returns the check's (empty_rows, unused)."""
    lq, lk, HQ, H, D = case
    q, k, v, do, cu_q, cu_k, idx = sparse_attn_inputs(lq, lk, HQ, H, D, dtype, empty_rows=True)
    mq, mk = max(lq), max(lk)
    out, grads = launcher_grads(q, k, v, do, cu_q, cu_k, idx, mq, mk, **bwd_fields)
    found = check(out, grads, q, k, v, do, cu_q, cu_k, idx, mq, mk, True)
    _, again = launcher_grads(q, k, v, do, cu_q, cu_k, idx, mq, mk, **bwd_fields)
    for x, y in zip(grads, again):
        assert torch.equal(x, y)
    return found


@GPU
@pytest.mark.skipif(not HOPPER, reason="programmatic dependent launch of the sm_90a dk/dv passes")
@pytest.mark.parametrize("passes", [2, 8])
@pytest.mark.parametrize("case", OP_CASES, ids=OP_IDS)
def test_query_range_passes_as_programmatic_dependents(case, passes):
    """PDL (the launcher's default): passes after the first start while the one before drains and
    order their dk32 / dv32 sums with griddepcontrol: the same bits as passes launched one after the
    other (the `_pdl=False` hook; twice, so a race would have two chances to show)."""
    lq, lk, HQ, H, D = case
    q, k, v, do, cu_q, cu_k, idx = sparse_attn_inputs(lq, lk, HQ, H, D, torch.bfloat16, empty_rows=True)
    mq, mk = max(lq), max(lk)
    fields = {"dkdv_passes": passes, "block0_parts": 1}
    _, plain = launcher_grads(q, k, v, do, cu_q, cu_k, idx, mq, mk, pdl=False, **fields)
    for _ in range(2):
        out, grads = launcher_grads(q, k, v, do, cu_q, cu_k, idx, mq, mk, pdl=True, **fields)
        for x, y in zip(plain, grads):
            assert torch.equal(x, y)
    check(out, grads, q, k, v, do, cu_q, cu_k, idx, mq, mk, True)


@GPU
@pytest.mark.skipif(not HOPPER, reason="the query-range passes are the sm_90a dk/dv's")
@pytest.mark.parametrize("pdl", ["0", "1"])
def test_query_range_pass_with_no_tile(pdl):
    """A pass in which no query selects anything (every CTA of it leaves at once): the next pass
    must still add its sums after the pass before, with plain and with programmatic launches."""
    fields = {"dkdv_passes": 4, "block0_parts": 1, "pdl": pdl == "1"}
    lq = [700, 130, 1]
    q, k, v, do, cu_q, cu_k, idx = sparse_attn_inputs(lq, lq, 16, 1, 128, torch.bfloat16)
    chunk = -(-700 // 4)
    for s0, n in zip(cu_q[:-1].tolist(), lq):
        idx[:, s0 + chunk:s0 + min(n, 2 * chunk)] = -1      # pass 1's tokens select nothing
    out, grads = launcher_grads(q, k, v, do, cu_q, cu_k, idx, 700, 700, **fields)
    check(out, grads, q, k, v, do, cu_q, cu_k, idx, 700, 700, True)
    _, again = launcher_grads(q, k, v, do, cu_q, cu_k, idx, 700, 700, **fields)
    for x, y in zip(grads, again):
        assert torch.equal(x, y)


@GPU
def test_grad_of_one_input_only():
    # only one of q, k, v requires grad (e.g. frozen K/V): its gradient is the one of the full run
    lq = [400, 65]
    q, k, v, do, cu_q, cu_k, idx = sparse_attn_inputs(lq, lq, 8, 2, 64, torch.bfloat16)
    _, _, full = op_grads(sparse_attn_varlen, q, k, v, do, cu_q, cu_k, idx, 400, 400)
    for i in range(3):
        inputs = [q, k, v]
        inputs[i] = inputs[i].clone().requires_grad_()
        (g,) = torch.autograd.grad(sparse_attn_varlen(*inputs, cu_q, cu_k, idx, 400, 400), (inputs[i],), do)
        assert torch.equal(g, full[i])


# ----------------------------------------------------------------------------------- block layouts


@GPU
@pytest.mark.parametrize("q_block", [64, 128])
@pytest.mark.parametrize("per_sequence", [False, True], ids=["shared", "per_sequence"])
@DTYPES
def test_block_layout_grads(q_block, per_sequence, dtype):
    lq = [1000, 300, 1, 130]
    HQ, H, D = 16, 2, 128
    q, k, v, do, cu_q, cu_k, _ = sparse_attn_inputs(lq, lq, HQ, H, D, dtype)
    nqb, nkb = -(-1000 // q_block), -(-1000 // 64)
    shape = (len(lq), H, nqb, nkb) if per_sequence else (H, nqb, nkb)
    mask = torch.rand(shape, generator=torch.Generator().manual_seed(1)) < 0.3
    mask[..., 0] = True
    mask[..., 3, :] = False                      # a query block that selects nothing: its rows get dq = 0
    layout = BlockLayout(mask, q_block)
    out, _, grads = op_grads(block_sparse_attn_varlen, q, k, v, do, cu_q, cu_k, layout, 1000, 1000,
                             backend="kernels")
    idx = layout.to_topk_idx(cu_q.cpu()).cuda()
    empty_rows, unused = check(out, grads, q, k, v, do, cu_q, cu_k, idx, 1000, 1000, True)
    assert empty_rows.any() and unused.any()
    # the layout and its token-level form run the same kernels over the same bitmask bits
    _, _, tok = op_grads(sparse_attn_varlen, q, k, v, do, cu_q, cu_k, idx, 1000, 1000, backend="kernels")
    for x, y in zip(grads, tok):
        assert torch.equal(x, y)


# -------------------------------------------------------------------------------- compile, training


class TinyCudaAttention(torch.nn.Module):
    def __init__(self, E=256, HQ=16, H=2, D=64, backend="auto"):
        super().__init__()
        self.HQ, self.H, self.D, self.backend = HQ, H, D, backend
        self.qkv = torch.nn.Linear(E, (HQ + 2 * H) * D, bias=False)
        self.o = torch.nn.Linear(HQ * D, E, bias=False)

    def forward(self, x, cu, idx, max_seqlen: int):
        T, HQ, H, D = x.shape[0], self.HQ, self.H, self.D
        q, k, v = self.qkv(x).split([HQ * D, H * D, H * D], dim=-1)
        o = sparse_attn_varlen(q.reshape(T, HQ, D), k.reshape(T, H, D), v.reshape(T, H, D), cu, cu, idx,
                               max_seqlen, max_seqlen, backend=self.backend)
        return self.o(o.reshape(T, HQ * D))


def _batch(lengths, E=256, H=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(lengths), E, generator=g).to("cuda", torch.bfloat16)
    idx = random_topk_idx(H, lengths, lengths, 8, generator=g).cuda()
    return x, cu_seqlens_from_lengths(lengths, "cuda"), idx, max(lengths)


@GPU
def test_torch_compile_inductor_matches_eager():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TinyCudaAttention().to("cuda", torch.bfloat16)
    compiled = torch.compile(model, fullgraph=True)           # inductor; fullgraph: no graph break
    for lengths in ([700, 130, 1], [300, 257]):               # the second batch: dynamic shapes
        x, cu, idx, L = _batch(lengths)
        results = []
        for m in (compiled, model):
            model.zero_grad()
            y = m(x, cu, idx, L)
            y.float().square().mean().backward()
            results.append((y.detach(), [p.grad.clone() for p in model.parameters()]))
        (y1, g1), (y2, g2) = results
        assert rel_l2_err(y1, y2) < 1e-2
        for a, b in zip(g1, g2):
            assert bool(torch.isfinite(a).all()) and rel_l2_err(a, b) < 2e-2


@GPU
def test_short_training_matches_reference():
    # five AdamW steps in bf16 through the kernels and through the reference, from the same init
    torch.manual_seed(0)
    ours = TinyCudaAttention(backend="auto").to("cuda", torch.bfloat16)
    ref = copy.deepcopy(ours)
    ref.backend = "reference"
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (ours, ref)]
    x, cu, idx, L = _batch([700, 130, 1, 257])
    target = torch.randn(x.shape, generator=torch.Generator().manual_seed(5)).to("cuda")
    losses = []
    for _ in range(5):
        step = []
        for m, opt in zip((ours, ref), opts):
            opt.zero_grad()
            loss = (m(x, cu, idx, L).float() - target).square().mean()
            loss.backward()
            opt.step()
            step.append(loss.item())
        losses.append(step)
    for a, b in losses:
        assert abs(a - b) <= 2e-2 * abs(b), losses
    assert losses[-1][0] < losses[0][0], f"the loss must go down: {losses}"
