r"""Stage-2 token-level sparse attention (ours) against the anchors, in one process.

    python benchmarks/bench_stage2.py --quick                                   # smoke run, one small config
    python benchmarks/bench_stage2.py --configs 32kx8,64kx4,128kx2 --K 64,96 --selections a,b,c \
        --modes fwd --json benchmarks/results/stage2.json

Implementations (rows):
    ours        infllm_cupy.stage2.sparse_attn_varlen on the token-level `topk_idx`
    sdpa_cudnn  torch SDPA dense causal, cuDNN backend, `[B, HQ, T, D]`, enable_gqa
    sdpa_flash  the same, flash backend
    flex_same   FlexAttention, 128x128 BlockMask with the same keys per query (K/2 tiles of 128 per
                128-token q tile: block 0 + diagonal + random earlier): block-level speed at equal work
    flex_union  FlexAttention, 128x128 BlockMask over the union of the 128 tokens' selected blocks: the
                least work an exact FlexAttention version of the selection must do (a superset of keys)
    nsa         fla NSA `parallel_nsa` with our selection as `block_indices` (if `fla` is importable)
Selections: (a) block-shared per 64-token q block, (b) per token, (c) InfLLM-like (infllm_cupy/selections.py).
Effective TFLOP/s count the keys each implementation attends (ours/nsa: selected, flex: its tiles,
sdpa: causal dense), causal clipping included; bwd = 2.5x, fwdbwd = 3.5x the forward.
Ratio columns = anchor ms / ours ms (> 1: ours is faster). Anchors that fail are recorded, not fatal.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import _harness as harness  # noqa: E402
from infllm_cupy import _env  # noqa: E402
from infllm_cupy._rules import KV_BLOCK  # noqa: E402
from infllm_cupy.selections import (  # noqa: E402
    SELECTION_NAMES,
    attended_keys,
    block_shared,
    infllm_like,
    make_selection,
    per_token,
    split_blocks,
    to_flex_block_mask_inputs,
    to_nsa_block_indices,
    uniform_cu_seqlens,
)

IMPLS = ("ours", "sdpa_cudnn", "sdpa_flash", "flex_same", "flex_union", "nsa")
ANCHORS = IMPLS[1:]


def load_ours():
    try:
        try:
            from infllm_cupy.stage2 import sparse_attn_varlen
        except ImportError:
            from infllm_cupy.stage2.attention import sparse_attn_varlen
        return sparse_attn_varlen, ""
    except Exception as e:  # noqa: BLE001 - not written yet, or broken: the anchors still run
        return None, f"not importable: {harness.short_error(e)}"


def load_nsa():
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from fla.ops.nsa import parallel_nsa
        return parallel_nsa, ""
    except Exception as e:  # noqa: BLE001 - optional dependency
        return None, f"fla not importable: {harness.short_error(e)}"


class Runner:
    def __init__(self, args, device: torch.device):
        self.args, self.device = args, device
        self.rows: list[harness.Row] = []
        self.t_start = time.perf_counter()
        self.check_failed = False

    def over_budget(self, impl: str) -> bool:
        # anchors stop at 80% of the budget so that ours (timed last) keeps the rest
        limit = self.args.budget_s * (1.0 if impl == "ours" else 0.8)
        return self.args.budget_s > 0 and time.perf_counter() - self.t_start > limit

    def time(self, row: harness.Row, forward: Callable | None, inputs, keys: float | None, *, skip: str = "",
             fail_prefix: str = "") -> harness.Row:
        """Time one row; any failure (or `skip`) is recorded in `row.note` and the run goes on."""
        a = self.args
        if keys is not None:
            row.keys_per_q = keys / self.n_q_rows
            row.flop = harness.flops_attn(keys, self.D, row.mode)
        why = harness.skip_reason(skip, forward, self.over_budget(row.impl), a.budget_s)
        if why:
            row.note = why
        else:
            fn = None
            try:
                fn = harness.make_fn(forward, inputs, row.mode)
                harness.time_row(row, fn, a, self.device)
            except Exception as e:  # noqa: BLE001 - one anchor failing must not kill the table
                no_autograd = isinstance(e, NotImplementedError) or "grad" in str(e).lower()
                row.note = ((row.note + "; " if row.note else "") + (fail_prefix if no_autograd else "")
                            + harness.short_error(e))
            finally:
                del fn
                self.free()
        self.rows.append(row)
        print(f"  {row.impl:<10} {row.config} sel={row.selection} K={row.K} {row.mode:<6} "
              f"ms={row.ms if row.ms is None else round(row.ms, 3)} "
              f"TFLOP/s={row.tflops if row.tflops is None else round(row.tflops, 1)} {row.note}", flush=True)
        return row

    def free(self):
        harness.free_gpu_memory(self.device)


def run_check(ours, args, device) -> str:
    """Ours against the naive reference on a reduced shape; returns a one-line verdict."""
    if ours is None:
        return "check skipped: ours not importable"
    try:
        from infllm_cupy.stage2.naive import naive_sparse_attn_varlen as naive
    except Exception as e:  # noqa: BLE001
        return f"check skipped: reference not importable ({harness.short_error(e)})"
    from infllm_cupy.testing import max_abs_err
    B, T, HQ, H, D = 2, 1024, args.hq, args.h, args.d
    g = torch.Generator(device=device).manual_seed(1234)
    q = torch.randn(B * T, HQ, D, generator=g, device=device).to(torch.bfloat16)
    k = torch.randn(B * T, H, D, generator=g, device=device).to(torch.bfloat16)
    v = torch.randn(B * T, H, D, generator=g, device=device).to(torch.bfloat16)
    cu = uniform_cu_seqlens(B, T, device)
    cases = [("a", 5, lambda K: block_shared(B, T, H, K, device=device, seed=1)),
             ("b", 5, lambda K: per_token(B, T, H, K, device=device, seed=2)),
             ("b", 16, lambda K: per_token(B, T, H, K, device=device, seed=3)),
             ("c", 9, lambda K: infllm_like(B, T, H, K, local_blocks=4, device=device, seed=4))]
    verdicts, ok_all = [], True
    for name, K, gen in cases:
        try:
            topk = gen(K)
            def call(f, *x, **kw):
                return f(*x, cu, cu, topk, T, T, causal=True, **kw)
            out = call(ours, q, k, v, **args.ours_kwargs)
            try:
                ref = call(naive, q.float(), k.float(), v.float()).float()
            except Exception:  # noqa: BLE001 - a reference that only takes bf16
                ref = call(naive, q, k, v).float()
            try:
                lowp = call(naive, q, k, v, upcast=False)
            except TypeError:
                lowp = call(naive, q, k, v)
            err, base = max_abs_err(out, ref), max_abs_err(lowp, ref)
            ok = bool(not torch.isnan(out).any()) and err <= 2 * base + 2e-3
            verdicts.append(f"{name}/K{K}: {'ok' if ok else 'FAIL'} err={err:.2e} (ref lowp {base:.2e})")
        except Exception as e:  # noqa: BLE001
            ok = False
            verdicts.append(f"{name}/K{K}: ERROR {harness.short_error(e)}")
        ok_all &= ok
    return ("check PASSED: " if ok_all else "check FAILED: ") + "; ".join(verdicts)


def bench_config(r: Runner, T: int, B: int, impls: list[str], ours, nsa, flex, BlockMask):
    """Time `impls` on one (T, B). Inputs and selections are seeded, so both passes see the same data."""
    a, dev = r.args, r.device
    HQ, H, D = a.hq, a.h, a.d
    G = HQ // H
    cfg = harness.shape_id(B, T, HQ, H, D)
    r.D, r.n_q_rows = D, B * T * HQ
    print(f"\n== {cfg}: {','.join(impls)}", flush=True)
    g = torch.Generator(device=dev).manual_seed(a.seed)
    q = torch.randn(B * T, HQ, D, generator=g, device=dev, dtype=torch.bfloat16)
    k = torch.randn(B * T, H, D, generator=g, device=dev, dtype=torch.bfloat16)
    v = torch.randn(B * T, H, D, generator=g, device=dev, dtype=torch.bfloat16)
    cu = uniform_cu_seqlens(B, T, dev)
    # [B, T, heads, D] views for NSA; [B, heads, T, D] contiguous copies for SDPA and Flex
    q4, k4, v4 = (x.view(B, T, x.shape[1], D) for x in (q, k, v))
    need_bhtd = any(i in impls for i in ("sdpa_cudnn", "sdpa_flash", "flex_same", "flex_union"))
    qt, kt, vt = ((x.transpose(1, 2).contiguous() for x in (q4, k4, v4)) if need_bhtd else (None,) * 3)

    # dense SDPA, once per config
    dense_keys = harness.causal_dense_keys(B, T, HQ)
    for impl in ("sdpa_cudnn", "sdpa_flash"):
        if impl not in impls:
            continue
        from torch.nn.attention import SDPBackend, sdpa_kernel
        backend = SDPBackend.CUDNN_ATTENTION if impl == "sdpa_cudnn" else SDPBackend.FLASH_ATTENTION

        def sdpa(q_, k_, v_, backend=backend, gqa=True):
            with sdpa_kernel([backend]):
                return torch.nn.functional.scaled_dot_product_attention(q_, k_, v_, is_causal=True,
                                                                        enable_gqa=gqa)

        for mode in a.modes:
            row = r.time(harness.Row(impl, cfg, "-", None, mode), sdpa, (qt, kt, vt), dense_keys)
            if row.ms is None and dev.type == "cuda" and not row.note.startswith("skipped"):
                # GQA refused by this backend: time it on K/V repeated to HQ heads instead
                r.rows.pop()
                kr, vr = (x.repeat_interleave(G, dim=1) for x in (kt, vt))
                r.time(harness.Row(impl, cfg, "-", None, mode, note=f"KV repeated ({row.note[:80]})"),
                       lambda q_, k_, v_: sdpa(q_, k_, v_, gqa=False), (qt, kr, vr), dense_keys)
                del kr, vr

    def flex_fn(fb):
        bm = BlockMask.from_kv_blocks(fb.kv_num_blocks, fb.kv_indices, fb.full_kv_num_blocks,
                                      fb.full_kv_indices,
                                      BLOCK_SIZE=(128, 128), mask_mod=harness.causal_mask, seq_lengths=(T, T))
        return lambda q_, k_, v_: flex(q_, k_, v_, block_mask=bm, enable_gqa=True)

    def time_flex(impl, label, K, sel):
        fn, keys, note = None, None, ""
        try:
            fb = to_flex_block_mask_inputs(sel, B, T, HQ)
            keys, fn = fb.keys, flex_fn(fb)
            del fb
        except Exception as e:  # noqa: BLE001
            note = f"setup: {harness.short_error(e)}"
        for mode in a.modes:
            r.time(harness.Row(impl, cfg, label, K, mode), fn, (qt, kt, vt), keys, skip=note)
        del fn
        r.free()

    for K in tqdm(a.K, desc=f"{cfg} K", disable=None, leave=False):
        if "flex_same" in impls:
            # K/2 tiles of 128 keys per 128-token q tile (block 0 + diagonal + random earlier), as 64-blocks
            sel = split_blocks(block_shared(B, T, H, K // 2, block_size=128, device=dev, seed=a.seed + K), 2)
            time_flex("flex_same", "-", K, sel)
            del sel
        if not any(i in impls for i in ("ours", "flex_union", "nsa")):
            continue
        for si, s in enumerate(tqdm(a.selections, desc=f"K={K} selections", disable=None, leave=False)):
            label = f"{s}:{SELECTION_NAMES[s]}"
            topk = make_selection(s, B, T, H, K, device=dev, seed=a.seed + 1000 * K + si)
            keys = G * int(attended_keys(topk, cu).sum())
            if "ours" in impls:
                def ours_fwd(q_, k_, v_, topk=topk):
                    return ours(q_, k_, v_, cu, cu, topk, T, T, causal=True, **a.ours_kwargs)
                for mode in a.modes:
                    r.time(harness.Row("ours", cfg, label, K, mode,
                                       note="CHECK FAILED" if r.check_failed else ""),
                           ours_fwd if ours else None, (q, k, v), keys, skip="" if ours else r.ours_err,
                           fail_prefix="" if mode == "fwd" else "skipped, no backward yet: ")
            if "flex_union" in impls:
                time_flex("flex_union", label, K, topk)
            if "nsa" in impls:
                fn = bi = bc = None
                if nsa:
                    bi, bc = to_nsa_block_indices(topk, B, T)

                    def fn(q_, k_, v_, bi=bi, bc=bc):
                        return nsa(q_, k_, v_, block_indices=bi, block_counts=bc, block_size=KV_BLOCK,
                                   window_size=0)
                for mode in a.modes:
                    r.time(harness.Row("nsa", cfg, label, K, mode), fn, (q4, k4, v4), keys,
                           skip="" if nsa else r.nsa_err)
                fn = bi = bc = None
            del topk
            r.free()
    q = k = v = q4 = k4 = v4 = qt = kt = vt = None
    r.free()


IMPL_ORDER = {i: n for n, i in enumerate(IMPLS)}


def sort_rows(rows: list[harness.Row]) -> list[harness.Row]:
    """Config order as run, then K, selection, implementation, mode."""
    cfg_order = {}
    for x in rows:
        cfg_order.setdefault(x.config, len(cfg_order))
    return sorted(rows, key=lambda x: (cfg_order[x.config], x.K or 0, x.selection, IMPL_ORDER.get(x.impl, 99),
                                       harness.MODES.index(x.mode) if x.mode in harness.MODES else 9))


def add_ratios(rows: list[harness.Row]) -> None:
    """ours.ratios[anchor] = anchor ms / ours ms, matched on what the anchor depends on."""
    def key(row: harness.Row, impl: str):
        if impl.startswith("sdpa"):
            return (impl, row.config, row.mode)
        if impl == "flex_same":
            return (impl, row.config, row.K, row.mode)
        return (impl, row.config, row.selection, row.K, row.mode)

    index = {key(x, x.impl): x for x in rows if x.impl in ANCHORS and x.ms}
    for x in rows:
        if x.impl == "ours" and x.ms:
            x.ratios = {i: index[key(x, i)].ms / x.ms for i in ANCHORS if key(x, i) in index}


def pivot(rows: list[harness.Row], field: str) -> tuple[list[dict], list[str]]:
    """One line per (config, selection, K, mode) of the ours rows: ms per implementation, or ratios."""
    add_ratios(rows)
    out = []
    by = {}
    for x in rows:
        by.setdefault(x.impl, {})[(x.config, x.selection, x.K, x.mode)] = x
    for x in rows:
        if x.impl != "ours":
            continue
        rec = {"config": x.config, "selection": x.selection, "K": x.K, "mode": x.mode, "ours_ms": x.ms,
               "ours_TFLOP/s": x.tflops}
        for i in ANCHORS:
            if field == "ratio":
                rec[i] = x.ratios.get(i)
            else:
                k = (x.config, "-" if i.startswith("sdpa") or i == "flex_same" else x.selection,
                     None if i.startswith("sdpa") else x.K, x.mode)
                rec[i] = by.get(i, {}).get(k).ms if by.get(i, {}).get(k) else None
        out.append(rec)
    cols = ["config", "selection", "K", "mode", "ours_ms", "ours_TFLOP/s", *ANCHORS]
    return out, cols


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    harness.add_run_args(p, target_ms=600.0, min_rep=3, max_rep=20)
    p.add_argument("--K", default="64,96",
                   help="selected 64-key blocks per query, comma-separated. Default: 64,96")
    p.add_argument("--selections", default="a,b,c", help="a (block-shared), b (per-token), c (InfLLM-like)")
    p.add_argument("--modes", default="fwd",
                   help=f"comma-separated subset of {','.join(harness.MODES)}. Default: fwd")
    p.add_argument("--impls", default=",".join(IMPLS), help=f"subset of {','.join(IMPLS)}")
    p.add_argument("--skip-check", action="store_true",
                   help="skip ours-vs-reference check on a reduced shape")
    p.add_argument("--ours-kwargs", default="{}", type=json.loads,
                   help='extra keyword arguments for our op, as JSON, e.g. \'{"kernel": "sm80"}\' (the SM80 '
                        'kernels '
                        'on an H100)')
    p.add_argument("--validate", action="store_true",
                   help="keep our launcher's value checks (a host sync per call) while timing; the check "
                        "runs them")
    a = p.parse_args(argv)
    dev = torch.device(a.device)
    if a.configs is None:
        a.configs = ("8kx2" if dev.type == "cuda" else "512x2") if a.quick else harness.README_CONFIGS
    a.configs = [harness.parse_config(c) for c in a.configs.split(",") if c]
    a.K = [int(x) for x in a.K.split(",") if x]
    a.selections = harness.csv_choices(p, "--selections", a.selections, SELECTION_NAMES)
    a.modes = harness.csv_choices(p, "--modes", a.modes, harness.MODES)
    a.impls = harness.csv_choices(p, "--impls", a.impls, IMPLS)
    harness.check_run_args(p, a, quick_target_ms=200.0, quick_max_rep=10)
    return a


def main(argv=None) -> list[harness.Row]:
    a = parse_args(argv)
    dev = torch.device(a.device)
    env = harness.env_stamp()
    harness.print_env(env)
    r = Runner(a, dev)
    ours, r.ours_err = load_ours()
    nsa, r.nsa_err = (load_nsa() if "nsa" in a.impls else (None, "not requested"))
    print(f"ours: {'ok' if ours else r.ours_err}; nsa: {'ok' if nsa else r.nsa_err}", flush=True)

    flex, BlockMask = harness.setup_flex(dev, compile_=not a.no_compile,
                                         backward=any(m != "fwd" for m in a.modes))

    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    # pass 1: the anchors; pass 2: ours (after its check), so that a crash in ours cannot cost the anchors
    anchors = [i for i in a.impls if i != "ours"]
    check = "check not run (ours not requested)"
    stack = contextlib.ExitStack()
    for phase, impls in (("anchors", anchors), ("ours", ["ours"] if "ours" in a.impls else [])):
        if not impls:
            continue
        if phase == "ours":
            check = "check skipped (--skip-check)" if a.skip_check else run_check(ours, a, dev)
            r.check_failed = check.startswith("check FAILED")
            print(check, flush=True)
            if not a.validate:  # the launcher's input validation reads cu_seqlens on the host: not timed
                stack.enter_context(_env.override(validate=False))
        for T, B in tqdm(a.configs, desc=phase, unit="config", disable=None):
            try:
                bench_config(r, T, B, impls, ours, nsa, flex, BlockMask)
            except Exception as e:  # noqa: BLE001 - e.g. OOM building inputs: record it, go on
                r.rows.append(harness.Row(phase, harness.shape_id(B, T, a.hq, a.h, a.d),
                                          note=f"config failed: {harness.short_error(e)}"))
                print(f"config {T}x{B} ({phase}) failed: {harness.short_error(e)}", flush=True)
                r.free()
            if a.json:
                harness.write_json(sort_rows(r.rows), a.json, env,
                                   extra={"check": check, "argv": sys.argv[1:]})

    stack.close()   # validation back on: leave the process as we found it (main() may run in-process)
    peak = torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else float("nan")
    add_ratios(r.rows)
    r.rows = sort_rows(r.rows)
    harness.print_table(
        r.rows, title="All rows (ms = median; TFLOP/s effective on attended keys; keys_per_q per query head)")
    for field, title in (("ms", "ms per implementation (median)"),
                         ("ratio", "anchor ms / ours ms (> 1: ours faster)")):
        recs, cols = pivot(r.rows, field)
        print(f"\n{title}")
        print(harness.format_table(recs, cols) if recs else "(no ours rows)")
    print(f"\n{check}")
    print(harness.env_line(env, r.t_start, f"peak GPU memory {peak:.1f} GiB"), flush=True)
    if a.json:
        harness.write_json(r.rows, a.json, env,
                           extra={"check": check, "argv": sys.argv[1:], "peak_gib": peak})
    return r.rows


if __name__ == "__main__":
    main()
