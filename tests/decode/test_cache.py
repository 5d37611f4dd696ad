"""DecodeCache: appends (chunks and one-token steps), incremental compression against recompressing
from scratch, paged against contiguous, and errors that leave the cache unchanged."""
import pytest
import torch

from infllm_cupy._rules import COMPRESSIONS, n_windows
from infllm_cupy.compress import compress_k, naive_compress_k
from infllm_cupy.decode import DecodeCache
from infllm_cupy.testing import cu_seqlens_from_lengths


def new_cache(B, cap, H, D, dtype, page_size, device="cpu", seed=0):
    if page_size is None:
        return DecodeCache.contiguous(B, cap, H, D, dtype=dtype, device=device)
    per = -(-cap // page_size)
    g = torch.Generator().manual_seed(seed)
    table = torch.randperm(B * per + 2, generator=g)[:B * per].view(B, per).to(torch.int32)
    return DecodeCache.paged(B * per + 2, page_size, H, D, table.to(device), dtype=dtype, device=device)


def fill(cache, chunks, steps, seed=0):
    """Append ragged chunks (lists of per-sequence counts), then `steps` one-token steps; returns the
    packed keys and values appended to each sequence, in order."""
    g = torch.Generator().manual_seed(seed)
    B, H, D = cache.batch, cache.num_heads, cache.head_dim
    ks = [[] for _ in range(B)]
    vs = [[] for _ in range(B)]
    for counts in chunks:
        k = torch.randn(sum(counts), H, D, generator=g).to(cache.device, cache.dtype)
        v = torch.randn(sum(counts), H, D, generator=g).to(cache.device, cache.dtype)
        cache.append(k, v, cu_seqlens_from_lengths(counts) if chunks else None)
        o = 0
        for b, n in enumerate(counts):
            ks[b].append(k[o:o + n])
            vs[b].append(v[o:o + n])
            o += n
    for _ in range(steps):
        k = torch.randn(B, H, D, generator=g).to(cache.device, cache.dtype)
        v = torch.randn(B, H, D, generator=g).to(cache.device, cache.dtype)
        cache.append(k, v)
        for b in range(B):
            ks[b].append(k[b:b + 1])
            vs[b].append(v[b:b + 1])
    return [torch.cat(x) for x in ks], [torch.cat(x) for x in vs]


def assert_compressed_equal_recompression(cache, exact=True, compress=naive_compress_k):
    k, _, cu = cache.packed()
    c1, cu1, c2, cu2 = cache.packed_compressed()
    for (kr, st), got, got_cu in zip(COMPRESSIONS, (c1, c2), (cu1, cu2)):
        want, want_cu = compress(k, cu, kr, st)
        assert torch.equal(got_cu, want_cu)
        if exact:
            assert torch.equal(got, want), f"ck({kr},{st}) differs from recompression"
        else:   # GPU: the kernel's fp32 sum runs in another order than torch's mean
            torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1e-2)


def snapshot(cache):
    t = {n: getattr(cache, n).clone() for n in ("k", "v", "ck1", "ck2", "seqlens")}
    if cache.is_paged:
        t["block_table"] = cache.block_table.clone()
    return t, cache.lengths(), cache.capacities()


def assert_unchanged(cache, snap):
    t, lens, caps = snap
    for n, x in t.items():
        assert torch.equal(getattr(cache, n), x), f"{n} changed"
    assert cache.lengths() == lens and cache.capacities() == caps


LAYOUTS = [None, 64, 256]
LAYOUT_IDS = ["contiguous", "page64", "page256"]


