"""The merge of stage 1's key-range passes (docs/stage1.md, 9. Long context: key ranges; its paragraph
"The merge kernel"): the torch merge against a brute-force sort (CPU), the kernel `merge_range_candidates`
against the torch merge bit for bit (GPU: random, tie-heavy, padding and empty rows, extreme keys
and block indices, K from 1 to 1024, 16- and 32-bit score keys), and whole range-pass selections
through the kernel merge against the torch merge and the one launch (GPU)."""
from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from infllm_cupy.stage1 import select as sel

from test_stage1_split import default_plan, gpu_inputs  # (same folder, pytest rootdir-relative import)

IDX_BITS = 31


def score_keys(x: torch.Tensor, key_bits: int) -> torch.Tensor:
    """The kernels' order-preserving keys of scores `x` (select_common.cuh, `Score<KT>::key`): bf16
    bits for 16-bit keys, fp32 bits for 32-bit ones; int32 storage of the unsigned key."""
    if key_bits == 16:
        b = x.to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF
        return torch.where(b & 0x8000 != 0, ~b & 0xFFFF, b | 0x8000).to(torch.int32)
    b = x.float().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    k = torch.where(b & 0x80000000 != 0, ~b & 0xFFFFFFFF, b | 0x80000000)
    return (k - (k >= 2**31).to(torch.int64) * 2**32).to(torch.int32)


PATTERNS = ("random", "ties", "padding", "extremes")


def range_passes(H, T, K, passes, *, key_bits, pattern, seed, device="cpu", spare=7):
    """`passes` lists of candidates `(cand_key, cand_idx)` int32 `[H, T, K]` as range passes write
    them: pass p's blocks are K distinct blocks of the range [p W, (p + 1) W), W = K + spare.
    Patterns: "random" keys over the whole key range; "ties": three score levels (0, 0.5, +inf, so
    many equal block keys); "padding": real rows, the forced +inf blocks, visible scores, invisible
    -inf blocks and padding keys 0 past each row's own end (whole rows of padding or -inf among
    them); "extremes": keys 0 and the maximum, blocks up to 2^31 - 1."""
    g = torch.Generator().manual_seed(seed)
    W = K + spare
    base = 2**31 - passes * W if pattern == "extremes" else 0
    kmax = 2**key_bits - 1
    rows_end = torch.randint(0, passes * W + 1, (H, T, 1), generator=g)     # "padding": a row's own end
    rows_vis = (rows_end * torch.rand(H, T, 1, generator=g)).long()
    out = []
    for p in range(passes):
        blocks = torch.rand(H, T, W, generator=g).argsort(-1)[..., :K] + p * W
        if pattern == "random":
            keys = torch.randint(0, kmax + 1, (H, T, K), generator=g)
        elif pattern == "ties":
            levels = torch.tensor([0.0, 0.5, float("inf")])
            keys = score_keys(levels[torch.randint(0, 3, (H, T, K), generator=g)],
                              key_bits).to(torch.int64) & kmax
        elif pattern == "padding":
            vals = torch.rand(H, T, K, generator=g).div(64).round(decimals=3)     # some ties
            vals = torch.where(blocks < rows_vis, vals, torch.tensor(float("-inf")))
            vals = torch.where(torch.rand(H, T, K, generator=g) < 0.05, torch.tensor(float("inf")), vals)
            keys = score_keys(vals, key_bits).to(torch.int64) & kmax
            keys = torch.where(blocks >= rows_end, 0, keys)
        else:
            keys = torch.randint(0, 2, (H, T, K), generator=g) * kmax
        keys = keys - (keys >= 2**31).to(torch.int64) * 2**32                  # int32 storage of uint32
        out.append((keys.to(torch.int32).to(device), (blocks + base).to(torch.int32).to(device)))
    return out


def brute_merge(run_keys: torch.Tensor | None, cand_key, cand_idx, K):
    """The top-K merge keys of the union by a full descending sort (the definition)."""
    new = (((cand_key.to(torch.int64) & 0xFFFFFFFF) << IDX_BITS)
           | ((1 << IDX_BITS) - 1 - cand_idx.to(torch.int64)))
    both = new if run_keys is None else torch.cat([run_keys, new], dim=-1)
    return both.sort(dim=-1, descending=True).values[..., :K]


# ---- CPU: the torch merge (the kernel's reference) and the dispatch past the kernel's K bound


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("key_bits", [16, 32])
@pytest.mark.parametrize("K", [1, 7, 40])
def test_torch_merge_equals_a_full_sort(pattern, key_bits, K):
    want, run = None, None
    for ck, ci in range_passes(2, 19, K, 3, key_bits=key_bits, pattern=pattern, seed=K + key_bits):
        want = brute_merge(want, ck, ci, K)
        run = sel._merge_into_torch(run, ck, ci, K)
        assert torch.equal(run.sort(-1, descending=True).values, want)


