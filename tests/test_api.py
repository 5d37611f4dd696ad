"""The package root: every op is exported next to its reference with the same call signature, and
the block-layout reference agrees with the op's CPU path."""
import inspect

import pytest
import torch

import infllm_cupy
from infllm_cupy import BlockLayout, block_sparse_attn_varlen, naive_block_sparse_attn_varlen
from infllm_cupy.testing import cu_seqlens_from_lengths

OPS = ["compress_k", "stage1_select", "sparse_attn_varlen", "block_sparse_attn_varlen", "infllmv2_attention",
       "sparse_decode"]
# Keyword-only knobs that only a reference has: other key-block sizes than the kernels' 64, and the
# low-precision twin used for tolerances.
REFERENCE_ONLY = {"block_size", "upcast"}


def _params(fn, kind):
    return [p.name for p in inspect.signature(fn).parameters.values() if p.kind == kind]


def test_all_names_resolve():
    missing = [n for n in infllm_cupy.__all__ if not hasattr(infllm_cupy, n)]
    assert not missing
    assert len(set(infllm_cupy.__all__)) == len(infllm_cupy.__all__)


def test_the_top_level_is_infllm_v2():
    """The top level holds InfLLM-v2 (config, attention and its module, the stages, the decode step and
    its attention, the cache) and their references; the pattern zoo is `infllm_cupy.patterns`', the
    cache's helpers (chunked prefill, H2O, the custom ops) `infllm_cupy.decode`'s."""
    import infllm_cupy.decode
    import infllm_cupy.patterns

    public = set(infllm_cupy.__all__) - {"__version__"}
    assert not public & set(infllm_cupy.patterns.__all__), public & set(infllm_cupy.patterns.__all__)
    decode_like = {n for n in public if "decode" in n.lower() and not n.startswith("naive_")}
    assert decode_like == {"infllmv2_decode", "sparse_decode", "DecodeCache"}, decode_like
    for name in public - {"BlockLayout", "DecodeCache", "InfLLMv2Config", "InfLLMv2Attention"}:
        assert name.startswith("naive_") or f"naive_{name}" in public or name == "naive_dense_attn_varlen" \
            or name in {"InfLLMv2Attention"}, f"{name} has no reference at the top level"
    assert {"H2O", "infllmv2_prefill_into_cache"} <= set(infllm_cupy.decode.__all__)
    # two public entries run the decode step's body: the whole step and attention over a selection (the
    # custom op infllm_cupy::infllmv2_decode is what they become under torch.compile)
    runs_step = {n for n in infllm_cupy.decode.__all__
                 if n.endswith("decode") and not n.startswith(("naive_", "plan_"))}
    assert runs_step == {"infllmv2_decode", "sparse_decode"}, runs_step


@pytest.mark.parametrize("op", OPS)
def test_op_exported_with_its_reference(op):
    assert op in infllm_cupy.__all__ and f"naive_{op}" in infllm_cupy.__all__
    fn, ref = getattr(infllm_cupy, op), getattr(infllm_cupy, f"naive_{op}")
    positional = inspect.Parameter.POSITIONAL_OR_KEYWORD
    ours, theirs = _params(fn, positional), _params(ref, positional)
    assert ours == theirs[:len(ours)], (ours, theirs)
    accepted = set(inspect.signature(fn).parameters) | REFERENCE_ONLY
    assert set(inspect.signature(ref).parameters) <= accepted


def test_block_layout_reference_matches_the_op():
    lq = [130, 64]
    cu = cu_seqlens_from_lengths(lq)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(194, h, 64, generator=g) for h in (4, 2, 2))
    layout = BlockLayout(torch.rand(2, 2, 3, generator=g) < 0.5, q_block=128)
    ref, ref_lse = naive_block_sparse_attn_varlen(q, k, v, cu, cu, layout, 130, 130, return_lse=True)
    out, lse = block_sparse_attn_varlen(q, k, v, cu, cu, layout, 130, 130, return_lse=True,
                                        backend="reference")
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    assert out.abs().sum() > 0
    # backend "auto" on CPU tensors: the CPU implementation, within fp32 rounding of the reference
    out, lse = block_sparse_attn_varlen(q, k, v, cu, cu, layout, 130, 130, return_lse=True)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


