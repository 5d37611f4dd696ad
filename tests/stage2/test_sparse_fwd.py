"""Stage-2 forward: the kernels against the PyTorch reference (FlashAttention's error rule), and the
forward plan (`fwd_plan`, CPU).

Variants the plan never picks by itself (SM80 tile shapes, key-range passes) run at the launcher
level (`ops.token_fwd` / `ops.layout_fwd` with a plan), and forced sm_90a step shapes there through
the launcher's `_force_steps` hook; "sm90a" goes through the public op with `kernel="sm90a"`.
"""
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from infllm_cupy import _env, _jit
from infllm_cupy.stage2 import naive as s2
from infllm_cupy.stage2 import ops, sparse_fwd
from infllm_cupy.stage2.attention import block_sparse_attn_varlen, sparse_attn_varlen
from infllm_cupy.stage2.layout import BlockLayout
from infllm_cupy.stage2.naive import naive_dense_attn_varlen, naive_sparse_attn_varlen
from infllm_cupy.stage2.plan import FwdPlan, FwdTiles, fwd_plan, kv_passes_for
from infllm_cupy.testing import assert_close_to_ref, cu_seqlens_from_lengths, random_topk_idx

from conftest import HOPPER, STAGE2_CASES, STAGE2_IDS

CASES, IDS = STAGE2_CASES, STAGE2_IDS


def make_inputs(lengths_q, lengths_k, HQ, H, D, dtype, K=12, seed=0, **sel):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lengths_q), HQ, D, generator=g).to("cuda", dtype)
    k = torch.randn(sum(lengths_k), H, D, generator=g).to("cuda", dtype)
    v = torch.randn(sum(lengths_k), H, D, generator=g).to("cuda", dtype)
    idx = random_topk_idx(H, lengths_q, lengths_k, K, generator=g, **sel).cuda()
    return (q, k, v, cu_seqlens_from_lengths(lengths_q, "cuda"), cu_seqlens_from_lengths(lengths_k, "cuda"),
            idx)


def check_against_reference(out, lse, q, k, v, cu_q, cu_k, idx, mq, mk, causal):
    ref, ref_lse = naive_sparse_attn_varlen(q.double(), k.double(), v.double(), cu_q, cu_k, idx, mq, mk,
                                            causal=causal, return_lse=True)
    lowp = naive_sparse_attn_varlen(q, k, v, cu_q, cu_k, idx, mq, mk, causal=causal, upcast=False)
    assert_close_to_ref("out", out, ref, lowp, mult=2)
    empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), empty), "lse must be +inf exactly on rows with no allowed key"
    assert bool((lse[empty] > 0).all())
    assert not torch.isnan(lse).any()
    # the LSE of the fp32 softmax: a few fp32 ulps of its magnitude
    err = (lse[~empty].double() - ref_lse[~empty]).abs().max().item() if (~empty).any() else 0.0
    assert err <= 1e-4 * max(1.0, ref_lse[~empty].abs().max().item()), f"lse error {err}"
    assert bool((out[empty.T] == 0).all()), "rows with no allowed key must be exactly 0"


NEEDS_HOPPER = pytest.mark.skipif(not HOPPER, reason="sm_90a kernel needs capability 9.0")
# the sm_90a kernel with its per-CTA step choice, and with each step shape forced in every CTA
SM90_VARIANTS = [pytest.param(t, marks=NEEDS_HOPPER) for t in ("sm90a_pair", "sm90a_single", "sm90a_split",
                                                               "sm90a")]
TILES = [FwdTiles(8, 1, 64), FwdTiles(4, 1, 64), FwdTiles(4, 1, 32), FwdTiles(4, 2, 32), FwdTiles(8, 2, 64),
         *SM90_VARIANTS]


def tiles_id(t):
    return t if isinstance(t, str) else f"w{t.warps}m{t.m_tiles}k{t.sub_keys}"


# the step shape each sm_90a variant forces in every CTA (`stage2_fwd`'s `_force_steps`); "sm90a": none,
# each CTA chooses, as every plan runs
SM90_STEP = {"sm90a": None, "sm90a_pair": "pair", "sm90a_single": "single", "sm90a_split": "split"}


def plan_of(variant, q, k, max_seqlen_k, default_split_min, **fields):
    """The forward plan of a test variant: a FwdTiles (the SM80 kernel with that shape) or an sm_90a
    variant (the sm_90a plan), built with the op's `default_split_min` and then `fields` replaced (a
    forced `split_min` among them). The step shape a variant forces is `forced_steps(variant)`."""
    if isinstance(variant, FwdTiles):
        plan = FwdPlan("sm80", variant)
    else:
        plan = ops.fwd_plan_for(q, k, max_seqlen_k, default_split_min, kernel="sm90a")
    return dataclasses.replace(plan, **fields)


def forced_steps(variant):
    """The launchers' `_force_steps` of a test variant (None: the kernel's per-CTA choice)."""
    return None if isinstance(variant, FwdTiles) else SM90_STEP[variant]


