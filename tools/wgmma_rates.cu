// tools/wgmma_rates.cu: sustained rates of the sm_90a dk/dv kernel's tile step, piece by
// piece (development tool, not part of the package; run by tools/wgmma_rates.py).
//
// One warpgroup per CTA loops over one 64-key x 64-row tile's products (D = 128, bf16) on fixed
// shared-memory tiles, with none of the kernel's index walk or row info:
//   MODE 0  S^T, dP^T: two SS m64n64 products over D (16 wgmmas), waited; accumulating across
//           iterations (a product whose result the next one overwrites is dead code to ptxas)
//   MODE 1  dV, dK: two RS m64n128 products over the 64 rows (8 wgmmas), waited
//   MODE 2  0 then 1, each waited, S^T / dP^T packed into the A operands (no other elementwise work)
//   MODE 3  S^T, dP^T over 128 rows: two SS m64n128 products (a wider tile's shape), accumulating
//   MODE 4  2 with the kernel's elementwise work between: exp2 of S^T into P^T, dS^T, packing
//   MODE 5  4 plus the kernel's Q/dO traffic: 32 KB per tile by bulk copy (from an L2-resident
//           buffer) into a double buffer, an mbarrier wait and a CTA barrier per tile
//   MODE 6  4 with the next tile's S^T/dP^T issued before waiting for this tile's dV/dK
//   MODE 7  5 pipelined as 6 (the kernel's tile step: docs/stage2_bwd.md, 6. dk/dv: the tile step)
//   MODE 8  7 with exp2 replaced by one FMA: the most any faster exp2 could give
// grid: CTAs per SM x SMs, block 128; the dynamic shared memory size sets the CTAs per SM.
#include "common/types.cuh"
#include "common/mma_sm80.cuh"
#include "common/wgmma_sm90.cuh"

