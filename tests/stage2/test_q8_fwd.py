"""The 8-bit stage-2 kernels (kernels_cu/stage2/q8_quantize.cu, q8_fwd.cu; docs/stage2_q8.md) on a GPU:
the quantized operands and scales against the plan's reference (`naive_q8_quantize`) bit for bit (K's
mean to one fp32 ulp, K compared given the kernel's mean), and the output against the float64 oracle
within the plan's contract and against the reference, over stage 2's shape rules: token-level
selections (a), (b), (c) and junk entries, the union walk, the causal limit, G 1-32, ragged varlen
lengths, one-token sequences, D 64/128, bf16 and fp16. Kernel outputs are poisoned (conftest sets
INFLLM_CUPY_POISON=1: NaN, and -128 for int8), so an element never written fails.

The kernels are gated off CUDA tensors until these tests pass on hardware (`VERIFIED_ON_HARDWARE`);
the fixture below lifts the gate for them, since they are what verifies the kernels."""
from __future__ import annotations

import pytest
import torch

from infllm_cupy._checks import HostSeqlens
from infllm_cupy.config import InfLLMv2Config
from infllm_cupy.prefill import select_blocks
from infllm_cupy.selections import make_selection, uniform_cu_seqlens
from infllm_cupy.stage2 import q8_fwd as q8
from infllm_cupy.stage2.naive import naive_sparse_attn_varlen
from infllm_cupy.stage2.q8_naive import k_block_base, naive_q8_quantize, naive_q8_sparse_attn_varlen
from infllm_cupy.synthetic import structured_sequence
from infllm_cupy.testing import accuracy_per_head, cu_seqlens_from_lengths, sparse_attn_inputs

pytestmark = pytest.mark.gpu

LQ = [1, 63, 64, 65, 200, 1, 130]
LK = [1, 100, 64, 65, 329, 70, 130]
COSINE_MIN = 0.999
REL_L1_MAX = {64: 0.035, 128: 0.03}


@pytest.fixture(autouse=True)
def _unverified_allowed(monkeypatch):
    monkeypatch.setattr(q8, "VERIFIED_ON_HARDWARE", True)


def host_of(cu_q, cu_k):
    return HostSeqlens.read(cu_q, cu_k)


def check_operands(got, ref, cu_k):
    """`got` (the kernels') equals `ref` (the reference's, quantized with the kernel's K mean) bit for
    bit; k_scale on the columns blocks map to."""
    got = got._replace(**{f: getattr(got, f).cpu() for f in got._fields})
    assert torch.equal(got.q8, ref.q8), "q8"
    assert torch.equal(got.q_scale, ref.q_scale), "q_scale"
    assert torch.equal(got.k8, ref.k8), "k8"
    assert torch.equal(got.v8.view(torch.uint8), ref.v8.view(torch.uint8)), "v8"
    assert torch.equal(got.v_scale, ref.v_scale), "v_scale"
    for b, base in enumerate(k_block_base(cu_k)):
        nb = -(-(cu_k[b + 1] - cu_k[b]) // 64)
        assert torch.equal(got.k_scale[:, base:base + nb], ref.k_scale[:, base:base + nb]), f"k_scale seq {b}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("G, H, D", [(1, 2, 64), (2, 2, 128), (4, 1, 64), (8, 2, 128), (16, 1, 64),
                                     (32, 1, 128)])
def test_gpu_q8_quantize_bit_for_bit(G, H, D, dtype):
    q, k, v, _, cu_q, cu_k, _ = sparse_attn_inputs(LQ, LK, G * H, H, D, dtype, seed=G + D, device="cuda")
    k = k + 2.0 * torch.randn(1, H, D, device="cuda").to(dtype)       # a shared component to smooth away
    host = host_of(cu_q, cu_k)
    got = q8.q8_quantize(q, k, v, cu_q, cu_k, host)
    own = naive_q8_quantize(q.cpu(), k.cpu(), v.cpu(), cu_q.cpu(), cu_k.cpu())
    # the mean: float64 sums in another order, rounded to fp32 -> equal but on a rounding tie
    torch.testing.assert_close(got.k_mean.cpu(), own.k_mean, rtol=2.0 ** -23, atol=0)
    ref = naive_q8_quantize(q.cpu(), k.cpu(), v.cpu(), cu_q.cpu(), cu_k.cpu(), k_mean=got.k_mean.cpu())
    check_operands(got, ref, list(host.k))


