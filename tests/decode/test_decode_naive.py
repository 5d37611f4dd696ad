"""Decode reference: one query against the cache equals the last row of prefill (CPU)."""
import dataclasses

import pytest
import torch

from infllm_cupy.compress.naive import n_chunks, naive_compress_k
from infllm_cupy.decode import naive_infllmv2_decode
from infllm_cupy.pipeline import InfLLMv2Config, naive_infllmv2_attention
from infllm_cupy.stage2.naive import naive_dense_attn_varlen

# Small budget so that selection really drops blocks; fp32 scores so that the two runs' top-k
# cannot be split by bf16 rounding of nearly equal scores.
SPARSE = InfLLMv2Config(topk=3, local_blocks=2, dense_len=0, score_dtype=torch.float32)


def make_cu(lengths):
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    return cu


def make_qkv(lengths, HQ=4, H=2, D=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    return (torch.randn(T, HQ, D, generator=g), 4 * torch.randn(T, H, D, generator=g),
            torch.randn(T, H, D, generator=g))


def last_rows(lengths):
    return make_cu(lengths)[1:].long() - 1


# The last prefill row sees every fine and coarse key, as decode does, only when L % 16 != 15:
# at L % 16 == 15 (quirk A; L % 64 == 63 is quirk B, a subset) prefill's causal rule hides the most
# recent complete window from every row, while decode (non-causal) sees it. So these lengths avoid 15 mod 16.
@pytest.mark.parametrize("lengths", [[1000], [700, 1000, 130, 2], [1100, 64, 900]],
                         ids=lambda x: "L" + "-".join(map(str, x)))
@pytest.mark.parametrize("exact", [False, True], ids=["lse", "exact"])
def test_decode_equals_last_prefill_row(lengths, exact):
    cfg = dataclasses.replace(SPARSE, exact_stage1=exact)
    q, k, v = make_qkv(lengths)
    cu = make_cu(lengths)
    pre, pre_aux = naive_infllmv2_attention(q, k, v, cu, cu, max(lengths), max(lengths), cfg, return_aux=True)
    last = last_rows(lengths)
    dec, dec_aux = naive_infllmv2_decode(q[last], k, v, cu, config=cfg, return_aux=True)
    torch.testing.assert_close(dec_aux["scores"], pre_aux["scores"][:, last], atol=1e-5, rtol=1e-5)
    assert torch.equal(dec_aux["topk_idx"], pre_aux["topk_idx"][:, last])
    torch.testing.assert_close(dec, pre[last], atol=1e-5, rtol=1e-5)
    if max(lengths) > 64 * 6:
        assert bool((dec_aux["topk_idx"][:, lengths.index(max(lengths))] >= 0).sum(-1).eq(5).all())


def test_decode_differs_from_prefill_under_quirk_a():
    # L = 335 = 15 mod 16: prefill's last row cannot see fine key n1 - 1; decode scores it
    L = 335
    q, k, v = make_qkv([L])
    cu = make_cu([L])
    _, pre_aux = naive_infllmv2_attention(q, k, v, cu, cu, L, L, SPARSE, return_aux=True)
    _, dec_aux = naive_infllmv2_decode(q[-1:], k, v, cu, config=SPARSE, return_aux=True)
    n1 = n_chunks(L, 32, 16)
    assert pre_aux["scores"][:, -1, n1 - 1].eq(0).all() and dec_aux["scores"][:, 0, n1 - 1].gt(0).all()


def test_dense_decode_is_attention_over_the_whole_cache():
    lengths = [300, 1, 77]
    _, k, v = make_qkv(lengths)
    cu = make_cu(lengths)
    qd = torch.randn(3, 4, 32)
    out, aux = naive_infllmv2_decode(qd, k, v, cu, return_aux=True)           # 300 < dense_len
    assert aux["dense"] and aux["topk_idx"] is None
    want = naive_dense_attn_varlen(qd, k, v, torch.arange(4, dtype=torch.int32), cu, causal=False)
    torch.testing.assert_close(out, want)
    # a 1-token cache: the only key's value, for every head of the group
    torch.testing.assert_close(out[1], v[300].repeat_interleave(2, 0))


def test_one_token_cache_on_the_sparse_path():
    lengths = [1, 200]
    q, k, v = make_qkv(lengths)
    out, aux = naive_infllmv2_decode(q[last_rows(lengths)], k, v, make_cu(lengths), config=SPARSE, return_aux=True)
    assert aux["topk_idx"][:, 0].tolist() == [[0, -1, -1, -1], [0, -1, -1, -1]]
    torch.testing.assert_close(out[0], v[0].repeat_interleave(2, 0))


def test_precomputed_compressed_cache_is_used():
    lengths = [700, 400]
    q, k, v = make_qkv(lengths)
    cu = make_cu(lengths)
    qd = q[last_rows(lengths)]
    ck1, cu1 = naive_compress_k(k, cu, 32, 16)
    ck2, cu2 = naive_compress_k(k, cu, 128, 64)
    ref = naive_infllmv2_decode(qd, k, v, cu, config=SPARSE)
    out = naive_infllmv2_decode(qd, k, v, cu, config=SPARSE, ck1=ck1, cu_seqlens_c1=cu1, ck2=ck2, cu_seqlens_c2=cu2)
    assert torch.equal(out, ref)
    # a different (wrong) compressed cache changes the result, so the given one is really used
    wrong, aux = naive_infllmv2_decode(qd, k, v, cu, config=SPARSE, ck1=-ck1, cu_seqlens_c1=cu1, ck2=ck2,
                                       cu_seqlens_c2=cu2, return_aux=True)
    assert torch.equal(aux["ck1"], -ck1) and not torch.equal(wrong, ref)


def test_decode_rejects_bad_inputs():
    lengths = [100, 30]
    q, k, v = make_qkv(lengths)
    cu = make_cu(lengths)
    qd = q[:2]
    with pytest.raises(ValueError, match=r"\bq\b"):
        naive_infllmv2_decode(q[:2, 0], k, v, cu)
    with pytest.raises(TypeError, match=r"\bk_cache\b"):
        naive_infllmv2_decode(qd, k.double(), v, cu)
    with pytest.raises(ValueError, match=r"\bv_cache\b"):
        naive_infllmv2_decode(qd, k, v[:, :1], cu)
    with pytest.raises(ValueError, match=r"\bcu_seqlens_k\b"):
        naive_infllmv2_decode(q[:3], k, v, cu)                                  # 3 queries, 2 caches
    with pytest.raises(ValueError, match=r"\bcu_seqlens_k\b"):
        naive_infllmv2_decode(qd, k, v, make_cu([130, 0]))
    with pytest.raises(ValueError, match=r"\bck1\b"):
        naive_infllmv2_decode(qd, k, v, cu, config=SPARSE, ck1=k[:5])
    with pytest.raises(TypeError, match=r"\bconfig\b"):
        naive_infllmv2_decode(qd, k, v, cu, config={"topk": 3})
