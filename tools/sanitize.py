"""Every kernel family at small sizes under NVIDIA compute-sanitizer's four tools (docs/reliability.md,
"Sanitizers").

    python tools/sanitize.py                              # memcheck, racecheck, synccheck, initcheck
    python tools/sanitize.py --tools memcheck,synccheck          # two tools per device call (< 5 min)
    python tools/sanitize.py --tools racecheck,initcheck --no-warmup
    python tools/sanitize.py --tools memcheck --families stage2,decode
    python tools/sanitize.py --driver                     # the workload alone (no sanitizer)
    python tools/sanitize.py --list                       # families and the kernel-name filter

One subprocess per tool runs `compute-sanitizer --tool T --error-exitcode 99 ... python
tools/sanitize.py --driver`; the driver runs each family once (compression; stage 1 SM80 and sm_90a;
stage-2 forward and backward, SM80 and sm_90a, token level and block layouts; decode: cache append,
sparse_decode with weights, the decode step's split stage-1 kernels; patterns through the stage-2
and decode kernels). The summary counts the findings per tool in our kernels (names from the
launchers' registered instances) and, apart, in others (torch's own kernels, which initcheck may
flag): only ours fail the run. racecheck instruments only our kernels (`--kernel-regex`), which also
keeps it fast; the other tools see every kernel. PyTorch's caching allocator is switched off in the
driver (`PYTORCH_NO_CUDA_MEMORY_CACHING=1`) so that memcheck sees each tensor as its own allocation:
an access past a tensor's end is then an access past an allocation. Exit status 1 when any tool
reports a finding in our kernels or fails to run; the per-tool logs go to `--log-dir`.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[1]))

TOOLS = ("memcheck", "racecheck", "synccheck", "initcheck")
FAMILIES = ("compress", "stage1", "stage2", "layout", "decode", "patterns")


# --------------------------------------------------------------------------------------------
# the workload (runs under the sanitizer)
# --------------------------------------------------------------------------------------------
def _hopper(torch) -> bool:
    return torch.cuda.get_device_capability() == (9, 0)


def drive(families: list[str], dev: str = "cuda") -> None:
    """Each family once at small sizes. `dev="cpu"` runs the same calls on the references (the ops'
    CPU path): a check of this driver itself, without a GPU."""
    import torch

    import infllm_cupy as ic
    import infllm_cupy.patterns as icp
    from infllm_cupy.testing import cu_seqlens_from_lengths, random_topk_idx

    g = torch.Generator().manual_seed(0)
    on_gpu = dev == "cuda"
    kernels = (["sm80"] + (["sm90a"] if _hopper(torch) else [])) if on_gpu else ["auto"]
    backend = "kernels" if on_gpu else "auto"      # "kernels": a call the kernels cannot take fails loudly
    bf = torch.bfloat16

    def rnd(*shape, dtype=bf):
        return torch.randn(*shape, generator=g).to(dev, dtype)

    def step(name: str, fn) -> None:
        t0 = time.perf_counter()
        fn()
        if on_gpu:
            torch.cuda.synchronize()
        print(f"driver: {name} ok ({time.perf_counter() - t0:.1f} s)", flush=True)

    # a ragged batch with a one-token and a zero-length sequence, lengths off the 64 grid
    lens = [130, 1, 0, 77]
    cu = cu_seqlens_from_lengths(lens, dev)
    T = sum(lens)

    if "compress" in families:
        for D in (64, 128):
            k = rnd(T, 2, D)
            step(f"compress D={D}", lambda: (ic.compress_k(k, cu, 32, 16, backend=backend),
                                             ic.compress_k(k, cu, 128, 64, backend=backend)))

    if "stage1" in families:
        for kernel in kernels:
            for HQ, H, D in ((16, 1, 128), (4, 2, 64)):
                q, k = rnd(T, HQ, D), 4 * rnd(T, H, D)
                ck1, cu1 = ic.naive_compress_k(k, cu, 32, 16)
                ck2, cu2 = ic.naive_compress_k(k, cu, 128, 64)
                step(f"stage1 {kernel} HQ={HQ} H={H} D={D}",
                     lambda: ic.stage1_select(q, ck1, ck2, cu, cu1, cu2, max(lens), topk=3, local_blocks=1,
                                              return_scores=True, backend=backend, kernel=kernel))

        if on_gpu:      # key-range passes and the merge kernel (docs/stage1.md §9): 65 blocks, ranges of 64
            import dataclasses

            from infllm_cupy.stage1 import select as sel
            lr = [4160 - 7]
            cur = cu_seqlens_from_lengths(lr, dev)
            q, k = rnd(lr[0], 16, 128), 4 * rnd(lr[0], 1, 128)
            ck1, cu1 = ic.naive_compress_k(k, cur, 32, 16)
            ck2, cu2 = ic.naive_compress_k(k, cur, 128, 64)
            for kernel in kernels:
                plan = dataclasses.replace(sel.device_stage1_plan(q.device, 16, 128, bf, bf, -(-lr[0] // 64),
                                                                  rows=lr[0], kernel=kernel),
                                           range_blocks=64, block_keys_in_smem=True)
                step(f"stage1 key ranges + merge kernel {kernel}",
                     lambda: sel.launch_select(q, ck1, ck2, cur, cu1, cu2, lr[0], topk=3, local_blocks=1,
                                               kernel=kernel, plan=plan))

    def fwd_bwd(op, *args, kernel):
        q, k, v = (t.clone().requires_grad_() for t in args[:3])
        out = op(q, k, v, *args[3:], backend=backend, kernel=kernel)
        torch.autograd.grad(out, (q, k, v), torch.randn_like(out))

    if "stage2" in families:
        for kernel in kernels:
            for HQ, H, D in ((16, 1, 128), (6, 2, 64)):
                q, k, v = rnd(T, HQ, D), rnd(T, H, D), rnd(T, H, D)
                idx = random_topk_idx(H, lens, lens, 5, generator=g, empty_rows=True).to(dev)
                step(f"stage2 fwd+bwd {kernel} HQ={HQ} H={H} D={D}",
                     lambda: fwd_bwd(ic.sparse_attn_varlen, q, k, v, cu, cu, idx, max(lens), max(lens),
                                     kernel=kernel))

    if "layout" in families:
        for kernel in kernels:
            HQ, H, D = 8, 2, 128
            q, k, v = rnd(T, HQ, D), rnd(T, H, D), rnd(T, H, D)
            mask = torch.rand(len(lens), H, 3, 3, generator=g) < 0.5
            lay = ic.BlockLayout(mask.to(dev), 64)
            step(f"block layout fwd+bwd {kernel}",
                 lambda: fwd_bwd(ic.block_sparse_attn_varlen, q, k, v, cu, cu, lay, max(lens), max(lens),
                                 kernel=kernel))

    if "decode" in families:
        B, HQ, H, D = 3, 16, 2, 128
        table = torch.randperm(B * 3 + 1, generator=g)[:B * 3].view(B, 3).to(torch.int32).to(dev)
        cache = ic.DecodeCache.paged(B * 3 + 1, 128, H, D, table, dtype=bf, device=dev)
        first = [200, 0, 65]
        step("decode cache append (chunk, then one token)",
             lambda: (cache.append(rnd(sum(first), H, D), rnd(sum(first), H, D),
                                   cu_seqlens_from_lengths(first, dev)),
                      cache.append(rnd(B, H, D), rnd(B, H, D))))
        q = rnd(B, HQ, D)
        idx = random_topk_idx(H, [1] * B, cache.lengths(), 4, generator=g).to(dev)
        step("sparse_decode (selected, with weights)",
             lambda: ic.sparse_decode(q, cache, idx, return_lse=True, return_attn_weights=True))
        step("sparse_decode (dense)", lambda: ic.sparse_decode(q, cache, None, return_lse=True))
        cfg = ic.InfLLMv2Config(topk=2, local_blocks=1, dense_len=64)
        step("infllmv2_decode (split stage-1 kernels)",
             lambda: ic.infllmv2_decode(q, cache, config=cfg, return_topk_idx=True))

    if "patterns" in families:
        HQ, H, D = 4, 2, 64
        q, k, v = rnd(T, HQ, D), rnd(T, H, D), rnd(T, H, D)
        lay = icp.local_stride(H, max(lens) + 1, block_size=64, local_blocks=1, vert_stride=2)
        step("local_stride through the stage-2 kernels",
             lambda: fwd_bwd(ic.block_sparse_attn_varlen, q, k, v, cu, cu, lay, max(lens), max(lens),
                             kernel="auto"))
        from infllm_cupy.patterns import qhead_block_sparse_attn_varlen
        lay_q = icp.local_stride(HQ, max(lens) + 1, block_size=64, local_blocks=1, vert_stride=2,
                                homo_head=False)
        for kernel in kernels:
            step(f"per-query-head rows fwd+bwd {kernel}",
                 lambda: fwd_bwd(qhead_block_sparse_attn_varlen, q, k, v, cu, cu, lay_q, max(lens), max(lens),
                                 kernel=kernel))
        cache = ic.DecodeCache.contiguous(len(lens), max(lens) + 2, H, D, dtype=bf, device=dev)
        cache.append(k, v, cu)
        cache.append(rnd(len(lens), H, D), rnd(len(lens), H, D))
        step("pattern_decode", lambda: icp.pattern_decode(rnd(len(lens), HQ, D), cache, lay))


# --------------------------------------------------------------------------------------------
# the sanitizer runs and their summaries
# --------------------------------------------------------------------------------------------
def our_kernel_names() -> list[str]:
    """Base names of every kernel instance the launchers register (template arguments dropped)."""
    import infllm_cupy  # noqa: F401  (imports every launcher, which registers its instances)
    from infllm_cupy import _jit

    names = {re.split(r"[<(\s]", n, maxsplit=1)[0] for ks in _jit.registered() for n in ks.names}
    return sorted(n for n in names if n)


_SKIP_HEADS = ("COMPUTE-SANITIZER", "ERROR SUMMARY", "RACECHECK SUMMARY", "LEAK SUMMARY",
               "Target application",
               "Saved host backtrace", "Program hit", "Warning:", "WARNING:", "Note:", "Host Frame",
               "Device Frame")
_NAME_RE = re.compile(r"([A-Za-z_]\w*)\s*[<(]")


def _kernel_of(text: str, ours: list[str]) -> str | None:
    """The kernel a report line names: the first identifier followed by `<` or `(` that is one of
    ours, else the first that is not a keyword (`at 0x70 in file.cu:5:name(args)`, `at name(args)+0x70`,
    `... access at 0x.. in name<...>(...)`)."""
    names = [n for n in _NAME_RE.findall(text) if n not in ("void", "in", "at", "of", "and", "by", "size")]
    for n in names:
        if n in ours:
            return n
    return names[0] if names else None


def parse_findings(log: str, ours: list[str]) -> tuple[int | None, dict, dict]:
    """`(error_summary_count, ours, others)`: the count on compute-sanitizer's ERROR SUMMARY line
    (None if absent) and the reports grouped as `{(message, kernel): count}`, split by whether the
    kernel is one of ours. A report is a line `========= <message>` (one space); the lines under it
    (`=========     at ...`) name the kernel."""
    summary = None
    reports: list[list] = []
    for line in log.splitlines():
        if not line.startswith("========="):
            continue
        body = line[len("========="):]
        text = body.strip()
        if m := re.search(r"ERROR SUMMARY: (\d+) error", body):
            summary = int(m.group(1))
        elif body.startswith(" ") and not body.startswith("  ") and text and not text.startswith(_SKIP_HEADS):
            msg = re.sub(r"0x[0-9a-fA-F]+", "0x..", text)
            reports.append([re.split(r" (?:at|in) ", msg)[0][:120], _kernel_of(text, ours)])
        elif reports and reports[-1][1] is None and text:
            reports[-1][1] = _kernel_of(text, ours)
    ours_f: dict = {}
    others: dict = {}
    for msg, kern in reports:
        kern = kern or "?"
        bucket = ours_f if kern in ours else others
        bucket[(msg, kern)] = bucket.get((msg, kern), 0) + 1
    return summary, ours_f, others


def _sanitize(cmd: list[str], timeout: int) -> tuple[str, int | None]:
    env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1", PYTHONUNBUFFERED="1")
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        return p.stdout + p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return out + f"\n(timed out after {timeout} s)", None


def run_tool(tool: str, exe: str, families: list[str], ours: list[str], log_dir: Path, timeout: int) -> dict:
    base = [exe, "--tool", tool, "--error-exitcode", "99", "--report-api-errors", "no", "--print-limit",
            "200"]
    extra = []
    if tool == "racecheck":
        extra = ["--racecheck-report", "hazard", "--kernel-regex", "kns=" + "|".join(ours)]
    driver = [sys.executable, str(HERE), "--driver", "--families", ",".join(families)]
    t0 = time.perf_counter()
    cmd = base + extra + driver
    log, rc = _sanitize(cmd, timeout)
    if "driver:" not in log and extra and ("nrecognized" in log or "nvalid" in log or "nknown" in log):
        # an older compute-sanitizer without the kernel filter: every kernel instrumented
        cmd = base + driver
        log, rc = _sanitize(cmd, timeout)
    seconds = time.perf_counter() - t0
    (log_dir / f"{tool}.log").write_text(" ".join(cmd) + "\n" + log)
    summary, ours_f, others = parse_findings(log, ours)
    return {"tool": tool, "rc": rc, "seconds": seconds, "summary": summary, "ours": ours_f, "others": others,
            "completed": "driver: done" in log, "tail": log[-3000:]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tools", default=",".join(TOOLS))
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--driver", action="store_true", help="run the workload (what the sanitizer wraps)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="driver only: cpu runs the same calls on the references (checks the driver)")
    p.add_argument("--list", action="store_true", help="print the families and our kernel names, then exit")
    p.add_argument("--sanitizer", default=None, help="compute-sanitizer executable (default: on PATH or in "
                                                     "/usr/local/cuda/bin)")
    p.add_argument("--log-dir", default="sanitize_logs")
    p.add_argument("--timeout", type=int, default=140, help="seconds per tool")
    p.add_argument("--no-warmup", action="store_true", help="skip the plain driver run before the tools")
    args = p.parse_args()
    families = [f for f in args.families.split(",") if f]
    bad = sorted(set(families) - set(FAMILIES))
    if bad:
        p.error(f"unknown families {bad}; choose from {FAMILIES}")
    if args.driver:
        drive(families, args.device)
        print("driver: done", flush=True)
        return 0
    ours = our_kernel_names()
    if args.list:
        print("families:", ", ".join(FAMILIES))
        print("our kernels:", ", ".join(ours))
        return 0
    tools = [t for t in args.tools.split(",") if t]
    if set(tools) - set(TOOLS):
        p.error(f"unknown tools {sorted(set(tools) - set(TOOLS))}; choose from {TOOLS}")
    exe = args.sanitizer or shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
    if not Path(exe).exists() and not shutil.which(exe):
        print(f"compute-sanitizer not found ({exe}); pass --sanitizer", file=sys.stderr)
        return 2
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    # the workload alone first: it compiles every kernel into CuPy's disk cache (the sanitized runs
    # then load them), and a failure here is the workload's, not a sanitizer finding
    t0 = time.perf_counter()
    driver = [sys.executable, str(HERE), "--driver", "--families", ",".join(families)]
    warm = (subprocess.CompletedProcess([], 0, "", "") if args.no_warmup
            else subprocess.run(driver, capture_output=True, text=True, timeout=args.timeout))
    (log_dir / "warmup.log").write_text(warm.stdout + warm.stderr)
    print("warm-up (no sanitizer): " + ("skipped" if args.no_warmup else
                                          f"{'ok' if warm.returncode == 0 else 'FAILED'}, "
                                          f"{time.perf_counter() - t0:.0f} s"), flush=True)
    if warm.returncode != 0:
        print((warm.stdout + warm.stderr)[-3000:])
        print("sanitize: FAIL (the workload fails without a sanitizer)")
        return 1
    failed = False
    for tool in tools:
        r = run_tool(tool, exe, families, ours, log_dir, args.timeout)
        n_ours = sum(r["ours"].values())
        n_other = sum(r["others"].values())
        ok = r["completed"] and n_ours == 0
        failed |= not ok
        print(f"{tool}: {'PASS' if ok else 'FAIL'}: {n_ours} findings in our kernels, {n_other} in others, "
              f"sanitizer error summary {r['summary']}, exit {r['rc']}, {r['seconds']:.0f} s, "
              f"workload {'completed' if r['completed'] else 'DID NOT COMPLETE'} (log "
              f"{log_dir / (tool + '.log')})",
              flush=True)
        for (msg, kern), n in sorted(r["ours"].items()):
            print(f"    ours   {n:4d} x {kern}: {msg}")
        for (msg, kern), n in sorted(r["others"].items()):
            print(f"    other  {n:4d} x {kern}: {msg}")
        if not r["completed"]:
            print("    last output:\n" + "\n".join("      " + s for s in r["tail"].splitlines()[-25:]))
    print("sanitize: " + ("FAIL" if failed else "PASS"), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