def run_both(q, k, v, cu_q, cu_k, idx, causal=True):
    host = host_of(cu_q, cu_k)
    scale = q.shape[2] ** -0.5
    ops = q8.q8_quantize(q, k, v, cu_q, cu_k, host)
    out = q8.q8_fwd(q, k, v, cu_q, cu_k, idx, host, causal, scale, operands=ops)
    assert not torch.isnan(out).any(), "an output element was never written"
    cpu_ops = ops._replace(**{f: getattr(ops, f).cpu() for f in ops._fields})
    ref = naive_q8_sparse_attn_varlen(q.cpu(), k.cpu(), v.cpu(), cu_q.cpu(), cu_k.cpu(), idx.cpu(),
                                      max(host.lq), max(host.lk), causal=causal, operands=cpu_ops)
    exact = naive_sparse_attn_varlen(q.double(), k.double(), v.double(), cu_q, cu_k, idx, max(host.lq),
                                     max(host.lk), causal=causal).cpu()
    return out.cpu(), ref, exact


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("G, H, D", [(1, 2, 64), (2, 2, 128), (4, 1, 64), (8, 2, 128), (16, 1, 64),
                                     (32, 1, 128)])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_gpu_q8_fwd_against_reference_and_oracle(G, H, D, dtype, causal):
    q, k, v, _, cu_q, cu_k, idx = sparse_attn_inputs(LQ, LK, G * H, H, D, dtype, K=9, seed=G * D,
                                                     device="cuda", empty_rows=True)
    out, ref, exact = run_both(q, k, v, cu_q, cu_k, idx, causal)
    empty = (exact == 0).all(-1)                                      # [total_q, HQ]: rows with no key
    assert bool(empty.any()) and torch.equal(out[empty], ref[empty]) and not bool(out[empty].any())
    # the reference on the same operands: the same math, fp32 rounding and exp2's approximation apart
    # (the empty rows are 0 in all three, so they add nothing to either figure)
    assert accuracy_per_head(out, ref)["rel_l1"].max().item() < 2e-3
    assert accuracy_per_head(out, exact)["cosine"].min().item() >= COSINE_MIN


@pytest.mark.parametrize("sel", ["a", "b", "c"])
@pytest.mark.parametrize("D", [64, 128])
def test_gpu_q8_fwd_selections_union_walk(sel, D):
    B, T, H, G, K = 2, 1024, 2, 8, 8
    g = torch.Generator().manual_seed(D)
    q, k, v = (torch.randn(B * T, n, D, generator=g).bfloat16().cuda() for n in (H * G, H, H))
    cu = uniform_cu_seqlens(B, T, device="cuda")
    idx = make_selection(sel, B, T, H, K, device="cuda", seed=D)
    out, ref, exact = run_both(q, k, v, cu, cu, idx)
    assert accuracy_per_head(out, ref)["rel_l1"].max().item() < 2e-3
    assert accuracy_per_head(out, exact)["cosine"].min().item() >= COSINE_MIN


@pytest.mark.parametrize("HQ, H, D", [(16, 1, 128), (2, 2, 64), (32, 1, 64), (8, 2, 128)])
def test_gpu_q8_fwd_structured_within_the_contract(HQ, H, D):
    T = 8192
    s = structured_sequence(T, HQ, H, D, dtype=torch.bfloat16, device="cuda", seed=HQ)
    cu = cu_seqlens_from_lengths([T], "cuda")
    cfg = InfLLMv2Config(dense_len=0)                                 # MiniCPM4's K = 96
    idx = select_blocks(s.q, s.k, cu, cu, T, None, True, cfg, need_scores=False)["topk_idx"]
    host = host_of(cu, cu)
    out = q8.q8_fwd(s.q, s.k, s.v, cu, cu, idx, host, True, D ** -0.5).cpu()
    exact = naive_sparse_attn_varlen(s.q.double(), s.k.double(), s.v.double(), cu, cu, idx, T, T).cpu()
    acc = accuracy_per_head(out, exact)
    assert acc["cosine"].min().item() >= COSINE_MIN and acc["rel_l1"].max().item() <= REL_L1_MAX[D], acc


def test_gpu_q8_plan_entry_still_refused_while_unverified(monkeypatch):
    monkeypatch.setattr(q8, "VERIFIED_ON_HARDWARE", False)
    q = torch.randn(4, 2, 64, device="cuda").bfloat16()
    with pytest.raises(NotImplementedError, match="not yet verified on hardware"):
        q8.check_q8_device(q)
