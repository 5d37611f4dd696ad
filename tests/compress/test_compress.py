"""Key compression: the reference against a loop, the CPU implementation against the reference (bit for
bit), and the kernel against the reference."""
import pytest
import torch

import infllm_cupy.compress.cpu as compress_cpu
from infllm_cupy._rules import n_windows
from infllm_cupy.compress import compress_k, compressed_cu_seqlens, naive_compress_k
from infllm_cupy.compress.cpu import cpu_compress_k
from infllm_cupy.testing import assert_close_to_ref

WINDOWS = [(32, 16), (128, 64)]
# ragged lengths: below one window, exactly one window, not multiples of 16/64, one token, empty
LENGTHS = [[300], [31, 32, 33, 1, 0, 257], [127, 128, 129, 1000], [4097, 5, 64]]


def make_cu(lengths, device="cpu"):
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths).cumsum(0)
    return cu.to(device)


def loop_compress(k, lengths, kernel, stride):
    rows, start = [], 0
    for L in lengths:
        for i in range(n_windows(L, kernel, stride)):
            rows.append(k[start + i * stride: start + i * stride + kernel].double().mean(0))
        start += L
    return torch.stack(rows) if rows else k.new_zeros((0,) + k.shape[1:]).double()


def test_compress_n_windows_matches_definition():
    for L in range(0, 400):
        for kernel, stride in WINDOWS:
            want = sum(1 for s in range(0, L, stride) if s + kernel <= L)
            assert n_windows(L, kernel, stride) == want, (L, kernel, stride)


@pytest.mark.parametrize("lengths", LENGTHS, ids=lambda x: "L" + "-".join(map(str, x)))
@pytest.mark.parametrize("window", WINDOWS, ids=lambda w: f"{w[0]}s{w[1]}")
def test_compress_reference_against_loop(lengths, window):
    kernel, stride = window
    k = torch.randn(sum(lengths), 2, 64, dtype=torch.float64)
    ck, cu_c = naive_compress_k(k, make_cu(lengths), kernel, stride)
    want = loop_compress(k, lengths, kernel, stride)
    assert torch.allclose(ck, want, atol=1e-12)
    assert cu_c.tolist() == [0] + torch.tensor([n_windows(L, kernel,
                                                         stride) for L in lengths]).cumsum(0).tolist()
    assert cu_c.dtype == torch.int32


def test_compress_cu_seqlens():
    cu = make_cu([31, 32, 48, 0, 1000])
    assert compressed_cu_seqlens(cu, 32, 16).tolist() == [0, 0, 1, 3, 3, 3 + 61]


@pytest.mark.parametrize("bad, match", [
    (dict(k=torch.randn(10, 2, 64).to(torch.int32)), "k must have dtype"),
    (dict(k=torch.randn(10, 128)), "k must have 3 dimensions"),
    (dict(cu=torch.tensor([0, 10], dtype=torch.int64)), "cu_seqlens_k must have dtype int32"),
    (dict(cu=torch.tensor([0, 6, 4, 10], dtype=torch.int32)), "cu_seqlens_k must be non-decreasing"),
    (dict(cu=torch.tensor([1, 10], dtype=torch.int32)), "cu_seqlens_k must start at 0"),
    (dict(cu=torch.tensor([0, 9], dtype=torch.int32)), "cu_seqlens_k must end at the total token count 10"),
    (dict(kernel=0), "kernel_size must be >= 1, got 0"),
    (dict(kernel=1), r"kernel_size \(1\) must be >= kernel_stride \(2\)"),
])
def test_compress_rejects_bad_inputs_naming_the_argument(bad, match):
    k = bad.get("k", torch.randn(10, 2, 64))
    cu = bad.get("cu", torch.tensor([0, 10], dtype=torch.int32))
    for backend in ("auto", "reference"):          # the CPU implementation and the oracle
        with pytest.raises((ValueError, TypeError), match=match):
            compress_k(k, cu, bad.get("kernel", 4), 2, backend=backend)


# ------------------------------------------------------------------------------- CPU implementation

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64],
                         ids=["bf16", "fp16", "fp32", "fp64"])
@pytest.mark.parametrize("H,D", [(1, 64), (2, 128), (8, 32), (3, 80)])
@pytest.mark.parametrize("window", WINDOWS + [(5, 3), (4, 4)], ids=lambda w: f"{w[0]}s{w[1]}")
@pytest.mark.parametrize("lengths", LENGTHS, ids=lambda x: "L" + "-".join(map(str, x)))
def test_compress_cpu_equals_reference_bit_for_bit(lengths, window, H, D, dtype):
    kernel, stride = window
    k = (4 * torch.randn(sum(lengths), H, D)).to(dtype)
    ck, cu_c = cpu_compress_k(k, make_cu(lengths), kernel, stride)
    ref, ref_cu = naive_compress_k(k, make_cu(lengths), kernel, stride)
    assert torch.equal(cu_c, ref_cu) and ck.dtype == dtype
    assert torch.equal(ck, ref)


