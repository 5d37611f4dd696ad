"""`pool_blocks` (infllm_cupy/stage1/pool.py, device-side tensor code) against its oracle `naive_pool_blocks`:
bit for bit on random bf16/fp16/fp32 scores, ragged batches, cache_lens > 0, one-token and empty
sequences, garbage past each sequence's fine keys, -inf/+inf/NaN and signed-zero entries, block sizes
and strides other than 64/16, and inputs large enough to take several slices. CPU tests, and the same
checks on CUDA tensors (gpu-marked)."""
from __future__ import annotations

import pytest
import torch

from infllm_cupy.stage1 import pool as pool_mod
from infllm_cupy.stage1.naive import naive_pool_blocks
from infllm_cupy.stage1.pool import pool_blocks
from infllm_cupy.testing import cu_seqlens_from_lengths

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _cu(lengths, device):
    return cu_seqlens_from_lengths(lengths).to(device)


def _scores(H, T, W, dtype, *, seed, device, specials=False):
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(H, T, W, generator=g).to(dtype)
    if specials:
        pick = torch.rand(H, T, W, generator=g)
        s = torch.where(pick < 0.03, torch.full_like(s, float("-inf")), s)
        s = torch.where((pick >= 0.03) & (pick < 0.05), torch.full_like(s, float("inf")), s)
        s = torch.where((pick >= 0.05) & (pick < 0.06), torch.full_like(s, float("nan")), s)
        s = torch.where((pick >= 0.06) & (pick < 0.10), torch.full_like(s, -0.0), s)
        s = torch.where((pick >= 0.10) & (pick < 0.14), torch.zeros_like(s), s)
    return s.to(device)


def _same(a, b):
    """Bitwise equality, NaN payloads and the sign of zero included."""
    assert a.shape == b.shape and a.dtype == b.dtype
    if a.dtype == torch.float32:
        ia, ib = a.view(torch.int32), b.view(torch.int32)
    elif a.dtype == torch.float64:
        ia, ib = a.view(torch.int64), b.view(torch.int64)
    else:
        ia, ib = a.view(torch.int16), b.view(torch.int16)
    assert torch.equal(ia, ib)


CASES = [
    # lq, n1s, cache, init, local, block_size, stride
    ([70, 5, 200], [40, 3, 23], [0, 130, 64], 1, 2, 64, 16),
    ([1, 1, 1], [0, 1, 30], [0, 63, 900], 1, 32, 64, 16),             # decode-like: one token each, n1 0
    ([300], [17], None, 1, 32, 64, 16),
    ([33, 0, 150], [2, 0, 60], [5, 7, 0], 0, 1, 64, 16),              # an empty sequence in the middle
    ([90, 40], [25, 9], [0, 17], 2, 3, 32, 16),                       # w = 2
    ([300, 70], [70, 35], [3, 0], 0, 0, 128, 16),                     # w = 8
    ([50, 20], [13, 6], [100, 0], 1, 4, 48, 16),                      # w = 3
    ([200], [200], [10], 0, 0, 64, 64),                               # w = 1
    ([200, 12], [30, 2], [0, 0], 1, 0, 64, 8),                        # w = 8, no local window
]


def _check(case, dtype, device, *, specials, cache_as="tensor", width_extra=5, seed=0):
    lq, n1s, cache, init, local, bs, stride = case
    H = 3
    W = max(n1s) + width_extra
    s = _scores(H, sum(lq), W, dtype, seed=seed, device=device, specials=specials)
    cu_q, cu_k = _cu(lq, device), _cu(n1s, device)
    if cache is not None and cache_as == "tensor":
        cl = torch.tensor(cache, dtype=torch.int32, device=device)
    else:
        cl = cache
    kw = dict(init_blocks=init, local_blocks=local, block_size=bs, kernel_stride=stride)
    want = naive_pool_blocks(s, cu_q, cu_k, cl, max(lq), **kw)
    got = pool_blocks(s, cu_q, cu_k, cl, max(lq), **kw)
    _same(got, want)
    # a longer max_seqlen_q widens the output the same way
    _same(pool_blocks(s, cu_q, cu_k, cl, max(lq) + 70, **kw),
          naive_pool_blocks(s, cu_q, cu_k, cl, max(lq) + 70, **kw))
    return got


def _run_all(device):
    for dtype in DTYPES:
        for ci, case in enumerate(CASES):
            for specials in (False, True):
                _check(case, dtype, device, specials=specials, seed=ci)
        _check(CASES[0], dtype, device, specials=True, cache_as="list")
        _check(CASES[0], dtype, device, specials=True, width_extra=0)
        _check(CASES[0], dtype, device, specials=True, width_extra=400)   # more columns than any window reads


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ci", range(len(CASES)))
@pytest.mark.parametrize("specials", [False, True])
def test_pool_blocks_equals_reference(dtype, ci, specials):
    got = _check(CASES[ci], dtype, "cpu", specials=specials, seed=ci)
    if specials:
        assert torch.isnan(got).any() or CASES[ci][1] == [0, 1, 30]


