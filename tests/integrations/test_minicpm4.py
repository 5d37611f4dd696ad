"""The MiniCPM4-style layer's compat route (`MiniCPM4SparseAttention(route="compat")`) in a decode step: what
it reads back from the device and what it runs, in small Llama models built in code (random weights).

A read back of a device tensor's values (`item`, `bool`, `tolist`, a data-dependent shape, ...) synchronizes
the host with the GPU; on CPU tensors the same lines cost nothing, so the CPU tests count the lines
(`HostReads`) on the compat route with its kernel paths taken (the kernels replaced by their references,
uncounted), and the GPU tests ask torch to raise on a synchronizing call.
"""
from __future__ import annotations

import contextlib
import copy
import traceback
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

transformers = pytest.importorskip("transformers")

from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: E402

from infllm_cupy import _env, decode  # noqa: E402
from infllm_cupy.compat import infllm_v2 as iv2  # noqa: E402
from infllm_cupy.decode import naive_sparse_decode  # noqa: E402
from infllm_cupy.integrations import transformers as hf  # noqa: E402
from infllm_cupy.integrations.minicpm4 import MiniCPM4SparseAttention, use_minicpm4_attention  # noqa: E402
from infllm_cupy.stage1 import naive_stage1_scores  # noqa: E402
from infllm_cupy.testing import rel_l2_err  # noqa: E402

# The sparse regime at a few hundred tokens: K = topk + window_size / block_size = 4 + 2 = 6 of 10+ blocks.
SPARSE = dict(dense_len=256, topk=4, window_size=128)
VOCAB = 128


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        yield


def small_config(sparse_config, **kw) -> LlamaConfig:
    """2 layers, hidden 256, HQ 16, H 2, head dim 64 (a kernel size)."""
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=16, num_key_value_heads=2, head_dim=64,
                      max_position_embeddings=4096, initializer_range=0.1, **kw)
    cfg.sparse_config = dict(sparse_config)
    return cfg


def model_for(cfg, impl=hf.ATTN_NAME, *, route=None, dtype=torch.float32, device="cpu"):
    hf.register()
    torch.manual_seed(0)
    m = LlamaForCausalLM(cfg).eval().to(device=device, dtype=dtype)
    m.set_attn_implementation(impl)
    return use_minicpm4_attention(m, route=route) if route else m


def prompt(B, T, device="cpu"):
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (B, T), generator=g).to(device)


def make_cache(kind, cfg, max_len):
    return hf.InfLLMv2Cache(cfg, max_cache_len=max_len) if kind == "InfLLMv2Cache" else DynamicCache()


def prefill_and_steps(model, ids, n_prompt, cache, *, mask=False):
    """Logits `[n_steps + 1, B, vocab]` of a prefill of `ids[:, :n_prompt]` and one decode step per further
    token (teacher forcing), with an all-ones 2-D `attention_mask` (as generate passes it) when `mask`."""
    B = ids.shape[0]
    with torch.no_grad():
        out = [model(ids[:, :n_prompt], past_key_values=cache, use_cache=True).logits[:, -1]]
        for t in range(n_prompt, ids.shape[1]):
            kw = {"attention_mask": torch.ones(B, t + 1, dtype=torch.long, device=ids.device)} if mask else {}
            out.append(model(ids[:, t:t + 1], past_key_values=cache, use_cache=True, **kw).logits[:, -1])
    return torch.stack(out)


# ----------------------------------------------------------------------------------- counting reads
# aten ops that read values back to the host on a CUDA tensor: a scalar (item, bool, int, float), or an
# output whose shape depends on the values
_READ_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique", "_unique2",
             "unique_consecutive", "unique_dim"}


