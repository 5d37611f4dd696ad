"""H2O: scores accumulated from the decode step's attention weights equal those of eager attention
(matmul + softmax, HF's path) in a small model-like loop, and the kept positions are identical."""
import pytest
import torch

from infllm_cupy.config import InfLLMv2Config
from infllm_cupy.decode import H2O, DecodeCache, infllmv2_decode, sparse_decode
from infllm_cupy.decode.h2o import h2o_kept_eager
from infllm_cupy.testing import cu_seqlens_from_lengths


def eager_weights(q, keys, lengths, H, allow=None):
    """HF's eager attention weights of one decode step: repeat the KV heads, q k^T * scale,
    softmax over each sequence's keys (masked to `allow [B, H, W]` when given), summed over the group:
    `[B, H, W]` zero-padded to the cache width."""
    B, HQ, D = q.shape
    G, W = HQ // H, keys.shape[1]
    out = torch.zeros(B, H, W, dtype=torch.float64)
    for b, L in enumerate(lengths):
        k = keys[b, :L].double().repeat_interleave(G, dim=1)              # [L, HQ, D]
        s = torch.einsum("hd,lhd->hl", q[b].double(), k) * D ** -0.5     # [HQ, L]
        if allow is not None:
            s = s.masked_fill(~allow[b, :, :L].repeat_interleave(G, dim=0), float("-inf"))
        out[b, :, :L] = torch.softmax(s, -1).view(H, G, L).sum(1)
    return out


