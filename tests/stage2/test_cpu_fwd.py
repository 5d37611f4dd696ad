"""Stage 2's CPU implementation (`infllm_cupy/stage2/cpu.py`, docs/cpu.md "Stage 2") against the oracle
`naive_sparse_attn_varlen` with FlashAttention's rule (its error at most 2x that of the same math in
low precision), on ragged varlen batches, every GQA ratio from 1 to 32, head dims 64, 128 and others,
bf16 / fp16 / fp32 (float64 stays float64), junk selections; both of its paths (the dense GEMM per
query block, the per-block pieces) alone and together, every tiling, and its memory: nothing is
sized from `max_seqlen_q` / `max_seqlen_k`. CPU only."""
from __future__ import annotations

import pytest
import torch

from infllm_cupy.selections import make_selection
from infllm_cupy.stage2 import cpu
from infllm_cupy.stage2.attention import block_sparse_attn_varlen, sparse_attn_varlen
from infllm_cupy.stage2.cpu import chunk_tokens, cpu_block_sparse_attn_varlen, cpu_sparse_attn_varlen
from infllm_cupy.stage2.layout import BlockLayout
from infllm_cupy.stage2.naive import naive_block_sparse_attn_varlen, naive_sparse_attn_varlen
from infllm_cupy.testing import assert_close_to_ref, cu_seqlens_from_lengths, sparse_attn_inputs

# ragged: lengths off the 64-token grid, 1-token sequences; keys longer than queries (cache_lens > 0)
LQ = [1, 63, 64, 65, 200, 1, 130]
LK = [1, 100, 64, 65, 329, 70, 130]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
DTYPE_IDS = ["bf16", "fp16", "fp32"]


def inputs(lq=LQ, lk=LK, HQ=8, H=2, D=64, dtype=torch.bfloat16, K=6, seed=0, **sel):
    q, k, v, _, cu_q, cu_k, idx = sparse_attn_inputs(lq, lk, HQ, H, D, dtype, K=K, seed=seed, device="cpu",
                                                     **sel)
    return q, k, v, cu_q, cu_k, idx


def check_against_oracle(out, lse, q, k, v, cu_q, cu_k, idx, causal=True, block_size=64):
    """`out` within FlashAttention's rule of the float64 oracle (the oracle in q's precision as the
    baseline), `lse` its float32 value to fp32 rounding, +inf exactly on the rows with no key."""
    mq, mk = int((cu_q[1:] - cu_q[:-1]).max()), int((cu_k[1:] - cu_k[:-1]).max())
    ref, ref_lse = naive_sparse_attn_varlen(q.double(), k.double(), v.double(), cu_q, cu_k, idx, mq, mk,
                                            causal=causal, return_lse=True, block_size=block_size)
    lowp = naive_sparse_attn_varlen(q, k, v, cu_q, cu_k, idx, mq, mk, causal=causal, upcast=False,
                                    block_size=block_size)
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    assert_close_to_ref("out", out, ref, lowp)
    empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), empty) and bool((lse[empty] > 0).all())
    assert bool((out[empty.T] == 0).all()), "rows with no allowed key are exactly 0"
    if (~empty).any():
        err = (lse[~empty].double() - ref_lse[~empty].double()).abs().max().item()
        assert err <= 1e-5 * max(1.0, ref_lse[~empty].abs().max().item()), f"lse error {err}"


def run(q, k, v, cu_q, cu_k, idx, **kw):
    mq, mk = int((cu_q[1:] - cu_q[:-1]).max()), int((cu_k[1:] - cu_k[:-1]).max())
    return cpu_sparse_attn_varlen(q, k, v, cu_q, cu_k, idx, mq, mk, return_lse=True, **kw)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("G, H", [(1, 2), (2, 2), (4, 1), (8, 2), (16, 2), (32, 1)])
def test_cpu_fwd_gqa_ratios_against_the_oracle(G, H, dtype):
    q, k, v, cu_q, cu_k, idx = inputs(HQ=G * H, H=H, D=64, dtype=dtype, seed=G, empty_rows=True)
    out, lse = run(q, k, v, cu_q, cu_k, idx)
    check_against_oracle(out, lse, q, k, v, cu_q, cu_k, idx)


@pytest.mark.parametrize("D", [64, 128, 32, 80])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_cpu_fwd_head_dims_and_causality(D, causal):
    q, k, v, cu_q, cu_k, idx = inputs(HQ=8, H=2, D=D, K=9, seed=D, empty_rows=True)
    out, lse = run(q, k, v, cu_q, cu_k, idx, causal=causal)
    check_against_oracle(out, lse, q, k, v, cu_q, cu_k, idx, causal=causal)


def test_cpu_fwd_float64_stays_float64():
    q, k, v, cu_q, cu_k, idx = inputs(dtype=torch.float64, empty_rows=True)
    out, lse = run(q, k, v, cu_q, cu_k, idx)
    ref, ref_lse = naive_sparse_attn_varlen(q, k, v, cu_q, cu_k, idx, 200, 329, return_lse=True)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lse, ref_lse)


