"""dkernel-like modules (SparseAttention, LocalStrideSparseAttention): outputs and gradients against a
dense masked reference (the token-level mask expanded from the block pattern) by FlashAttention's rule,
on ragged packed batches and padded batch-first inputs, GQA, per-query-head patterns; pattern
construction against a transcription of dkernel's rule; argument errors."""
import pytest
import torch

from infllm_cupy.patterns.local_stride import local_stride_block_mask
from infllm_cupy.patterns.modules import (
    LocalStrideSparseAttention,
    SparseAttention,
    dkernel_local_stride_mask,
)
from infllm_cupy.testing import assert_close_to_ref, cu_seqlens_from_lengths

BS = 64


def q_head_pattern(pattern: torch.Tensor, HQ: int, H: int) -> torch.Tensor:
    """The module's pattern as one row per query head `[HQ, NB, NB]`."""
    P = pattern.shape[0]
    if P == 1:
        return pattern.expand(HQ, -1, -1)
    if P == H:
        return pattern.repeat_interleave(HQ // H, dim=0)
    assert P == HQ
    return pattern


def dense_ref(q, k, v, lengths, pattern_q, *, causal=True, scale=None, exact=True):
    """Masked softmax attention per sequence with the token mask `pattern_q[h, i // 64, j // 64]`
    (and `j <= i` if causal): in float64 (`exact`) or in q's dtype (FlashAttention's low-precision twin)."""
    if exact:
        q, k, v = q.double(), k.double(), v.double()
    HQ, H, D = q.shape[1], k.shape[1], q.shape[2]
    scale = D ** -0.5 if scale is None else scale
    outs, s = [], 0
    for L in lengths:
        qs = q[s:s + L]
        ks, vs = k[s:s + L].repeat_interleave(HQ // H, 1), v[s:s + L].repeat_interleave(HQ // H, 1)
        blk = torch.arange(L) // BS
        mask = pattern_q[:, blk][:, :, blk].to(q.device)                      # [HQ, L, L]
        if causal:
            mask = mask & torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
        sc = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        p = torch.softmax(sc.masked_fill(~mask, float("-inf")), dim=-1)
        outs.append(torch.einsum("hqk,khd->qhd", p.to(vs.dtype), vs))
        s += L
    return torch.cat(outs)


def random_pattern(P, NB, *, seed, diag=True):
    g = torch.Generator().manual_seed(seed)
    m = torch.rand(P, NB, NB, generator=g) < 0.4
    if diag:   # every query row keeps its own block, so no row is empty (the dense reference needs it)
        m |= torch.eye(NB, dtype=torch.bool)
    return m


def make_pattern(kind, HQ, H, NB, seed=0):
    if kind == "shared":
        return random_pattern(1, NB, seed=seed)[0]                            # 2-D, as dkernel allows
    if kind == "kv":
        return random_pattern(H, NB, seed=seed)
    if kind == "q_agree":
        return random_pattern(H, NB, seed=seed).repeat_interleave(HQ // H, 0)
    assert kind == "q_differ"
    return random_pattern(HQ, NB, seed=seed)


def inputs(total, HQ, H, D, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(total, h, D, generator=g).to(device, dtype).requires_grad_() for h in (HQ, H, H)]


def check_against_dense(out, q, k, v, lengths, pattern_q, *, causal=True, scale=None, out_pick=None):
    """FlashAttention's rule on the output and on dq, dk, dv for one random dout. `out_pick` maps the
    module's output to the packed valid tokens (for padded batch-first inputs)."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    pack = out_pick or (lambda t: t)
    packed = [pack(t) for t in (q, k, v)] if out_pick else [q, k, v]
    ref = dense_ref(*[pack(t) for t in leaves] if out_pick else leaves, lengths, pattern_q, causal=causal,
                    scale=scale)
    lowp = dense_ref(*packed, lengths, pattern_q, causal=causal, scale=scale, exact=False)
    o = pack(out)
    assert_close_to_ref("out", o, ref, lowp)
    do = torch.randn_like(o)
    grads = torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
    ref_grads = torch.autograd.grad(ref, leaves, do.double())
    lowp_grads = torch.autograd.grad(lowp, (q, k, v), do)
    for name, g, r, lp in zip(("dq", "dk", "dv"), grads, ref_grads, lowp_grads):
        assert_close_to_ref(name, g, r, lp, mult=3)
    return grads


@pytest.mark.parametrize("G", [1, 2, 4])
@pytest.mark.parametrize("kind", ["shared", "kv", "q_agree", "q_differ"])
def test_packed_ragged_batch_matches_dense(G, kind):
    H, D, lengths = 2, 64, [200, 64, 131, 1]
    HQ = G * H
    NB = 4
    pattern = make_pattern(kind, HQ, H, NB, seed=G)
    attn = SparseAttention(BS, pattern)
    q, k, v = inputs(sum(lengths), HQ, H, D, torch.bfloat16, seed=G)
    cu = cu_seqlens_from_lengths(lengths)
    out = attn(q, k, v, cu_seqlens=cu)
    assert out.shape == q.shape and out.dtype == q.dtype
    p3 = pattern if pattern.dim() == 3 else pattern[None]
    check_against_dense(out, q, k, v, lengths, q_head_pattern(p3, HQ, H))
    _, expand = attn.layout_for(HQ, H, "cpu")
    assert expand == (kind == "q_differ" and G > 1)    # only differing groups pay the K/V repeat


def test_non_causal_pattern_and_positional_sm_scale():
    H, G, D, lengths = 2, 2, 64, [190, 70]
    pattern = random_pattern(H, 3, seed=5, diag=False) | torch.eye(3, dtype=torch.bool)   # upper blocks too
    attn = SparseAttention(BS, pattern, causal=False)
    q, k, v = inputs(sum(lengths), G * H, H, D, torch.bfloat16, seed=3)
    out = attn(q, k, v, 0.05, cu_seqlens=cu_seqlens_from_lengths(lengths))     # sm_scale positional (dkernel)
    check_against_dense(out, q, k, v, lengths, q_head_pattern(pattern, G * H, H), causal=False, scale=0.05)


def _to_bthd(x, seq_dim):
    return x if seq_dim == 1 else x.transpose(1, 2)


@pytest.mark.parametrize("seq_dim", [1, 2])
@pytest.mark.parametrize("padding", ["none", "right", "left"])
@pytest.mark.parametrize("G", [1, 4])
def test_batch_first_with_padding_matches_dense(seq_dim, padding, G):
    B, T, H, D = 3, 150, 2, 64
    HQ = G * H
    lens = torch.tensor([150, 97, 1]) if padding != "none" else torch.tensor([T] * B)
    pattern = make_pattern("q_differ", HQ, H, 3, seed=11)
    attn = SparseAttention(BS, pattern, seq_dim=seq_dim)
    g = torch.Generator().manual_seed(7)
    shape = lambda h: (B, T, h, D) if seq_dim == 1 else (B, h, T, D)       # noqa: E731
    q, k, v = [torch.randn(*shape(h), generator=g).bfloat16().requires_grad_() for h in (HQ, H, H)]
    kw = {"right": {"seqlens": lens}, "left": {"left_paddings": T - lens}, "none": {}}[padding]
    out = attn(q, k, v, **kw)
    assert out.shape == q.shape
    pos = torch.arange(T)[None]
    valid = pos >= (T - lens)[:, None] if padding == "left" else pos < lens[:, None]     # [B, T]

    def pick(x):   # the valid tokens, packed in sequence order
        return _to_bthd(x, seq_dim).reshape(B * T, *_to_bthd(x, seq_dim).shape[2:])[valid.reshape(-1)]

    grads = check_against_dense(out, q, k, v, lens.tolist(), pattern, out_pick=pick)
    pad = ~valid
    assert bool((_to_bthd(out, seq_dim)[pad] == 0).all()), "padded positions of the output must be 0"
    for gr in grads:
        assert bool((_to_bthd(gr, seq_dim)[pad] == 0).all()), "padded positions get no gradient"


def test_layout_built_once_per_shape_and_device():
    attn = SparseAttention(BS, make_pattern("kv", 4, 2, 3))
    a = attn.layout_for(4, 2, "cpu")
    assert attn.layout_for(4, 2, torch.device("cpu")) is a
    b = attn.layout_for(8, 2, "cpu")
    assert b is not a and len(attn._layouts) == 2
    q, k, v = inputs(128, 4, 2, 64, torch.float32)
    attn(q, k, v, cu_seqlens=cu_seqlens_from_lengths([128]))
    assert len(attn._layouts) == 2     # the forward reused the cached (4, 2, cpu) layout


def test_block_size_128_and_192_select_the_same_tokens():
    H, lengths = 2, [300, 130]
    for bs in (128, 192):
        NB = -(-320 // bs)
        pattern = random_pattern(H, NB, seed=bs)
        attn = SparseAttention(bs, pattern)
        q, k, v = inputs(sum(lengths), H, H, 64, torch.float64, seed=bs)
        out = attn(q, k, v, cu_seqlens=cu_seqlens_from_lengths(lengths))
        tok = pattern.repeat_interleave(bs // BS, 1).repeat_interleave(bs // BS, 2)
        ref = dense_ref(q, k, v, lengths, tok)
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)


def dkernel_transcription(num_heads, seqlen, block_size, local_blocks, vert_stride, homo_head, num_kv_heads,
                          offset, num_dense_heads):
    """dkernel's `get_sparse_attn_mask` rule, one head at a time, as loops."""
    n_pat = 1 if homo_head else (num_kv_heads or num_heads)
    step = 0 if homo_head else max(1, vert_stride // n_pat)
    nb = -(-seqlen // block_size)
    m = torch.zeros(n_pat, nb, nb, dtype=torch.bool)
    for h in range(n_pat):
        dense = h >= n_pat - num_dense_heads
        for i in range(nb):
            for j in range(i + 1):
                m[h, i, j] = i - j < local_blocks or dense or (j + h * step + offset) % vert_stride == 0
    return m


@pytest.mark.parametrize("args", [
    dict(num_heads=8, homo_head=False, num_kv_heads=None, offset=0, num_dense_heads=0),
    dict(num_heads=8, homo_head=True, num_kv_heads=None, offset=0, num_dense_heads=0),
    dict(num_heads=8, homo_head=False, num_kv_heads=2, offset=1, num_dense_heads=1),
    dict(num_heads=2, homo_head=False, num_kv_heads=None, offset=3, num_dense_heads=0),
])
def test_local_stride_pattern_is_dkernel_rule(args):
    got = dkernel_local_stride_mask(args["num_heads"], 1000, 64, 3, 5, homo_head=args["homo_head"],
                                    num_kv_heads=args["num_kv_heads"], head_sliding_offset=args["offset"],
                                    num_dense_heads=args["num_dense_heads"])
    want = dkernel_transcription(args["num_heads"], 1000, 64, 3, 5, args["homo_head"], args["num_kv_heads"],
                                 args["offset"], args["num_dense_heads"])
    assert torch.equal(got, want)


def test_local_stride_offset_one_is_vllm_rule():
    for homo in (True, False):
        ours = dkernel_local_stride_mask(4, 700, 64, 2, 6, homo_head=homo, head_sliding_offset=1)
        vllm = local_stride_block_mask(4, 700, block_size=64, local_blocks=2, vert_stride=6, homo_head=homo)
        assert torch.equal(ours.expand_as(vllm), vllm)


@pytest.mark.parametrize("num_kv_heads", [None, 2])
def test_local_stride_module_matches_dense(num_kv_heads):
    HQ, H, D, lengths = 4, 2, 64, [320, 75, 200]
    attn = LocalStrideSparseAttention(HQ, 320, 64, 2, 3, num_kv_heads=num_kv_heads)
    assert attn.block_sparse_pattern.shape[0] == (num_kv_heads or HQ)
    q, k, v = inputs(sum(lengths), HQ, H, D, torch.bfloat16, seed=2)
    out = attn(q, k, v, cu_seqlens=cu_seqlens_from_lengths(lengths))
    check_against_dense(out, q, k, v, lengths, q_head_pattern(attn.block_sparse_pattern, HQ, H))
    assert attn.layout_for(HQ, H, "cpu")[1] == (num_kv_heads is None)   # sliding per query head: K/V repeat


@pytest.mark.parametrize("ctor, err, match", [
    (lambda: SparseAttention(32, torch.ones(2, 2, dtype=torch.bool)), ValueError, "block_size"),
    (lambda: SparseAttention(64, torch.ones(2, 3, dtype=torch.bool)), ValueError, "block_sparse_pattern"),
    (lambda: SparseAttention(64, torch.ones(2, 2)), TypeError, "block_sparse_pattern"),
    (lambda: SparseAttention(64, "dense"), TypeError, "block_sparse_pattern"),
    (lambda: SparseAttention(64, torch.ones(2, 2, dtype=torch.bool), seq_dim=3), ValueError, "seq_dim"),
    (lambda: SparseAttention(64, torch.ones(2, 2, dtype=torch.bool), causal=1), TypeError, "causal"),
    (lambda: SparseAttention(64, torch.ones(2, 2, dtype=torch.bool), backend="x"), ValueError, "backend"),
    (lambda: LocalStrideSparseAttention(4, 512, 16, 2, 2), ValueError, "block_size"),
    (lambda: LocalStrideSparseAttention(4, 512, 64, 0, 2), ValueError, "local_blocks"),
    (lambda: LocalStrideSparseAttention(4, 512, 64, 2, 2, homo_head="no"), TypeError, "homo_head"),
    (lambda: LocalStrideSparseAttention(4, 512, 64, 2, 2, num_kv_heads=3), ValueError, "num_kv_heads"),
])
def test_bad_constructor_arguments(ctor, err, match):
    with pytest.raises(err, match=match):
        ctor()


def test_empty_batches_and_sequences():
    attn = SparseAttention(64, torch.ones(2, 2, dtype=torch.bool).tril())
    q, k = torch.randn(2, 100, 4, 64, requires_grad=True), torch.randn(2, 100, 2, 64)
    assert attn(q[:0], k[:0], k[:0]).shape == (0, 100, 4, 64)
    assert attn(q[:, :0], k[:, :0], k[:, :0]).shape == (2, 0, 4, 64)
    out = attn(q, k, k, seqlens=torch.tensor([0, 100]))
    full = attn(q[1:], k[1:], k[1:])
    assert bool((out[0] == 0).all()) and torch.equal(out[1], full[0])
    out.sum().backward()
    assert bool((q.grad[0] == 0).all()) and q.grad[1].abs().sum() > 0


def test_bad_call_arguments():
    attn = SparseAttention(64, make_pattern("kv", 4, 2, 2))
    q, k, v = inputs(100, 4, 2, 64, torch.float32)
    cu = cu_seqlens_from_lengths([60, 40])
    with pytest.raises(ValueError, match="cu_seqlens is required"):
        attn(q, k, v)
    with pytest.raises(ValueError, match="cu_seqlens must end at"):
        attn(q, k, v, cu_seqlens=cu_seqlens_from_lengths([60, 30]))
    with pytest.raises(ValueError, match="max_seqlen=300 exceeds"):
        attn(q, k, v, cu_seqlens=cu, max_seqlen=300)
    with pytest.raises(ValueError, match="cu_seqlen_q and cu_seqlen_k"):
        attn(q, k, v, cu_seqlen_q=cu, cu_seqlen_k=cu_seqlens_from_lengths([50, 50]))
    with pytest.raises(ValueError, match="sm_scale"):
        attn(q, k, v, -1.0, cu_seqlens=cu)
    with pytest.raises(ValueError, match="block_sparse_pattern has 2 heads; q has 6"):
        attn(*inputs(100, 6, 3, 64, torch.float32), cu_seqlens=cu)
    with pytest.raises(ValueError, match="q has 4 heads and k has 3"):
        attn(q, *inputs(100, 3, 3, 64, torch.float32)[1:], cu_seqlens=cu)
    q4, k4, v4 = (t.detach()[None] for t in (q, k, v))          # [1, 100, H, D]
    with pytest.raises(ValueError, match="cu_seqlens is for packed"):
        attn(q4, k4, v4, cu_seqlens=cu)
    with pytest.raises(ValueError, match="seqlens"):
        attn(q4, k4, v4, seqlens=torch.tensor([101]))
    with pytest.raises(ValueError, match="not both"):
        attn(q4, k4, v4, seqlens=torch.tensor([50]), left_paddings=torch.tensor([2]))
    with pytest.raises(ValueError, match="k and v must have q's batch"):
        attn(q4, k4[:, :90], v4[:, :90])
    long = torch.zeros(1, 200, 4, 64)
    with pytest.raises(ValueError, match="pattern covers 128"):
        attn(long, long[:, :, :2], long[:, :, :2])
    # dkernel's spelling of the lengths, both the same: accepted
    out = attn(q, k, v, cu_seqlen_q=cu, cu_seqlen_k=cu.clone())
    torch.testing.assert_close(out, attn(q, k, v, cu_seqlens=cu), rtol=0, atol=0)


# ------------------------------------------------------------------------------------ GPU (kernels)
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("G, kind", [(1, "kv"), (2, "q_agree"), (4, "q_differ"), (4, "shared")])
def test_gpu_packed_ragged_batch_matches_dense(dtype, D, G, kind):
    H, lengths = 2, [1000, 64, 517, 1]
    HQ = G * H
    NB = -(-1000 // BS)
    pattern = make_pattern(kind, HQ, H, NB, seed=G)
    attn = SparseAttention(BS, pattern).cuda()
    q, k, v = inputs(sum(lengths), HQ, H, D, dtype, device="cuda", seed=D + G)
    out = attn(q, k, v, cu_seqlens=cu_seqlens_from_lengths(lengths, "cuda"))
    p3 = pattern if pattern.dim() == 3 else pattern[None]
    check_against_dense(out, q, k, v, lengths, q_head_pattern(p3, HQ, H))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("seq_dim", [1, 2])
def test_gpu_local_stride_batch_first_right_padding(dtype, D, seq_dim):
    B, T, HQ, H = 2, 700, 8, 2
    attn = LocalStrideSparseAttention(HQ, 1024, 128, 2, 3, seq_dim=seq_dim).cuda()
    g = torch.Generator().manual_seed(D)
    shape = lambda h: (B, T, h, D) if seq_dim == 1 else (B, h, T, D)       # noqa: E731
    q, k, v = [torch.randn(*shape(h), generator=g).to("cuda", dtype).requires_grad_() for h in (HQ, H, H)]
    lens = torch.tensor([700, 333])
    out = attn(q, k, v, seqlens=lens.cuda())
    valid = torch.arange(T)[None] < lens[:, None]

    def pick(x):
        x = _to_bthd(x, seq_dim)
        return x.reshape(B * T, *x.shape[2:])[valid.reshape(-1).cuda()]

    tok = attn.block_sparse_pattern.cpu().repeat_interleave(2, 1).repeat_interleave(2, 2)   # 128 -> 64 blocks
    check_against_dense(out, q, k, v, lens.tolist(), tok, out_pick=pick)
