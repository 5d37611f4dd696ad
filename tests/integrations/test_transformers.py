"""The transformers backend (`attn_implementation="infllm_cupy"`, `InfLLMv2Cache`) and the MiniCPM4-style
layer on the compat API, in small Llama models built in code (random weights, nothing downloaded).

CPU tests run the references in fp32: the dense regime gives eager attention's greedy tokens; in the sparse
regime the backend (our pipeline ops) and the MiniCPM4-style layer (the `infllm_v2` API, as MiniCPM4's HF
file calls it) agree, through prefill, decode and the first crossing of `dense_len`. GPU tests run the kernels
in bf16 against the fp32 references by FlashAttention's rule.
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: E402

from infllm_cupy import DecodeCache, naive_compress_k  # noqa: E402
from infllm_cupy.integrations import transformers as hf  # noqa: E402
from infllm_cupy.integrations.minicpm4 import MiniCPM4SparseAttention, use_minicpm4_attention  # noqa: E402
from infllm_cupy.testing import rel_l2_err  # noqa: E402

# Sparse regime reached at a few hundred tokens: K = topk + window_size / block_size = 4 + 2 = 6 of 10 blocks.
SPARSE = dict(dense_len=256, topk=4, window_size=128)
PROMPT = 640
VOCAB = 128


@pytest.fixture(autouse=True)
def _quiet():
    # transformers 5.2x deprecates generate's `past_key_values` for `cache`; 5.17 knows only the former
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        yield


def small_config(sparse_config=None, **kw) -> LlamaConfig:
    """The issue's config: 2 layers, hidden 256, HQ 16, H 2 (head dim 64, a kernel size)."""
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=16, num_key_value_heads=2, head_dim=64,
                      max_position_embeddings=4096, initializer_range=0.1, **kw)
    if sparse_config is not None:
        cfg.sparse_config = dict(sparse_config)
    return cfg


def model_for(cfg, impl=hf.ATTN_NAME, *, seed=0, dtype=torch.float32, device="cpu"):
    hf.register()
    torch.manual_seed(seed)
    m = LlamaForCausalLM(cfg).eval().to(device=device, dtype=dtype)
    m.set_attn_implementation(impl)
    return m


def prompt(B, T, *, seed=1, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (B, T), generator=g).to(device)


def generate(model, ids, n, cache=None):
    kw = {} if cache is None else {"past_key_values": cache}
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                         output_logits=True, return_dict_in_generate=True, pad_token_id=0, **kw)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits)


def step_logits(model, ids, n_prompt, cache):
    """Logits of a prefill of `ids[:, :n_prompt]` then one decode step per remaining token (teacher forcing):
    the same tokens for every model, so logits compare even where greedy tokens would diverge."""
    with torch.no_grad():
        out = [model(ids[:, :n_prompt], past_key_values=cache, use_cache=True).logits[:, -1]]
        for t in range(n_prompt, ids.shape[1]):
            out.append(model(ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits[:, -1])
    return torch.stack(out)


# ------------------------------------------------------------------------------------------- CPU
def test_dense_regime_greedy_tokens_equal_eager():
    cfg = small_config()                                    # dense_len 8192: every call dense
    ids = prompt(2, 48)
    m = model_for(cfg)
    toks, logits = generate(m, ids, 6)
    toks_c, logits_c = generate(m, ids, 6, hf.InfLLMv2Cache(cfg, max_cache_len=64))
    m.set_attn_implementation("eager")
    ref_toks, ref_logits = generate(m, ids, 6)
    assert torch.equal(toks, ref_toks) and torch.equal(toks_c, ref_toks)
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits_c, ref_logits, atol=1e-4, rtol=1e-4)
    assert len(set(ref_toks.flatten().tolist())) > 2, "degenerate model: the comparison says little"