def run_fwd(q, k, v, cu_q, cu_k, idx, mq, mk, variant, causal=True, **fields):
    """(out, lse) of the token-level forward under `variant`: "sm90a" without `fields` through the
    public op (`kernel="sm90a"`), everything else through `ops.token_fwd` with its plan."""
    if variant == "sm90a" and not fields:
        return sparse_attn_varlen(q, k, v, cu_q, cu_k, idx, mq, mk, causal=causal, return_lse=True,
                                  backend="kernels", kernel="sm90a")
    plan = plan_of(variant, q, k, mk, 2 * idx.shape[2], **fields)
    return ops.token_fwd(q, k, v, cu_q, cu_k, idx, mq, mk, causal, q.shape[-1] ** -0.5, plan,
                         _force_steps=forced_steps(variant))


@pytest.mark.gpu
@pytest.mark.parametrize("tiles", TILES, ids=tiles_id)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_token_level_against_reference(case, dtype, tiles):
    lq, lk, HQ, H, D = case
    q, k, v, cu_q, cu_k, idx = make_inputs(lq, lk, HQ, H, D, dtype, empty_rows=True)
    out, lse = run_fwd(q, k, v, cu_q, cu_k, idx, max(lq), max(lk), tiles)
    check_against_reference(out, lse, q, k, v, cu_q, cu_k, idx, max(lq), max(lk), True)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="sm_90a kernel needs capability 9.0")
@pytest.mark.parametrize("split_min", ["0", "default"])
@pytest.mark.parametrize("passes", [2, 3, 7])
@pytest.mark.parametrize("tiles", ["sm90a", "sm90a_pair", "sm90a_split"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_key_range_passes_against_reference(case, dtype, tiles, passes, split_min):
    """The sm_90a forward in key-range passes (the long-context path, forced here on short
    sequences), with every CTA split over the passes ("0": each later pass merges into the rows by
    lse) or only those whose union exceeds 2 K blocks (the default). One pass must differ from it
    by rounding only; with every CTA split and more than one block, the outputs differ."""
    lq, lk, HQ, H, D = case
    q, k, v, cu_q, cu_k, idx = make_inputs(lq, lk, HQ, H, D, dtype, empty_rows=True)
    forced = {} if split_min == "default" else {"split_min": int(split_min)}
    out, lse = run_fwd(q, k, v, cu_q, cu_k, idx, max(lq), max(lk), tiles, kv_passes=passes, **forced)
    check_against_reference(out, lse, q, k, v, cu_q, cu_k, idx, max(lq), max(lk), True)
    one, _ = run_fwd(q, k, v, cu_q, cu_k, idx, max(lq), max(lk), tiles, kv_passes=1, **forced)
    if split_min == "0" and max(lk) > 128:      # the passes ran and merged: they round differently
        assert not torch.equal(out, one)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="sm_90a kernel needs capability 9.0")
@pytest.mark.parametrize("validate", ["1", "0"])
@pytest.mark.parametrize("split_min", ["0", "default"])
@pytest.mark.parametrize("selection", ["a", "b", "c"])
def test_key_range_passes_one_cu_seqlens(selection, split_min, validate):
    """One cu_seqlens tensor for queries and keys: later passes leave out the leading CTAs (their
    tokens precede the pass's keys). Benchmark selections, G = 16 and G = 1 rows per token; with
    host reads allowed, later passes are skipped where no CTA split (selection a, default)."""
    from infllm_cupy.selections import make_selection

    forced = {"kv_passes": 3} if split_min == "default" else {"kv_passes": 3, "split_min": int(split_min)}
    for HQ in (32, 2):
        T, H, D, K = 2001, 2, 128, 20
        g = torch.Generator().manual_seed(7)
        q = torch.randn(2 * T, HQ, D, generator=g).to("cuda", torch.bfloat16)
        k, v = (torch.randn(2 * T, H, D, generator=g).to("cuda", torch.bfloat16) for _ in range(2))
        cu = cu_seqlens_from_lengths([T + 300, T - 300], "cuda")   # ragged; the selection's rows are
        # drawn for two sequences of T, so some picks fall out of range (ignored, as the reference does)
        idx = make_selection(selection, 2, T, H, K, seed=3).cuda()
        plan = dataclasses.replace(ops.fwd_plan_for(q, k, T + 300, 2 * K), **forced)
        with _env.override(validate=validate == "1"):
            out, lse = ops.token_fwd(q, k, v, cu, cu, idx, T + 300, T + 300, True, D ** -0.5, plan)
        check_against_reference(out, lse, q, k, v, cu, cu, idx, T + 300, T + 300, True)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="sm_90a kernel needs capability 9.0")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_key_range_passes_non_causal(dtype):
    lq, lk = [1, 5, 90], [300, 64, 1000]
    q, k, v, cu_q, cu_k, idx = make_inputs(lq, lk, 16, 2, 128, dtype)
    out, lse = run_fwd(q, k, v, cu_q, cu_k, idx, max(lq), max(lk), "sm90a", causal=False, kv_passes=3,
                       split_min=0)
    check_against_reference(out, lse, q, k, v, cu_q, cu_k, idx, max(lq), max(lk), False)


def test_kv_passes_policy():
    """One pass while a sequence's K/V per KV head fit 32 MB, then one per 32 MB, at most 8."""
    assert [kv_passes_for(n, 128, 2) for n in (1, 16384, 32768, 65536, 131072, 10**7)] == [1, 1, 1, 1, 2, 8]
    assert kv_passes_for(32768, 64, 2) == 1