@pytest.mark.parametrize("cache_as", ["tensor", "list", "none"])
def test_pool_blocks_cache_lens_forms(cache_as):
    case = CASES[0] if cache_as != "none" else CASES[2]
    _check(case, torch.bfloat16, "cpu", specials=True, cache_as=cache_as)


@pytest.mark.parametrize("width_extra", [0, 1, 400])
def test_pool_blocks_score_width(width_extra):
    _check(CASES[0], torch.float16, "cpu", specials=True, width_extra=width_extra)


def test_pool_blocks_non_contiguous_scores_and_float64():
    lq, n1s, cache = [70, 5, 200], [40, 3, 23], [0, 130, 64]
    s = _scores(3, sum(lq), 48, torch.float32, seed=4, device="cpu", specials=True)
    t = s.transpose(0, 1).contiguous().transpose(0, 1)           # [H, T, W] with token-major strides
    cu_q, cu_k, cl = _cu(lq, "cpu"), _cu(n1s, "cpu"), torch.tensor(cache, dtype=torch.int32)
    _same(pool_blocks(t, cu_q, cu_k, cl, 200), naive_pool_blocks(s, cu_q, cu_k, cl, 200))
    d = s.double()
    _same(pool_blocks(d, cu_q, cu_k, cl, 200), naive_pool_blocks(d, cu_q, cu_k, cl, 200))


def test_pool_blocks_in_several_slices(monkeypatch):
    """A slice budget far below the input: many token slices and one head per slice give the same bits."""
    lq, n1s, cache = [70, 5, 200], [40, 3, 23], [0, 130, 64]
    s = _scores(3, sum(lq), 48, torch.bfloat16, seed=5, device="cpu", specials=True)
    cu_q, cu_k, cl = _cu(lq, "cpu"), _cu(n1s, "cpu"), torch.tensor(cache, dtype=torch.int32)
    want = naive_pool_blocks(s, cu_q, cu_k, cl, 200)
    for budget in (1, 50, 1000, 3 * 275 * 30):
        monkeypatch.setattr(pool_mod, "_SLICE_ELEMS", budget)
        _same(pool_blocks(s, cu_q, cu_k, cl, 200), want)


def test_pool_blocks_empty_and_errors():
    s = torch.zeros(2, 0, 4)
    cu0 = torch.tensor([0, 0], dtype=torch.int32)
    assert pool_blocks(s, cu0, cu0, [0], 0).shape == (2, 0, 0)
    assert pool_blocks(s, cu0, cu0, [70], 0).shape == (2, 0, 2)
    lq, n1s = [10, 4], [3, 1]
    s = torch.randn(2, 14, 3)
    cu_q, cu_k = _cu(lq, "cpu"), _cu(n1s, "cpu")
    with pytest.raises(ValueError, match="columns"):
        pool_blocks(s[..., :2], cu_q, cu_k, None, 10)
    with pytest.raises(ValueError, match="max_seqlen_q"):
        pool_blocks(s, cu_q, cu_k, None, 9)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        pool_blocks(s, torch.tensor([0, 10, 13], dtype=torch.int32), cu_k, None, 10)
    with pytest.raises(ValueError, match="cu_seqlens_c1"):
        pool_blocks(s, cu_q, torch.tensor([0, 3, 2], dtype=torch.int32), None, 10)
    with pytest.raises(ValueError, match="cache_lens"):
        pool_blocks(s, cu_q, cu_k, torch.tensor([0, -1], dtype=torch.int32), 10)
    with pytest.raises(ValueError, match="cache_lens"):
        pool_blocks(s, cu_q, cu_k, [0], 10)
    with pytest.raises(TypeError, match="cu_seqlens_q"):
        pool_blocks(s, cu_q.long(), cu_k, None, 10)
    with pytest.raises(ValueError, match="multiple"):
        pool_blocks(s, cu_q, cu_k, None, 10, block_size=40)


@pytest.mark.gpu
def test_pool_blocks_equals_reference_gpu():
    _run_all("cuda")
    lq, n1s, cache = [70, 5, 200], [40, 3, 23], [0, 130, 64]
    s = _scores(3, sum(lq), 48, torch.bfloat16, seed=6, device="cuda", specials=True)
    cu_q, cu_k, cl = _cu(lq, "cuda"), _cu(n1s, "cuda"), torch.tensor(cache, dtype=torch.int32, device="cuda")
    _same(pool_blocks(s, cu_q, cu_k, cl, 200), naive_pool_blocks(s, cu_q, cu_k, cl, 200).cuda())


@pytest.mark.gpu
def test_pool_blocks_large_gpu():
    """A MiniCPM4-sized prefill (2 heads, 16k + 3000 tokens, every fine key): several slices, equal to the
    reference."""
    lq = [16384, 3000]
    n1s = [(L - 32) // 16 + 1 for L in lq]
    s = _scores(2, sum(lq), max(n1s), torch.bfloat16, seed=7, device="cuda")
    cu_q, cu_k = _cu(lq, "cuda"), _cu(n1s, "cuda")
    cl = torch.tensor([0, 512], dtype=torch.int32, device="cuda")
    _same(pool_blocks(s, cu_q, cu_k, cl, max(lq)), naive_pool_blocks(s, cu_q, cu_k, cl, max(lq)))