class HostReads(TorchDispatchMode):
    """Counts, while entered, each operation that reads a tensor's values back to the host: `item`, `bool`,
    `int` of a tensor (`_local_scalar_dense`), an output shaped by the values (`nonzero`, boolean-mask
    indexing, `repeat_interleave` without its output size, `unique`), and `Tensor.tolist`, `.cpu()`,
    `.numpy()` (patched by `install`). `host` holds tensors that live on the host by design (their reads
    are host reads on CUDA too); `paused()` stops counting (a kernel's stand-in). `sites` says where each
    read came from."""

    def __init__(self):
        super().__init__()
        self.sites: list[str] = []
        self.host: list[torch.Tensor] = []
        self.on = False

    def _count(self, what, t=None):
        if self.on and not any(t is h for h in self.host):
            frames = [f for f in traceback.extract_stack()[:-2] if "infllm_cupy" in f.filename]
            where = f"{frames[-1].filename.split('infllm_cupy/')[-1]}:{frames[-1].lineno}" if frames else "?"
            self.sites.append(f"{what} at {where}")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in _READ_OPS:
            self._count(name, args[0] if args else None)
        elif name == "repeat_interleave" and kwargs.get("output_size") is None:
            self._count(name)
        elif name in ("index", "index_put", "index_put_") and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ())):
            self._count(f"{name} with a boolean mask")
        return func(*args, **kwargs)

    def install(self, monkeypatch):
        for method in ("tolist", "cpu", "numpy"):
            real = getattr(torch.Tensor, method)

            def counted(t, *a, _real=real, _name=method, **kw):
                self._count(_name, t)
                return _real(t, *a, **kw)
            monkeypatch.setattr(torch.Tensor, method, counted)
        return self

    @contextlib.contextmanager
    def counting(self):
        self.on = True
        try:
            with self:
                yield self
        finally:
            self.on = False

    @contextlib.contextmanager
    def paused(self):
        on, self.on = self.on, False
        try:
            yield
        finally:
            self.on = on


def kernel_paths(monkeypatch, reads: HostReads) -> dict[str, int]:
    """The compat functions' kernel paths on CPU tensors, each kernel replaced by its reference (uncounted):
    stage 1 sized by the shapes (`stage1_select` with host offsets, its score rows as wide as the kernel
    writes them), the decode attention (`decode.sparse_decode`). The calls that read their offsets back
    (`stage1_scores`) or run prefill attention for one query (`sparse_attn_varlen`) are counted by name."""
    calls = {"stage1_select": 0, "sparse_decode": 0, "stage1_scores": 0, "sparse_attn_varlen": 0}

    def stage1_select(q, k, v, cu_q, cu_k, cu_v, max_seqlen_q, *, host_seqlens, return_scores, topk,
                      local_blocks, init_blocks, causal, softmax_scale, score_dtype):
        assert return_scores and host_seqlens is not None and (topk, local_blocks, init_blocks) == (0, 0, 0)
        calls["stage1_select"] += 1
        with reads.paused():
            scores = naive_stage1_scores(q, k, v, cu_q, cu_k, cu_v, max_seqlen_q, causal=causal,
                                         softmax_scale=softmax_scale, score_dtype=score_dtype)
        width = max(b - a for a, b in zip(host_seqlens.c1, host_seqlens.c1[1:]))
        return None, torch.nn.functional.pad(scores, (0, max(0, width - scores.shape[2])))[..., :width], None

    def sparse_decode(q, cache, topk_idx=None, **kw):
        calls["sparse_decode"] += 1
        with reads.paused():
            return naive_sparse_decode(q, cache, topk_idx, **kw)

    def counted(name, real):
        def call(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)
        return call

    monkeypatch.setattr(iv2, "_stage1_on_kernels", lambda q, k: True)
    monkeypatch.setattr(iv2, "stage1_select", stage1_select)
    monkeypatch.setattr(decode, "sparse_decode", sparse_decode)
    monkeypatch.setattr(iv2, "stage1_scores", counted("stage1_scores", iv2.stage1_scores))
    monkeypatch.setattr(iv2, "sparse_attn_varlen", counted("sparse_attn_varlen", iv2.sparse_attn_varlen))
    return calls