def test_fwd_plan():
    """The forward plan of each device and shape: sm_90a on capability 9.0 (passes for the token-level
    op at long contexts, the deepest ring that fits the mask rows), SM80 elsewhere or without keys."""
    bf16 = torch.bfloat16
    assert fwd_plan((9, 0), 128, bf16, 32768, 65536, split_min=128) == FwdPlan(
        "sm90a", stages=6, kv_passes=1, split_min=128)
    assert fwd_plan((9, 0), 128, bf16, 131072, 262144, split_min=128).kv_passes == 2
    assert fwd_plan((9, 0), 128, bf16, 131072, 262144).kv_passes == 1          # layouts: one pass
    assert fwd_plan((9, 0), 128, bf16, 1 << 20, 1 << 20, split_min=128).stages == 4   # long mask rows
    assert fwd_plan((9, 0), 64, torch.float16, 1 << 20, 1 << 20).stages == 6
    for cap, kernel in (((8, 0), "auto"), ((8, 9), "sm80"), ((9, 0), "sm80"), ((10, 0), "auto")):
        assert fwd_plan(cap, 128, bf16, 4096, 4096, split_min=128, kernel=kernel) == FwdPlan("sm80",
                                                                                             FwdTiles(4, 2,
                                                                                                      64))
    assert fwd_plan((9, 0), 128, bf16, 0, 0, kernel="sm90a").kernel == "sm80"   # no keys: no tensor map
    with pytest.raises(ValueError, match=r"kernel='sm90a' needs a device of compute capability 9\.0"):
        fwd_plan((8, 0), 128, bf16, 4096, 4096, kernel="sm90a")
    for bad in ("sm90", "SM80", "", None, "sm90a_pair"):
        with pytest.raises(ValueError, match="kernel must be one of"):
            fwd_plan((9, 0), 128, bf16, 4096, 4096, kernel=bad)


def test_parameter_structs_are_checked_in_their_compiles():
    """The forward kernels' parameter structs and the constants the launcher shares with them are
    static_asserts of the sources NVRTC compiles (tests/test_jit.py compiles them on the CPU)."""
    for params in (sparse_fwd.FWD_PARAMS, sparse_fwd.SM90_PARAMS, sparse_fwd.MASK_PARAMS):
        assert params.checks() in _jit._code(params.source)
    assert "static_assert((NC) == 2" in _jit._code(sparse_fwd.SM90_SOURCE)
    assert "static_assert((WARPS) == 8" in _jit._code(sparse_fwd.MASK_SOURCE)
    assert sparse_fwd.SM90_PARAMS.offsets["tmap_k"] % 64 == 0    # the TmaMap alignment


@pytest.mark.nvrtc
def test_the_ab_build_without_the_ping_pong_compiles():
    """FWD_PINGPONG = 0 (tools/ab_nvrtc_options.py's "nopingpong" set) is an A/B build the package
    never compiles: one instance of it here keeps it compiling, with no spills."""
    name = "stage2_fwd_sm90<__nv_bfloat16, 128, 6>"
    code = "#define FWD_PINGPONG 0\n" + _jit._code(sparse_fwd.SM90_SOURCE)
    (k,) = _jit.compile_report(sparse_fwd.SM90_SOURCE, [name], "sm_90a", code=code).kernels
    assert k.name == name and k.spill_stores == 0 and k.spill_loads == 0, str(k)


def test_fwd_plan_fields_are_checked():
    with pytest.raises(ValueError, match="FwdTiles needs"):
        FwdTiles(3, 1, 64)
    for bad in (dict(kernel="sm70"), dict(kernel="sm90a", stages=5),
                dict(kernel="sm90a", kv_passes=0), dict(kernel="sm80", kv_passes=2),
                dict(kernel="sm90a", split_min=-1)):
        with pytest.raises(ValueError, match="FwdPlan"):
            FwdPlan(**bad)
    with pytest.raises(TypeError, match=r"FwdPlan\.tiles"):
        FwdPlan("sm80", (4, 2, 64))


def test_forced_step_shapes_are_a_launcher_hook_not_a_plan_field():
    """The sm_90a step shape is each CTA's choice (STEPS_AUTO, what every plan runs); a test or A/B
    run forces one through `_force_steps`, on the sm_90a kernel only."""
    assert "step" not in {f.name for f in dataclasses.fields(FwdPlan)}
    sm90a, sm80 = FwdPlan("sm90a"), FwdPlan("sm80")
    assert sparse_fwd._step_mode(sm90a, None) == sparse_fwd._step_mode(sm80, None) == sparse_fwd.STEPS_AUTO
    assert {name: sparse_fwd._step_mode(sm90a, name) for name in ("single", "pair", "split")} == \
        sparse_fwd.FORCED_STEPS
    for plan, bad in ((sm90a, "auto"), (sm90a, "triple"), (sm80, "pair")):
        with pytest.raises(ValueError, match="_force_steps forces one of"):
            sparse_fwd._step_mode(plan, bad)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_non_causal_forward(dtype):
    lq, lk = [1, 5, 90], [300, 64, 1000]          # decode-like rows against long caches
    q, k, v, cu_q, cu_k, idx = make_inputs(lq, lk, 16, 2, 128, dtype)
    out, lse = sparse_attn_varlen(q, k, v, cu_q, cu_k, idx, max(lq), max(lk), causal=False, return_lse=True,
                                  backend="kernels")
    check_against_reference(out, lse, q, k, v, cu_q, cu_k, idx, max(lq), max(lk), False)


