"""The whole pipeline: the reference `naive_infllmv2_attention` (CPU: dense fallback, sparse path,
chunked prefill, gradients, timing); `infllmv2_attention` and `InfLLMv2Attention` (dispatch, the
CPU path and the reference path on CPU, the kernel-path checks, the SDPA dense fallback); and (gpu
marker) the kernel path against the reference."""
from __future__ import annotations

import dataclasses
import math
import time

import pytest
import torch

from infllm_cupy._rules import check_kernel_block, n_windows
from infllm_cupy.compress.naive import naive_compress_k
from infllm_cupy.config import InfLLMv2Config
from infllm_cupy.pipeline import InfLLMv2Attention, infllmv2_attention, naive_infllmv2_attention
from infllm_cupy.prefill import (
    _kernel_sparse_attn,
    check_kernel_path,
    cpu_sparse_attn,
    sdpa_dense_attn_varlen,
    stage_names,
    stages_for,
)
from infllm_cupy.stage1.naive import q_block_idx_prefill, vis_limit
from infllm_cupy.stage2.naive import naive_dense_attn_varlen, naive_sparse_attn_varlen
from infllm_cupy.testing import assert_close_to_ref, assert_grads_close_to_ref, cu_seqlens_from_lengths

SPARSE = InfLLMv2Config(topk=3, local_blocks=2, dense_len=0)


def make_qkv(lq, lk=None, HQ=4, H=2, D=32, dtype=torch.float32, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    lk = lq if lk is None else lk
    q = torch.randn(sum(lq), HQ, D, generator=g)
    k = 4 * torch.randn(sum(lk), H, D, generator=g)
    v = torch.randn(sum(lk), H, D, generator=g)
    return (x.to(device, dtype) for x in (q, k, v))


def tie_free_qkv(lengths, HQ, H, D, dtype, device, seed=0):
    """Keys are multiples of 1/8 in [-1, 1]: their window means are exact in fp32 and round alike in
    the compression kernel and its reference, so both backends score (and pick) the same blocks."""
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q = torch.randn(total, HQ, D, generator=g)
    k = torch.randint(-8, 9, (total, H, D), generator=g) / 8.0
    v = torch.randn(total, H, D, generator=g)
    return (x.to(device, dtype) for x in (q, k, v))


# -------------------------------------------------------------------------- reference pipeline, CPU


def test_dense_fallback_below_dense_len():
    lengths = [300, 1, 129]
    q, k, v = make_qkv(lengths)
    cu = cu_seqlens_from_lengths(lengths)
    out, aux = naive_infllmv2_attention(q, k, v, cu, cu, 300, 300, return_aux=True)
    assert aux["dense"] and aux["topk_idx"] is None
    assert torch.equal(out, naive_dense_attn_varlen(q, k, v, cu, cu))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_sparse_path_with_room_for_every_block_is_dense(dtype):
    # out_len = 16 <= topk + local_blocks = 96: every causal block is selected
    lengths = [1000, 333, 1, 64]
    q, k, v = make_qkv(lengths, dtype=dtype)
    cu = cu_seqlens_from_lengths(lengths)
    cfg = InfLLMv2Config(dense_len=0)
    out, aux = naive_infllmv2_attention(q, k, v, cu, cu, 1000, 1000, cfg, return_aux=True)
    assert not aux["dense"] and aux["topk_idx"].shape == (2, sum(lengths), 16)
    assert out.dtype == dtype
    torch.testing.assert_close(out, naive_dense_attn_varlen(q, k, v, cu, cu), atol=1e-6, rtol=1e-6)


def test_sparse_path_intermediates():
    lengths = [1000, 200, 31]
    q, k, v = make_qkv(lengths)
    cu = cu_seqlens_from_lengths(lengths)
    out, aux = naive_infllmv2_attention(q, k, v, cu, cu, 1000, 1000, SPARSE, return_aux=True)
    ck1, cu1 = naive_compress_k(k, cu, 32, 16)
    ck2, cu2 = naive_compress_k(k, cu, 128, 64)
    assert torch.equal(aux["ck1"], ck1) and torch.equal(aux["ck2"], ck2)
    assert torch.equal(aux["cu_seqlens_c1"], cu1) and torch.equal(aux["cu_seqlens_c2"], cu2)
    T = sum(lengths)
    assert aux["scores"].shape == (2, T, n_windows(1000, 32, 16)) and aux["scores"].dtype == torch.bfloat16
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
    cu = cu_seqlens_from_lengths([L])
    cfg = dataclasses.replace(SPARSE, exact_stage1=True, score_dtype=torch.float32)
    _, aux = naive_infllmv2_attention(q, k, v, cu, cu, L, L, cfg, return_aux=True)
    assert aux["ck2"] is aux["ck1"]
    # exact mode: each visible row is the sum over G = 2 heads of a softmax over the visible fine keys
    n1 = n_windows(L, 32, 16)
    rows = torch.tensor([vis_limit(r, 16, n1, L) for r in range(L)]) > 0
    torch.testing.assert_close(aux["scores"].sum(-1)[:, rows], torch.full((2, int(rows.sum())), 2.0))
    assert bool((aux["scores"][:, ~rows] == 0).all())


def test_chunked_prefill_equals_last_rows_of_full_prefill():
    # The cached prefix is a multiple of 64 (and so of 16): the stage-1 visibility rule, the pooled
    # block layout and the query blocks then line up with the full prefill's last rows. fp32 scores,
    # so that the two runs' rounding cannot reorder nearly tied blocks.
    full, chunk = [1000, 700], [360, 124]
    q, k, v = make_qkv(full)
    cu = cu_seqlens_from_lengths(full)
    cfg = dataclasses.replace(SPARSE, score_dtype=torch.float32)
    ref, ref_aux = naive_infllmv2_attention(q, k, v, cu, cu, 1000, 1000, cfg, return_aux=True)
    rows = torch.cat([torch.arange(1000 - 360, 1000), 1000 + torch.arange(700 - 124, 700)])
    cu_chunk = cu_seqlens_from_lengths(chunk)
    out, aux = naive_infllmv2_attention(q[rows], k, v, cu_chunk, cu, 360, 1000, cfg, return_aux=True)
    assert torch.equal(aux["topk_idx"], ref_aux["topk_idx"][:, rows])
    torch.testing.assert_close(out, ref[rows], atol=1e-6, rtol=1e-6)


def test_gradients_flow_through_stage2_only():
    lengths = [700, 130]
    q, k, v = (x.requires_grad_() for x in make_qkv(lengths, D=16))
    cu = cu_seqlens_from_lengths(lengths)
    out, aux = naive_infllmv2_attention(q, k, v, cu, cu, 700, 700, SPARSE, return_aux=True)
    assert not aux["scores"].requires_grad and not aux["ck1"].requires_grad
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), do)
    want = torch.autograd.grad(naive_sparse_attn_varlen(q, k, v, cu, cu, aux["topk_idx"], 700, 700),
                               (q, k, v), do)
    for g, w in zip(grads, want):
        assert bool(torch.isfinite(g).all()) and g.abs().sum() > 0
        torch.testing.assert_close(g, w)


