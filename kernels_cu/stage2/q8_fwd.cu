// stage2/q8_fwd.cu: the 8-bit stage-2 forward (precision="int8-fp8", docs/stage2_q8.md §5) on mma.sync
// for sm_89 / sm_90 (compiled for sm_90a): S = Q8 K8^T with m16n8k32 s8 (exact int32 sums), P V with
// m16n8k32 e4m3 (fp32 accumulators), over the operands of q8_quantize.cu.
//
// Launch contract (mirrored by q8_fwd in infllm_cupy/stage2/q8_fwd.py, whose Q8_FWD_PARAMS declares
// Q8FwdParams field by field):
//   kernel   q8_fwd<T, D>(the fields of Q8FwdParams)      T in {__half, __nv_bfloat16}, D in {64, 128}
//   grid     (cdiv(max_seqlen_q, TOK), H, B), TOK = 64 / G tokens per CTA (G <= 64)
//   block    128 (4 warps, 16 rows each)     static smem: Q8 64 x D, K8 64 x D, V8^T D x 64 bytes
//   q8 [total_q, HQ, D] int8, q_scale [total_q, HQ] f32; k8 [total_k, H, D] int8,
//   k_scale [H, n_slots] f32 (block j of sequence b at cu_k[b] / 64 + b + j); v8 [total_k, H, D] e4m3,
//   v_scale [B, H, D] f32; masks [H, total_q, n_words] uint32 (token_block_masks' rows: bit j of
//   (h, t) set iff t selected block j); cu_seqlens_q/k int32 [B + 1]; out [total_q, HQ, D] T.
//   Semantics: naive_q8_sparse_attn_varlen's (no lse): row (token t, head h*G + i) of the CTA's 64 rows
//   (row r: token t0 + r / G, head r % G) attends keys c of its sequence with block c / 64 selected,
//   c < Lk and, if causal, c <= r_t + Lk - Lq. The CTA walks the union of its tokens' blocks in
//   ascending order, one 64-key block per step: s = float(int32 S) * (q_scale * scale_log2 * k_scale),
//   running max m, corr = exp2(m_old - m), p = exp2(s - m), sum += p, P8 = e4m3(448 p), o = o * corr +
//   (P8 V8 from a zeroed accumulator); out = o / (448 sum) * v_scale, 0 on rows with no key.
//
// Fragments (m16n8k32, 8-bit, g = lane / 4, c = lane % 4): A a0 = row g, k 4c..4c+3; a1 row g + 8;
// a2/a3 the same at k + 16. B b0 = col g, k 4c..4c+3; b1 at k + 16. C c0,c1 = row g, cols 2c, 2c+1;
// c2,c3 row g + 8. The S accumulator gives a thread two adjacent keys per 8-key tile, the e4m3 A
// fragment wants four adjacent k: P V runs its k in a permuted key order (k step s, position p =
// 16 half + 4 c + i holds key 32 s + 16 half + 8 (i / 2) + 2 c + i % 2), and V^T is stored in
// shared memory in that order, so P goes from the S accumulator to A registers with no shuffle.
#include "common/types.cuh"
#include "common/params.cuh"

#define BLOCK_N 64
#define ROWS 64
#define NWARPS 4

typedef unsigned int u32;

#define Q8_FWD_PARAMS(F, M) \
    F(const signed char* __restrict__, q8)       /* [total_q, HQ, D] */ \
    F(const float* __restrict__, q_scale)        /* [total_q, HQ] */ \
    F(const signed char* __restrict__, k8)       /* [total_k, H, D] */ \
    F(const float* __restrict__, k_scale)        /* [H, n_slots] */ \
    F(const unsigned char* __restrict__, v8)     /* [total_k, H, D] e4m3 */ \
    F(const float* __restrict__, v_scale)        /* [B, H, D] */ \
    F(const unsigned* __restrict__, masks)       /* [H, total_q, n_words] */ \
    F(const int* __restrict__, cu_seqlens_q)     /* [B + 1] */ \
    F(const int* __restrict__, cu_seqlens_k)     /* [B + 1] */ \
    F(T* __restrict__, out)                      /* [total_q, HQ, D] */ \
    F(int, total_q) F(int, H) F(int, G) F(int, n_words) F(int, n_slots) \
    F(float, scale_log2)                         /* softmax_scale * log2(e), rounded to fp32 on the host */ \
    F(int, causal)
