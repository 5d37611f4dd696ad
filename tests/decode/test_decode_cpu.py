"""Decode attention's CPU implementation (decode/cpu.py) against the oracle (`naive_sparse_decode`):
the selected blocks only, with the reference's semantics (junk and repeated entries, empty heads, lse,
weights), within FlashAttention's rule in bf16 and fp16, and which entry points run it."""
from __future__ import annotations

import pytest
import torch

from infllm_cupy.config import InfLLMv2Config
from infllm_cupy.decode import infllmv2_decode, naive_sparse_decode, sparse_decode
from infllm_cupy.decode import step as step_module
from infllm_cupy.decode.cache import cache_tensors
from infllm_cupy.decode.cpu import cpu_sparse_decode
from infllm_cupy.testing import assert_close_to_ref, random_decode_cache

LENGTHS = [1, 63, 64, 65, 300, 1025]


def junk_selection(lengths, H: int, K: int, seed: int) -> torch.Tensor:
    """int32 `[H, B, K]` block ids: valid blocks, repeats, -1, ids past the sequence's last block and
    one head of the longest sequence with nothing usable."""
    g = torch.Generator().manual_seed(seed)
    B = len(lengths)
    idx = torch.empty(H, B, K, dtype=torch.int32)
    for b, L in enumerate(lengths):
        nb = -(-L // 64)
        idx[:, b] = torch.randint(-2, nb + 2, (H, K), generator=g, dtype=torch.int32)
        idx[:, b, 0] = idx[:, b, 1]                                   # a repeat in every row
    idx[0, -1] = torch.tensor([-1, 10**6] * (K // 2) + [-1] * (K % 2), dtype=torch.int32)
    return idx


def run_cpu(q, cache, idx, **kw):
    k, v, seqlens, bt, width = cache_tensors(cache)
    return cpu_sparse_decode(q, k, v, seqlens, bt, width, idx, scale=q.shape[2] ** -0.5, block_size=64, **kw)


@pytest.mark.parametrize("page_size", [None, 64, 256], ids=["contiguous", "page64", "page256"])
@pytest.mark.parametrize("G", [1, 4, 32])
@pytest.mark.parametrize("sparse", [True, False], ids=["selected", "dense"])
def test_float64_equals_the_oracle(page_size, G, sparse):
    H, D = 2, 64
    cache = random_decode_cache(LENGTHS, H, D, torch.float64, page_size=page_size, seed=G)
    q = torch.randn(len(LENGTHS), H * G, D, dtype=torch.float64)
    idx = junk_selection(LENGTHS, H, 5, seed=G) if sparse else None
    for weights in ("per_head", "per_kv_head"):
        out, lse, w = run_cpu(q, cache, idx, return_lse=True, return_attn_weights=True, weights=weights)
        ref, ref_lse, ref_w = naive_sparse_decode(q, cache, idx, return_lse=True, return_attn_weights=True,
                                                  weights=weights)
        torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(lse, ref_lse, atol=1e-6, rtol=0)          # both fp32
        torch.testing.assert_close(w, ref_w, atol=1e-6, rtol=0)
    if sparse:                                                                # the empty head
        assert torch.equal(out[-1, :G], torch.zeros(G, D, dtype=out.dtype))
        assert bool(torch.isinf(lse[-1, :G]).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("page_size", [None, 64], ids=["contiguous", "page64"])
def test_low_precision_within_flash_attention_rule(dtype, D, page_size):
    H, G = 2, 8
    cache = random_decode_cache(LENGTHS, H, D, dtype, page_size=page_size, seed=D)
    q = torch.randn(len(LENGTHS), H * G, D).to(dtype)
    idx = junk_selection(LENGTHS, H, 6, seed=D)
    out, lse = run_cpu(q, cache, idx, return_lse=True, return_attn_weights=False, weights="per_head")
    k, v, seqlens, bt, _ = cache_tensors(cache)
    as64 = (k.double(), v.double(), seqlens, bt)
    ref, ref_lse = naive_sparse_decode(q.double(), as64, idx, return_lse=True)
    lowp = naive_sparse_decode(q, cache, idx, upcast=False)
    assert_close_to_ref("out", out, ref, lowp)
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), fin)
    torch.testing.assert_close(lse[fin], ref_lse[fin].float(), atol=1e-4, rtol=0)


def test_entry_points_run_it_on_cpu_under_auto_only(monkeypatch):
    calls = []
    monkeypatch.setattr(step_module, "cpu_sparse_decode",
                        lambda *a, **k: calls.append("cpu") or cpu_sparse_decode(*a, **k))
    cfg = InfLLMv2Config(topk=2, local_blocks=1, dense_len=128)
    cache = random_decode_cache([300, 700], 2, 64, torch.float32)
    q = torch.randn(2, 8, 64)
    idx = junk_selection([300, 700], 2, 3, seed=1)
    for backend, want in (("auto", ["cpu"] * 2), ("reference", [])):
        calls.clear()
        out = infllmv2_decode(q, cache, config=cfg, backend=backend)
        got = sparse_decode(q, cache, idx, backend=backend)
        assert calls == want, (backend, calls)
        ref = naive_sparse_decode(q, cache, idx)
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
        assert out.shape == q.shape and bool(torch.isfinite(out).all())


def test_reads_only_the_selected_rows():
    # unselected key rows set to NaN change nothing: the CPU implementation gathers the selected rows only
    H, G, D, L = 2, 4, 64, 1000
    cache = random_decode_cache([L], H, D, torch.float32, spare=24)
    idx = torch.tensor([[[0, 3]], [[5, 15]]], dtype=torch.int32)             # [H, 1, K]
    keep = torch.zeros(cache.k.shape[1], H, dtype=torch.bool)
    for h, blocks in enumerate(([0, 3], [5, 15])):
        for blk in blocks:
            keep[blk * 64:(blk + 1) * 64, h] = True
    poisoned = cache.k.clone()
    poisoned[0][~keep] = float("nan")
    k, v, seqlens, bt, width = cache_tensors(cache)
    q = torch.randn(1, H * G, D)
    kw = dict(scale=D ** -0.5, block_size=64, return_lse=False, return_attn_weights=False, weights="per_head")
    out = cpu_sparse_decode(q, poisoned, v, seqlens, bt, width, idx, **kw)
    ref = cpu_sparse_decode(q, k, v, seqlens, bt, width, idx, **kw)
    assert bool(torch.isfinite(ref).all()) and torch.equal(out, ref)
    torch.testing.assert_close(ref, naive_sparse_decode(q, cache, idx), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("page_size", [None, 64, 256], ids=["contiguous", "page64", "page256"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_fp8_cache_reads_only_the_gathered_pages_as_the_reference_does(page_size, dtype):
    # an FP8 cache (docs/decode.md §16): the CPU step dequantizes the rows it gathers (Fp8Pages), the
    # reference the whole cache; both read the same numbers, so they agree to fp32 rounding, through
    # one-token appends that fill and open pages
    cfg = InfLLMv2Config(topk=3, local_blocks=1, dense_len=0)
    lengths, H, G, D = [1, 63, 64, 65, 300, 1025], 2, 4, 64
    cache = random_decode_cache(lengths, H, D, dtype, page_size=page_size, kv_dtype=torch.float8_e4m3fn,
                                spare=80, seed=3)
    g = torch.Generator().manual_seed(4)
    for _ in range(70):
        q = torch.randn(len(lengths), H * G, D, generator=g).to(dtype)
        out, lse, idx = infllmv2_decode(q, cache, config=cfg, return_lse=True, return_topk_idx=True)
        ref, ref_lse, ref_idx = infllmv2_decode(q, cache, config=cfg, return_lse=True, return_topk_idx=True,
                                                backend="reference")
        assert torch.equal(idx, ref_idx)
        torch.testing.assert_close(out, ref, atol=2 * torch.finfo(dtype).eps * 4, rtol=0)
        torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
        k_new = torch.randn(len(lengths), H, D, generator=g).to(dtype)
        cache.append(k_new, torch.randn(len(lengths), H, D, generator=g).to(dtype))