@pytest.mark.gpu
def test_every_block_selected_equals_dense_sdpa():
    T, HQ, H, D = 777, 32, 2, 128
    q, k, v, cu_q, cu_k, _ = make_inputs([T], [T], HQ, H, D, torch.bfloat16)
    idx = torch.arange(-(-T // 64), dtype=torch.int32, device="cuda").expand(H, T, -1).contiguous()
    out = sparse_attn_varlen(q, k, v, cu_q, cu_k, idx, T, T, backend="kernels")
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], is_causal=True,
        enable_gqa=True)[0].transpose(0, 1)
    ref = naive_sparse_attn_varlen(q.double(), k.double(), v.double(), cu_q, cu_k, idx, T, T)
    assert_close_to_ref("out", out, ref, sdpa, mult=2)


@pytest.mark.gpu
def test_junk_indices_equal_the_clean_selection():
    lq = [300, 129]
    q, k, v, cu_q, cu_k, _ = make_inputs(lq, lq, 16, 1, 64, torch.bfloat16)
    clean = random_topk_idx(1, lq, lq, 5, junk=False).cuda()
    nb = 5
    junk = torch.cat([clean, clean.flip(-1), torch.full_like(clean, -1), clean + 1000, -clean - 2,
                      torch.full_like(clean, nb + 7)], dim=-1)
    a = sparse_attn_varlen(q, k, v, cu_q, cu_k, clean, 300, 300, backend="kernels")
    b = sparse_attn_varlen(q, k, v, cu_q, cu_k, junk, 300, 300, backend="kernels")
    assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="sm_90a kernel needs capability 9.0")
@pytest.mark.parametrize("selection", ["a", "b", "c"])
@pytest.mark.parametrize("HQ", [32, 2], ids=["G16", "G1"])
@pytest.mark.parametrize("stages", [6, 4], ids=["ring6", "ring4"])
def test_step_shapes_on_benchmark_selections(selection, HQ, stages):
    """The benchmark's block-shared (a), per-token (b) and InfLLM-like (c) selections through both
    step shapes of the sm_90a kernel and its automatic choice, with each K/V ring depth. At G = 16
    a CTA's tokens share one query block, so under (a) every CTA qualifies for 128-key steps (and
    the full ones for the warpgroups' ping-pong) and the automatic choice must equal them bit for
    bit. T * G is not a multiple of the CTA's 128 rows: the last CTA has a warpgroup without rows."""
    from infllm_cupy.selections import make_selection

    T, H, D, K = 2001, 2, 128, 20
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2 * T, HQ, D, generator=g).to("cuda", torch.bfloat16)
    k, v = (torch.randn(2 * T, H, D, generator=g).to("cuda", torch.bfloat16) for _ in range(2))
    cu = cu_seqlens_from_lengths([T, T], "cuda")
    idx = make_selection(selection, 2, T, H, K, seed=3).cuda()
    outs = {}
    for tiles in ("sm90a_pair", "sm90a_single", "sm90a_split", "sm90a"):
        out, lse = run_fwd(q, k, v, cu, cu, idx, T, T, tiles, stages=stages)
        check_against_reference(out, lse, q, k, v, cu, cu, idx, T, T, True)
        outs[tiles] = out
    assert not torch.equal(outs["sm90a_pair"], outs["sm90a_single"])   # the two shapes round differently
    if HQ == 32 and selection == "a":
        assert torch.equal(outs["sm90a"], outs["sm90a_pair"])


