"""The tolerance rule every kernel test uses (`infllm_cupy.testing.assert_close_to_ref`): its floors
must admit rounding and still catch real errors."""
import pytest
import torch

from infllm_cupy.testing import assert_close_to_ref


def test_zero_reference_admits_fp32_row_sum_rounding_only():
    # a 1-token backward: the float64 dq is exactly 0, the kernel's is the fp32 rounding of dP - rowsum
    ref = torch.zeros(1, 2, 64, dtype=torch.float64)
    lowp = torch.zeros(1, 2, 64, dtype=torch.float16)
    rounding = torch.full((1, 2, 64), 1.2e-6).half()
    assert_close_to_ref("dq", rounding, ref, lowp, mult=3)
    for wrong in (1e-4, 1e-5):
        with pytest.raises(AssertionError, match="dq: max"):
            assert_close_to_ref("dq", torch.full((1, 2, 64), wrong).half(), ref, lowp, mult=3)


def test_rule_is_relative_to_the_low_precision_error():
    torch.manual_seed(0)
    ref = torch.randn(4, 8, 128, dtype=torch.float64)
    lowp = ref.half()
    base = (lowp.double() - ref).abs().max().item()
    assert_close_to_ref("out", lowp, ref, lowp)
    with pytest.raises(AssertionError, match="out: max"):
        assert_close_to_ref("out", (ref + 10 * base).half(), ref, lowp)
    with pytest.raises(AssertionError, match="NaN"):
        assert_close_to_ref("out", torch.full_like(lowp, float("nan")), ref, lowp)


def test_accuracy_per_head_is_sageattentions_cosine_and_relative_l1():
    from infllm_cupy.testing import accuracy_per_head

    g = torch.Generator().manual_seed(0)
    ref = torch.randn(50, 3, 16, generator=g, dtype=torch.float64)
    out = ref.clone()
    out[:, 1] *= -1                                  # head 1 flipped: cosine -1, relative L1 2
    out[:, 2] += 0.01 * ref[:, 2].abs().mean()       # head 2 shifted by 1% of its mean magnitude
    acc = accuracy_per_head(out.float(), ref)
    assert acc["cosine"][0] == pytest.approx(1.0, abs=1e-7) and acc["rel_l1"][0] < 1e-6
    assert acc["cosine"][1] == pytest.approx(-1.0) and acc["rel_l1"][1] == pytest.approx(2.0)
    assert acc["rel_l1"][2] == pytest.approx(0.01, rel=1e-5) and 0.999 < acc["cosine"][2] < 1.0
    with pytest.raises(ValueError, match="one shape"):
        accuracy_per_head(out[:, :2], ref)