def count_layer_reads(monkeypatch, reads: HostReads) -> list[list[str]]:
    """Counts inside every `MiniCPM4SparseAttention.forward` (the model's own code is not the layer's);
    returns one list of read sites per layer call. The `cache_lens` the layer builds on the host
    (`_cache_lens`) are host tensors on CUDA too: their reads are not counted."""
    per_call: list[list[str]] = []
    forward, host_lens = MiniCPM4SparseAttention.forward, MiniCPM4SparseAttention._cache_lens

    def counted_forward(self, *args, **kwargs):
        reads.sites = []
        with reads.counting():
            out = forward(self, *args, **kwargs)
        per_call.append(reads.sites)
        reads.host.clear()
        return out

    def cache_lens(B, n):
        t = host_lens(B, n)
        reads.host.append(t)        # a CPU tensor on CUDA runs too: reading it is no device read
        return t

    monkeypatch.setattr(MiniCPM4SparseAttention, "forward", counted_forward)
    monkeypatch.setattr(MiniCPM4SparseAttention, "_cache_lens", staticmethod(cache_lens))
    return per_call


# ------------------------------------------------------------------------------------------------- CPU
@pytest.mark.parametrize("cache_kind", ["InfLLMv2Cache", "DynamicCache"])
def test_compat_decode_step_reads_nothing_back(cache_kind, monkeypatch):
    """Decode steps of the compat route in the sparse regime (across compression windows and a 64-key block
    edge, with generate's 2-D all-ones mask), the kernel paths taken: no layer call reads a value back
    without the value checks; stage 1 is sized by the shapes and the attention is the decode attention, so
    nothing reads its offsets back nor runs prefill attention for one query. With the checks on
    (INFLLM_CUPY_VALIDATE), each of the three compat calls reads once at most, in the checks."""
    cfg = small_config(SPARSE)
    n_prompt, n_steps = 300, 24                     # keys 300 -> 324: windows complete, block 5 -> 6
    ids = prompt(2, n_prompt + n_steps)
    model = model_for(cfg, route="compat")
    cache = make_cache(cache_kind, cfg, n_prompt + n_steps)
    with torch.no_grad():
        model(ids[:, :n_prompt], past_key_values=cache, use_cache=True)
    reads = HostReads().install(monkeypatch)
    calls = kernel_paths(monkeypatch, reads)
    per_call = count_layer_reads(monkeypatch, reads)
    with torch.no_grad(), _env.override(validate=False):
        for t in range(n_prompt, n_prompt + n_steps - 2):
            mask = torch.ones(2, t + 1, dtype=torch.long)
            model(ids[:, t:t + 1], past_key_values=cache, use_cache=True, attention_mask=mask)
    n_calls = (n_steps - 2) * cfg.num_hidden_layers
    assert len(per_call) == n_calls
    assert [s for s in per_call if s] == [], "reads back in a decode step"
    assert calls == {"stage1_select": n_calls, "sparse_decode": n_calls, "stage1_scores": 0,
                     "sparse_attn_varlen": 0}
    per_call.clear()
    with torch.no_grad():                            # the value checks: one read per compat call at most
        for t in range(n_prompt + n_steps - 2, n_prompt + n_steps):
            model(ids[:, t:t + 1], past_key_values=cache, use_cache=True)
    for sites in per_call:
        assert len(sites) <= 3 and all("_checks.py" in s or "stage1/pool.py" in s for s in sites), sites


def test_compat_dense_decode_reads_nothing_back(monkeypatch):
    """Below dense_len the compat route's one call, the dense varlen attention, is the decode attention over
    every block: nothing read back."""
    cfg = small_config(dict(SPARSE, dense_len=4096))
    ids = prompt(2, 104)
    model = model_for(cfg, route="compat")
    cache = make_cache("InfLLMv2Cache", cfg, 104)
    with torch.no_grad():
        model(ids[:, :100], past_key_values=cache, use_cache=True)
    reads = HostReads().install(monkeypatch)
    calls = kernel_paths(monkeypatch, reads)
    per_call = count_layer_reads(monkeypatch, reads)
    with torch.no_grad(), _env.override(validate=False):
        for t in range(100, 104):
            model(ids[:, t:t + 1], past_key_values=cache, use_cache=True)
    assert len(per_call) == 8 and not any(per_call)
    assert calls["sparse_decode"] == 8 and calls["sparse_attn_varlen"] == 0


