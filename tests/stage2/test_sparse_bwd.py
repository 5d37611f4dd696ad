"""Stage-2 gradients through the public ops on CUDA: autograd of `sparse_attn_varlen` and
`block_sparse_attn_varlen` (custom ops -> forward and backward kernels), torch.compile, training.

FlashAttention's rule for gradients: the error of dq, dk, dv against the float64 reference's
autograd may be at most 3x that of the same math done by PyTorch in the low precision
(`upcast=False`). Kernel outputs are NaN-poisoned (conftest sets INFLLM_CUPY_POISON=1), so an
element the backward never writes fails. The launcher-level kernel tests are in
test_sparse_bwd_kernel.py; this file tests the wiring users see.
"""
import copy

import pytest
import torch
from conftest import HAS_GPU

from infllm_cupy.stage2.attention import block_sparse_attn_varlen, sparse_attn_varlen
from infllm_cupy.stage2.layout import BlockLayout
from infllm_cupy.stage2.sparse_fwd import FwdTiles
from infllm_cupy.testing import (check_sparse_grads, cu_seqlens_from_lengths, random_topk_idx, rel_l2_err,
                                 sparse_attn_inputs)

pytestmark = pytest.mark.gpu

# (lengths_q, lengths_k, HQ, H, D): ragged batches with lengths that are not multiples of 64,
# one-token sequences, G in {1, 2, 4, 8, 12, 16, 32}, D in {64, 128}, queries shorter than keys
CASES = [
    ([1, 63, 130, 257, 700], [1, 63, 130, 257, 700], 16, 1, 128),     # G = 16
    ([1, 63, 130, 257, 700], [1, 63, 130, 257, 700], 2, 2, 64),       # G = 1
    ([700, 130, 1], [700, 130, 1], 4, 2, 128),                        # G = 2
    ([513, 1, 65], [513, 1, 65], 16, 4, 64),                          # G = 4
    ([257, 1, 300], [257, 1, 300], 16, 2, 64),                        # G = 8
    ([333, 17], [333, 17], 24, 2, 128),                               # G = 12
    ([1000, 1], [1000, 1], 32, 1, 128),                               # G = 32
    ([100, 37, 5, 1], [700, 37, 64, 130], 16, 2, 64),                 # chunked prefill (Lq < Lk), G = 8
]
IDS = [f"Lq{'-'.join(map(str, c[0]))}_Lk{'-'.join(map(str, c[1]))}_HQ{c[2]}_H{c[3]}_D{c[4]}" for c in CASES]
DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])

HOPPER = HAS_GPU and torch.cuda.get_device_capability() == (9, 0)


def op_grads(fn, q, k, v, do, *args, **kw):
    """(out, lse, (dq, dk, dv)) of `fn(q, k, v, *args, return_lse=True, **kw)` through autograd."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse = fn(*leaves, *args, return_lse=True, **kw)
    assert out.requires_grad and not lse.requires_grad
    return out.detach(), lse, torch.autograd.grad(out, leaves, do)


def check(out, grads, q, k, v, do, cu_q, cu_k, idx, mq, mk, causal):
    return check_sparse_grads(grads, q, k, v, do, cu_q, cu_k, idx, mq, mk, causal, out=out)


# ------------------------------------------------------------------------------------- token level


@DTYPES
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_token_level_grads(case, dtype):
    lq, lk, HQ, H, D = case
    q, k, v, do, cu_q, cu_k, idx = sparse_attn_inputs(lq, lk, HQ, H, D, dtype, empty_rows=True)
    mq, mk = max(lq), max(lk)
    out, _, grads = op_grads(sparse_attn_varlen, q, k, v, do, cu_q, cu_k, idx, mq, mk, backend="kernels")
    empty_rows, unused = check(out, grads, q, k, v, do, cu_q, cu_k, idx, mq, mk, True)
    assert empty_rows.any() and unused.any(), "the case must exercise both exact-zero rules"


@DTYPES
def test_non_causal(dtype):
    lq, lk = [1, 5, 90, 63], [300, 64, 1000, 63]          # decode-like rows against long caches
    q, k, v, do, cu_q, cu_k, idx = sparse_attn_inputs(lq, lk, 16, 2, 128, dtype)
    out, _, grads = op_grads(sparse_attn_varlen, q, k, v, do, cu_q, cu_k, idx, 90, 1000, False, backend="kernels")
    check(out, grads, q, k, v, do, cu_q, cu_k, idx, 90, 1000, False)


TILES = [None, FwdTiles(8, 1, 64), FwdTiles(4, 2, 32),
         pytest.param("sm90a", marks=pytest.mark.skipif(not HOPPER, reason="sm_90a kernel needs capability 9.0"))]


@pytest.mark.parametrize("tiles", TILES, ids=lambda t: "default" if t is None else str(t) if isinstance(t, str)
                         else f"w{t.warps}m{t.m_tiles}k{t.sub_keys}")
def test_backward_after_every_forward_kernel(tiles):
    # the backward reads the forward's out and lse, whichever forward kernel wrote them
    lq = [700, 129, 1]
    q, k, v, do, cu_q, cu_k, idx = sparse_attn_inputs(lq, lq, 16, 2, 128, torch.bfloat16, empty_rows=True)
    out, _, grads = op_grads(sparse_attn_varlen, q, k, v, do, cu_q, cu_k, idx, 700, 700, backend="kernels",
                             tiles=tiles)
    check(out, grads, q, k, v, do, cu_q, cu_k, idx, 700, 700, True)


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


def test_bit_identical_across_runs():
    lq = [1500, 333, 1]
    q, k, v, do, cu_q, cu_k, idx = sparse_attn_inputs(lq, lq, 16, 2, 128, torch.bfloat16, K=16)
    _, _, a = op_grads(sparse_attn_varlen, q, k, v, do, cu_q, cu_k, idx, 1500, 1500)
    _, _, b = op_grads(sparse_attn_varlen, q, k, v, do, cu_q, cu_k, idx, 1500, 1500)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@pytest.mark.skipif(not HOPPER, reason="the query-range passes are the sm_90a dk/dv's")
@pytest.mark.parametrize("passes", [3, 8])
@DTYPES
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_query_range_passes(case, dtype, passes, monkeypatch):
    """The sm_90a dk/dv in query-range passes (forced; real sizes take them from 8k tokens on):
    fp32 sums carried through the passes, the last one writing dk, dv; key blocks with tiles in
    some passes only, passes a block has no tile in, keys no query picked (exact zeros), both
    instances of "sm90a_auto", and ranges that cut a sequence's tiles unevenly. Twice, bit for bit."""
    monkeypatch.setenv("INFLLM_CUPY_DKDV_PASSES", str(passes))
    empty_rows, unused = check_twice(case, dtype)
    assert empty_rows.any() and unused.any()