__device__ __forceinline__ void bulk_load(u32 dst, const void* src, u32 bytes, u32 bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                 :: "r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}

template <int MODE>
__global__ void __launch_bounds__(128, 2) wgmma_rates(float* out, const unsigned char* src, int n_chunks, int iters) {
    typedef __nv_bfloat16 T;
    constexpr bool LOADS = MODE == 5 || MODE == 7 || MODE == 8, PIPE = MODE == 6 || MODE == 7 || MODE == 8;
    constexpr bool TILE_STEP = MODE >= 2 && MODE != 3, EXP = MODE >= 4;
    extern __shared__ unsigned char smem[];
    __shared__ alignas(8) unsigned long long bars[2];
    const u32 raw = smem_u32(smem), base = (raw + 1023u) & ~1023u;
    constexpr u32 TILE = 64 * 128 * 2, HALF = 64 * 128;
    const u32 sK = base, sV = sK + TILE, sQ = sV + TILE, sO = sQ + 2 * TILE;   // Q, dO: 2 stages (or 128 rows)
    const int tid = threadIdx.x;
    {
        unsigned short* p = reinterpret_cast<unsigned short*>(smem + (base - raw));
        for (int i = tid; i < 6 * 64 * 128; i += 128) {
            const float x = (float)(((unsigned)i * 2654435761u >> 20) & 255u) / 256.f - 0.5f;
            const T h = __float2bfloat16(x);
            p[i] = *reinterpret_cast<const unsigned short*>(&h);
        }
    }
    const u32 bar0 = smem_u32(&bars[0]);
    if (tid == 0) {
        mbar_init(bar0, 1);
        mbar_init(bar0 + 8, 1);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    fence_proxy_async();
    __syncthreads();
    // stage s <- chunk c: Q and dO of one tile (2 x 16 KB, contiguous in the buffer)
    auto load = [&](int s, int c) {
        if (tid == 0) {
            const unsigned char* g = src + (size_t)c * 2 * TILE;
            mbar_arrive_expect_tx(bar0 + 8 * s, 2 * TILE);
            bulk_load(sQ + s * TILE, g, TILE, bar0 + 8 * s);
            bulk_load(sO + s * TILE, g + TILE, TILE, bar0 + 8 * s);
        }
    };
    const u64 k_desc = smem_desc(sK, 16, 1024), v_desc = smem_desc(sV, 16, 1024);
    const u64 q_desc = smem_desc(sQ, 16, 1024), o_desc = smem_desc(sO, 16, 1024);
    const u64 qt_desc = smem_desc(sQ, HALF, 1024), ot_desc = smem_desc(sO, HALF, 1024);
    float adk[64], adv[64], s[64], dp[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) adk[i] = adv[i] = s[i] = dp[i] = 0.f;
    u32 pa[4][4], da[4][4];
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
#pragma unroll
        for (int i = 0; i < 4; ++i) pa[kk][i] = da[kk][i] = 0x3c003c00u + tid;
    float (&s32)[32] = *reinterpret_cast<float(*)[32]>(s);
    float (&d32)[32] = *reinterpret_cast<float(*)[32]>(dp);
    if (LOADS) load(0, blockIdx.x % n_chunks);
    unsigned parity = 0u;
    for (int it = 0; it < iters; ++it) {
        const int st = LOADS ? it & 1 : 0;
        const u32 so = (st * TILE) >> 4;
        if (LOADS) {
            mbar_wait(bar0 + 8 * st, (parity >> st) & 1u);
            parity ^= 1u << st;
        }
        if (MODE >= 5) __syncthreads();
        if (MODE == 0 || TILE_STEP) {
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < 8; ++kk) {
                const u32 koff = ((kk >> 2) * (64 * 128) + (kk & 3) * 32) >> 4;
                wgmma_ss<T, 64>(s32, k_desc + koff, q_desc + so + koff, MODE == 0 || kk > 0);
            }
#pragma unroll
            for (int kk = 0; kk < 8; ++kk) {
                const u32 koff = ((kk >> 2) * (64 * 128) + (kk & 3) * 32) >> 4;
                wgmma_ss<T, 64>(d32, v_desc + koff, o_desc + so + koff, MODE == 0 || kk > 0);
            }
            wgmma_commit();
            if (PIPE) {
                wgmma_wait<1>();          // the previous tile's dV/dK: its stage is free
                fence_regs(adv);
                fence_regs(adk);
                __syncthreads();
            }
            if (LOADS && it + 1 < iters) load(st ^ 1, (blockIdx.x + 7 * (it + 1)) % n_chunks);
            wgmma_wait<0>();
            fence_regs(s32);
            fence_regs(d32);
            if (EXP) {
#pragma unroll
                for (int i = 0; i < 32; ++i) {
                    const float x = fmaf(s32[i], 0.088f, -1.f - (float)(i & 3));
                    const float p = MODE == 8 ? fmaf(x, 0.5f, 1.f) : exp2f(x);
                    s32[i] = p;
                    d32[i] = p * (d32[i] - 0.25f);
                }
            }
            if (MODE != 0) {
                pack_a_frags<T, 4>(s32, pa);
                pack_a_frags<T, 4>(d32, da);
            }
        }
        if (MODE == 3) {
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < 8; ++kk) {
                const u32 ka = ((kk >> 2) * (64 * 128) + (kk & 3) * 32) >> 4;
                const u32 kb = ((kk >> 2) * (128 * 128) + (kk & 3) * 32) >> 4;
                wgmma_ss<T, 128>(s, k_desc + ka, q_desc + kb, 1);
            }
#pragma unroll
            for (int kk = 0; kk < 8; ++kk) {
                const u32 ka = ((kk >> 2) * (64 * 128) + (kk & 3) * 32) >> 4;
                const u32 kb = ((kk >> 2) * (128 * 128) + (kk & 3) * 32) >> 4;
                wgmma_ss<T, 128>(dp, v_desc + ka, o_desc + kb, 1);
            }
            wgmma_commit();
            wgmma_wait<0>();
            fence_regs(s);
            fence_regs(dp);
        }
        if (MODE == 1 || TILE_STEP) {
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) wgmma_rs_tb<T, 128>(adv, pa[kk], ot_desc + so + ((kk * 16 * 128) >> 4), 1);
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) wgmma_rs_tb<T, 128>(adk, da[kk], qt_desc + so + ((kk * 16 * 128) >> 4), 1);
            wgmma_commit();
            if (!PIPE) {
                wgmma_wait<0>();
                fence_regs(adv);
                fence_regs(adk);
            }
        }
    }
    wgmma_wait<0>();
    fence_regs(adv);
    fence_regs(adk);
    float acc = 0.f;
#pragma unroll
    for (int i = 0; i < 64; ++i) acc += adk[i] + adv[i] + s[i] + dp[i];
    out[blockIdx.x * 128 + tid] = acc;
}

template __global__ void wgmma_rates<0>(float*, const unsigned char*, int, int);
template __global__ void wgmma_rates<1>(float*, const unsigned char*, int, int);
template __global__ void wgmma_rates<2>(float*, const unsigned char*, int, int);
template __global__ void wgmma_rates<3>(float*, const unsigned char*, int, int);
template __global__ void wgmma_rates<4>(float*, const unsigned char*, int, int);
template __global__ void wgmma_rates<5>(float*, const unsigned char*, int, int);
template __global__ void wgmma_rates<6>(float*, const unsigned char*, int, int);
template __global__ void wgmma_rates<7>(float*, const unsigned char*, int, int);
template __global__ void wgmma_rates<8>(float*, const unsigned char*, int, int);