def test_reference_pipeline_rejects_bad_inputs():
    lengths = [100, 30]
    q, k, v = make_qkv(lengths)
    cu = cu_seqlens_from_lengths(lengths)
    with pytest.raises(TypeError, match=r"\bconfig\b"):
        naive_infllmv2_attention(q, k, v, cu, cu, 100, 100, config="sparse")
    with pytest.raises(ValueError, match=r"\bcu_seqlens_q\b"):
        naive_infllmv2_attention(q, k[:120], v[:120], cu, cu_seqlens_from_lengths([90, 30]), 100, 100)
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


def test_reference_pipeline_timing_4096_tokens_bf16():
    T, HQ, H, D = 4096, 32, 2, 128
    q, k, v = make_qkv([T], HQ=HQ, H=H, D=D, dtype=torch.bfloat16)
    cu = cu_seqlens_from_lengths([T])
    t0 = time.perf_counter()
    out, aux = naive_infllmv2_attention(q, k, v, cu, cu, T, T, InfLLMv2Config(dense_len=0), return_aux=True)
    elapsed = time.perf_counter() - t0
    print(f"naive_infllmv2_attention T={T} HQ={HQ} H={H} D={D} bf16 on CPU: {elapsed:.2f} s")
    assert not aux["dense"] and out.shape == (T, HQ, D) and bool(torch.isfinite(out).all())
    assert elapsed < 60


# ------------------------------------------------------------------------------------ dispatch, CPU


