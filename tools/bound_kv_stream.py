"""How fast can any stage-2 forward stream the K/V blocks a selection names? (development tool)

    python tools/bound_kv_stream.py --T 131072 --B 2 --K 64 --sel b

Two read-only kernels (no Q, no math: each XOR-folds what it reads into one word per warp, so
nothing is optimised away and nearly nothing is written), timed with CUDA events next to our
stage-2 forward on the same selection:
  per_token  one warp per (token, KV head) reads the K and V rows of each of its selected blocks:
             the traffic of a kernel that shares nothing between tokens (fla NSA's forward).
  union8     one CTA per 8 consecutive tokens of a KV head reads each block of their union once:
             the traffic of a kernel that shares loads between the 8 tokens (ours: 2 consumer
             warpgroups x 4 tokens at G = 16 share each K/V stage).
The kernels live here, not in kernels_cu/: they are a measurement, not part of the library.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import cupy
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._harness import bench_gpu_time
from infllm_cupy.selections import make_selection, uniform_cu_seqlens


def current_stream():
    """CuPy's view of torch's current stream (this tool launches its probe kernels through CuPy)."""
    return cupy.cuda.Stream.from_external(torch.cuda.current_stream())

SOURCE = r"""
// K/V rows: [total_k, H, D] 16-bit elements; a 64-key block of head h is 64 rows of D * 2 bytes.
// topk: [H, total_q, K] int32, local block indices, -1 tail; token t of sequence b sees blocks <= t / 64.
extern "C" __global__ void per_token(const uint4* __restrict__ k, const uint4* __restrict__ v,
                                     const int* __restrict__ topk, const int* __restrict__ cu,
                                     unsigned* __restrict__ out, int total_q, int H, int D, int K, int T) {
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
    if (warp >= total_q * H) return;
    const int h = warp / total_q, tq = warp % total_q;
    const int b = tq / T, t = tq % T, ks = cu[b];
    const int CH = D / 8;                                   // uint4 per row
    uint4 acc = make_uint4(0, 0, 0, 0);
    for (int i = 0; i < K; ++i) {
        const int j = topk[((long long)h * total_q + tq) * K + i];
        if (j < 0 || j > t / 64) continue;
        const long long row0 = (long long)(ks + j * 64) * H + h;
        for (int x = lane; x < 64 * CH; x += 32) {
            const long long off = (row0 + (long long)(x / CH) * H) * CH + x % CH;
            const uint4 a = __ldg(k + off), c = __ldg(v + off);
            acc.x ^= a.x ^ c.x; acc.y ^= a.y ^ c.y; acc.z ^= a.z ^ c.z; acc.w ^= a.w ^ c.w;
        }
    }
    unsigned r = acc.x ^ acc.y ^ acc.z ^ acc.w;
    for (int o = 16; o > 0; o >>= 1) r ^= __shfl_xor_sync(0xffffffffu, r, o);
    if (lane == 0) out[warp] = r;
}

