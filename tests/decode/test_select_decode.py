"""Stage 1 for decode split over CTAs (decode/select_decode.py, kernels_cu/decode/select_decode.cu): the
plan, the merge math (a PyTorch emulation of the split algorithm against the reference, CPU), the
kernels against the reference and the prefill stage-1 kernel, and the top-k launch alone on planted
block scores against the emulation (GPU)."""
import dataclasses
import functools
import importlib

import pytest
import torch

from infllm_cupy import _env
from infllm_cupy.config import InfLLMv2Config
from infllm_cupy.decode.select_decode import (
    SelectDecodePlan,
    check_select_plan,
    emulate_select_decode,
    emulate_topk_rows,
    plan_select_decode,
    score_keys,
    select_decode,
    select_topk_rows,
)
from infllm_cupy.decode.step import decode_select, layout_of
from infllm_cupy.stage1.naive import naive_stage1_select
from infllm_cupy.testing import random_decode_cache

# the module (the package exports a function)
sd = importlib.import_module("infllm_cupy.decode.select_decode")

# fp32 scores: no two blocks tie, so every implementation must pick the same blocks
CFG = InfLLMv2Config(topk=6, local_blocks=2, dense_len=0, score_dtype=torch.float32)


# the page draws these tests were written on
build_cache = functools.partial(random_decode_cache, spare_pages=1)