def test_merge_ties_to_the_lower_block_and_keys_as_unsigned():
    """Equal block keys keep the lower blocks; a 32-bit key >= 2^31 (negative in int32 storage)
    ranks above the smaller ones."""
    ck = torch.tensor([[[5, 5, 5], [-1, 3, 2**31 - 1]]], dtype=torch.int32)
    ci = torch.tensor([[[9, 2, 4], [0, 1, 2]]], dtype=torch.int32)
    run = sel._merge_into_torch(None, ck, ci, 3)
    ck2 = torch.tensor([[[5, 4, 6], [-2, 0, 0]]], dtype=torch.int32)
    ci2 = torch.tensor([[[3, 10, 11], [5, 6, 7]]], dtype=torch.int32)
    run = sel._merge_into_torch(run, ck2, ci2, 3).sort(-1, descending=True).values
    blocks = ((1 << IDX_BITS) - 1 - (run & ((1 << IDX_BITS) - 1))).tolist()
    assert blocks == [[[11, 2, 3], [0, 5, 2]]]


def test_merge_past_the_kernel_bound_runs_the_torch_merge_on_cpu():
    """K > MERGE_KERNEL_UP_TO_K dispatches to the torch merge (which runs on CPU tensors too)."""
    K = sel.MERGE_KERNEL_UP_TO_K + 1
    want, run = None, None
    for ck, ci in range_passes(1, 3, K, 2, key_bits=16, pattern="ties", seed=5):
        want = brute_merge(want, ck, ci, K)
        run = sel._merge_into(run, ck, ci, K)
    assert torch.equal(run.sort(-1, descending=True).values, want)


@pytest.mark.parametrize("chunk", [1 << 22, 7 * 5, 1], ids=["one-chunk", "ragged-chunks", "row-chunks"])
def test_run_to_topk_in_chunks_equals_the_whole_conversion(chunk, monkeypatch):
    """The range passes' final conversion (`_run_to_topk`): sorted blocks, future blocks -> -1, the
    same in token chunks of any size (including one token and a ragged last chunk) as in one go."""
    H, T, K = 2, 23, 5
    passes = range_passes(H, T, K, 3, key_bits=16, pattern="random", seed=4)
    run = None
    for cand_key, cand_idx in passes:
        run = sel._merge_into_torch(run, cand_key, cand_idx, K)
    q_blocks = torch.randint(0, 3 * (K + 7), (T,), generator=torch.Generator().manual_seed(9))
    low = (1 << IDX_BITS) - 1
    whole = (low - (run & low)).to(torch.int32).sort(dim=-1).values
    want = whole.masked_fill(whole > q_blocks.to(torch.int32)[None, :, None], -1)
    assert bool((want == -1).any()) and bool((want >= 0).any())      # both cases present
    monkeypatch.setattr(sel, "_FINAL_ELEMS", chunk)
    got = sel._run_to_topk(run, q_blocks)
    assert got.dtype == torch.int32 and torch.equal(got, want)


def test_merge_kernel_rejects_bad_arguments():
    ck = torch.zeros(2, 3, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="K must be in"):
        sel._merge_into_kernel(None, ck, ck, 0)
    with pytest.raises(ValueError, match="K must be in"):
        sel._merge_into_kernel(None, ck, ck, sel.MERGE_MAX_K + 1)
    with pytest.raises(ValueError, match="cand_key and cand_idx must both have shape"):
        sel._merge_into_kernel(None, ck, ck[:, :2], 4)
    with pytest.raises(ValueError, match="cand_key and cand_idx must both have shape"):
        sel._merge_into_kernel(None, ck, ck, 5)
    with pytest.raises(TypeError, match="must be int32"):
        sel._merge_into_kernel(None, ck, ck.long(), 4)
    with pytest.raises(ValueError, match="run must be a contiguous int64"):
        sel._merge_into_kernel(ck.long()[:, :2], ck, ck, 4)
    with pytest.raises(ValueError, match="run must be a contiguous int64"):
        sel._merge_into_kernel(ck, ck, ck, 4)


def test_merge_instances_cover_every_k_up_to_the_bound():
    assert sel.MERGE_MAX_K == 32 * max(sel.MERGE_ITEMS) >= 1024
    assert list(sel.MERGE_ITEMS) == sorted(set(sel.MERGE_ITEMS)) and sel.MERGE_ITEMS[0] == 1
    text = (Path(__file__).resolve().parents[2] / "kernels_cu" / "stage1" / "merge_cand.cu").read_text()
    assert f"#define MERGE_WARPS {sel.MERGE_WARPS}\n" in text


def test_bench_stage1_merge_script_starts():
    """The merge micro-benchmark starts: a malformed case is an argument error; without a GPU it says so."""
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_stage1_merge.py"
    r = subprocess.run([sys.executable, str(script), "--cases", "1k:0"], capture_output=True, text=True,
                       timeout=120, check=False)
    if not torch.cuda.is_available():
        assert r.returncode == 0 and "needs a CUDA GPU" in r.stdout, r.stdout + r.stderr
    else:
        assert r.returncode == 2 and "the merge kernel's bound" in r.stderr, r.stderr
    bad = subprocess.run([sys.executable, str(script), "--cases", "1k"], capture_output=True, text=True,
                         timeout=120,
                       check=False)
    assert bad.returncode == 2 and "--cases must be" in bad.stderr, bad.stderr