def test_block_layout_reference_rejects_bad_layouts():
    cu = cu_seqlens_from_lengths([130, 64])
    q, k = torch.randn(194, 4, 64), torch.randn(194, 2, 64)
    with pytest.raises(TypeError, match="layout must be a BlockLayout"):
        naive_block_sparse_attn_varlen(q, k, k, cu, cu, torch.ones(2, 3, 3, dtype=torch.bool), 130, 130)
    three_heads = BlockLayout(torch.ones(3, 3, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="layout has 3 KV heads but k has 2"):
        naive_block_sparse_attn_varlen(q, k, k, cu, cu, three_heads, 130, 130)


# ---------------------------------------------------------------------------------------------------------
# Flags are keyword-only and booleans are booleans (the public API's rules)

# Parameters that change what a call computes or returns without being data: passed positionally,
# a value meant for another parameter (`naive_dense_attn_varlen(q, k, v, cu, cu, 724, 724)`) would be
# taken as one of these.
FLAGS = {"causal", "softmax_scale", "return_lse", "return_scores", "return_aux", "return_attn_weights",
         "backend", "kernel", "stage1", "score_dtype", "topk", "local_blocks", "init_blocks", "upcast",
         "weights", "plan", "varlen_offset_quirk", "exact_stage1", "dense_len", "cache_lens", "dtype",
         "device"}
PUBLIC_MODULES = ["infllm_cupy", "infllm_cupy.compress", "infllm_cupy.stage1", "infllm_cupy.stage2",
                  "infllm_cupy.decode", "infllm_cupy.patterns"]


def _public_callables():
    """(qualified name, callable) of every exported function, class constructor and public method."""
    import importlib

    seen = {}
    for mod_name in PUBLIC_MODULES:
        mod = importlib.import_module(mod_name)
        for name in mod.__all__:
            obj = getattr(mod, name)
            if inspect.isfunction(obj):
                seen.setdefault(f"{mod_name}.{name}", obj)
            elif inspect.isclass(obj):
                seen.setdefault(f"{mod_name}.{name}", obj)
                for meth, fn in vars(obj).items():
                    if meth.startswith("_") or isinstance(fn, property):
                        continue
                    fn = fn.__func__ if isinstance(fn, (classmethod, staticmethod)) else fn
                    if inspect.isfunction(fn):
                        seen.setdefault(f"{mod_name}.{name}.{meth}", fn)
    return sorted(seen.items())


def _is_flag(p: inspect.Parameter) -> bool:
    return p.default is not inspect.Parameter.empty and (p.name in FLAGS or isinstance(p.default, bool)
                                                        or p.annotation in (bool, "bool"))


def test_every_public_flag_is_keyword_only():
    callables = _public_callables()
    assert len(callables) > 20, [n for n, _ in callables]
    bad = [f"{name}({p.name}=...)" for name, fn in callables
           for p in inspect.signature(fn).parameters.values()
           if _is_flag(p) and p.kind is not inspect.Parameter.KEYWORD_ONLY]
    assert not bad, f"flags that can be passed positionally: {bad}"


ATTN_PAIRS = [("sparse_attn_varlen", "naive_sparse_attn_varlen"),
              ("block_sparse_attn_varlen", "naive_block_sparse_attn_varlen"),
              ("sparse_attn_varlen", "naive_dense_attn_varlen"),
              ("infllmv2_attention", "naive_infllmv2_attention")]


@pytest.mark.parametrize("a,b", ATTN_PAIRS)
def test_attention_entry_points_share_the_positional_order(a, b):
    """q, k, v, cu_seqlens_q, cu_seqlens_k, [selection], max_seqlen_q, max_seqlen_k in that order."""
    pos = (inspect.Parameter.POSITIONAL_OR_KEYWORD,)
    pa = [n for n in _params(getattr(infllm_cupy, a), *pos) if n not in ("topk_idx", "layout")]
    pb = [n for n in _params(getattr(infllm_cupy, b), *pos) if n not in ("topk_idx", "layout")]
    common = ["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"]
    assert pa[:7] == common and pb[:7] == common, (pa, pb)


def _dense_inputs():
    cu = cu_seqlens_from_lengths([724])
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(724, h, 64, generator=g) for h in (4, 2, 2))
    return q, k, v, cu


