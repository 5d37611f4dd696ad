"""The whole InfLLM-v2 reference pipeline (CPU): dense fallback, sparse path, chunked prefill, timing."""
import dataclasses
import math
import time

import pytest
import torch

from infllm_cupy.compress.naive import n_chunks, naive_compress_k
from infllm_cupy.pipeline import InfLLMv2Config, naive_infllmv2_attention
from infllm_cupy.stage1.naive import q_block_idx_prefill, vis_limit
from infllm_cupy.stage2.naive import naive_dense_attn_varlen, naive_sparse_attn_varlen

SPARSE = InfLLMv2Config(topk=3, local_blocks=2, dense_len=0)


def make_cu(lengths):
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    return cu


def make_qkv(lq, lk=None, HQ=4, H=2, D=32, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    lk = lq if lk is None else lk
    return (torch.randn(sum(lq), HQ, D, generator=g).to(dtype), 4 * torch.randn(sum(lk), H, D, generator=g).to(dtype),
            torch.randn(sum(lk), H, D, generator=g).to(dtype))


def test_dense_fallback_below_dense_len():
    lengths = [300, 1, 129]
    q, k, v = make_qkv(lengths)
    cu = make_cu(lengths)
    out, aux = naive_infllmv2_attention(q, k, v, cu, cu, 300, 300, return_aux=True)
    assert aux["dense"] and aux["topk_idx"] is None
    assert torch.equal(out, naive_dense_attn_varlen(q, k, v, cu, cu))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_sparse_path_with_room_for_every_block_is_dense(dtype):
    # out_len = 16 <= topk + local_blocks = 96: every causal block is selected
    lengths = [1000, 333, 1, 64]
    q, k, v = make_qkv(lengths, dtype=dtype)
    cu = make_cu(lengths)
    cfg = InfLLMv2Config(dense_len=0)
    out, aux = naive_infllmv2_attention(q, k, v, cu, cu, 1000, 1000, cfg, return_aux=True)
    assert not aux["dense"] and aux["topk_idx"].shape == (2, sum(lengths), 16)
    assert out.dtype == dtype
    torch.testing.assert_close(out, naive_dense_attn_varlen(q, k, v, cu, cu), atol=1e-6, rtol=1e-6)


def test_sparse_path_intermediates():
    lengths = [1000, 200, 31]
    q, k, v = make_qkv(lengths)
    cu = make_cu(lengths)
    out, aux = naive_infllmv2_attention(q, k, v, cu, cu, 1000, 1000, SPARSE, return_aux=True)
    ck1, cu1 = naive_compress_k(k, cu, 32, 16)
    ck2, cu2 = naive_compress_k(k, cu, 128, 64)
    assert torch.equal(aux["ck1"], ck1) and torch.equal(aux["ck2"], ck2)
    assert torch.equal(aux["cu_seqlens_c1"], cu1) and torch.equal(aux["cu_seqlens_c2"], cu2)
    T = sum(lengths)
    assert aux["scores"].shape == (2, T, n_chunks(1000, 32, 16)) and aux["scores"].dtype == torch.bfloat16
    assert aux["block_scores"].shape == (2, T, math.ceil(1000 / 64))
    idx = aux["topk_idx"]
    assert idx.shape == (2, T, 5) and idx.dtype == torch.int32
    # forced blocks: block 0 and the 3 blocks ending at the query's own block
    qb = q_block_idx_prefill(cu, 1000).long()
    for t in range(T):
        want = {0} | set(range(max(0, int(qb[t]) - 2), int(qb[t]) + 1))
        assert want <= set(idx[0, t].tolist()) and want <= set(idx[1, t].tolist())
    assert not bool((idx > qb[None, :, None]).any())
    # stage 2 is the last step
    assert torch.equal(out, naive_sparse_attn_varlen(q, k, v, cu, cu, idx, 1000, 1000))
    # and it is really sparse: late tokens differ from dense attention
    assert not torch.allclose(out[900:1000], naive_dense_attn_varlen(q, k, v, cu, cu)[900:1000], atol=1e-3)


def test_exact_stage1_uses_fine_keys_as_coarse_keys():
    L = 500
    q, k, v = make_qkv([L])
    cu = make_cu([L])
    cfg = dataclasses.replace(SPARSE, exact_stage1=True, score_dtype=torch.float32)
    _, aux = naive_infllmv2_attention(q, k, v, cu, cu, L, L, cfg, return_aux=True)
    assert aux["ck2"] is aux["ck1"]
    # exact mode: each visible row is the sum over G = 2 heads of a softmax over the visible fine keys
    n1 = n_chunks(L, 32, 16)
    rows = torch.tensor([vis_limit(r, 16, n1, L) for r in range(L)]) > 0
    torch.testing.assert_close(aux["scores"].sum(-1)[:, rows], torch.full((2, int(rows.sum())), 2.0))
    assert bool((aux["scores"][:, ~rows] == 0).all())


def test_chunked_prefill_equals_last_rows_of_full_prefill():
    # The cached prefix is a multiple of 64 (and so of 16): the stage-1 visibility rule, the pooled
    # block layout and the query blocks then line up with the full prefill's last rows. fp32 scores,
    # so that the two runs' rounding cannot reorder nearly tied blocks.
    full, chunk = [1000, 700], [360, 124]
    q, k, v = make_qkv(full)
    cu = make_cu(full)
    cfg = dataclasses.replace(SPARSE, score_dtype=torch.float32)
    ref, ref_aux = naive_infllmv2_attention(q, k, v, cu, cu, 1000, 1000, cfg, return_aux=True)
    rows = torch.cat([torch.arange(1000 - 360, 1000), 1000 + torch.arange(700 - 124, 700)])
    out, aux = naive_infllmv2_attention(q[rows], k, v, make_cu(chunk), cu, 360, 1000, cfg, return_aux=True)
    assert torch.equal(aux["topk_idx"], ref_aux["topk_idx"][:, rows])
    torch.testing.assert_close(out, ref[rows], atol=1e-6, rtol=1e-6)


def test_gradients_flow_through_stage2_only():
    lengths = [700, 130]
    q, k, v = (x.requires_grad_() for x in make_qkv(lengths, D=16))
    cu = make_cu(lengths)
    out, aux = naive_infllmv2_attention(q, k, v, cu, cu, 700, 700, SPARSE, return_aux=True)
    assert not aux["scores"].requires_grad and not aux["ck1"].requires_grad
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), do)
    want = torch.autograd.grad(naive_sparse_attn_varlen(q, k, v, cu, cu, aux["topk_idx"], 700, 700), (q, k, v), do)
    for g, w in zip(grads, want):
        assert bool(torch.isfinite(g).all()) and g.abs().sum() > 0
        torch.testing.assert_close(g, w)