@pytest.mark.parametrize("page_size", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_incremental_compression_equals_recompression(page_size, dtype):
    # lengths cross 32/16 and 128/64 windows at every phase: chunk ends inside and on window edges,
    # an empty chunk, a sequence that only grows by steps, then steps across several window ends
    cache = new_cache(4, 700, 2, 16, dtype, page_size)
    ks, vs = fill(cache, [[31, 0, 128, 200], [1, 16, 0, 250], [100, 47, 1, 0]], steps=70)
    assert cache.lengths() == [202, 133, 199, 520]
    for b in range(4):
        k, v = cache.gather(b)
        assert torch.equal(k, ks[b]) and torch.equal(v, vs[b])
    assert_compressed_equal_recompression(cache)
    n1, n2 = cache.compressed_lens()
    assert n1.tolist() == [n_windows(L, 32, 16) for L in cache.lengths()]
    assert n2.tolist() == [n_windows(L, 128, 64) for L in cache.lengths()]


def test_every_step_keeps_the_compression_current():
    cache = new_cache(2, 300, 1, 8, torch.float32, 64)
    g = torch.Generator().manual_seed(1)
    for step in range(260):
        cache.append(torch.randn(2, 1, 8, generator=g), torch.randn(2, 1, 8, generator=g))
        if step % 16 in (14, 15, 0) or step > 250:
            assert_compressed_equal_recompression(cache)
    assert cache.lengths() == [260, 260] and cache.seqlens.tolist() == [260, 260]


@pytest.mark.parametrize("page_size", [64, 256])
def test_paged_equals_contiguous(page_size):
    a = new_cache(3, 600, 2, 16, torch.bfloat16, None)
    b = new_cache(3, 600, 2, 16, torch.bfloat16, page_size, seed=5)
    chunks = [[300, 5, 64], [0, 60, 1]]
    fill(a, chunks, steps=66)
    fill(b, chunks, steps=66)
    assert a.lengths() == b.lengths()
    for x, y in zip(a.packed(), b.packed()):
        assert torch.equal(x, y)
    for x, y in zip(a.packed_compressed(), b.packed_compressed()):
        assert torch.equal(x, y)
    # the tokens landed on the pages the table names
    L = b.lengths()[0]
    page = b.block_table[0, (L - 1) // page_size]
    assert torch.equal(b.k[page, (L - 1) % page_size], a.k[0, L - 1])


def test_recompress_and_reset():
    cache = new_cache(2, 400, 1, 8, torch.float32, 64)
    fill(cache, [[300, 200]], steps=3)
    good = (cache.ck1.clone(), cache.ck2.clone())
    cache.ck1.zero_()
    cache.ck2.zero_()
    cache.recompress()
    assert torch.equal(cache.ck1, good[0]) and torch.equal(cache.ck2, good[1])
    cache.reset([100, 203])
    assert cache.lengths() == [100, 203] and cache.seqlens.tolist() == [100, 203]
    with pytest.raises(ValueError, match="seqlens"):
        cache.reset([101, 203])                      # longer than what sequence 0 holds now
    cache.reset()
    assert cache.lengths() == [0, 0] and cache.max_len() == 0


def test_one_token_step_accepts_a_q_len_axis():
    a = new_cache(2, 100, 2, 8, torch.float32, None)
    b = new_cache(2, 100, 2, 8, torch.float32, None)
    k, v = torch.randn(2, 2, 8), torch.randn(2, 2, 8)
    a.append(k, v)
    b.append(k[:, None], v[:, None])
    assert torch.equal(a.k, b.k) and a.lengths() == b.lengths() == [1, 1]


# ------------------------------------------------------------------------------------------------ errors
@pytest.mark.parametrize("page_size", LAYOUTS, ids=LAYOUT_IDS)
def test_errors_leave_the_cache_unchanged(page_size):
    cache = new_cache(2, 256, 2, 16, torch.bfloat16, page_size)
    fill(cache, [[250, 100]], steps=0)
    snap = snapshot(cache)
    caps = cache.capacities()
    bf = dict(dtype=torch.bfloat16)
    bad = [
        # one-token steps
        ((torch.randn(2, 2, 8, **bf), torch.randn(2, 2, 16, **bf)), {}, ValueError, "k_new"),
        ((torch.randn(2, 2, 16, **bf), torch.randn(3, 2, 16, **bf)), {}, ValueError, "v_new"),
        ((torch.randn(2, 2, 16), torch.randn(2, 2, 16)), {}, TypeError, "k_new"),
        ((torch.randn(2, 2, 16, **bf), torch.randn(2, 2, 16, dtype=torch.float16)), {}, TypeError, "v_new"),
        ((torch.randn(2, 2, 2, 16, **bf), torch.randn(2, 2, 2, 16, **bf)), {}, ValueError, "k_new"),
        # chunks: past the capacity of sequence 0, bad offsets, total that differs from the tensors
        ((torch.randn(caps[0] - 250 + 1, 2, 16, **bf),) * 2,
         dict(cu_seqlens_new=[0, caps[0] - 250 + 1, caps[0] - 249]), ValueError, "k_new"),
        ((torch.randn(caps[0] - 250 + 1, 2, 16, **bf),) * 2,
         dict(cu_seqlens_new=[0, caps[0] - 250 + 1, caps[0] - 250 + 1]), ValueError, "capacity"),
        ((torch.randn(4, 2, 16, **bf),) * 2, dict(cu_seqlens_new=[0, 3, 2]), ValueError, "cu_seqlens_new"),
        ((torch.randn(4, 2, 16, **bf),) * 2, dict(cu_seqlens_new=[1, 3, 4]), ValueError, "cu_seqlens_new"),
        ((torch.randn(4, 2, 16, **bf),) * 2, dict(cu_seqlens_new=[0, 4]), ValueError, "cu_seqlens_new"),
        ((torch.randn(4, 2, 16, **bf),) * 2, dict(cu_seqlens_new=[0, 2, 5]), ValueError, "k_new"),
    ]
    for args, kw, exc, match in bad:
        with pytest.raises(exc, match=match):
            cache.append(*args, **kw)
        assert_unchanged(cache, snap)
    # one-token steps up to the capacity of sequence 0 work, the next one fails and writes nothing
    for _ in range(caps[0] - 250):
        cache.append(torch.randn(2, 2, 16, **bf), torch.randn(2, 2, 16, **bf))
    snap = snapshot(cache)
    with pytest.raises(ValueError, match="capacity"):
        cache.append(torch.randn(2, 2, 16, **bf), torch.randn(2, 2, 16, **bf))
    assert_unchanged(cache, snap)
    assert_compressed_equal_recompression(cache)


def test_block_table_errors():
    def table(rows):
        return torch.tensor(rows, dtype=torch.int32)

    ok = table([[0, 1, 2], [3, 4, -1]])
    cache = DecodeCache.paged(6, 64, 1, 8, ok, dtype=torch.float32)
    assert cache.capacities() == [192, 128] and cache.capacity == 192
    for rows, match in [([[0, 1, 6], [3, 4, -1]], "out of range"), ([[0, 1, -2], [3, 4, 5]], "out of range"),
                        ([[0, 1, 2], [3, 2, -1]], "listed twice"), ([[0, 0, 2], [3, 4, 5]], "listed twice"),
                        ([[0, -1, 2], [3, 4, 5]], "after a -1")]:
        with pytest.raises(ValueError, match=match):
            DecodeCache.paged(6, 64, 1, 8, table(rows), dtype=torch.float32)
    with pytest.raises(TypeError, match="block_table"):
        DecodeCache.paged(6, 64, 1, 8, ok.long(), dtype=torch.float32)
    with pytest.raises(ValueError, match="page_size"):
        DecodeCache.paged(6, 96, 1, 8, ok, dtype=torch.float32)
    # a table update: the pages holding tokens stay, new pages may be granted; checked like the first
    fill(cache, [[100, 128]], steps=0)
    snap = snapshot(cache)
    with pytest.raises(ValueError, match="first 2 pages"):
        cache.set_block_table(table([[0, 5, 2], [3, 4, -1]]))
    with pytest.raises(ValueError, match="listed twice"):
        cache.set_block_table(table([[0, 1, 2], [3, 4, 2]]))
    with pytest.raises(ValueError, match="block_table"):
        cache.set_block_table(table([[0, 1], [3, 4]]))
    assert_unchanged(cache, snap)
    with pytest.raises(ValueError, match="capacity"):
        cache.append(torch.randn(2, 1, 8), torch.randn(2, 1, 8))          # sequence 1 is full (2 pages)
    assert_unchanged(cache, snap)
    cache.set_block_table(table([[0, 1, 2], [3, 4, 5]]))
    assert cache.capacities() == [192, 192]
    cache.append(torch.randn(2, 1, 8), torch.randn(2, 1, 8))
    assert cache.lengths() == [101, 129]
    assert_compressed_equal_recompression(cache)


def test_constructor_errors():
    with pytest.raises(ValueError, match="max_len"):
        DecodeCache.contiguous(2, 0, 1, 8)
    with pytest.raises(TypeError, match="dtype"):
        DecodeCache.contiguous(2, 8, 1, 8, dtype=torch.int32)
    with pytest.raises(ValueError, match="contiguous"):
        DecodeCache.contiguous(1, 8, 1, 8).set_block_table(torch.zeros(1, 1, dtype=torch.int32))


# ------------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [None, 256], ids=["contiguous", "page256"])
def test_cache_on_the_gpu_matches_the_compression_kernel(page_size):
    cache = new_cache(3, 900, 2, 128, torch.bfloat16, page_size, device="cuda")
    fill(cache, [[513, 64, 0], [100, 0, 31]], steps=40)
    assert cache.seqlens.tolist() == cache.lengths() == [653, 104, 71]
    assert_compressed_equal_recompression(cache, exact=False, compress=compress_k)
    cpu = new_cache(3, 900, 2, 128, torch.bfloat16, page_size)
    fill(cpu, [[513, 64, 0], [100, 0, 31]], steps=40)
    for x, y in zip(cache.packed(), cpu.packed()):
        assert torch.equal(x.cpu(), y)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("page_size", [None, 64, 256], ids=["contiguous", "page64", "page256"])
def test_one_launch_append_kernel(page_size, dtype):
    """The one-token append kernel (cache_append.cu): keys, values and lengths equal the torch path's bit
    for bit; its windows equal the compression kernel's bit for bit (the same fp32 sum in position
    order), so a cache filled by one-token steps alone is exactly its recompression by `compress_k`;
    views that are not 16-byte aligned or not contiguous are accepted."""
    from infllm_cupy.decode.cache import append_one_tensors

    B, H, D, steps = 3, 2, 128 if dtype == torch.bfloat16 else 64, 300
    kern = new_cache(B, 400, H, D, dtype, page_size, device="cuda")
    ref = new_cache(B, 400, H, D, dtype, page_size, device="cuda")
    g = torch.Generator().manual_seed(7)
    for i in range(steps):
        k, v = (torch.randn(B, H, D, generator=g).to("cuda", dtype) for _ in range(2))
        if i == 5:                                  # an unaligned view (offset by one element)
            k = torch.cat([k.new_zeros(1), k.flatten()])[1:].view(B, H, D)
        if i == 7:                                  # a non-contiguous view
            v = v.transpose(0, 1).contiguous().transpose(0, 1)
        kern.append(k, v)
        append_one_tensors(k, v, ref.k, ref.v, ref.ck1, ref.ck2, ref.seqlens, ref.block_table)
    assert kern._append_program is not None, "the kernel path was not taken"
    assert kern.lengths() == [steps] * B and kern.seqlens.tolist() == [steps] * B
    for name in ("k", "v", "seqlens"):
        assert torch.equal(getattr(kern, name), getattr(ref, name)), name
    ref._host_lens = kern.lengths()
    assert_compressed_equal_recompression(kern, exact=True, compress=compress_k)
    assert_compressed_equal_recompression(ref, exact=False, compress=compress_k)


@pytest.mark.gpu
def test_append_kernel_under_capture_and_the_op():
    """Captured one-token appends replay at the device lengths (the host mirror lags until
    `sync_lengths`), and the custom op `infllm_cupy::cache_append` writes what `append` writes."""
    B, H, D, dtype = 2, 2, 64, torch.bfloat16
    a = new_cache(B, 300, H, D, dtype, 64, device="cuda")
    b = new_cache(B, 300, H, D, dtype, 64, device="cuda")
    fill(a, [[100, 37]], steps=0)
    fill(b, [[100, 37]], steps=0)
    k, v = (torch.randn(B, H, D, device="cuda", dtype=dtype) for _ in range(2))
    a.append(k, v)                                  # warm-up: the prepared launch exists before capture
    torch.ops.infllm_cupy.cache_append(k, v, b.k, b.v, b.ck1, b.ck2, b.seqlens, b.block_table)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        a.append(k, v)
    for _ in range(70):
        graph.replay()
        torch.ops.infllm_cupy.cache_append(k, v, b.k, b.v, b.ck1, b.ck2, b.seqlens, b.block_table)
    assert a.sync_lengths() == b.sync_lengths() == [100 + 71, 37 + 71]     # capture records, replays run
    for name in ("k", "v", "ck1", "ck2", "seqlens"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