def test_dense_reference_takes_max_lengths_where_the_ops_do():
    from infllm_cupy import naive_dense_attn_varlen

    q, k, v, cu = _dense_inputs()
    out = naive_dense_attn_varlen(q, k, v, cu, cu, 724, 724)
    assert torch.equal(out, naive_dense_attn_varlen(q, k, v, cu, cu))                   # causal, 1/sqrt(D)
    assert not torch.equal(out, naive_dense_attn_varlen(q, k, v, cu, cu, causal=False))
    with pytest.raises(ValueError, match="max_seqlen_q must be >= the longest sequence"):
        naive_dense_attn_varlen(q, k, v, cu, cu, 700, 724)
    with pytest.raises(TypeError, match="max_seqlen_q must be an int"):
        naive_dense_attn_varlen(q, k, v, cu, cu, True)                    # the old positional causal
    with pytest.raises(TypeError, match="positional"):
        naive_dense_attn_varlen(q, k, v, cu, cu, 724, 724, True)


def _bool_cases():
    """(entry point, call taking a bad flag value) for every public entry point with a boolean flag."""
    from infllm_cupy import (
        DecodeCache,
        naive_dense_attn_varlen,
        naive_infllmv2_attention,
        naive_infllmv2_decode,
        naive_sparse_attn_varlen,
        naive_sparse_decode,
        naive_stage1_select,
        sparse_attn_varlen,
        sparse_decode,
        stage1_select,
    )
    from infllm_cupy.prefill import sdpa_dense_attn_varlen
    from infllm_cupy.stage1 import naive_stage1_scores, q_block_idx_prefill

    q, k, v, cu = _dense_inputs()
    idx = torch.zeros(2, 724, 1, dtype=torch.int32)
    layout = BlockLayout(torch.ones(2, 12, 12, dtype=torch.bool))
    ck, cuc = infllm_cupy.naive_compress_k(k, cu)
    cache = DecodeCache.contiguous(1, 64, 2, 64, dtype=torch.float32)
    cache.append(torch.randn(5, 2, 64), torch.randn(5, 2, 64), cu_seqlens_from_lengths([5]))
    q1 = torch.randn(1, 4, 64)
    return [
        ("causal", lambda x: sparse_attn_varlen(q, k, v, cu, cu, idx, 724, 724, causal=x)),
        ("causal", lambda x: naive_sparse_attn_varlen(q, k, v, cu, cu, idx, 724, 724, causal=x)),
        ("causal", lambda x: block_sparse_attn_varlen(q, k, v, cu, cu, layout, 724, 724, causal=x)),
        ("causal", lambda x: naive_block_sparse_attn_varlen(q, k, v, cu, cu, layout, 724, 724, causal=x)),
        ("causal", lambda x: naive_dense_attn_varlen(q, k, v, cu, cu, causal=x)),
        ("causal", lambda x: sdpa_dense_attn_varlen(q, k, v, cu, cu, causal=x)),
        ("return_lse", lambda x: sparse_attn_varlen(q, k, v, cu, cu, idx, 724, 724, return_lse=x)),
        ("causal", lambda x: stage1_select(q, ck, ck, cu, cuc, cuc, 724, causal=x)),
        ("causal", lambda x: naive_stage1_select(q, ck, ck, cu, cuc, cuc, 724, causal=x)),
        ("return_scores", lambda x: naive_stage1_select(q, ck, ck, cu, cuc, cuc, 724, return_scores=x)),
        ("varlen_offset_quirk", lambda x: stage1_select(q, ck, ck, cu, cuc, cuc, 724, varlen_offset_quirk=x)),
        ("causal", lambda x: naive_stage1_scores(q, ck, ck, cu, cuc, cuc, 724, causal=x)),
        ("varlen_offset_quirk", lambda x: q_block_idx_prefill(cu, 724, varlen_offset_quirk=x)),
        ("return_aux", lambda x: infllmv2_attention_(q, k, v, cu, return_aux=x)),
        ("return_aux", lambda x: naive_infllmv2_attention(q, k, v, cu, cu, 724, 724, return_aux=x)),
        ("exact_stage1", lambda x: infllm_cupy.InfLLMv2Config(exact_stage1=x)),
        ("varlen_offset_quirk", lambda x: infllm_cupy.InfLLMv2Config(varlen_offset_quirk=x)),
        ("return_lse", lambda x: sparse_decode(q1, cache, return_lse=x)),
        ("return_attn_weights", lambda x: naive_sparse_decode(q1, cache, return_attn_weights=x)),
        ("return_aux", lambda x: naive_infllmv2_decode(q1, *cache.packed(), return_aux=x)),
        ("return_lse", lambda x: infllm_cupy.infllmv2_decode(q1, cache, return_lse=x)),
        ("return_attn_weights", lambda x: infllm_cupy.infllmv2_decode(q1, cache, return_attn_weights=x)),
        ("return_topk_idx", lambda x: infllm_cupy.infllmv2_decode(q1, cache, return_topk_idx=x)),
        ("return_aux", lambda x: infllm_cupy.decode.infllmv2_prefill_into_cache(
            q1, torch.randn(1, 2, 64), torch.randn(1, 2, 64), cache, cu_seqlens_from_lengths([1]),
            return_aux=x)),
    ]


