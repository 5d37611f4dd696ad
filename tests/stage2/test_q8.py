"""The 8-bit stage-2 plan (`precision="int8-fp8"`, docs/stage2_q8.md) on the CPU: its reference
(`infllm_cupy/stage2/q8_naive.py`) against the float64 oracle within the plan's accuracy contract, on
random and structured inputs, ragged varlen batches, one-token sequences, G 1-32, D 64/128, bf16 and
fp16; the quantized operands' grids and scales; the plan value on every entry (sparse_attn_varlen, the
pipeline, its module, the config, the transformers backend); bad values, gradients and CUDA tensors
refused. CPU only (the kernels' tests: tests/stage2/test_q8_fwd.py)."""
from __future__ import annotations

from unittest import mock

import pytest
import torch

from infllm_cupy._rules import PRECISIONS, check_precision
from infllm_cupy.config import InfLLMv2Config
from infllm_cupy.pipeline import InfLLMv2Attention, infllmv2_attention, naive_infllmv2_attention
from infllm_cupy.prefill import prefill, select_blocks
from infllm_cupy.stage2.attention import sparse_attn_varlen
from infllm_cupy.stage2.naive import naive_sparse_attn_varlen
from infllm_cupy.stage2.q8_fwd import check_q8_device
from infllm_cupy.stage2.q8_naive import (
    AMAX_MIN,
    E4M3_MAX,
    INT8_MAX,
    k_block_base,
    k_scale_slots,
    naive_q8_k_mean,
    naive_q8_quantize,
    naive_q8_sparse_attn_varlen,
)
from infllm_cupy.synthetic import structured_sequence
from infllm_cupy.testing import accuracy_per_head, cu_seqlens_from_lengths, sparse_attn_inputs

# ragged: lengths off the 64-token grid, one-token sequences, keys longer than queries (a cache)
LQ = [1, 63, 65, 130, 1, 200]
LK = [1, 100, 65, 130, 70, 329]
# the plan's contract (docs/stage2_q8.md §4): per head against the float64 oracle
COSINE_MIN = 0.999
REL_L1_MAX = {64: 0.035, 128: 0.03}


def inputs(HQ, H, D, dtype, K=6, seed=0, lq=LQ, lk=LK, **sel):
    q, k, v, _, cu_q, cu_k, idx = sparse_attn_inputs(lq, lk, HQ, H, D, dtype, K=K, seed=seed, device="cpu",
                                                     **sel)
    return q, k, v, cu_q, cu_k, idx, max(lq), max(lk)


def oracle(q, k, v, cu_q, cu_k, idx, mq, mk, causal=True):
    return naive_sparse_attn_varlen(q.double(), k.double(), v.double(), cu_q, cu_k, idx, mq, mk,
                                    causal=causal, return_lse=True)


def check_contract(out, ref, D, structured):
    acc = accuracy_per_head(out, ref)
    assert acc["cosine"].min().item() >= COSINE_MIN, acc["cosine"]
    if structured:
        assert acc["rel_l1"].max().item() <= REL_L1_MAX[D], acc["rel_l1"]


# ------------------------------------------------------------------------------------- accuracy


@pytest.mark.parametrize("G, H, D, dtype", [
    (1, 2, 64, torch.bfloat16), (2, 2, 128, torch.float16), (4, 1, 64, torch.float16),
    (8, 2, 128, torch.bfloat16), (16, 1, 64, torch.bfloat16), (32, 1, 128, torch.float16),
], ids=lambda x: str(x).replace("torch.", ""))
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_q8_random_inputs_within_the_contract(G, H, D, dtype, causal):
    q, k, v, cu_q, cu_k, idx, mq, mk = inputs(G * H, H, D, dtype, seed=G + D, empty_rows=True)
    out, lse = naive_q8_sparse_attn_varlen(q, k, v, cu_q, cu_k, idx, mq, mk, causal=causal, return_lse=True)
    ref, ref_lse = oracle(q, k, v, cu_q, cu_k, idx, mq, mk, causal)
    assert out.dtype == dtype and lse.dtype == torch.float32 and not torch.isnan(out).any()
    empty = torch.isinf(ref_lse)
    assert bool(empty.any()) and bool((~empty).any())
    assert torch.equal(torch.isinf(lse), empty) and bool((lse[empty] > 0).all())
    assert bool((out[empty.T] == 0).all()), "rows with no allowed key are exactly 0"
    # the contract on the rows that attend something (empty rows are exact zeros in both)
    keep = ~empty.T.all(1)
    check_contract(out[keep], ref[keep], D, structured=False)
    # lse: the 8-bit scores' own, shifted back by what smoothing took off
    assert (lse[~empty].double() - ref_lse[~empty]).abs().max().item() < 0.1