def selected_positions(idx, W, block=64):
    """bool `[B, H, W]`: positions whose block is in `topk_idx [H, B, K]`."""
    H, B, _ = idx.shape
    blocks = torch.arange(W) // block
    return torch.stack([torch.stack([torch.isin(blocks, idx[h, b][idx[h, b] >= 0]) for h in range(H)])
                        for b in range(B)])


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_h2o_matches_eager_attention_in_a_decode_loop(sparse):
    B, H, HQ, D, steps = 2, 2, 8, 16, 24
    cfg = InfLLMv2Config(topk=3, local_blocks=1, dense_len=0 if sparse else 10**6, score_dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    start = [300, 170]
    cache = DecodeCache.contiguous(B, 400, H, D, dtype=torch.float64)
    cache.append(torch.randn(sum(start), H, D, generator=g, dtype=torch.float64),
                 torch.randn(sum(start), H, D, generator=g, dtype=torch.float64),
                 cu_seqlens_from_lengths(start))
    h2o = H2O(B, H, cache.capacity, budget=96, recent=16)
    eager_scores = torch.zeros(B, H, cache.capacity, dtype=torch.float64)
    for _ in range(steps):
        k, v = torch.randn(B, H, D, generator=g, dtype=torch.float64), torch.randn(B, H, D, generator=g,
                                                                                    dtype=torch.float64)
        q = torch.randn(B, HQ, D, generator=g, dtype=torch.float64)
        cache.append(k, v)
        _out, w, idx = infllmv2_decode(q, cache, config=cfg, return_attn_weights=True, weights="per_kv_head",
                                      return_topk_idx=True)
        h2o.update(w)
        allow = selected_positions(idx, cache.capacity) if sparse else None
        eager_scores += eager_weights(q, cache.k, cache.lengths(), H, allow)
    torch.testing.assert_close(h2o.scores, eager_scores.float(), atol=1e-5, rtol=1e-5)
    kept = h2o.kept(cache.seqlens)
    want = h2o_kept_eager(eager_scores, cache.lengths(), 96, 16)
    for b in range(B):
        for h in range(H):
            assert [x for x in kept[b, h].tolist() if x >= 0] == want[b][h], (b, h)
    assert kept.shape == (B, H, 96) and bool((kept >= 0).all())


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_update_from_per_head_weights_equals_per_kv_head(sparse):
    # the step's per-KV-head weights are the per-head ones summed over the group, as update() sums them:
    # both forms accumulate the same scores, so a caller may ask for the smaller one
    B, H, HQ, D = 2, 2, 8, 16
    cfg = InfLLMv2Config(topk=3, local_blocks=1, dense_len=0 if sparse else 10**6, score_dtype=torch.float32)
    g = torch.Generator().manual_seed(5)
    lengths = [333, 190]
    cache = DecodeCache.contiguous(B, 400, H, D, dtype=torch.float32)
    cache.append(torch.randn(sum(lengths), H, D, generator=g), torch.randn(sum(lengths), H, D, generator=g),
                 cu_seqlens_from_lengths(lengths))
    by_head = H2O(B, H, cache.capacity, budget=64, recent=8)
    by_kv_head = H2O(B, H, cache.capacity, budget=64, recent=8)
    for _ in range(3):
        q = torch.randn(B, HQ, D, generator=g)
        w = infllmv2_decode(q, cache, config=cfg, return_attn_weights=True)[1]
        wk = infllmv2_decode(q, cache, config=cfg, return_attn_weights=True, weights="per_kv_head")[1]
        assert w.shape == (B, HQ, cache.capacity) and wk.shape == (B, H, cache.capacity)
        by_head.update(w)
        by_kv_head.update(wk)
    torch.testing.assert_close(by_head.scores, by_kv_head.scores, atol=1e-6, rtol=1e-6)
    assert torch.equal(by_head.kept(cache.seqlens), by_kv_head.kept(cache.seqlens))


def test_kept_rule_ties_short_sequences_and_per_head_weights():
    torch.manual_seed(1)
    h2o = H2O(3, 2, 50, budget=12, recent=4)
    w = torch.rand(3, 6, 50)                                  # per query head, G = 3
    h2o.update(w)
    torch.testing.assert_close(h2o.scores, w.view(3, 2, 3, 50).sum(2))
    h2o.scores[1, 0, 3] = h2o.scores[1, 0, 7]                 # a tie: the lower position wins
    lens = torch.tensor([7, 40, 50])
    kept = h2o.kept(lens)
    want = h2o_kept_eager(h2o.scores, lens, 12, 4)
    for b in range(3):
        for h in range(2):
            assert [x for x in kept[b, h].tolist() if x >= 0] == want[b][h]
    assert kept[0, 0].tolist() == list(range(7)) + [-1] * 5   # shorter than the budget: all kept
    assert set(range(36, 40)) <= set(kept[1, 1].tolist())     # the recent window always


def test_evict_compacts_per_head_and_attention_continues():
    torch.manual_seed(2)
    B, H, W, D, budget = 2, 2, 64, 8, 20
    h2o = H2O(B, H, W, budget=budget, recent=5)
    h2o.update(torch.rand(B, H, W))
    k, v = torch.randn(B, W, H, D), torch.randn(B, W, H, D)
    lens = torch.tensor([60, 9])
    kept = h2o.kept(lens)
    scores = h2o.scores.clone()
    k2, v2, lens2 = h2o.evict(k, v, lens)
    assert lens2.tolist() == [20, 9]
    for b in range(B):
        for h in range(H):
            pos = [x for x in kept[b, h].tolist() if x >= 0]
            assert torch.equal(k2[b, :len(pos), h], k[b, pos, h])
            assert torch.equal(v2[b, :len(pos), h], v[b, pos, h])
            assert bool((k2[b, len(pos):, h] == 0).all())
            assert torch.equal(h2o.scores[b, h, :len(pos)], scores[b, h, pos])
            assert bool((h2o.scores[b, h, len(pos):] == 0).all())
    # the compacted cache is a cache: decode over it is attention over the kept keys of each head
    q = torch.randn(B, 2 * H, D)
    out = sparse_decode(q, (k2.contiguous(), v2.contiguous(), lens2))
    for b in range(B):
        for hq in range(2 * H):
            h = hq // 2
            pos = [x for x in kept[b, h].tolist() if x >= 0]
            p = torch.softmax(k[b, pos, h] @ q[b, hq] * D ** -0.5, 0)
            torch.testing.assert_close(out[b, hq], p @ v[b, pos, h], atol=1e-5, rtol=1e-5)


def test_evict_refuses_an_fp8_cache_and_the_dequantized_one_compacts():
    # e4m3 values without their scales mean nothing: refused, nothing changed; the way the message names
    # (dequantized values, appended to a new FP8 cache) keeps what the kept positions held
    from infllm_cupy.testing import random_decode_cache

    B, H, D, budget = 2, 2, 64, 128
    cache = random_decode_cache([300, 90], H, D, torch.bfloat16, kv_dtype=torch.float8_e4m3fn, spare=20)
    h2o = H2O(B, H, cache.capacity, budget=budget, recent=16)
    h2o.update(torch.rand(B, H, cache.capacity))
    before = h2o.scores.clone()
    with pytest.raises(ValueError, match=r"k_cache.*FP8 DecodeCache.*dequantized\(\)"):
        h2o.evict(cache.k, cache.v, cache.seqlens)
    assert torch.equal(h2o.scores, before)
    k, v = cache.dequantized()
    kept = h2o.kept(cache.seqlens)
    k2, v2, lens = h2o.evict(k, v, cache.seqlens)
    new = DecodeCache.contiguous(B, budget, H, D, dtype=torch.bfloat16, kv_dtype=torch.float8_e4m3fn)
    n = lens.tolist()
    new.append(torch.cat([k2[b, :n[b]] for b in range(B)]), torch.cat([v2[b, :n[b]] for b in range(B)]),
               cu_seqlens_from_lengths(n))
    nk, nv = new.dequantized()
    for b in range(B):
        pos = [x for x in kept[b, 0].tolist() if x >= 0]
        # a re-quantized page rounds again: within e4m3's step of the first quantization
        torch.testing.assert_close(nk[b, :len(pos), 0].float(), k[b, pos, 0].float(), atol=0.25, rtol=0.07)
        torch.testing.assert_close(nv[b, :len(pos), 0].float(), v[b, pos, 0].float(), atol=0.25, rtol=0.07)


def test_h2o_bad_input_names_the_argument():
    with pytest.raises(ValueError, match="recent"):
        H2O(1, 1, 10, budget=4, recent=5)
    with pytest.raises(ValueError, match="budget"):
        H2O(1, 1, 10, budget=0, recent=0)
    h2o = H2O(2, 2, 10, budget=4, recent=1)
    with pytest.raises(ValueError, match="weights"):
        h2o.update(torch.zeros(2, 3, 10))
    with pytest.raises(ValueError, match="weights"):
        h2o.update(torch.zeros(2, 2, 11))
    with pytest.raises(ValueError, match="k_cache"):
        h2o.evict(torch.zeros(2, 10, 3, 4), torch.zeros(2, 10, 3, 4), torch.tensor([3, 3]))


@pytest.mark.gpu
def test_h2o_from_kernel_weights_matches_eager():
    # heavy hitters planted (keys aligned with every query) so the kept set is decided by margins far
    # above bf16 rounding; the kernel's per-KV-head weights drive the accumulation
    B, H, HQ, D, steps, budget, recent = 2, 2, 16, 128, 8, 24, 8
    g = torch.Generator().manual_seed(7)
    start = [500, 333]
    base = torch.randn(HQ, D, generator=g)
    cache = DecodeCache.paged(16, 64, H, D, torch.arange(16, dtype=torch.int32).view(2, 8).cuda(),
                              dtype=torch.bfloat16, device="cuda")
    k0 = torch.randn(sum(start), H, D, generator=g) * 0.3
    # budget - recent of them
    heavy = [5, 17, 40, 77, 99, 130, 150, 181, 200, 222, 260, 271, 301, 310, 320, 332]
    for t in heavy:
        for off in (0, start[0]):
            k0[off + t] = base.view(H, HQ // H, D).mean(1) * 3
    cache.append(k0.to("cuda", torch.bfloat16),
                 torch.randn(sum(start), H, D, generator=g).to("cuda", torch.bfloat16),
                 cu_seqlens_from_lengths(start, "cuda"))
    h2o = H2O(B, H, cache.capacity, budget=budget, recent=recent, device="cuda")
    eager_scores = torch.zeros(B, H, cache.capacity, dtype=torch.float64)
    for _ in range(steps):
        q = (base + 0.1 * torch.randn(HQ, D, generator=g)).expand(B, HQ, D)
        q = q.to("cuda", torch.bfloat16).contiguous()
        kn, vn = (torch.randn(B, H, D, generator=g).to("cuda", torch.bfloat16) for _ in range(2))
        cache.append(kn, vn)
        _, w = sparse_decode(q, cache, return_attn_weights=True, weights="per_kv_head")
        h2o.update(w)
        keys = torch.stack([_padded(cache, b) for b in range(B)])
        eager_scores += eager_weights(q.cpu(), keys, cache.lengths(), H)
    torch.testing.assert_close(h2o.scores.cpu(), eager_scores.float(), atol=2e-2, rtol=2e-2)
    kept = h2o.kept(cache.seqlens).cpu()
    want = h2o_kept_eager(eager_scores, cache.lengths(), budget, recent)
    for b in range(B):
        for h in range(H):
            assert [x for x in kept[b, h].tolist() if x >= 0] == want[b][h], (b, h)


def _padded(cache, b):
    """Keys of sequence b `[W, H, D]` on the CPU, zero past its length."""
    k, _ = cache.gather(b)
    out = torch.zeros(cache.capacity, cache.num_heads, cache.head_dim, dtype=k.dtype)
    out[:k.shape[0]] = k.cpu()
    return out