@pytest.mark.parametrize("route", ["fused", "compat"])
@pytest.mark.parametrize("kv_heads", [2, 1])
def test_sparse_prefill_equals_minicpm4_layer_and_differs_from_dense(kv_heads, route):
    cfg = small_config(SPARSE)
    cfg.num_key_value_heads = kv_heads
    ids = prompt(2, PROMPT)
    m = model_for(cfg)
    mc = use_minicpm4_attention(copy.deepcopy(m), route=route)
    assert all(isinstance(layer.self_attn, MiniCPM4SparseAttention) for layer in mc.model.layers)
    with torch.no_grad():
        ours, theirs = m(ids).logits, mc(ids).logits
        m.set_attn_implementation("eager")
        dense = m(ids).logits
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    # below dense_len both are dense; past it the selection drops blocks and the logits move
    torch.testing.assert_close(ours[:, :255], dense[:, :255], atol=1e-4, rtol=1e-4)
    assert (ours[:, 400:] - dense[:, 400:]).abs().max() > 0.1, "sparse regime not reached"


def test_precision_int8_fp8_backend_runs_the_8bit_plan():
    """`register(precision="int8-fp8")`: the sparse prefill's stage 2 on the 8-bit plan (its reference on
    CPU tensors), not equal to the 16-bit backend and closer to it than the model run in bf16; below
    dense_len both are the 16-bit dense path."""
    cfg = small_config(SPARSE)
    ids = prompt(1, PROMPT)
    m = model_for(cfg)
    with pytest.raises(ValueError, match=r"^precision must be one of"):
        hf.register("infllm_cupy_q8", precision="int8")
    assert hf.register("infllm_cupy_q8", precision="int8-fp8") == "infllm_cupy_q8"
    short = ids[:, :200]                                      # below dense_len: the 16-bit dense path
    with torch.no_grad():
        ours, ours_short = m(ids).logits, m(short).logits
        m.set_attn_implementation("infllm_cupy_q8")
        q8, q8_short = m(ids).logits, m(short).logits
    assert torch.equal(q8_short, ours_short)
    assert not torch.equal(q8, ours), "the 8-bit plan did not run"
    # the yardstick: the same model in bf16 (16-bit backend) against fp32; the 8-bit plan moves the
    # logits less than that (0.086 against 0.135 when written)
    with torch.no_grad():
        bf16 = model_for(cfg, dtype=torch.bfloat16)(ids).logits.float()
    assert rel_l2_err(q8, ours) < rel_l2_err(bf16, ours)


def test_sparse_path_selecting_every_block_equals_eager():
    """An independent oracle of the sparse plumbing (packing, GQA, cache offsets): with K >= the number of
    blocks the selection keeps every block and the result is dense causal attention."""
    cfg = small_config(dict(dense_len=256, topk=16, window_size=128))     # K = 18 >= 12 blocks
    ids = prompt(1, 700)
    m = model_for(cfg)
    with torch.no_grad():
        ours = step_logits(m, ids, 690, hf.InfLLMv2Cache(cfg, max_cache_len=700))
        m.set_attn_implementation("eager")
        ref = step_logits(m, ids, 690, DynamicCache())
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("route", ["fused", "compat"])
@pytest.mark.parametrize("n_prompt,dense_len", [(PROMPT, 256), (636, 640)])   # 636: decode crosses dense_len
def test_sparse_decode_caches_and_minicpm4_layer_agree(n_prompt, dense_len, route):
    cfg = small_config(dict(SPARSE, dense_len=dense_len))
    ids = prompt(2, n_prompt)
    m = model_for(cfg)
    mc = use_minicpm4_attention(copy.deepcopy(m), route=route)
    n = 10
    toks, logits = generate(m, ids, n, hf.InfLLMv2Cache(cfg, max_cache_len=n_prompt + n))
    toks_d, logits_d = generate(m, ids, n)                                  # DynamicCache
    toks_m, logits_m = generate(mc, ids, n)
    toks_mi, logits_mi = generate(mc, ids, n, hf.InfLLMv2Cache(cfg, max_cache_len=n_prompt + n))
    assert torch.equal(toks, toks_m) and torch.equal(toks_d, toks_m) and torch.equal(toks, toks_mi)
    torch.testing.assert_close(logits, logits_m, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits_d, logits_m, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits, logits_mi, atol=1e-4, rtol=1e-4)
    m.set_attn_implementation("eager")
    _, logits_e = generate(m, torch.cat([ids, toks], 1)[:, :n_prompt], n)
    assert (logits_e - logits).abs().max() > 1e-2, "decode never left the dense regime"


