"""The whole decode step (infllmv2_decode), chunked prefill into the cache, and the custom ops under
torch.compile: against the references naive_infllmv2_decode / naive_infllmv2_attention (CPU), the
kernels against the float64 reference by FlashAttention's rule (GPU)."""
import collections
import dataclasses
import inspect
import sys

import pytest
import torch

import infllm_cupy.stage1.naive  # noqa: F401  (loaded before its `_checks` names are counted)
from infllm_cupy import _checks, _env
from infllm_cupy._rules import n_windows
from infllm_cupy.compress.naive import naive_compress_k
from infllm_cupy.config import InfLLMv2Config
from infllm_cupy.decode import DecodeCache, naive_infllmv2_decode, naive_sparse_decode, sparse_decode
from infllm_cupy.decode.step import (
    StepSpec,
    decode_layout,
    decode_select,
    infllmv2_decode,
    infllmv2_decode_op,
    infllmv2_prefill_into_cache,
    n_plans,
    step_spec,
)
from infllm_cupy.pipeline import naive_infllmv2_attention
from infllm_cupy.stage2.naive import naive_dense_attn_varlen
from infllm_cupy.testing import assert_close_to_ref, cu_seqlens_from_lengths, random_decode_cache

# A small budget so that selection drops blocks (K = 4 + 2 = 6 blocks of 64); fp32 scores, so that one
# rounding of a score (kernel against reference) rarely decides a near-tie. Exact ties go to the lower
# block on both sides (test_kernel_step_equals_reference_on_planted_ties).
CFG = InfLLMv2Config(topk=4, local_blocks=2, dense_len=0, score_dtype=torch.float32)



def oracle(q, cache, cfg, *, aux=False):
    """naive_infllmv2_decode on the packed cache: (out, topk_idx or None[, aux dict])."""
    k, v, cu = cache.packed()
    out, a = naive_infllmv2_decode(q, k, v, cu, config=cfg, return_aux=True)
    return (out, a["topk_idx"], a) if aux else (out, a["topk_idx"])


def same_selection(a, b, block_scores=None, tol=1e-3):
    """Equal as sets per (head, sequence) row, -1 slots ignored (K may differ by -1 padding). With
    the reference's `block_scores [H, B, n]`, blocks in one set only are allowed where their scores
    are within `tol` (relative) of each other: a near-tie that one rounding of the score decides."""
    assert a.shape[:2] == b.shape[:2]
    for h in range(a.shape[0]):
        for s in range(a.shape[1]):
            x = {i for i in a[h, s].tolist() if i >= 0}
            y = {i for i in b[h, s].tolist() if i >= 0}
            if x == y:
                continue
            where = f"row (h={h}, b={s})"
            assert block_scores is not None and len(x) == len(y), f"{where}: {sorted(x)} != {sorted(y)}"
            sc = [float(block_scores[h, s, i]) for i in sorted(x ^ y)]
            assert max(sc) - min(sc) <= tol * max(abs(v) for v in sc), f"{where}: {sorted(x ^ y)} {sc}"


# ------------------------------------------------------------------------------------------- CPU
@pytest.mark.parametrize("page_size", [None, 64, 256], ids=["contiguous", "page64", "page256"])
@pytest.mark.parametrize("exact", [False, True], ids=["coarse", "exact"])
def test_step_equals_the_reference(page_size, exact):
    lengths, H, HQ, D = [1, 65, 300, 700, 1025], 2, 8, 32
    cfg = dataclasses.replace(CFG, exact_stage1=exact)
    cache = random_decode_cache(lengths, H, D, torch.float32, page_size=page_size)
    q = torch.randn(len(lengths), HQ, D)
    out, idx = infllmv2_decode(q, cache, config=cfg, return_topk_idx=True)
    ref, ref_idx = oracle(q, cache, cfg)
    assert torch.equal(idx, ref_idx)                              # the selection exactly
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # the long sequence really drops blocks: 6 of its 17
    assert int((idx[:, -1] >= 0).sum(-1).min()) == 6


@pytest.mark.parametrize("G", [1, 16, 32])
@pytest.mark.parametrize("page_size", [None, 64], ids=["contiguous", "page64"])
def test_cpu_stage1_of_the_step_equals_the_oracle(page_size, G):
    # CPU tensors under "auto": the decode step's stage 1 is stage 1's CPU implementation (one query row
    # per sequence); with fp32 scores it selects exactly the oracle's blocks (backend="reference"), and
    # the attention over them (decode/cpu.py) is the oracle's up to fp32 rounding
    lengths, H, D = [1, 64, 65, 300, 1025, 2047], 2, 64
    cache = random_decode_cache(lengths, H, D, torch.bfloat16, page_size=page_size)
    q = torch.randn(len(lengths), H * G, D).to(torch.bfloat16)
    for cfg in (CFG, dataclasses.replace(CFG, exact_stage1=True), dataclasses.replace(CFG, topk=20)):
        want = decode_select(q, cache, config=cfg, backend="reference")
        assert torch.equal(decode_select(q, cache, config=cfg), want)
        out, idx = infllmv2_decode(q, cache, config=cfg, return_topk_idx=True)
        ref, ref_idx = infllmv2_decode(q, cache, config=cfg, return_topk_idx=True, backend="reference")
        assert torch.equal(idx, ref_idx)
        torch.testing.assert_close(out, ref, atol=2e-2, rtol=0)          # bf16: one ulp of |out| <= 4


def test_cpu_decode_and_prefill_into_cache_dispatch(monkeypatch):
    # which stage 1 runs: "auto" on CPU tensors the CPU implementation, "reference" the oracle, on every
    # decode entry (decode_select, infllmv2_decode, infllmv2_prefill_into_cache)
    from infllm_cupy import prefill as prefill_module
    from infllm_cupy.stage1 import select as select_module

    calls = []
    for module in (select_module, prefill_module):
        for name in ("cpu_stage1_select", "naive_stage1_select"):
            if hasattr(module, name):
                fn = getattr(module, name)
                monkeypatch.setattr(module, name,
                                    lambda *a, _n=name, _f=fn, **k: calls.append(_n[:3]) or _f(*a, **k))
    cache = random_decode_cache([300, 700], 2, 32, torch.float32, spare=200)
    q = torch.randn(2, 4, 32)
    for backend, want in (("auto", "cpu"), ("reference", "nai")):
        calls.clear()
        decode_select(q, cache, config=CFG, backend=backend)
        infllmv2_decode(q, cache, config=CFG, backend=backend)
        n = [10, 3]
        infllmv2_prefill_into_cache(torch.randn(13, 4, 32), torch.randn(13, 2, 32), torch.randn(13, 2, 32),
                                    cache, cu_seqlens_from_lengths(n), config=CFG, backend=backend)
        assert calls == [want] * 3, (backend, calls)