def test_compress_cpu_in_chunks_and_on_views(monkeypatch):
    # a chunk of a few windows: chunk boundaries inside every sequence; a non-contiguous k
    lengths = [1000, 129, 31, 500]
    k = torch.randn(sum(lengths), 2, 64, dtype=torch.bfloat16)
    want = [naive_compress_k(k, make_cu(lengths), *w) for w in WINDOWS]
    monkeypatch.setattr(compress_cpu, "CHUNK_ELEMS", 3 * 128 * 2 * 64)
    for w, (ref, ref_cu) in zip(WINDOWS, want):
        ck, cu_c = cpu_compress_k(k, make_cu(lengths), *w)
        assert torch.equal(ck, ref) and torch.equal(cu_c, ref_cu)
    wide = torch.randn(sum(lengths), 4, 64, dtype=torch.bfloat16)
    view = wide[:, ::2]
    assert torch.equal(cpu_compress_k(view, make_cu(lengths))[0], naive_compress_k(view, make_cu(lengths))[0])


def test_compress_k_backend_rule_on_cpu(monkeypatch):
    # "auto" on CPU tensors: the CPU implementation; "reference": the oracle
    calls = []
    monkeypatch.setattr("infllm_cupy.compress.mean_pool.cpu_compress_k",
                        lambda *a: calls.append("cpu") or cpu_compress_k(*a))
    monkeypatch.setattr("infllm_cupy.compress.mean_pool.naive_compress_k",
                        lambda *a: calls.append("naive") or naive_compress_k(*a))
    k, cu = torch.randn(300, 2, 64), make_cu([300])
    a = compress_k(k, cu)
    b = compress_k(k, cu, backend="reference")
    assert calls == ["cpu", "naive"] and torch.equal(a[0], b[0])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("window", WINDOWS, ids=lambda w: f"{w[0]}s{w[1]}")
@pytest.mark.parametrize("lengths", LENGTHS, ids=lambda x: "L" + "-".join(map(str, x)))
def test_compress_kernel_against_reference(lengths, window, D, dtype):
    kernel, stride = window
    k = torch.randn(sum(lengths), 2, D, device="cuda", dtype=dtype)
    cu = make_cu(lengths, "cuda")
    ck, cu_c = compress_k(k, cu, kernel, stride, backend="kernels")
    ref, ref_cu = naive_compress_k(k.double(), cu, kernel, stride)         # float64 oracle
    lowp, _ = naive_compress_k(k, cu, kernel, stride)                        # torch's own mean in dtype
    assert torch.equal(cu_c, ref_cu)
    assert ck.dtype == dtype and ck.shape == ref.shape
    if ck.numel():
        assert_close_to_ref("ck", ck, ref, lowp, mult=2)


@pytest.mark.gpu
def test_compress_kernel_runs_on_torch_current_stream():
    # k is produced on a side stream and consumed there: if the kernel ran on another stream it
    # could read k before randn wrote it.
    lengths = [1 << 16] * 8
    cu = make_cu(lengths, "cuda")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        for _ in range(3):
            k = torch.randn(sum(lengths), 2, 128, device="cuda", dtype=torch.bfloat16)
            ck, _ = compress_k(k, cu, 32, 16, backend="kernels")
            ref, _ = naive_compress_k(k, cu, 32, 16)
            diff = (ck.float() - ref.float()).abs().max()
    side.synchronize()
    assert diff.item() <= 2 ** -6 * ref.float().abs().max().item()


@pytest.mark.gpu
def test_compress_kernel_rejects_bad_head_dim():
    k = torch.randn(64, 2, 96, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="head dim 96"):
        compress_k(k, make_cu([64], "cuda"), backend="kernels")


@pytest.mark.gpu
def test_compress_kernel_rejects_a_misaligned_view():
    # rows are read in 4- or 8-byte vectors: a view at an odd element offset is refused, not read
    k = torch.randn(64, 2, 128, device="cuda", dtype=torch.bfloat16)
    odd = torch.empty(k.numel() + 1, dtype=k.dtype, device="cuda")[1:].view(k.shape).copy_(k)
    with pytest.raises(ValueError, match="k must start at a 16-byte aligned address"):
        compress_k(odd, make_cu([64], "cuda"), backend="kernels")
    out, _ = compress_k(odd.clone(), make_cu([64], "cuda"), backend="kernels")
    assert torch.equal(out, compress_k(k, make_cu([64], "cuda"), backend="kernels")[0])