def test_cache_keeps_keys_and_compressed_keys():
    cfg = small_config(SPARSE)
    ids = prompt(2, 300)
    m = model_for(cfg)
    cache = hf.InfLLMv2Cache(cfg, max_cache_len=320)
    generate(m, ids, 7, cache)
    assert cache.get_seq_length() == 306               # the last generated token is never fed back
    for layer, dc in zip(cache.layers, cache.decode_caches()):
        assert isinstance(dc, DecodeCache) and dc.lengths() == [306, 306]
        k, _v, cu = dc.packed()
        assert layer.keys.shape == (2, 2, 320, 64)     # static: the whole storage, as StaticLayer's
        assert torch.equal(layer.keys[:, :, :306].transpose(1, 2).reshape(-1, 2, 64), k)
        ck1, _ = naive_compress_k(k, cu, 32, 16)
        ck2, _ = naive_compress_k(k, cu, 128, 64)
        got1, _, got2, _ = dc.packed_compressed()
        assert torch.equal(got1, ck1) and torch.equal(got2, ck2)
    cache.crop(-6)
    assert cache.get_seq_length() == 300 and cache.decode_caches()[0].lengths() == [300, 300]


def test_prefill_reuses_cache_compressed_keys_and_reads_no_lengths(monkeypatch):
    """Prefill into an InfLLMv2Cache: the pipeline takes the keys the cache compressed at `update` instead of
    compressing them again, and reads no cu_seqlens back to the host (the integration knows the lengths);
    the logits equal, bit for bit, those of a DynamicCache (where the pipeline compresses)."""
    from infllm_cupy import pipeline
    from infllm_cupy import prefill as prefill_module

    cfg = small_config(SPARSE)
    ids = prompt(2, PROMPT)
    m = model_for(cfg)
    calls = []
    compress = prefill_module.cpu_compress_k         # CPU tensors under "auto": compression's CPU path
    monkeypatch.setattr(prefill_module, "cpu_compress_k",
                        lambda *a, **kw: calls.append(a[2:4]) or compress(*a, **kw))

    def no_host_read(*args, **kwargs):
        raise AssertionError("the integration's prefill read cu_seqlens back to the host")

    monkeypatch.setattr(pipeline, "check_prefill_inputs", no_host_read)      # the lengths' read
    with torch.no_grad():
        ours = m(ids, past_key_values=hf.InfLLMv2Cache(cfg, max_cache_len=PROMPT), use_cache=True).logits
        assert calls == [], "the pipeline compressed keys the InfLLMv2Cache had compressed already"
        dyn = m(ids, past_key_values=DynamicCache(), use_cache=True).logits
    assert calls == [(32, 16), (128, 64)] * cfg.num_hidden_layers      # DynamicCache: the pipeline compresses
    assert torch.equal(ours, dyn)


def test_host_lengths_entry_equals_infllmv2_attention():
    """`infllmv2_attention_host_lengths` (the integration's entry: host lengths, optional compressed keys)
    gives `infllmv2_attention`'s output on a ragged chunked-prefill batch, and names bad arguments."""
    from infllm_cupy import InfLLMv2Config, infllmv2_attention
    from infllm_cupy.pipeline import infllmv2_attention_host_lengths

    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    lq, lk = [130, 257], [300, 257]
    HQ, H, D = 4, 2, 32
    q = torch.randn(sum(lq), HQ, D, generator=g)
    k, v = (torch.randn(sum(lk), H, D, generator=g) for _ in range(2))
    cu_q = torch.tensor([0, lq[0], sum(lq)], dtype=torch.int32)
    cu_k = torch.tensor([0, lk[0], sum(lk)], dtype=torch.int32)
    cfg = InfLLMv2Config(dense_len=0, topk=3, local_blocks=1, score_dtype=torch.float32)
    ref = infllmv2_attention(q, k, v, cu_q, cu_k, config=cfg)
    ck1, cu1 = naive_compress_k(k, cu_k, 32, 16)
    ck2, cu2 = naive_compress_k(k, cu_k, 128, 64)
    assert torch.equal(infllmv2_attention_host_lengths(q, k, v, cu_q, cu_k, lq, lk, cfg), ref)
    assert torch.equal(infllmv2_attention_host_lengths(q, k, v, cu_q, cu_k, lq, lk, cfg,
                                                       compressed=(ck1, cu1, ck2, cu2)), ref)
    with pytest.raises(ValueError, match="seqlens_q"):
        infllmv2_attention_host_lengths(q, k, v, cu_q, cu_k, [130, 256], lk, cfg)
    with pytest.raises(ValueError, match="seqlens_k"):
        infllmv2_attention_host_lengths(q, k, v, cu_q, cu_k, lq, [300.0, 257], cfg)
    with pytest.raises(ValueError, match="compressed"):
        infllmv2_attention_host_lengths(q, k, v, cu_q, cu_k, lq, lk, cfg, compressed=(ck1, cu1))
    with pytest.raises(ValueError, match="ck2"):
        infllmv2_attention_host_lengths(q, k, v, cu_q, cu_k, lq, lk, cfg,
                                        compressed=(ck1, cu1, ck2[:, :1], cu2))