def structured_case(T, HQ, H, D, dtype, seed=0):
    s = structured_sequence(T, HQ, H, D, dtype=dtype, seed=seed)
    cu = cu_seqlens_from_lengths([T])
    cfg = InfLLMv2Config(topk=8, local_blocks=4, dense_len=0)
    idx = select_blocks(s.q, s.k, cu, cu, T, None, True, cfg, need_scores=False)["topk_idx"]
    return s.q, s.k, s.v, cu, idx


@pytest.mark.parametrize("HQ, H, D, dtype", [(16, 1, 128, torch.bfloat16), (2, 2, 64, torch.bfloat16),
                                             (8, 2, 64, torch.float16), (4, 2, 128, torch.float16)],
                         ids=["G16-D128-bf16", "G1-D64-bf16", "G4-D64-fp16", "G2-D128-fp16"])
def test_q8_structured_inputs_within_the_contract(HQ, H, D, dtype):
    T = 1536
    q, k, v, cu, idx = structured_case(T, HQ, H, D, dtype, seed=HQ)
    out = naive_q8_sparse_attn_varlen(q, k, v, cu, cu, idx, T, T)
    ref, _ = oracle(q, k, v, cu, cu, idx, T, T)
    check_contract(out, ref, D, structured=True)


def test_q8_differs_from_the_16bit_path():
    # the plan does quantize: its output is not the 16-bit one, yet within the contract of it
    q, k, v, cu_q, cu_k, idx, mq, mk = inputs(8, 2, 64, torch.bfloat16, seed=3)
    out = naive_q8_sparse_attn_varlen(q, k, v, cu_q, cu_k, idx, mq, mk)
    ref = sparse_attn_varlen(q, k, v, cu_q, cu_k, idx, mq, mk)
    assert not torch.equal(out, ref)
    assert accuracy_per_head(out, ref)["cosine"].min().item() >= COSINE_MIN


def test_q8_one_token_sequences():
    q, k, v, cu_q, cu_k, idx, mq, mk = inputs(4, 2, 64, torch.bfloat16, lq=[1, 1, 1], lk=[1, 1, 65], K=3,
                                              seed=7, empty_rows=False)
    idx[:, :, 0] = 0
    idx[:, 2, 1] = 1                                         # the last token's own block
    out = naive_q8_sparse_attn_varlen(q, k, v, cu_q, cu_k, idx, mq, mk)
    ref, _ = oracle(q, k, v, cu_q, cu_k, idx, mq, mk)
    check_contract(out, ref, 64, structured=False)
    # one key: the softmax is 1 there, so the output is v's e4m3 value times its scale
    v8 = naive_q8_quantize(q, k, v, cu_q, cu_k)
    expect = (v8.v8[0].float() * v8.v_scale[0]).repeat_interleave(2, 0)
    torch.testing.assert_close(out[0].float(), expect.to(out.dtype).float(), atol=0, rtol=0)


# ----------------------------------------------------------------------------- the quantized operands


