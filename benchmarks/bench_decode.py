r"""Decode (one query token per sequence against its KV cache): ours against the anchors, in one process.

    python benchmarks/bench_decode.py --json benchmarks/results/decode.json      # the default run (< 150 s, H100)
    python benchmarks/bench_decode.py --configs 8x128k --impls ours_step,sdpa_cudnn
    python benchmarks/bench_decode.py --device cpu --configs 1x1k --hq 4 --h 2 --d 64 --topk 4 --local-blocks 2

Configs are BATCHxCONTEXT (k = 1024), README head config by default (HQ 32, H 2, D 128, bf16). Every
sequence of a config holds CONTEXT keys; caches are random, built directly on the device.

Implementations (rows; `weights` = with `return_attn_weights=True`, fp32 per query head `[B, HQ, L]`):
    ours_sparse     sparse_decode over K = topk + local_blocks selected 64-key blocks (stage 2 alone):
                    block 0, the local_blocks + 1 blocks ending at the last one, random others
    ours_step       infllmv2_decode: stage 1 over the cache's compressed keys, top-k, sparse_decode
    ours_dense      sparse_decode over every block (dense decode through our kernel)
    ours_sparse_kvh, ours_step_kvh, ours_dense_kvh
                    the same calls with `weights="per_kv_head"`: fp32 weights summed over each group,
                    `[B, H, L]` (what H2O accumulates); rows with weights only (their time without
                    weights is the plain row's)
    ours_op         (opt-in) the step's custom op `infllm_cupy::infllmv2_decode` called directly with the
                    device-decided spec: what a torch.compile'd decode without CUDA graphs runs per layer
    ours_select     (opt-in) decode_select alone (stage 1 + top-k): the split decode kernels (select_decode)
    ours_select_s1  (opt-in) decode_select through the prefill stage-1 kernel (stage1="prefill"; kernel="auto":
                    its sm_90a form on H100 where G <= 32, else sm80): one CTA per (sequence, KV head), for
                    comparison
    sdpa_cudnn, sdpa_flash, sdpa_efficient, sdpa_math
                    torch SDPA dense decode, q `[B, HQ, 1, D]`, K/V `[B, H, L, D]`, enable_gqa
    flex            FlexAttention (compiled) with a BlockMask of the same selection as ours_sparse
                    (64-key KV blocks, all full: no mask_mod)
    eager_grouped   eager attention returning weights as a grouped einsum (the H2O baseline)
    eager_hf        HF's eager path returning weights: repeat_kv, matmul, softmax (fp32), matmul
    flashinfer      FlashInfer's paged decode (BatchDecodeWithPagedKVCacheWrapper) on the same cache
                    viewed as 64-token pages, if `import flashinfer` works
The device copy bandwidth (a device-to-device copy, bytes read + written) is measured in the same run.
At the batches in --graph-batches (default all) ours, SDPA and the grouped eager anchor are also timed
as CUDA-graph replays (`mode=graph`): eager, our Python launch path (checks, allocations, CuPy
launches) costs more than the kernels up to batch 64, so the graph rows say what the GPU does.
A graph holds one call by default (`--graph-calls 1`: each step's launch latency is in its time); with
`--graph-calls N` it holds N calls back to back, as a model's decode graph holds one per layer, and
the time per call is the replay's over N (the steady state, where one call's launch overlaps the
previous call's tail).

GB/s count the bytes each implementation must move: K/V of the selected (sparse, flex) or all
positions, the compressed keys ck1 + ck2 (stage 1 of ours_step), q, out, and the weights it returns.
`host us` (eager rows of ours and of the SDPA anchors): the host time of one call while the GPU queue is
not full: --host-calls (default 200) calls back to back without synchronising, time.perf_counter around them
(in chunks of --host-chunk, default 25, with a synchronize between chunks outside the clock, so that the
queue never fills and no launch waits for the GPU), per call (median over chunks). Where it is close to
`us`, the eager call is host-bound.
The kernel goals are printed as a second table, with the measured value, the target and whether met;
the eager-call goals (eager ours_step faster than eager sdpa_cudnn, and at most 60 host us per eager
ours_step, at 1x128k, 8x32k, 8x128k and 64x32k) as a third, with a `goals:` summary line.
Failures are recorded as notes, never raised.
"""  # noqa: E501 - verbatim commands, signatures and tables
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import _harness as harness  # noqa: E402

OURS = ("ours_sparse", "ours_step", "ours_dense", "ours_sparse_kvh", "ours_step_kvh", "ours_dense_kvh",
        "ours_op", "ours_select", "ours_select_s1")
