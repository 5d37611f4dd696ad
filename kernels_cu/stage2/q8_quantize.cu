// stage2/q8_quantize.cu: the 8-bit stage-2 plan's operands (precision="int8-fp8", docs/stage2_q8.md §2):
// Q and smoothed K on int8, V on e4m3, with their scales, exactly as infllm_cupy/stage2/q8_naive.py's
// naive_q8_quantize (the same fp32 operations, round to nearest even), so the two agree bit for bit.
//
// Launch contract (mirrored by q8_quantize in infllm_cupy/stage2/q8_fwd.py, whose Q8_STATS_PARAMS,
// Q8_Q_PARAMS and Q8_K_PARAMS declare the structs field by field), run in this order:
//   q8_kv_stats<T>(Q8KvStatsParams)       grid (H, B)                 block (D)   no dyn smem
//       per (sequence b, KV head h, channel): k_mean = (float)(sum_t (double)k / Lk) (0 if Lk = 0),
//       the sum in key order; v_scale = max(amax_t |v|, AMAX_MIN) / 448; v8 = e4m3(v * (448 / amax))
//       (saturating). One thread per channel: reads coalesced over channels.
//   q8_quantize_q<T>(Q8QuantizeQParams)   grid (cdiv(total_q * HQ, WARPS))  block (32 * WARPS)
//       one warp per (token, query head) row: q_scale = max(amax_d |q|, AMAX_MIN) / 127,
//       q8 = rint(q * (127 / amax)).
//   q8_quantize_k<T>(Q8QuantizeKParams)   grid (cdiv(max_seqlen_k, 64), H, B)   block (64)
//       one CTA per (64-key block j of sequence b, KV head h), one thread per key: ks = (float)k - k_mean,
//       amax over the block's keys (< Lk) and channels, k_scale[h, cu_k[b] / 64 + b + j] = amax / 127,
//       k8 = rint(ks * (127 / amax)). Slots no block maps to are not written.
//   T in {__half, __nv_bfloat16}; D in {64, 128} (a template value of q8_kv_stats only through blockDim).
//   q [total_q, HQ, D] T, k/v [total_k, H, D] T, contiguous; cu_seqlens_q/k int32 [B + 1];
//   q8 [total_q, HQ, D] int8, q_scale [total_q, HQ] f32; k8 [total_k, H, D] int8,
//   k_scale [H, total_k / 64 + B] f32, k_mean [B, H, D] f32; v8 [total_k, H, D] e4m3, v_scale [B, H, D] f32.
#include "common/types.cuh"
#include "common/params.cuh"

#define WARPS 8
#define BLOCK_N 64

// 2^-100: a group whose amax is below it quantizes as if it were this (127 / amax stays finite).
#define Q8_AMAX_MIN __int_as_float(0x0d800000)

__device__ __forceinline__ signed char to_int8(float y) {
    const int i = __float2int_rn(y);          // round half to even, as torch.round
    return (signed char)max(-127, min(127, i));
}

// fp32 -> e4m3, round to nearest even, saturating to +-448 (sm_89+).
__device__ __forceinline__ unsigned char to_e4m3(float y) {
    unsigned short r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(r) : "f"(0.f), "f"(y));
    return (unsigned char)(r & 0xff);
}

#define Q8_KV_STATS_PARAMS(F, M) \
    F(const T* __restrict__, k)              /* [total_k, H, D] */ \
    F(const T* __restrict__, v)              /* [total_k, H, D] */ \
    F(const int* __restrict__, cu_seqlens_k) /* [B + 1] */ \
    F(float* __restrict__, k_mean)           /* [B, H, D] */ \
    F(unsigned char* __restrict__, v8)       /* [total_k, H, D] e4m3 */ \
    F(float* __restrict__, v_scale)          /* [B, H, D] */ \
    F(int, H) F(int, D)
template <typename T> struct Q8KvStatsParams { PARAM_FIELDS(Q8_KV_STATS_PARAMS) };