def test_q8_operands_grids_scales_and_rounding():
    q, k, v, cu_q, cu_k, _, _, _ = inputs(8, 2, 128, torch.bfloat16, seed=11)
    k = k + 3.0 * torch.randn(1, 2, 128).bfloat16()               # a shared component: what smoothing removes
    ops = naive_q8_quantize(q, k, v, cu_q, cu_k)
    cu = cu_k.tolist()
    B, H, D = len(LK), 2, 128
    assert ops.q8.dtype == ops.k8.dtype == torch.int8 and ops.v8.dtype == torch.float8_e4m3fn
    assert ops.q8.shape == q.shape and ops.k8.shape == k.shape and ops.v8.shape == v.shape
    assert ops.q_scale.shape == q.shape[:2] and ops.k_mean.shape == ops.v_scale.shape == (B, H, D)
    assert ops.k_scale.shape == (H, k_scale_slots(k.shape[0], B))
    for t in (ops.q8, ops.k8):
        assert int(t.min()) >= -INT8_MAX and int(t.max()) <= INT8_MAX
    v8 = ops.v8.float()
    assert bool(torch.isfinite(v8).all()) and v8.abs().max().item() <= E4M3_MAX
    # every row's / block's / channel's largest magnitude lands on the grid's end
    assert bool((ops.q8.abs().amax(-1) == INT8_MAX).all())
    assert float(v8.abs().max()) == E4M3_MAX
    assert bool((ops.q_scale > 0).all()) and bool((ops.v_scale > 0).all())
    # the mean: float64 sums rounded to fp32
    torch.testing.assert_close(ops.k_mean, naive_q8_k_mean(k, cu), rtol=0, atol=0)
    for b, base in enumerate(k_block_base(cu)):
        k0, k1 = cu[b], cu[b + 1]
        exp_mean = k[k0:k1].double().mean(0).float()
        assert torch.equal(ops.k_mean[b], exp_mean)
        nb = -(-(k1 - k0) // 64)
        ks = ops.k_scale[:, base:base + nb]
        assert bool((ks > 0).all())
        for j in range(nb):
            blk = k[k0 + 64 * j:min(k1, k0 + 64 * j + 64)].float() - ops.k_mean[b]      # [n, H, D]
            amax = blk.abs().amax(dim=(0, 2)).clamp_min(AMAX_MIN)     # a one-key sequence: all 0
            assert torch.equal(ks[:, j], amax / INT8_MAX)
            q8 = (blk * (INT8_MAX / amax)[None, :, None]).round()           # round half to even
            assert torch.equal(ops.k8[k0 + 64 * j:k0 + 64 * j + blk.shape[0]].float(), q8)
        # dequantization error within half a step (int8) and e4m3's relative step (V)
        vf = v[k0:k1].float()
        err = (ops.v8[k0:k1].float() * ops.v_scale[b] - vf).abs()
        assert bool((err <= vf.abs() * 2.0 ** -4 + ops.v_scale[b] * 2.0 ** -9 * 1.0001).all())
    # the slots no block maps to stay 0, the used ones cover every block exactly once
    used = sum(-(-(cu[b + 1] - cu[b]) // 64) for b in range(B))
    assert int((ops.k_scale[0] > 0).sum()) == used
    qerr = (ops.q8.float() * ops.q_scale[..., None] - q.float()).abs()
    assert bool((qerr <= ops.q_scale[..., None] * 0.5 * 1.0001).all())


def test_q8_quantize_hand_values_and_ties():
    # q's amax 127: 127 / amax = 1, so the grid is the values rounded half to even
    q = torch.tensor([[[127.0, -63.5, 0.5, 31.75]]])
    k = torch.tensor([[[1.0, 1.0, 1.0, 1.0]], [[3.0, 1.0, 1.0, -1.0]]])
    v = torch.tensor([[[448.0, 1.0, -0.0625, 0.0]], [[224.0, -2.0, 0.0, 0.0]]])
    cu_q, cu_k = cu_seqlens_from_lengths([1]), cu_seqlens_from_lengths([2])
    ops = naive_q8_quantize(q, k, v, cu_q, cu_k)
    assert ops.q8[0, 0].tolist() == [127, -64, 0, 32] and ops.q_scale[0, 0].item() == 1.0
    # K less its mean [2, 1, 1, 0]: [[-1, 0, 0, 1], [1, 0, 0, -1]], amax 1
    assert torch.equal(ops.k_mean[0, 0], torch.tensor([2.0, 1.0, 1.0, 0.0]))
    assert ops.k8[:, 0].tolist() == [[-127, 0, 0, 127], [127, 0, 0, -127]]
    assert ops.k_scale[0, 0].item() == pytest.approx(1 / 127, rel=1e-7)
    # V per channel: amax [448, 2, 0.0625, 0 -> AMAX_MIN]
    assert ops.v_scale[0, 0].tolist() == pytest.approx([1.0, 2 / 448, 0.0625 / 448, AMAX_MIN / 448], rel=1e-7)
    assert ops.v8[:, 0].float().tolist() == [[448.0, 224.0, -448.0, 0.0], [224.0, -448.0, 0.0, 0.0]]


def test_q8_quantize_takes_a_given_mean():
    q, k, v, cu_q, cu_k, _, _, _ = inputs(4, 2, 64, torch.float16, seed=5)
    own = naive_q8_quantize(q, k, v, cu_q, cu_k)
    mean = own.k_mean + 0.25
    given = naive_q8_quantize(q, k, v, cu_q, cu_k, k_mean=mean)
    assert torch.equal(given.k_mean, mean) and not torch.equal(given.k8, own.k8)
    for a, b in ((given.q8, own.q8), (given.q_scale, own.q_scale), (given.v8.view(torch.int8),
                                                                      own.v8.view(torch.int8))):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="k_mean"):
        naive_q8_quantize(q, k, v, cu_q, cu_k, k_mean=mean[:, :1])


def test_q8_attention_from_given_operands():
    # the attention alone from a set of operands (how a kernel's quantization is checked end to end)
    q, k, v, cu_q, cu_k, idx, mq, mk = inputs(4, 2, 64, torch.bfloat16, seed=9)
    ops = naive_q8_quantize(q, k, v, cu_q, cu_k)
    a = naive_q8_sparse_attn_varlen(q, k, v, cu_q, cu_k, idx, mq, mk)
    b = naive_q8_sparse_attn_varlen(q, k, v, cu_q, cu_k, idx, mq, mk, operands=ops)
    assert torch.equal(a, b)
    c = naive_q8_sparse_attn_varlen(q, k, v, cu_q, cu_k, idx, mq, mk,
                                    operands=ops._replace(v_scale=ops.v_scale * 2))
    torch.testing.assert_close(c.float(), 2 * a.float(), rtol=1e-2, atol=1e-2)


# ------------------------------------------------------------------------------- the plan's entries


def test_sparse_attn_varlen_runs_the_q8_reference_on_cpu():
    q, k, v, cu_q, cu_k, idx, mq, mk = inputs(8, 2, 64, torch.bfloat16, seed=2, empty_rows=True)
    ref = naive_q8_sparse_attn_varlen(q, k, v, cu_q, cu_k, idx, mq, mk, return_lse=True)
    for backend in ("auto", "reference"):
        got = sparse_attn_varlen(q, k, v, cu_q, cu_k, idx, mq, mk, return_lse=True, backend=backend,
                                 precision="int8-fp8")
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    assert torch.equal(sparse_attn_varlen(q, k, v, cu_q, cu_k, idx, mq, mk, precision="16bit"),
                       sparse_attn_varlen(q, k, v, cu_q, cu_k, idx, mq, mk))
    with pytest.raises(ValueError, match="backend='kernels'"):
        sparse_attn_varlen(q, k, v, cu_q, cu_k, idx, mq, mk, backend="kernels", precision="int8-fp8")


@pytest.mark.parametrize("bad", ["int8", "fp8", "INT8-FP8", None, 8, "bf16"])
def test_bad_precision_values_raise_naming_the_argument(bad):
    q, k, v, cu_q, cu_k, idx, mq, mk = inputs(2, 1, 64, torch.bfloat16, lq=[70], lk=[70])
    with pytest.raises(ValueError, match=r"^precision must be one of"):
        sparse_attn_varlen(q, k, v, cu_q, cu_k, idx, mq, mk, precision=bad)
    with pytest.raises(ValueError, match=r"^precision must be one of"):
        InfLLMv2Config(precision=bad)
    if bad is not None:                    # None: the config's own plan
        with pytest.raises(ValueError, match=r"^precision must be one of"):
            infllmv2_attention(q, k, v, cu_q, precision=bad)
        with pytest.raises(ValueError, match=r"^precision must be one of"):
            InfLLMv2Attention(precision=bad)


def test_precision_is_keyword_only_and_checked_in_one_place():
    assert PRECISIONS == ("16bit", "int8-fp8") and check_precision("int8-fp8") == "int8-fp8"
    with pytest.raises(ValueError, match=r"^plan must be one of"):
        check_precision("x", "plan")
    q, k, v, cu_q, cu_k, idx, mq, mk = inputs(2, 1, 64, torch.bfloat16, lq=[70], lk=[70])
    with pytest.raises(TypeError):
        infllmv2_attention(q, k, v, cu_q, cu_q, 70, 70, None, "auto")        # backend is keyword-only too
    with pytest.raises(TypeError):
        sparse_attn_varlen(q, k, v, cu_q, cu_k, idx, mq, mk, True, None, False, "auto", "auto", None,
                           "int8-fp8")
    # the 8-bit K scales are per 64-key block: another block size is refused on that plan only
    InfLLMv2Config(block_size=32, kernel_stride=16, coarse_kernel_stride=32)
    with pytest.raises(ValueError, match=r"^block_size must be 64 on precision='int8-fp8'"):
        InfLLMv2Config(block_size=32, kernel_stride=16, coarse_kernel_stride=32, precision="int8-fp8")


def test_q8_gradients_are_refused_naming_the_plan():
    q, k, v, cu_q, cu_k, idx, mq, mk = inputs(4, 2, 64, torch.bfloat16, seed=4)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = sparse_attn_varlen(*leaves, cu_q, cu_k, idx, mq, mk, precision="int8-fp8")
    assert out.requires_grad                       # forward works in a graph (a model without no_grad)
    with pytest.raises(RuntimeError, match=r"precision='int8-fp8' has no backward"):
        out.float().sum().backward()
    cfg = InfLLMv2Config(dense_len=0, topk=2, local_blocks=1, precision="int8-fp8")
    out = infllmv2_attention(*leaves, cu_q, cu_k, config=cfg)
    with pytest.raises(RuntimeError, match=r"precision='int8-fp8' has no backward"):
        out.float().sum().backward()
    with torch.no_grad():                          # inference: no graph, no error
        assert not sparse_attn_varlen(*leaves, cu_q, cu_k, idx, mq, mk, precision="int8-fp8").requires_grad


def _cuda_like(t: torch.Tensor):
    """A stand-in for a CUDA tensor (no GPU here): a torch.Tensor to isinstance, on "cuda:0"."""
    m = mock.MagicMock(spec=torch.Tensor)
    m.is_cuda = True
    m.device = torch.device("cuda:0")
    m.shape, m.dtype = t.shape, t.dtype
    return m


def test_q8_cuda_tensors_refused_not_yet_verified_on_hardware():
    q, k, v, cu_q, cu_k, idx, mq, mk = inputs(2, 1, 64, torch.bfloat16, lq=[70], lk=[70])
    with pytest.raises(NotImplementedError, match="not yet verified on hardware"):
        check_q8_device(_cuda_like(q))
    check_q8_device(q)                                   # CPU tensors pass
    for backend in ("auto", "kernels"):
        with pytest.raises(NotImplementedError,
                           match=r"precision='int8-fp8' on CUDA tensors .*not yet verified"):
            sparse_attn_varlen(_cuda_like(q), k, v, cu_q, cu_k, idx, mq, mk, backend=backend,
                               precision="int8-fp8")
    # the prefill body refuses before any stage, dense or sparse
    with pytest.raises(NotImplementedError, match="not yet verified on hardware"):
        prefill(_cuda_like(q), k, v, cu_q, cu_k, mq, mk, InfLLMv2Config(precision="int8-fp8"), kernels=True,
                host_seqlens=None)


def test_q8_pipeline_module_and_reference_pipeline_agree():
    T = 700
    s = structured_sequence(T, 4, 2, 64, dtype=torch.bfloat16, seed=1)
    cu = cu_seqlens_from_lengths([T])
    cfg = InfLLMv2Config(topk=4, local_blocks=2, dense_len=0)
    q8cfg = InfLLMv2Config(topk=4, local_blocks=2, dense_len=0, precision="int8-fp8")
    out16 = infllmv2_attention(s.q, s.k, s.v, cu, config=cfg)
    out8 = infllmv2_attention(s.q, s.k, s.v, cu, config=cfg, precision="int8-fp8")
    assert torch.equal(out8, infllmv2_attention(s.q, s.k, s.v, cu, config=q8cfg))
    assert torch.equal(out8, InfLLMv2Attention(cfg, precision="int8-fp8")(s.q, s.k, s.v, cu))
    assert torch.equal(out8, naive_infllmv2_attention(s.q, s.k, s.v, cu, cu, T, T, q8cfg))
    assert torch.equal(out16, infllmv2_attention(s.q, s.k, s.v, cu, config=q8cfg, precision="16bit"))
    assert not torch.equal(out8, out16)
    acc = accuracy_per_head(out8, out16)
    assert acc["cosine"].min().item() >= COSINE_MIN and acc["rel_l1"].max().item() <= REL_L1_MAX[64]
    # below dense_len the fallback is the 16-bit dense path on either plan
    dense = dict(topk=4, local_blocks=2, dense_len=8192)
    q8dense = InfLLMv2Config(**dense, precision="int8-fp8")
    assert torch.equal(infllmv2_attention(s.q, s.k, s.v, cu, config=InfLLMv2Config(**dense)),
                       infllmv2_attention(s.q, s.k, s.v, cu, config=q8dense))