NO_WEIGHTS = ("ours_op", "ours_select", "ours_select_s1")
# weights summed per KV head [B, H, L]: timed with weights only; the row without is the plain impl's
# stage 1 alone: no attention, no weights; opt-in rows
PER_KV_HEAD = {"ours_sparse_kvh": "ours_sparse", "ours_step_kvh": "ours_step", "ours_dense_kvh": "ours_dense"}
SDPA = ("sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "sdpa_math")
ANCHORS = (*SDPA, "flex", "eager_grouped", "eager_hf", "flashinfer")
IMPLS = (*OURS, *ANCHORS)
DEFAULT_IMPLS = tuple(i for i in IMPLS if i not in NO_WEIGHTS)
DENSE_ANCHORS = (*SDPA, "flashinfer")            # dense decode without weights: "the fastest dense anchor"
WITH_WEIGHTS = ("eager_grouped", "eager_hf")     # anchors that only exist with weights
DEFAULT_CONFIGS = "1x32k,1x128k,8x32k,8x128k,64x32k,64x128k"
BLOCK = 64


@dataclasses.dataclass
class Row:
    """One timed (implementation, config, weights, mode); `us` is None when it failed or was skipped."""
    impl: str
    config: str
    weights: bool = False
    mode: str = "eager"                   # "eager" or "graph" (CUDA-graph replay)
    us: float | None = None
    us_p20: float | None = None
    us_p80: float | None = None
    host_us: float | None = None          # host time per call, eager rows of ours and SDPA (see host_time)
    reps: int = 0
    bytes: int | None = None
    gbps: float | None = None
    note: str = ""


def _short(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0] if msg else ''}"[:200]


def config_id(B: int, L: int) -> str:
    return f"{B}x{L // 1024}k" if L % 1024 == 0 else f"{B}x{L}"


# ------------------------------------------------------------------------------------------ runner
class Runner:
    def __init__(self, a, dev: torch.device):
        self.a, self.dev = a, dev
        self.rows: list[Row] = []
        self.t0 = time.perf_counter()

    def over_budget(self) -> bool:
        return self.a.budget_s > 0 and time.perf_counter() - self.t0 > self.a.budget_s

    def time(self, row: Row, fn: Callable | None, nbytes: int | None, *, skip: str = "") -> Row:
        a = self.a
        row.bytes = nbytes
        why = harness.skip_reason(skip, fn, self.over_budget(), a.budget_s)
        if why:
            row.note = why
        else:
            try:
                run, per = fn, 1
                if row.mode == "graph":
                    per = a.graph_calls
                    run = harness.capture_graph(fn, calls=per).replay
                times = [t / per for t in harness.timed_runs(run, a, self.dev)]
                st = harness.summarize(times)
                row.us, row.us_p20, row.us_p80, row.reps = (st["ms"] * 1e3, st["ms_p20"] * 1e3,
                                                            st["ms_p80"] * 1e3, len(times))
                row.gbps = nbytes / (row.us * 1e3) if nbytes and row.us else None
                if row.mode == "eager" and (row.impl.startswith("ours") or row.impl in SDPA) and a.host_calls:
                    row.host_us = host_time(fn, a.host_calls, a.host_chunk, self.dev) * 1e6
            except Exception as e:  # noqa: BLE001 - one failure must not end the table
                row.note = (row.note + "; " if row.note else "") + _short(e)
                if self.dev.type == "cuda":
                    with contextlib.suppress(Exception):
                        torch.cuda.synchronize()
            finally:
                run = None
                harness.free_gpu_memory(self.dev)
        self.rows.append(row)
        tqdm.write(f"  {row.impl:<14} {row.config:<8} w={int(row.weights)} {row.mode:<5} "
                   f"us={'-' if row.us is None else f'{row.us:.1f}'} "
                   f"host_us={'-' if row.host_us is None else f'{row.host_us:.1f}'} "
                   f"GB/s={'-' if row.gbps is None else f'{row.gbps:.0f}'} {row.note}")
        return row


