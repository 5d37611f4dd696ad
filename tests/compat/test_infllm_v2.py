"""The `infllm_v2` compat module against direct transcriptions of the original's semantics.

Each `_orig_*` below transcribes the original package's behaviour as the spec describes it
(/work/shared/spec/infllm_v2.md sections 4-8: the CUDA kernels' loops and index rules), written
independently of infllm_cupy's references. CPU tensors, so the reference path runs.
"""
import importlib
import math
import subprocess
import sys

import pytest
import torch

import infllm_cupy.compat
from infllm_cupy.compat import infllm_v2 as iv2


def _cu(lengths):
    return torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32)


# ---------------------------------------------------------------------------------------------
# transcriptions of the original (spec sections 4.3, 5, 7.1, 8, 13)
# ---------------------------------------------------------------------------------------------

def _cdiv(a, b):  # C integer division, truncating toward zero
    return a // b if a >= 0 else -((-a) // b)


def _orig_topk_to_uint64(topk_idx, max_seqlen_k, block_size):
    """topk_to_uint64.cuh: per row and word, OR in the bits of the row's indices in that word's range;
    -1 is skipped explicitly, other negatives fail `idx >= bit_start`. Words as int64 bit patterns."""
    k_blocks = (max_seqlen_k + block_size - 1) // block_size
    n_words = (k_blocks + 63) // 64
    rows = topk_idx.reshape(-1, topk_idx.shape[-1]).tolist()
    out = []
    for row in rows:
        words = []
        for w in range(n_words):
            bit_start, word = w * 64, 0
            for idx in row:
                if idx == -1:
                    continue
                if bit_start <= idx < bit_start + 64:
                    word |= 1 << (idx - bit_start)
            words.append(word - (1 << 64) if word >= 1 << 63 else word)
        out.append(words)
    return torch.tensor(out, dtype=torch.int64).reshape(tuple(topk_idx.shape[:-1]) + (n_words,)), k_blocks


def _orig_pool(score, cu_q, cu_k1, cache_lens, max_seqlen_q, local_blocks, init_blocks, block_size=64,
               stride=16):
    """max_pooling_1d.cuh varlen kernel (spec 5), one element at a time."""
    w = block_size // stride
    out_len = (max_seqlen_q + max(cache_lens) + block_size - 1) // block_size
    hk, T, _ = score.shape
    out = torch.zeros(hk, T, out_len, dtype=score.dtype)
    for b in range(len(cu_q) - 1):
        qs, Lq, n1 = cu_q[b], cu_q[b + 1] - cu_q[b], cu_k1[b + 1] - cu_k1[b]
        for r in range(Lq):
            off_bq = (r + cache_lens[b]) // block_size
            for j in range(out_len):
                for h in range(hk):
                    if j < init_blocks or (off_bq >= j and off_bq <= j + local_blocks):
                        out[h, qs + r, j] = float("inf")
                    else:
                        lo, hi = max(w * j - 1, 0), min(w * j + w, n1)
                        out[h, qs + r, j] = score[h, qs + r, lo:hi].max() if hi > lo else float("-inf")
    return out


def _orig_compress(k, lengths, kernel, stride):
    outs, ns, s = [], [], 0
    for L in lengths:
        n = 0 if L < kernel else (L - kernel) // stride + 1
        for i in range(n):
            outs.append(k[s + i * stride: s + i * stride + kernel].float().mean(0).to(k.dtype))
        ns.append(n)
        s += L
    return torch.stack(outs), ns


def _orig_stage1(q, k1, k2, lq, n1s, n2s, causal, width):
    """flash_fwd_kernel.h stage 1 (spec 4.2-4.3): coarse-key max/sum, fine-key probabilities, sum of 16
    heads."""
    T, hq, d = q.shape
    hk = k1.shape[1]
    G = hq // hk
    scale = d ** -0.5
    out = torch.zeros(hk, T, width, dtype=torch.float32)

    def limit(r, s, n, Lq):
        return n if not causal else min(n, max(0, _cdiv(r + 1, s) - 1 + n - _cdiv(Lq - s + 1, s)))

    qs = c1 = c2 = 0
    for Lq, n1, n2 in zip(lq, n1s, n2s):
        s2 = 16 if n1 == n2 else 64
        for r in range(Lq):
            l1, l2 = limit(r, 16, n1, Lq), limit(r, s2, n2, Lq)
            if l2 == 0:
                continue
            for h in range(hk):
                qh = q[qs + r, h * G:(h + 1) * G].float()
                s_2 = qh @ k2[c2:c2 + l2, h].float().T
                m = s_2.max(-1, keepdim=True).values
                Z = torch.exp(scale * (s_2 - m)).sum(-1, keepdim=True)
                s_1 = qh @ k1[c1:c1 + l1, h].float().T
                out[h, qs + r, :l1] = (torch.exp(scale * (s_1 - m)) / Z).sum(0)
        qs, c1, c2 = qs + Lq, c1 + n1, c2 + n2
    return out.to(torch.bfloat16)