# ---- GPU: the kernel against the torch merge, bit for bit


@pytest.mark.gpu
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("key_bits", [16, 32], ids=["bf16_keys", "fp32_keys"])
@pytest.mark.parametrize("K", [1, 2, 31, 32, 33, 64, 96, 97, 130, 200, 256, 300, 513, 1000, 1024])
def test_merge_kernel_equals_torch_merge(pattern, key_bits, K):
    T = max(5, 24000 // (K * 2)) + 1          # H x T rows: not a multiple of the CTA's 4 rows
    passes = 4 if K <= 256 else 2
    run_k = run_t = None
    for p, (ck, ci) in enumerate(range_passes(2, T, K, passes, key_bits=key_bits, pattern=pattern,
                                              seed=1000 * K + key_bits + len(pattern), device="cuda")):
        run_k = sel._merge_into_kernel(run_k, ck, ci, K)
        run_t = sel._merge_into_torch(run_t, ck, ci, K)
        want = run_t.sort(-1, descending=True).values
        n_bad = int((run_k != want).any(-1).sum())
        assert n_bad == 0, f"pass {p}: {n_bad} of {2 * T} rows differ from the torch merge"
    # the final step's block order and -1 tail follow from the same keys
    assert torch.equal(run_k, run_t.sort(-1, descending=True).values)


@pytest.mark.gpu
def test_merge_kernel_dispatch_and_in_place():
    """`_merge_into` takes the kernel up to MERGE_KERNEL_UP_TO_K, merging in place into the running list."""
    K = 96
    (ck0, ci0), (ck1, ci1) = range_passes(3, 1001, K, 2, key_bits=16, pattern="padding", seed=3,
                                          device="cuda")
    run = sel._merge_into(None, ck0, ci0, K)
    assert torch.equal(run, brute_merge(None, ck0.cpu(), ci0.cpu(), K).cuda())     # sorted, first pass
    again = sel._merge_into(run, ck1, ci1, K)
    assert again.data_ptr() == run.data_ptr()
    want = brute_merge(brute_merge(None, ck0.cpu(), ci0.cpu(), K), ck1.cpu(), ci1.cpu(), K)
    assert torch.equal(again.cpu(), want)


# ---- GPU: whole range-pass selections through the kernel merge

KERNELS = ["auto", "sm80"]


def _selections(inputs, L, range_blocks, kernel, monkeypatch, **kw):
    """(one launch, ranges with the kernel merge, ranges with the torch merge, kernel merges run)."""
    one = sel.stage1_select(*inputs, L, backend="kernels", kernel=kernel, **kw)
    plan = dataclasses.replace(default_plan(inputs, L, kernel, kw.get("score_dtype", torch.bfloat16)),
                               range_blocks=range_blocks, block_keys_in_smem=True)
    calls = []
    real = sel._merge_into_kernel

    def counting(*a):
        calls.append(a[-1])
        return real(*a)

    with monkeypatch.context() as m:
        m.setattr(sel, "_merge_into_kernel", counting)
        got = sel.launch_select(*inputs, L, plan=plan, **kw)
    with monkeypatch.context() as m:
        m.setattr(sel, "MERGE_KERNEL_UP_TO_K", 0)        # every merge on torch
        ref = sel.launch_select(*inputs, L, plan=plan, **kw)
    return one, got, ref, len(calls)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("score_dtype", [torch.bfloat16, None], ids=["bf16", "fp32"])
@pytest.mark.parametrize("topk,local_blocks,range_blocks", [(8, 4, 64), (64, 32, 128), (200, 40, 256)])
def test_range_selection_with_the_merge_kernel_equals_one_launch(score_dtype, topk, local_blocks,
                                                                 range_blocks,
                                                                  kernel, monkeypatch):
    lengths = [40000, 1023, 383, 1, 64]
    inputs = gpu_inputs(lengths, 32, 2, 64, seed=21)
    L = max(lengths)
    one, got, ref, n = _selections(inputs, L, range_blocks, kernel, monkeypatch, topk=topk,
                                   local_blocks=local_blocks, score_dtype=score_dtype)
    out_len = -(-L // 64)
    assert n == -(-out_len // range_blocks), n       # one merge per range pass
    assert not bool((got == -(2**30)).any())
    assert torch.equal(got, ref), "the kernel merge's selection differs from the torch merge's"
    assert torch.equal(got, one), "the range passes differ from the one launch"


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", KERNELS)
def test_range_selection_tie_heavy_with_the_merge_kernel(kernel, monkeypatch):
    inputs = gpu_inputs([12000, 900], 16, 2, 64, seed=22, ties=True)
    one, got, ref, n = _selections(inputs, 12000, 64, kernel, monkeypatch, topk=16, local_blocks=4)
    assert n == 3 and torch.equal(got, ref) and torch.equal(got, one)
