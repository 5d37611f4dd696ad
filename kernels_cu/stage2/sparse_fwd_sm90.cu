// stage2/sparse_fwd_sm90.cu: token-level block-sparse attention forward, Hopper (sm_90a) path.
//
// Launch contract (mirrored by infllm_cupy/stage2/sparse_fwd.py; arguments as stage2_fwd in
// sparse_fwd.cu, same semantics and outputs):
//   kernel   stage2_fwd_sm90<T, D>      T in {__half, __nv_bfloat16}, D in {64, 128}; capability 9.0
//   grid     (cdiv(max_seqlen_q * G, 64 * NC), H, B)     block (128 * (NC + 1))
//   dyn smem fwd_sm90_smem_bytes(D, n_words): 1 KB alignment slack + NC Q tiles + NS K and V
//            stages + 2 NS mbarriers + (NC + 1) * n_words union words
//
// Warp-specialised, as FlashAttention-3: warpgroups 0..NC-1 are consumers, each owning 64 rows of
// the flattened (token, head-in-group) space (4 tokens at G = 16); warpgroup NC is the producer.
// The producer walks the union of the CTA's blocks and streams K/V blocks into an NS-deep ring of
// 128-byte-swizzled stages with cp.async, signalling `full[s]`; consumers run S = Q K^T and
// O += P V on wgmma (Q, K, V read from shared memory through descriptors, P from registers) and
// release a stage through `empty[s]`. A consumer warpgroup whose tokens did not select a block
// releases it as soon as it has arrived: warpgroups advance independently (up to the ring's
// depth), so a block that one token picked costs that token's warpgroup alone (the SM80 kernel's
// block barrier made every warp wait for the slowest).
// Rows of a warpgroup that did not select a block are masked, as are keys past the causal limit.
#include "common/types.cuh"
#include "common/mma_sm80.cuh"
#include "common/wgmma_sm90.cuh"

#define BLOCK_N 64
#define NC 2   // consumer warpgroups
#define NS 4   // K/V stages in the ring
#define LAG 2  // the producer publishes stage it - LAG after issuing stage it (LAG <= NS - 2: consumers
               // waiting on it - LAG must already have released the stage that issue reuses)

// Byte offset of 16-byte chunk `ch` of `row` in a 128-byte-swizzled tile of `rows` rows
// (64-element halves of a wider row stored one after the other).
__device__ __forceinline__ u32 swz128(int row, int ch, int rows) {
    return (ch >> 3) * (rows * 128) + row * 128 + (((ch & 7) ^ (row & 7)) << 4);
}

__device__ __forceinline__ int next_set(const unsigned* __restrict__ words, int n_words, int from) {
    int w = from >> 5;
    if (w >= n_words) return -1;
    unsigned bits = words[w] & (~0u << (from & 31));
    while (true) {
        if (bits) return (w << 5) + __ffs(bits) - 1;
        if (++w >= n_words) return -1;
        bits = words[w];
    }
}