@pytest.mark.parametrize("backend", ["auto", "reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cpu_pipeline_against_naive_pipeline(backend, dtype):
    """CPU tensors: backend="reference" is the reference pipeline bit for bit; "auto" runs compression
    and stage 1's CPU implementations (the compressed keys bit for bit, the scores within an ulp of the
    score dtype: fp32 sums in another order, the same selection here) and stage 2's, within
    FlashAttention's rule of the reference on that selection."""
    lengths = [1000, 200, 31]
    q, k, v = make_qkv(lengths, dtype=dtype)
    cu = cu_seqlens_from_lengths(lengths)
    out, aux = infllmv2_attention(q, k, v, cu, cu, 1000, 1000, SPARSE, backend=backend, return_aux=True)
    ref, ref_aux = naive_infllmv2_attention(q, k, v, cu, cu, 1000, 1000, SPARSE, return_aux=True)
    assert not aux["dense"]
    for key in ("ck1", "ck2", "topk_idx"):
        assert torch.equal(aux[key], ref_aux[key]), key
    if backend == "reference":
        assert torch.equal(out, ref)
        for key in ("scores", "block_scores"):
            assert torch.equal(aux[key], ref_aux[key]), key
        return
    for key in ("scores", "block_scores"):
        got, want = aux[key].double(), ref_aux[key].double()
        fin = torch.isfinite(want)
        assert torch.equal(torch.isfinite(got), fin) and torch.equal(got[~fin], want[~fin]), key
        assert bool(((got - want)[fin].abs() <= 2.0 ** -7 * want[fin].abs()).all()), key
    idx = ref_aux["topk_idx"]
    exact = naive_sparse_attn_varlen(q.double(), k.double(), v.double(), cu, cu, idx, 1000, 1000)
    lowp = naive_sparse_attn_varlen(q, k, v, cu, cu, idx, 1000, 1000, upcast=False)
    assert_close_to_ref("out", out, exact, lowp)


def test_cpu_dense_fallback_and_chunked_prefill_against_naive():
    """CPU tensors under "auto": the dense fallback is torch SDPA and chunked prefill's stage 2 the CPU
    implementation, both within fp32 rounding of the reference pipeline; "reference" is it exactly."""
    lq, lk = [300, 90], [400, 90]
    q, k, v = make_qkv(lq, lk)
    cuq, cuk = cu_seqlens_from_lengths(lq), cu_seqlens_from_lengths(lk)
    out, aux = infllmv2_attention(q, k, v, cuq, cuk, 300, 400, return_aux=True)     # 400 < dense_len
    assert aux["dense"] and aux["topk_idx"] is None
    assert torch.equal(out, sdpa_dense_attn_varlen(q, k, v, cuq, cuk))
    ref = naive_infllmv2_attention(q, k, v, cuq, cuk, 300, 400)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(infllmv2_attention(q, k, v, cuq, cuk, 300, 400, backend="reference"), ref)
    out = infllmv2_attention(q, k, v, cuq, cuk, config=SPARSE)
    ref = naive_infllmv2_attention(q, k, v, cuq, cuk, 300, 400, SPARSE)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(infllmv2_attention(q, k, v, cuq, cuk, config=SPARSE, backend="reference"), ref)


def test_cu_seqlens_k_and_max_seqlens_default_from_cu_seqlens_q():
    lengths = [700, 65]
    q, k, v = make_qkv(lengths)
    cu = cu_seqlens_from_lengths(lengths)
    want = infllmv2_attention(q, k, v, cu, cu, 700, 700, SPARSE)
    assert torch.equal(infllmv2_attention(q, k, v, cu, config=SPARSE), want)
    assert torch.equal(infllmv2_attention(q, k, v, cu, None, 700, None, SPARSE), want)


def test_stages_for_cpu_reference_and_auto():
    """backend="reference" (stages_for's default): every stage's reference; "auto" on CPU tensors: the
    CPU implementations (the backend rule, _rules.runs_cpu) and torch SDPA for the dense fallback."""
    q = torch.zeros(1, 1, 8)
    ref = stages_for(q)
    assert set(ref) == {"compress_k", "stage1_select", "sparse_attn", "dense_attn"}
    assert stages_for(q, "reference") == ref
    names = stage_names(ref)
    assert names["sparse_attn"].endswith("naive_sparse_attn_varlen")
    assert names["dense_attn"].endswith("naive_dense_attn_varlen")
    assert names["stage1_select"].endswith("naive_stage1_select")
    assert names["compress_k"].endswith("naive_compress_k")
    auto = stages_for(q, "auto")
    assert auto["sparse_attn"] is cpu_sparse_attn and auto["dense_attn"] is sdpa_dense_attn_varlen
    auto_names = stage_names(auto)
    assert auto_names["stage1_select"] == "infllm_cupy.stage1.cpu.cpu_stage1_select"
    assert auto_names["compress_k"] == "infllm_cupy.compress.cpu.cpu_compress_k"


CPU_KERNELS = "q must be a CUDA tensor for backend='kernels' (there are no CPU kernels)"


def test_backend_kernels_on_cpu_tensors_raises_the_same_error_on_every_entry_point():
    """The backend rule (`_rules.runs_kernels`): `backend="kernels"` on CPU tensors is one ValueError,
    named after the tensor, from every entry point (no silent reference run)."""
    from infllm_cupy import (
        BlockLayout,
        DecodeCache,
        InfLLMv2Attention,
        block_sparse_attn_varlen,
        compress_k,
        infllmv2_decode,
        sparse_attn_varlen,
        sparse_decode,
        stage1_select,
    )
    from infllm_cupy.decode import decode_select, infllmv2_prefill_into_cache

    lengths = [300]
    q, k, v = make_qkv(lengths, dtype=torch.bfloat16)
    cu = cu_seqlens_from_lengths(lengths)
    ck1, cu1 = compress_k(k, cu, 32, 16)
    ck2, cu2 = compress_k(k, cu, 128, 64)
    idx = torch.zeros(k.shape[1], 300, 1, dtype=torch.int32)
    layout = BlockLayout(torch.ones(k.shape[1], 5, 5, dtype=torch.bool))
    cache = DecodeCache.contiguous(1, 512, k.shape[1], k.shape[2], dtype=torch.bfloat16)
    cache.append(k, v, [0, 300])
    q1 = q[:1]
    calls = {
        "infllmv2_attention": lambda: infllmv2_attention(q, k, v, cu, config=SPARSE, backend="kernels"),
        "InfLLMv2Attention": lambda: InfLLMv2Attention(SPARSE, backend="kernels")(q, k, v, cu),
        "stage1_select": lambda: stage1_select(q, ck1, ck2, cu, cu1, cu2, 300, backend="kernels"),
        "sparse_attn_varlen": lambda: sparse_attn_varlen(q, k, v, cu, cu, idx, 300, 300, backend="kernels"),
        "block_sparse_attn_varlen": lambda: block_sparse_attn_varlen(q, k, v, cu, cu, layout, 300, 300,
                                                                     backend="kernels"),
        "infllmv2_decode": lambda: infllmv2_decode(q1, cache, config=SPARSE, backend="kernels"),
        "decode_select": lambda: decode_select(q1, cache, config=SPARSE, backend="kernels"),
        "sparse_decode": lambda: sparse_decode(q1, cache, backend="kernels"),
        "infllmv2_prefill_into_cache": lambda: infllmv2_prefill_into_cache(
            q[:10], k[:10], v[:10], cache, [0, 10], config=SPARSE, backend="kernels"),
    }
    before = cache.lengths()
    for name, call in calls.items():
        with pytest.raises(ValueError) as e:
            call()
        assert CPU_KERNELS in str(e.value), (name, str(e.value))
    with pytest.raises(ValueError, match=r"k must be a CUDA tensor for backend='kernels'"):
        compress_k(k, cu, 32, 16, backend="kernels")
    assert cache.lengths() == before


def test_rejects_bad_backend_and_config():
    lengths = [100]
    q, k, v = make_qkv(lengths)
    cu = cu_seqlens_from_lengths(lengths)
    for bad in ("cuda", "Kernels", None, 1):
        with pytest.raises(ValueError, match=r"\bbackend\b"):
            infllmv2_attention(q, k, v, cu, backend=bad)
        with pytest.raises(ValueError, match=r"\bbackend\b"):
            InfLLMv2Attention(backend=bad)
        with pytest.raises(ValueError, match=r"\bbackend\b"):
            stages_for(q, bad)
    with pytest.raises(TypeError, match=r"\bconfig\b"):
        infllmv2_attention(q, k, v, cu, config={"topk": 3})
    with pytest.raises(TypeError, match=r"\bconfig\b"):
        InfLLMv2Attention({"topk": 3})
    with pytest.raises(ValueError, match=r"\bmax_seqlen_q\b"):
        infllmv2_attention(q, k, v, cu, cu, 50, 100)
    with pytest.raises(TypeError, match=r"\bmax_seqlen_k\b"):
        infllmv2_attention(q, k, v, cu, cu, 100, 100.0)
    with pytest.raises(ValueError, match=r"\bcu_seqlens_q\b"):
        q2, k2, v2 = make_qkv([100], [60])
        infllmv2_attention(q2, k2, v2, cu, cu_seqlens_from_lengths([60]))


def test_kernel_path_checks_without_gpu():
    check_kernel_block(64)
    for bs in (16, 128, 32, True):
        with pytest.raises(ValueError, match=r"\bblock_size must be 64\b"):
            check_kernel_block(bs)
    q, k, v = make_qkv([200], dtype=torch.bfloat16, D=64)
    cu = cu_seqlens_from_lengths([200])
    cfg128 = InfLLMv2Config(block_size=128, dense_len=0)
    with pytest.raises(ValueError, match=r"config\.block_size must be 64"):
        check_kernel_path(cfg128, q, k, v)
    # the wrapper the kernel path uses for stage 2 refuses before it reaches the kernel
    idx = torch.zeros(2, 200, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"block_size"):
        _kernel_sparse_attn(q, k, v, cu, cu, idx, 200, 200, block_size=128)
    with pytest.raises(ValueError, match=r"upcast"):
        _kernel_sparse_attn(q, k, v, cu, cu, idx, 200, 200, upcast=False)
    # gradients are no reason to refuse (stage 2 has a backward kernel); CPU tensors are no kernel inputs
    with pytest.raises(ValueError, match=r"CUDA"):
        check_kernel_path(SPARSE, q.requires_grad_(), k, v)


def test_module_forward_backward_through_reference():
    lengths = [700, 130]
    q, k, v = (x.requires_grad_() for x in make_qkv(lengths, D=16))
    cu = cu_seqlens_from_lengths(lengths)
    attn = InfLLMv2Attention(SPARSE, backend="reference")
    assert "backend='reference'" in repr(attn) and attn.config is SPARSE
    assert list(attn.parameters()) == []
    out = attn(q, k, v, cu)
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), do)
    ref = naive_infllmv2_attention(q, k, v, cu, cu, 700, 700, SPARSE)
    want = torch.autograd.grad(ref, (q, k, v), do)
    assert torch.equal(out, ref)
    for g, w in zip(grads, want):
        assert bool(torch.isfinite(g).all()) and g.abs().sum() > 0
        torch.testing.assert_close(g, w)
    # backend "auto" on CPU: the CPU implementations (stage 2's forward, the reference's backward), so
    # the default module trains on CPU too
    out2 = InfLLMv2Attention(SPARSE)(q, k, v, cu, cu, 700, 700)
    assert out2.requires_grad
    torch.testing.assert_close(out2, ref, atol=1e-5, rtol=1e-5)
    for g, w in zip(torch.autograd.grad(out2, (q, k, v), do), want):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_sdpa_dense_fallback_matches_reference(causal, monkeypatch):
    # ragged, chunked prefill (Lq < Lk), a query longer than its keys (causal: leading rows empty -> 0),
    # an empty query; a tiny mask budget so that the Lq != Lk path runs several chunks
    from infllm_cupy import prefill as prefill_module

    monkeypatch.setattr(prefill_module, "_SDPA_MASK_ELEMS", 1000)
    lq, lk = [130, 64, 70, 0, 5], [300, 64, 50, 7, 0]
    q, k, v = (x.requires_grad_() for x in make_qkv(lq, lk, HQ=6, H=2, D=16))
    cuq, cuk = cu_seqlens_from_lengths(lq), cu_seqlens_from_lengths(lk)
    out = sdpa_dense_attn_varlen(q, k, v, cuq, cuk, causal=causal)
    ref = naive_dense_attn_varlen(q, k, v, cuq, cuk, causal=causal)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    do = torch.randn_like(out)
    for g, w in zip(torch.autograd.grad(out, (q, k, v), do), torch.autograd.grad(ref, (q, k, v), do)):
        torch.testing.assert_close(g, w, atol=2e-5, rtol=2e-5)
    with pytest.raises(ValueError, match=r"return_lse"):
        sdpa_dense_attn_varlen(q, k, v, cuq, cuk, return_lse=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("D", [64, 128])
def test_sdpa_dense_fallback_low_precision_within_the_rule(dtype, D):
    """The dense fallback on CPU tensors under "auto" (torch SDPA's CPU kernels) within FlashAttention's
    rule of the float64 reference, as the kernels are held to."""
    lq, lk = [300, 1, 129], [300, 65, 200]
    q, k, v = make_qkv(lq, lk, HQ=8, H=2, D=D, dtype=dtype)
    cuq, cuk = cu_seqlens_from_lengths(lq), cu_seqlens_from_lengths(lk)
    out = sdpa_dense_attn_varlen(q, k, v, cuq, cuk)
    ref = naive_dense_attn_varlen(q.double(), k.double(), v.double(), cuq, cuk)
    lowp = naive_dense_attn_varlen(q, k, v, cuq, cuk, upcast=False)
    assert out.dtype == dtype
    assert_close_to_ref("out", out, ref, lowp)


# ------------------------------------------------------ one check and one host read per call, CPU


class _HostWork:
    """Counters of a prefill call's host reads of cu_seqlens (`_checks.cu_seqlens_host`, which every
    check and `HostSeqlens.read` go through) and of its checks of q (`_checks.check_tensor("q")`), on
    the kernel path with its stage kernels replaced by fakes: each runs its reference uncounted and
    records the `host_seqlens` it got, as the kernels would use them. The path is taken on CPU tensors
    (`runs_kernels` forced in `modules`, the kernels' dtype and device check skipped)."""

    def __init__(self, monkeypatch, *modules):
        from infllm_cupy import _checks
        from infllm_cupy import prefill as prefill_module
        from infllm_cupy.stage1.naive import naive_stage1_select

        self.reads = self.q_checks = 0
        self.stages: list[tuple[str, object]] = []      # (stage, host_seqlens) in call order
        self._counting = True
        read, check_tensor = _checks.cu_seqlens_host, _checks.check_tensor

        def counted_read(*cus):
            self.reads += self._counting
            return read(*cus)

        def counted_check(name, *args, **kwargs):
            self.q_checks += self._counting and name == "q"
            return check_tensor(name, *args, **kwargs)

        def fake(stage, reference):
            def kernel(*args, backend, host_seqlens, **kwargs):
                assert backend == "kernels"
                self.stages.append((stage, host_seqlens))
                self._counting = False
                try:
                    return reference(*args, **kwargs)
                finally:
                    self._counting = True
            return kernel

        monkeypatch.setattr(_checks, "cu_seqlens_host", counted_read)
        monkeypatch.setattr(_checks, "check_tensor", counted_check)
        monkeypatch.setattr(prefill_module, "compress_k", fake("compress_k", naive_compress_k))
        monkeypatch.setattr(prefill_module, "stage1_select", fake("stage1_select", naive_stage1_select))
        monkeypatch.setattr(prefill_module, "sparse_attn_varlen",
                            fake("sparse_attn", naive_sparse_attn_varlen))
        monkeypatch.setattr(prefill_module, "check_kernel_inputs", lambda q, k, v: None)
        for module in modules:
            monkeypatch.setattr(module, "runs_kernels", lambda q, backend="auto": True)


@pytest.mark.parametrize("same_cu", [True, False], ids=["plain", "chunked"])
def test_kernel_path_checks_and_reads_cu_seqlens_once_per_call(same_cu, monkeypatch):
    """`infllmv2_attention` on the kernel path: q checked once, both cu_seqlens read to the host in one
    copy, at the entry; every stage gets that copy (the compressed keys' offsets for stage 1) and
    neither checks nor reads again. Same output as the reference pipeline."""
    from infllm_cupy import pipeline
    from infllm_cupy._checks import HostSeqlens

    lq, lk = ([700, 130], [700, 130]) if same_cu else ([300, 130], [700, 257])
    q, k, v = make_qkv(lq, lk)
    cuq, cuk = cu_seqlens_from_lengths(lq), cu_seqlens_from_lengths(lk)
    cuq = cuk if same_cu else cuq
    want = naive_infllmv2_attention(q, k, v, cuq, cuk, max(lq), max(lk), SPARSE)
    work = _HostWork(monkeypatch, pipeline)
    out = infllmv2_attention(q, k, v, cuq, cuk, config=SPARSE)
    assert (work.reads, work.q_checks) == (1, 1)
    assert [stage for stage, _ in work.stages] == ["compress_k", "compress_k", "stage1_select", "sparse_attn"]
    host = work.stages[0][1]
    assert isinstance(host, HostSeqlens) and (host.q, host.k) == (tuple(cuq.tolist()), tuple(cuk.tolist()))
    c1 = work.stages[2][1].c1
    assert c1 == tuple(naive_compress_k(k, cuk, SPARSE.kernel_size, SPARSE.kernel_stride)[1].tolist())
    assert all(h is not None for _, h in work.stages)
    assert torch.equal(out, want)
    # the dense fallback (SDPA) takes the same copy: still one read and one check of q
    work.reads = work.q_checks = 0
    dense = InfLLMv2Config(dense_len=10**6)
    out = infllmv2_attention(q, k, v, cuq, cuk, config=dense)
    assert (work.reads, work.q_checks) == (1, 1)
    torch.testing.assert_close(out, naive_infllmv2_attention(q, k, v, cuq, cuk, max(lq), max(lk), dense),
                               atol=2e-5, rtol=2e-5)
    # bad input is still named at the entry
    with pytest.raises(ValueError, match=r"cu_seqlens_k must end at the total token count"):
        infllmv2_attention(q, k[:-1], v[:-1], cuq, cuk, config=SPARSE)


def test_prefill_into_cache_reads_no_cu_seqlens(monkeypatch):
    """The decode package's chunked prefill into a DecodeCache runs the same prefill body with the
    cache's host lengths and compressed keys: no cu_seqlens read back, no compression, each stage
    given the host copy; the output equals `naive_infllmv2_attention` on the packed cache."""
    from infllm_cupy.decode import DecodeCache, infllmv2_prefill_into_cache
    from infllm_cupy.decode import step as decode_step

    cfg = InfLLMv2Config(topk=3, local_blocks=2, dense_len=0, score_dtype=torch.float32)
    cache = DecodeCache.contiguous(2, 1024, 2, 32, dtype=torch.float32)
    for seed, lengths in enumerate(([400, 130], [200, 0])):
        q, k, v = make_qkv(lengths, HQ=4, H=2, D=32, seed=seed)
        work = _HostWork(monkeypatch, decode_step)
        out = infllmv2_prefill_into_cache(q, k, v, cache, [0, lengths[0], sum(lengths)], config=cfg)
        assert work.reads == 0
        assert [stage for stage, _ in work.stages] == ["stage1_select", "sparse_attn"]
        monkeypatch.undo()
        kc, vc, cu_k = cache.packed()
        want = naive_infllmv2_attention(q, kc, vc, cu_seqlens_from_lengths(lengths), cu_k, max(lengths),
                                        max(cache.lengths()), cfg)
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------- GPU

GPU_SHAPES = [  # (lengths, HQ, H, D)
    ([1000, 333, 2049], 8, 2, 128),      # ragged, no length a multiple of 64
    ([4097], 32, 2, 64),                 # one token past a block edge, G = 16
    ([130, 700, 1025, 63], 4, 4, 128),   # G = 1, a sequence shorter than one block
]


@pytest.mark.gpu
@pytest.mark.parametrize(("lengths", "HQ", "H", "D"),
                         [pytest.param(*s, id="L{}-HQ{}-H{}-D{}".format("_".join(map(str, s[0])), *s[1:]))
                          for s in GPU_SHAPES])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_kernels_match_reference_on_cuda(lengths, HQ, H, D, dtype):
    q, k, v = tie_free_qkv(lengths, HQ, H, D, dtype, "cuda")
    cu = cu_seqlens_from_lengths(lengths, "cuda")
    L = max(lengths)
    cfg = InfLLMv2Config(topk=4, local_blocks=2, dense_len=0, score_dtype=torch.float32)
    with torch.no_grad():
        out, aux = infllmv2_attention(q, k, v, cu, cu, L, L, cfg, backend="kernels", return_aux=True)
        ref_out, ref_aux = infllmv2_attention(q, k, v, cu, cu, L, L, cfg, backend="reference",
                                              return_aux=True)
        idx = ref_aux["topk_idx"]
        ref64 = naive_sparse_attn_varlen(q.double(), k.double(), v.double(), cu, cu, idx, L, L)
        lowp = naive_sparse_attn_varlen(q, k, v, cu, cu, idx, L, L, upcast=False)
    assert torch.equal(aux["ck1"], ref_aux["ck1"]) and torch.equal(aux["ck2"], ref_aux["ck2"])
    assert torch.equal(aux["topk_idx"], idx)
    assert (idx >= 0).sum(-1).max() < -(-L // 64), \
        "the selection must be sparse for the test to mean anything"
    assert_close_to_ref("out (kernels)", out, ref64, lowp)
    assert_close_to_ref("out (reference)", ref_out, ref64, lowp)


@pytest.mark.gpu
def test_kernel_path_chunked_prefill_on_cuda():
    lq, lk = [360, 124], [1000, 700]
    q, _, _ = tie_free_qkv(lq, 8, 2, 128, torch.bfloat16, "cuda", seed=1)
    _, k, v = tie_free_qkv(lk, 8, 2, 128, torch.bfloat16, "cuda", seed=2)
    cuq, cuk = cu_seqlens_from_lengths(lq, "cuda"), cu_seqlens_from_lengths(lk, "cuda")
    cfg = InfLLMv2Config(topk=3, local_blocks=2, dense_len=0, score_dtype=torch.float32)
    with torch.no_grad():
        out, aux = infllmv2_attention(q, k, v, cuq, cuk, config=cfg, backend="kernels", return_aux=True)
        _, ref_aux = infllmv2_attention(q, k, v, cuq, cuk, config=cfg, backend="reference", return_aux=True)
        idx = ref_aux["topk_idx"]
        ref64 = naive_sparse_attn_varlen(q.double(), k.double(), v.double(), cuq, cuk, idx, 360, 1000)
        lowp = naive_sparse_attn_varlen(q, k, v, cuq, cuk, idx, 360, 1000, upcast=False)
    assert torch.equal(aux["topk_idx"], idx)
    assert_close_to_ref("out", out, ref64, lowp)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_dense_fallback_sdpa_on_cuda(dtype):
    lq, lk = [1000, 77, 300], [1000, 77, 513]
    q, k, v = (x.requires_grad_() for x in make_qkv(lq, lk, HQ=8, H=2, D=128, dtype=dtype, device="cuda"))
    cuq, cuk = cu_seqlens_from_lengths(lq, "cuda"), cu_seqlens_from_lengths(lk, "cuda")
    out, aux = infllmv2_attention(q, k, v, cuq, cuk, backend="kernels", return_aux=True)   # 1000 < dense_len
    assert aux["dense"]
    # float64 leaves: the reference gradients stay exact instead of rounding to q's dtype
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref = naive_dense_attn_varlen(q64, k64, v64, cuq, cuk)
    lowp = naive_dense_attn_varlen(q, k, v, cuq, cuk, upcast=False)
    assert_close_to_ref("out", out, ref, lowp)
    assert_grads_close_to_ref(out, ref, lowp, (q, k, v), (q64, k64, v64))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_kernel_path_backward_on_cuda(dtype):
    # the sparse kernel path end to end with gradients: stage 1 under no_grad, stage 2's backward kernel
    lengths = [1000, 333, 130]
    q, k, v = (x.requires_grad_() for x in tie_free_qkv(lengths, 8, 2, 128, dtype, "cuda"))
    cu = cu_seqlens_from_lengths(lengths, "cuda")
    cfg = InfLLMv2Config(topk=3, local_blocks=2, dense_len=0, score_dtype=torch.float32)
    out, aux = infllmv2_attention(q, k, v, cu, cu, config=cfg, backend="kernels", return_aux=True)
    assert out.requires_grad and not aux["dense"]
    assert all(not t.requires_grad for t in (aux["ck1"], aux["ck2"], aux["topk_idx"]))
    with torch.no_grad():
        _, ref_aux = infllmv2_attention(q, k, v, cu, cu, config=cfg, backend="reference", return_aux=True)
    idx = ref_aux["topk_idx"]
    assert torch.equal(aux["topk_idx"], idx)
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref = naive_sparse_attn_varlen(q64, k64, v64, cu, cu, idx, 1000, 1000)
    lowp = naive_sparse_attn_varlen(q, k, v, cu, cu, idx, 1000, 1000, upcast=False)
    assert_grads_close_to_ref(out, ref, lowp, (q, k, v), (q64, k64, v64))


@pytest.mark.gpu
def test_kernel_path_grads_and_other_block_sizes_on_cuda():
    q, k, v = make_qkv([700], HQ=8, H=2, D=128, dtype=torch.bfloat16, device="cuda")
    cu = cu_seqlens_from_lengths([700], "cuda")
    out = infllmv2_attention(q.requires_grad_(), k, v, cu, config=SPARSE, backend="kernels")
    assert out.requires_grad
    (dq,) = torch.autograd.grad(out.float().square().sum(), (q,))
    assert dq.shape == q.shape and bool(torch.isfinite(dq).all())
    with torch.no_grad():
        with pytest.raises(ValueError, match=r"config\.block_size"):
            infllmv2_attention(q, k, v, cu, config=InfLLMv2Config(block_size=128, dense_len=0),
                               backend="auto")
        # the reference path takes any block size
        infllmv2_attention(q, k, v, cu, config=InfLLMv2Config(block_size=128, dense_len=0),
                           backend="reference")
    out = InfLLMv2Attention(SPARSE, backend="reference")(q, k, v, cu)
    assert out.requires_grad
    with torch.no_grad():
        assert InfLLMv2Attention(SPARSE)(q, k, v, cu).shape == q.shape


@pytest.mark.gpu
@pytest.mark.parametrize("dense_len", [0, 10**6], ids=["sparse", "dense"])
def test_kernel_path_copies_to_the_host_once_per_call(dense_len, monkeypatch):
    """One kernel-path prefill copies device memory to the host once: both cu_seqlens, read at the entry
    (`_checks.cu_seqlens_host`), counted there and as torch's synchronizing operations (a plain prefill
    short enough for one stage-2 pass: no other sync on the path)."""
    import warnings

    from infllm_cupy import _checks

    lengths = [1000, 300]
    q, k, v = tie_free_qkv(lengths, 8, 2, 128, torch.bfloat16, "cuda")
    cu = cu_seqlens_from_lengths(lengths, "cuda")
    cfg = InfLLMv2Config(topk=3, local_blocks=2, dense_len=dense_len)
    with torch.no_grad():
        infllmv2_attention(q, k, v, cu, config=cfg)          # first call: kernels compiled and loaded
        torch.cuda.synchronize()
        reads = []
        read = _checks.cu_seqlens_host
        monkeypatch.setattr(_checks, "cu_seqlens_host", lambda *cus: reads.append(len(cus)) or read(*cus))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                infllmv2_attention(q, k, v, cu, config=cfg)
            finally:
                torch.cuda.set_sync_debug_mode("default")
    # (torch's one-time notice that the debug mode is a prototype is no synchronization)
    syncs = [str(w.message) for w in caught if "called a synchronizing" in str(w.message)]
    assert len(reads) == 1
    assert len(syncs) == 1, syncs
