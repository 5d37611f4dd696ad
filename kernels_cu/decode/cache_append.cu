// decode/cache_append.cu: a decode step's new token per sequence into a DecodeCache, in one launch: its
// key and value at position p = seqlens[b], the compression windows that end at p (spec section 3, the
// incremental form: a window is written once, when its last key arrives), then seqlens[b] = p + 1.
// Design: docs/decode.md, 2. Cache.
//
// Launch contract (mirrored by infllm_cupy/decode/cache_append.py, whose APPEND_PARAMS declares
// CacheAppendParams field by field; the loader checks the layout at compile time):
//   kernel  cache_append_one<T>(the fields of CacheAppendParams<T>)    T in {__half, __nv_bfloat16, float}
//   grid    (B, 1, 1)    block (CA_THREADS, 1, 1)    no shared memory
//   k_new, v_new  [B, H, D] T, contiguous; row = H * D elements, a multiple of 8 / sizeof(T) x 2
//   k, v          contiguous [B, L_max, H, D] T (block_table nullptr, row_stride_b = L_max), or paged
//                 [num_pages, page_size, H, D] T with block_table int32 [B, max_pages]
//   ck1 [B, N1, H, D] T (32/16 windows), ck2 [B, N2, H, D] T (128/64); seqlens int32 [B]
//   capacity      positions a sequence can address (L_max, or max_pages * page_size)
//   ck[b, i] = from_float(sum_{t < ks} k[pos i * st + t] / ks), the sum in fp32 in position order: the
//   expression of compress/mean_pool.cu, so the two agree bit for bit.
// A sequence whose p is past its capacity (p >= capacity, or page -1) is left as it is: the eager
// caller checks capacities on the host before the launch; a replayed graph cannot.
//
// Each thread owns VEC consecutive elements (16 bytes) of the H * D row: it writes them for k and v,
// then reads its own elements of the window's rows (its own write among them, so no barrier is
// needed before the means; k is not __restrict__ for that reason); one barrier before seqlens[b] changes, after every thread has read it.
#include "common/types.cuh"
#include "common/params.cuh"

#define CA_THREADS 128

template <typename T>
__device__ __forceinline__ const T* ca_row(const T* base, const int* __restrict__ bt, int b, int t, int max_pages,
                                           int page_size, int L_max, int row) {
    const int64 r = bt != nullptr ? (int64)bt[(int64)b * max_pages + t / page_size] * page_size + t % page_size
                                  : (int64)b * L_max + t;
    return base + r * row;
}

template <typename T, int VEC>
__device__ __forceinline__ void ca_window(const T* k, T* __restrict__ ck, const int* __restrict__ bt,
                                          int b, int p, int ks, int st, int N, int max_pages, int page_size,
                                          int L_max, int row) {
    const int first = p + 1 - ks;                       // the window [first, p] ends at the new key
    if (first < 0 || first % st != 0 || first / st >= N) return;
    T* dst = ck + ((int64)b * N + first / st) * row;
    for (int e = VEC * threadIdx.x; e < row; e += VEC * CA_THREADS) {
        float acc[VEC];
#pragma unroll
        for (int i = 0; i < VEC; ++i) acc[i] = 0.f;
        for (int t = first; t <= p; ++t) {
            Vec<T, VEC> x;
            x.load(ca_row(k, bt, b, t, max_pages, page_size, L_max, row) + e);
#pragma unroll
            for (int i = 0; i < VEC; ++i) acc[i] += to_float(x.elem[i]);
        }
        Vec<T, VEC> y;
        const float n = (float)ks;
#pragma unroll
        for (int i = 0; i < VEC; ++i) y.elem[i] = from_float<T>(acc[i] / n);
        y.store(dst + e);
    }
}

// The arguments (the launch contract above; k and v are not __restrict__: see above).
#define CACHE_APPEND_PARAMS(F, M) \
    F(const T* __restrict__, k_new)             /* [B, H, D] the new keys */ \
    F(const T* __restrict__, v_new)             /* [B, H, D] the new values */ \
    F(T*, k)                                    /* [B, L_max, H, D], or [num_pages, page_size, H, D] (paged) */ \
    F(T*, v)                                    /* as k */ \
    F(T* __restrict__, ck1)                     /* [B, N1, H, D] 32/16 windows */ \
    F(T* __restrict__, ck2)                     /* [B, N2, H, D] 128/64 windows */ \
    F(int* __restrict__, seqlens)               /* [B] read, then advanced by one */ \
    F(const int* __restrict__, block_table)     /* [B, max_pages] (paged), or nullptr (contiguous) */ \
    F(int, max_pages) F(int, page_size)         /* 0, 0 when contiguous */ \
    F(int, L_max)                               /* the contiguous cache's rows per sequence (0 when paged) */ \
    F(int, capacity)                            /* positions a sequence can address */ \
    F(int, row)                                 /* H * D elements of one position */ \
    F(int, N1) F(int, N2)                       /* windows per sequence of ck1, ck2 */
template <typename T>
struct CacheAppendParams { PARAM_FIELDS(CACHE_APPEND_PARAMS) };

template <typename T>
__global__ void __launch_bounds__(CA_THREADS)
cache_append_one(PARAM_ARGS(CACHE_APPEND_PARAMS)) {
    constexpr int VEC = 16 / sizeof(T);
    const int b = blockIdx.x;
    const int pos = seqlens[b];
    const bool room =
        pos < capacity && (block_table == nullptr || block_table[(int64)b * max_pages + pos / page_size] >= 0);
    if (!room) return;                                   // the whole CTA: the same position
    T* kd = const_cast<T*>(ca_row<T>(k, block_table, b, pos, max_pages, page_size, L_max, row));
    T* vd = const_cast<T*>(ca_row<T>(v, block_table, b, pos, max_pages, page_size, L_max, row));
    for (int e = VEC * threadIdx.x; e < row; e += VEC * CA_THREADS) {
        Vec<T, VEC> x;
        x.load(k_new + (int64)b * row + e);
        x.store(kd + e);
        x.load(v_new + (int64)b * row + e);
        x.store(vd + e);
    }
    ca_window<T, VEC>(k, ck1, block_table, b, pos, 32, 16, N1, max_pages, page_size, L_max, row);
    ca_window<T, VEC>(k, ck2, block_table, b, pos, 128, 64, N2, max_pages, page_size, L_max, row);
    __syncthreads();                                     // every thread has read seqlens[b]
    if (threadIdx.x == 0) seqlens[b] = pos + 1;
}