def test_step_bf16_within_flash_attention_rule_and_default_scores():
    # MiniCPM4's bf16 stage-1 scores; the output against float64 attention over the same selection
    lengths, H, HQ, D = [130, 900, 640], 2, 16, 64
    cfg = dataclasses.replace(CFG, score_dtype=torch.bfloat16)
    cache = random_decode_cache(lengths, H, D, torch.bfloat16, page_size=64)
    q = torch.randn(len(lengths), HQ, D).to(torch.bfloat16)
    out, lse, idx = infllmv2_decode(q, cache, config=cfg, return_lse=True, return_topk_idx=True)
    _, ref_idx = oracle(q, cache, cfg)
    assert torch.equal(idx, ref_idx)
    as64 = (cache.k.double(), cache.v.double(), cache.seqlens, cache.block_table)
    ref, ref_lse = naive_sparse_decode(q.double(), as64, idx, return_lse=True)
    lowp = naive_sparse_decode(q, cache, idx, upcast=False)
    assert_close_to_ref("out", out, ref, lowp)
    torch.testing.assert_close(lse, ref_lse.float(), atol=1e-3, rtol=0)


def test_dense_below_dense_len_and_sparse_from_it():
    # spec section 9: dense while the longest cache (current token included) is < dense_len
    lengths, H, HQ, D = [511, 200], 2, 4, 32
    cfg = dataclasses.replace(CFG, dense_len=512)
    cache = random_decode_cache(lengths, H, D, torch.float32)
    q = torch.randn(2, HQ, D)
    out, idx = infllmv2_decode(q, cache, config=cfg, return_topk_idx=True)
    ref, ref_idx = oracle(q, cache, cfg)
    assert idx is None and ref_idx is None
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, naive_sparse_decode(q, cache), atol=1e-6, rtol=1e-6)
    cache.append(torch.randn(2, H, D), torch.randn(2, H, D))          # longest = 512 = dense_len
    out, idx = infllmv2_decode(q, cache, config=cfg, return_topk_idx=True)
    ref, ref_idx = oracle(q, cache, cfg)
    assert idx is not None and torch.equal(idx, ref_idx)
    assert int((idx[:, 0] >= 0).sum(-1).max()) == 6                   # 8 blocks, 6 kept: sparse
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_weights_of_the_step():
    lengths, H, HQ, D = [300, 1000], 2, 8, 32
    cache = random_decode_cache(lengths, H, D, torch.float32, page_size=64)
    q = torch.randn(2, HQ, D)
    _out, w, idx = infllmv2_decode(q, cache, config=CFG, return_attn_weights=True, return_topk_idx=True)
    _, wr = naive_sparse_decode(q, cache, idx, return_attn_weights=True)
    assert w.shape == (2, HQ, cache.capacity)
    torch.testing.assert_close(w, wr, atol=1e-6, rtol=0)
    torch.testing.assert_close(w.sum(-1), torch.ones(2, HQ), atol=1e-5, rtol=0)
    blocks = torch.arange(cache.capacity) // 64
    for b in range(2):
        for h in range(H):
            sel = torch.isin(blocks, idx[h, b][idx[h, b] >= 0])
            assert bool((w[b, h * 4:(h + 1) * 4][:, ~sel] == 0).all())
    wk = infllmv2_decode(q, cache, config=CFG, return_attn_weights=True, weights="per_kv_head")[1]
    torch.testing.assert_close(wk, w.view(2, H, 4, -1).sum(2), atol=1e-6, rtol=0)


def test_decode_layout_views_the_cache_without_copying():
    cache = random_decode_cache([40, 200, 1], 2, 16, torch.float32, spare=100)
    cu_q, ck1, cu1, ck2, cu2, cache_lens = decode_layout(cache)
    N1, N2 = cache.ck1.shape[1], cache.ck2.shape[1]
    assert ck1.data_ptr() == cache.ck1.data_ptr() and ck2.data_ptr() == cache.ck2.data_ptr()
    assert cu_q.tolist() == [0, 1, 1, 2, 2, 3, 3]
    n1 = [1, 11, 0]                                   # (L - 32) // 16 + 1 complete windows
    n2 = [0, 2, 0]                                    # (L - 128) // 64 + 1
    assert cu1.tolist() == [0, n1[0], N1, N1 + n1[1], 2 * N1, 2 * N1 + n1[2], 3 * N1]
    assert cu2.tolist() == [0, n2[0], N2, N2 + n2[1], 2 * N2, 2 * N2 + n2[2], 3 * N2]
    assert cache_lens.tolist() == [39, 0, 199, 0, 0, 0]
    e = decode_layout(cache, exact=True)
    assert e[3] is e[1] and e[4] is e[2]


@pytest.mark.parametrize("backend", ["auto", "reference"])
@pytest.mark.parametrize("page_size", [None, 64])
@pytest.mark.parametrize("dense_len", [0, 100000], ids=["sparse", "dense"])
def test_chunked_prefill_equals_the_reference_pipeline(page_size, dense_len, backend):
    """backend="reference": the reference pipeline on the packed cache, bit for bit; "auto" on CPU
    tensors (stage 2's CPU implementation, SDPA below dense_len): the same selection, the output
    within fp32 rounding."""
    cfg = dataclasses.replace(CFG, dense_len=dense_len)
    H, HQ, D = 2, 4, 32
    cache = random_decode_cache([1, 300, 800], H, D, torch.float32, page_size=page_size, spare=300)
    for n in ([5, 0, 64], [130, 1, 3]):
        q = torch.randn(sum(n), HQ, D)
        k, v = torch.randn(sum(n), H, D), torch.randn(sum(n), H, D)
        out, aux = infllmv2_prefill_into_cache(q, k, v, cache, cu_seqlens_from_lengths(n), config=cfg,
                                               backend=backend, return_aux=True)
        kp, vp, cu = cache.packed()
        L = cache.lengths()
        ref, ref_aux = naive_infllmv2_attention(q, kp, vp, cu_seqlens_from_lengths(n), cu, max(n), max(L),
                                                cfg, return_aux=True)
        if backend == "reference":
            assert torch.equal(out, ref)
        else:
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        assert aux["dense"] == ref_aux["dense"] == (dense_len > 0)
        if not aux["dense"]:
            assert torch.equal(aux["topk_idx"], ref_aux["topk_idx"])
    # then one decode step on the same cache agrees with the reference too
    q = torch.randn(3, HQ, D)
    cache.append(torch.randn(3, H, D), torch.randn(3, H, D))
    out = infllmv2_decode(q, cache, config=cfg)
    torch.testing.assert_close(out, oracle(q, cache, cfg)[0], atol=1e-5, rtol=1e-5)