def test_rejects_bad_inputs():
    lengths = [100, 30]
    q, k, v = make_qkv(lengths)
    cu = make_cu(lengths)
    with pytest.raises(TypeError, match=r"\bconfig\b"):
        naive_infllmv2_attention(q, k, v, cu, cu, 100, 100, config="sparse")
    with pytest.raises(ValueError, match=r"\bcu_seqlens_q\b"):
        naive_infllmv2_attention(q, k[:120], v[:120], cu, make_cu([90, 30]), 100, 100)
    with pytest.raises(ValueError, match=r"\bmax_seqlen_k\b"):
        naive_infllmv2_attention(q, k, v, cu, cu, 100, 64)
    with pytest.raises(ValueError, match=r"\bk\b"):
        naive_infllmv2_attention(q, k[:, :, :16], v, cu, cu, 100, 100)
    with pytest.raises(ValueError, match=r"\bblock_size\b"):
        InfLLMv2Config(block_size=0)
    with pytest.raises(ValueError, match=r"\bblock_size\b"):
        InfLLMv2Config(block_size=40)
    with pytest.raises(ValueError, match=r"\btopk\b"):
        InfLLMv2Config(topk=-1)


def test_timing_4096_tokens_bf16():
    T, HQ, H, D = 4096, 32, 2, 128
    q, k, v = make_qkv([T], HQ=HQ, H=H, D=D, dtype=torch.bfloat16)
    cu = make_cu([T])
    t0 = time.perf_counter()
    out, aux = naive_infllmv2_attention(q, k, v, cu, cu, T, T, InfLLMv2Config(dense_len=0), return_aux=True)
    elapsed = time.perf_counter() - t0
    print(f"naive_infllmv2_attention T={T} HQ={HQ} H={H} D={D} bf16 on CPU: {elapsed:.2f} s")
    assert not aux["dense"] and out.shape == (T, HQ, D) and bool(torch.isfinite(out).all())
    assert elapsed < 60
