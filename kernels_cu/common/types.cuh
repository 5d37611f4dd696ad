// common/types.cuh: element-type helpers shared by all kernels.
//
// Kernels are templates over the storage type T in {__half, __nv_bfloat16, float}; all arithmetic
// is done in fp32. NVRTC has no <cstdint> and no INFINITY macro, hence the spellings below.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

typedef long long int64;

#define INFLLM_INF __int_as_float(0x7f800000)

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// An unsigned type of exactly BYTES bytes, for one wide load or store per thread.
template <int BYTES> struct VecStorage;
template <> struct VecStorage<2> { typedef unsigned short type; };
template <> struct VecStorage<4> { typedef unsigned int type; };
template <> struct VecStorage<8> { typedef uint2 type; };
template <> struct VecStorage<16> { typedef uint4 type; };

// N consecutive elements of T moved with one load/store (N * sizeof(T) in {2, 4, 8, 16}).
template <typename T, int N>
struct alignas(N * sizeof(T)) Vec {
    typedef typename VecStorage<N * sizeof(T)>::type storage;
    T elem[N];

    __device__ __forceinline__ void load(const T* p) {
        *reinterpret_cast<storage*>(elem) = *reinterpret_cast<const storage*>(p);
    }
    __device__ __forceinline__ void store(T* p) const {
        *reinterpret_cast<storage*>(p) = *reinterpret_cast<const storage*>(elem);
    }
};

// Index of the sequence that owns row `row` of a packed varlen tensor: the largest b with
// cu[b] <= row, for cu = cumulative lengths [B+1]. Empty sequences are skipped naturally.
__device__ __forceinline__ int find_sequence(const int* __restrict__ cu, int batch, int64 row) {
    int lo = 0, hi = batch - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) >> 1;
        if ((int64)cu[mid] <= row) lo = mid; else hi = mid - 1;
    }
    return lo;
}

// 16-byte chunk `ch` of row R of a forward CTA's flattened (token, head-in-group) Q space:
// q[qs + R / G, h * G + R % G, 8 ch ..] with `bytes` = 16, or the base with 0 (zero fill) past
// the sequence's rows_total = L_q * G rows.
template <typename T>
__device__ __forceinline__ const T* q_row_chunk(const T* __restrict__ q, int64 R, int64 rows_total, int G, int qs,
                                                int HQ, int h, int D, int ch, int& bytes) {
    bytes = 0;
    if (R >= rows_total) return q;
    const int t = (int)(R / G), g = (int)(R - (int64)t * G);
    bytes = 16;
    return q + ((int64)(qs + t) * HQ + (int64)h * G + g) * D + ch * 8;
}

// Index of the first set bit at or after bit `from` of a bitmask of `n_words` words, or -1.
__device__ __forceinline__ int next_set_bit(const unsigned* __restrict__ words, int n_words, int from) {
    int w = from >> 5;
    if (w >= n_words) return -1;
    unsigned bits = words[w] & (~0u << (from & 31));
    while (true) {
        if (bits) return (w << 5) + __ffs(bits) - 1;
        if (++w >= n_words) return -1;
        bits = words[w];
    }
}

// Highest set bit <= from of a bit array, or -1 (from < 0 gives -1).
__device__ __forceinline__ int prev_set_bit(const unsigned* __restrict__ words, int from) {
    if (from < 0) return -1;
    int w = from >> 5;
    unsigned bits = words[w] & (~0u >> (31 - (from & 31)));
    while (true) {
        if (bits) return (w << 5) + 31 - __clz(bits);
        if (--w < 0) return -1;
        bits = words[w];
    }
}

// n / d for 0 <= n < 2^31 without a division instruction sequence: a power of two shifts, any
// other d multiplies by ceil(2^(31 + l) / d) (l = ceil(log2 d), the multiplier fits 32 bits) and
// keeps the high word shifted by l - 1 (Granlund-Montgomery). init costs one 64-bit division.
struct FastDiv {
    unsigned mul, shift;   // mul == 0: d is a power of two
    __device__ __forceinline__ void init(unsigned d) {
        const unsigned l = 32 - __clz(d - 1);            // ceil(log2 d); d = 1: __clz(0) = 32
        if ((d & (d - 1)) == 0) {
            mul = 0;
            shift = l;
        } else {
            mul = (unsigned)(((1ull << (31 + l)) + d - 1) / d);
            shift = l - 1;
        }
    }
    __device__ __forceinline__ unsigned div(unsigned n) const { return mul ? __umulhi(n, mul) >> shift : n >> shift; }
};