def infllmv2_attention_(*args, **kwargs):
    return infllm_cupy.infllmv2_attention(*args, **kwargs)


N_BOOL_CASES = 24


@pytest.mark.parametrize("i", range(N_BOOL_CASES))
def test_flags_must_be_bools(i):
    cases = _bool_cases()
    assert len(cases) == N_BOOL_CASES
    name, call = cases[i]
    for bad in ("no", 1, None, 724):
        with pytest.raises(TypeError, match=f"{name} must be a bool"):
            call(bad)


def test_decode_names_what_the_user_passed():
    """naive_infllmv2_decode builds cu_seqlens_q itself: a batch mismatch names q and cu_seqlens_k."""
    from infllm_cupy import naive_infllmv2_decode, naive_sparse_decode

    cu_k = cu_seqlens_from_lengths([40, 30])
    k = torch.randn(70, 2, 64)
    with pytest.raises(ValueError, match="q has 3 rows but cu_seqlens_k has 2 sequences") as err:
        naive_infllmv2_decode(torch.randn(3, 4, 64), k, k, cu_k)
    assert "cu_seqlens_q" not in str(err.value)
    ck, cuc = infllm_cupy.naive_compress_k(k, cu_k)
    with pytest.raises(ValueError, match="cu_seqlens_c1 has 1 sequences but cu_seqlens_k has 2"):
        naive_infllmv2_decode(torch.randn(2, 4, 64), k, k, cu_k, ck1=ck[:1], cu_seqlens_c1=cuc[:2].clone(),
                              ck2=ck, cu_seqlens_c2=cuc)
    cache = (torch.randn(2, 64, 2, 64), torch.randn(2, 64, 2, 64), torch.tensor([5, 9], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"q has 3 rows .* the cache holds 2 sequences"):
        naive_sparse_decode(torch.randn(3, 4, 64), cache)


def test_prefill_without_cu_seqlens_k_names_k_and_q():
    cu = cu_seqlens_from_lengths([100])
    q, k = torch.randn(100, 4, 64), torch.randn(120, 2, 64)
    with pytest.raises(ValueError, match="k has 120 rows but q has 100") as err:
        infllm_cupy.infllmv2_attention(q, k, k, cu)
    assert "cu_seqlens_k" not in str(err.value).split(":")[0]