@pytest.mark.parametrize("B,L0", [(1, 0), (3, 200)])
def test_decode_cache_eager_one_token_append_equals_vectorized(B, L0):
    """InfLLMv2Cache's decode step appends one token: the eager path of a contiguous cache with equal host
    lengths (slices, a window mean only when one completes) writes what the capturable vectorized path
    writes, bit for bit, across ck1 and ck2 window boundaries; a stale host mirror takes the vectorized
    path."""
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    H, D, n = 2, 16, 140
    caches = [DecodeCache.contiguous(B, L0 + n, H, D, dtype=torch.bfloat16) for _ in range(2)]
    if L0:
        k0, v0 = (torch.randn(B * L0, H, D, generator=g).to(torch.bfloat16) for _ in range(2))
        for c in caches:
            c.append(k0, v0, [b * L0 for b in range(B + 1)])
    taken = []
    fast, vec = caches
    vec._append_one_at = lambda *a: taken.append("fast")        # must not be taken while the mirror is stale
    fast._append_one = lambda *a: taken.append("vectorized")     # must not be taken with an exact mirror
    vec._host_stale = True
    for _ in range(n):
        k, v = (torch.randn(B, H, D, generator=g).to(torch.bfloat16) for _ in range(2))
        fast.append(k, v)
        vec.append(k, v)
    assert taken == [] and fast.lengths() == [L0 + n] * B and vec.sync_lengths() == [L0 + n] * B
    for name in ("k", "v", "ck1", "ck2", "seqlens"):
        assert torch.equal(getattr(fast, name), getattr(vec, name)), name
    ck1, _, ck2, _ = fast.packed_compressed()
    k_all, _, cu = fast.packed()
    assert torch.equal(ck1, naive_compress_k(k_all, cu, 32, 16)[0])
    assert torch.equal(ck2, naive_compress_k(k_all, cu, 128, 64)[0])


def test_sparse_config_maps_minicpm4_keys():
    cfg = hf.config_from_sparse_config({"kernel_size": 32, "kernel_stride": 16, "init_blocks": 1,
                                        "block_size": 64,
                                        "window_size": 2048, "topk": 64, "use_nope": False,
                                        "dense_len": 8192},
                                       softmax_scale=0.125)
    assert (cfg.topk, cfg.local_blocks, cfg.init_blocks, cfg.dense_len) == (64, 32, 1, 8192)
    assert (cfg.coarse_kernel_size, cfg.coarse_kernel_stride, cfg.softmax_scale) == (128, 64, 0.125)
    assert hf.config_from_sparse_config(None) == hf.InfLLMv2Config()


# ------------------------------------------------------------------------------------ bad inputs
def test_padded_batch_raises_naming_attention_mask():
    m = model_for(small_config())
    ids = prompt(2, 16)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0                                                        # left padding
    with pytest.raises(NotImplementedError, match="attention_mask"):
        m(ids, attention_mask=mask)
    mc = use_minicpm4_attention(copy.deepcopy(m))
    with pytest.raises(NotImplementedError, match="attention_mask"):
        mc(ids, attention_mask=mask)