template <typename T> struct Q8FwdParams { PARAM_FIELDS(Q8_FWD_PARAMS) };

__device__ __forceinline__ void mma_s8(int (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void mma_e4m3(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Four fp32 values to four e4m3 bytes, x0 in the lowest (round to nearest even, saturating).
__device__ __forceinline__ u32 e4m3x4(float x0, float x1, float x2, float x3) {
    unsigned short lo, hi;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(lo) : "f"(x1), "f"(x0));
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(hi) : "f"(x3), "f"(x2));
    return (u32)lo | ((u32)hi << 16);
}

// The key of position p (0..31) of a 32-key step of P V (the permutation of the header).
__device__ __forceinline__ int pv_key(int p) {
    const int half = p >> 4, c = (p >> 2) & 3, i = p & 3;
    return 16 * half + 8 * (i >> 1) + 2 * c + (i & 1);
}

template <typename T, int D>
__global__ void __launch_bounds__(32 * NWARPS, 1) q8_fwd(PARAM_ARGS(Q8_FWD_PARAMS)) {
    static_assert(D == 64 || D == 128, "head dims 64 and 128");
    __shared__ __align__(16) signed char q_s[ROWS * D];
    __shared__ __align__(16) signed char k_s[BLOCK_N * D];
    __shared__ __align__(16) unsigned char vt_s[D * BLOCK_N];     // V^T, keys in the P V order
    __shared__ unsigned union_s[NWARPS * 32];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, c = lane & 3;
    const int h = blockIdx.y, b = blockIdx.z;
    const int q0 = cu_seqlens_q[b], Lq = cu_seqlens_q[b + 1] - q0;
    const int k0 = cu_seqlens_k[b], Lk = cu_seqlens_k[b + 1] - k0;
    const int tok = ROWS / G;                                   // tokens per CTA
    const int t0 = blockIdx.x * tok;
    if (t0 >= Lq) return;
    const int n_tok = min(tok, Lq - t0);
    const int HQ = H * G;
    if (Lk == 0) {                                              // no key: every row of the tile is 0
        for (int i = tid; i < n_tok * G * D; i += 32 * NWARPS)
            out[((int64)(q0 + t0) * HQ + h * G) * D + (int64)(i / (G * D)) * HQ * D + i % (G * D)] = from_float<T>(0.f);
        return;
    }

    // Q8 tile: row r = (token t0 + r / G, head h G + r % G); rows past the tile's tokens are zero
    for (int i = tid; i < ROWS * D / 16; i += 32 * NWARPS) {
        const int r = i / (D / 16), ch = (i % (D / 16)) * 16;
        uint4 val = make_uint4(0, 0, 0, 0);
        if (r / G < n_tok)
            val = *reinterpret_cast<const uint4*>(q8 + ((int64)(q0 + t0 + r / G) * HQ + h * G + r % G) * D + ch);
        *reinterpret_cast<uint4*>(q_s + r * D + ch) = val;
    }
    // the two rows of this thread (g and g + 8 of its warp's 16): their token, limit and scale factor
    int row_t[2], row_last[2];
    float row_f[2];
    bool row_on[2];
    #pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
        const int r = warp * 16 + g + 8 * hr;
        const int t = r / G;
        row_on[hr] = t < n_tok;
        row_t[hr] = q0 + t0 + min(t, n_tok - 1);
        const int rr = t0 + min(t, n_tok - 1);
        row_last[hr] = causal ? min(rr + Lk - Lq, Lk - 1) : Lk - 1;
        row_f[hr] = row_on[hr] ? q_scale[(int64)row_t[hr] * HQ + h * G + r % G] * scale_log2 : 0.f;
    }
    const int nb = (Lk + BLOCK_N - 1) / BLOCK_N;
    const int words = min(n_words, (nb + 31) / 32);
    const unsigned* mrow = masks + ((int64)h * total_q + q0 + t0) * n_words;

    float o[D / 8][4];
    #pragma unroll
    for (int n = 0; n < D / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    float m[2] = {-INFLLM_INF, -INFLLM_INF}, l[2] = {0.f, 0.f};

    for (int w = 0; w < words; ++w) {
        // the union of the tile's tokens' word w
        unsigned u = 0;
        for (int t = tid; t < n_tok; t += 32 * NWARPS) u |= mrow[(int64)t * n_words + w];
        for (int s = 16; s; s >>= 1) u |= __shfl_xor_sync(0xffffffffu, u, s);
        __syncthreads();
        if (lane == 0) union_s[warp] = u;
        __syncthreads();
        u = 0;
        #pragma unroll
        for (int i = 0; i < NWARPS; ++i) u |= union_s[i];
        unsigned my[2];
        #pragma unroll
        for (int hr = 0; hr < 2; ++hr) my[hr] = row_on[hr] ? masks[((int64)h * total_q + row_t[hr]) * n_words + w] : 0u;
        while (u) {
            const int j = w * 32 + __ffs(u) - 1;
            u &= u - 1;
            if (j >= nb) break;
            __syncthreads();                                    // the previous block's K/V are consumed
            const int kb0 = j * BLOCK_N;
            for (int i = tid; i < BLOCK_N * D / 16; i += 32 * NWARPS) {
                const int key = i / (D / 16), ch = (i % (D / 16)) * 16;
                uint4 val = make_uint4(0, 0, 0, 0);
                if (kb0 + key < Lk)
                    val = *reinterpret_cast<const uint4*>(k8 + ((int64)(k0 + kb0 + key) * H + h) * D + ch);
                *reinterpret_cast<uint4*>(k_s + key * D + ch) = val;
            }
            for (int i = tid; i < BLOCK_N * D; i += 32 * NWARPS) {
                const int pos = i % BLOCK_N, ch = i / BLOCK_N;     // V^T[ch][pos], key of pos permuted
                const int key = (pos & ~31) + pv_key(pos & 31);
                vt_s[ch * BLOCK_N + pos] =
                    kb0 + key < Lk ? v8[((int64)(k0 + kb0 + key) * H + h) * D + ch] : (unsigned char)0;
            }
            const float ksc = k_scale[(int64)h * n_slots + k0 / BLOCK_N + b + j];
            __syncthreads();

            // S = Q8 K8^T: 16 rows x 64 keys per warp, exact int32 sums
            int s_acc[BLOCK_N / 8][4];
            #pragma unroll
            for (int n = 0; n < BLOCK_N / 8; ++n) s_acc[n][0] = s_acc[n][1] = s_acc[n][2] = s_acc[n][3] = 0;
            #pragma unroll
            for (int kk = 0; kk < D / 32; ++kk) {
                const signed char* qa = q_s + (warp * 16 + g) * D + kk * 32 + 4 * c;
                const u32 a[4] = {*reinterpret_cast<const u32*>(qa), *reinterpret_cast<const u32*>(qa + 8 * D),
                                  *reinterpret_cast<const u32*>(qa + 16), *reinterpret_cast<const u32*>(qa + 8 * D + 16)};
                #pragma unroll
                for (int n = 0; n < BLOCK_N / 8; ++n) {
                    const signed char* kb = k_s + (n * 8 + g) * D + kk * 32 + 4 * c;
                    mma_s8(s_acc[n], a, *reinterpret_cast<const u32*>(kb), *reinterpret_cast<const u32*>(kb + 16));
                }
            }
            // scores, masks, online softmax (rows g and g + 8; a row's 64 keys over the quad's 4 threads)
            float sc[BLOCK_N / 8][4];
            float corr[2];
            #pragma unroll
            for (int hr = 0; hr < 2; ++hr) {
                const bool sel = (my[hr] >> (j & 31)) & 1u;
                const float f = row_f[hr] * ksc;
                float mx = -INFLLM_INF;
                #pragma unroll
                for (int n = 0; n < BLOCK_N / 8; ++n)
                    #pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int key = kb0 + n * 8 + 2 * c + e;
                        const float s = (sel && key <= row_last[hr]) ? (float)s_acc[n][2 * hr + e] * f : -INFLLM_INF;
                        sc[n][2 * hr + e] = s;
                        mx = fmaxf(mx, s);
                    }
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                const float m_new = fmaxf(m[hr], mx);
                const float m_sub = m_new == -INFLLM_INF ? 0.f : m_new;
                corr[hr] = m_new == -INFLLM_INF ? 0.f : exp2f(m[hr] - m_sub);
                float sum = 0.f;
                #pragma unroll
                for (int n = 0; n < BLOCK_N / 8; ++n)
                    #pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const float p = exp2f(sc[n][2 * hr + e] - m_sub);
                        sc[n][2 * hr + e] = p;
                        sum += p;
                    }
                l[hr] = l[hr] * corr[hr] + sum;                 // the quad's partial sums, reduced at the end
                m[hr] = m_new;
            }
            // P8 as A fragments in the permuted key order: k step s takes S tiles 4s .. 4s + 3
            u32 pa[2][4];
            #pragma unroll
            for (int s = 0; s < 2; ++s) {
                pa[s][0] = e4m3x4(448.f * sc[4 * s][0], 448.f * sc[4 * s][1], 448.f * sc[4 * s + 1][0], 448.f * sc[4 * s + 1][1]);
                pa[s][1] = e4m3x4(448.f * sc[4 * s][2], 448.f * sc[4 * s][3], 448.f * sc[4 * s + 1][2], 448.f * sc[4 * s + 1][3]);
                pa[s][2] = e4m3x4(448.f * sc[4 * s + 2][0], 448.f * sc[4 * s + 2][1], 448.f * sc[4 * s + 3][0], 448.f * sc[4 * s + 3][1]);
                pa[s][3] = e4m3x4(448.f * sc[4 * s + 2][2], 448.f * sc[4 * s + 2][3], 448.f * sc[4 * s + 3][2], 448.f * sc[4 * s + 3][3]);
            }
            // P V from a zeroed accumulator, added into the fp32 output (two levels)
            #pragma unroll
            for (int n = 0; n < D / 8; ++n) {
                float pv[4] = {0.f, 0.f, 0.f, 0.f};
                #pragma unroll
                for (int s = 0; s < 2; ++s) {
                    const unsigned char* vb = vt_s + (n * 8 + g) * BLOCK_N + s * 32 + 4 * c;
                    mma_e4m3(pv, pa[s], *reinterpret_cast<const u32*>(vb), *reinterpret_cast<const u32*>(vb + 16));
                }
                o[n][0] = o[n][0] * corr[0] + pv[0];
                o[n][1] = o[n][1] * corr[0] + pv[1];
                o[n][2] = o[n][2] * corr[1] + pv[2];
                o[n][3] = o[n][3] * corr[1] + pv[3];
            }
        }
    }
    // the row sums over the quad, then out = o / (448 sum) * v_scale
    #pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
        l[hr] += __shfl_xor_sync(0xffffffffu, l[hr], 1);
        l[hr] += __shfl_xor_sync(0xffffffffu, l[hr], 2);
    }
    const float* vs = v_scale + ((int64)b * H + h) * D;
    #pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
        if (!row_on[hr]) continue;
        const int r = warp * 16 + g + 8 * hr;
        const float inv = l[hr] > 0.f ? 1.f / (448.f * l[hr]) : 0.f;
        T* y = out + ((int64)row_t[hr] * HQ + h * G + r % G) * D;
        #pragma unroll
        for (int n = 0; n < D / 8; ++n)
            #pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int ch = n * 8 + 2 * c + e;
                y[ch] = from_float<T>(o[n][2 * hr + e] * inv * vs[ch]);
            }
    }
}