def _orig_stage2(q, k, v, lq, lk, topk_idx, causal):
    """Spec 7.1: keys of the selected 64-blocks (indices < the sequence's block count), causal bottom-right.
    Returns out and lse [hq, T] (empty row: out 0, lse +inf)."""
    T, hq, d = q.shape
    hk = k.shape[1]
    G = hq // hk
    scale = d ** -0.5
    out = torch.zeros(T, hq, d, dtype=torch.float64)
    lse = torch.full((hq, T), float("inf"), dtype=torch.float64)
    qs = ks = 0
    for Lq, Lk in zip(lq, lk):
        nb = (Lk + 63) // 64
        for r in range(Lq):
            for hh in range(hq):
                h = hh // G
                sel = {int(i) for i in topk_idx[h, qs + r] if 0 <= int(i) < nb}
                keys = [c for c in range(Lk) if c // 64 in sel and (not causal or c <= r + Lk - Lq)]
                if not keys:
                    continue
                s = (k[ks + torch.tensor(keys), h].double() @ q[qs + r, hh].double()) * scale
                p = torch.softmax(s, 0)
                out[qs + r, hh] = p @ v[ks + torch.tensor(keys), h].double()
                lse[hh, qs + r] = torch.logsumexp(s, 0)
        qs, ks = qs + Lq, ks + Lk
    return out, lse


# ---------------------------------------------------------------------------------------------
# bit masks
# ---------------------------------------------------------------------------------------------

def test_topk_to_uint64_bit_layout():
    g = torch.Generator().manual_seed(0)
    max_seqlen_k = 64 * 100  # 100 blocks -> 2 words; indices 100..127 are kept, >= 128 dropped
    idx = torch.randint(-1, 100, (2, 7, 12), generator=g, dtype=torch.int32)
    idx[0, 0, :6] = torch.tensor([63, 64, 0, 127, 128, -5], dtype=torch.int32)  # bit 63 = the sign bit
    got, k_blocks = iv2.topk_to_uint64(idx, max_seqlen_k, 64)
    want, want_blocks = _orig_topk_to_uint64(idx, max_seqlen_k, 64)
    assert got.dtype == torch.int64 and got.shape == (2, 7, 2)
    assert k_blocks == want_blocks == 100
    assert torch.equal(got, want)
    assert got[0, 0, 0] < 0  # bit 63 set
    # 4-D input, as infllmv2_attn_with_kvcache passes it
    idx4 = idx.reshape(1, 2, 7, 12)
    got4, _ = iv2.topk_to_uint64(idx4, max_seqlen_k, 64)
    assert torch.equal(got4, want.reshape(1, 2, 7, 2))
    # the reused buffer is the output
    buf = torch.full((2, 7, 2), 7, dtype=torch.int64)
    res, _ = iv2.topk_to_uint64(idx, max_seqlen_k, 64, memory_buffer=buf)
    assert res is buf and torch.equal(buf, want)
    conv = iv2.TopkToUint64Converter()
    a, _ = conv.convert(idx, max_seqlen_k, 64)
    b, _ = conv.convert(idx, max_seqlen_k, 64)
    assert a is b and torch.equal(b, want)
    with pytest.raises(TypeError):
        iv2.topk_to_uint64(idx.long(), max_seqlen_k, 64)


def test_uint64_bool_roundtrip():
    g = torch.Generator().manual_seed(1)
    mask = torch.rand(3, 5, 130, generator=g) < 0.4
    mask[0, 0, 63] = True
    words, n = iv2.blockmask_to_uint64(mask)
    assert n == 130 and words.shape == (3, 5, 3) and words.dtype == torch.int64
    # bit j of word j // 64, checked against the topk transcription of the same sets
    idx = torch.full((3, 5, 130), -1, dtype=torch.int32)
    for i, row in enumerate(mask.reshape(-1, 130)):
        sel = row.nonzero().flatten()
        idx.view(-1, 130)[i, :len(sel)] = sel.int()
    want, _ = _orig_topk_to_uint64(idx, 130 * 64, 64)
    assert torch.equal(words, want)
    assert torch.equal(iv2.uint64_to_bool(words, 130), mask)


def _orig_uint64_to_bool(words, last_dim_size):
    """uint64_to_bool.cuh: out[row, col] = bit col % 64 of word col // 64 of the row."""
    lead = tuple(words.shape[:-1])
    rows = words.reshape(-1, words.shape[-1]).tolist() if words.numel() else []
    out = [[bool((w % (1 << 64)) >> (c % 64) & 1)
            for c, w in ((c, row[c // 64]) for c in range(last_dim_size))]
           for row in rows]
    return torch.tensor(out, dtype=torch.bool).reshape(lead + (last_dim_size,))


def _orig_blockmask_to_uint64(mask):
    """blockmask_to_uint64.cuh: word w of a row ORs bit b for every set column 64 w + b < n."""
    n = mask.shape[-1]
    n_words = (n + 63) // 64
    out = []
    for row in mask.reshape(-1, n).tolist():
        words = []
        for w in range(n_words):
            word = 0
            for b in range(64):
                if 64 * w + b < n and row[64 * w + b]:
                    word |= 1 << b
            words.append(word - (1 << 64) if word >= 1 << 63 else word)
        out.append(words)
    return torch.tensor(out, dtype=torch.int64).reshape(tuple(mask.shape[:-1]) + (n_words,)), n


def _bitmask_checks(device):
    """The three helpers against the transcriptions: random rows with -1 padding, other negatives, indices
    past k_blocks (kept up to the last word) and past the last word (dropped), duplicates, bit 63, widths
    that are not multiples of 64, non-contiguous inputs, int64 and uint64 words."""
    g = torch.Generator().manual_seed(21)
    for max_seqlen_k, shape in ((64 * 100, (2, 7, 12)), (64 * 64, (3, 5, 40)), (1, (1, 4, 3)),
                                (64 * 200, (1, 2, 3, 9)), (64 * 129, (2, 1, 200))):
        k_blocks = -(-max_seqlen_k // 64)
        hi = 64 * ((k_blocks + 63) // 64) + 5
        idx = torch.randint(-3, hi, shape, generator=g, dtype=torch.int32)
        flat = idx.view(-1, shape[-1])
        flat[0, :4] = torch.tensor([63, 63, -1, -(2 ** 31)], dtype=torch.int32)[:shape[-1]]
        want, want_blocks = _orig_topk_to_uint64(idx, max_seqlen_k, 64)
        got, got_blocks = iv2.topk_to_uint64(idx.to(device), max_seqlen_k, 64)
        assert got_blocks == want_blocks and got.device.type == torch.device(device).type
        assert torch.equal(got.cpu(), want)
        # a non-contiguous index tensor
        wide = torch.randint(-1, hi, shape[:-1] + (2 * shape[-1],), generator=g, dtype=torch.int32)
        got, _ = iv2.topk_to_uint64(wide.to(device)[..., ::2], max_seqlen_k, 64)
        assert torch.equal(got.cpu(), _orig_topk_to_uint64(wide[..., ::2].contiguous(), max_seqlen_k, 64)[0])
    for n in (1, 63, 64, 65, 130, 257):
        mask = torch.rand(3, 4, n, generator=g) < 0.4
        mask[0, 0, min(63, n - 1)] = True
        want, want_n = _orig_blockmask_to_uint64(mask)
        got, got_n = iv2.blockmask_to_uint64(mask.to(device))
        assert got_n == want_n == n and torch.equal(got.cpu(), want)
        got_t, _ = iv2.blockmask_to_uint64(mask.to(device).transpose(0, 1))           # non-contiguous
        assert torch.equal(got_t.cpu(), _orig_blockmask_to_uint64(mask.transpose(0, 1).contiguous())[0])
        words = torch.randint(-(2 ** 63), 2 ** 63 - 1, (2, 3, (n + 63) // 64), generator=g, dtype=torch.int64)
        for last in (n, max(0, n - 7)):
            want_b = _orig_uint64_to_bool(words, last)
            assert torch.equal(iv2.uint64_to_bool(words.to(device), last).cpu(), want_b)
            if hasattr(torch, "uint64"):
                assert torch.equal(iv2.uint64_to_bool(words.to(device).view(torch.uint64), last).cpu(),
                                   want_b)
        assert torch.equal(iv2.uint64_to_bool(got, n).cpu(), mask)


def test_bitmask_helpers_equal_the_original_kernels():
    _bitmask_checks("cpu")
    with pytest.raises(TypeError, match="uint64_array"):
        iv2.uint64_to_bool(torch.zeros(2, 1, dtype=torch.int32), 10)
    with pytest.raises(ValueError, match="exceeds"):
        iv2.uint64_to_bool(torch.zeros(2, 1, dtype=torch.int64), 65)
    # empty shapes
    assert iv2.topk_to_uint64(torch.zeros(0, 3, 4, dtype=torch.int32), 640, 64)[0].shape == (0, 3, 1)
    assert torch.equal(iv2.topk_to_uint64(torch.zeros(2, 3, 0, dtype=torch.int32), 640, 64)[0],
                       torch.zeros(2, 3, 1, dtype=torch.int64))
    assert iv2.topk_to_uint64(torch.zeros(2, 3, 4, dtype=torch.int32), 0, 64)[0].shape == (2, 3, 0)
    assert iv2.blockmask_to_uint64(torch.zeros(2, 0, dtype=torch.bool))[0].shape == (2, 0)


class _NoHostRead:
    """Makes every way of reading a tensor's values on the host raise (CPU tensors stand in for device
    ones)."""
    NAMES = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy", "nonzero")

    def __init__(self, monkeypatch):
        def boom(*a, **k):
            raise AssertionError("host read")
        for name in self.NAMES:
            monkeypatch.setattr(torch.Tensor, name, boom)


def test_bitmask_helpers_and_pooling_read_nothing_back(monkeypatch):
    """No host loop over values, no host read: the helpers run with every host read of a tensor raising;
    so does the pooling with cache_lens known on the host and the value checks off."""
    from infllm_cupy import _env

    g = torch.Generator().manual_seed(22)
    idx = torch.randint(-1, 140, (2, 9, 16), generator=g, dtype=torch.int32)
    mask = torch.rand(2, 9, 130, generator=g) < 0.5
    score = torch.randn(2, 30, 8, generator=g).to(torch.bfloat16)
    cu_q, cu_k = _cu([20, 10]), _cu([8, 3])
    want_pool = iv2.max_pooling_1d_varlen(score, cu_q, cu_k, torch.tensor([0, 70], dtype=torch.int32), 20, 8,
                                          1, 1)
    want_one = iv2.max_pooling_1d(score[:, :20], 70, 1, 1)
    with monkeypatch.context() as m:
        _NoHostRead(m)
        words, _ = iv2.topk_to_uint64(idx, 64 * 140, 64)
        back = iv2.uint64_to_bool(words, 140)
        packed, _ = iv2.blockmask_to_uint64(mask)
        unpacked = iv2.uint64_to_bool(packed, 130)
        with _env.override(validate=False):
            from infllm_cupy.stage1.pool import pool_blocks
            pooled = pool_blocks(score, cu_q, cu_k, [0, 70], 20, local_blocks=1)
            one = iv2.max_pooling_1d(score[:, :20], 70, 1, 1)
    assert torch.equal(words, _orig_topk_to_uint64(idx, 64 * 140, 64)[0])
    assert torch.equal(unpacked, mask) and torch.equal(packed, _orig_blockmask_to_uint64(mask)[0])
    assert back.shape == (2, 9, 140)
    assert torch.equal(pooled, want_pool) and torch.equal(one, want_one)


@pytest.mark.gpu
def test_bitmask_helpers_equal_the_original_kernels_gpu():
    _bitmask_checks("cuda")


@pytest.mark.gpu
def test_bitmask_helpers_and_pooling_do_not_synchronize_gpu():
    """On CUDA tensors, with torch's sync debug mode set to raise: the helpers and the pooling (cache_lens
    as a list, value checks off) never synchronize with the host."""
    from infllm_cupy import _env
    from infllm_cupy.stage1.pool import pool_blocks

    g = torch.Generator().manual_seed(23)
    idx = torch.randint(-1, 140, (2, 9, 16), generator=g, dtype=torch.int32).cuda()
    mask = (torch.rand(2, 9, 130, generator=g) < 0.5).cuda()
    score = torch.randn(2, 30, 8, generator=g).to(torch.bfloat16).cuda()
    cu_q, cu_k = _cu([20, 10]).cuda(), _cu([8, 3]).cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        words, _ = iv2.topk_to_uint64(idx, 64 * 140, 64)
        iv2.uint64_to_bool(words, 140)
        packed, _ = iv2.blockmask_to_uint64(mask)
        iv2.uint64_to_bool(packed, 130)
        with _env.override(validate=False):
            pooled = pool_blocks(score, cu_q, cu_k, [0, 70], 20, local_blocks=1)
            iv2.max_pooling_1d(score[:, :20], 70, 1, 1)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(words.cpu(), _orig_topk_to_uint64(idx.cpu(), 64 * 140, 64)[0])
    want = _orig_pool(score.cpu(), [0, 20, 30], [0, 8, 11], [0, 70], 20, 1, 1)
    assert torch.equal(pooled.cpu(), want)


# ---------------------------------------------------------------------------------------------
# pooling
# ---------------------------------------------------------------------------------------------

def _pool_checks(device, local_blocks, init_blocks):
    g = torch.Generator().manual_seed(2)
    lq, n1s, cache = [70, 5, 200], [40, 3, 23], [0, 130, 64]
    cu_q, cu_k = _cu(lq), _cu(n1s)
    width = 48  # > every n1: entries past n1 are garbage the kernel must not read
    score = torch.randn(2, sum(lq), width, generator=g).to(torch.bfloat16)
    score[0, 3, :8] = float("-inf")
    score[1, 80, 5] = float("inf")
    got = iv2.max_pooling_1d_varlen(score.to(device), cu_q.to(device), cu_k.to(device),
                                    torch.tensor(cache, dtype=torch.int32, device=device), max(lq), width,
                                    local_blocks, init_blocks)
    want = _orig_pool(score, cu_q.tolist(), cu_k.tolist(), cache, max(lq), local_blocks, init_blocks)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape == (2, sum(lq),
                                                                       math.ceil((200 + 130) / 64))
    assert got.device.type == torch.device(device).type
    assert torch.equal(got.cpu(), want)
    assert torch.isneginf(got).any()  # empty windows past n1
    with pytest.raises(ValueError):
        iv2.max_pooling_1d_varlen(score.to(device), cu_q.to(device), cu_k.to(device),
                                  torch.tensor(cache, dtype=torch.int32, device=device), max(lq), width - 1,
                                  local_blocks, init_blocks)
    one = torch.randn(2, 9, 30, generator=g).to(torch.float16)
    got1 = iv2.max_pooling_1d(one.to(device), 300, 3, 1)
    want1 = _orig_pool(one, [0, 9], [0, 30], [300], 9, 3, 1)
    assert got1.dtype == torch.float16 and torch.equal(got1.cpu(), want1)
    # one query token per sequence (decode), cache_lens = L - 1
    lens = [1, 1, 1]
    dec = torch.randn(2, 3, 40, generator=g).to(torch.bfloat16)
    cu1, n1 = _cu(lens), [40, 0, 17]
    cl = [700, 15, 300]
    got2 = iv2.max_pooling_1d_varlen(dec.to(device), cu1.to(device), _cu(n1).to(device),
                                     torch.tensor(cl, dtype=torch.int32, device=device), 1, 40, local_blocks,
                                     init_blocks)
    assert torch.equal(got2.cpu(),
                       _orig_pool(dec, cu1.tolist(), _cu(n1).tolist(), cl, 1, local_blocks, init_blocks))


@pytest.mark.parametrize("local_blocks,init_blocks", [(2, 1), (32, 1), (1, 0)])
def test_max_pooling_1d_varlen_quirks(local_blocks, init_blocks):
    _pool_checks("cpu", local_blocks, init_blocks)


@pytest.mark.gpu
@pytest.mark.parametrize("local_blocks,init_blocks", [(2, 1), (32, 1), (1, 0)])
def test_max_pooling_1d_varlen_quirks_gpu(local_blocks, init_blocks):
    _pool_checks("cuda", local_blocks, init_blocks)


# ---------------------------------------------------------------------------------------------
# stage 1
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [True, False])
def test_stage1_layout_and_quirks(causal):
    # 300: plain; 335: L % 16 == 15 (quirk A); 383: L % 16 == 15 and L % 64 == 63 (quirk B); 100: no coarse
    # key
    g = torch.Generator().manual_seed(4)
    lengths, hk, G, d = [300, 335, 383, 100], 2, 16, 32
    q = torch.randn(sum(lengths), hk * G, d, generator=g).to(torch.bfloat16)
    kk = torch.randn(sum(lengths), hk, d, generator=g).to(torch.bfloat16)
    k1, n1s = _orig_compress(kk, lengths, 32, 16)
    k2, n2s = _orig_compress(kk, lengths, 128, 64)
    cu_q, cu1, cu2 = _cu(lengths), _cu(n1s), _cu(n2s)
    max_n1 = max(n1s)
    got = iv2.infllmv2_attn_stage1(q, k1, k2, cu_q, cu1, cu2, max(lengths), max_n1, causal=causal)
    want = _orig_stage1(q, k1, k2, lengths, n1s, n2s, causal, max_n1)
    assert got.dtype == torch.bfloat16 and got.shape == (hk, sum(lengths), max_n1)
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-3)
    if causal:  # the quirks really are exercised: the last fully covered fine key of L=335 is masked
        r = 334
        assert want[:, cu_q[1] + r, (r + 1 - 32) // 16].abs().sum() == 0
    assert (got[:, cu_q[3]:cu_q[4]] == 0).all()  # no coarse key -> zero rows
    # a wider max_seqlen_k pads with zeros (the original's buffer is zero-initialised)
    wide = iv2.infllmv2_attn_stage1(q, k1, k2, cu_q, cu1, cu2, max(lengths), max_n1 + 5, causal=causal)
    assert wide.shape[2] == max_n1 + 5 and torch.equal(wide[:, :, :max_n1],
                                                       got) and (wide[:, :, max_n1:] == 0).all()
    # the HF modeling file feeds this layout straight into the varlen pooling
    pooled = iv2.max_pooling_1d_varlen(got, cu_q, cu1, torch.zeros(4, dtype=torch.int32), max(lengths),
                                       max_n1, 32, 1)
    want_pooled = _orig_pool(want, cu_q.tolist(), cu1.tolist(), [0] * 4, max(lengths), 32, 1)
    assert pooled.shape == want_pooled.shape == (hk, sum(lengths), math.ceil(383 / 64))
    torch.testing.assert_close(pooled.float(), want_pooled.float(), rtol=2 ** -7, atol=1e-3)


def test_stage1_exact_mode():
    g = torch.Generator().manual_seed(5)
    lengths, hk, G, d = [260], 1, 16, 32
    q = torch.randn(260, hk * G, d, generator=g).to(torch.bfloat16)
    kk = torch.randn(260, hk, d, generator=g).to(torch.bfloat16)
    k1, n1s = _orig_compress(kk, lengths, 32, 16)
    cu = _cu(n1s)
    got = iv2.infllmv2_attn_stage1(q, k1, k1, _cu(lengths), cu, cu, 260, n1s[0], causal=True)
    want = _orig_stage1(q, k1, k1, lengths, n1s, n1s, True, n1s[0])
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-3)
    # exact softmax over the visible fine keys, summed over 16 heads: rows with keys sum to 16
    rows = got[0].float().sum(-1)
    assert torch.allclose(rows[rows > 0], torch.full_like(rows[rows > 0], 16.0), rtol=2e-2)


# ---------------------------------------------------------------------------------------------
# stage 2
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("G", [16, 2])
def test_varlen_with_topk_idx(G):
    g = torch.Generator().manual_seed(6)
    lq, lk, hk, d = [150, 40, 200], [150, 300, 200], 2, 32
    q = torch.randn(sum(lq), hk * G, d, generator=g, dtype=torch.float64).float()
    k = torch.randn(sum(lk), hk, d, generator=g).float()
    v = torch.randn(sum(lk), hk, d, generator=g).float()
    # incl. -1, future, >= own count
    topk = torch.randint(-1, 6, (hk, sum(lq), 5), generator=g, dtype=torch.int32)
    topk[:, :, 0] = 0
    topk[0, 3] = torch.tensor([2, 2, 1, -1, 9], dtype=torch.int32)  # duplicates
    topk[1, 5] = -1  # nothing selected: out 0, lse +inf
    out, lse, s = iv2.infllmv2_attn_varlen_func(q, k, v, _cu(lq), _cu(lk), max(lq), max(lk), causal=True,
                                                return_attn_probs=True, topk_idx=topk)
    want, want_lse = _orig_stage2(q, k, v, lq, lk, topk, causal=True)
    torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=1e-5)
    assert s is None
    # the original's LSE layout with topk_idx: [h_kv, total_q * G], row t * G + g
    T = sum(lq)
    assert lse.shape == (hk, T * G)
    mapped = want_lse.reshape(hk, G, T).transpose(1, 2).reshape(hk, T * G)
    assert torch.isinf(lse[1, 5 * G:6 * G]).all()
    torch.testing.assert_close(lse.double(), mapped, rtol=1e-4, atol=1e-5)
    # without return_attn_probs: the tensor alone; differentiable in q, k, v
    qg = q.clone().requires_grad_()
    o = iv2.infllmv2_attn_varlen_func(qg, k, v, _cu(lq), _cu(lk), max(lq), max(lk), causal=True,
                                      topk_idx=topk)
    o.sum().backward()
    assert qg.grad is not None and torch.isfinite(qg.grad).all()


def test_varlen_dense_and_bf16():
    g = torch.Generator().manual_seed(7)
    lq, lk, hk, G, d = [70, 130], [70, 130], 1, 4, 64
    q = torch.randn(sum(lq), hk * G, d, generator=g).to(torch.bfloat16)
    k = torch.randn(sum(lk), hk, d, generator=g).to(torch.bfloat16)
    v = torch.randn(sum(lk), hk, d, generator=g).to(torch.bfloat16)
    out = iv2.infllmv2_attn_varlen_func(q, k, v, _cu(lq), _cu(lk), max(lq), max(lk), causal=True)
    every = torch.arange(3, dtype=torch.int32).expand(hk, sum(lq), 3)
    want, _ = _orig_stage2(q, k, v, lq, lk, every, causal=True)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    torch.testing.assert_close(out.double(), want, rtol=2e-2, atol=2e-2)
    out_nc, lse, _ = iv2.infllmv2_attn_varlen_func(q, k, v, _cu(lq), _cu(lk), max(lq), max(lk), causal=False,
                                                   return_attn_probs=True)
    want_nc, want_lse = _orig_stage2(q, k, v, lq, lk, every, causal=False)
    torch.testing.assert_close(out_nc.double(), want_nc, rtol=2e-2, atol=2e-2)
    assert lse.shape == (hk * G, sum(lq))  # FlashAttention's layout without topk_idx
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-3, atol=1e-3)


# ---------------------------------------------------------------------------------------------
# one query per sequence: the varlen function as decode attention, stage 1 sized by the shapes
# ---------------------------------------------------------------------------------------------

def _one_query_inputs(B=3, L=300, hk=2, G=4, d=32, K=6, dtype=torch.float32, device="cpu", seed=11):
    """A decode step in the varlen layout: B sequences of one query and L keys each, and a selection with
    every kind of junk the ops ignore: -1, blocks past the last, duplicates, a row with nothing."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, hk * G, d, generator=g).to(dtype)
    k = torch.randn(B * L, hk, d, generator=g).to(dtype)
    v = torch.randn(B * L, hk, d, generator=g).to(dtype)
    nb = math.ceil(L / 64)
    topk = torch.randint(-1, nb + 2, (hk, B, K), generator=g, dtype=torch.int32)
    topk[0, 0, :6] = torch.tensor([2, 2, 0, -1, nb + 5, 1], dtype=torch.int32)
    topk[hk - 1, B - 1] = -1
    return [t.to(device) for t in (q, k, v, topk, _cu([1] * B), _cu([L] * B))]


class _DecodeSpy:
    """`decode.sparse_decode` as the compat layer calls it, recording each call's selection and cache."""

    def __init__(self, monkeypatch):
        from infllm_cupy import decode

        self.calls = []
        run = decode.sparse_decode

        def spy(q, cache, topk_idx=None, **kw):
            self.calls.append((q, cache, topk_idx))
            return run(q, cache, topk_idx, **kw)

        monkeypatch.setattr(decode, "sparse_decode", spy)


@pytest.mark.parametrize("sparse", [True, False], ids=["topk_idx", "dense"])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_one_query_per_sequence_runs_decode_attention(sparse, causal, monkeypatch):
    """One query per sequence and the same key count in each (the shapes say so: total_q = B, total_k = B x
    max_seqlen_k): `decode.sparse_decode` on the packed keys viewed as `[B, L, h_kv, d]`, the lengths filled
    on the device, `topk_idx [h_kv, total_q, K]` as its `[h_kv, B, K]`. Same output and lse (both layouts) as
    the original's transcription and as the stage-2 path of the same call; causal changes nothing."""
    q, k, v, topk, cu_q, cu_k = _one_query_inputs()
    B, L, hk = q.shape[0], k.shape[0] // q.shape[0], k.shape[1]
    G = q.shape[1] // hk
    sel = topk if sparse else None
    spy = _DecodeSpy(monkeypatch)
    out, lse, s = iv2.infllmv2_attn_varlen_func(q, k, v, cu_q, cu_k, 1, L, causal=causal,
                                                return_attn_probs=True, topk_idx=sel)
    assert s is None and len(spy.calls) == 1
    _, (kc, vc, seqlens), got_sel = spy.calls[0]
    assert kc.shape == (B, L, hk, q.shape[2])
    assert kc.data_ptr() == k.data_ptr() and vc.data_ptr() == v.data_ptr()      # views, no copy
    assert seqlens.dtype == torch.int32 and seqlens.tolist() == [L] * B
    assert (got_sel is None) == (not sparse) and (not sparse or torch.equal(got_sel, topk))
    every = torch.arange(math.ceil(L / 64), dtype=torch.int32).expand(hk, B, -1)
    want, want_lse = _orig_stage2(q, k, v, [1] * B, [L] * B, topk if sparse else every, causal=causal)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-6)
    if sparse:      # the original's [h_kv, total_q * G] (row t * G + g); the empty row: lse +inf, out 0
        want_lse = want_lse.reshape(hk, G, B).transpose(1, 2).reshape(hk, B * G)
        assert torch.isinf(lse[hk - 1, (B - 1) * G:]).all() and (out[B - 1, (hk - 1) * G:] == 0).all()
    assert lse.shape == want_lse.shape
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-6)
    # the stage-2 path of the same call (the decode attention refused) gives the same numbers
    monkeypatch.setattr(iv2, "_one_query_each", lambda *args: False)
    old, old_lse, _ = iv2.infllmv2_attn_varlen_func(q, k, v, cu_q, cu_k, 1, L, causal=causal,
                                                    return_attn_probs=True, topk_idx=sel)
    assert len(spy.calls) == 1
    torch.testing.assert_close(out, old, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse, old_lse, rtol=1e-5, atol=1e-6)


def test_varlen_decode_attention_only_where_the_shapes_fix_the_lengths(monkeypatch):
    """Ragged keys, several queries per sequence, gradients asked for, an empty selection row width: the
    stage-2 path (no decode call), with the same results as before."""
    q, k, v, topk, cu_q, _ = _one_query_inputs()
    spy = _DecodeSpy(monkeypatch)
    lk = [300, 250, 350]                              # total 900 = 3 x 300, but max_seqlen_k 350 > 300
    out = iv2.infllmv2_attn_varlen_func(q, k, v, cu_q, _cu(lk), 1, 350, topk_idx=topk)
    want, _ = _orig_stage2(q, k, v, [1] * 3, lk, topk, causal=False)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-6)
    qg = q.clone().requires_grad_()                   # the decode attention has no backward
    o = iv2.infllmv2_attn_varlen_func(qg, k, v, cu_q, _cu([300] * 3), 1, 300, topk_idx=topk)
    o.sum().backward()
    assert qg.grad is not None and torch.isfinite(qg.grad).all()
    q2 = torch.cat([q, q])                            # two queries per sequence
    iv2.infllmv2_attn_varlen_func(q2, k, v, _cu([2] * 3), _cu([300] * 3), 2, 300, causal=True,
                                  topk_idx=torch.cat([topk, topk], 1))
    iv2.infllmv2_attn_varlen_func(q, k, v, cu_q, _cu([300] * 3), 1, 300, topk_idx=topk[:, :, :0])
    assert spy.calls == []
    with torch.no_grad():                             # no gradient asked for: the decode attention
        iv2.infllmv2_attn_varlen_func(qg, k, v, cu_q, _cu([300] * 3), 1, 300, topk_idx=topk)
    assert len(spy.calls) == 1


def test_varlen_decode_attention_checks_name_the_argument(monkeypatch):
    """The decode path raises what the stage-2 path raises, naming the argument; the offsets' values are
    checked (one read) under validation, never read without it."""
    from infllm_cupy import _checks, _env

    q, k, v, topk, cu_q, cu_k = _one_query_inputs()
    L = 300
    with pytest.raises(ValueError, match=r"topk_idx must have shape \(2, 3, '\*'\)"):
        iv2.infllmv2_attn_varlen_func(q, k, v, cu_q, cu_k, 1, L, topk_idx=torch.cat([topk, topk], 1)[:, :4])
    with pytest.raises(TypeError, match="topk_idx must be int32"):
        iv2.infllmv2_attn_varlen_func(q, k, v, cu_q, cu_k, 1, L, topk_idx=topk.long())
    with pytest.raises(ValueError, match="v must have the shape of k"):
        iv2.infllmv2_attn_varlen_func(q, k, v[:, :1], cu_q, cu_k, 1, L, topk_idx=topk)
    with pytest.raises(TypeError, match="k must have dtype float32"):
        iv2.infllmv2_attn_varlen_func(q, k.double(), v.double(), cu_q, cu_k, 1, L, topk_idx=topk)
    with pytest.raises(TypeError, match="cu_seqlens_k must have dtype int32"):
        iv2.infllmv2_attn_varlen_func(q, k, v, cu_q, cu_k.long(), 1, L, topk_idx=topk)
    with pytest.raises(ValueError, match="softmax_scale"):
        iv2.infllmv2_attn_varlen_func(q, k, v, cu_q, cu_k, 1, L, softmax_scale=-1.0, topk_idx=topk)
    reads = []
    read = _checks.cu_seqlens_host
    monkeypatch.setattr(_checks, "cu_seqlens_host", lambda *cus: reads.append(len(cus)) or read(*cus))
    bad_k = torch.tensor([0, 250, 600, 900], dtype=torch.int32)    # the shapes' total, a sequence over 300
    with pytest.raises(ValueError, match=r"max_seqlen_k must be >= the longest sequence \(350\)"):
        iv2.infllmv2_attn_varlen_func(q, k, v, cu_q, bad_k, 1, L, topk_idx=topk)
    assert reads == [2]                              # both offsets in one read
    reads.clear()
    iv2.infllmv2_attn_varlen_func(q, k, v, cu_q, cu_k, 1, L, topk_idx=topk)
    assert reads == [2]
    reads.clear()
    with _env.override(validate=False):
        iv2.infllmv2_attn_varlen_func(q, k, v, cu_q, cu_k, 1, L, topk_idx=topk)
    assert reads == []


def test_stage1_sized_by_the_shapes_reads_no_offsets(monkeypatch):
    """`infllmv2_attn_stage1` on the kernel path (forced here; the kernel replaced by the reference, its score
    rows `max_n1` wide as the kernel writes them) with `max_seqlen_q` queries and `max_seqlen_k` fine keys
    in every sequence: `stage1_select(return_scores=True)` with the offsets taken from the shapes, no read
    without validation and one (the checks) with it; the same scores as `stage1_scores`, sliced or padded
    to `max_seqlen_k`. Ragged batches keep `stage1_scores`."""
    from infllm_cupy import _checks, _env
    from infllm_cupy.stage1 import naive_stage1_scores

    g = torch.Generator().manual_seed(13)
    B, Lq, n1, n2, hk, G, d = 2, 5, 20, 5, 2, 4, 32
    q = torch.randn(B * Lq, hk * G, d, generator=g).to(torch.bfloat16)
    ck1 = torch.randn(B * n1, hk, d, generator=g).to(torch.bfloat16)
    ck2 = torch.randn(B * n2, hk, d, generator=g).to(torch.bfloat16)
    cu_q, cu1, cu2 = _cu([Lq] * B), _cu([n1] * B), _cu([n2] * B)
    wants = {c: naive_stage1_scores(q, ck1, ck2, cu_q, cu1, cu2, Lq, causal=c) for c in (True, False)}
    want = wants[True]
    calls, reads, counting = [], [], [True]

    def kernel(q, k, v, cu_q, cu_k, cu_v, max_seqlen_q, *, host_seqlens, return_scores, topk, local_blocks,
               init_blocks, causal, softmax_scale, score_dtype):
        assert return_scores and (topk, local_blocks, init_blocks) == (0, 0, 0)
        calls.append(host_seqlens)
        counting[0] = False                 # the reference's own reads are not the kernel's
        scores = naive_stage1_scores(q, k, v, cu_q, cu_k, cu_v, max_seqlen_q, causal=causal,
                                     softmax_scale=softmax_scale, score_dtype=score_dtype)
        counting[0] = True
        width = max(b - a for a, b in zip(host_seqlens.c1, host_seqlens.c1[1:]))
        scores = torch.nn.functional.pad(scores, (0, max(0, width - scores.shape[2])))[:, :, :width]
        return None, scores, None

    def counted(*cus):
        if counting[0]:
            reads.append(len(cus))
        return read(*cus)

    monkeypatch.setattr(iv2, "_stage1_on_kernels", lambda q, k: True)
    monkeypatch.setattr(iv2, "stage1_select", kernel)
    read = _checks.cu_seqlens_host
    monkeypatch.setattr(_checks, "cu_seqlens_host", counted)
    for causal in (True, False):
        with _env.override(validate=False):
            got = iv2.infllmv2_attn_stage1(q, ck1, ck2, cu_q, cu1, cu2, Lq, n1, causal=causal)
        assert reads == [] and calls[-1].q == (0, Lq, 2 * Lq) and calls[-1].c1 == (0, n1, 2 * n1)
        assert torch.equal(got, wants[causal])
    got = iv2.infllmv2_attn_stage1(q, ck1, ck2, cu_q, cu1, cu2, Lq, n1, causal=True)
    assert reads == [3] and torch.equal(got, want)      # the checks' one read of the three offsets
    # wider or narrower max_seqlen_k: the shapes no longer fix the lengths, stage1_scores pads or slices
    monkeypatch.setattr(iv2, "stage1_scores", lambda *a, **kw: want.clone())
    n_calls = len(calls)
    wide = iv2.infllmv2_attn_stage1(q, ck1, ck2, cu_q, cu1, cu2, Lq, n1 + 3, causal=True)
    assert torch.equal(wide[..., :n1], want) and (wide[..., n1:] == 0).all()
    assert iv2.infllmv2_attn_stage1(q, ck1, ck2, cu_q, _cu([15, 25]), cu2, Lq, 25).shape == (hk, B * Lq, 25)
    assert len(calls) == n_calls
    # the checks run before the kernel, naming the argument
    with pytest.raises(ValueError, match="v must have shape"):
        iv2.infllmv2_attn_stage1(q, ck1, ck2[:, :1], cu_q, cu1, cu2, Lq, n1)
    with pytest.raises(ValueError, match=r"cu_seqlens_q must end at the total token count 10, got 11"):
        iv2.infllmv2_attn_stage1(q, ck1, ck2, torch.tensor([0, 6, 11], dtype=torch.int32), cu1, cu2, Lq, n1)
    with pytest.raises(TypeError, match="cu_seqlens_k must have dtype int32"):
        iv2.infllmv2_attn_stage1(q, ck1, ck2, cu_q, cu1.long(), cu2, Lq, n1)
    assert len(calls) == n_calls


def test_pooling_takes_host_lengths_without_a_read(monkeypatch):
    """`max_pooling_1d_varlen` with `cache_lens` on the CPU: the output width from the host values, nothing
    read back without validation, the result of the device-tensor call; bad values still named."""
    from infllm_cupy import _env
    from infllm_cupy.stage1 import pool as pool_module

    g = torch.Generator().manual_seed(14)
    score = torch.randn(2, 3, 40, generator=g).to(torch.bfloat16)
    cu_q, cu_k = _cu([1, 1, 1]), _cu([40, 0, 17])
    cl = [700, 15, 300]
    reads = []
    real = pool_module._read_back

    def read_back(scores, cu_q, cu_k, cache, cache_max, max_seqlen_q):
        reads.append(cache_max)
        return real(scores, cu_q, cu_k, cache, cache_max, max_seqlen_q)

    monkeypatch.setattr(pool_module, "_read_back", read_back)
    with _env.override(validate=False):
        got = iv2.max_pooling_1d_varlen(score, cu_q, cu_k, torch.tensor(cl, dtype=torch.int32), 1, 40, 2, 1)
    assert reads == [700]                # the width known on the host: _read_back returns it, reads nothing
    assert torch.equal(got, _orig_pool(score, cu_q.tolist(), cu_k.tolist(), cl, 1, 2, 1))
    with pytest.raises(ValueError, match=r"cache_lens must be \[batch\]"):
        iv2.max_pooling_1d_varlen(score, cu_q, cu_k, torch.tensor([cl], dtype=torch.int32), 1, 40, 2, 1)
    with pytest.raises(ValueError, match="cache_lens must be non-negative"):
        iv2.max_pooling_1d_varlen(score, cu_q, cu_k, torch.tensor([7, -1, 3], dtype=torch.int32), 1, 40, 2, 1)
    with pytest.raises(TypeError, match="cache_lens must be an int32 tensor"):
        iv2.max_pooling_1d_varlen(score, cu_q, cu_k, cl, 1, 40, 2, 1)


@pytest.mark.gpu
@pytest.mark.parametrize("sparse", [True, False], ids=["topk_idx", "dense"])
def test_varlen_one_query_per_sequence_decode_kernel_gpu(sparse, monkeypatch):
    """On CUDA (bf16, MiniCPM4's heads: G 16, D 128, 2 KV heads): the decode kernel behind the varlen
    function, within FlashAttention's rule of the float64 stage-2 reference (the same reference in bf16
    without upcasting as the low-precision baseline), its lse too; with the value checks off the call
    synchronizes nothing."""
    from infllm_cupy import _env
    from infllm_cupy.stage2 import naive_sparse_attn_varlen
    from infllm_cupy.testing import assert_close_to_ref

    B, L = 3, 1000
    q, k, v, topk, cu_q, cu_k = _one_query_inputs(B=B, L=L, hk=2, G=16, d=128, K=8, dtype=torch.bfloat16,
                                                  device="cuda")
    sel = topk if sparse else None
    spy = _DecodeSpy(monkeypatch)
    out, lse, _ = iv2.infllmv2_attn_varlen_func(q, k, v, cu_q, cu_k, 1, L, return_attn_probs=True,
                                                topk_idx=sel)
    assert len(spy.calls) == 1
    every = torch.arange(math.ceil(L / 64), dtype=torch.int32, device="cuda").expand(2, B, -1).contiguous()
    idx = topk if sparse else every
    ref, ref_lse = naive_sparse_attn_varlen(q.double(), k.double(), v.double(), cu_q, cu_k, idx, 1, L,
                                            causal=False, return_lse=True)
    lowp = naive_sparse_attn_varlen(q, k, v, cu_q, cu_k, idx, 1, L, causal=False, upcast=False)
    assert_close_to_ref("out", out, ref, lowp)
    G = 16
    want_lse = ref_lse.reshape(2, G, B).transpose(1, 2).reshape(2, B * G) if sparse else ref_lse
    fin = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse), fin)
    torch.testing.assert_close(lse[fin].double(), want_lse[fin].double(), rtol=1e-3, atol=1e-2)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with _env.override(validate=False):
            again = iv2.infllmv2_attn_varlen_func(q, k, v, cu_q, cu_k, 1, L, topk_idx=sel)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(again, out)


