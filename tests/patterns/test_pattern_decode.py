"""Decode over a static pattern: `pattern_decode` equals the last row of the prefill under the same
layout and keys (contiguous and paged caches, shared, per-sequence and per-query-head layouts, GQA),
step by step across query-block boundaries; the index it builds; argument errors."""
import pytest
import torch

from infllm_cupy.decode import DecodeCache, naive_sparse_decode
from infllm_cupy.patterns.decode import pattern_decode, pattern_topk_idx
from infllm_cupy.patterns.modules import LocalStrideSparseAttention
from infllm_cupy.stage2.attention import block_sparse_attn_varlen
from infllm_cupy.stage2.layout import BlockLayout
from infllm_cupy.testing import assert_close_to_ref, cu_seqlens_from_lengths

H, D = 2, 64


def rand(shape, dtype, seed, device="cpu"):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device, dtype)


def make_cache(kind, lengths, dtype, device="cpu", cap=512):
    B = len(lengths)
    if kind == "contiguous":
        return DecodeCache.contiguous(B, cap, H, D, dtype=dtype, device=device)
    pages = cap // 128
    table = torch.randperm(B * pages, generator=torch.Generator().manual_seed(1)).view(B, pages)
    return DecodeCache.paged(B * pages, 128, H, D, table.to(torch.int32).to(device), dtype=dtype,
                             device=device)


def prefill_last_rows(q, k, v, lengths, layout, G):
    """The prefill's output at each sequence's last token under `layout` (per KV head or, for a
    per-query-head layout, with k/v repeated per query head), causal."""
    cu = cu_seqlens_from_lengths(lengths, q.device)
    if layout.num_kv_heads != k.shape[1]:
        k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    out = block_sparse_attn_varlen(q, k, v, cu, cu, layout, max(lengths), max(lengths), causal=True)
    return out[cu[1:].long() - 1]


def layouts(kind, G, B, nqb, nkb, q_block, seed):
    g = torch.Generator().manual_seed(seed)
    if kind == "shared":
        return BlockLayout(torch.rand(H, nqb, nkb, generator=g) < 0.5, q_block)
    if kind == "per_sequence":
        return BlockLayout(torch.rand(B, H, nqb, nkb, generator=g) < 0.5, q_block)
    if kind == "q_agree":
        return BlockLayout((torch.rand(H, nqb, nkb, generator=g) < 0.5).repeat_interleave(G, 0), q_block)
    assert kind == "q_differ"
    return BlockLayout(torch.rand(H * G, nqb, nkb, generator=g) < 0.5, q_block)