template <typename T>
__global__ void __launch_bounds__(128) q8_kv_stats(PARAM_ARGS(Q8_KV_STATS_PARAMS)) {
    const int h = blockIdx.x, b = blockIdx.y, ch = threadIdx.x;
    const int k0 = cu_seqlens_k[b], Lk = cu_seqlens_k[b + 1] - k0;
    const int64 stride = (int64)H * D;
    const int64 base = (int64)k0 * stride + (int64)h * D + ch;
    double sum = 0.0;
    float amax = 0.f;
    for (int t = 0; t < Lk; ++t) {
        sum += (double)to_float(k[base + t * stride]);
        amax = fmaxf(amax, fabsf(to_float(v[base + t * stride])));
    }
    const int64 o = ((int64)b * H + h) * D + ch;
    k_mean[o] = Lk > 0 ? (float)(sum / (double)Lk) : 0.f;
    amax = fmaxf(amax, Q8_AMAX_MIN);
    v_scale[o] = amax / 448.f;
    const float inv = 448.f / amax;
    for (int t = 0; t < Lk; ++t) v8[base + t * stride] = to_e4m3(to_float(v[base + t * stride]) * inv);
}

#define Q8_QUANTIZE_Q_PARAMS(F, M) \
    F(const T* __restrict__, q)              /* [total_q, HQ, D] */ \
    F(signed char* __restrict__, q8)         /* [total_q, HQ, D] */ \
    F(float* __restrict__, q_scale)          /* [total_q, HQ] */ \
    F(int64, rows) F(int, D)                 /* total_q * HQ, head dim */
template <typename T> struct Q8QuantizeQParams { PARAM_FIELDS(Q8_QUANTIZE_Q_PARAMS) };

template <typename T>
__global__ void __launch_bounds__(32 * WARPS) q8_quantize_q(PARAM_ARGS(Q8_QUANTIZE_Q_PARAMS)) {
    const int lane = threadIdx.x & 31;
    const int64 row = (int64)blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (row >= rows) return;
    const T* x = q + row * D;
    float amax = 0.f;
    for (int d = lane; d < D; d += 32) amax = fmaxf(amax, fabsf(to_float(x[d])));
    for (int o = 16; o; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    amax = fmaxf(amax, Q8_AMAX_MIN);
    const float inv = 127.f / amax;
    for (int d = lane; d < D; d += 32) q8[row * D + d] = to_int8(to_float(x[d]) * inv);
    if (lane == 0) q_scale[row] = amax / 127.f;
}

#define Q8_QUANTIZE_K_PARAMS(F, M) \
    F(const T* __restrict__, k)              /* [total_k, H, D] */ \
    F(const int* __restrict__, cu_seqlens_k) /* [B + 1] */ \
    F(const float* __restrict__, k_mean)     /* [B, H, D] */ \
    F(signed char* __restrict__, k8)         /* [total_k, H, D] */ \
    F(float* __restrict__, k_scale)          /* [H, total_k / 64 + B] */ \
    F(int, H) F(int, D) F(int, n_slots)      /* KV heads, head dim, k_scale's columns */
template <typename T> struct Q8QuantizeKParams { PARAM_FIELDS(Q8_QUANTIZE_K_PARAMS) };

template <typename T>
__global__ void __launch_bounds__(BLOCK_N) q8_quantize_k(PARAM_ARGS(Q8_QUANTIZE_K_PARAMS)) {
    __shared__ float warp_max[BLOCK_N / 32];
    const int j = blockIdx.x, h = blockIdx.y, b = blockIdx.z, key = threadIdx.x;
    const int k0 = cu_seqlens_k[b], Lk = cu_seqlens_k[b + 1] - k0;
    if (j * BLOCK_N >= Lk) return;                         // whole CTA: no block j in this sequence
    const int t = j * BLOCK_N + key;
    const float* mean = k_mean + ((int64)b * H + h) * D;
    const T* x = k + ((int64)(k0 + t) * H + h) * D;
    float amax = 0.f;
    if (t < Lk)
        for (int d = 0; d < D; ++d) amax = fmaxf(amax, fabsf(to_float(x[d]) - mean[d]));
    for (int o = 16; o; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    if ((key & 31) == 0) warp_max[key >> 5] = amax;
    __syncthreads();
    amax = Q8_AMAX_MIN;
    for (int w = 0; w < BLOCK_N / 32; ++w) amax = fmaxf(amax, warp_max[w]);
    if (key == 0) k_scale[(int64)h * n_slots + k0 / BLOCK_N + b + j] = amax / 127.f;
    if (t >= Lk) return;
    const float inv = 127.f / amax;
    signed char* y = k8 + ((int64)(k0 + t) * H + h) * D;
    for (int d = 0; d < D; ++d) y[d] = to_int8((to_float(x[d]) - mean[d]) * inv);
}
