"""`stage1_scores`: the `[H, total_q, max_n1]` score matrix from the stage-1 kernel (`return_scores`, no
top-k) against `naive_stage1_scores` in fp32 (FlashAttention's error rule, the bf16/fp16 reference as the
baseline; the launcher's outputs are NaN-poisoned under the test suite, so an unwritten element fails),
and the compat layer's `infllmv2_attn_stage1`, which returns it in the original's layout."""
from __future__ import annotations

import pytest
import torch

from infllm_cupy.compat import infllm_v2
from infllm_cupy.compress.naive import naive_compress_k
from infllm_cupy.stage1 import naive_stage1_scores, stage1_scores
from infllm_cupy.testing import assert_close_to_ref, cu_seqlens_from_lengths

DT = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _inputs(lengths, HQ, H, D, dtype, device, *, exact=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    q = torch.randn(T, HQ, D, generator=g).to(dtype)
    k = torch.randn(T, H, D, generator=g).to(dtype)
    cu = cu_seqlens_from_lengths(lengths)
    ck1, cu1 = naive_compress_k(k, cu, 32, 16)
    ck2, cu2 = (ck1, cu1) if exact else naive_compress_k(k, cu, 128, 64)
    return tuple(t.to(device) for t in (q, ck1, ck2, cu, cu1, cu2))


def test_reference_route_off_the_kernels_shapes():
    """CPU tensors, and head dims the kernel lacks, run the reference: the same tensor."""
    q, ck1, ck2, cu, cu1, cu2 = _inputs([300, 77], 4, 2, 32, torch.float32, "cpu")
    want = naive_stage1_scores(q, ck1, ck2, cu, cu1, cu2, 300)
    assert torch.equal(stage1_scores(q, ck1, ck2, cu, cu1, cu2, 300), want)
    with pytest.raises(ValueError, match="backend must be one of"):
        stage1_scores(q, ck1, ck2, cu, cu1, cu2, 300, backend="fast")
    # the backend rule of every entry (`runs_kernels`): "kernels" on CPU tensors names q
    with pytest.raises(ValueError, match=r"q must be a CUDA tensor for backend='kernels' \(there are no CPU"):
        stage1_scores(q, ck1, ck2, cu, cu1, cu2, 300, backend="kernels")
    assert torch.equal(stage1_scores(q, ck1, ck2, cu, cu1, cu2, 300, backend="reference"), want)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("HQ,H", [(2, 2), (16, 2), (32, 1), (8, 4)])
@pytest.mark.parametrize("causal", [True, False])
def test_kernel_scores_within_error_rule(dtype, D, HQ, H, causal):
    lengths = [1000, 130, 1, 700, 47]          # ragged, one token, shorter than a fine window
    args = _inputs(lengths, HQ, H, D, DT[dtype], "cuda")
    mq = max(lengths)
    got = stage1_scores(*args, mq, causal=causal, score_dtype=None)
    ref = naive_stage1_scores(*(t.double() if t.is_floating_point() else t for t in args), mq, causal=causal,
                              score_dtype=None)
    lowp = naive_stage1_scores(*args, mq, causal=causal, score_dtype=DT[dtype])
    assert got.dtype == torch.float32 and got.shape == ref.shape
    assert_close_to_ref(f"stage1_scores {dtype} D{D} G{HQ // H}", got.double(), ref, lowp.double())
    bf = stage1_scores(*args, mq, causal=causal)                    # default: bf16, as the original
    assert bf.dtype == torch.bfloat16 and torch.equal(bf, got.to(torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize("width", ["exact", "narrower", "wider"])
def test_compat_stage1_is_the_kernel_scores_in_the_original_layout(exact, width):
    lengths = [900, 257, 3]
    q, ck1, ck2, cu, cu1, cu2 = _inputs(lengths, 32, 2, 128, torch.bfloat16, "cuda", exact=exact, seed=1)
    n1 = int((cu1[1:] - cu1[:-1]).max())
    max_k = {"exact": n1, "narrower": n1 - 5, "wider": n1 + 70}[width]
    out = infllm_v2.infllmv2_attn_stage1(q, ck1, ck2, cu, cu1, cu2, max(lengths), max_k,
                                         causal=True)
    want = stage1_scores(q, ck1, ck2, cu, cu1, cu2, max(lengths), causal=True)
    assert out.dtype == torch.bfloat16 and out.shape == (2, sum(lengths), max_k) and out.is_contiguous()
    w = min(n1, max_k)
    assert torch.equal(out[:, :, :w], want[:, :, :w])
    assert not bool(out[:, :, w:].any()), "columns past the scores are zero, as the original's buffer"
