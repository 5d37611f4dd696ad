"""Non-finite and degenerate inputs (docs/reliability.md, "Non-finite inputs" and "Zero-length
sequences"), for the references on CPU and the kernels on the GPU:

- NaN or inf in one sequence never changes another sequence's rows: they are bit-identical to a run
  with that sequence cleaned (forward, and the backward's dq, dk, dv);
- a non-finite q row changes only its own (token, head) row of out and lse;
- a NaN key reaches exactly the rows that attend it (selected block, causally visible); an inf key
  never reaches a row that does not attend it;
- a non-finite value stays within its sequence and its KV head's query heads;
- every op takes batches with zero-length (and one-token) sequences; the calls finish (no hang).
"""
import pytest
import torch

from infllm_cupy import (
    BlockLayout,
    DecodeCache,
    InfLLMv2Config,
    block_sparse_attn_varlen,
    compress_k,
    infllmv2_attention,
    infllmv2_decode,
    sparse_attn_varlen,
    sparse_decode,
    stage1_select,
)
from infllm_cupy.patterns import local_stride, pattern_decode
from infllm_cupy.testing import cu_seqlens_from_lengths

from conftest import HOPPER

# (device, kernel argument): the reference on CPU; the kernels (SM80 and, on Hopper, sm_90a) on the GPU
RUNS = [pytest.param("cpu", "auto", id="reference"),
        pytest.param("cuda", "sm80", id="sm80", marks=pytest.mark.gpu),
        pytest.param("cuda", "sm90a", id="sm90a", marks=[pytest.mark.gpu, pytest.mark.skipif(
            not HOPPER, reason="sm_90a kernels need capability 9.0")])]

LENS = [150, 97, 64]                      # three sequences; the middle one gets the non-finite values
HQ, H, D, K = 8, 2, 64, 4


def _inputs(dev, seed=0):
    g = torch.Generator().manual_seed(seed)
    dt = torch.float32 if dev == "cpu" else torch.bfloat16
    T = sum(LENS)
    q, k, v = (torch.randn(T, n, D, generator=g).to(dev, dt) for n in (HQ, H, H))
    cu = cu_seqlens_from_lengths(LENS, dev)
    # every token: block 0, its own block, one random earlier block, a -1
    pos = torch.cat([torch.arange(L) for L in LENS])
    own = pos // 64
    rnd = (torch.rand(H, T, generator=g) * (own + 1)).long()
    idx = torch.stack([torch.zeros(H, T, dtype=torch.long), own.expand(H, T), rnd,
                       torch.full((H, T), -1)], -1).to(torch.int32).to(dev)
    return q, k, v, cu, idx


def _run(q, k, v, cu, idx, kernel, grads=False, seed=1):
    leaves = [t.clone().requires_grad_(grads) for t in (q, k, v)]
    out, lse = sparse_attn_varlen(*leaves, cu, cu, idx, max(LENS), max(LENS), return_lse=True, kernel=kernel)
    if not grads:
        return out.detach(), lse, None
    g = torch.Generator().manual_seed(seed)
    do = torch.randn(out.shape, generator=g).to(out.device, out.dtype)
    return out.detach(), lse, torch.autograd.grad(out, leaves, do)


def _rows(b):
    s = sum(LENS[:b])
    return slice(s, s + LENS[b])


def _same(a, b):
    """Bit-identical, NaN included."""
    return a.shape == b.shape and bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())