def test_chunked_prefill_errors_leave_the_cache_unchanged():
    H, HQ, D = 2, 4, 16
    cache = random_decode_cache([10, 20], H, D, torch.float32, spare=5)
    before = (cache.k.clone(), cache.ck1.clone(), cache.lengths())
    q = torch.randn(8, HQ, D)
    kv = torch.randn(8, H, D)
    cases = [
        (dict(n=[2, 6]), "capacity"),                                 # sequence 1: 20 + 6 > 25
        (dict(q=torch.randn(7, HQ, D)), "q"),
        (dict(k=kv.double()), "k_new"),
        (dict(q=q.double()), "q"),
        (dict(n=[4, 3]), "k_new"),                                    # 7 tokens for 8 rows
    ]
    for change, match in cases:
        a = dict(q=q, k=kv, v=kv, n=[4, 4])
        a.update(change)
        with pytest.raises((ValueError, TypeError), match=match):
            infllmv2_prefill_into_cache(a["q"], a["k"], a["v"], cache, cu_seqlens_from_lengths(a["n"]),
                                        config=CFG)
        assert torch.equal(cache.k, before[0]) and torch.equal(cache.ck1, before[1])
        assert cache.lengths() == before[2]


def test_bad_input_names_the_argument():
    cache = random_decode_cache([100, 70], 2, 32, torch.float32)
    q = torch.randn(2, 4, 32)
    cases = [
        (dict(q=q.double()), "q"),
        (dict(q=torch.randn(3, 4, 32)), "q"),
        (dict(q=torch.randn(2, 4, 16)), "head dim"),
        (dict(q=torch.randn(2, 3, 32)), "heads"),
        (dict(weights="per_query"), "weights"),
        (dict(backend="cuda"), "backend"),
        (dict(kernel="sm70"), "kernel"),
        # `kernel` is the generation, as in every op: the decode kernels have no sm_90a form
        (dict(kernel="sm90a"), "sm90a.*stage1='prefill'"),
        (dict(stage1="sm80"), "stage1 must be one of .*the kernel generation is `kernel=`"),
        (dict(stage1="split"), "stage1"),
        (dict(config=dataclasses.replace(CFG, kernel_size=64, kernel_stride=32, block_size=64)), "config"),
        (dict(config="minicpm"), "config"),
        (dict(cache=(cache.k, cache.v, cache.seqlens)), "cache"),
        (dict(return_lse=1), "return_lse"),
    ]
    # every entry point of the step checks the arguments it takes, with the same messages
    entries = {infllmv2_decode: {"weights", "backend", "kernel", "stage1", "return_lse"},
               decode_select: {"backend", "kernel", "stage1"}}
    for change, match in cases:
        a = dict(q=q, cache=cache)
        a.update(change)
        q_, c_ = a.pop("q"), a.pop("cache")
        for entry, takes in entries.items():
            if set(a) - {"config"} <= takes:
                with pytest.raises((ValueError, TypeError), match=match):
                    entry(q_, c_, **{"config": CFG, **a})
    empty = DecodeCache.contiguous(2, 64, 2, 32, dtype=torch.float32)
    with pytest.raises(ValueError, match="cache: every sequence must hold"):
        infllmv2_decode(q, empty, config=CFG)
    # the prefill stage-1 switch and either generation of the decode kernels: the same step (the
    # reference on CPU tensors)
    ref = infllmv2_decode(q, cache, config=CFG, return_topk_idx=True)
    for kw in (dict(kernel="sm80"), dict(stage1="prefill"), dict(stage1="prefill", kernel="sm90a")):
        for a, b in zip(infllmv2_decode(q, cache, config=CFG, return_topk_idx=True, **kw), ref):
            assert torch.equal(a, b), kw


def count_checks(monkeypatch, q):
    """Counts the calls of every `_checks` function, under each name a module of the package holds it by
    (so calls between the checks count too): `(calls, calls_with_q)`, Counters by function name, the
    second of the calls that were given `q` itself."""
    calls, with_q = collections.Counter(), collections.Counter()
    originals = {f: name for name, f in vars(_checks).items()
                 if inspect.isfunction(f) and f.__module__ == _checks.__name__}

    def counted(name, f):
        def call(*args, **kwargs):
            calls[name] += 1
            if any(a is q for a in (*args, *kwargs.values())):
                with_q[name] += 1
            return f(*args, **kwargs)
        return call

    wrapped = {f: counted(name, f) for f, name in originals.items()}
    for module in [m for name, m in sys.modules.items() if name.startswith("infllm_cupy")]:
        for attr, value in list(vars(module).items()):
            if inspect.isfunction(value) and value in wrapped:
                monkeypatch.setattr(module, attr, wrapped[value])
    return calls, with_q