@pytest.mark.parametrize("selection", ["a", "b", "c"])
@pytest.mark.parametrize("share", [None, 0.0, 1.0], ids=["both", "all-dense", "all-pieces"])
def test_cpu_fwd_paths_on_benchmark_selections(selection, share, monkeypatch):
    """Block-shared (a: every pair dense), per-token (b: nearly every pair in pieces) and InfLLM-like (c:
    both) selections; with `_DENSE_SHARE` 0 every selected block runs in its query block's dense GEMM,
    with 1 every pair in the per-block pieces: each path alone equals the oracle, and so do the two
    merged."""
    if share is not None:
        monkeypatch.setattr(cpu, "_DENSE_SHARE", share)
    T, HQ, H, D = 333, 8, 2, 64
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(T, n, D, generator=g).to(torch.bfloat16) for n in (HQ, H, H))
    cu = cu_seqlens_from_lengths([T])
    idx = make_selection(selection, 1, T, H, 4 if selection != "c" else 6)
    out, lse = run(q, k, v, cu, cu, idx)
    check_against_oracle(out, lse, q, k, v, cu, cu, idx)


@pytest.mark.parametrize("chunk_elems, tile_elems, piece_rows", [(1, 1, 1), (1 << 16, 1 << 12, 16),
                                                                 (1 << 30, 1 << 30, 1 << 20)],
                         ids=["smallest", "small", "one-chunk"])
def test_cpu_fwd_any_tiling_gives_the_oracle(chunk_elems, tile_elems, piece_rows, monkeypatch):
    """Chunks of one query block, GEMM tiles of one piece and pieces of one token, or everything in one
    chunk and one piece per key block: the same attention."""
    monkeypatch.setattr(cpu, "_CHUNK_ELEMS", chunk_elems)
    monkeypatch.setattr(cpu, "_TILE_ELEMS", tile_elems)
    monkeypatch.setattr(cpu, "_PIECE_ROWS", piece_rows)
    q, k, v, cu_q, cu_k, idx = inputs(HQ=4, H=2, K=7, seed=3, empty_rows=True)
    out, lse = run(q, k, v, cu_q, cu_k, idx)
    check_against_oracle(out, lse, q, k, v, cu_q, cu_k, idx)


def test_cpu_fwd_block_sizes_other_than_64():
    """Any key block size, as the oracle takes (the kernels take 64 only)."""
    for bs in (16, 100):
        q, k, v, cu_q, cu_k, idx = inputs(HQ=4, H=2, K=5, seed=bs)
        idx = torch.where(idx >= 0, idx * 64 // bs, idx)             # indices in units of `bs` keys
        out, lse = run(q, k, v, cu_q, cu_k, idx, block_size=bs)
        check_against_oracle(out, lse, q, k, v, cu_q, cu_k, idx, block_size=bs)


def test_cpu_fwd_edge_shapes():
    """Queries longer than keys (causal rows before the first key see nothing), a sequence without keys,
    an empty batch, K = 0, and rows whose every entry is junk."""
    q, k, v, cu_q, cu_k, idx = inputs(lq=[5, 3, 70], lk=[3, 0, 70], HQ=4, H=2, K=3, seed=5)
    idx[:, :5] = torch.tensor([0, -1, 0], dtype=torch.int32)         # the first sequence: block 0
    idx[:, 8:] = torch.tensor([-1, 9, -7], dtype=torch.int32)        # the third sequence: junk only
    out, lse = run(q, k, v, cu_q, cu_k, idx)
    check_against_oracle(out, lse, q, k, v, cu_q, cu_k, idx)
    # rows 0-1 of the first sequence come before its first key (r + Lk - Lq < 0); the second has no key
    assert bool(torch.isinf(lse[:, :2]).all()) and bool(torch.isinf(lse[:, 5:]).all())
    assert bool(torch.isfinite(lse[:, 2:5]).all())
    out, lse = run(q, k, v, cu_q, cu_k, idx[:, :, :0])               # K = 0: nothing selected
    assert bool((out == 0).all()) and bool(torch.isinf(lse).all())
    e = cu_seqlens_from_lengths([0, 0])
    out, lse = cpu_sparse_attn_varlen(q[:0], k[:0], v[:0], e, e, idx[:, :0], 0, 0, return_lse=True)
    assert out.shape == (0, 4, 64) and lse.shape == (4, 0)


def test_cpu_fwd_slot_order_and_repeats_change_nothing():
    """Stage 2 has no ties: a row's entries are a set. Any order of them, and repeats, give the same
    bits (the tie rule of top-k is stage 1's, `naive_select_topk`)."""
    q, k, v, cu_q, cu_k, idx = inputs(K=6, seed=7, junk=False)
    out, lse = run(q, k, v, cu_q, cu_k, idx)
    g = torch.Generator().manual_seed(0)
    perm = torch.argsort(torch.rand(idx.shape, generator=g), dim=-1)
    shuffled = idx.gather(-1, perm)
    repeated = torch.cat([shuffled, shuffled[..., :3]], dim=-1)
    for other in (shuffled, repeated):
        o2, l2 = run(q, k, v, cu_q, cu_k, other)
        assert torch.equal(o2, out) and torch.equal(l2, lse)


def test_cpu_fwd_on_worker_threads(monkeypatch):
    """Chunks run on `torch.get_num_threads()` Python threads of one intra-op thread each: the same bits
    as one thread inline, under no_grad and inference_mode alike, and the caller's thread count kept."""
    monkeypatch.setattr(cpu, "_CHUNK_ELEMS", 1 << 16)                  # chunks of 64 tokens
    q, k, v, cu_q, cu_k, idx = inputs(HQ=4, H=2, K=6, seed=17)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        want = run(q, k, v, cu_q, cu_k, idx)
        torch.set_num_threads(2)
        for mode in (torch.no_grad, torch.inference_mode, torch.enable_grad):
            with mode():
                got = run(q, k, v, cu_q, cu_k, idx)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), mode
            assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)


