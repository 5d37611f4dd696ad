"""The FP8 KV cache (docs/decode.md §16): its storage on every write path (chunks, one-token steps,
paged and contiguous, truncation), the compressed keys and the selection equal to the 16-bit cache's,
the references reading the dequantized pages, the accuracy contract, and the kernels' refusal."""
import pytest
import torch

from infllm_cupy.config import InfLLMv2Config
from infllm_cupy.decode import DecodeCache, decode_select, infllmv2_decode, naive_sparse_decode, sparse_decode
from infllm_cupy.decode.fp8 import E4M3, E4M3_MAX
from infllm_cupy.synthetic import structured_sequence
from infllm_cupy.testing import accuracy_per_head, cu_seqlens_from_lengths

FP8 = torch.float8_e4m3fn


def new_cache(B, cap, H, D, dtype, page_size, kv_dtype=FP8, seed=0):
    if page_size is None:
        return DecodeCache.contiguous(B, cap, H, D, dtype=dtype, kv_dtype=kv_dtype)
    per = -(-cap // page_size)
    g = torch.Generator().manual_seed(seed)
    table = torch.randperm(B * per + 2, generator=g)[:B * per].view(B, per).to(torch.int32)
    return DecodeCache.paged(B * per + 2, page_size, H, D, table, dtype=dtype, kv_dtype=kv_dtype)


def tokens(lengths, H, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return [((torch.randn(L, H, D, generator=g) * 2 + torch.randn(D, generator=g)).to(dtype),
             torch.randn(L, H, D, generator=g).to(dtype)) for L in lengths]


def fill(cache, kv, plan):
    """Append each sequence's tokens in `plan` rounds: an int n is a chunk of n per sequence (fewer when it
    runs out), "step" one token per sequence (every sequence must have one left)."""
    done = [0] * cache.batch
    for item in plan:
        if item == "step":
            cache.append(torch.stack([k[d] for (k, _), d in zip(kv, done)]),
                         torch.stack([v[d] for (_, v), d in zip(kv, done)]))
            done = [d + 1 for d in done]
            continue
        n = [min(item, k.shape[0] - d) for (k, _), d in zip(kv, done)]
        cache.append(torch.cat([k[d:d + c] for (k, _), d, c in zip(kv, done, n)]),
                     torch.cat([v[d:d + c] for (_, v), d, c in zip(kv, done, n)]), cu_seqlens_from_lengths(n))
        done = [d + c for d, c in zip(done, n)]


def state(cache):
    """Every tensor of a cache, bytes for e4m3, and its host lengths."""
    ts = [cache.k, cache.v, cache.ck1, cache.ck2, cache.seqlens, cache.k_scale, cache.v_scale, cache.k_recent,
          cache.v_open]
    return [t.view(torch.uint8).clone() if t.dtype == E4M3 else t.clone() for t in ts], cache.lengths()


def same_state(a, b):
    return a[1] == b[1] and all(torch.equal(x, y) for x, y in zip(a[0], b[0]))


def emulate(k, v, dtype):
    """K and V `[L, H, D]` stored and read as docs/decode.md §16 says, written independently of the
    cache: full 64-token pages of K per channel, V per token, both e4m3 from fp32 `x / (amax / 448)`;
    the open page as it was."""
    L = k.shape[0]
    full = L - L % 64
    kf = k[:full].float().view(-1, 64, *k.shape[1:])
    ks = kf.abs().amax(1, keepdim=True) / E4M3_MAX
    k8 = torch.where(ks > 0, kf / torch.where(ks > 0, ks, 1), 0).clamp(-448, 448).to(E4M3)
    vf = v[:full].float()
    vs = vf.abs().amax(-1, keepdim=True) / E4M3_MAX
    v8 = torch.where(vs > 0, vf / torch.where(vs > 0, vs, 1), 0).clamp(-448, 448).to(E4M3)
    kr = torch.cat([(k8.float() * ks).to(dtype).view(full, *k.shape[1:]), k[full:]])
    vr = torch.cat([(v8.float() * vs).to(dtype), v[full:]])
    return kr, vr


# ------------------------------------------------------------------------------------ the storage
@pytest.mark.parametrize("page_size", [None, 64, 128], ids=["contiguous", "page64", "page128"])
@pytest.mark.parametrize("dtype,D,H", [(torch.bfloat16, 128, 2), (torch.float16, 64, 3)],
                         ids=["bf16", "fp16"])
def test_every_fill_stores_the_same_pages_and_the_16_bit_compressed_keys(page_size, dtype, D, H):
    lengths = [1, 63, 64, 65, 130, 201]
    kv = tokens(lengths, H, D, dtype, seed=1)
    ref = new_cache(len(lengths), 256, H, D, dtype, None, kv_dtype=None)
    fill(ref, kv, [256])
    caches = []
    for plan in ([256], [1, 40, 23, 1, 64, 100], [1, 127, 200], [3, 70, 5, 128]):
        c = new_cache(len(lengths), 256, H, D, dtype, page_size)
        fill(c, kv, plan)
        assert c.lengths() == lengths and c.seqlens.tolist() == lengths
        # compressed keys from the unquantized keys: the 16-bit cache's, bit for bit
        assert torch.equal(c.ck1, ref.ck1) and torch.equal(c.ck2, ref.ck2)
        caches.append(c)
    for b, (k, v) in enumerate(kv):
        want = emulate(k, v, dtype)
        for c in caches:
            got = c.gather(b)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    for c in caches:
        kd, vd = c.dequantized()
        for b, L in enumerate(lengths):
            r, s = c.positions(b, 0, L)
            assert torch.equal(kd[r, s], c.gather(b)[0]) and torch.equal(vd[r, s], c.gather(b)[1])


@pytest.mark.parametrize("page_size", [None, 64, 192], ids=["contiguous", "page64", "page192"])
def test_one_token_steps_store_what_a_chunk_stores(page_size):
    """Steps of sequences holding different lengths (device positions: the op's path) quantize each
    page when its 64th key arrives, as a chunk does."""
    lengths0, steps = [0, 5, 63, 120], 140
    H, D, dtype = 4, 64, torch.bfloat16
    kv = tokens([n + steps for n in lengths0], H, D, dtype, seed=2)
    a = new_cache(4, 320, H, D, dtype, page_size)
    b = new_cache(4, 320, H, D, dtype, page_size)
    counts = list(lengths0)
    fill(a, [(k[:n], v[:n]) for (k, v), n in zip(kv, counts)], [320])
    for t in range(steps):
        a.append(torch.stack([k[n + t] for (k, _), n in zip(kv, counts)]),
                 torch.stack([v[n + t] for (_, v), n in zip(kv, counts)]))
        if t in (0, 62, 63, 64, 100):
            b = new_cache(4, 320, H, D, dtype, page_size)
            fill(b, [(k[:n + t + 1], v[:n + t + 1]) for (k, v), n in zip(kv, counts)], [320])
            for i in range(4):
                assert all(torch.equal(x, y) for x, y in zip(a.gather(i), b.gather(i)))
            assert torch.equal(a.ck1, b.ck1) and torch.equal(a.ck2, b.ck2)


def test_equal_length_steps_and_chunks_store_the_same_bytes():
    B, H, D, dtype = 2, 1, 128, torch.float16
    kv = tokens([150, 150], H, D, dtype, seed=3)
    a, b = new_cache(B, 200, H, D, dtype, None), new_cache(B, 200, H, D, dtype, None)
    fill(a, kv, ["step"] * 150)
    fill(b, kv, [150])
    # the 16-bit buffers past the live positions hold what each path left there: not compared
    sa, sb = state(a), state(b)
    assert sa[1] == sb[1] and all(torch.equal(x, y) for x, y in zip(sa[0][:7], sb[0][:7]))
    for i in range(B):
        assert torch.equal(a.gather(i)[0], b.gather(i)[0]) and torch.equal(a.gather(i)[1], b.gather(i)[1])


@pytest.mark.parametrize("page_size", [None, 64])
def test_failed_appends_leave_the_cache_bit_identical(page_size):
    H, D, dtype = 2, 64, torch.bfloat16
    c2 = new_cache(2, 128, H, D, dtype, page_size)
    fill(c2, tokens([70, 127], H, D, dtype, seed=4), [200])
    k = torch.randn(2, H, D).to(dtype)
    c2.append(k, k)                                     # sequence 1 fills its last page: quantized
    before = state(c2)
    with pytest.raises(ValueError, match="capacity"):
        c2.append(k, k)
    assert same_state(state(c2), before)
    with pytest.raises(ValueError, match="capacity"):
        c2.append(torch.randn(5, H, D).to(dtype), torch.randn(5, H, D).to(dtype), [0, 3, 5])
    assert same_state(state(c2), before)
    with pytest.raises((ValueError, TypeError), match="k_new"):
        c2.append(k.half(), k.half())
    with pytest.raises((ValueError, TypeError), match="k_new"):
        c2.append(k.to(FP8), k.to(FP8))
    assert same_state(state(c2), before)


@pytest.mark.parametrize("bad", [torch.float8_e5m2, torch.int8, torch.float32, "e4m3"])
def test_bad_kv_dtype_names_the_argument(bad):
    with pytest.raises(ValueError, match="kv_dtype"):
        DecodeCache.contiguous(1, 64, 1, 64, kv_dtype=bad)
    with pytest.raises(ValueError, match="kv_dtype"):
        DecodeCache.paged(2, 64, 1, 64, torch.tensor([[0, 1]], dtype=torch.int32), kv_dtype=bad)
    with pytest.raises(ValueError, match="kv_dtype"):
        DecodeCache.contiguous(1, 64, 1, 64, dtype=torch.float32, kv_dtype=FP8)


def test_default_and_same_dtype_keep_16_bit_storage():
    for kv in (None, torch.bfloat16):
        c = DecodeCache.contiguous(2, 64, 2, 64, kv_dtype=kv)
        assert not c.is_fp8 and c.kv_dtype == torch.bfloat16 and c.k_scale is None


@pytest.mark.parametrize("D", [64, 128])
def test_memory_per_token(D):
    H = 8
    c8 = DecodeCache.contiguous(2, 4096, H, D, kv_dtype=FP8)
    c16 = DecodeCache.contiguous(2, 4096, H, D)
    assert c16.bytes_per_token == 4 * H * D
    assert c8.bytes_per_token == H * (2 * D + 4 * D / 64 + 4)
    assert c8.bytes_per_token < 0.56 * c16.bytes_per_token
    # the storage and the fixed per-sequence buffers: all the cache holds
    assert c8.nbytes < 0.6 * c16.nbytes
    assert c8.nbytes == sum(t.numel() * t.element_size() for t in (
        c8.k, c8.v, c8.ck1, c8.ck2, c8.seqlens, c8.k_scale, c8.v_scale, c8.k_recent, c8.v_open))


@pytest.mark.parametrize("page_size", [None, 128])
def test_truncation_keeps_what_is_read_and_appends_go_on(page_size):
    H, D, dtype = 2, 64, torch.bfloat16
    lengths = [200, 130, 64]
    kv = tokens([L + 100 for L in lengths], H, D, dtype, seed=5)
    c = new_cache(3, 320, H, D, dtype, page_size)
    fill(c, [(k[:L], v[:L]) for (k, v), L in zip(kv, lengths)], [320])
    keep = [70, 129, 0]
    read = [c.gather(b, L) for b, L in enumerate(keep)]
    c.reset(keep)
    for b in range(3):
        assert torch.equal(c.gather(b)[0], read[b][0]) and torch.equal(c.gather(b)[1], read[b][1])
    kd = c.dequantized()[0]
    for b, L in enumerate(keep):
        assert torch.equal(kd[c.positions(b, 0, L)], read[b][0])
    # the cache takes appends again; truncating only the open page's tail is exact
    fill(c, [(k[L:L + 10], v[L:L + 10]) for (k, v), L in zip(kv, keep)], [10])
    d = new_cache(3, 320, H, D, dtype, page_size)
    fill(d, [(k[:100], v[:100]) for k, v in kv], [100])
    e = new_cache(3, 320, H, D, dtype, page_size)
    fill(e, [(k[:100], v[:100]) for k, v in kv], [100])
    e.reset([99, 98, 97])
    fill(e, [(k[L:100], v[L:100]) for (k, v), L in zip(kv, [99, 98, 97])], [5])
    assert torch.equal(d.ck1, e.ck1) and torch.equal(d.ck2, e.ck2)
    for b in range(3):
        assert torch.equal(d.gather(b)[0], e.gather(b)[0]) and torch.equal(d.gather(b)[1], e.gather(b)[1])
    c.reset()
    assert c.lengths() == [0, 0, 0]


# ------------------------------------------------------------------------ selection and the references
def structured_caches(L, HQ, H, D, rows, kv_dtype, page_size=None, seed=0):
    """`rows` caches of one structured sequence's prefixes (lengths spread over its last half), with
    each prefix's last query: per-head figures over many decode rows, as docs/decode.md §15 measured."""
    s = structured_sequence(L, HQ, H, D, dtype=torch.bfloat16, seed=seed)
    lens = [L - i * (L // (2 * rows)) for i in range(rows)]
    c = new_cache(rows, L, H, D, torch.bfloat16, page_size, kv_dtype=kv_dtype)
    c.append(torch.cat([s.k[:n] for n in lens]), torch.cat([s.v[:n] for n in lens]),
             cu_seqlens_from_lengths(lens))
    return c, s.q[torch.tensor(lens) - 1].contiguous()


@pytest.mark.parametrize("page_size", [None, 64])
@pytest.mark.parametrize("G", [1, 8])
def test_selection_equals_the_16_bit_caches(page_size, G):
    lengths, H, D, dtype = [1, 65, 700, 1100], 2, 64, torch.bfloat16
    kv = tokens(lengths, H, D, dtype, seed=6)
    cfg = InfLLMv2Config(topk=4, dense_len=0)
    c8 = new_cache(4, 1200, H, D, dtype, page_size)
    c16 = new_cache(4, 1200, H, D, dtype, page_size, kv_dtype=None)
    fill(c8, kv, ["step", 300, 1000])
    fill(c16, kv, [1200])
    q = torch.randn(4, H * G, D).to(dtype)
    assert torch.equal(decode_select(q, c8, config=cfg), decode_select(q, c16, config=cfg))
    _, i8 = infllmv2_decode(q, c8, config=cfg, return_topk_idx=True)
    _, i16 = infllmv2_decode(q, c16, config=cfg, return_topk_idx=True)
    assert torch.equal(i8, i16)


@pytest.mark.parametrize("page_size", [None, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("G", [1, 3, 32])
def test_references_read_the_dequantized_pages(page_size, dtype, G):
    """naive_sparse_decode, the step's reference path and sparse_decode on an FP8 cache are the same
    calls on the 16-bit cache holding the dequantized keys and values."""
    lengths, H, D = [1, 63, 64, 129, 400], 1, 128
    kv = tokens(lengths, H, D, dtype, seed=7)
    c8 = new_cache(5, 450, H, D, dtype, page_size)
    fill(c8, kv, ["step", 100, 300])
    deq = [c8.gather(b) for b in range(5)]
    c16 = new_cache(5, 450, H, D, dtype, page_size, kv_dtype=None)
    fill(c16, deq, [450])
    c16.ck1.copy_(c8.ck1)                     # the selection reads the unquantized keys' windows
    c16.ck2.copy_(c8.ck2)
    q = torch.randn(5, H * G, D).to(dtype)
    idx = torch.randint(-1, 8, (H, 5, 5), dtype=torch.int32)
    for sel in (None, idx):
        a = naive_sparse_decode(q, c8, sel, return_lse=True, return_attn_weights=True)
        b = naive_sparse_decode(q, c16, sel, return_lse=True, return_attn_weights=True)
        assert all(torch.equal(x, y) for x, y in zip(a, b))
        assert torch.equal(sparse_decode(q, c8, sel), sparse_decode(q, c16, sel))
    for dense_len in (0, 10_000):
        cfg = InfLLMv2Config(topk=3, dense_len=dense_len)
        a = infllmv2_decode(q, c8, config=cfg, return_lse=True, return_topk_idx=True)
        b = infllmv2_decode(q, c16, config=cfg, return_lse=True, return_topk_idx=True)
        assert all((x is None and y is None) or torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("D,HQ,H,page_size", [(128, 16, 1, None), (64, 2, 2, 128)])
def test_accuracy_contract_on_structured_caches(D, HQ, H, page_size):
    """docs/decode.md §16: cosine >= 0.999 per head against the 16-bit cache on structured caches
    (relative L1 <= 0.05); against the float64 oracle the same bars, the 16-bit cache's own error far
    below the quantization's."""
    cfg = InfLLMv2Config(topk=16, dense_len=0)
    c8, q = structured_caches(3000, HQ, H, D, 24, FP8, page_size)
    c16, _ = structured_caches(3000, HQ, H, D, 24, None, page_size)
    o8, idx8 = infllmv2_decode(q, c8, config=cfg, return_topk_idx=True)
    o16, idx16 = infllmv2_decode(q, c16, config=cfg, return_topk_idx=True)
    assert torch.equal(idx8, idx16)
    k, v, cu = c16.packed()
    kb = [(k[cu[b]:cu[b + 1]].double()[None], v[cu[b]:cu[b + 1]].double()[None]) for b in range(c16.batch)]
    o64 = torch.stack([naive_sparse_decode(q[b:b + 1].double(), (*kb[b], c16.seqlens[b:b + 1]),
                                           idx16[:, b:b + 1])[0] for b in range(c16.batch)])
    vs16 = accuracy_per_head(o8.float(), o16.float())
    vs64 = accuracy_per_head(o8.float(), o64)
    own = accuracy_per_head(o16.float(), o64)
    assert vs16["cosine"].min() >= 0.999 and vs16["rel_l1"].max() <= 0.05, vs16
    assert vs64["cosine"].min() >= 0.999 and vs64["rel_l1"].max() <= 0.05, vs64
    assert own["rel_l1"].max() < 0.5 * vs64["rel_l1"].min(), own      # the quantization's error dominates


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_accuracy_on_random_caches(dtype):
    lengths, H, G, D = [1, 90, 777, 1500], 4, 4, 64
    kv = tokens(lengths, H, D, dtype, seed=8)
    c8 = new_cache(4, 1600, H, D, dtype, 64)
    c16 = new_cache(4, 1600, H, D, dtype, 64, kv_dtype=None)
    fill(c8, kv, ["step", 700, 2000])
    fill(c16, kv, [2000])
    q = torch.randn(4, H * G, D).to(dtype)
    cfg = InfLLMv2Config(topk=8, dense_len=0)
    o8, o16 = infllmv2_decode(q, c8, config=cfg), infllmv2_decode(q, c16, config=cfg)
    acc = accuracy_per_head(o8.float()[1:], o16.float()[1:])    # a one-token cache reads its open page
    # few rows per head and no structure: a looser bar than the structured contract's
    assert acc["cosine"].min() >= 0.995 and acc["rel_l1"].max() <= 0.08, acc
    assert torch.equal(o8[0], o16[0])


# --------------------------------------------------------------------------------- kernels refused
def test_kernel_path_refuses_the_fp8_cache(monkeypatch):
    c = new_cache(2, 128, 1, 64, torch.bfloat16, None)
    fill(c, tokens([65, 3], 1, 64, torch.bfloat16, seed=9), [100])
    with pytest.raises(NotImplementedError, match="not yet verified on hardware"):
        c.read_kv(True, "infllmv2_decode")
    assert c.read_kv(False, "x")[0].dtype == torch.bfloat16
    # a stand-in for a CUDA tensor: the step and sparse_decode decide "kernels" and must refuse
    from infllm_cupy.decode import step as step_module
    monkeypatch.setattr(step_module, "runs_kernels", lambda q, backend: True)
    q = torch.randn(2, 2, 64).to(torch.bfloat16)
    with pytest.raises(NotImplementedError, match=r"infllmv2_decode.*not yet verified"):
        infllmv2_decode(q, c, config=InfLLMv2Config(dense_len=0))
    with pytest.raises(NotImplementedError, match=r"sparse_decode.*not yet verified"):
        sparse_decode(q, c)


@pytest.mark.parametrize("page_size", [None, 64])
def test_chunked_prefill_into_the_fp8_cache(page_size):
    """`infllmv2_prefill_into_cache` writes the FP8 storage as `append` does and attends over the
    dequantized cache: the 16-bit cache's compressed keys, outputs close to the 16-bit cache's."""
    from infllm_cupy.decode import infllmv2_prefill_into_cache
    H, G, D, dtype = 2, 2, 64, torch.bfloat16
    cfg = InfLLMv2Config(topk=4, dense_len=128)
    kv = tokens([300, 1, 190], H, D, dtype, seed=10)
    c8, c16 = new_cache(3, 320, H, D, dtype, page_size), new_cache(3, 320, H, D, dtype, page_size, None)
    for lo, hi in ((0, 100), (100, 300)):
        n = [max(0, min(hi, k.shape[0]) - lo) for k, _ in kv]
        k = torch.cat([k[lo:lo + c] for (k, _), c in zip(kv, n)])
        v = torch.cat([v[lo:lo + c] for (_, v), c in zip(kv, n)])
        q = torch.randn(sum(n), H * G, D).to(dtype)
        o8 = infllmv2_prefill_into_cache(q, k, v, c8, cu_seqlens_from_lengths(n), config=cfg)
        o16 = infllmv2_prefill_into_cache(q, k, v, c16, cu_seqlens_from_lengths(n), config=cfg)
        if sum(n):
            acc = accuracy_per_head(o8.float(), o16.float())
            assert acc["cosine"].min() >= 0.995, acc
    assert c8.lengths() == [300, 1, 190] and torch.equal(c8.ck1, c16.ck1) and torch.equal(c8.ck2, c16.ck2)
    d = new_cache(3, 320, H, D, dtype, page_size)
    fill(d, kv, [400])
    for b in range(3):
        assert all(torch.equal(x, y) for x, y in zip(c8.gather(b), d.gather(b)))