def test_unsupported_arguments_raise_naming_them():
    hf.register()
    cfg = small_config()
    module = LlamaForCausalLM(cfg).model.layers[0].self_attn
    q, k = torch.randn(1, 16, 4, 64), torch.randn(1, 2, 4, 64)
    with pytest.raises(NotImplementedError, match="dropout"):
        hf.infllm_cupy_attention(module, q, k, k, None, dropout=0.1)
    with pytest.raises(NotImplementedError, match="sliding_window"):
        hf.infllm_cupy_attention(module, q, k, k, None, sliding_window=128)
    with pytest.raises(NotImplementedError, match="cu_seq_lens_q"):
        hf.infllm_cupy_attention(module, q, k, k, None, cu_seq_lens_q=torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="query has 4 tokens but key only 2"):
        hf.infllm_cupy_attention(module, q, k[:, :, :2], k[:, :, :2], None)
    with pytest.raises(NotImplementedError, match="use_nope"):
        hf.config_from_sparse_config({"use_nope": True})
    with pytest.raises(ValueError, match=r"sparse_config: unknown key\(s\) \['topK'\]"):
        hf.config_from_sparse_config({"topK": 4})
    with pytest.raises(ValueError, match="window_size"):
        hf.config_from_sparse_config({"window_size": 100})
    with pytest.raises(ValueError, match="backend"):
        hf.register(backend="cuda")
    with pytest.raises(ValueError, match="max_cache_len"):
        hf.InfLLMv2Cache(cfg, max_cache_len=0)
    with pytest.raises(ValueError, match="config or num_layers"):
        hf.InfLLMv2Cache(max_cache_len=8)


def test_cache_overflow_and_beam_search_raise():
    cfg = small_config()
    m = model_for(cfg)
    ids = prompt(1, 16)
    with pytest.raises(ValueError, match="max_cache_len"):
        generate(m, ids, 8, hf.InfLLMv2Cache(cfg, max_cache_len=20))
    with pytest.raises(NotImplementedError, match="beam search"):
        m.generate(ids, max_new_tokens=2, num_beams=2, do_sample=False, pad_token_id=0,
                   past_key_values=hf.InfLLMv2Cache(cfg, max_cache_len=32))


# ------------------------------------------------------------------------------------------- GPU
def _rule(name, out, ref, lowp, mult=2.0):
    """FlashAttention's rule on relative L2 error of logits: a model's logits move with every block that a
    near-tie in stage-1 scores selects differently, so the max error of a whole model is dominated by the
    odd flipped token; the L2 error is not."""
    assert torch.isfinite(out).all(), f"{name}: non-finite logits"
    err, base = rel_l2_err(out, ref), rel_l2_err(lowp, ref)
    assert err <= mult * base + 1e-5, \
        f"{name}: rel L2 {err:.3e} > {mult} x {base:.3e} (low-precision reference)"


@pytest.mark.gpu
def test_gpu_dense_regime_within_error_rule_of_eager():
    cfg = small_config()
    ids = prompt(2, 200, device="cuda")
    ours = step_logits(model_for(cfg, dtype=torch.bfloat16, device="cuda"), ids, 190,
                       hf.InfLLMv2Cache(cfg, max_cache_len=200))
    ref = step_logits(model_for(cfg, "eager", device="cuda"), ids, 190, DynamicCache())
    lowp = step_logits(model_for(cfg, "eager", dtype=torch.bfloat16, device="cuda"), ids, 190, DynamicCache())
    _rule("dense", ours.float(), ref, lowp.float())