def test_each_decode_entry_point_checks_q_once(monkeypatch):
    # the public entry points check their arguments once; what runs below them takes them as checked
    # (on CUDA tensors the kernels' own requirements are checked once more, in step_launches)
    cache = random_decode_cache([100, 700], 2, 32, torch.float32, page_size=64)
    q = torch.randn(2, 4, 32)
    calls, with_q = count_checks(monkeypatch, q)
    dense = dataclasses.replace(CFG, dense_len=10**6)
    once = {
        "infllmv2_decode, sparse": lambda: infllmv2_decode(q, cache, config=CFG, return_lse=True,
                                                           return_attn_weights=True, return_topk_idx=True),
        "infllmv2_decode, dense": lambda: infllmv2_decode(q, cache, config=dense, return_lse=True),
        "infllmv2_decode, prefill stage 1": lambda: infllmv2_decode(q, cache, config=CFG, stage1="prefill"),
        "decode_select": lambda: decode_select(q, cache, config=CFG),
        "sparse_decode": lambda: sparse_decode(q, cache, return_lse=True),
        "naive_sparse_decode": lambda: naive_sparse_decode(q, cache),
    }
    for what, call in once.items():
        calls.clear()
        with_q.clear()
        call()
        assert with_q == {"check_tensor": 1}, (what, dict(with_q))
        assert calls["check_backend"] <= 1 and calls["check_softmax_scale"] <= 1, (what, dict(calls))
    # the step's custom op checks its tensors once too (under torch.compile the op is all that runs per
    # call), on either path
    for cfg in (CFG, dense):
        with_q.clear()
        spec = step_spec(cfg, select="stage1", device_dense=True, weights="per_head")
        infllmv2_decode_op(q, cache.k, cache.v, cache.ck1, cache.ck2, cache.seqlens, cache.block_table, None,
                           spec.encode())
        assert with_q == {"check_tensor": 1}, dict(with_q)


def test_op_pads_the_selection_to_the_static_width():
    # the op sizes K on the cache's width (a static shape); the reference on the longest sequence
    cache = random_decode_cache([200, 130], 2, 32, torch.float32, spare=700)            # width 900: 15 blocks
    q = torch.randn(2, 4, 32)
    cfg = dataclasses.replace(CFG, topk=12)
    ref = decode_select(q, cache, config=cfg)                                           # K = min(14, 4) = 4
    spec = step_spec(cfg, select="stage1", return_topk_idx=True)
    out, got = infllmv2_decode_op(q, cache.k, cache.v, cache.ck1, cache.ck2, cache.seqlens, None, None,
                                  spec.encode())
    assert ref.shape == (2, 2, 4) and got.shape == (2, 2, 14)
    assert torch.equal(got[..., :4], ref) and bool((got[..., 4:] == -1).all())
    assert torch.equal(out, infllmv2_decode(q, cache, config=cfg))
    # a device-decided dense step (every length below dense_len) returns the rows it attended: every
    # block of each sequence, then -1, as wide as the dense blocks (cdiv(dense_len - 1, 64) = 5 > K = 4)
    spec = step_spec(dataclasses.replace(cfg, topk=2, dense_len=300), select="stage1", device_dense=True,
                     return_topk_idx=True)
    out, rows = infllmv2_decode_op(q, cache.k, cache.v, cache.ck1, cache.ck2, cache.seqlens, None, None,
                                   spec.encode())
    assert rows.shape == (2, 2, 5)
    assert rows[0].tolist() == [[0, 1, 2, 3, -1], [0, 1, 2, -1, -1]]
    torch.testing.assert_close(out, naive_sparse_decode(q, cache), atol=1e-6, rtol=0)


def test_step_spec_round_trips_and_refuses_garbage():
    spec = step_spec(dataclasses.replace(CFG, softmax_scale=0.1234567890123), select="stage1",
                     device_dense=True, return_lse=True, weights="per_kv_head", backend="reference")
    assert StepSpec.decode(spec.encode()) == spec
    plan = StepSpec("given", softmax_scale=None, decode_plan=(2, 8, 3, 0, True))
    assert StepSpec.decode(plan.encode()) == plan
    for bad in ("import os", spec.encode().replace("True", "yes"), spec.encode() + ";1"):
        with pytest.raises(ValueError, match="spec"):
            StepSpec.decode(bad)


def test_op_fake_and_schema():
    # torch.library.opcheck: schema, fake implementation against the CPU kernel, autograd registration
    cache = random_decode_cache([100, 70], 2, 32, torch.float32, page_size=64)
    q = torch.randn(2, 4, 32)
    idx = torch.tensor([[[0, 1], [1, -1]], [[1, 0], [0, 0]]], dtype=torch.int32)
    tensors = (q, cache.k, cache.v, cache.ck1, cache.ck2, cache.seqlens, cache.block_table)
    specs = [step_spec(CFG, select="stage1", return_lse=True, weights="per_head", return_topk_idx=True),
             step_spec(dataclasses.replace(CFG, dense_len=90), select="stage1", device_dense=True,
                       return_topk_idx=True),
             step_spec(CFG, select="dense", weights="per_kv_head")]
    for spec in specs:
        torch.library.opcheck(infllmv2_decode_op, tensors + (None, spec.encode()))
    given = StepSpec("given", softmax_scale=0.2, return_lse=True, weights="per_kv_head", return_topk_idx=True)
    torch.library.opcheck(infllmv2_decode_op, (q, cache.k, cache.v, None, None, cache.seqlens,
                                               cache.block_table, idx, given.encode()))