def test_cpu_fwd_oversized_max_seqlen_costs_no_memory():
    """`max_seqlen_q` / `max_seqlen_k` are checked, never used to size a buffer: at 2^40 any tensor
    sized from them could not be allocated (terabytes), and the result is the exact call's."""
    q, k, v, cu_q, cu_k, idx = inputs(HQ=4, H=2, seed=11)
    want = cpu_sparse_attn_varlen(q, k, v, cu_q, cu_k, idx, 200, 329)
    big = 1 << 40
    assert torch.equal(cpu_sparse_attn_varlen(q, k, v, cu_q, cu_k, idx, big, big), want)
    assert torch.equal(sparse_attn_varlen(q, k, v, cu_q, cu_k, idx, big, big), want)
    # the chunk of tokens is a function of K, G, D and the block size alone
    assert chunk_tokens(6, 2, 64) % 64 == 0 and chunk_tokens(6, 2, 64) >= 64
    assert chunk_tokens(10_000, 32, 256) == 64


def test_cpu_fwd_is_the_op_forward_and_layouts_share_it():
    """`sparse_attn_varlen` and `block_sparse_attn_varlen` on CPU tensors under "auto" run the CPU
    implementation (bit for bit), differentiable through the op (the oracle's backward);
    backend="reference" is the oracle. The CPU implementation itself records no graph."""
    q, k, v, cu_q, cu_k, idx = inputs(HQ=8, H=2, seed=13)
    q.requires_grad_()
    want, want_lse = cpu_sparse_attn_varlen(q, k, v, cu_q, cu_k, idx, 200, 329, return_lse=True)
    assert not want.requires_grad
    out, lse = sparse_attn_varlen(q, k, v, cu_q, cu_k, idx, 200, 329, return_lse=True)
    assert torch.equal(out, want) and torch.equal(lse, want_lse) and out.requires_grad
    (dq,) = torch.autograd.grad(out.float().sum(), q)
    assert dq.shape == q.shape and bool(torch.isfinite(dq).all())
    ref = sparse_attn_varlen(q, k, v, cu_q, cu_k, idx, 200, 329, backend="reference")
    assert torch.equal(ref, naive_sparse_attn_varlen(q, k, v, cu_q, cu_k, idx, 200, 329))

    lq = [130, 64, 1]
    cu = cu_seqlens_from_lengths(lq)
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(195, n, 64, generator=g).to(torch.bfloat16) for n in (8, 2, 2))
    layout = BlockLayout(torch.rand(3, 2, 3, 3, generator=g) < 0.5, q_block=64)
    out, lse = block_sparse_attn_varlen(q, k, v, cu, cu, layout, 130, 130, return_lse=True)
    want = cpu_block_sparse_attn_varlen(q, k, v, cu, cu, layout, 130, 130, return_lse=True)
    assert torch.equal(out, want[0]) and torch.equal(lse, want[1])
    check_against_oracle(out, lse, q, k, v, cu, cu, layout.to_topk_idx(cu))
    ref = naive_block_sparse_attn_varlen(q, k, v, cu, cu, layout, 130, 130)
    assert torch.equal(block_sparse_attn_varlen(q, k, v, cu, cu, layout, 130, 130, backend="reference"), ref)


@pytest.mark.parametrize("bad, match", [
    (dict(topk_idx=torch.zeros(2, 3, 1, dtype=torch.int64)), "topk_idx must have dtype int32"),
    (dict(max_seqlen_q=2), r"max_seqlen_q must be >= the longest sequence \(3\)"),
    (dict(block_size=0), "block_size must be >= 1"),
    (dict(causal=1), "causal must be a bool"),
    (dict(softmax_scale=-1.0), "softmax_scale must be a positive finite float"),
])
def test_cpu_fwd_checks_its_inputs(bad, match):
    q, k, v = torch.randn(3, 4, 8), torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    cu = cu_seqlens_from_lengths([3])
    args = dict(topk_idx=torch.zeros(2, 3, 1, dtype=torch.int32), max_seqlen_q=3, max_seqlen_k=3)
    kw = {}
    for name, value in bad.items():
        (args if name in args else kw)[name] = value
    with pytest.raises((TypeError, ValueError), match=match):
        cpu_sparse_attn_varlen(q, k, v, cu, cu, args["topk_idx"], args["max_seqlen_q"], args["max_seqlen_k"],
                               **kw)