@pytest.mark.parametrize("dev, kernel", RUNS)
@pytest.mark.parametrize("where", ["q", "k", "v"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
def test_non_finite_values_never_cross_sequences(dev, kernel, where, value):
    q, k, v, cu, idx = _inputs(dev)
    clean = _run(q, k, v, cu, idx, kernel, grads=True)
    bad = {"q": q.clone(), "k": k.clone(), "v": v.clone()}
    r = _rows(1)
    bad[where][r.start + 3: r.start + 70, :, 5] = value          # spread over the middle sequence's blocks
    dirty = _run(bad["q"], bad["k"], bad["v"], cu, idx, kernel, grads=True)
    for b in (0, 2):
        rb = _rows(b)
        assert _same(dirty[0][rb], clean[0][rb]), f"out of sequence {b} changed"
        assert _same(dirty[1][:, rb], clean[1][:, rb]), f"lse of sequence {b} changed"
        for name, gd, gc in zip(("dq", "dk", "dv"), dirty[2], clean[2]):
            assert _same(gd[rb], gc[rb]), f"{name} of sequence {b} changed"
    assert not torch.isfinite(dirty[0][r]).all(), "the non-finite values reached nothing at all"


@pytest.mark.parametrize("dev, kernel", RUNS)
@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_a_non_finite_query_changes_only_its_own_row(dev, kernel, value):
    q, k, v, cu, idx = _inputs(dev)
    out, lse, _ = _run(q, k, v, cu, idx, kernel)
    t, hq = _rows(1).start + 40, 3
    q2 = q.clone()
    q2[t, hq, 7] = value
    out2, lse2, _ = _run(q2, k, v, cu, idx, kernel)
    changed = ~((out2 == out) | (torch.isnan(out2) & torch.isnan(out))).all(-1)            # [T, HQ]
    changed |= ~((lse2 == lse) | (torch.isnan(lse2) & torch.isnan(lse))).T
    assert changed[t, hq] and int(changed.sum()) == 1, f"rows changed: {changed.nonzero().tolist()}"


@pytest.mark.parametrize("dev, kernel", RUNS)
def test_a_nan_key_reaches_exactly_the_rows_that_attend_it(dev, kernel):
    q, k, v, cu, idx = _inputs(dev)
    r = _rows(0)
    j, h = r.start + 70, 1                                         # key 70 of sequence 0, block 1, KV head 1
    k2 = k.clone()
    k2[j, h, 0] = float("nan")
    out, _lse, _ = _run(q, k2, v, cu, idx, kernel)
    G = HQ // H
    pos = torch.arange(LENS[0])
    attends = ((idx[h, r].long().cpu() == 1).any(-1) & (pos >= 70))             # [L0]
    bad = ~torch.isfinite(out).all(-1).cpu()                                   # [T, HQ]
    want = torch.zeros_like(bad)
    want[r.start + pos[attends], h * G:(h + 1) * G] = True
    assert attends.any() and (~attends[70:]).any(), "the case must have rows on both sides"
    assert torch.equal(bad, want), f"{int((bad != want).sum())} rows differ from the attending set"


@pytest.mark.parametrize("dev, kernel", RUNS)
@pytest.mark.parametrize("value", [float("inf"), float("-inf")], ids=["inf", "-inf"])
def test_an_infinite_key_stays_out_of_rows_that_do_not_attend_it(dev, kernel, value):
    q, k, v, cu, idx = _inputs(dev)
    clean, clean_lse, _ = _run(q, k, v, cu, idx, kernel)
    r = _rows(0)
    j, h = r.start + 70, 1
    k2 = k.clone()
    k2[j, h, 0] = value
    out, lse, _ = _run(q, k2, v, cu, idx, kernel)
    G = HQ // H
    pos = torch.arange(LENS[0])
    attends = ((idx[h, r].long().cpu() == 1).any(-1) & (pos >= 70))
    keep = torch.ones(out.shape[:2], dtype=torch.bool)
    keep[r.start + pos[attends], h * G:(h + 1) * G] = False
    keep = keep.to(out.device)
    assert _same(out[keep], clean[keep]) and _same(lse.T[keep], clean_lse.T[keep])


@pytest.mark.parametrize("dev, kernel", RUNS)
def test_a_non_finite_value_stays_in_its_kv_head(dev, kernel):
    q, k, v, cu, idx = _inputs(dev)
    clean, _, _ = _run(q, k, v, cu, idx, kernel)
    v2 = v.clone()
    v2[_rows(0).start + 70, 1, 0] = float("nan")                   # KV head 1
    out, _, _ = _run(q, k, v2, cu, idx, kernel)
    G = HQ // H
    assert _same(out[:, :G], clean[:, :G]), "KV head 0's query heads changed"
    assert not torch.isfinite(out[:, G:]).all()


# ------------------------------------------------------------------------------------------------
# zero-length sequences: every op takes them (the decode step excepted: its cache must hold the
# current token, docs/reliability.md)
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dev, kernel", RUNS)
@pytest.mark.parametrize("lens", [[0, 130, 0, 1, 0], [0], [0, 0]], ids=["ragged", "one-empty", "all-empty"])
def test_zero_length_sequences_work_in_every_op(dev, kernel, lens):
    dt = torch.float32 if dev == "cpu" else torch.bfloat16
    g = torch.Generator().manual_seed(0)
    T, B = sum(lens), len(lens)
    q, k, v = (torch.randn(T, n, D, generator=g).to(dev, dt) for n in (HQ, H, H))
    cu = cu_seqlens_from_lengths(lens, dev)
    m = max(lens)
    ck1, cu1 = compress_k(k, cu, 32, 16)
    ck2, cu2 = compress_k(k, cu, 128, 64)
    assert ck1.shape[0] == sum(max(0, (L - 32) // 16 + 1) for L in lens)
    idx = stage1_select(q, ck1, ck2, cu, cu1, cu2, m, topk=2, local_blocks=1, kernel=kernel)
    out = sparse_attn_varlen(q, k, v, cu, cu, idx, m, m, kernel=kernel)
    assert out.shape == q.shape and bool(torch.isfinite(out).all())
    lay = BlockLayout(torch.ones(B, H, 3, 3, dtype=torch.bool, device=dev))
    out2 = block_sparse_attn_varlen(q, k, v, cu, cu, lay, m, m, kernel=kernel)
    assert out2.shape == q.shape and bool(torch.isfinite(out2).all())
    pat = local_stride(H, m + 2, local_blocks=1, vert_stride=2)
    out3 = block_sparse_attn_varlen(q, k, v, cu, cu, pat, m, m, kernel=kernel)
    assert out3.shape == q.shape
    pipe = infllmv2_attention(q, k, v, cu, cu, m, m,
                              config=InfLLMv2Config(topk=2, local_blocks=1, dense_len=64))
    assert pipe.shape == q.shape and bool(torch.isfinite(pipe).all())
    # decode: a cache holding these sequences (a 0-token chunk appends nothing), sparse_decode over it
    cache = DecodeCache.contiguous(B, m + 2, H, D, dtype=dt, device=dev)
    cache.append(k, v, cu)
    assert cache.lengths() == lens
    qd = torch.randn(B, HQ, D, generator=g).to(dev, dt)
    o, lse = sparse_decode(qd, cache, return_lse=True)
    empty = torch.tensor([L == 0 for L in lens], device=dev)
    assert bool((o[empty] == 0).all()) and bool(torch.isinf(lse[empty]).all())
    assert pattern_decode(qd, cache, pat).shape == qd.shape
    # the decode step needs the current token in every sequence's cache: a clear error otherwise
    if 0 in lens:
        with pytest.raises(ValueError, match="every sequence must hold at least the current token"):
            infllmv2_decode(qd, cache)