template <typename T, int D>
__global__ void __launch_bounds__(128 * (NC + 1), 1)
stage2_fwd_sm90(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                const unsigned* __restrict__ masks, const int* __restrict__ mask_base,
                const int* __restrict__ cu_seqlens_q, const int* __restrict__ cu_seqlens_k,
                T* __restrict__ out, float* __restrict__ lse,
                int total_q, int HQ, int H, int G, int n_words, long long mask_h_stride, int mask_q_block,
                float scale_log2, int causal) {
    constexpr int M = 64 * NC;
    constexpr int CH = D / 8;
    constexpr u32 TILE_Q = 64 * D * sizeof(T);
    constexpr u32 TILE_KV = BLOCK_N * D * sizeof(T);
    constexpr u32 HALF = 64 * 128;             // bytes of one 64-row, 64-element half tile
    extern __shared__ unsigned char smem[];
    const u32 raw = smem_u32(smem);
    const u32 base = (raw + 1023u) & ~1023u;   // swizzled tiles start on 1 KB boundaries
    const u32 sQ = base, sK = sQ + NC * TILE_Q, sV = sK + NS * TILE_KV;
    const u32 bar_full = sV + NS * TILE_KV, bar_empty = bar_full + 8 * NS;
    unsigned* sU = reinterpret_cast<unsigned*>(smem + (bar_empty + 8 * NS - raw));   // CTA union
    unsigned* sUw = sU + n_words;                                                    // [NC][n_words]

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, wg = warp >> 2;
    const int h = blockIdx.y, b = blockIdx.z;
    const int qs = cu_seqlens_q[b], Lq = cu_seqlens_q[b + 1] - qs;
    const int ks = cu_seqlens_k[b], Lk = cu_seqlens_k[b + 1] - ks;
    const int64 rows_total = (int64)Lq * G;
    const int64 m0 = (int64)blockIdx.x * M;
    if (m0 >= rows_total) return;
    const int shift = causal ? Lk - Lq : 0;
    const int nb = min((Lk + BLOCK_N - 1) / BLOCK_N, n_words * 32);
    const unsigned* mrows = masks + ((int64)mask_base[b] + (int64)h * mask_h_stride) * n_words;

    // ---- per-warpgroup unions (clipped to what its last row may see) and the CTA union
    {
        int q_lo[NC], q_hi[NC], lim[NC];
#pragma unroll
        for (int g = 0; g < NC; ++g) {
            const int64 r_lo = m0 + 64 * g, r_hi = min(m0 + 64 * (g + 1), rows_total) - 1;
            if (r_lo > r_hi) { q_lo[g] = 1; q_hi[g] = 0; lim[g] = -1; continue; }
            const int t_lo = (int)(r_lo / G), t_hi = (int)(r_hi / G);
            q_lo[g] = t_lo / mask_q_block;
            q_hi[g] = t_hi / mask_q_block;
            lim[g] = nb - 1;
            if (causal) lim[g] = min(lim[g], (t_hi + shift) < 0 ? -1 : (t_hi + shift) / BLOCK_N);
        }
        for (int w = tid; w < n_words; w += 128 * (NC + 1)) {
            unsigned all = 0;
#pragma unroll
            for (int g = 0; g < NC; ++g) {
                unsigned u = 0;
                for (int r = q_lo[g]; r <= q_hi[g]; ++r) u |= __ldg(mrows + (int64)r * n_words + w);
                const int lo_bit = w * 32;
                if (lim[g] < lo_bit) u = 0;
                else if (lim[g] < lo_bit + 31) u &= (2u << (lim[g] - lo_bit)) - 1u;
                sUw[g * n_words + w] = u;
                all |= u;
            }
            sU[w] = all;
        }
    }
    if (tid == 0) {
        for (int s = 0; s < NS; ++s) {
            mbar_init(bar_full + 8 * s, 128);
            mbar_init(bar_empty + 8 * s, 128 * NC);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    if (wg == NC) {
        // ================= producer warpgroup: K/V ring
        const int ptid = tid - 128 * NC;
        int it = 0;
        for (int j = next_set(sU, n_words, 0); j >= 0; j = next_set(sU, n_words, j + 1), ++it) {
            const int s = it % NS;
            if (it >= NS) mbar_wait(bar_empty + 8 * s, (it / NS - 1) & 1);
            for (int i = ptid; i < BLOCK_N * CH; i += 128) {
                const int row = i / CH, ch = i % CH;
                const int key = j * BLOCK_N + row;
                const int64 off = ((int64)(ks + key) * H + h) * D + ch * 8;
                const int bytes = key < Lk ? 16 : 0;
                const u32 dst = swz128(row, ch, BLOCK_N);
                cp_async_16(sK + s * TILE_KV + dst, bytes ? k + off : k, bytes);
                cp_async_16(sV + s * TILE_KV + dst, bytes ? v + off : v, bytes);
            }
            cp_async_commit();
            // LAG + 1 blocks in flight per thread; the oldest is done: publish it to the tensor cores
            if (it >= LAG) {
                cp_async_wait<LAG>();
                fence_proxy_async();
                mbar_arrive(bar_full + 8 * ((it - LAG) % NS));
            }
        }
        cp_async_wait<0>();
        fence_proxy_async();
        for (int done = max(it - LAG, 0); done < it; ++done) mbar_arrive(bar_full + 8 * (done % NS));
        return;
    }

    // ================= consumer warpgroup `wg`: 64 rows
    const int ctid = tid & 127, wwarp = warp & 3;
    const u32 myQ = sQ + wg * TILE_Q;
    for (int i = ctid; i < 64 * CH; i += 128) {
        const int row = i / CH, ch = i % CH;
        const int64 R = m0 + 64 * wg + row;
        const T* src = q;
        int bytes = 0;
        if (R < rows_total) {
            const int t = (int)(R / G), g = (int)(R - (int64)t * G);
            src = q + ((int64)(qs + t) * HQ + (int64)h * G + g) * D + ch * 8;
            bytes = 16;
        }
        cp_async_16(myQ + swz128(row, ch, 64), src, bytes);
    }
    cp_async_commit();
    cp_async_wait<0>();
    fence_proxy_async();
    named_barrier(1 + wg, 128);

    bool row_ok[2];
    int rk[2];
    const unsigned* mrow[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int64 R = m0 + 64 * wg + wwarp * 16 + (lane >> 2) + 8 * r;
        row_ok[r] = R < rows_total;
        const int t = row_ok[r] ? (int)(R / G) : 0;
        rk[r] = causal ? t + shift : Lk - 1;
        mrow[r] = mrows + (int64)(t / mask_q_block) * n_words;
    }
    float o[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
    float m_run[2] = {-INFLLM_INF, -INFLLM_INF}, l_run[2] = {0.f, 0.f};
    const unsigned* myU = sUw + wg * n_words;

    int it = 0;
    for (int j = next_set(sU, n_words, 0); j >= 0; j = next_set(sU, n_words, j + 1), ++it) {
        const int s = it % NS;
        // Every consumer waits for every stage, needed or not: parity waits are only sound for a
        // waiter at most one phase ahead of the barrier, and a warpgroup that released stage s
        // without waiting could otherwise see an old phase as the one it wants.
        mbar_wait(bar_full + 8 * s, (it / NS) & 1);
        if ((myU[j >> 5] >> (j & 31)) & 1u) {          // warpgroup-uniform
            const int kbase = j * BLOCK_N;
            bool sel[2], all_full = true;
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                sel[r] = row_ok[r] && ((__ldg(mrow[r] + (j >> 5)) >> (j & 31)) & 1u) && kbase <= rk[r];
                all_full &= sel[r] && kbase + BLOCK_N - 1 <= rk[r];
            }
            const bool need_mask = !__all_sync(0xffffffffu, all_full);

            // S = Q K^T: 64 rows x 64 keys, K-major operands straight from shared memory
            float sacc[32];
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) {
                const u32 koff = (kk >> 2) * HALF + (kk & 3) * 32;
                wgmma_ss<T, 64>(sacc, smem_desc(myQ + koff, 16, 1024), smem_desc(sK + s * TILE_KV + koff, 16, 1024),
                                kk > 0);
            }
            wgmma_commit();
            wgmma_wait<0>();
            fence_regs(sacc);

            // mask, online softmax (log2 domain, scale folded into the exponent's FMA)
            bool rescale = false;
            float alpha[2];
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                float mx = -INFLLM_INF;
#pragma unroll
                for (int n = 0; n < 8; ++n) {
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        float x = sacc[4 * n + 2 * r + e];
                        if (need_mask) {
                            const int c = kbase + n * 8 + (lane & 3) * 2 + e;
                            if (!sel[r] || c > rk[r]) x = -INFLLM_INF;
                            sacc[4 * n + 2 * r + e] = x;
                        }
                        mx = fmaxf(mx, x);
                    }
                }
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                const float m_new = fmaxf(m_run[r], mx);
                const float m_use = m_new == -INFLLM_INF ? 0.f : m_new * scale_log2;
                alpha[r] = exp2f(m_run[r] * scale_log2 - m_use);
                rescale |= m_new != m_run[r];
                m_run[r] = m_new;
                float sum = 0.f;
#pragma unroll
                for (int n = 0; n < 8; ++n) {
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const float p = exp2f(fmaf(sacc[4 * n + 2 * r + e], scale_log2, -m_use));
                        sacc[4 * n + 2 * r + e] = p;
                        sum += p;
                    }
                }
                l_run[r] = l_run[r] * alpha[r] + sum;
            }
            if (__any_sync(0xffffffffu, rescale)) {
#pragma unroll
                for (int n = 0; n < D / 8; ++n) {
                    o[4 * n] *= alpha[0];
                    o[4 * n + 1] *= alpha[0];
                    o[4 * n + 2] *= alpha[1];
                    o[4 * n + 3] *= alpha[1];
                }
            }
            // O += P V: P from registers (accumulator layout = A layout), V MN-major in shared memory
            u32 pa[4][4];
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) {
                pa[kk][0] = pack2<T>(sacc[8 * kk + 0], sacc[8 * kk + 1]);
                pa[kk][1] = pack2<T>(sacc[8 * kk + 2], sacc[8 * kk + 3]);
                pa[kk][2] = pack2<T>(sacc[8 * kk + 4], sacc[8 * kk + 5]);
                pa[kk][3] = pack2<T>(sacc[8 * kk + 6], sacc[8 * kk + 7]);
            }
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < 4; ++kk)
                wgmma_rs_tb<T, D>(o, pa[kk], smem_desc(sV + s * TILE_KV + kk * 16 * 128, HALF, 1024), 1);
            wgmma_commit();
            wgmma_wait<0>();
            fence_regs(o);
        }
        mbar_arrive(bar_empty + 8 * s);
    }

    // ---- epilogue
    const float LN2 = 0.69314718055994531f;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float l = l_run[r];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        if (!row_ok[r]) continue;
        const int64 R = m0 + 64 * wg + wwarp * 16 + (lane >> 2) + 8 * r;
        const int t = (int)(R / G), g = (int)(R - (int64)t * G);
        const float inv = l > 0.f ? 1.f / l : 0.f;
        T* dst = out + ((int64)(qs + t) * HQ + (int64)h * G + g) * D + (lane & 3) * 2;
#pragma unroll
        for (int n = 0; n < D / 8; ++n)
            *reinterpret_cast<u32*>(dst + n * 8) = pack2<T>(o[4 * n + 2 * r] * inv, o[4 * n + 2 * r + 1] * inv);
        if ((lane & 3) == 0)
            lse[((int64)h * G + g) * total_q + qs + t] = l > 0.f ? (m_run[r] * scale_log2 + log2f(l)) * LN2 : INFLLM_INF;
    }
}