@pytest.mark.gpu
def test_stage1_and_pooling_sized_by_the_shapes_gpu():
    """On CUDA: `infllmv2_attn_stage1` with the same counts in every sequence (prefill of equal rows, and a
    decode step) equals `stage1_scores` bit for bit (the same kernel), and with the value checks off it and
    the pooling with host `cache_lens` synchronize nothing; the pooling equals the device-lengths call."""
    from infllm_cupy import _env
    from infllm_cupy.stage1 import stage1_scores

    g = torch.Generator().manual_seed(15)
    hk, G, d = 2, 16, 128
    for B, Lq, n1, n2, causal in ((2, 300, 40, 9, True), (3, 1, 200, 49, False)):
        q = torch.randn(B * Lq, hk * G, d, generator=g).to(torch.bfloat16).cuda()
        ck1 = torch.randn(B * n1, hk, d, generator=g).to(torch.bfloat16).cuda()
        ck2 = torch.randn(B * n2, hk, d, generator=g).to(torch.bfloat16).cuda()
        cu_q, cu1, cu2 = (_cu([n] * B).cuda() for n in (Lq, n1, n2))
        want = stage1_scores(q, ck1, ck2, cu_q, cu1, cu2, Lq, causal=causal, score_dtype=torch.bfloat16)
        want = want.nan_to_num(nan=0.0, posinf=float("inf"), neginf=float("-inf"))
        cache_cpu = torch.full((B,), 16 * n1 + 31 - Lq, dtype=torch.int32)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            with _env.override(validate=False):
                got = iv2.infllmv2_attn_stage1(q, ck1, ck2, cu_q, cu1, cu2, Lq, n1, causal=causal)
                pooled = iv2.max_pooling_1d_varlen(got, cu_q, cu1, cache_cpu, Lq, n1, 32, 1)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert torch.equal(got, want)
        assert torch.equal(pooled, iv2.max_pooling_1d_varlen(got, cu_q, cu1, cache_cpu.cuda(), Lq, n1, 32, 1))