def check_twice(case, dtype):
    """The kernels' gradients of `case` (with empty rows) against the reference, then a second run
    bit for bit; returns the check's (empty_rows, unused)."""
    lq, lk, HQ, H, D = case
    q, k, v, do, cu_q, cu_k, idx = sparse_attn_inputs(lq, lk, HQ, H, D, dtype, empty_rows=True)
    mq, mk = max(lq), max(lk)
    out, _, grads = op_grads(sparse_attn_varlen, q, k, v, do, cu_q, cu_k, idx, mq, mk, backend="kernels")
    found = check(out, grads, q, k, v, do, cu_q, cu_k, idx, mq, mk, True)
    _, _, again = op_grads(sparse_attn_varlen, q, k, v, do, cu_q, cu_k, idx, mq, mk, backend="kernels")
    for x, y in zip(grads, again):
        assert torch.equal(x, y)
    return found


@pytest.mark.skipif(not HOPPER, reason="programmatic dependent launch of the sm_90a dk/dv passes")
@pytest.mark.parametrize("passes", [2, 8])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_query_range_passes_as_programmatic_dependents(case, passes, monkeypatch):
    """INFLLM_CUPY_DKDV_PDL=1: passes after the first start while the one before drains and order
    their dk32 / dv32 sums with griddepcontrol: the same bits as passes launched one after the other
    (twice, so a race would have two chances to show)."""
    monkeypatch.setenv("INFLLM_CUPY_DKDV_PASSES", str(passes))
    lq, lk, HQ, H, D = case
    q, k, v, do, cu_q, cu_k, idx = sparse_attn_inputs(lq, lk, HQ, H, D, torch.bfloat16, empty_rows=True)
    mq, mk = max(lq), max(lk)
    monkeypatch.setenv("INFLLM_CUPY_DKDV_PDL", "0")
    _, _, plain = op_grads(sparse_attn_varlen, q, k, v, do, cu_q, cu_k, idx, mq, mk, backend="kernels")
    monkeypatch.setenv("INFLLM_CUPY_DKDV_PDL", "1")
    for _ in range(2):
        out, _, grads = op_grads(sparse_attn_varlen, q, k, v, do, cu_q, cu_k, idx, mq, mk, backend="kernels")
        for x, y in zip(plain, grads):
            assert torch.equal(x, y)
    check(out, grads, q, k, v, do, cu_q, cu_k, idx, mq, mk, True)


@pytest.mark.skipif(not HOPPER, reason="the query-range passes are the sm_90a dk/dv's")
@pytest.mark.parametrize("pdl", ["0", "1"])
def test_query_range_pass_with_no_tile(pdl, monkeypatch):
    """A pass in which no query selects anything (every CTA of it leaves at once): the next pass
    must still add its sums after the pass before, with plain and with programmatic launches."""
    monkeypatch.setenv("INFLLM_CUPY_DKDV_PASSES", "4")
    monkeypatch.setenv("INFLLM_CUPY_DKDV_PDL", pdl)
    lq = [700, 130, 1]
    q, k, v, do, cu_q, cu_k, idx = sparse_attn_inputs(lq, lq, 16, 1, 128, torch.bfloat16)
    chunk = -(-700 // 4)
    for s0, n in zip(cu_q[:-1].tolist(), lq):
        idx[:, s0 + chunk:s0 + min(n, 2 * chunk)] = -1      # pass 1's tokens select nothing
    out, _, grads = op_grads(sparse_attn_varlen, q, k, v, do, cu_q, cu_k, idx, 700, 700, backend="kernels")
    check(out, grads, q, k, v, do, cu_q, cu_k, idx, 700, 700, True)
    _, _, again = op_grads(sparse_attn_varlen, q, k, v, do, cu_q, cu_k, idx, 700, 700, backend="kernels")
    for x, y in zip(grads, again):
        assert torch.equal(x, y)


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


class TinyAttention(torch.nn.Module):
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


def test_torch_compile_inductor_matches_eager():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TinyAttention().to("cuda", torch.bfloat16)
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


def test_short_training_matches_reference():
    # five AdamW steps in bf16 through the kernels and through the reference, from the same init
    torch.manual_seed(0)
    ours = TinyAttention(backend="auto").to("cuda", torch.bfloat16)
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
