// stage1/packed.cuh: the group sum of stage 1 on packed f16x2 pairs (Stage1Plan.packed; docs/stage1.md,
// "Packed group sum").
//
// The exact path (select_common.cuh) sums each token's probabilities over its G heads in float32: the
// reduce-scatter moves one float per shuffle and spends one add and two selects per float. Here the
// probabilities, computed and row-pair-summed in float32 as before, are rounded to f16 pairs (columns
// 2c and 2c + 1 of one row in one register), and the reduce-scatter moves, selects and adds both
// columns with one shuffle, two LOP3 and one HADD2: half the instructions of that step.
//
// Range: the probabilities are scaled by 2^pk_shift(lgp) through the exp's bias (exact: a power of
// two), so that probabilities down to 2^-14 / 2^pk_shift stay normal f16 numbers; the sums are scaled
// back in float32 before the score dtype's rounding. A fine key's probability is normalised by the
// coarse keys' log-sum-exp, so it can exceed 1 (a 32-key window scores above every 128-key mean):
// where a sum leaves f16's range (65504) in some lane, the warp redoes the tile's sum in float32
// from the probabilities it still holds, so no input overflows the packed path. Precision: f16 keeps 11
// significant bits against the bf16 score's 8, and a sum of 16 rows rounds at most 4 times (the
// row pair in float32, then 3 packed levels), so the packed scores lie within about one bf16 step
// of the exact ones; ties and near-ties may order differently, which the tests allow (tie rule).
#pragma once
#include "common/types.cuh"
#include "stage1/select_common.cuh"

// log2 of the scale: a sum of 2^L rows (L = min(lgp, 4)) scaled by 2^(11 - L) stays below 65504 while
// the rows' mean probability is below 32 (above 1 only where fine keys beat the coarse maximum;
// beyond, the float32 fallback); probabilities stay normal f16 numbers down to 2^-(25 - L)
__device__ __forceinline__ float pk_shift(int lgp) { return (float)(11 - min(lgp, 4)); }

__device__ __forceinline__ unsigned pk_pack(float lo, float hi) {
    unsigned d;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}
__device__ __forceinline__ unsigned pk_add(unsigned a, unsigned b) {
    unsigned d;
    asm("add.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}
__device__ __forceinline__ float2 pk_unpack(unsigned v, float inv_scale) {
    return make_float2(__half2float(__ushort_as_half((unsigned short)(v & 0xffffu))) * inv_scale,
                       __half2float(__ushort_as_half((unsigned short)(v >> 16))) * inv_scale);
}

// reduce_scatter on pairs: v[n] = (column 8n + 2c, 8n + 2c + 1); after the call v[0 .. 8 >> LV) hold
// the sums of n-tiles n0 .. n0 + (8 >> LV), n0 = (g % 2^LV) * (8 >> LV), as reduce_scatter's floats.
template <int LV, int STEP = 0>
__device__ __forceinline__ void reduce_scatter_pk(unsigned (&v)[8], int lane) {
    if constexpr (STEP < LV) {
        constexpr int k = LV - 1 - STEP;
        constexpr int half = 4 >> STEP;
        const unsigned up = 0u - ((lane >> (2 + k)) & 1u);
#pragma unroll
        for (int i = 0; i < half; ++i) {
            const unsigned send = bitsel(up, v[i], v[i + half]);
            const unsigned keep = bitsel(up, v[i + half], v[i]);
            v[i] = pk_add(keep, __shfl_xor_sync(S1_FULL, send, 4 << k));
        }
        reduce_scatter_pk<LV, STEP + 1>(v, lane);
    }
}

// True when neither half of v is inf or NaN (a sum past f16's range: the caller redoes the tile in
// float32).
__device__ __forceinline__ bool pk_finite(unsigned v) {
    return (v & 0x7c00u) != 0x7c00u && (v & 0x7c000000u) != 0x7c000000u;
}

// warp_rows_sum on pairs: the sum over the warp's 16 rows of columns 2 lane and 2 lane + 1, scaled
// back by inv_scale. False (and `out` unset) when a sum left f16's range in some lane of the warp.
__device__ __forceinline__ bool warp_rows_sum_pk(float (&s)[1][8][4], int lane, float inv_scale, float2& out) {
    unsigned v[8];
#pragma unroll
    for (int n = 0; n < 8; ++n) v[n] = pk_pack(s[0][n][0] + s[0][n][2], s[0][n][1] + s[0][n][3]);
    reduce_scatter_pk<3>(v, lane);
    if (!__all_sync(S1_FULL, pk_finite(v[0]))) return false;
    out = pk_unpack(v[0], inv_scale);
    return true;
}

// stage_tokens (select_common.cuh) for one m-tile per warp and tokens of 4 or 8 rows (LG 2 or 3), on
// pairs; sT as there. False (nothing written) when a sum left f16's range in some lane of the warp.
template <typename KT, int LG>
__device__ __forceinline__ bool stage_tokens_pk(float (&s)[1][8][4], float* __restrict__ sT, int lane, int tfirst,
                                                int kb, int n1, int kind, float inv_scale) {
    static_assert(LG == 2 || LG == 3, "pairs pay from tokens of 4 rows on");
    const int g = lane >> 2, c = lane & 3;
    constexpr int NN = 8 >> LG;                          // n-tiles kept per lane
    const int n0 = (g & ((1 << LG) - 1)) * NN;
    unsigned v[2][8];
    bool fin = true;
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
#pragma unroll
        for (int n = 0; n < 8; ++n) v[hf][n] = pk_pack(s[0][n][2 * hf], s[0][n][2 * hf + 1]);
        reduce_scatter_pk<LG>(v[hf], lane);
#pragma unroll
        for (int i = 0; i < NN; ++i) fin &= pk_finite(v[hf][i]);
    }
    if (!__all_sync(S1_FULL, fin)) return false;
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        const int tw = tfirst + hf * (8 >> LG) + (g >> LG);
#pragma unroll
        for (int i = 0; i < NN; ++i) {
            const int col = 8 * (n0 + i) + 2 * c;
            const float2 x = pk_unpack(v[hf][i], inv_scale);
            const float a = kb + col < n1 ? round_score<KT>(x.x, kind) : -INFLLM_INF;
            const float b = kb + col + 1 < n1 ? round_score<KT>(x.y, kind) : -INFLLM_INF;
            *reinterpret_cast<float2*>(sT + tw * S1_ST + 4 + col) = make_float2(a, b);
        }
    }
    return true;
}

// The float32 fallback's input: the tile's probabilities scaled back to the exact path's.
__device__ __forceinline__ void pk_unscale(float (&s)[1][8][4], float inv_scale) {
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[0][n][e] *= inv_scale;
}