@pytest.mark.parametrize("cache_kind", ["InfLLMv2Cache", "DynamicCache"])
def test_compat_decode_equals_the_stage2_attention_and_the_backend(cache_kind, monkeypatch):
    """The compat route's logits through prefill and 20 decode steps (ragged windows, dense_len crossed in
    decode) with the decode attention equal those with the stage-2 attention it ran before for one query
    (`_one_query_each` refused), and the backend's (native decode) within fp32 noise."""
    cfg = small_config(dict(SPARSE, dense_len=310))
    n_prompt, n = 300, 20
    ids = prompt(2, n_prompt + n)
    model = model_for(cfg, route="compat")
    new = prefill_and_steps(model, ids, n_prompt, make_cache(cache_kind, cfg, n_prompt + n), mask=True)
    with monkeypatch.context() as m:
        m.setattr(iv2, "_one_query_each", lambda *args: False)
        old = prefill_and_steps(model, ids, n_prompt, make_cache(cache_kind, cfg, n_prompt + n))
    torch.testing.assert_close(new, old, atol=1e-5, rtol=1e-5)
    native = prefill_and_steps(model_for(cfg), ids, n_prompt, make_cache("InfLLMv2Cache", cfg, n_prompt + n))
    torch.testing.assert_close(new, native, atol=1e-4, rtol=1e-4)


def test_compat_route_bad_inputs_still_name_the_argument():
    """The decode step checks no mask values (a batch without padding at prefill has none later), but a mask
    that is not 2-D still raises, naming attention_mask; a padded prefill too."""
    cfg = small_config(SPARSE)
    ids = prompt(1, 40)
    model = model_for(cfg, route="compat")
    cache = make_cache("DynamicCache", cfg, 64)
    with torch.no_grad():
        with pytest.raises(NotImplementedError, match="attention_mask"):
            model(ids, attention_mask=torch.cat([torch.zeros(1, 1), torch.ones(1, 39)], 1).long())
        model(ids[:, :39], past_key_values=cache, use_cache=True)
        layer = model.model.layers[0].self_attn
        h = torch.randn(1, 1, cfg.hidden_size)
        pos = model.model.rotary_emb(h, torch.tensor([[39]]))
        with pytest.raises(NotImplementedError, match="attention_mask"):
            layer(h, pos, attention_mask=torch.ones(1, 1, 1, 40), past_key_values=cache)


def test_layer_keeps_a_few_offsets():
    """`_offsets` keeps a few offset tensors per layer (the most recently used): equal to the arange they
    stand for, reused for the same (B, n, device), bounded."""
    layer = MiniCPM4SparseAttention(small_config(SPARSE), 0, route="compat")
    a = layer._offsets(3, 5, torch.device("cpu"))
    assert a.dtype == torch.int32 and a.tolist() == [0, 5, 10, 15]
    assert layer._offsets(3, 5, torch.device("cpu")) is a
    for n in range(100):
        layer._offsets(2, n, torch.device("cpu"))
    assert len(layer._offsets_memo) <= 8
    twin = copy.deepcopy(layer)
    assert twin._offsets(2, 99, torch.device("cpu")).tolist() == [0, 99, 198]


# ------------------------------------------------------------------------------------------------- GPU
def _rule(name, out, ref, lowp, mult=2.0):
    """FlashAttention's rule on the relative L2 error of logits (a whole model's max error is dominated by the
    odd token whose near-tied block scores select differently)."""
    assert torch.isfinite(out).all(), f"{name}: non-finite logits"
    err, base = rel_l2_err(out, ref), rel_l2_err(lowp, ref)
    assert err <= mult * base + 1e-5, \
        f"{name}: rel L2 {err:.3e} > {mult} x {base:.3e} (low-precision reference)"