@pytest.mark.gpu
@pytest.mark.parametrize("n_prompt", [PROMPT, 250])
def test_gpu_sparse_kernels_within_error_rule_of_reference(n_prompt):
    """Kernels (bf16) against the reference ops in fp32, the reference ops in bf16 as the low-precision
    baseline, through prefill and 10 decode steps; also the MiniCPM4-style layer on the compat API."""
    ref_name = hf.register("infllm_cupy_reference", backend="reference")
    cfg = small_config(SPARSE)
    ids = prompt(2, n_prompt + 10, device="cuda")

    def run(impl, dtype, minicpm=None, cache=True):
        m = model_for(cfg, impl, dtype=dtype, device="cuda")
        if minicpm:
            use_minicpm4_attention(m, route=minicpm)
        c = hf.InfLLMv2Cache(cfg, max_cache_len=n_prompt + 10) if cache else DynamicCache()
        return step_logits(m, ids, n_prompt, c).float()

    ref = run(ref_name, torch.float32)
    lowp = run(ref_name, torch.bfloat16)
    _rule("kernels, InfLLMv2Cache", run(hf.ATTN_NAME, torch.bfloat16), ref, lowp)
    _rule("kernels, DynamicCache", run(hf.ATTN_NAME, torch.bfloat16, cache=False), ref, lowp)
    for route in ("fused", "compat"):
        for cache in (True, False):
            _rule(f"MiniCPM4-style layer, route {route}, {'InfLLMv2Cache' if cache else 'DynamicCache'}",
                  run(hf.ATTN_NAME, torch.bfloat16, minicpm=route, cache=cache), ref, lowp)


@pytest.mark.gpu
@pytest.mark.parametrize("route", ["fused", "compat"])
def test_gpu_minicpm4_layer_off_the_kernels_dtypes_names_q(route):
    """fp32 on CUDA: the stage-2 kernels take bf16/fp16 only. Both routes end in the same clear error naming q
    (the fused route falls back to the compat functions, whose varlen attention refuses it)."""
    cfg = small_config(SPARSE)
    ids = prompt(1, PROMPT, device="cuda")
    mc = use_minicpm4_attention(model_for(cfg, device="cuda"), route=route)
    with torch.no_grad(), pytest.raises(TypeError, match="q must have dtype bfloat16 or float16"):
        mc(ids)


@pytest.mark.gpu
def test_gpu_generate_runs_kernels_at_head_dim_128():
    """MiniCPM4's head shape (G = 16, D = 128) generates through the kernels; tokens are valid ids."""
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=512, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=32, num_key_value_heads=2, head_dim=128,
                      max_position_embeddings=4096)
    cfg.sparse_config = dict(SPARSE)
    m = model_for(cfg, dtype=torch.bfloat16, device="cuda")
    ids = prompt(1, 1000, device="cuda")
    toks, logits = generate(m, ids, 8, hf.InfLLMv2Cache(cfg, max_cache_len=1008))
    assert toks.shape == (1, 8) and torch.isfinite(logits).all()