def reference(q, ck1, ck2, seqlens, width, cfg):
    """naive_stage1_select over the cache's own windows, padded with -1 to the static K, and its block
    scores `[H, B, n]`."""
    q, ck1, ck2, seqlens = (t.cpu() for t in (q, ck1, ck2, seqlens))
    cu_q, k1, cu1, k2, cu2, cache_lens = layout_of(ck1, ck2, seqlens, cfg.exact_stage1)
    idx, _, bs = naive_stage1_select(
        q, k1, k2, cu_q, cu1, cu2, 1, causal=False, cache_lens=cache_lens, softmax_scale=cfg.softmax_scale,
        topk=cfg.topk, local_blocks=cfg.local_blocks, init_blocks=cfg.init_blocks, block_size=cfg.block_size,
        score_dtype=cfg.score_dtype, return_scores=True)
    K = min(cfg.topk + cfg.local_blocks, -(-width // cfg.block_size))
    pad = K - idx.shape[2]
    return (torch.nn.functional.pad(idx, (0, pad), value=-1) if pad > 0 else idx), bs


def assert_same_blocks(got, ref, block_scores, tol):
    """Equal rows; where a row differs, as sets of the same size whose differing blocks' reference
    scores lie within `tol` (relative) of each other (a near-tie that one rounding decides)."""
    assert got.shape == ref.shape, (got.shape, ref.shape)
    for h in range(got.shape[0]):
        for b in range(got.shape[1]):
            x, y = got[h, b].tolist(), ref[h, b].tolist()
            if x == y:
                continue
            sx, sy = {i for i in x if i >= 0}, {i for i in y if i >= 0}
            assert len(sx) == len(sy) and sx != sy, f"row (h={h}, b={b}): {x} != {y}"
            sc = [float(block_scores[h, b, i]) for i in sorted(sx ^ sy)]
            assert max(sc) - min(sc) <= tol * max(abs(v)
                                                  for v in sc), f"row (h={h}, b={b}): {sorted(sx ^ sy)} {sc}"


# ------------------------------------------------------------------------------------------- CPU
def test_select_plan_splits_long_caches_over_the_gpu():
    # README head config at 128k: N1 = 8191 fine and N2 = 2047 coarse windows per row
    for B in (1, 8, 64):
        p = plan_select_decode(B, 2, 16, 8191, 2047, 132)
        assert p.row_tiles == 1
        assert 64 * p.fine_tiles * p.fine_ranges >= 8191 + 4 and 64 * p.coarse_tiles * p.coarse_ranges >= 2047
        fine_ctas = B * 2 * p.fine_ranges
        assert fine_ctas >= min(2 * 132, B * 2 * 129) * 0.9, (B, p)  # about two CTAs per SM, or one tile each
        assert p.fine_ranges == -(-129 // p.fine_tiles)                       # no empty trailing range
    assert plan_select_decode(1, 2, 16, 8191, 2047, 132).fine_tiles == 1
    assert plan_select_decode(8, 2, 16, 8191, 2047, 132) == plan_select_decode(8, 2, 16, 8191, 2047, 132)
    assert [plan_select_decode(1, 1, g, 10, 2, 1).row_tiles for g in (1, 16, 17, 32, 33, 64)] == [1, 1, 2, 2,
                                                                                                  4, 4]
    tiny = plan_select_decode(3, 1, 4, 0, 0, 132)
    assert tiny.fine_tiles == tiny.fine_ranges == tiny.coarse_tiles == tiny.coarse_ranges == 1
    huge = plan_select_decode(512, 8, 16, 1 << 20, 1 << 18, 132)
    assert huge.fine_tiles <= 64 and 64 * huge.fine_tiles * huge.fine_ranges >= (1 << 20) + 4


def test_select_plan_checks_name_the_problem():
    with pytest.raises(ValueError, match="group"):
        plan_select_decode(1, 1, 65, 10, 2, 132)
    with pytest.raises(ValueError, match="batch"):
        plan_select_decode(0, 1, 4, 10, 2, 132)
    with pytest.raises(ValueError, match="n1_max"):
        plan_select_decode(1, 1, 4, -1, 2, 132)
    with pytest.raises(ValueError, match="fine keys"):
        check_select_plan(SelectDecodePlan(1, 1, 2, 1, 1), 4, 125, 10, 128)          # 128 < 125 + 4
    with pytest.raises(ValueError, match="coarse keys"):
        check_select_plan(SelectDecodePlan(1, 1, 3, 1, 1), 4, 125, 65, 128)
    with pytest.raises(ValueError, match="G = 20"):
        check_select_plan(SelectDecodePlan(1, 1, 3, 1, 2), 20, 125, 65, 128)
    check_select_plan(SelectDecodePlan(2, 1, 3, 1, 2), 20, 125, 65, 128)
    with pytest.raises(ValueError, match="every count"):
        check_select_plan(SelectDecodePlan(2, 1, 3, 0, 2), 20, 125, 65, 128)


def test_select_plan_table_in_the_docs_lists_its_fields():
    # docs/decode.md's SelectDecodePlan table names every field of the plan, and no other (the fused
    # and one-warp top-k switches were removed: docs/decode.md, "Stage 1 for decode: the split kernels")
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "decode.md").read_text()
    # past the header
    table = doc[doc.index("| `SelectDecodePlan` field |"):].split("\n\n")[0].splitlines()[2:]
    named = {n for row in table for n in re.findall(r"`(\w+)`", row.split("|")[1])}
    assert table and named == {f.name for f in dataclasses.fields(SelectDecodePlan)}


@pytest.mark.parametrize("exact", [False, True], ids=["coarse", "exact"])
@pytest.mark.parametrize("tiles", [(1, 1), (2, 3)], ids=["tile_ranges", "wide_ranges"])
def test_split_merge_math_equals_the_reference(exact, tiles):
    # ranges of one or two tiles: many range boundaries inside each sequence (pooling across them,
    # coarse partials merged), lengths around every window and block edge, one empty-ish sequence
    lengths, H, HQ, D = [1, 63, 64, 65, 127, 128, 1000, 4097, 2500], 2, 6, 32
    cfg = dataclasses.replace(CFG, exact_stage1=exact)
    cache = build_cache(lengths, H, D, torch.float32)
    q = torch.randn(len(lengths), HQ, D, generator=torch.Generator().manual_seed(5))
    N1, N2 = cache.ck1.shape[1], cache.ck2.shape[1]
    n2 = N1 if exact else N2
    t1, t2 = tiles
    plan = SelectDecodePlan(1, t1, -(-(N1 + 4) // (64 * t1)), t2, max(1, -(-n2 // (64 * t2))))
    check_select_plan(plan, HQ // H, N1, n2, D)
    width = cache.capacity
    got = emulate_select_decode(q, cache.ck1, cache.ck2, cache.seqlens, -(-width // 64), plan, topk=cfg.topk,
                                local_blocks=cfg.local_blocks, init_blocks=cfg.init_blocks,
                                softmax_scale=cfg.softmax_scale, score_dtype=cfg.score_dtype, exact=exact)
    ref, bs = reference(q, cache.ck1, cache.ck2, cache.seqlens, width, cfg)
    assert_same_blocks(got, ref, bs, 1e-5)
    # the reference through decode_select is the same selection (sized on the longest sequence)
    dsel = decode_select(q, cache, config=cfg, backend="reference")
    assert torch.equal(ref[:, :, :dsel.shape[2]], dsel)


def plant(cache, q, b, keys):
    """Make fine windows `keys` of sequence b the best-scoring ones of every KV head (q's group mean, scaled):
    a window at a range boundary then decides two blocks, one of them through the neighbouring range."""
    H = cache.ck1.shape[2]
    qg = q[b].float().view(H, -1, q.shape[2]).mean(dim=1)
    for i in keys:
        cache.ck1[b, i] = (qg / qg.norm(dim=-1, keepdim=True) * 4).to(cache.ck1.dtype)


def test_split_merge_takes_the_boundary_key_from_the_next_range():
    # ranges of one tile: range r starts at fine key 64 r - 1, so keys 127 and 191 are the first keys of
    # ranges 2 and 3 and the last keys of blocks 31 and 47 (ranges 1 and 2)
    lengths, H, HQ, D = [4097, 3000], 2, 4, 32
    cfg = dataclasses.replace(CFG, topk=6, local_blocks=2)               # 4 blocks chosen by score
    cache = build_cache(lengths, H, D, torch.float32, seed=11)
    q = torch.randn(2, HQ, D, generator=torch.Generator().manual_seed(2))
    plant(cache, q, 0, (127, 191))
    plant(cache, q, 1, (63, 127))
    N1, N2 = cache.ck1.shape[1], cache.ck2.shape[1]
    plan = SelectDecodePlan(1, 1, -(-(N1 + 4) // 64), 1, -(-N2 // 64))
    got = emulate_select_decode(q, cache.ck1, cache.ck2, cache.seqlens, -(-cache.capacity // 64), plan,
                                topk=cfg.topk, local_blocks=cfg.local_blocks, init_blocks=cfg.init_blocks,
                                softmax_scale=None, score_dtype=cfg.score_dtype, exact=False)
    ref, _bs = reference(q, cache.ck1, cache.ck2, cache.seqlens, cache.capacity, cfg)
    for h in range(H):
        assert {31, 32, 47, 48} <= set(ref[h, 0].tolist()) and {15, 16, 31, 32} <= set(ref[h, 1].tolist())
    assert torch.equal(got, ref)


def test_split_merge_math_with_bf16_scores_and_one_range_per_block_row():
    # bf16 scores tie often; the emulation breaks ties to the lower block as the kernels do
    lengths, H, HQ, D = [3000, 700], 1, 16, 64
    cfg = InfLLMv2Config(topk=10, local_blocks=3, dense_len=0)
    cache = build_cache(lengths, H, D, torch.float32, seed=3)
    q = torch.randn(2, HQ, D, generator=torch.Generator().manual_seed(7))
    N1, N2 = cache.ck1.shape[1], cache.ck2.shape[1]
    plan = plan_select_decode(2, H, 16, N1, N2, 4)
    got = emulate_select_decode(q, cache.ck1, cache.ck2, cache.seqlens, -(-cache.capacity // 64), plan,
                                topk=cfg.topk, local_blocks=cfg.local_blocks, init_blocks=cfg.init_blocks,
                                softmax_scale=None, score_dtype=torch.bfloat16, exact=False)
    ref, bs = reference(q, cache.ck1, cache.ck2, cache.seqlens, cache.capacity, cfg)
    assert_same_blocks(got, ref, bs, 1e-2)


def test_select_decode_checks_name_the_argument():
    q = torch.zeros(2, 4, 64, dtype=torch.bfloat16)
    ck1 = torch.zeros(2, 10, 2, 64, dtype=torch.bfloat16)
    ck2 = torch.zeros(2, 3, 2, 64, dtype=torch.bfloat16)
    L = torch.tensor([100, 90], dtype=torch.int32)
    kw = dict(topk=4, local_blocks=2, init_blocks=1, softmax_scale=None, score_dtype=torch.bfloat16,
              exact=False)
    with pytest.raises((TypeError, ValueError), match="q"):
        select_decode(q.float(), ck1, ck2, L, 4, **kw)
    with pytest.raises(ValueError, match="ck1"):
        select_decode(q, ck1[:1], ck2, L, 4, **kw)
    with pytest.raises(ValueError, match="ck2"):
        select_decode(q, ck1, ck2[:, :, :1], L, 4, **kw)
    with pytest.raises((TypeError, ValueError), match="seqlens"):
        select_decode(q, ck1, ck2, L.long(), 4, **kw)
    with pytest.raises(ValueError, match="score_dtype"):
        select_decode(q, ck1, ck2, L, 4, **dict(kw, score_dtype=torch.float64))
    with pytest.raises(ValueError, match="CUDA"):
        select_decode(q, ck1, ck2, L, 4, **kw)


# the top-k step alone: row patterns (block scores as values of the score dtype, -0.0 included where
# a dtype underflows: the kernels order keys, -0.0 below +0.0)
TOPK_PATTERNS = ("normal", "few_values", "all_equal", "all_ninf", "low_bits", "wide")
ONE_BITS = {torch.float32: (0x3F800000, torch.int32), torch.bfloat16: (0x3F80, torch.int16),
            torch.float16: (0x3C00, torch.int16)}


def block_rows(pattern, shape, sdt, g):
    """float32 block scores of `shape` in `pattern`, each a value of `sdt`."""
    if pattern == "normal":                       # both signs
        x = torch.randn(shape, generator=g)
    elif pattern == "few_values":                 # many ties at and around the K-th
        x = torch.tensor([0.25, 0.5, 1.0, 2.0, float("-inf")])[torch.randint(0, 5, shape, generator=g)]
    elif pattern == "all_equal":
        x = torch.full(shape, 0.5)
    elif pattern == "all_ninf":
        x = torch.full(shape, float("-inf"))
    elif pattern == "low_bits":                   # keys that differ in the lowest digit only
        one, it = ONE_BITS[sdt]
        return (one + torch.randint(0, 6, shape, generator=g)).to(it).view(sdt).float()
    else:                                         # "wide": overflow to +-inf and underflow to +-0 in fp16
        e = torch.rand(shape, generator=g) * 160 - 80
        x = torch.sign(torch.randn(shape, generator=g)) * torch.exp2(e)
    return x.to(sdt).float()


@pytest.mark.parametrize("sdt", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_topk_emulation_takes_the_best_keys_ties_to_the_lower_block(sdt):
    # emulate_topk_rows (the GPU tests' reference) against a sort of (key, block) pairs in Python,
    # with the row completion checked on the blocks it touches
    g = torch.Generator().manual_seed(3)
    B, H, T1, out_len = 2, 2, 1, 150
    seqlens = torch.tensor([64 * out_len, 2000], dtype=torch.int32)
    for pattern in TOPK_PATTERNS:
        blk = block_rows(pattern, (B, H, 16 * T1 * 10), sdt, g)
        lead = block_rows(pattern, (B, H, 10), sdt, g)
        got = emulate_topk_rows(blk, lead, seqlens, out_len, fine_tiles=T1, topk=20, local_blocks=3,
                                init_blocks=1, score_dtype=sdt)
        for b in range(B):
            L = int(seqlens[b])
            n1 = (L - 32) // 16 + 1
            nbv, qb = n1 // 4 + 1, (L - 1) // 64
            for h in range(H):
                vals = []
                for j in range(out_len):
                    x = float(blk[b, h, j]) if j < nbv else float("-inf")
                    if j < nbv and j % 16 == 15 and 4 * (j + 1) - 1 < n1:   # range (j + 1) / 16's first key
                        x = max(x, float(lead[b, h, (j + 1) // 16]))
                    if j < 1 or qb - 3 <= j <= qb:
                        x = float("inf")
                    vals.append(x)
                keys = score_keys(torch.tensor(vals), sdt).tolist()
                best = sorted(sorted(range(out_len), key=lambda j: (-keys[j], j))[:23])
                assert got[h, b].tolist() == [j if j <= qb else -1 for j in best], (pattern, b, h)


def test_topk_scratch_size_matches_the_kernel():
    # the launcher sizes the top-k kernel's shared memory as the row plus the CTA top-k's scratch
    import re

    from infllm_cupy import _jit

    src = (_jit.kernels_dir() / sd.SOURCE).read_text()
    ints = int(re.search(r"#define SEL_TOPK_SCRATCH (\d+)", src).group(1))
    assert sd.TOPK_SCRATCH_BYTES == 4 * ints and ints >= 2 * 256 + 64 + 2
    assert sd._topk_row_smem(100, 1) == (128, 256 + 4 * ints)
    with pytest.raises(ValueError, match="shared memory"):
        sd._topk_row_smem(sd.SMEM_PER_BLOCK // 4, 0)

def test_cta_topk_source_on_host_threads(tmp_path):
    # the kernel's own top-k code (from the CTA top-k's first comment to the end of sel_topk_row, and
    # the sweep_words it calls), compiled for the host by tests/decode/topk_host_harness.cpp and run
    # on random rows (ties, all -inf, K = 1 .. out_len, 32 .. 512 threads, short search prefixes)
    # against a stable sort
    import re
    import shutil
    import subprocess
    from pathlib import Path

    from infllm_cupy import _jit

    cxx = shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no host C++ compiler")
    src = (_jit.kernels_dir() / sd.SOURCE).read_text()
    m = re.search(r"^// The K-th largest of the first n keys.*?(?=^template <typename KT>\n__global__)", src,
                  re.S | re.M)
    assert m and "void sel_topk_row" in m.group(0), "the CTA top-k's code moved in select_decode.cu"
    # its ballot sweep is select_row's (sweep_words in stage1/select_common.cuh)
    common = (_jit.kernels_dir() / "stage1" / "select_common.cuh").read_text()
    sw = re.search(r"^// The ascending sweep of a top-K.*?(?=^// The K largest keys)", common, re.S | re.M)
    assert sw and "void sweep_words" in sw.group(0), "sweep_words moved in stage1/select_common.cuh"
    (tmp_path / "sel_topk_extract.cu").write_text(sw.group(0) + m.group(0))
    exe = tmp_path / "harness"
    harness = Path(__file__).with_name("topk_host_harness.cpp")
    build = subprocess.run([cxx, "-std=c++20", "-O1", "-pthread", f"-I{tmp_path}", str(harness), "-o",
                            str(exe)],
                           capture_output=True, text=True, timeout=300)
    if build.returncode and "barrier" in build.stderr and "No such file" in build.stderr:
        pytest.skip("the host C++ library has no <barrier> (C++20)")
    assert build.returncode == 0, build.stderr[-3000:]
    run = subprocess.run([str(exe), "3", "40"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and "40 cases, 0 mismatches" in run.stdout, \
        run.stdout[-3000:] + run.stderr[-2000:]

def test_select_topk_rows_checks_name_the_argument():
    blk, lead = torch.zeros(2, 1, 32), torch.zeros(2, 1, 2)
    L = torch.tensor([100, 90], dtype=torch.int32)
    kw = dict(fine_tiles=1, topk=4, local_blocks=2, init_blocks=1, score_dtype=torch.bfloat16)
    with pytest.raises((TypeError, ValueError), match="blk"):
        select_topk_rows(blk.double(), lead, L, 20, **kw)
    with pytest.raises(ValueError, match="lead"):
        select_topk_rows(blk, lead[:, :, :1], L, 20, **kw)
    with pytest.raises(ValueError, match="fine_tiles"):
        select_topk_rows(blk, lead, L, 20, **dict(kw, fine_tiles=3))
    with pytest.raises(ValueError, match="out_len"):
        select_topk_rows(blk, lead, L, 33, **kw)
    with pytest.raises(ValueError, match="threads"):
        select_topk_rows(blk, lead, L, 20, threads=100, **kw)
    with pytest.raises(ValueError, match="topk_prefix"):
        select_topk_rows(blk, lead, L, 20, topk_prefix=-1, **kw)
    with pytest.raises(ValueError, match="CUDA"):
        select_topk_rows(blk, lead, L, 20, **kw)


# ------------------------------------------------------------------------------------------- GPU
# (lengths, HQ, H, D, dtype, page_size, exact)
GPU_CASES = [
    ([1, 63, 64, 65, 127, 128, 1000, 4097], 16, 2, 128, torch.bfloat16, None, False),
    ([1, 63, 64, 65, 127, 128, 1000, 4097], 16, 2, 128, torch.bfloat16, None, True),
    ([65, 4097, 300], 2, 2, 64, torch.float16, 64, False),
    ([1000, 129, 4000], 1, 1, 128, torch.float16, 256, False),
    ([2049, 17, 5000], 32, 1, 64, torch.bfloat16, None, False),
    ([3001, 800], 24, 2, 128, torch.float16, 128, True),
    ([130000, 5000], 16, 2, 128, torch.bfloat16, None, False),
    ([130001], 8, 1, 64, torch.bfloat16, 256, False),
    ([3000, 200, 20000], 48, 1, 64, torch.float16, None, False),     # G = 48: four row tiles, 512 threads
]
GPU_IDS = [f"L{'-'.join(map(str, c[0][:4]))}_HQ{c[1]}_H{c[2]}_D{c[3]}_{str(c[4])[6:]}_"
           f"{'pg' + str(c[5]) if c[5] else 'contig'}{'_exact' if c[6] else ''}" for c in GPU_CASES]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=GPU_IDS)
def test_split_select_kernel_matches_reference_and_prefill_kernel(case):
    lengths, HQ, H, D, dtype, page_size, exact = case
    cache = build_cache(lengths, H, D, dtype, page_size=page_size, device="cuda", seed=len(lengths))
    q = torch.randn(len(lengths), HQ, D, generator=torch.Generator().manual_seed(1)).to("cuda", dtype)
    for cfg, tol in ((dataclasses.replace(CFG, exact_stage1=exact), 1e-4),
                     (InfLLMv2Config(dense_len=0, exact_stage1=exact), 1e-2)):    # MiniCPM4's: K = 96, bf16
        got = decode_select(q, cache, config=cfg)
        ref, bs = reference(q, cache.ck1, cache.ck2, cache.seqlens, cache.capacity, cfg)
        assert_same_blocks(got.cpu(), ref, bs, tol)
        if cfg.score_dtype == torch.float32 and HQ // H <= 32:
            # the prefill stage-1 kernel (one CTA per sequence and head): the same rows, bit for bit
            assert torch.equal(got, decode_select(q, cache, config=cfg, stage1="prefill", kernel="sm80"))
        N1 = cache.ck1.shape[1]
        n2 = N1 if exact else cache.ck2.shape[1]
        mt = next(t for t in (1, 2, 4) if HQ // H <= 16 * t)
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        default = plan_select_decode(len(lengths), H, HQ // H, N1, n2, sms)
        # the default plan passed explicitly, and (several sequences) a plan with many short ranges: the
        # same blocks
        plans = [default]
        if len(lengths) > 1:
            plans.append(SelectDecodePlan(mt, 1, -(-(N1 + 4) // 64), 1, max(1, -(-n2 // 64))))
        for plan in plans:
            other = select_decode(q, cache.ck1, cache.ck2, cache.seqlens, -(-cache.capacity // 64),
                                  topk=cfg.topk, local_blocks=cfg.local_blocks, init_blocks=cfg.init_blocks,
                                  softmax_scale=cfg.softmax_scale, score_dtype=cfg.score_dtype, exact=exact,
                                  plan=plan)
            if plan.fine_tiles == plans[0].fine_tiles and plan.coarse_tiles == plans[0].coarse_tiles:
                assert torch.equal(other, got), plan          # the same scores: the same rows, bit for bit
            assert_same_blocks(other.cpu(), ref, bs, tol)


@pytest.mark.gpu
def test_split_select_replays_in_a_cuda_graph():
    lengths, HQ, H, D, dtype = [4000, 70, 1500], 16, 2, 128, torch.bfloat16
    cfg = InfLLMv2Config(dense_len=0)
    eager = build_cache(lengths, H, D, dtype, device="cuda")
    graphed = build_cache(lengths, H, D, dtype, device="cuda")
    q = torch.randn(3, HQ, D, device="cuda", dtype=dtype)
    kn, vn = (torch.randn(3, H, D, device="cuda", dtype=dtype) for _ in range(2))
    with _env.override(validate=False):
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):                            # compile and warm up outside the capture
            decode_select(q, build_cache(lengths, H, D, dtype, device="cuda"), config=cfg)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            graphed.append(kn, vn)
            got = decode_select(q, graphed, config=cfg)
    for _ in range(3):                                        # three steps: lengths grow on the device
        graph.replay()
        eager.append(kn, vn)
        ref = decode_select(q, eager, config=cfg)
        torch.cuda.synchronize()
        assert torch.equal(got, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("short_ranges", [False, True], ids=["default_plan", "one_tile_ranges"])
def test_split_select_kernel_boundary_keys(short_ranges):
    lengths, HQ, H, D, dtype = [20000, 9000], 16, 2, 128, torch.bfloat16
    cfg = dataclasses.replace(CFG, topk=8, local_blocks=2)                # 6 blocks chosen by score
    cache = build_cache(lengths, H, D, dtype, device="cuda", seed=4)
    q = torch.randn(2, HQ, D, generator=torch.Generator().manual_seed(9)).to("cuda", dtype)
    N1, N2 = cache.ck1.shape[1], cache.ck2.shape[1]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    plan = SelectDecodePlan(1, 1, -(-(N1 + 4) // 64), 1, -(-N2 // 64)) if short_ranges else \
        plan_select_decode(2, H, HQ // H, N1, N2, sms)
    t = 64 * plan.fine_tiles
    plant(cache, q, 0, (t - 1, 2 * t - 1, 3 * t - 1))                  # first keys of ranges 1, 2, 3
    plant(cache, q, 1, (t - 1, 2 * t - 1, 3 * t - 1))
    got = select_decode(q, cache.ck1, cache.ck2, cache.seqlens, -(-cache.capacity // 64), topk=cfg.topk,
                        local_blocks=cfg.local_blocks, init_blocks=cfg.init_blocks, softmax_scale=None,
                        score_dtype=cfg.score_dtype, exact=False, plan=plan)
    ref, _bs = reference(q, cache.ck1, cache.ck2, cache.seqlens, cache.capacity, cfg)
    edge = {t // 4 * r + d for r in (1, 2, 3) for d in (-1, 0)}        # the blocks on both sides of each edge
    assert all(edge <= set(ref[h, b].tolist()) for h in range(H) for b in range(2))
    assert torch.equal(got.cpu(), ref)


# (out_len, fine_tiles, lengths, topk, local_blocks, init_blocks): rows of the top-k kernel alone
TOPK_ROW_CASES = [
    (2048, 1, [131072, 131000, 1], 64, 32, 1),        # the README decode at 128k: K = 96 of 2048
    (1500, 2, [96000, 70001, 33], 1, 0, 0),           # K = 1; olp = 1536, not a power of two
    (100, 1, [6400, 3000, 64], 100, 0, 0),            # K = out_len: every block, -1 past the query's own
    (333, 4, [21312, 20000, 200], 40, 3, 2),
    (1, 1, [64, 1, 20], 5, 2, 1),                     # K capped at one block
    (4097, 1, [262208, 100000, 4000], 200, 8, 1),     # more than 4096 keys
]


@pytest.mark.gpu
@pytest.mark.parametrize("pattern", TOPK_PATTERNS)
@pytest.mark.parametrize("sdt", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_cta_topk_equals_the_emulation(sdt, pattern):
    # the top-k kernel on planted block scores, on 128, 256 and 512 threads (select_decode's), equal to
    # the emulation bit for bit; topk_prefix = 64 makes the search prefix short, so that keys after it
    # beat its K-th and the whole row is searched again
    g = torch.Generator().manual_seed(len(pattern))
    for out_len, T1, lengths, topk, local_blocks, init_blocks in TOPK_ROW_CASES:
        B, H = len(lengths), 2
        R1 = -(-(out_len + 1) // (16 * T1))
        blk = block_rows(pattern, (B, H, 16 * T1 * R1), sdt, g).cuda()
        lead = block_rows(pattern, (B, H, R1), sdt, g).cuda()
        seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
        kw = dict(fine_tiles=T1, topk=topk, local_blocks=local_blocks, init_blocks=init_blocks,
                  score_dtype=sdt)
        want = emulate_topk_rows(blk, lead, seqlens, out_len, **kw)
        for threads in (128, 256, 512):
            for prefix in (0, 64):
                got = select_topk_rows(blk, lead, seqlens, out_len, topk_prefix=prefix, threads=threads, **kw)
                assert torch.equal(got.cpu(), want), (out_len, lengths, threads, prefix)


def test_bench_select_topk_script_starts():
    """The top-k benchmark starts: without a GPU it says so; with one, it rejects a bad --inner."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_select_topk.py"
    r = subprocess.run([sys.executable, str(script), "--inner", "0"], capture_output=True, text=True,
                       timeout=120)
    if not torch.cuda.is_available():
        assert r.returncode == 0 and "needs a CUDA GPU" in r.stdout, r.stderr
    else:
        assert r.returncode == 2 and "--inner" in r.stderr, r.stderr