@pytest.mark.parametrize("cache_kind", ["contiguous", "paged"])
@pytest.mark.parametrize("kind", ["shared", "per_sequence", "q_agree", "q_differ"])
@pytest.mark.parametrize("G", [1, 2, 4])
@pytest.mark.parametrize("q_block", [64, 128])
def test_decode_equals_prefill_last_token(cache_kind, kind, G, q_block):
    lengths = [300, 65, 128, 1]
    B, total = len(lengths), sum(lengths)
    layout = layouts(kind, G, B, -(-512 // q_block), 8, q_block, seed=G + q_block)
    q = rand((total, H * G, D), torch.float64, 0)
    k, v = rand((total, H, D), torch.float64, 1), rand((total, H, D), torch.float64, 2)
    cache = make_cache(cache_kind, lengths, torch.float64)
    cache.append(k, v, cu_seqlens_from_lengths(lengths))
    last = cu_seqlens_from_lengths(lengths)[1:].long() - 1
    out, lse = pattern_decode(q[last], cache, layout, return_lse=True)
    ref = prefill_last_rows(q, k, v, lengths, layout, G)
    assert out.shape == (B, H * G, D) and lse.shape == (B, H * G)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    # rows with nothing allowed give 0 in both, and lse = +inf in decode
    assert bool((out[torch.isinf(lse)] == 0).all())


@pytest.mark.parametrize("homo_head", [True, False])
def test_module_prefill_then_steps_across_block_boundaries(homo_head):
    """Prefill with the module, then one token per step: each step's output equals the module's
    prefill over the longer sequences at their last token (the row moves to the next query block
    at 128, 192, ...)."""
    G, lengths, steps = 2, [126, 63, 190], 4
    attn = LocalStrideSparseAttention(H * G, 320, 64, 2, 3, homo_head=homo_head)
    full = [L + steps for L in lengths]
    q = rand((sum(full), H * G, D), torch.float64, 3)
    k, v = rand((sum(full), H, D), torch.float64, 4), rand((sum(full), H, D), torch.float64, 5)
    cu_full = cu_seqlens_from_lengths(full)
    starts = cu_full[:-1].long()
    cache = make_cache("contiguous", lengths, torch.float64)
    idx0 = torch.cat([torch.arange(s, s + L) for s, L in zip(starts.tolist(), lengths)])
    cache.append(k[idx0], v[idx0], cu_seqlens_from_lengths(lengths))
    for s in range(steps):
        pos = starts + torch.tensor(lengths) + s          # the new token of each sequence
        cache.append(k[pos], v[pos])
        out = pattern_decode(q[pos], cache, attn)
        cur = [L + s + 1 for L in lengths]
        sel = torch.cat([torch.arange(st, st + L) for st, L in zip(starts.tolist(), cur)])
        pre = attn(q[sel], k[sel], v[sel], cu_seqlens=cu_seqlens_from_lengths(cur))
        torch.testing.assert_close(out, pre[cu_seqlens_from_lengths(cur)[1:].long() - 1], rtol=0, atol=1e-12)
    assert attn.layout_for(H * G, H, "cpu")[1] == (not homo_head)   # the repeat path and the collapsed one


def test_pattern_topk_idx_rows():
    mask = torch.zeros(1, 3, 4, dtype=torch.bool)       # [H=1, NQB=3, NKB=4], q_block 64
    mask[0, 0, 0] = True
    mask[0, 1, [0, 1]] = True
    mask[0, 2, [3, 0, 2]] = True
    idx = pattern_topk_idx(BlockLayout(mask), torch.tensor([1, 64, 65, 192, 0], dtype=torch.int32))
    assert idx.dtype == torch.int32 and idx.shape == (1, 5, 3)
    # positions 0, 63 -> row 0; 64 -> row 1; 191 -> row 2; an empty sequence reads row 0
    assert idx[0].tolist() == [[0, -1, -1], [0, -1, -1], [0, 1, -1], [0, 2, 3], [0, -1, -1]]


def test_bad_arguments():
    lengths = [70, 10]
    cache = make_cache("contiguous", lengths, torch.float32, cap=512)
    cache.append(rand((80, H, D), torch.float32, 0), rand((80, H, D), torch.float32, 1),
                 cu_seqlens_from_lengths(lengths))
    q = rand((2, 4, D), torch.float32, 2)
    with pytest.raises(ValueError, match="layout has 3 heads"):
        pattern_decode(q, cache, BlockLayout(torch.ones(3, 2, 2, dtype=torch.bool)))
    with pytest.raises(ValueError, match="layout covers 64"):
        pattern_decode(q, cache, BlockLayout(torch.ones(2, 1, 2, dtype=torch.bool)))
    with pytest.raises(ValueError, match="layout has 3 sequences"):
        pattern_decode(q, cache, BlockLayout(torch.ones(3, 2, 2, 2, dtype=torch.bool)))
    with pytest.raises(TypeError, match="layout must be"):
        pattern_decode(q, cache, torch.ones(2, 2, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="q has 3 heads"):
        pattern_decode(rand((2, 3, D), torch.float32, 2), cache,
                       BlockLayout(torch.ones(2, 2, 2, dtype=torch.bool)))
    with pytest.raises(TypeError, match="return_lse"):
        pattern_decode(q, cache, BlockLayout(torch.ones(2, 2, 2, dtype=torch.bool)), return_lse=1)
    with pytest.raises(TypeError, match="q must have dtype"):
        pattern_decode(q.double(), cache, BlockLayout(torch.ones(2, 2, 2, dtype=torch.bool)))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("Dh", [64, 128])
@pytest.mark.parametrize("kind, G", [("shared", 4), ("per_sequence", 2), ("q_differ", 2), ("q_agree", 8)])
@pytest.mark.parametrize("cache_kind", ["contiguous", "paged"])
def test_gpu_decode_kernel_matches_reference(dtype, Dh, kind, G, cache_kind):
    """The kernel path against the float64 reference decode with the same index (FlashAttention's
    rule, the low-precision reference as baseline), and against the CPU pattern_decode's index."""
    lengths = [1000, 65, 511, 1]
    B, total = len(lengths), sum(lengths)
    layout = layouts(kind, G, B, 16, 16, 64, seed=Dh)
    k, v = rand((total, H, Dh), dtype, 1, "cuda"), rand((total, H, Dh), dtype, 2, "cuda")
    q = rand((B, H * G, Dh), dtype, 0, "cuda")
    if cache_kind == "contiguous":
        cache = DecodeCache.contiguous(B, 1024, H, Dh, dtype=dtype, device="cuda")
    else:
        table = torch.randperm(B * 8).view(B, 8).to(torch.int32).cuda()
        cache = DecodeCache.paged(B * 8, 128, H, Dh, table, dtype=dtype, device="cuda")
    cache.append(k, v, cu_seqlens_from_lengths(lengths, "cuda"))
    out = pattern_decode(q, cache, layout)
    seqlens = cache.seqlens
    kd, vd = cache.k.double(), cache.v.double()
    tup = (kd, vd, seqlens) if cache.block_table is None else (kd, vd, seqlens, cache.block_table)
    tup_lp = (cache.k, cache.v, seqlens) if cache.block_table is None else (cache.k, cache.v, seqlens,
                                                                            cache.block_table)
    idx = pattern_topk_idx(layout, seqlens)                                     # [H or HQ, B, K]
    if idx.shape[0] == H:
        ref = naive_sparse_decode(q.double(), tup, idx)
        lowp = naive_sparse_decode(q, tup_lp, idx, upcast=False)
    else:   # per query head: one G = 1 reference per group member
        ref, lowp = torch.empty_like(q, dtype=torch.float64), torch.empty_like(q)
        for g in range(G):
            ref[:, g::G] = naive_sparse_decode(q[:, g::G].double().contiguous(), tup, idx[g::G].contiguous())
            lowp[:, g::G] = naive_sparse_decode(q[:, g::G].contiguous(), tup_lp, idx[g::G].contiguous(),
                                                upcast=False)
    assert_close_to_ref("out", out, ref, lowp)