def minicpm4_heads_config() -> LlamaConfig:
    """MiniCPM4's heads (HQ 32, H 2, D 128: G 16), 2 small layers, sparse from a few hundred tokens."""
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=512, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=32, num_key_value_heads=2, head_dim=128,
                      max_position_embeddings=4096, initializer_range=0.1)
    cfg.sparse_config = dict(SPARSE)
    return cfg


@pytest.mark.gpu
@pytest.mark.parametrize("cache_kind", ["InfLLMv2Cache", "DynamicCache"])
def test_gpu_compat_decode_within_error_rule_of_native(cache_kind):
    """bf16 on CUDA, MiniCPM4's heads (G 16, D 128): the compat route's decode logits (20 steps across
    compression windows and a block edge) and the native route's, each within FlashAttention's rule of the
    fp32 reference ops (the same in bf16 as the low-precision baseline), and so within twice the rule's
    allowance of each other."""
    ref_name = hf.register("infllm_cupy_reference", backend="reference")
    cfg = minicpm4_heads_config()
    n_prompt, n = 700, 20
    ids = prompt(2, n_prompt + n, device="cuda")

    def run(impl, dtype, route=None):
        m = model_for(cfg, impl, route=route, dtype=dtype, device="cuda")
        cache = make_cache(cache_kind, cfg, n_prompt + n) if route else make_cache("InfLLMv2Cache", cfg,
                                                                                    n_prompt + n)
        return prefill_and_steps(m, ids, n_prompt, cache, mask=True)[1:].float()     # the decode steps

    ref, lowp = run(ref_name, torch.float32), run(ref_name, torch.bfloat16)
    compat, native = run(hf.ATTN_NAME, torch.bfloat16, "compat"), run(hf.ATTN_NAME, torch.bfloat16)
    _rule("compat route", compat, ref, lowp)
    _rule("native route", native, ref, lowp)
    assert rel_l2_err(compat, native) <= 4 * rel_l2_err(lowp, ref) + 2e-5


@pytest.mark.gpu
def test_gpu_compat_decode_step_synchronizes_at_most_once(monkeypatch):
    """bf16 on CUDA with an InfLLMv2Cache, value checks off (as the benchmark): no compat layer call makes a
    synchronizing CUDA call in 20 decode steps (torch's sync debug mode set to raise inside the layer), and a
    whole compat decode step synchronizes no more than a native one (at most once)."""
    cfg = minicpm4_heads_config()
    n_prompt, n = 700, 24
    ids = prompt(1, n_prompt + n, device="cuda")

    def step_syncs(model, cache, t):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                model(ids[:, t:t + 1], past_key_values=cache, use_cache=True)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return sum("called a synchronizing" in str(w.message) for w in caught)

    counts = {}
    with torch.no_grad(), _env.override(validate=False):
        for route in (None, "compat"):
            model = model_for(cfg, route=route, dtype=torch.bfloat16, device="cuda")
            cache = make_cache("InfLLMv2Cache", cfg, n_prompt + n)
            model(ids[:, :n_prompt], past_key_values=cache, use_cache=True)
            for t in range(n_prompt, n_prompt + 3):          # kernels compiled and loaded
                model(ids[:, t:t + 1], past_key_values=cache, use_cache=True)
            torch.cuda.synchronize()
            counts[route] = step_syncs(model, cache, n_prompt + 3)
        forward = MiniCPM4SparseAttention.forward

        def strict(self, *args, **kwargs):
            torch.cuda.set_sync_debug_mode("error")
            try:
                return forward(self, *args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("default")

        monkeypatch.setattr(MiniCPM4SparseAttention, "forward", strict)
        for t in range(n_prompt + 4, n_prompt + n):          # the compat model: raises on a sync in a layer
            model(ids[:, t:t + 1], past_key_values=cache, use_cache=True)
    assert counts["compat"] <= max(counts[None], 1), counts