extern "C" __global__ void union8(const uint4* __restrict__ k, const uint4* __restrict__ v,
                                  const int* __restrict__ topk, const int* __restrict__ cu,
                                  unsigned* __restrict__ out, int total_q, int H, int D, int K, int T) {
    __shared__ unsigned words[2048 / 32 * 4];                // up to 8192 blocks (512k tokens)
    const int ntile = (T + 7) / 8;
    const int h = blockIdx.x % H, rest = blockIdx.x / H, b = rest / ntile, t0 = (rest % ntile) * 8;
    const int ks = cu[b], nb = (T + 63) / 64, nw = (nb + 31) / 32;
    for (int w = threadIdx.x; w < nw; w += blockDim.x) words[w] = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < 8 * K; i += blockDim.x) {
        const int t = t0 + i / K;
        if (t >= T) continue;
        const int j = topk[((long long)h * total_q + b * T + t) * K + i % K];
        if (j >= 0 && j <= t / 64) atomicOr(&words[j >> 5], 1u << (j & 31));
    }
    __syncthreads();
    const int CH = D / 8;
    uint4 acc = make_uint4(0, 0, 0, 0);
    for (int w = 0; w < nw; ++w) {
        unsigned bits = words[w];
        while (bits) {
            const int j = w * 32 + __ffs(bits) - 1;
            bits &= bits - 1;
            const long long row0 = (long long)(ks + j * 64) * H + h;
            for (int x = threadIdx.x; x < 64 * CH; x += blockDim.x) {
                const long long off = (row0 + (long long)(x / CH) * H) * CH + x % CH;
                const uint4 a = __ldg(k + off), c = __ldg(v + off);
                acc.x ^= a.x ^ c.x; acc.y ^= a.y ^ c.y; acc.z ^= a.z ^ c.z; acc.w ^= a.w ^ c.w;
            }
        }
    }
    unsigned r = acc.x ^ acc.y ^ acc.z ^ acc.w;
    for (int o = 16; o > 0; o >>= 1) r ^= __shfl_xor_sync(0xffffffffu, r, o);
    if ((threadIdx.x & 31) == 0) out[blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32] = r;
}
"""


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--T", type=int, default=131072)
    p.add_argument("--B", type=int, default=2)
    p.add_argument("--K", type=int, default=64)
    p.add_argument("--sel", nargs="+", default=["b", "a"])
    a = p.parse_args()
    HQ, H, D, T, B = 32, 2, 128, a.T, a.B
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B * T, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(B * T, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(B * T, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    cu = uniform_cu_seqlens(B, T, "cuda")
    mod = cupy.RawModule(code=SOURCE)
    kern = {n: mod.get_function(n) for n in ("per_token", "union8")}
    total_q = B * T
    out = torch.empty(total_q * H, dtype=torch.int32, device="cuda")
    print(f"T={T} B={B} H={H} D={D} K={a.K} {torch.cuda.get_device_name()}")
    from infllm_cupy.stage2 import sparse_attn_varlen

    for sel in a.sel:
        topk = make_selection(sel, B, T, H, a.K, device="cuda", seed=0).contiguous()
        qpos = (torch.arange(total_q, device="cuda") % T) // 64
        valid = (topk >= 0) & (topk <= qpos[None, :, None])
        blocks = int(valid.sum())
        # union of each 8-token group's blocks (per head), counted on the GPU
        nb = -(-T // 64)
        onehot_groups = 0
        for h in range(H):
            idx = torch.where(valid[h], topk[h].long(), nb).view(B, -1, 8 * a.K)      # [B, T/8, 8K]
            m = torch.zeros(B, idx.shape[1], nb + 1, dtype=torch.bool, device="cuda")
            m.scatter_(2, idx, True)
            onehot_groups += int(m[..., :nb].sum())
        bytes_tok = blocks * 64 * D * 2 * 2
        bytes_union = onehot_groups * 64 * D * 2 * 2
        args = (k.data_ptr(), v.data_ptr(), topk.data_ptr(), cu.data_ptr(), out.data_ptr())
        ints = [cupy.int32(x) for x in (total_q, H, D, a.K, T)]

        def run_tok(args=args, ints=ints):
            kern["per_token"](((total_q * H * 32 + 255) // 256,), (256,),
                              tuple(cupy.uint64(x) for x in args) + tuple(ints), stream=current_stream())

        def run_union(args=args, ints=ints):
            kern["union8"]((H * B * (-(-T // 8)),), (256,),
                           tuple(cupy.uint64(x) for x in args) + tuple(ints), stream=current_stream())

        def run_ours(topk=topk):
            with torch.no_grad():
                return sparse_attn_varlen(q, k, v, cu, cu, topk, T, T)

        for name, fn, nbytes in (("per_token", run_tok, bytes_tok), ("union8", run_union, bytes_union),
                                 ("ours fwd", run_ours, None)):
            ms = statistics.median(bench_gpu_time(fn))
            extra = f" {nbytes / 1e9:8.1f} GB  {nbytes / ms / 1e9:6.2f} TB/s" if nbytes else ""
            print(f"sel {sel}: {name:10s} {ms:8.2f} ms{extra}", flush=True)
        print(f"sel {sel}: sharing in 8-token groups: {blocks / onehot_groups:.2f} tokens per loaded block")


if __name__ == "__main__":
    main()