# ---------------------------------------------------------------------------------------------
# decode with a KV cache
# ---------------------------------------------------------------------------------------------

def _orig_decode(q, k_full, v_full, seqlens, topk):
    """Spec 8: one query per sequence, non-causal over its first seqlens[b] keys, selected blocks only."""
    B, _, hq, d = q.shape
    hk = k_full.shape[2]
    G = hq // hk
    out = torch.zeros(B, 1, hq, d, dtype=torch.float64)
    lse = torch.full((B, hq, 1), float("inf"), dtype=torch.float64)
    for b in range(B):
        L = int(seqlens[b])
        nb = (L + 63) // 64
        for hh in range(hq):
            h = hh // G
            sel = set(range(nb)) if topk is None else {int(i) for i in topk[b, h, 0] if 0 <= int(i) < nb}
            keys = torch.tensor([c for c in range(L) if c // 64 in sel], dtype=torch.long)
            if len(keys) == 0:
                continue
            s = (k_full[b, keys, h].double() @ q[b, 0, hh].double()) * d ** -0.5
            out[b, 0, hh] = torch.softmax(s, 0) @ v_full[b, keys, h].double()
            lse[b, hh, 0] = torch.logsumexp(s, 0)
    return out, lse


def _decode_checks(paged, device):
    g = torch.Generator().manual_seed(8)
    B, S, hk, G, d, page = 3, 320, 2, 16, 64, 64
    dt = torch.float32 if device == "cpu" else torch.bfloat16
    tol = dict(rtol=1e-4, atol=1e-5) if device == "cpu" else dict(rtol=2e-2, atol=2e-2)
    seqlens = torch.tensor([300, 65, 128], dtype=torch.int32)
    q = torch.randn(B, 1, hk * G, d, generator=g).to(dt)
    k_full = torch.randn(B, S, hk, d, generator=g).to(dt)
    v_full = torch.randn(B, S, hk, d, generator=g).to(dt)
    topk = torch.randint(-1, 6, (B, hk, 1, 4), generator=g, dtype=torch.int32)
    topk[:, :, 0, 0] = 0
    topk[2, 1, 0] = -1  # nothing selected
    block_table = None
    if paged:
        n_pages = S // page
        perm = torch.randperm(B * n_pages, generator=g)
        block_table = perm.reshape(B, n_pages).to(torch.int32)
        k_cache = torch.zeros(B * n_pages, page, hk, d, dtype=dt)
        v_cache = torch.zeros(B * n_pages, page, hk, d, dtype=dt)
        for b in range(B):
            for p in range(n_pages):
                k_cache[block_table[b, p]] = k_full[b, p * page:(p + 1) * page]
                v_cache[block_table[b, p]] = v_full[b, p * page:(p + 1) * page]
    else:
        k_cache, v_cache = k_full.clone(), v_full.clone()
    dev = lambda t: None if t is None else t.to(device)        # noqa: E731
    kc, vc, bt = dev(k_cache), dev(v_cache), dev(block_table)
    out, lse = iv2.infllmv2_attn_with_kvcache(dev(q), kc, vc, cache_seqlens=dev(seqlens), block_table=bt,
                                              return_softmax_lse=True, topk_idx=dev(topk))
    want, want_lse = _orig_decode(q, k_full, v_full, seqlens, topk)
    assert out.shape == (B, 1, hk * G, d) and lse.shape == (B, hk * G, 1)
    torch.testing.assert_close(out.cpu().double(), want, **tol)
    torch.testing.assert_close(lse.cpu().double(), want_lse, **tol)
    # new k/v are written in place at cache_seqlens and attended (dense here)
    k_new, v_new = torch.randn(B, 1, hk, d, generator=g).to(dt), torch.randn(B, 1, hk, d, generator=g).to(dt)
    out2 = iv2.infllmv2_attn_with_kvcache(dev(q), kc, vc, k=dev(k_new), v=dev(v_new),
                                          cache_seqlens=dev(seqlens), block_table=bt)
    k_full2, v_full2 = k_full.clone(), v_full.clone()
    kc = kc.cpu()
    for b in range(B):
        k_full2[b, int(seqlens[b])] = k_new[b, 0]
        v_full2[b, int(seqlens[b])] = v_new[b, 0]
        pos = int(seqlens[b])
        stored = (kc[block_table[b, pos // page], pos % page] if paged else kc[b, pos])
        assert torch.equal(stored, k_new[b, 0])
    want2, _ = _orig_decode(q, k_full2, v_full2, seqlens + 1, None)
    torch.testing.assert_close(out2.cpu().double(), want2, **tol)


@pytest.mark.parametrize("paged", [False, True])
def test_kvcache_decode(paged):
    _decode_checks(paged, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("paged", [False, True])
def test_kvcache_decode_gpu(paged):
    _decode_checks(paged, "cuda")


def _failure_checks(paged, device):
    """Every failure mode of `infllmv2_attn_with_kvcache` with new k/v: the call raises naming the argument,
    and every cache tensor (and the block table) stays bit-identical."""
    g = torch.Generator().manual_seed(9)
    B, hk, d, page = 2, 2, 64, 64
    dt = torch.float32 if device == "cpu" else torch.bfloat16
    q = torch.randn(B, 1, 4 * hk, d, generator=g).to(dt).to(device)
    if paged:
        k_cache, v_cache = (torch.randn(5, page, hk, d, generator=g).to(dt).to(device) for _ in range(2))
        # sequence 1: one page
        block_table = torch.tensor([[3, 0], [1, -1]], dtype=torch.int32, device=device)
    else:
        k_cache, v_cache = (torch.randn(B, 2 * page, hk, d, generator=g).to(dt).to(device) for _ in range(2))
        block_table = None
    k_new, v_new = (torch.randn(B, 1, hk, d, generator=g).to(dt).to(device) for _ in range(2))
    seqlens = torch.tensor([70, 20], dtype=torch.int32, device=device)
    good = torch.zeros(B, hk, 1, 3, dtype=torch.int32, device=device)
    ang = torch.rand(256, 8, generator=g)
    cos, sin = ang.cos().to(dt).to(device), ang.sin().to(dt).to(device)
    i32 = dict(dtype=torch.int32, device=device)
    before = (k_cache.clone(), v_cache.clone(), None if block_table is None else block_table.clone())
    overflow = "block_table" if paged else "cache_seqlens"
    bad_calls = [
        (TypeError, "topk_idx", dict(topk_idx=good.long())),
        (ValueError, "topk_idx", dict(topk_idx=good[:, :1])),
        (ValueError, "topk_idx", dict(topk_idx=good[:, :, 0])),
        (ValueError, "k must be", dict(k=k_new[:, :, :1], v=v_new)),
        (ValueError, "k must be", dict(k=k_new.double(), v=v_new.double())),
        (ValueError, "v must be", dict(k=k_new, v=v_new[:, :, :, :16])),
        (ValueError, "k and v", dict(k=k_new, v=torch.cat([v_new, v_new], 1))),
        (ValueError, "k and v", dict(v=None)),
        (ValueError, "cache_seqlens", dict(cache_seqlens=None)),
        (ValueError, overflow, dict(cache_seqlens=torch.tensor([70, 64 if paged else 128], **i32))),
        (ValueError, "cache_seqlens must be in", dict(cache_seqlens=torch.tensor([70, -1], **i32))),
        (ValueError, overflow, dict(cache_seqlens=128)),
        (ValueError, "cache_seqlens", dict(cache_seqlens=torch.tensor([1, 2, 3], **i32))),
        (ValueError, "cache_seqlens", dict(cache_seqlens=seqlens.float())),
        (ValueError, "k_cache", dict(q=q.double())),
        (ValueError, "head dim", dict(q=q[..., :32])),
        (ValueError, "heads", dict(q=q[:, :, :3])),
        (ValueError, "rotary_cos", dict(rotary_cos=cos[:50], rotary_sin=sin[:50])),
        (ValueError, "rotary_cos", dict(rotary_cos=cos.double(), rotary_sin=sin.double())),
        (ValueError, "rotary_cos", dict(rotary_cos=cos[:, :5], rotary_sin=sin[:, :5])),
        (ValueError, "together", dict(rotary_cos=cos)),
        (ValueError, "cache_batch_idx", dict(cache_batch_idx=torch.tensor([0, 1], **i32))) if paged else
        (ValueError, "cache_batch_idx", dict(cache_batch_idx=torch.tensor([0, 2], **i32))),
        (ValueError, "cache_batch_idx", dict(cache_batch_idx=torch.tensor([0, -1], **i32))),
        (ValueError, "cache_batch_idx",
         dict(cache_batch_idx=torch.tensor([0, 1], dtype=torch.int64, device=device))),
        (ValueError, "cache_leftpad", dict(cache_leftpad=torch.tensor([0, 21], **i32))),
        (ValueError, "cache_leftpad", dict(cache_leftpad=torch.tensor([-1, 0], **i32))),
        (ValueError, "cache_leftpad",
         dict(cache_leftpad=torch.tensor([0, 0], dtype=torch.int64, device=device))),
        (ValueError, "cache_leftpad", dict(cache_leftpad=torch.tensor([0], **i32))),
        (NotImplementedError, "softcap", dict(softcap=2.0)),
        (NotImplementedError, "seqlen", dict(q=torch.cat([q, q], 1))),
    ]
    if paged:
        bad_calls += [
            (ValueError, "block_table", dict(block_table=block_table.long())),
            (ValueError, "block_table", dict(block_table=block_table[:1])),
            (ValueError, "cache_seqlens must be in", dict(cache_seqlens=torch.tensor([130, 20], **i32))),
        ]
    else:
        bad_calls += [(ValueError, "k_cache",
                       dict(cache_seqlens=torch.tensor([1], **i32), q=q[:1], k=k_new[:1],
                                                   v=v_new[:1], topk_idx=good[:1]))]
    for exc, match, kw in bad_calls:
        args = dict(q=q, k=k_new, v=v_new, cache_seqlens=seqlens, block_table=block_table, topk_idx=good,
                    rotary_cos=None, rotary_sin=None)
        args.update(kw)
        with pytest.raises(exc, match=match):
            iv2.infllmv2_attn_with_kvcache(k_cache=k_cache, v_cache=v_cache, **args)
        assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1]), (match, kw)
        assert block_table is None or torch.equal(block_table, before[2])
    iv2.infllmv2_attn_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new, cache_seqlens=seqlens,
                                   block_table=block_table, topk_idx=good)
    assert not torch.equal(k_cache, before[0])                  # the good call writes


@pytest.mark.parametrize("paged", [False, True])
def test_kvcache_failed_call_leaves_the_caches_unchanged(paged):
    """Every check of `infllmv2_attn_with_kvcache` runs before the new k/v are written: a bad selection, bad
    new keys, an overflowing or negative position, a missing page, a bad cache row, left padding past the
    keys, bad rotary tables, q not matching the cache raise naming the argument, and every cache tensor
    stays bit-identical."""
    _failure_checks(paged, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("paged", [False, True])
def test_kvcache_failed_call_leaves_the_caches_unchanged_gpu(paged):
    _failure_checks(paged, "cuda")


def _rope_by_hand(x, cos, sin, pos, interleaved):
    """FlashAttention's kvcache rotary, written out per pair: x `[d]` at position `pos`."""
    out = x.double().clone()
    half = cos.shape[1]
    for i in range(half):
        a, b = (2 * i, 2 * i + 1) if interleaved else (i, i + half)
        c, s_ = float(cos[pos, i]), float(sin[pos, i])
        out[a] = x[a].double() * c - x[b].double() * s_
        out[b] = x[a].double() * s_ + x[b].double() * c
    return out


@pytest.mark.parametrize("interleaved", [True, False])
def test_kvcache_rotary_and_cache_batch_idx(interleaved):
    """rotary_cos/sin (q at cache_seqlens, the new keys at cache_seqlens + i, first rotary_dim dims) and
    cache_batch_idx (each sequence's cache row), as FlashAttention's kvcache defines them: the written keys
    and the output against a by-hand rotation and attention; the other cache rows untouched."""
    g = torch.Generator().manual_seed(13)
    B, S, hk, G, d, rd = 2, 192, 2, 4, 32, 16
    rows, seqlens = [2, 0], torch.tensor([40, 130], dtype=torch.int32)
    k_cache = torch.randn(3, S, hk, d, generator=g)
    v_cache = torch.randn(3, S, hk, d, generator=g)
    before = k_cache.clone()
    q = torch.randn(B, 1, hk * G, d, generator=g)
    k_new, v_new = torch.randn(B, 1, hk, d, generator=g), torch.randn(B, 1, hk, d, generator=g)
    ang = torch.rand(256, rd // 2, generator=g) * 6.0
    cos, sin = ang.cos(), ang.sin()
    topk = torch.randint(-1, 3, (B, hk, 1, 2), generator=g, dtype=torch.int32)
    out = iv2.infllmv2_attn_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new, rotary_cos=cos,
                                         rotary_sin=sin,
                                         cache_seqlens=seqlens,
                                         cache_batch_idx=torch.tensor(rows, dtype=torch.int32),
                                         rotary_interleaved=interleaved, topk_idx=topk)
    q_rot = torch.zeros(B, 1, hk * G, d, dtype=torch.float64)
    k_full, v_full = before[rows].double(), v_cache[rows].double()
    for b in range(B):
        L = int(seqlens[b])
        for h in range(hk * G):
            q_rot[b, 0, h] = _rope_by_hand(q[b, 0, h], cos, sin, L, interleaved)
        for h in range(hk):
            want_k = _rope_by_hand(k_new[b, 0, h], cos, sin, L, interleaved)
            torch.testing.assert_close(k_cache[rows[b], L, h].double(), want_k, atol=1e-6, rtol=1e-6)
            k_full[b, L, h] = want_k
        v_full[b, L] = v_new[b, 0].double()
    assert torch.equal(k_cache[1], before[1])                       # a row no sequence uses
    want, _ = _orig_decode(q_rot, k_full, v_full, seqlens + 1, topk)
    torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="need k and v"):
        iv2.infllmv2_attn_with_kvcache(q, k_cache, v_cache, rotary_cos=cos, rotary_sin=sin,
                                       cache_seqlens=seqlens,
                                       cache_batch_idx=torch.tensor(rows, dtype=torch.int32))
    with pytest.raises(ValueError, match="cache_batch_idx"):
        iv2.infllmv2_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens,
                                       cache_batch_idx=torch.tensor([0, 3], dtype=torch.int32))
    with pytest.raises(ValueError, match="rotary_cos"):
        iv2.infllmv2_attn_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new, rotary_cos=cos[:100],
                                       rotary_sin=sin[:100], cache_seqlens=seqlens,
                                       cache_batch_idx=torch.tensor(rows, dtype=torch.int32))


def _leftpad_checks(device, interleaved):
    """cache_leftpad (with cache_batch_idx, rotary and new keys): sequence b's keys are cache positions
    cache_leftpad[b] .. cache_seqlens[b] (the new key included), its topk_idx blocks count from
    cache_leftpad[b], the new key is written and q and the key rotated at the absolute cache_seqlens[b]
    (FlashAttention's kvcache kernel, which the original runs). Against a by-hand rotation and the
    transcribed decode on the shifted rows; zero padding equals no padding exactly."""
    g = torch.Generator().manual_seed(31)
    B, S, hk, G, d, rd = 3, 256, 2, 4, 64, 32
    dt = torch.float32 if device == "cpu" else torch.bfloat16
    tol = dict(rtol=1e-4, atol=1e-5) if device == "cpu" else dict(rtol=2e-2, atol=2e-2)
    rows = [2, 0, 1]
    seqlens = torch.tensor([200, 70, 130], dtype=torch.int32)
    pads = torch.tensor([10, 70, 65], dtype=torch.int32)        # sequence 1 keeps only its new key
    k_cache = torch.randn(3, S, hk, d, generator=g).to(dt)
    v_cache = torch.randn(3, S, hk, d, generator=g).to(dt)
    q = torch.randn(B, 1, hk * G, d, generator=g).to(dt)
    k_new, v_new = torch.randn(B, 1, hk, d, generator=g).to(dt), torch.randn(B, 1, hk, d, generator=g).to(dt)
    ang = torch.rand(S, rd // 2, generator=g) * 6.0
    cos, sin = ang.cos().to(dt), ang.sin().to(dt)
    topk = torch.randint(-1, 3, (B, hk, 1, 3), generator=g, dtype=torch.int32)
    topk[:, :, 0, 0] = 0
    before_k, before_v = k_cache.clone(), v_cache.clone()
    dev = lambda t: t.to(device)                                # noqa: E731
    kc, vc = dev(k_cache), dev(v_cache)
    out, lse = iv2.infllmv2_attn_with_kvcache(
        dev(q), kc, vc, k=dev(k_new), v=dev(v_new), rotary_cos=dev(cos), rotary_sin=dev(sin),
        cache_seqlens=dev(seqlens), cache_batch_idx=dev(torch.tensor(rows, dtype=torch.int32)),
        cache_leftpad=dev(pads), rotary_interleaved=interleaved, topk_idx=dev(topk), return_softmax_lse=True)
    kc, vc = kc.cpu(), vc.cpu()
    q_rot = torch.zeros(B, 1, hk * G, d, dtype=torch.float64)
    k_shift = torch.zeros(B, S, hk, d, dtype=torch.float64)
    v_shift = torch.zeros(B, S, hk, d, dtype=torch.float64)
    for b in range(B):
        L, p, r = int(seqlens[b]), int(pads[b]), rows[b]
        for h in range(hk * G):
            q_rot[b, 0, h] = _rope_by_hand(q[b, 0, h], cos, sin, L, interleaved)
        for h in range(hk):
            want_k = _rope_by_hand(k_new[b, 0, h], cos, sin, L, interleaved)
            # written at the absolute position
            torch.testing.assert_close(kc[r, L, h].double(), want_k, **tol)
        assert torch.equal(vc[r, L], v_new[b, 0])
        k_shift[b, :S - p] = kc[r, p:].double()
        v_shift[b, :S - p] = vc[r, p:].double()
    # nothing else of the caches changed
    mask = torch.ones(3, S, dtype=torch.bool)
    for b in range(B):
        mask[rows[b], int(seqlens[b])] = False
    assert torch.equal(kc[mask], before_k[mask]) and torch.equal(vc[mask], before_v[mask])
    q_in = q_rot.to(dt).double() if device != "cpu" else q_rot
    want, want_lse = _orig_decode(q_in, k_shift, v_shift, seqlens + 1 - pads, topk)
    torch.testing.assert_close(out.cpu().double(), want, **tol)
    torch.testing.assert_close(lse.cpu().double(), want_lse, **tol)
    # zero padding is no padding
    kz, vz = dev(before_k.clone()), dev(before_v.clone())
    a = iv2.infllmv2_attn_with_kvcache(dev(q), kz, vz, cache_seqlens=dev(seqlens), topk_idx=dev(topk),
                                       cache_leftpad=dev(torch.zeros(B, dtype=torch.int32)))
    b_ = iv2.infllmv2_attn_with_kvcache(dev(q), kz, vz, cache_seqlens=dev(seqlens), topk_idx=dev(topk))
    assert torch.equal(a, b_)


@pytest.mark.parametrize("interleaved", [True, False])
def test_kvcache_leftpad(interleaved):
    _leftpad_checks("cpu", interleaved)


@pytest.mark.gpu
@pytest.mark.parametrize("interleaved", [True, False])
def test_kvcache_leftpad_gpu(interleaved):
    _leftpad_checks("cuda", interleaved)


# ---------------------------------------------------------------------------------------------
# unsupported arguments, install()
# ---------------------------------------------------------------------------------------------

def _small():
    q = torch.randn(64, 16, 32)
    k = torch.randn(64, 1, 32)
    cu = _cu([64])
    return q, k, cu


@pytest.mark.parametrize("kw", [dict(dropout_p=0.1), dict(alibi_slopes=torch.ones(16)), dict(softcap=5.0),
                                dict(window_size=(32, 0)),
                                dict(block_table=torch.zeros(1, 1, dtype=torch.int32))])
def test_varlen_and_stage1_unsupported(kw):
    q, k, cu = _small()
    name = next(iter(kw))
    if name != "block_table":                  # the varlen function takes paged K/V (test below)
        with pytest.raises(NotImplementedError, match=name):
            iv2.infllmv2_attn_varlen_func(q, k, k, cu, cu, 64, 64, **kw)
    with pytest.raises(NotImplementedError, match=name):
        iv2.infllmv2_attn_stage1(q, k, k, cu, cu, cu, 64, 64, **kw)


@pytest.mark.parametrize("page", [64, 256])
def test_varlen_paged_kv_equals_packed(page):
    """`block_table` in `infllmv2_attn_varlen_func`: K/V in shuffled pages (FlashAttention's paged varlen
    layout) give the packed call's output and lse exactly, ragged lengths, sparse and dense; a missing
    page raises naming block_table."""
    g = torch.Generator().manual_seed(12)
    lq, lk, hk, G, d = [5, 70], [300, 130], 2, 4, 32
    q = torch.randn(sum(lq), hk * G, d, generator=g)
    k = torch.randn(sum(lk), hk, d, generator=g)
    v = torch.randn(sum(lk), hk, d, generator=g)
    cu_q, cu_k = _cu(lq), _cu(lk)
    per = [-(-L // page) for L in lk]
    n_pages = sum(per) + 2
    order = torch.randperm(n_pages, generator=g)
    table = torch.full((2, max(per)), -1, dtype=torch.int32)
    k_pages, v_pages = torch.zeros(n_pages, page, hk, d), torch.zeros(n_pages, page, hk, d)
    o, used = 0, 0
    for b, L in enumerate(lk):
        for p in range(per[b]):
            pid = int(order[used])
            used += 1
            table[b, p] = pid
            n = min(page, L - p * page)
            k_pages[pid, :n] = k[o + p * page:o + p * page + n]
            v_pages[pid, :n] = v[o + p * page:o + p * page + n]
        o += L
    topk = torch.randint(-1, 5, (hk, sum(lq), 3), generator=g, dtype=torch.int32)
    for sel in (topk, None):
        want = iv2.infllmv2_attn_varlen_func(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=True, topk_idx=sel,
                                             return_attn_probs=True)
        got = iv2.infllmv2_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, max(lq), max(lk), causal=True,
                                            topk_idx=sel, block_table=table, return_attn_probs=True)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    bad = table.clone()
    bad[1, 0] = -1
    with pytest.raises(ValueError, match="block_table"):
        iv2.infllmv2_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, max(lq), max(lk), block_table=bad)


@pytest.mark.parametrize("kw",
                         [dict(softcap=1.0), dict(alibi_slopes=torch.ones(16)), dict(window_size=(8, 0))])
def test_kvcache_unsupported(kw):
    q = torch.randn(1, 1, 16, 32)
    kc = torch.randn(1, 64, 1, 32)
    with pytest.raises(NotImplementedError, match=next(iter(kw))):
        iv2.infllmv2_attn_with_kvcache(q, kc, kc, cache_seqlens=10, **kw)
    with pytest.raises(NotImplementedError, match="seqlen"):
        iv2.infllmv2_attn_with_kvcache(torch.randn(1, 2, 16, 32), kc, kc, cache_seqlens=10)


def test_accepted_no_op_arguments():
    q, k, cu = _small()
    a = iv2.infllmv2_attn_varlen_func(q, k, k, cu, cu, 64, 64, causal=True)
    b = iv2.infllmv2_attn_varlen_func(q, k, k, cu, cu, 64, 64, causal=True, deterministic=True)
    assert torch.equal(a, b)
    kc = torch.randn(1, 64, 1, 32)
    x = iv2.infllmv2_attn_with_kvcache(q[:1, None], kc, kc, cache_seqlens=10)
    y = iv2.infllmv2_attn_with_kvcache(q[:1, None], kc, kc, cache_seqlens=10, num_splits=4, causal=True)
    assert torch.equal(x, y)


def test_install_is_opt_in(monkeypatch):
    code = ("import sys, infllm_cupy; assert 'infllm_v2' not in sys.modules; "
            "assert 'infllm_cupy.compat' not in sys.modules; print('ok')")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr
    monkeypatch.setitem(sys.modules, "infllm_v2", None)  # restored (removed) after the test
    for name in infllm_cupy.compat.SUBMODULES:
        monkeypatch.setitem(sys.modules, f"infllm_v2.{name}", None)
    infllm_cupy.compat.install()
    import infllm_v2
    from infllm_v2 import infllmv2_attn_varlen_func, max_pooling_1d_varlen, topk_to_uint64  # noqa: F401

    assert infllm_v2 is iv2 and infllmv2_attn_varlen_func is iv2.infllmv2_attn_varlen_func
    # every submodule path of the original package resolves to the same functions
    for name, names in infllm_cupy.compat.SUBMODULES.items():
        mod = importlib.import_module(f"infllm_v2.{name}")
        for n in names:
            assert getattr(mod, n) is getattr(iv2, n), (name, n)
    from infllm_v2.infllmv2_sparse_attention import infllmv2_attn_with_kvcache  # noqa: F401
    from infllm_v2.max_pooling_1d import max_pooling_1d_varlen as mp
    from infllm_v2.topk_to_uint64 import TopkToUint64Converter  # noqa: F401

    assert mp is iv2.max_pooling_1d_varlen