def test_compiled_step_honours_the_reference_backend(monkeypatch):
    # under torch.compile the step is the op; backend="reference" reaches its body as the reference (on
    # CUDA tensors too: test_kernel_compiled_step_honours_the_reference_backend)
    from infllm_cupy.decode import step as step_module

    seen = []
    body = step_module.run_step

    def spy(*args, kernels, **kw):
        seen.append((args[8].backend, kernels))
        return body(*args, kernels=kernels, **kw)

    monkeypatch.setattr(step_module, "run_step", spy)
    torch._dynamo.reset()
    cache = random_decode_cache([100, 70], 2, 32, torch.float32)
    q = torch.randn(2, 4, 32)
    f = torch.compile(lambda q: infllmv2_decode(q, cache, config=CFG, backend="reference"), fullgraph=True,
                      backend="eager")
    want = infllmv2_decode(q, cache, config=CFG, backend="reference")
    torch.testing.assert_close(f(q), want, atol=0, rtol=0)
    assert ("reference", False) in seen


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_decode_loop_compiles_fullgraph_on_cpu(backend):
    # append + the whole step (selection and attention with weights) in one compiled region, across
    # the dense/sparse switch; equal to the eager step at every step: bit for bit through aot_eager
    # (fake-tensor tracing and functionalization of the cache's in-place writes, eager kernels);
    # inductor generates its own window-mean code, so ck1/ck2 may differ in the last bit there
    exact = backend == "aot_eager"
    same = torch.equal if exact else (lambda a, b: torch.allclose(a, b, atol=1e-5, rtol=1e-5))
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    H, HQ, D = 2, 4, 32
    cfg = dataclasses.replace(CFG, dense_len=250)
    eager = random_decode_cache([240, 100], H, D, torch.float32, page_size=64, spare=40)
    compiled = random_decode_cache([240, 100], H, D, torch.float32, page_size=64, spare=40)

    @torch.compile(fullgraph=True, backend=backend)
    def step(cache, q, k, v):
        cache.append(k, v)
        return infllmv2_decode(q, cache, config=cfg, return_lse=True, return_attn_weights=True)

    g = torch.Generator().manual_seed(5)
    paths = set()
    for _ in range(16):
        q = torch.randn(2, HQ, D, generator=g)
        k, v = torch.randn(2, H, D, generator=g), torch.randn(2, H, D, generator=g)
        out, lse, w = step(compiled, q, k, v)        # dense or sparse decided inside the op
        eager.append(k, v)
        paths.add(eager.max_len() < cfg.dense_len)
        ref, ref_lse, ref_w = infllmv2_decode(q, eager, config=cfg, return_lse=True, return_attn_weights=True)
        assert same(out, ref) and same(lse, ref_lse) and same(w, ref_w)
    assert paths == {True, False}
    assert compiled.sync_lengths() == eager.lengths() == [256, 116]
    for name in ("k", "v", "seqlens"):
        assert torch.equal(getattr(compiled, name), getattr(eager, name)), name
    for name in ("ck1", "ck2"):
        assert same(getattr(compiled, name), getattr(eager, name)), name
    # one graph for both paths (the op decides on the lengths), plus at most one recompile
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])


# ------------------------------------------------------------------------------------------- GPU
# (lengths, HQ, H, D, dtype, page_size): cache lengths 1, 63, 64, 65, 127, 128 and ones that are not
# page multiples, mixed; G from 1 to 32.
GPU_CASES = [
    ([1, 63, 64, 65, 127, 128, 700], 16, 1, 128, torch.bfloat16, None),
    ([300, 1000, 70], 32, 2, 128, torch.bfloat16, 64),
    ([2049, 17], 4, 2, 64, torch.float16, 128),
    ([777], 1, 1, 64, torch.bfloat16, 256),
    ([513, 200], 24, 1, 128, torch.float16, None),
    ([130, 1500], 32, 1, 64, torch.bfloat16, 64),
    ([900, 640, 3], 2, 2, 128, torch.float16, 256),
]
GPU_IDS = [f"L{'-'.join(map(str, c[0]))}_HQ{c[1]}_H{c[2]}_D{c[3]}_{str(c[4])[6:]}_"
           f"{'pg' + str(c[5]) if c[5] else 'contig'}" for c in GPU_CASES]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=GPU_IDS)