def host_time(fn: Callable, calls: int, chunk: int, dev: torch.device) -> float:
    """Host seconds per call of `fn` while the GPU queue is not full: `calls` calls back to back without
    synchronising, in chunks of `chunk` (a synchronize between chunks, outside the clock, so that the
    launches a chunk queues stay far below the driver's queue depth and no launch waits for the GPU);
    time.perf_counter around each chunk, the median over chunks of the time per call."""
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    per = []
    done = 0
    while done < calls:
        n = min(chunk, calls - done)
        sync()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        per.append((time.perf_counter() - t0) / n)
        done += n
    sync()
    per.sort()
    return per[len(per) // 2] if len(per) % 2 else (per[len(per) // 2 - 1] + per[len(per) // 2]) / 2


def copy_bandwidth(r: Runner) -> Row:
    """Device-to-device copy of a large buffer; GB/s on the bytes read + written."""
    fn, nbytes = harness.device_copy(r.dev)
    row = r.time(Row("copy", "-"), fn, nbytes)
    del fn                                       # the buffers go with it
    return row


def mem_free(dev: torch.device) -> float:
    return torch.cuda.mem_get_info()[0] if dev.type == "cuda" else float("inf")


def load_ours():
    try:
        from infllm_cupy.decode import sparse_decode
        from infllm_cupy.decode.step import infllmv2_decode
        return sparse_decode, infllmv2_decode, ""
    except Exception as e:  # noqa: BLE001 - mid-edit or broken: the anchors still run
        return None, None, f"not importable: {_short(e)}"


def load_flashinfer():
    try:
        import flashinfer
        return flashinfer, ""
    except Exception as e:  # noqa: BLE001
        return None, ("not run: flashinfer not installed" if isinstance(e, ModuleNotFoundError)
                      else f"not run: import flashinfer failed ({_short(e)})")


def bench_config(r: Runner, B: int, L: int, flex, BlockMask, ours, flashinfer, fi_note: str,
                 check: list) -> None:
    a, dev = r.a, r.dev
    HQ, H, D = a.hq, a.h, a.d
    G = HQ // H
    dt = torch.bfloat16
    cfg = config_id(B, L)
    esz = torch.tensor([], dtype=dt).element_size()
    kv_all = 2 * B * L * H * D * esz
    need = 2 * kv_all + (B * HQ * L * 4 if a.weights else 0)       # cache + the anchors' [B, H, L, D] copy
    if need > 0.9 * mem_free(dev):
        for impl in a.impls:
            r.rows.append(Row(impl, cfg, note=f"skipped: needs ~{need / 2**30:.0f} GiB, "
                                              f"{mem_free(dev) / 2**30:.0f} GiB free"))
        tqdm.write(f"== {cfg}: skipped (does not fit)")
        return
    tqdm.write(f"== {cfg}: B={B} L={L} HQ={HQ} H={H} D={D}")
    g = torch.Generator(device=dev).manual_seed(a.seed)
    cache = harness.random_cache(B, L, H, D, dt, dev, g)
    q = torch.randn(B, HQ, D, generator=g, device=dev, dtype=dt)
    topk_idx = harness.random_selection(B, H, L, a.topk, a.local_blocks, dev, g)
    K = topk_idx.shape[2]
    scale = D ** -0.5
    qo = 2 * B * HQ * D * esz                                          # q read + out written
    kv_sel = 2 * B * H * K * BLOCK * D * esz
    ck_bytes = (cache.ck1.numel() + cache.ck2.numel()) * esz
    w32 = B * HQ * L * 4                                               # fp32 weights [B, HQ, L]
    wkv32 = B * H * L * 4                                              # per KV head [B, H, L]
    graph = dev.type == "cuda" and B in a.graph_batches
    modes = ["eager", "graph"] if graph else ["eager"]
    weight_opts = [False, True] if a.weights else [False]

    # ---- anchors (before ours: a crash in ours must not cost them)
    need_bhld = any(i in a.impls for i in (*SDPA, "flex", "eager_grouped", "eager_hf"))
    kt, vt = ((cache.k.transpose(1, 2).contiguous(), cache.v.transpose(1, 2).contiguous()) if need_bhld
              else (None, None))
    q4 = q.view(B, HQ, 1, D)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backends = {"sdpa_cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa_flash": SDPBackend.FLASH_ATTENTION,
                "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION, "sdpa_math": SDPBackend.MATH}
    repeat_bytes = 2 * B * HQ * L * D * esz                            # K/V repeated to HQ heads
    for impl in SDPA:
        if impl not in a.impls:
            continue

        def sdpa(backend=backends[impl]):
            with sdpa_kernel([backend]):
                return torch.nn.functional.scaled_dot_product_attention(q4, kt, vt, enable_gqa=True)
        skip = ""
        if impl == "sdpa_math" and 3 * repeat_bytes > mem_free(dev):   # seen: 32 GiB asked at 17 GiB repeated
            skip = f"skipped: the math backend repeats K/V to {repeat_bytes / 2**30:.0f} GiB"
        for mode in modes:
            prev = r.rows[-1] if mode == "graph" else None
            if mode == "graph" and prev is not None and prev.us is None:
                skip = skip or "skipped: eager failed"
            r.time(Row(impl, cfg, False, mode), sdpa, kv_all + qo, skip=skip)

    if "flex" in a.impls:
        fn, note = None, ""
        try:
            nb = -(-L // BLOCK)
            full_idx = torch.zeros(B, HQ, 1, nb, dtype=torch.int32, device=dev)
            full_idx[..., :K] = topk_idx.permute(1, 0, 2).repeat_interleave(G, dim=1)[:, :, None]
            full_num = torch.full((B, HQ, 1), K, dtype=torch.int32, device=dev)
            bm = BlockMask.from_kv_blocks(torch.zeros_like(full_num), torch.zeros_like(full_idx), full_num,
                                          full_idx, BLOCK_SIZE=(128, BLOCK), seq_lengths=(1, L))
            t0 = time.perf_counter()
            flex(q4, kt, vt, block_mask=bm, enable_gqa=True)          # compiles (seconds): not timed
            if dev.type == "cuda":
                torch.cuda.synchronize()
            note = f"first call {time.perf_counter() - t0:.1f} s"

            def fn():
                return flex(q4, kt, vt, block_mask=bm, enable_gqa=True)
        except Exception as e:  # noqa: BLE001
            note = f"setup: {_short(e)}"
        r.time(Row("flex", cfg, False, "eager", note=note if fn else ""), fn, kv_sel + qo,
               skip="" if fn else note)
        fn = bm = full_idx = None

    if "eager_grouped" in a.impls:
        def eager_grouped():
            s = torch.einsum("bhgd,bhld->bhgl", q.view(B, H, G, D), kt).float() * scale
            p = torch.softmax(s, -1)
            o = torch.einsum("bhgl,bhld->bhgd", p.to(dt), vt)
            return o.reshape(B, HQ, D), p.view(B, HQ, L)
        for mode in modes:
            r.time(Row("eager_grouped", cfg, True, mode), eager_grouped, kv_all + qo + w32)

    if "eager_hf" in a.impls:
        def eager_hf():
            kr = kt[:, :, None].expand(B, H, G, L, D).reshape(B, HQ, L, D)
            vr = vt[:, :, None].expand(B, H, G, L, D).reshape(B, HQ, L, D)
            w = torch.matmul(q4, kr.transpose(2, 3)) * scale
            w = torch.softmax(w, dim=-1, dtype=torch.float32).to(dt)
            return torch.matmul(w, vr).view(B, HQ, D), w
        skip = (f"skipped: repeat_kv allocates {repeat_bytes / 2**30:.0f} GiB"
                if 1.5 * repeat_bytes > mem_free(dev) else "")
        r.time(Row("eager_hf", cfg, True, "eager"), eager_hf, kv_all + qo + B * HQ * L * esz, skip=skip)

    if "flashinfer" in a.impls:
        fn, note = None, fi_note
        if flashinfer is not None:
            try:
                npg = L // BLOCK
                ws = torch.empty(128 << 20, dtype=torch.uint8, device=dev)
                wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
                wrapper.plan(torch.arange(B + 1, dtype=torch.int32, device=dev) * npg,
                             torch.arange(B * npg, dtype=torch.int32, device=dev),
                             torch.full((B,), BLOCK, dtype=torch.int32, device=dev), HQ, H, D, BLOCK,
                             q_data_type=dt, kv_data_type=dt)
                paged = (cache.k.view(B * npg, BLOCK, H, D), cache.v.view(B * npg, BLOCK, H, D))

                def fn():
                    return wrapper.run(q, paged)
                note = ""
            except Exception as e:  # noqa: BLE001
                note = f"setup: {_short(e)}"
        r.time(Row("flashinfer", cfg, False, "eager"), fn, kv_all + qo, skip=note)
    kt = vt = None
    harness.free_gpu_memory(dev)

    # ---- ours
    sparse_decode, infllmv2_decode = ours
    if any(i in a.impls for i in OURS) and a.check and sparse_decode is not None:
        check.append(run_check(cfg, q, cache, topk_idx, sparse_decode))
        tqdm.write("  " + check[-1])
    from infllm_cupy.config import InfLLMv2Config
    step_cfg = InfLLMv2Config(topk=a.topk, local_blocks=a.local_blocks, dense_len=0)
    calls = {
        "ours_sparse": (lambda w: lambda: sparse_decode(q, cache, topk_idx, return_attn_weights=w),
                        kv_sel + qo),
        "ours_step": (lambda w: lambda: infllmv2_decode(q, cache, config=step_cfg, return_attn_weights=w),
                      kv_sel + ck_bytes + qo),
        "ours_dense": (lambda w: lambda: sparse_decode(q, cache, None, return_attn_weights=w), kv_all + qo),
        "ours_sparse_kvh": (lambda w: lambda: sparse_decode(q, cache, topk_idx, return_attn_weights=True,
                                                            weights="per_kv_head"), kv_sel + qo),
        "ours_step_kvh": (lambda w: lambda: infllmv2_decode(q, cache, config=step_cfg,
                                                            return_attn_weights=True,
                                                            weights="per_kv_head"), kv_sel + ck_bytes + qo),
        "ours_dense_kvh": (lambda w: lambda: sparse_decode(q, cache, None, return_attn_weights=True,
                                                           weights="per_kv_head"), kv_all + qo),
        "ours_op": (lambda w: lambda: torch.ops.infllm_cupy.infllmv2_decode(
            q, cache.k, cache.v, cache.ck1, cache.ck2, cache.seqlens, cache.block_table, None, op_spec),
            kv_sel + ck_bytes + qo),
        "ours_select": (lambda w: lambda: decode_select(q, cache, config=step_cfg),
                        ck_bytes + B * HQ * D * esz),
        "ours_select_s1": (lambda w: lambda: decode_select(q, cache, config=step_cfg, stage1="prefill"),
                           ck_bytes + B * HQ * D * esz),
    }
    from infllm_cupy.decode.step import decode_select, step_spec
    op_spec = step_spec(step_cfg, select="stage1", device_dense=True).encode()
    for impl in OURS:
        if impl not in a.impls:
            continue
        make, nbytes = calls[impl]
        wbytes = wkv32 if impl in PER_KV_HEAD else w32
        opts = [False] if impl in NO_WEIGHTS else [True] if impl in PER_KV_HEAD else weight_opts
        if impl in PER_KV_HEAD and not a.weights:
            continue
        for w in opts:
            for mode in modes:
                r.time(Row(impl, cfg, w, mode), make(w) if sparse_decode else None,
                       nbytes + (wbytes if w else 0), skip="" if sparse_decode else r.ours_err)
    if a.splits and sparse_decode is not None and dev.type == "cuda":
        # the split-count sweep of docs/decode.md section 4 (graph replays, no weights)
        from infllm_cupy.decode.sparse_decode import DecodePlan, plan_decode
        mt = plan_decode(B, H, G, K, 1).row_tiles
        for S in a.splits:
            per = -(-K // S)
            plan = DecodePlan(mt, -(-K // per), per)
            r.time(Row(f"ours_sparse_s{plan.num_splits}", cfg, False, "graph"),
                   lambda plan=plan: sparse_decode(q, cache, topk_idx, plan=plan), kv_sel + qo)
    cache = q = topk_idx = None
    harness.free_gpu_memory(dev)


def run_check(cfg: str, q, cache, topk_idx, sparse_decode) -> str:
    """Sequence 0 of the config: ours dense against SDPA (math), ours sparse against the reference."""
    try:
        from infllm_cupy.decode.naive import naive_sparse_decode
        L = cache.lengths()[0]
        k, v = cache.k[:1, :L], cache.v[:1, :L]
        one = (cache.k[:1], cache.v[:1], cache.seqlens[:1])
        with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.MATH]):
            ref = torch.nn.functional.scaled_dot_product_attention(
                q[:1, :, None].float(), k.transpose(1, 2).float(), v.transpose(1, 2).float(),
                                                                   enable_gqa=True)[:, :, 0]
        dense = sparse_decode(q[:1].contiguous(), one).float()
        sel = topk_idx[:, :1].contiguous()
        sp = sparse_decode(q[:1].contiguous(), one, sel).float()
        sp_ref = naive_sparse_decode(q[:1], one, sel).float()
        e1, e2 = (dense - ref).abs().max().item(), (sp - sp_ref).abs().max().item()
        ok = e1 < 2e-2 and e2 < 2e-2
        return f"check {cfg}: {'ok' if ok else 'FAIL'} dense vs SDPA {e1:.1e}, sparse vs reference {e2:.1e}"
    except Exception as e:  # noqa: BLE001
        return f"check {cfg}: ERROR {_short(e)}"


# ------------------------------------------------------------------------------------------ report
def find(rows, impl, cfg, weights=False, mode="eager"):
    for x in rows:
        if x.impl == impl and x.config == cfg and x.weights == weights and x.mode == mode and x.us:
            return x
    return None


def fastest_dense(rows, cfg, graph: bool):
    """The fastest dense anchor without weights at `cfg` (eager, or eager and graph replays)."""
    cands = [x for x in rows if x.impl in DENSE_ANCHORS and x.config == cfg and x.us and not x.weights
             and (graph or x.mode == "eager")]
    return min(cands, key=lambda x: x.us, default=None)


def goals(rows: list[Row], copy: Row | None) -> list[dict]:
    """Every ratio of the kernel goals that the rows allow, with its target and whether it is met."""
    out = []

    def add(goal, cfg, value, target, op, detail):
        if value is None:
            return
        met = value >= target if op == ">=" else value <= target
        out.append({"goal": goal, "config": cfg, "value": round(value, 3), "target": f"{op} {target:g}",
                    "met": "yes" if met else "no", "detail": detail})

    cfgs = list(dict.fromkeys(x.config for x in rows if x.config != "-"))
    for cfg in cfgs:
        B = int(cfg.split("x")[0])
        for mode in ("eager", "graph"):
            # graph rows of ours compare with the fastest dense anchor eager or replayed, eager rows with
            # eager
            fd = fastest_dense(rows, cfg, graph=mode == "graph")
            tag = f" ({mode})"
            sp = find(rows, "ours_sparse", cfg, mode=mode)
            if sp and copy and copy.gbps and B >= 8:
                add("sparse attention GB/s / copy GB/s" + tag, cfg, sp.gbps / copy.gbps, 0.7, ">=",
                    f"{sp.gbps:.0f} / {copy.gbps:.0f} GB/s")
            st = find(rows, "ours_step", cfg, mode=mode)
            if st and fd:
                add("fastest dense anchor / whole sparse step" + tag, cfg, fd.us / st.us,
                    2.0 if B == 1 else 5.0, ">=",
                    f"{fd.impl} ({fd.mode}) {fd.us:.1f} us / step {st.us:.1f} us")
            dn = find(rows, "ours_dense", cfg, mode=mode)
            if dn and fd:
                add("ours dense / fastest dense anchor" + tag, cfg, dn.us / fd.us, 1.1, "<=",
                    f"{dn.us:.1f} us / {fd.impl} ({fd.mode}) {fd.us:.1f} us")
            for impl in OURS:
                if impl in PER_KV_HEAD:
                    continue
                on, off = find(rows, impl, cfg, True, mode), find(rows, impl, cfg, False, mode)
                if on and off:
                    add(f"{impl} with weights / without" + tag, cfg, on.us / off.us, 1.25, "<=",
                        f"{on.us:.1f} / {off.us:.1f} us")
            for impl, base in PER_KV_HEAD.items():
                on, off = find(rows, impl, cfg, True, mode), find(rows, base, cfg, False, mode)
                if on and off:
                    add(f"{base} with weights / without, per KV head" + tag, cfg, on.us / off.us, 1.25, "<=",
                        f"{on.us:.1f} / {off.us:.1f} us")
            dw = find(rows, "ours_dense", cfg, True, mode)
            if dw and fd:
                add("fastest dense anchor (no weights) / ours dense with weights" + tag, cfg, fd.us / dw.us,
                    0.8, ">=", f"{fd.impl} ({fd.mode}) {fd.us:.1f} us / {dw.us:.1f} us")
            dk = find(rows, "ours_dense_kvh", cfg, True, mode)
            if dk and fd:
                add("fastest dense anchor (no weights) / ours dense with weights, per KV head" + tag, cfg,
                    fd.us / dk.us, 0.8, ">=", f"{fd.impl} ({fd.mode}) {fd.us:.1f} us / {dk.us:.1f} us")
            for impl, target in (("eager_grouped", 2.5), ("eager_hf", 10.0)):
                e = find(rows, impl, cfg, True, mode) or find(rows, impl, cfg, True)
                if dw and e:
                    add(f"{impl} with weights / ours dense with weights" + tag, cfg, e.us / dw.us, target,
                        ">=", f"{e.us:.1f} ({e.mode}) / {dw.us:.1f} us")
    return out


EAGER_GOAL_CONFIGS = ("1x128k", "8x32k", "8x128k", "64x32k")
HOST_US_TARGET = 60.0


def goals_38(rows: list[Row]) -> tuple[list[dict], str]:
    """The eager-call goals: ours_step faster than sdpa_cudnn, and host us per ours_step call <= 60, at every
    config that ran (rows as in `goals`), and a summary line over the goal's configs (1x128k, 8x32k, 8x128k,
    64x32k)."""
    out = []
    cfgs = list(dict.fromkeys(x.config for x in rows if x.config != "-"))
    for cfg in cfgs:
        st, cu = find(rows, "ours_step", cfg), find(rows, "sdpa_cudnn", cfg)
        if st and cu:
            out.append({"goal": "sdpa_cudnn / ours_step, eager", "config": cfg,
                        "value": round(cu.us / st.us, 3),
                        "target": "> 1", "met": "yes" if st.us < cu.us else "no",
                        "detail": f"sdpa_cudnn {cu.us:.1f} us / ours_step {st.us:.1f} us"})
        if st and st.host_us is not None:
            out.append({"goal": "host us per eager ours_step", "config": cfg, "value": round(st.host_us, 1),
                        "target": f"<= {HOST_US_TARGET:g}",
                        "met": "yes" if st.host_us <= HOST_US_TARGET else "no",
                        "detail": f"{st.host_us:.1f} us host, {st.us:.1f} us per call (CUDA events)"})
    parts = []
    for goal in ("sdpa_cudnn / ours_step, eager", "host us per eager ours_step"):
        got = {g["config"]: g["met"] for g in out if g["goal"] == goal}
        missing = [c for c in EAGER_GOAL_CONFIGS if c not in got]
        missed = [c for c in EAGER_GOAL_CONFIGS if got.get(c) == "no"]
        verdict = "not met" if missed else "not measured" if len(missing) == len(EAGER_GOAL_CONFIGS) else \
            "met" if not missing else "met where measured"
        parts.append(f"{goal}: {verdict}" + (f" (missed at {', '.join(missed)})" if missed else "")
                     + (f" (not run: {', '.join(missing)})" if missing else ""))
    return out, "eager calls at " + ", ".join(EAGER_GOAL_CONFIGS) + ": " + "; ".join(parts)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--configs", default=None,
                   help=f"comma-separated BATCHxCONTEXT. Default: {DEFAULT_CONFIGS} "
                                                   "(on CPU: 1x1k,2x1k)")
    p.add_argument("--impls", default=",".join(DEFAULT_IMPLS),
                   help=f"subset of {','.join(IMPLS)}. Default: all but {','.join(NO_WEIGHTS)}")
    p.add_argument("--json", default=None, help="write all rows, the goals and the env stamp to this file")
    p.add_argument("--hq", type=int, default=32)
    p.add_argument("--h", type=int, default=2)
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--topk", type=int, default=64,
                   help="K = topk + local_blocks selected blocks (MiniCPM4: 64)")
    p.add_argument("--local-blocks", type=int, default=32, help="MiniCPM4: 32 (K = 96)")
    p.add_argument("--no-weights", dest="weights", action="store_false",
                   help="skip the return_attn_weights rows")
    p.add_argument("--graph-batches", default="1,8,64",
                   help="batches also timed as CUDA-graph replays (ours, SDPA, grouped eager). Default: "
                        "1,8,64")
    p.add_argument("--graph-calls", type=int, default=1,
                   help="calls per captured graph; times are per call (default 1: each replay's launch "
                        "included)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rep", type=int, default=None, help="timed runs; default adaptive (--target-ms)")
    p.add_argument("--target-ms", type=float, default=25.0)
    p.add_argument("--min-rep", type=int, default=10)
    p.add_argument("--max-rep", type=int, default=200)
    p.add_argument("--host-calls", type=int, default=None,
                   help="calls timed on the host (time.perf_counter, no synchronize) for `host us`, eager "
                        "rows of ours and SDPA; 0: no host column. Default: 200 (on CPU: 4)")
    p.add_argument("--host-chunk", type=int, default=25,
                   help="host-timed calls between synchronizes (keeps the GPU queue from filling). Default: "
                        "25")
    p.add_argument("--budget-s", type=float, default=140.0,
                   help="after this many seconds skip the remaining rows (0: no limit). Default: 140")
    p.add_argument("--check", action="store_true",
                   help="per config, ours (dense, sparse) against SDPA math / the reference on sequence 0")
    p.add_argument("--splits", default="",
                   help="also time ours_sparse (graph) with these split counts, e.g. 8,16,24,32,48 (rows "
                        "ours_sparse_sS)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--no-compile", action="store_true", help="run FlexAttention eagerly (always on CPU)")
    a = p.parse_args(argv)
    dev = torch.device(a.device)
    if a.configs is None:
        a.configs = DEFAULT_CONFIGS if dev.type == "cuda" else "1x1k,2x1k"
    try:
        a.configs = [harness.parse_decode_config(c) for c in a.configs.split(",") if c]
    except ValueError:
        p.error(f"--configs: expected BATCHxCONTEXT entries like 8x128k, got {a.configs!r}")
    a.impls = harness.csv_choices(p, "--impls", a.impls, IMPLS)
    a.graph_batches = {int(x) for x in a.graph_batches.split(",") if x}
    if a.host_calls is None:
        a.host_calls = 200 if dev.type == "cuda" else 4
    if a.host_calls < 0 or a.host_chunk < 1:
        p.error("--host-calls must be >= 0 and --host-chunk >= 1")
    if a.graph_calls < 1:
        p.error(f"--graph-calls must be >= 1, got {a.graph_calls}")
    a.splits = [int(x) for x in a.splits.split(",") if x]
    if a.hq % a.h:
        p.error("--hq must be a multiple of --h")
    return a


def main(argv=None) -> list[Row]:
    a = parse_args(argv)
    dev = torch.device(a.device)
    env = harness.env_stamp()
    harness.print_env(env)
    r = Runner(a, dev)
    sparse_decode, infllmv2_decode, r.ours_err = load_ours()
    flashinfer, fi_note = load_flashinfer() if "flashinfer" in a.impls else (None, "not requested")
    print(f"ours: {'ok' if sparse_decode else r.ours_err}; flashinfer: {'ok' if flashinfer else fi_note}",
          flush=True)
    flex, BlockMask = harness.setup_flex(dev, compile_=not a.no_compile, backward=False)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    validate = contextlib.nullcontext()
    with contextlib.suppress(Exception):
        from infllm_cupy import _env
        validate = _env.override(validate=False)   # value checks read the device: not part of a decode step
    check: list[str] = []
    copy = copy_bandwidth(r)
    with validate:
        for B, L in tqdm(a.configs, unit="config", disable=None):
            try:
                bench_config(r, B, L, flex, BlockMask, (sparse_decode, infllmv2_decode), flashinfer, fi_note,
                             check)
            except Exception as e:  # noqa: BLE001 - e.g. OOM building the cache: record it, go on
                r.rows.append(Row("config", config_id(B, L), note=f"config failed: {_short(e)}"))
                tqdm.write(f"config {config_id(B, L)} failed: {_short(e)}")
                harness.free_gpu_memory(dev)
            if a.json:
                harness.write_json(r.rows, a.json, env, extra={"argv": sys.argv[1:], "check": check})
    gl = goals(r.rows, copy if copy.us else None)
    gl38, line38 = goals_38(r.rows)
    peak = torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else float("nan")
    cols = ["config", "impl", "weights", "mode", "us", "host us", "GB/s", "MB", "note"]
    recs = [{**dataclasses.asdict(x), "host us": x.host_us, "GB/s": x.gbps,
             "MB": None if x.bytes is None else x.bytes / 1e6}
            for x in r.rows]
    print(f"\n### Decode, microseconds per step (median), HQ {a.hq} / H {a.h} / D {a.d}, bf16, "
          f"K = {a.topk + a.local_blocks} blocks; copy bandwidth {copy.gbps or float('nan'):.0f} GB/s; "
          f"{a.graph_calls} call(s) per captured graph\n")
    print(harness.markdown_table(recs, cols))
    print("\n### Goals (decode kernels)\n")
    print(harness.markdown_table(gl, ["goal", "config", "value", "target", "met", "detail"])
          if gl else "(no goal computable)")
    print("\n### Goals (eager calls)\n")
    print(harness.markdown_table(gl38, ["goal", "config", "value", "target", "met", "detail"]) if gl38
          else "(no goal computable)")
    print("\ngoals: " + line38)
    for c in check:
        print(c)
    print(harness.env_line(env, r.t0, f"peak GPU memory {peak:.1f} GiB"), flush=True)
    if a.json:
        harness.write_json(r.rows, a.json, env, extra={"argv": sys.argv[1:], "check": check, "goals": gl,
                                                       "goals_38": gl38, "goals_38_summary": line38,
                                                       "copy_gbps": copy.gbps, "peak_gib": peak,
                                                       "median_of": "CUDA events per step"})
    return r.rows


if __name__ == "__main__":
    main()
