"""Stage-2 custom ops on CPU (ops.py): registration (opcheck), gradients (gradcheck and against the
reference's autograd), torch.compile without graph breaks, and the pipeline module's backward.

CPU tensors run the reference inside the same ops as the kernels, so the op wiring, the fake
implementations and the autograd formula are all tested here, without a GPU.
"""
import pytest
import torch

from infllm_cupy.pipeline import InfLLMv2Attention, InfLLMv2Config
from infllm_cupy.stage2 import naive as s2
from infllm_cupy.stage2 import ops
from infllm_cupy.stage2.attention import block_sparse_attn_varlen, sparse_attn_varlen
from infllm_cupy.stage2.layout import BlockLayout
from infllm_cupy.stage2.naive import naive_sparse_attn_varlen, naive_sparse_attn_varlen_bwd
from infllm_cupy.stage2.sparse_fwd import FwdTiles
from infllm_cupy.testing import cu_seqlens_from_lengths, random_topk_idx

# ragged, one-token sequences, lengths across 64-key block edges, G = 2
LQ = [70, 1, 131]
HQ, H, D = 4, 2, 8


def make(lq, lk=None, dtype=torch.float64, K=4, seed=0, grad=True, **sel):
    lk = lq if lk is None else lk
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lq), HQ, D, generator=g, dtype=dtype)
    k = torch.randn(sum(lk), H, D, generator=g, dtype=dtype)
    v = torch.randn(sum(lk), H, D, generator=g, dtype=dtype)
    if grad:
        q, k, v = (t.requires_grad_() for t in (q, k, v))
    idx = random_topk_idx(H, lq, lk, K, generator=g, **sel)      # -1, duplicates, out-of-range, future
    return q, k, v, cu_seqlens_from_lengths(lq), cu_seqlens_from_lengths(lk), idx