def test_kernel_step_matches_reference(case):
    lengths, HQ, H, D, dtype, page_size = case
    cache = random_decode_cache(lengths, H, D, dtype, page_size=page_size, device="cuda")
    q = torch.randn(len(lengths), HQ, D, generator=torch.Generator().manual_seed(1)).to("cuda", dtype)
    out, lse, w, idx = infllmv2_decode(q, cache, config=CFG, return_lse=True, return_attn_weights=True,
                                       return_topk_idx=True)
    cpu = random_decode_cache(lengths, H, D, dtype, page_size=page_size)               # same draws on the CPU
    _, ref_idx, aux = oracle(q.cpu(), cpu, CFG, aux=True)
    same_selection(idx.cpu(), ref_idx, aux["block_scores"])
    assert idx.shape[2] == min(CFG.topk + CFG.local_blocks, -(-cache.capacity // 64))
    as64 = (cache.k.double(), cache.v.double(), cache.seqlens, cache.block_table)
    as64 = as64 if page_size else as64[:3]
    ref, ref_lse, ref_w = naive_sparse_decode(q.double(), as64, idx, return_lse=True,
                                              return_attn_weights=True)
    lowp, lowp_lse, lowp_w = naive_sparse_decode(q, cache, idx, return_lse=True, return_attn_weights=True,
                                                 upcast=False)
    assert_close_to_ref("out", out, ref, lowp)
    assert_close_to_ref("lse", lse, ref_lse.float(), lowp_lse, atol_floor=1e-5)
    assert_close_to_ref("weights", w, ref_w.float(), lowp_w, atol_floor=1e-6)
    torch.testing.assert_close(w.sum(-1), torch.ones_like(lse), atol=1e-4, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("score_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("case", GPU_CASES[:3], ids=GPU_IDS[:3])
def test_kernel_step_equals_reference_on_planted_ties(case, score_dtype):
    # q = 0: every block that is not forced ties; the step's kernels and the reference take the same
    # (lowest) blocks, row for row
    lengths, HQ, H, D, dtype, page_size = case
    cfg = dataclasses.replace(CFG, score_dtype=score_dtype)
    cache = random_decode_cache(lengths, H, D, dtype, page_size=page_size, device="cuda")
    q = torch.zeros(len(lengths), HQ, D, dtype=dtype, device="cuda")
    _, idx = infllmv2_decode(q, cache, config=cfg, return_topk_idx=True)
    _, ref_idx = oracle(q.cpu(), random_decode_cache(lengths, H, D, dtype, page_size=page_size), cfg)
    K = ref_idx.shape[2]
    assert torch.equal(idx[..., :K].cpu(), ref_idx) and bool((idx[..., K:] == -1).all())


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES[:3], ids=GPU_IDS[:3])
def test_kernel_step_generation_and_prefill_stage1(case):
    # kernel="sm80" is the default's kernels (the decode kernels' one generation, through the prepared
    # launches); stage1="prefill" selects on the prefill stage-1 kernel, the same rows bit for bit (fp32
    # scores, G <= 32), so the same step through the general path
    lengths, HQ, H, D, dtype, page_size = case
    cache = random_decode_cache(lengths, H, D, dtype, page_size=page_size, device="cuda")
    q = torch.randn(len(lengths), HQ, D, generator=torch.Generator().manual_seed(6)).to("cuda", dtype)
    ref = infllmv2_decode(q, cache, config=CFG, return_lse=True, return_topk_idx=True)
    n = n_plans()
    for kw in (dict(kernel="sm80"), dict(stage1="prefill", kernel="sm80")):
        got = infllmv2_decode(q, cache, config=CFG, return_lse=True, return_topk_idx=True, **kw)
        for a, b in zip(got, ref):
            assert torch.equal(a, b), kw
        if "stage1" not in kw:
            assert n_plans() == n            # "auto" and "sm80" share the prepared step
    with pytest.raises(ValueError, match="sm90a"):
        infllmv2_decode(q, cache, config=CFG, kernel="sm90a")


@pytest.mark.gpu
def test_eager_step_checks_nothing_after_the_first_call(monkeypatch):
    # the prepared path: the first call of a program checks everything once (the arguments, then the
    # kernels' requirements: q's dtype and layout, its alignment); later calls run no `_checks` function
    lengths, HQ, H, D, dtype = [700, 90], 16, 2, 64, torch.float16
    cache = random_decode_cache(lengths, H, D, dtype, device="cuda")
    q = torch.randn(2, HQ, D, device="cuda", dtype=dtype)
    calls, with_q = count_checks(monkeypatch, q)
    infllmv2_decode(q, cache, config=CFG, return_lse=True)
    assert with_q == {"check_tensor": 2, "check_aligned": 1}, dict(with_q)
    calls.clear()
    for _ in range(3):
        infllmv2_decode(torch.randn_like(q), cache, config=CFG, return_lse=True)
    assert not calls, dict(calls)


@pytest.mark.gpu
@pytest.mark.parametrize("dense", [False, True], ids=["sparse", "dense"])
@pytest.mark.parametrize("case", GPU_CASES[1:4] + GPU_CASES[5:6], ids=GPU_IDS[1:4] + GPU_IDS[5:6])
def test_kernel_step_weights_per_kv_head(case, dense):
    # weights="per_kv_head" through the whole step (the split stage 1, then sparse_decode's summed form)
    # and through the ops (decode_step): the float64 reference's group sums by FlashAttention's rule, and
    # the same step's per-head weights summed over each group by the fp32 rule (error at most 2x that of
    # torch's fp32 sum of them against their float64 sum, plus G fp32 roundings)
    lengths, HQ, H, D, dtype, page_size = case
    cfg = dataclasses.replace(CFG, dense_len=10**6 if dense else 0)
    cache = random_decode_cache(lengths, H, D, dtype, page_size=page_size, device="cuda")
    q = torch.randn(len(lengths), HQ, D, generator=torch.Generator().manual_seed(4)).to("cuda", dtype)
    B, G, W = len(lengths), HQ // H, cache.capacity
    out, wk, idx = infllmv2_decode(q, cache, config=cfg, return_attn_weights=True, weights="per_kv_head",
                                   return_topk_idx=True)
    out_h, w = infllmv2_decode(q, cache, config=cfg, return_attn_weights=True)
    assert (idx is None) == dense and wk.shape == (B, H, W) and wk.dtype == torch.float32
    assert torch.equal(out, out_h)                    # the weights' form does not touch the output
    grouped = w.view(B, H, G, W)
    assert_close_to_ref("per-KV-head = per-head summed", wk, grouped.double().sum(2), grouped.sum(2),
                        atol_floor=G * 2.0**-23)
    as64 = (cache.k.double(), cache.v.double(), cache.seqlens, cache.block_table)
    as64 = as64 if page_size else as64[:3]
    ref_w = naive_sparse_decode(q.double(), as64, idx, return_attn_weights=True, weights="per_kv_head")[1]
    lowp_w = naive_sparse_decode(q, cache, idx, return_attn_weights=True, weights="per_kv_head",
                                 upcast=False)[1]
    assert_close_to_ref("weights per KV head", wk, ref_w.float(), lowp_w, atol_floor=1e-6)
    assert bool((wk[ref_w == 0] == 0).all()), "weights must be exactly 0 where nothing is selected"
    torch.testing.assert_close(wk.sum(-1), torch.full((B, H), float(G), device="cuda"), atol=G * 1e-4, rtol=0)
    # the compiled step (the op, dense or sparse decided on the device: on a dense step another split of
    # the same blocks, so the same weights to fp32 rounding)
    step = torch.compile(lambda q: infllmv2_decode(q, cache, config=cfg, return_attn_weights=True,
                                                   weights="per_kv_head"), fullgraph=True, backend="eager")
    wk_op = step(q)[1]
    if dense:
        torch.testing.assert_close(wk_op, wk, atol=1e-6, rtol=1e-5)
    else:
        assert torch.equal(wk_op, wk)


@pytest.mark.gpu
def test_kernel_dense_path_and_chunked_prefill():
    lengths, HQ, H, D, dtype = [300, 65], 8, 2, 128, torch.bfloat16
    cfg = dataclasses.replace(CFG, dense_len=10000)
    cache = random_decode_cache(lengths, H, D, dtype, page_size=64, device="cuda", spare=400)
    q = torch.randn(2, HQ, D, device="cuda", dtype=dtype)
    out, idx = infllmv2_decode(q, cache, config=cfg, return_topk_idx=True)
    assert idx is None
    as64 = (cache.k.double(), cache.v.double(), cache.seqlens, cache.block_table)
    assert_close_to_ref("dense", out, naive_sparse_decode(q.double(), as64),
                        naive_sparse_decode(q, cache, upcast=False))
    n = [70, 130]
    g = torch.Generator().manual_seed(2)
    qn = torch.randn(sum(n), HQ, D, generator=g).to("cuda", dtype)
    kn, vn = (torch.randn(sum(n), H, D, generator=g).to("cuda", dtype) for _ in range(2))
    out = infllmv2_prefill_into_cache(qn, kn, vn, cache, cu_seqlens_from_lengths(n, "cuda"), config=CFG)
    assert not torch.isnan(out).any()
    kp, vp, cu = cache.packed()
    cu_q = cu_seqlens_from_lengths(n, "cuda")
    # the reference on the same bf16 values (its math in fp32), so that stage 1 sees the same keys
    ref = naive_infllmv2_attention(qn.cpu(), kp.cpu(), vp.cpu(), cu_q.cpu(), cu.cpu(), max(n),
                                   max(cache.lengths()), CFG)
    torch.testing.assert_close(out.cpu().float(), ref.float(), atol=2e-2, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("weights", ["per_head", "per_kv_head"])
@pytest.mark.parametrize("page_size", [None, 64])
def test_whole_step_replays_bit_identically_in_a_cuda_graph(page_size, weights):
    # append + stage 1 + top-k + sparse decode with weights (either form), captured with value checks off
    lengths, HQ, H, D, dtype = [700, 63, 1029], 16, 2, 128, torch.bfloat16
    eager = random_decode_cache(lengths, H, D, dtype, page_size=page_size, device="cuda")
    graphed = random_decode_cache(lengths, H, D, dtype, page_size=page_size, device="cuda")
    g = torch.Generator().manual_seed(3)
    kn, vn = (torch.randn(3, H, D, generator=g).to("cuda", dtype) for _ in range(2))
    q = torch.randn(3, HQ, D, generator=g).to("cuda", dtype)

    def step(cache):
        cache.append(kn, vn)
        return infllmv2_decode(q, cache, config=CFG, return_lse=True, return_attn_weights=True,
                               weights=weights, return_topk_idx=True)

    with _env.override(validate=False):
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):                 # warm-up: compilation, allocator
            step(random_decode_cache(lengths, H, D, dtype, page_size=page_size, device="cuda"))
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            res_g = step(graphed)
        graph.replay()
        torch.cuda.synchronize()
        res_e = step(eager)
    assert graphed.sync_lengths() == eager.lengths() == [L + 1 for L in lengths]
    for a, b in zip(res_g, res_e):
        assert torch.equal(a, b)
    for name in ("k", "v", "ck1", "ck2", "seqlens"):
        assert torch.equal(getattr(graphed, name), getattr(eager, name)), name


@pytest.mark.gpu
def test_kernel_ops_under_compile():
    cfg = dataclasses.replace(CFG, dense_len=0)
    cache = random_decode_cache([500, 90], 2, 64, torch.float16, page_size=64, device="cuda")
    q = torch.randn(2, 8, 64, device="cuda", dtype=torch.float16)
    step = torch.compile(lambda q: infllmv2_decode(q, cache, config=cfg, return_lse=True), fullgraph=True,
                         backend="eager")
    out, lse = step(q)
    ref, ref_lse = infllmv2_decode(q, cache, config=cfg, return_lse=True)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [None, 64])
def test_cache_graphs_replay_equal_the_launches_across_dense_len(page_size):
    """`DecodeCache.graphs`: each step replays a CUDA graph of the prepared launches, on both sides of
    dense_len (one graph per path), with the same bits as the eager launches; outputs are fresh tensors
    (a later step does not overwrite an earlier one's)."""
    lengths, HQ, H, D, dtype = [500, 380], 16, 2, 128, torch.bfloat16
    cfg = dataclasses.replace(CFG, dense_len=512, score_dtype=torch.bfloat16)
    eager = random_decode_cache(lengths, H, D, dtype, page_size=page_size, device="cuda")
    graphed = random_decode_cache(lengths, H, D, dtype, page_size=page_size, device="cuda")
    graphed.graphs = True
    g = torch.Generator().manual_seed(9)
    kept = []
    for _ in range(24):                              # 500 -> 524: dense for 11 steps, then sparse
        kn, vn = (torch.randn(2, H, D, generator=g).to("cuda", dtype) for _ in range(2))
        q = torch.randn(2, HQ, D, generator=g).to("cuda", dtype)
        eager.append(kn, vn)
        graphed.append(kn, vn)
        res_e = infllmv2_decode(q, eager, config=cfg, return_lse=True, return_attn_weights=True)
        res_g = infllmv2_decode(q, graphed, config=cfg, return_lse=True, return_attn_weights=True)
        for a, b in zip(res_g, res_e):
            assert torch.equal(a, b)
        kept.append((res_g[0], res_g[0].clone()))
    assert all(torch.equal(a, b) for a, b in kept)
    progs = graphed._prepared.values()          # white box: the prepared steps hold their graphs
    assert len(progs) == 2 and all(p.graph is not None for p in progs)


@pytest.mark.gpu
def test_device_decided_step_in_a_graph_follows_the_lengths():
    """The compiled path's op (`infllm_cupy::infllmv2_decode`, dense or sparse decided on the device):
    captured once while every sequence is below dense_len, then replayed across it; each replay against
    the eager step (host-decided, another split of the same keys) within bf16 rounding, and both within
    FlashAttention's rule of the float64 reference once sparse."""
    lengths, HQ, H, D, dtype = [440, 300, 2], 32, 2, 128, torch.bfloat16
    cfg = dataclasses.replace(CFG, dense_len=450, score_dtype=torch.bfloat16)
    eager = random_decode_cache(lengths, H, D, dtype, page_size=64, device="cuda")
    graphed = random_decode_cache(lengths, H, D, dtype, page_size=64, device="cuda")
    g = torch.Generator().manual_seed(11)
    kn, vn = (torch.zeros(3, H, D, device="cuda", dtype=dtype) for _ in range(2))
    q = torch.zeros(3, HQ, D, device="cuda", dtype=dtype)
    spec = step_spec(cfg, select="stage1", device_dense=True).encode()

    def step(cache):
        cache.append(kn, vn)
        return torch.ops.infllm_cupy.infllmv2_decode(q, cache.k, cache.v, cache.ck1, cache.ck2, cache.seqlens,
                                                     cache.block_table, None, spec)[0]

    warm = random_decode_cache(lengths, H, D, dtype, page_size=64, device="cuda")
    step(warm)                                       # kernels loaded, prepared launches built
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_g = step(graphed)
    paths = set()
    for _i in range(20):                              # the longest: 441 -> 460, dense_len 450
        for t in (kn, vn, q):
            t.copy_(torch.randn(t.shape, generator=g).to(dtype))
        graph.replay()
        eager.append(kn, vn)
        out_e, idx = infllmv2_decode(q, eager, config=cfg, return_topk_idx=True)
        paths.add(idx is None)
        torch.testing.assert_close(out_g.float(), out_e.float(), atol=2e-2, rtol=2e-2)
        if idx is not None:
            as64 = (eager.k.double(), eager.v.double(), eager.seqlens, eager.block_table)
            ref = naive_sparse_decode(q.double(), as64, idx)
            lowp = naive_sparse_decode(q, eager, idx, upcast=False)
            assert_close_to_ref("replayed, sparse", out_g, ref, lowp)
    assert paths == {True, False}
    assert graphed.sync_lengths() == eager.lengths()


@pytest.mark.gpu
def test_eager_step_program_rechecks_what_changes():
    """The eager fast path: one prepared program per (q shape, config, outputs, path), reused; bad q
    still raises naming the argument before any launch; outputs are fresh per call."""
    lengths, HQ, H, D, dtype = [700, 90], 16, 2, 64, torch.float16
    cache = random_decode_cache(lengths, H, D, dtype, device="cuda")
    q = torch.randn(2, HQ, D, device="cuda", dtype=dtype)
    out1 = infllmv2_decode(q, cache, config=CFG)
    keep = out1.clone()
    n = n_plans()
    out2 = infllmv2_decode(torch.randn_like(q), cache, config=CFG)
    assert n_plans() == n and out1.data_ptr() != out2.data_ptr() and torch.equal(out1, keep)
    assert torch.equal(infllmv2_decode(q, cache, config=CFG), keep)
    with pytest.raises(TypeError, match="q must have dtype"):
        infllmv2_decode(q.to(torch.bfloat16), cache, config=CFG)
    with pytest.raises(ValueError, match="q has 3 sequences"):
        infllmv2_decode(torch.randn(3, HQ, D, device="cuda", dtype=dtype), cache, config=CFG)
    with pytest.raises(ValueError, match="head dim"):
        infllmv2_decode(torch.randn(2, HQ, 32, device="cuda", dtype=dtype), cache, config=CFG)
    # a q off 16-byte alignment runs on an aligned copy (q is B x HQ x D: a small copy)
    odd = torch.randn(2 * HQ * D + 1, device="cuda", dtype=dtype)[1:].view(2, HQ, D)
    assert odd.data_ptr() % 16
    aligned = infllmv2_decode(odd.clone(), cache, config=CFG)
    assert torch.equal(infllmv2_decode(odd, cache, config=CFG), aligned)
    with pytest.raises(TypeError, match="return_lse"):
        infllmv2_decode(q, cache, config=CFG, return_lse=1)
    assert torch.equal(infllmv2_decode(q.transpose(0, 1).contiguous().transpose(0, 1), cache, config=CFG),
                       keep)


# ------------------------------------------------------------------------------------------------
# The whole-step reference (naive_infllmv2_decode) on a packed cache: the oracle of infllmv2_decode.

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
    n1 = n_windows(L, 32, 16)
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
    out, aux = naive_infllmv2_decode(q[last_rows(lengths)], k, v, make_cu(lengths), config=SPARSE,
                                     return_aux=True)
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
    out = naive_infllmv2_decode(qd, k, v, cu, config=SPARSE, ck1=ck1, cu_seqlens_c1=cu1, ck2=ck2,
                                cu_seqlens_c2=cu2)
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


def _count_body_calls(monkeypatch) -> list:
    """Records `(spec.select, kernels)` of every call of the step's body (`run_step`)."""
    from infllm_cupy.decode import step as step_module

    seen, body = [], step_module.run_step

    def counted(*args, kernels, **kw):
        seen.append((args[8].select, kernels))
        return body(*args, kernels=kernels, **kw)

    monkeypatch.setattr(step_module, "run_step", counted)
    return seen


def _three_entries(q, cache, cfg):
    """The decode entries, each called once: the whole step, attention over its selection, the op."""
    out, idx = infllmv2_decode(q, cache, config=cfg, return_topk_idx=True)
    att = sparse_decode(q, cache, idx)
    spec = step_spec(cfg, select="stage1", device_dense=True).encode()
    (op,) = infllmv2_decode_op(q, cache.k, cache.v, cache.ck1, cache.ck2, cache.seqlens, cache.block_table,
                               None, spec)
    return out, att, op


def test_the_three_decode_entries_run_one_body(monkeypatch):
    # infllmv2_decode, sparse_decode and the op each reach run_step once per call, on the references here
    seen = _count_body_calls(monkeypatch)
    cache = random_decode_cache([300, 1000], 2, 32, torch.float32, page_size=64)
    q = torch.randn(2, 8, 32)
    out, att, op = _three_entries(q, cache, CFG)
    assert seen == [("stage1", False), ("given", False), ("stage1", False)], seen
    assert torch.equal(out, att) and torch.equal(out, op)


@pytest.mark.gpu
def test_kernel_three_decode_entries_run_one_body_and_reuse_its_plans(monkeypatch):
    # on CUDA tensors the same body runs the kernels for each entry; a second round of calls builds no
    # new prepared step (each entry's plan is reused)
    seen = _count_body_calls(monkeypatch)
    cache = random_decode_cache([300, 1000, 65], 2, 128, torch.bfloat16, page_size=64, device="cuda")
    q = torch.randn(3, 16, 128, device="cuda", dtype=torch.bfloat16)
    first = _three_entries(q, cache, CFG)
    n = n_plans()
    second = _three_entries(q, cache, CFG)
    assert n_plans() == n
    assert seen == [("stage1", True), ("given", True), ("stage1", True)] * 2, seen
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    assert torch.equal(first[0], first[1]) and torch.equal(first[0], first[2])


@pytest.mark.gpu
def test_kernel_compiled_step_honours_the_reference_backend(monkeypatch):
    # under torch.compile on CUDA tensors, backend="reference" runs the references (the op honours the
    # spec's backend), and "auto" the kernels
    seen = _count_body_calls(monkeypatch)
    torch._dynamo.reset()
    cache = random_decode_cache([300, 90], 2, 64, torch.float16, device="cuda")
    q = torch.randn(2, 8, 64, device="cuda", dtype=torch.float16)
    for backend, kernels in (("reference", False), ("auto", True)):
        seen.clear()
        f = torch.compile(lambda q, b=backend: infllmv2_decode(q, cache, config=CFG, backend=b),
                          fullgraph=True, backend="eager")
        f(q)
        assert seen and all(k == kernels for _, k in seen), (backend, seen)
