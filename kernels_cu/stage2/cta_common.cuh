// stage2/cta_common.cuh: the per-CTA setup that the stage-2 kernels (forward and backward, SM80
// and sm_90a) share: which 64-key blocks a range of query tokens may see, the union of their
// selection bitmask rows, and the per-row state of a backward dq tile.
//
// Mask rows are uint32 words over 64-key blocks: bit k of word w is block 32 w + k.
#pragma once
#include "common/types.cuh"
#include "common/mma_sm80.cuh"

// Last 64-key block a token <= t_hi may see: n_blocks - 1 (n_blocks already capped at the mask
// width), or the block of key t_hi + shift when causal; -1 when none.
__device__ __forceinline__ int last_visible_block(int n_blocks, int causal, int t_hi, int shift) {
    const int last = n_blocks - 1;
    if (!causal) return last;
    return min(last, (t_hi + shift) < 0 ? -1 : (t_hi + shift) / 64);
}

// Word w of a mask row with the bits of blocks past max_block cleared.
__device__ __forceinline__ unsigned clip_word(unsigned u, int w, int max_block) {
    const int keep = max_block - 32 * w + 1;     // low bits kept
    return keep <= 0 ? 0u : keep >= 32 ? u : u & ((1u << keep) - 1u);
}

// Word w of a mask row with the bits of blocks below min_block cleared.
__device__ __forceinline__ unsigned clip_word_below(unsigned u, int w, int min_block) {
    const int drop = min_block - 32 * w;         // low bits dropped
    return drop <= 0 ? u : drop >= 32 ? 0u : u & (~0u << drop);
}

// OR of word w over mask rows q_lo..q_hi, and (in `all`) their AND.
__device__ __forceinline__ unsigned rows_or_and(const unsigned* __restrict__ mrows, int n_words, int q_lo, int q_hi,
                                                int w, unsigned& all) {
    unsigned u = 0, a = ~0u;
    for (int r = q_lo; r <= q_hi; ++r) {
        const unsigned x = __ldg(mrows + (int64)r * n_words + w);
        u |= x;
        a &= x;
    }
    all = a;
    return u;
}

// OR of word w over mask rows q_lo..q_hi (the unused AND compiles away).
__device__ __forceinline__ unsigned rows_or(const unsigned* __restrict__ mrows, int n_words, int q_lo, int q_hi, int w) {
    unsigned all;
    return rows_or_and(mrows, n_words, q_lo, q_hi, w, all);
}

// Mask words that hold blocks 0..max_block.
__device__ __forceinline__ int union_words(int max_block) { return max_block >= 0 ? (max_block >> 5) + 1 : 0; }

// sU[0, nw) = union of mask rows q_lo..q_hi clipped to max_block, nw = union_words(max_block);
// threads tid of `threads` share the words. The caller synchronises.
__device__ __forceinline__ void cta_union(unsigned* sU, const unsigned* __restrict__ mrows, int n_words, int q_lo, int q_hi,
                                          int max_block, int nw, int tid, int threads) {
    for (int w = tid; w < nw; w += threads) sU[w] = clip_word(rows_or(mrows, n_words, q_lo, q_hi, w), w, max_block);
}

// This thread's two rows (row0 and row0 + 8 of the flattened (token, head-in-group) space) of a
// backward dq tile: whether each exists, its last visible key (rk), its mask row, its lse in log2
// units (0 for an empty row's +inf lse: such a row never reaches a selected, visible block) and its
// delta. Rows past the sequence take token t_fallback and zeros.
__device__ __forceinline__ void dq_row_state(int64 row0, int64 rows_total, int t_fallback, int G, int causal, int shift,
                                             int Lk, const unsigned* __restrict__ mrows, int mask_q_block, int n_words,
                                             int h, int total_q, int qs, const float* __restrict__ lse,
                                             const float* __restrict__ delta, bool (&row_ok)[2], int (&rk)[2],
                                             const unsigned* (&mrow)[2], float (&lse2)[2], float (&dlt)[2]) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int64 R = row0 + 8 * r;
        row_ok[r] = R < rows_total;
        const int t = row_ok[r] ? (int)(R / G) : t_fallback;
        const int g = row_ok[r] ? (int)(R - (int64)t * G) : 0;
        rk[r] = causal ? t + shift : Lk - 1;
        mrow[r] = mrows + (int64)(t / mask_q_block) * n_words;
        const int64 li = ((int64)h * G + g) * total_q + qs + t;
        const float l = row_ok[r] ? __ldg(lse + li) : 0.f;
        lse2[r] = l == INFLLM_INF ? 0.f : l * 1.4426950408889634f;
        dlt[r] = row_ok[r] ? __ldg(delta + li) : 0.f;
    }
}

// Keys 64 j .. 64 j + 63 of KV head h (rows past L_k as zeros) into the swizzled SM80 tiles dk and
// dv (`swz`), by cp.async; threads tid of `threads` share the copies, the caller commits.
template <typename T, int D>
__device__ __forceinline__ void load_kv_block(T* dk, T* dv, const T* __restrict__ k, const T* __restrict__ v, int j,
                                              int ks, int Lk, int H, int h, int tid, int threads) {
    constexpr int CH = D / 8;
    for (int i = tid; i < 64 * CH; i += threads) {
        const int row = i / CH, ch = i % CH;
        const int key = j * 64 + row;
        const int64 off = ((int64)(ks + key) * H + h) * D + ch * 8;
        const int bytes = key < Lk ? 16 : 0;
        cp_async_16(smem_u32(dk + swz<D>(row, ch) * 8), bytes ? k + off : k, bytes);
        cp_async_16(smem_u32(dv + swz<D>(row, ch) * 8), bytes ? v + off : v, bytes);
    }
}