def make_layout(batch, nqb, nkb, q_block=64, per_sequence=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (batch, H, nqb, nkb) if per_sequence else (H, nqb, nkb)
    return BlockLayout(torch.rand(shape, generator=g) < 0.5, q_block)


# -------------------------------------------------------------------------------------- registration


def test_opcheck_token_level():
    q, k, v, cu, _, idx = make(LQ, dtype=torch.float32, empty_rows=True)
    args = (q, k, v, cu, cu, idx, 131, 131, True, 0.3, "")
    torch.library.opcheck(ops.sparse_attn_fwd, args)
    out, lse = ops.sparse_attn_fwd(*(a.detach() if isinstance(a, torch.Tensor) else a for a in args))
    dout = torch.randn_like(out)
    torch.library.opcheck(ops.sparse_attn_bwd, (dout, q.detach(), k.detach(), v.detach(), out, lse, cu, cu, idx,
                                                131, 131, True, 0.3))


def test_opcheck_block_layout():
    q, k, v, cu, _, _ = make(LQ, dtype=torch.float64)
    layout = make_layout(len(LQ), 3, 3)
    args = (q, k, v, cu, cu, layout.mask, 64, 131, 131, True, 0.3, "4,1,64")
    torch.library.opcheck(ops.block_sparse_attn_fwd, args)
    out, lse = ops.block_sparse_attn_fwd(*(a.detach() if isinstance(a, torch.Tensor) else a for a in args))
    dout = torch.randn_like(out)
    torch.library.opcheck(ops.block_sparse_attn_bwd, (dout, q.detach(), k.detach(), v.detach(), out, lse, cu, cu,
                                                      layout.mask, 64, 131, 131, True, 0.3))


def test_tiles_argument():
    assert ops.tiles_arg(None) == ""
    assert ops.tiles_arg("sm90a") == "sm90a"
    assert ops.tiles_arg(FwdTiles(8, 1, 32)) == "8,1,32"
    assert ops.tiles_arg((4, 2, 64)) == "4,2,64"
    assert ops._tiles("8,1,32", "cpu") == FwdTiles(8, 1, 32)
    with pytest.raises(ValueError, match="tiles"):
        ops.tiles_arg((3, 1, 64))
    with pytest.raises(TypeError, match="tiles"):
        ops.tiles_arg("fast")
    q, k, v, cu, _, idx = make(LQ)
    with pytest.raises(TypeError, match="tiles"):                   # checked before the op, on CPU too
        sparse_attn_varlen(q, k, v, cu, cu, idx, 131, 131, tiles="fast")


# ------------------------------------------------------------------------------------------ gradients


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_gradcheck_token_level(causal):
    # queries shorter than keys (bottom-right causal), rows with no usable index
    q, k, v, cuq, cuk, idx = make([70, 1, 100], [150, 1, 100], empty_rows=True)

    def f(q, k, v):
        return sparse_attn_varlen(q, k, v, cuq, cuk, idx, 100, 150, causal)

    assert torch.autograd.gradcheck(f, (q, k, v), fast_mode=True)


@pytest.mark.parametrize("q_block", [64, 128])
def test_gradcheck_block_layout(q_block):
    q, k, v, cu, _, _ = make(LQ)
    layout = make_layout(len(LQ), -(-131 // q_block), 3, q_block)

    def f(q, k, v):
        return block_sparse_attn_varlen(q, k, v, cu, cu, layout, 131, 131)

    assert torch.autograd.gradcheck(f, (q, k, v), fast_mode=True)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_op_grads_equal_reference_autograd(causal, monkeypatch):
    # 16-row query chunks, so that dk and dv accumulate over several chunks of the reference backward
    monkeypatch.setattr(s2, "_CHUNK_ELEMS", 1)
    q, k, v, cuq, cuk, idx = make([70, 1, 131, 5], [90, 1, 131, 64], empty_rows=True)
    out, lse = sparse_attn_varlen(q, k, v, cuq, cuk, idx, 131, 131, causal, return_lse=True)
    ref = naive_sparse_attn_varlen(q, k, v, cuq, cuk, idx, 131, 131, causal)
    assert torch.equal(out, ref)
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
    q, k, v, cu, _, idx = make(LQ, dtype=torch.bfloat16)
    do = torch.randn(q.shape, dtype=torch.bfloat16)
    grads = naive_sparse_attn_varlen_bwd(do, q, k, v, cu, cu, idx, 131, 131)
    want = torch.autograd.grad(naive_sparse_attn_varlen(q, k, v, cu, cu, idx, 131, 131), (q, k, v), do)
    for g, w in zip(grads, want):
        assert g.dtype == torch.bfloat16
        torch.testing.assert_close(g, w, atol=2e-2, rtol=2e-2)
    with pytest.raises(ValueError, match="dout must have shape"):
        naive_sparse_attn_varlen_bwd(do[:-1], q, k, v, cu, cu, idx, 131, 131)


def test_lse_has_no_gradient_and_selection_gets_none():
    q, k, v, cu, _, idx = make(LQ)
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
def test_cpu_auto_is_the_reference(dtype):
    q, k, v, cu, _, idx = make(LQ, dtype=dtype, grad=False)
    out, lse = sparse_attn_varlen(q, k, v, cu, cu, idx, 131, 131, return_lse=True)
    ref, ref_lse = naive_sparse_attn_varlen(q, k, v, cu, cu, idx, 131, 131, return_lse=True)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    for backend in ("auto", "reference"):
        assert torch.equal(sparse_attn_varlen(q, k, v, cu, cu, idx, 131, 131, backend=backend), ref)
    with pytest.raises((ValueError, TypeError), match="CUDA tensor|q must have dtype"):
        sparse_attn_varlen(q, k, v, cu, cu, idx, 131, 131, backend="kernels")
    with pytest.raises(ValueError, match="cu_seqlens_q must"):       # value checks run in eager mode
        sparse_attn_varlen(q, k, v, cu.flip(0), cu, idx, 131, 131)


# ------------------------------------------------------------------------------------------ compile


class TinyAttention(torch.nn.Module):
    """q/k/v projections, stage-2 attention, output projection; selection and lengths are inputs."""

    def __init__(self, E=16, layout_form=False, q_block=64):
        super().__init__()
        self.qkv = torch.nn.Linear(E, (HQ + 2 * H) * D)
        self.o = torch.nn.Linear(HQ * D, E)
        self.layout_form, self.q_block = layout_form, q_block

    def forward(self, x, cu, sel, max_seqlen: int):
        T = x.shape[0]
        q, k, v = self.qkv(x).split([HQ * D, H * D, H * D], dim=-1)
        q, k, v = q.reshape(T, HQ, D), k.reshape(T, H, D), v.reshape(T, H, D)
        if self.layout_form:
            o, lse = block_sparse_attn_varlen(q, k, v, cu, cu, BlockLayout(sel, self.q_block), max_seqlen,
                                              max_seqlen, return_lse=True)
        else:
            o, lse = sparse_attn_varlen(q, k, v, cu, cu, sel, max_seqlen, max_seqlen, return_lse=True)
        return self.o(o.reshape(T, HQ * D)), lse


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
    model = TinyAttention()
    batches = []
    for lens in ([70, 1, 131], [100, 64]):          # the second batch recompiles with dynamic shapes
        batches.append((torch.randn(sum(lens), 16, generator=g), cu_seqlens_from_lengths(lens),
                        random_topk_idx(H, lens, lens, 3, generator=g), max(lens)))
    _compile_matches_eager(model, batches)


def test_compile_block_layout_matches_eager():
    model = TinyAttention(layout_form=True)
    lens = [70, 1, 131]
    x = torch.randn(sum(lens), 16)
    batches = [(x, cu_seqlens_from_lengths(lens), make_layout(3, 3, 3).mask, 131),
               (x, cu_seqlens_from_lengths(lens), make_layout(3, 3, 3, per_sequence=False, seed=1).mask, 131)]
    _compile_matches_eager(model, batches)


# ----------------------------------------------------------------------------------------- pipeline


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
