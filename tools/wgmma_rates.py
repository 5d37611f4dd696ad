"""Sustained wgmma rates of the dk/dv kernel's product shapes (development tool).

    python tools/wgmma_rates.py [--iters 4000] [--sustain 4]
    python tools/wgmma_rates.py --compile-only      # NVRTC alone, no GPU: print ptxas' log

Compiles tools/wgmma_rates.cu for sm_90a and times each MODE (see its header) with 1 and 2
CTAs per SM (CUDA events, median of 5). TFLOP/s are counted on the products issued; the bf16 dense
peak of an H100 SXM is about 989. Needs a GPU of capability 9.0. `--sustain S` also runs each mode
at 2 CTAs per SM back to back for S seconds under nvidia-smi sampling (tools/clock_probe.py):
short runs go at boost clock, long ones at whatever the power cap leaves.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import cupy as cp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from infllm_cupy import _jit

TILE_FLOPS = 4 * 2 * 64 * 64 * 128
FLOPS = {0: TILE_FLOPS // 2, 1: TILE_FLOPS // 2, 2: TILE_FLOPS, 3: TILE_FLOPS, 4: TILE_FLOPS, 5: TILE_FLOPS,
         6: TILE_FLOPS, 7: TILE_FLOPS, 8: TILE_FLOPS}
LABEL = {0: "S^T,dP^T SS m64n64", 1: "dV,dK RS m64n128", 2: "both, waited", 3: "S^T,dP^T SS m64n128",
         4: "both + exp2/dS/pack", 5: "4 + Q/dO 32 KB loads", 6: "4 pipelined", 7: "5 pipelined",
         8: "7, exp2 as one FMA"}


SOURCE = Path(__file__).parent / "wgmma_rates.cu"
NAMES = [f"wgmma_rates<{m}>" for m in FLOPS]


def options() -> tuple[str, ...]:
    return tuple(_jit.BASE_OPTIONS) + _jit._include_options() + ("--gpu-architecture=sm_90a",)


def ptxas_log() -> str:
    """Compile every mode with NVRTC alone (no GPU needed) and return ptxas' log."""
    return _jit.compile_report(SOURCE.name, NAMES, "sm_90a", code=SOURCE.read_text()).log


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--iters", type=int, default=4000)
    p.add_argument("--sustain", type=float, default=0.0)
    p.add_argument("--modes", default=",".join(str(m) for m in FLOPS))
    p.add_argument("--compile-only", action="store_true",
                   help="compile every mode with NVRTC alone (no GPU needed), print ptxas' log and exit")
    a = p.parse_args()
    if a.compile_only:
        print(f"wgmma_rates: {len(NAMES)} instances for sm_90a")
        print(ptxas_log())
        return
    modes = [int(m) for m in a.modes.split(",")]
    mod = cp.RawModule(code=SOURCE.read_text(), options=options(), name_expressions=NAMES)
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    out = cp.empty(sms * 2 * 128, dtype=cp.float32)
    n_chunks = 512                       # 16 MB of Q/dO tiles: L2-resident
    src = (cp.random.standard_normal(n_chunks * 2 * 64 * 128,
                                     dtype=cp.float32) * 0.5).astype(cp.float16).view(cp.uint8)
    print(f"{cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}, {sms} SMs, iters {a.iters}")
    for per_sm, smem in ((1, 160 * 1024), (2, 100 * 1024)):
        for m in modes:
            flop = FLOPS[m]
            k = mod.get_function(f"wgmma_rates<{m}>")
            k.max_dynamic_shared_size_bytes = smem
            grid = sms * per_sm
            times = []
            for _ in range(6):
                e0, e1 = cp.cuda.Event(), cp.cuda.Event()
                e0.record()
                k((grid,), (128,), (out, src, cp.int32(n_chunks), cp.int32(a.iters)), shared_mem=smem)
                e1.record()
                e1.synchronize()
                times.append(cp.cuda.get_elapsed_time(e0, e1))
            ms = statistics.median(times[1:])
            tf = flop * a.iters * grid / (ms * 1e-3) / 1e12
            print(f"  {per_sm} CTA/SM  mode {m} {LABEL[m]:<24} {ms:8.3f} ms  {tf:6.0f} TFLOP/s", flush=True)
            if a.sustain > 0 and per_sm == 2:
                from clock_probe import report, sample_while  # tools/clock_probe.py (this script's folder)

                def run(k=k, grid=grid, smem=smem):
                    k((grid,), (128,), (out, src, cp.int32(n_chunks), cp.int32(a.iters)), shared_mem=smem)
                    cp.cuda.runtime.deviceSynchronize()
                ms_s, rows = sample_while(run, a.sustain, sync=cp.cuda.runtime.deviceSynchronize)
                report(f"    sustained {1e-9 * flop * a.iters * grid / ms_s:5.0f} TFLOP/s", ms_s, rows)


if __name__ == "__main__":
    main()
