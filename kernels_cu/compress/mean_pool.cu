// compress/mean_pool.cu: InfLLM-v2 key compression, the mean of keys over complete windows.
//
// Launch contract (mirrored by infllm_cupy/compress/mean_pool.py, whose MEAN_POOL_PARAMS declares
// CompressMeanPoolParams field by field; the loader checks the layout at compile time):
//   kernel   compress_mean_pool<T, D>(the fields of CompressMeanPoolParams<T>)   T in {__half, __nv_bfloat16, float}, D in {64, 128}
//   grid     (cdiv(total_c * H, WARPS), 1, 1)     block (32 * WARPS, 1, 1)     no shared memory
//   k        [total_k, H, D] T, contiguous        cu_seqlens_k int32 [B+1]
//   out      [total_c, H, D] T                    cu_seqlens_c int32 [B+1], from the launcher:
//            n_b = L_b < kernel_size ? 0 : (L_b - kernel_size) / kernel_stride + 1
//   out[cu_c[b] + i, h] = mean_{t < kernel_size} k[cu_k[b] + i * kernel_stride + t, h]  (fp32 sum)
//
// One warp per (compressed key, head): each lane owns D/32 consecutive channels and walks the
// window's rows, so every row read is one coalesced D*sizeof(T)-byte segment. The windows overlap
// (kernel = 2 * stride in InfLLM-v2), so each key is read twice, the second time from L2.
#include "common/types.cuh"
#include "common/params.cuh"

#define WARPS 4

#define COMPRESS_MEAN_POOL_PARAMS(F, M) \
    F(const T* __restrict__, k)                 /* [total_k, H, D] */ \
    F(const int* __restrict__, cu_seqlens_k)    /* [batch + 1] */ \
    F(const int* __restrict__, cu_seqlens_c)    /* [batch + 1] */ \
    F(T* __restrict__, out)                     /* [total_c, H, D] */ \
    F(int, batch) F(int, total_c) F(int, H) F(int, kernel_size) F(int, kernel_stride)
template <typename T>
struct CompressMeanPoolParams { PARAM_FIELDS(COMPRESS_MEAN_POOL_PARAMS) };

template <typename T, int D>
__global__ void __launch_bounds__(32 * WARPS)
compress_mean_pool(PARAM_ARGS(COMPRESS_MEAN_POOL_PARAMS)) {
    constexpr int VEC = D / 32;
    const int lane = threadIdx.x & 31;
    const int64 task = (int64)blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (task >= (int64)total_c * H) return;
    const int64 c = task / H;                 // compressed key, packed over the batch
    const int h = (int)(task - c * H);
    const int b = find_sequence(cu_seqlens_c, batch, c);
    const int64 first = (int64)cu_seqlens_k[b] + (c - cu_seqlens_c[b]) * (int64)kernel_stride;

    const int64 row_stride = (int64)H * D;
    const T* src = k + first * row_stride + (int64)h * D + lane * VEC;
    float acc[VEC];
#pragma unroll
    for (int e = 0; e < VEC; ++e) acc[e] = 0.f;
#pragma unroll 4
    for (int t = 0; t < kernel_size; ++t) {
        Vec<T, VEC> x;
        x.load(src + t * row_stride);
#pragma unroll
        for (int e = 0; e < VEC; ++e) acc[e] += to_float(x.elem[e]);
    }
    Vec<T, VEC> y;
    const float n = (float)kernel_size;
#pragma unroll
    for (int e = 0; e < VEC; ++e) y.elem[e] = from_float<T>(acc[e] / n);
    y.store(out + c * row_stride + (int64)h * D + lane * VEC);
}