@pytest.mark.gpu
@pytest.mark.parametrize("tiles", [FwdTiles(4, 1, 64), *SM90_VARIANTS], ids=tiles_id)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_scores_whose_maximum_jumps_between_blocks(dtype, tiles):
    """Key blocks scaled by 1, 4, 7, 10, 13 in turn: a row's running maximum grows by a little in
    some blocks and by far more than 2^8 in P in others, so the sm_90a kernel's reference maximum
    (moved only past that slack) is exercised both ways, rows of one warp disagreeing."""
    lq = [1500, 333]
    q, k, v, cu_q, cu_k, idx = make_inputs(lq, lq, 16, 2, 128, dtype, K=24, seed=11)
    block = torch.cat([torch.arange(n, device="cuda") // 64 for n in lq])
    k = (k.float() * (1 + 3 * (block % 5)).view(-1, 1, 1)).to(dtype)
    out, lse = run_fwd(q, k, v, cu_q, cu_k, idx, 1500, 1500, tiles)
    check_against_reference(out, lse, q, k, v, cu_q, cu_k, idx, 1500, 1500, True)


@pytest.mark.gpu
@pytest.mark.parametrize("tiles", [FwdTiles(8, 1, 64), FwdTiles(4, 2, 32), *SM90_VARIANTS], ids=tiles_id)
@pytest.mark.parametrize("q_block", [64, 128])
@pytest.mark.parametrize("per_sequence", [False, True])
def test_block_layout_equals_token_level(q_block, per_sequence, tiles):
    lq = [1000, 300, 1]
    HQ, H, D = 16, 2, 128
    q, k, v, cu_q, cu_k, _ = make_inputs(lq, lq, HQ, H, D, torch.bfloat16)
    nqb, nkb = -(-1000 // q_block), -(-1000 // 64)
    shape = (len(lq), H, nqb, nkb) if per_sequence else (H, nqb, nkb)
    mask = torch.rand(shape) < 0.3
    mask[..., 0] = True
    layout = BlockLayout(mask, q_block)
    if tiles == "sm90a":
        out, lse = block_sparse_attn_varlen(q, k, v, cu_q, cu_k, layout, 1000, 1000, return_lse=True,
                                            backend="kernels", kernel="sm90a")
    else:
        out, lse = ops.layout_fwd(q, k, v, cu_q, cu_k, layout.mask.cuda(), q_block, 1000, 1000, True,
                                  D ** -0.5, plan_of(tiles, q, k, 1000, None),
                                  _force_steps=forced_steps(tiles))
    idx = layout.to_topk_idx(cu_q.cpu()).cuda()
    check_against_reference(out, lse, q, k, v, cu_q, cu_k, idx, 1000, 1000, True)
    tok, _ = run_fwd(q, k, v, cu_q, cu_k, idx, 1000, 1000, tiles)
    assert torch.equal(out, tok)


@pytest.mark.gpu
@pytest.mark.parametrize("tiles", [FwdTiles(4, 1, 64), *SM90_VARIANTS], ids=tiles_id)
def test_non_finite_keys_of_the_next_sequence_stay_out(tiles):
    """A sequence whose last key block is partial: the copies of that block may bring the next
    sequence's rows into masked positions. Non-finite values there must not reach its output."""
    lq = lk = [100, 77, 64]
    q, k, v, cu_q, cu_k, idx = make_inputs(lq, lk, 16, 2, 128, torch.bfloat16, K=8)
    k[100:164], v[100:164] = float("nan"), float("inf")   # all of sequence 1's first block
    out, lse = run_fwd(q, k, v, cu_q, cu_k, idx, 100, 100, tiles)
    first, last = slice(0, 100), slice(177, 241)
    for rows in (first, last):
        n = rows.stop - rows.start
        cu1 = cu_seqlens_from_lengths([n], "cuda")
        q1, k1, v1 = (t[rows].contiguous() for t in (q, k, v))
        check_against_reference(out[rows], lse[:, rows].contiguous(), q1, k1, v1, cu1, cu1,
                                idx[:, rows].contiguous(), n, n, True)


@pytest.mark.gpu
def test_large_offsets_past_2_to_31():
    """q has more than 2^31 elements: rows at the end must still be right (64-bit offsets)."""
    T, HQ, H, D, K = 600_000, 32, 1, 128, 8
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(T, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
    assert q.numel() > 2**31
    k = torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    cu = cu_seqlens_from_lengths([T], "cuda")
    pos = torch.arange(T, device="cuda")
    idx = (torch.rand(H, T, K, device="cuda", generator=g) * (pos[None, :, None] // 64 + 1)).long()
    idx[..., 0] = pos // 64                                              # the diagonal block
    idx = idx.to(torch.int32)
    out, lse = sparse_attn_varlen(q, k, v, cu, cu, idx, T, T, return_lse=True, backend="kernels")
    rows = torch.cat([torch.tensor([0, 1, 63, 64], device="cuda"), torch.randint(0, T, (24,), device="cuda"),
                      torch.arange(T - 8, T, device="cuda")])
    for t in rows.tolist():
        blocks = torch.unique(idx[0, t].long())
        keys = (blocks[:, None] * 64 + torch.arange(64, device="cuda")).flatten()
        keys = keys[keys <= t]
        s = (q[t].double() @ k[keys, 0].double().T) * D ** -0.5                 # [HQ, n]
        want = torch.softmax(s, -1) @ v[keys, 0].double()
        assert (out[t].double() - want).abs().max().item() < 2e-2, t
        assert (lse[:, t].double() - torch.logsumexp(s, -1)).abs().max().item() < 1e-3, t


@pytest.mark.gpu
@pytest.mark.parametrize("bad, match", [
    (dict(q=lambda q: q.float(), k=lambda k: k.float(), v=lambda v: v.float()), "q must have dtype"),
    (dict(q=lambda q: q[..., :32].contiguous(), k=lambda k: k[..., :32].contiguous(),
          v=lambda v: v[..., :32].contiguous()), "head dim 32"),
    (dict(k=lambda k: k[:, :1].repeat(1, 3, 1)), "multiple of the key/value head count"),
    (dict(idx=lambda i: i.long()), "topk_idx must have dtype int32"),
    (dict(idx=lambda i: i[:, :-1]), "topk_idx must have shape"),
    (dict(idx=lambda i: i.cpu()), "topk_idx must be on cuda"),
    (dict(mq=lambda m: m - 1), "max_seqlen_q must be >="),
    (dict(mk=lambda m: m - 1), "max_seqlen_k must be >="),
    (dict(cu_q=lambda c: c.flip(0)), "cu_seqlens_q must"),
    (dict(v=lambda v: torch.empty(v.numel() + 1, dtype=v.dtype, device=v.device)[1:].view(v.shape).copy_(v)),
     "v must start at a 16-byte aligned address"),
])
def test_sparse_attn_bad_inputs_raise_before_launch(bad, match):
    q, k, v, cu_q, cu_k, idx = make_inputs([100, 50], [100, 50], 16, 2, 128, torch.bfloat16)
    args = dict(q=q, k=k, v=v, idx=idx, mq=100, mk=100, cu_q=cu_q)
    for name, f in bad.items():
        args[name] = f(args[name])
    with pytest.raises((ValueError, TypeError), match=match):
        sparse_attn_varlen(args["q"], args["k"], args["v"], args["cu_q"], cu_k, args["idx"], args["mq"],
                           args["mk"], backend="kernels")


# ------------------------------------------------------------------------------------------------
# The reference (naive_sparse_attn_varlen, naive_dense_attn_varlen) against dense attention, SDPA
# and explicit masks, on CPU: the oracle the kernel tests above compare with.

HEADS = [(2, 2), (4, 2), (16, 1)]
LENGTHS = [1, 97, 200, 64, 130]          # a 1-token sequence, lengths that are not multiples of 64


def make_cu(lengths):
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    return cu


def make_qkv(lq, lk, HQ, H, D=32, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lq), HQ, D, generator=g).to(dtype)
    k = torch.randn(sum(lk), H, D, generator=g).to(dtype)
    v = torch.randn(sum(lk), H, D, generator=g).to(dtype)
    return q, k, v


def all_blocks(H, T, n_blocks):
    return torch.arange(n_blocks, dtype=torch.int32).expand(H, T, n_blocks).contiguous()


def random_selection(lq, lk, H, K, bs, seed=0):
    """Random causal-valid block indices (<= the query's block), sorted, -1 tail padded."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for Lq, Lk in zip(lq, lk):
        for r in range(Lq):
            qb = (r + Lk - Lq) // bs
            for _ in range(H):
                pick = sorted(torch.randperm(max(qb + 1, 1), generator=g)[:K].tolist()) if qb >= 0 else []
                rows.append(pick + [-1] * (K - len(pick)))
    T = sum(lq)
    return torch.tensor(rows, dtype=torch.int32).view(T, H, K).permute(1, 0, 2).contiguous()


def mask_reference(q, k, v, lq, lk, topk_idx, bs, causal=True):
    """Explicit per-token masked softmax in fp64; returns out and lse (+inf on empty rows)."""
    HQ, H, D = q.shape[1], k.shape[1], q.shape[2]
    G = HQ // H
    out = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.full((HQ, q.shape[0]), float("inf"), dtype=torch.float64)
    qs = ks = 0
    for Lq, Lk in zip(lq, lk):
        nb = -(-Lk // bs)
        kk, vv = k[ks:ks + Lk].double(), v[ks:ks + Lk].double()
        for r in range(Lq):
            allowed = torch.zeros(H, Lk, dtype=torch.bool)
            for h in range(H):
                for b in topk_idx[h, qs + r].tolist():
                    if 0 <= b < nb:
                        allowed[h, b * bs:(b + 1) * bs] = True
            if causal:
                allowed[:, max(0, r + Lk - Lq + 1):] = False
            allowed = allowed.repeat_interleave(G, 0)                      # [HQ, Lk]
            s = torch.einsum("hd,jhd->hj", q[qs + r].double(), kk.repeat_interleave(G, 1)) * D ** -0.5
            s = s.masked_fill(~allowed, float("-inf"))
            rows = allowed.any(-1)
            lse[rows, qs + r] = torch.logsumexp(s[rows], -1)
            out[qs + r, rows] = torch.einsum("hj,jhd->hd", torch.softmax(s[rows], -1),
                                             vv.repeat_interleave(G, 1)[:, rows])
        qs, ks = qs + Lq, ks + Lk
    return out, lse


def sdpa_varlen(q, k, v, lq, lk, causal=True):
    outs, qs, ks = [], 0, 0
    for Lq, Lk in zip(lq, lk):
        qq, kk, vv = (x.transpose(0, 1) for x in (q[qs:qs + Lq], k[ks:ks + Lk], v[ks:ks + Lk]))
        mask = None
        if causal:
            mask = torch.arange(Lk)[None, :] <= torch.arange(Lq)[:, None] + Lk - Lq
        outs.append(F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, enable_gqa=True).transpose(0,
                                                                                                          1))
        qs, ks = qs + Lq, ks + Lk
    return torch.cat(outs)


@pytest.mark.parametrize("HQ,H", HEADS, ids=lambda x: str(x))
def test_all_blocks_equals_dense_and_sdpa(HQ, H):
    q, k, v = make_qkv(LENGTHS, LENGTHS, HQ, H)
    cu, T = make_cu(LENGTHS), sum(LENGTHS)
    idx = all_blocks(H, T, 4)
    out, lse = naive_sparse_attn_varlen(q, k, v, cu, cu, idx, 200, 200, return_lse=True)
    dense, dense_lse = naive_dense_attn_varlen(q, k, v, cu, cu, return_lse=True)
    torch.testing.assert_close(out, dense, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse, dense_lse, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out, sdpa_varlen(q, k, v, LENGTHS, LENGTHS), atol=2e-6, rtol=2e-5)
    torch.testing.assert_close(naive_dense_attn_varlen(q, k, v, cu, cu, causal=False),
                               sdpa_varlen(q, k, v, LENGTHS, LENGTHS, causal=False), atol=2e-6, rtol=2e-5)


def test_bf16_output_and_low_precision_twin():
    q, k, v = make_qkv(LENGTHS, LENGTHS, 4, 2, dtype=torch.bfloat16)
    cu = make_cu(LENGTHS)
    idx = random_selection(LENGTHS, LENGTHS, 2, 3, 64)
    ref = naive_sparse_attn_varlen(q.double(), k.double(), v.double(), cu, cu, idx, 200, 200)
    out = naive_sparse_attn_varlen(q, k, v, cu, cu, idx, 200, 200)
    lowp = naive_sparse_attn_varlen(q, k, v, cu, cu, idx, 200, 200, upcast=False)
    assert out.dtype == lowp.dtype == torch.bfloat16
    err, err_lowp = (out.double() - ref).abs().max().item(), (lowp.double() - ref).abs().max().item()
    # upcast output only carries the final bf16 rounding; the twin also rounds q.k and p
    assert 0 < err <= 2 ** -8 * ref.abs().max().item()
    assert err < err_lowp < 0.05


@pytest.mark.parametrize("HQ,H", HEADS, ids=lambda x: str(x))
def test_random_selection_matches_explicit_mask(HQ, H):
    lq = lk = LENGTHS
    q, k, v = make_qkv(lq, lk, HQ, H)
    cu = make_cu(lq)
    idx = random_selection(lq, lk, H, 2, 64)
    out, lse = naive_sparse_attn_varlen(q, k, v, cu, cu, idx, 200, 200, return_lse=True)
    want, want_lse = mask_reference(q, k, v, lq, lk, idx, 64)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)
    assert lse.dtype == torch.float32 and lse.shape == (HQ, sum(lq))


def test_junk_indices_are_ignored():
    lq = lk = [300, 130, 1]
    q, k, v = make_qkv(lq, lk, 4, 2)
    cu, T = make_cu(lq), sum(lq)
    clean = random_selection(lq, lk, 2, 3, 64)
    nb = torch.tensor([5] * 300 + [3] * 130 + [1])                      # blocks of each token's sequence
    qb = torch.cat([torch.arange(L) // 64 for L in lq])                 # each token's own block
    junk = torch.stack([
        torch.full((T,), -1), torch.full((T,), -7), torch.full((T,), -2 ** 31),   # negative
        nb, nb + 3, torch.full((T,), 10 ** 6),                                     # >= own block count
        qb + 1,                                                                    # future (or past the end)
        torch.zeros(T, dtype=torch.int64),                                         # duplicate of block 0
    ], dim=-1).to(torch.int32).expand(2, T, 8)
    dirty = torch.cat([junk[..., :4], clean, junk[..., 4:], clean], dim=-1)        # unsorted, duplicated
    # block 0 is a real selection: put it into the clean set so the duplicate changes nothing
    clean0 = torch.cat([clean, torch.zeros(2, T, 1, dtype=torch.int32)], dim=-1)
    # future blocks are only harmless under the causal mask, so these are causal runs
    a, la = naive_sparse_attn_varlen(q, k, v, cu, cu, clean0, 300, 300, return_lse=True)
    b, lb = naive_sparse_attn_varlen(q, k, v, cu, cu, dirty, 300, 300, return_lse=True)
    assert torch.equal(a, b) and torch.equal(la, lb)


def test_empty_rows_give_zero_and_inf_lse():
    lq = lk = [100, 70]
    q, k, v = make_qkv(lq, lk, 4, 2)
    cu = make_cu(lq)
    idx = all_blocks(2, 170, 2)
    idx[0, 5] = -1                                                    # kv head 0 of token 5 selects nothing
    idx[:, 150] = torch.tensor([5, -3], dtype=torch.int32)            # out of range for a 70-token sequence
    idx[:, 120] = torch.tensor([1, 1], dtype=torch.int32)         # row 20 of seq 1 is in block 0: future only
    out, lse = naive_sparse_attn_varlen(q, k, v, cu, cu, idx, 100, 100, return_lse=True)
    empty = [(0, 5), (1, 5), (0, 150), (1, 150), (2, 150), (3, 150), (0, 120), (1, 120), (2, 120), (3, 120)]
    for hq, t in empty:
        assert bool((out[t, hq] == 0).all()) and lse[hq, t].item() == float("inf")
    assert bool(torch.isfinite(lse[2:, 5]).all()) and not bool(torch.isnan(out).any())


def test_bottom_right_alignment_q_shorter_and_longer_than_k():
    lq, lk = [5, 64, 3, 40], [300, 130, 3, 20]                        # chunked prefill, and Lq > Lk
    q, k, v = make_qkv(lq, lk, 4, 2)
    cuq, cuk = make_cu(lq), make_cu(lk)
    idx = all_blocks(2, sum(lq), 5)
    out, lse = naive_sparse_attn_varlen(q, k, v, cuq, cuk, idx, 64, 300, return_lse=True)
    want, want_lse = mask_reference(q, k, v, lq, lk, idx, 64)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, sdpa_varlen(q, k, v, lq, lk).nan_to_num(0.0), atol=2e-6, rtol=2e-5)
    # Lq > Lk: the first Lq - Lk rows see no key at all
    assert bool((out[72:72 + 20] == 0).all()) and bool(torch.isinf(lse[:, 72:72 + 20]).all())
    sparse = random_selection(lq, lk, 2, 2, 64)
    out = naive_sparse_attn_varlen(q, k, v, cuq, cuk, sparse, 64, 300)
    torch.testing.assert_close(out.double(), mask_reference(q, k, v, lq, lk, sparse, 64)[0], atol=1e-5,
                               rtol=1e-5)


def test_non_causal_uses_every_selected_block():
    lq, lk = [1, 1], [200, 65]                                         # decode: one query per sequence
    q, k, v = make_qkv(lq, lk, 4, 2)
    idx = torch.tensor([[[0, 3, -1]] * 2] * 2, dtype=torch.int32)
    out = naive_sparse_attn_varlen(q, k, v, make_cu(lq), make_cu(lk), idx, 1, 200, causal=False)
    want = mask_reference(q, k, v, lq, lk, idx, 64, causal=False)[0]
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


def test_query_chunking_does_not_change_output(monkeypatch):
    q, k, v = make_qkv(LENGTHS, LENGTHS, 4, 2)
    cu = make_cu(LENGTHS)
    idx = random_selection(LENGTHS, LENGTHS, 2, 2, 64)
    ref = naive_sparse_attn_varlen(q, k, v, cu, cu, idx, 200, 200)
    monkeypatch.setattr(s2, "_CHUNK_ELEMS", 1)                        # 16-row chunks
    torch.testing.assert_close(naive_sparse_attn_varlen(q, k, v, cu, cu, idx, 200, 200), ref, atol=1e-6,
                               rtol=1e-6)


def test_gradcheck_float64():
    lq, lk = [6, 3], [9, 3]
    q, k, v = (x.requires_grad_() for x in make_qkv(lq, lk, 4, 2, D=4, dtype=torch.float64))
    idx = torch.tensor([[[0, -1], [1, 2]] * 4 + [[0, 0]]] * 2, dtype=torch.int32)[:, :9]
    idx[1, 2] = -1                                                    # one empty row (its gradient is 0)
    cuq, cuk = make_cu(lq), make_cu(lk)

    def f(q, k, v):
        return naive_sparse_attn_varlen(q, k, v, cuq, cuk, idx, 6, 9, block_size=4)

    assert torch.autograd.gradcheck(f, (q, k, v), fast_mode=True)


def test_gradients_match_sdpa():
    q, k, v = (x.requires_grad_() for x in make_qkv(LENGTHS, LENGTHS, 4, 2, dtype=torch.float64))
    cu, T = make_cu(LENGTHS), sum(LENGTHS)
    do = torch.randn(T, 4, 32, dtype=torch.float64)
    out = naive_sparse_attn_varlen(q, k, v, cu, cu, all_blocks(2, T, 4), 200, 200)
    ref = sdpa_varlen(q, k, v, LENGTHS, LENGTHS)
    for g, r in zip(torch.autograd.grad(out, (q, k, v), do), torch.autograd.grad(ref, (q, k, v), do)):
        torch.testing.assert_close(g, r, atol=1e-10, rtol=1e-8)


def _args():
    q, k, v = make_qkv([100, 30], [100, 30], 4, 2)
    cu = make_cu([100, 30])
    return {"q": q, "k": k, "v": v, "cu_seqlens_q": cu, "cu_seqlens_k": cu, "topk_idx": all_blocks(2, 130, 2),
            "max_seqlen_q": 100, "max_seqlen_k": 100}


BAD = [
    ("q", TypeError, lambda a: a["q"].long()),
    ("q", ValueError, lambda a: a["q"][None]),
    ("k", TypeError, lambda a: a["k"].half()),
    ("v", ValueError, lambda a: a["v"][..., :8]),
    ("k", ValueError, lambda a: a["k"][:, :1].expand(130, 3, 32)),   # 4 query heads over 3 kv heads
    ("cu_seqlens_q", TypeError, lambda a: a["cu_seqlens_q"].long()),
    ("cu_seqlens_k", ValueError, lambda a: torch.tensor([0, 100], dtype=torch.int32)),
    ("topk_idx", TypeError, lambda a: a["topk_idx"].long()),
    ("topk_idx", ValueError, lambda a: a["topk_idx"][:1]),
    ("topk_idx", ValueError, lambda a: a["topk_idx"][0]),
    ("max_seqlen_q", ValueError, lambda a: 99),
    ("max_seqlen_k", TypeError, lambda a: 100.0),
]


@pytest.mark.parametrize("name,exc,corrupt", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_rejects_bad_inputs(name, exc, corrupt):
    args = _args()
    args[name] = corrupt(args)
    with pytest.raises(exc, match=rf"\b{name}\b"):
        naive_sparse_attn_varlen(**args)


def test_dense_rejects_bad_inputs():
    a = _args()
    with pytest.raises(ValueError, match="cu_seqlens_k"):
        naive_dense_attn_varlen(a["q"], a["k"], a["v"], a["cu_seqlens_q"], make_cu([100, 20, 10]))