def _greedy(model, ids, n, cache, forward, feed=None):
    """Prefill eagerly, then n greedy steps through `forward` (explicit positions: no length read back):
    the n + 1 tokens (the prefill's first) and the n steps' logits. `feed`: tokens to feed instead of
    the argmax (teacher forcing), `[B, n + 1]`."""
    with torch.no_grad():
        tok = model(ids, past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
        toks, logits = [tok], []
        for i in range(n):
            if feed is not None:
                tok = feed[:, i:i + 1]
            pos = torch.full_like(tok, ids.shape[1] + i)
            lo = forward(input_ids=tok, past_key_values=cache, use_cache=True, position_ids=pos).logits[:, -1]
            tok = lo.argmax(-1, keepdim=True)
            toks.append(tok)
            logits.append(lo.float())
    return torch.cat(toks, 1), torch.stack(logits)


def test_compiled_decode_traces_whole_and_equals_eager_on_cpu():
    """InfLLMv2Cache under torch.compile (aot_eager on CPU: the ops' CPU kernels): no graph break in the
    forward, and decode steps across dense_len give eager's tokens and logits."""
    cfg = small_config(SPARSE)
    m = model_for(cfg)
    ids = prompt(2, 250)
    toks_e, logits_e = _greedy(m, ids, 12, hf.InfLLMv2Cache(cfg, max_cache_len=300), m.forward)
    torch._dynamo.reset()
    cache = hf.InfLLMv2Cache(cfg, max_cache_len=300)
    toks_c, logits_c = _greedy(m, ids, 12, cache, torch.compile(m.forward, backend="aot_eager"))
    assert torch.equal(toks_c, toks_e)
    torch.testing.assert_close(logits_c, logits_e, atol=1e-4, rtol=1e-4)
    assert int(cache.get_seq_length()) == 262 and cache.decode_caches()[0].sync_lengths() == [262, 262]
    one = torch.zeros(2, 1, dtype=torch.long)
    ex = torch._dynamo.explain(m.forward)(input_ids=one, past_key_values=cache, use_cache=True,
                                          position_ids=torch.full_like(one, 262))
    assert ex.graph_break_count == 0, [str(r) for r in ex.break_reasons]


def test_compiled_prefill_is_one_op_and_equals_eager_on_cpu():
    """A prefill inside torch.compile (aot_eager on CPU) calls the op `infllm_cupy::infllmv2_prefill` and
    the chunk-append op: no graph break, eager's logits and cache; padding still raises inside the op."""
    cfg = small_config(SPARSE)
    m = model_for(cfg)
    ids = prompt(2, 300)
    with torch.no_grad():
        eager_cache = hf.InfLLMv2Cache(cfg, max_cache_len=320)
        ref = m(ids, past_key_values=eager_cache, use_cache=True).logits
        torch._dynamo.reset()
        cache = hf.InfLLMv2Cache(cfg, max_cache_len=320)
        ex = torch._dynamo.explain(m.forward)(input_ids=ids,
                                              past_key_values=hf.InfLLMv2Cache(cfg, max_cache_len=320),
                                              use_cache=True)
        assert ex.graph_break_count == 0, [str(r) for r in ex.break_reasons]
        got = torch.compile(m.forward, backend="aot_eager")(input_ids=ids, past_key_values=cache,
                                                            use_cache=True).logits
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    for a, b in zip(cache.decode_caches(), eager_cache.decode_caches()):
        assert a.lengths() == b.lengths() == [300, 300]
        for name in ("k", "v", "ck1", "ck2", "seqlens"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    torch._dynamo.reset()
    with torch.no_grad(), pytest.raises(Exception, match="attention_mask"):
        cache = hf.InfLLMv2Cache(cfg, max_cache_len=320)
        torch.compile(m.forward, backend="aot_eager")(input_ids=ids, attention_mask=mask, use_cache=True,
                                                      past_key_values=cache)


@pytest.mark.gpu
def test_gpu_compiled_greedy_equals_eager_and_generate_compiles():
    """32 greedy steps through torch.compile(mode="reduce-overhead") (CUDA graphs taken) across dense_len:
    fed eager's tokens, the compiled steps' logits match eager's to bf16 rounding and pick eager's token
    wherever eager's top-2 margin exceeds that rounding (a random bf16 model has near-ties that inductor's
    fused ops may break the other way); no graph break in the forward; transformers' generate (which
    compiles the decode steps of a compileable cache) gives the compiled loop's tokens."""
    cfg = small_config(dict(SPARSE, dense_len=320))
    m = model_for(cfg, dtype=torch.bfloat16, device="cuda")
    ids = prompt(1, 300, device="cuda")
    toks_e, logits_e = _greedy(m, ids, 32, hf.InfLLMv2Cache(cfg, max_cache_len=400), m.forward)
    torch._dynamo.reset()
    compiled = torch.compile(m.forward, mode="reduce-overhead")
    _, logits_f = _greedy(m, ids, 32, hf.InfLLMv2Cache(cfg, max_cache_len=400), compiled, feed=toks_e)
    diff = (logits_f - logits_e).abs().amax(-1)
    assert float(diff.max()) < 0.25, diff
    top2 = logits_e.topk(2, -1).values
    clear = (top2[..., 0] - top2[..., 1]) > 2 * diff
    assert int(clear.sum()) >= 24, "too few clear steps to compare"
    assert torch.equal(logits_f.argmax(-1)[clear], logits_e.argmax(-1)[clear])
    cache = hf.InfLLMv2Cache(cfg, max_cache_len=400)
    toks_c, _ = _greedy(m, ids, 32, cache, compiled)
    one = torch.zeros(1, 1, dtype=torch.long, device="cuda")
    ex = torch._dynamo.explain(m.forward)(input_ids=one, past_key_values=cache, use_cache=True,
                                          position_ids=torch.full_like(one, 332))
    assert ex.graph_break_count == 0, [str(r) for r in ex.break_reasons]
    gen, _ = generate(m, ids, 33, hf.InfLLMv2Cache(cfg, max_cache_len=400))
    assert torch.equal(gen, toks_c)


@pytest.mark.gpu
def test_gpu_decode_graphs_equal_eager():
    """InfLLMv2Cache(decode_graphs=True): each layer's attention replayed from a CUDA graph, the same
    logits bit for bit as the launches."""
    cfg = small_config(dict(SPARSE, dense_len=320))
    m = model_for(cfg, dtype=torch.bfloat16, device="cuda")
    ids = prompt(2, 300, device="cuda")
    toks_e, logits_e = _greedy(m, ids, 30, hf.InfLLMv2Cache(cfg, max_cache_len=400), m.forward)
    toks_g, logits_g = _greedy(m, ids, 30, hf.InfLLMv2Cache(cfg, max_cache_len=400, decode_graphs=True),
                               m.forward)
    assert torch.equal(toks_g, toks_e) and torch.equal(logits_g, logits_e)


def test_readme_transformers_block_runs():
    """README.md's "Using with transformers / MiniCPM4" block runs as written (CPU, seconds)."""
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("## Using with transformers / MiniCPM4", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```python\n(.*?)```", section, re.S)
    ns = {"__name__": "readme_transformers"}
    exec(compile(block, "README.md (transformers)", "exec"), ns)
    out = ns["out"]
    assert out.shape == (1, 528) and torch.equal(out[:, :512], ns["ids"])
    assert ns["model"].config._attn_implementation == hf.ATTN_NAME


def test_fp8_cache_eager_and_compiled_on_cpu():
    """InfLLMv2Cache(kv_dtype=torch.float8_e4m3fn), bf16 model on CPU across dense_len: compiled steps
    (aot_eager) give the eager steps' tokens and logits; the logits stay close to the 16-bit cache's;
    the caches hold e4m3 pages and the 16-bit cache's compressed keys."""
    cfg = small_config(SPARSE)
    m = model_for(cfg, dtype=torch.bfloat16)
    ids = prompt(2, 250)
    fp8 = torch.float8_e4m3fn
    toks_16, logits_16 = _greedy(m, ids, 12, hf.InfLLMv2Cache(cfg, max_cache_len=300), m.forward)
    eager = hf.InfLLMv2Cache(cfg, max_cache_len=300, kv_dtype=fp8)
    toks_e, logits_e = _greedy(m, ids, 12, eager, m.forward, feed=toks_16)
    torch._dynamo.reset()
    cache = hf.InfLLMv2Cache(cfg, max_cache_len=300, kv_dtype=fp8)
    toks_c, logits_c = _greedy(m, ids, 12, cache, torch.compile(m.forward, backend="aot_eager"), feed=toks_16)
    assert torch.equal(toks_c, toks_e)
    torch.testing.assert_close(logits_c, logits_e, atol=1e-4, rtol=1e-4)
    cos = torch.nn.functional.cosine_similarity(logits_e.flatten(1), logits_16.flatten(1), dim=-1)
    # two layers of a random bf16 model carry the attention error on (the per-head contract: tests/decode)
    assert cos.min() > 0.98 and not torch.equal(logits_e, logits_16)
    ref = hf.InfLLMv2Cache(cfg, max_cache_len=300)
    _greedy(m, ids, 12, ref, m.forward, feed=toks_16)
    for a in cache.decode_caches():
        assert a.kv_dtype == fp8 and a.sync_lengths() == [262, 262]
    # the first layer's keys do not depend on attention: its compressed keys are the 16-bit cache's
    a, b = cache.decode_caches()[0], ref.decode_caches()[0]
    assert torch.equal(a.ck1, b.ck1) and torch.equal(a.ck2, b.ck2)
    with pytest.raises(ValueError, match="kv_dtype"):
        hf.InfLLMv2Cache(cfg, max_cache_len=300, kv_dtype=torch.float8_e5m2)
