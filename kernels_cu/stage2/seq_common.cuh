// stage2/seq_common.cuh: the per-sequence prologue every stage-2 kernel starts with (forward and
// backward, SM80 and sm_90a): where sequence b's queries and keys start in the packed varlen
// tensors, their lengths, the causal shift, the rows of the flattened (token, head-in-group)
// space, and the first selection-mask row of (sequence, KV head). stage1/select_common.cuh's
// S1Cta does the same for stage 1.
#pragma once
#include "common/types.cuh"

// The fields both forward kernels take after q and K/V (stage2_fwd, stage2_fwd_sm90: a field list of
// common/params.cuh; the launchers' _FWD_FIELDS): mask rows, sequences, outputs, shapes, scale.
#define STAGE2_FWD_ROW_FIELDS(F, M) \
    F(const unsigned* __restrict__, masks)      /* [..., n_words] bitmask rows over 64-key blocks */ \
    F(const int* __restrict__, mask_base)       /* [B]: first mask row of each sequence */ \
    F(const int* __restrict__, cu_seqlens_q)    /* [B + 1] */ \
    F(const int* __restrict__, cu_seqlens_k)    /* [B + 1] */ \
    F(T* __restrict__, out)                     /* [total_q, HQ, D] */ \
    F(float* __restrict__, lse)                 /* [HQ, total_q], natural log */ \
    F(int, total_q) F(int, HQ) F(int, H) F(int, G) /* query tokens; query heads; heads of the row space, queries per head */ \
    F(int, n_words)                             /* mask words per row */ \
    F(long long, mask_h_stride)                 /* mask rows between heads */ \
    F(int, mask_q_block)                        /* query tokens per mask row */ \
    F(float, scale_log2)                        /* softmax scale * log2(e) */ \
    F(int, causal)                              /* 1: bottom-right causal */

// The fields every dq and dk/dv kernel of the backward takes (sparse_bwd.cu, sparse_bwd_sm90.cu,
// sparse_bwd_dq_sm90.cu; the launcher's `inputs` and `rows`). After q, K/V and dout: the forward's
// lse, delta, the mask rows and the sequences.
#define STAGE2_BWD_INPUT_FIELDS(F, M) \
    F(const float* __restrict__, lse)           /* [HQ, total_q], the forward's (natural log) */ \
    F(const float* __restrict__, delta)         /* [HQ, total_q] (stage2_bwd_delta) */ \
    F(const unsigned* __restrict__, masks)      /* bitmask rows (stage2_fwd's layout, sparse_fwd.cu) */ \
    F(const int* __restrict__, mask_base)       /* [B] first mask row of each sequence */ \
    F(const int* __restrict__, cu_seqlens_q)    /* [B + 1] */ \
    F(const int* __restrict__, cu_seqlens_k)    /* [B + 1] */
// q, K/V and dout as pointers, then the fields above (the kernels that do not read K/V by TMA).
#define STAGE2_BWD_QKV_FIELDS(F, M) \
    F(const T* __restrict__, q)                 /* [total_q, HQ, D] */ \
    F(const T* __restrict__, k)                 /* [total_k, H, D] (QH 2, 3: H / kv_group heads) */ \
    F(const T* __restrict__, v)                 /* as k */ \
    F(const T* __restrict__, dout)              /* [total_q, HQ, D] */ \
    STAGE2_BWD_INPUT_FIELDS(F, M)
// After the outputs: the shapes, the scale and the causal flag.
#define STAGE2_BWD_ROW_FIELDS(F, M) \
    F(int, total_q) F(int, HQ) F(int, H) F(int, G) /* H, G: of the row space (QH 2, 3: HQ, 1) */ \
    F(int, n_words)                             /* mask words per row */ \
    F(long long, mask_h_stride)                 /* mask rows between heads */ \
    F(int, mask_q_block)                        /* tokens per mask row */ \
    F(float, scale_log2) F(float, scale)        /* softmax scale times log2(e), softmax scale */ \
    F(int, causal)

struct S2Seq {
    int qs, Lq;          // the sequence's first query token in q / out (packed), its query count
    int ks, Lk;          // the same for k / v
    int shift;           // causal (bottom-right aligned): key c is visible to token r iff c <= r + shift; else 0
    int64 rows_total;    // Lq * G: rows of the flattened (token, head-in-group) space
};

// The prologue comes in three parts, which a kernel calls where it computed them before they
// became functions: computed ahead of an early exit (rows or a key block past the sequence), they
// changed how ptxas scheduled the kernels (and made the sm_90a dk/dv kernel at D = 128 spill).
// Each fills the caller's S2Seq in place: returned by value (a copy with fields not yet set), the
// sm_90a forward's schedule changed too. The cu_seqlens reads: qs, Lq, ks, Lk.
__device__ __forceinline__ void s2_seq_bounds(S2Seq& s, const int* __restrict__ cu_seqlens_q,
                                              const int* __restrict__ cu_seqlens_k, int b) {
    s.qs = cu_seqlens_q[b];
    s.Lq = cu_seqlens_q[b + 1] - s.qs;
    s.ks = cu_seqlens_k[b];
    s.Lk = cu_seqlens_k[b + 1] - s.ks;
}
__device__ __forceinline__ void s2_seq_rows(S2Seq& s, int G) { s.rows_total = (int64)s.Lq * G; }
__device__ __forceinline__ void s2_seq_shift(S2Seq& s, int causal) { s.shift = causal ? s.Lk - s.Lq : 0; }

// The whole prologue, for kernels that need all of it before their first exit.
__device__ __forceinline__ void s2_seq(S2Seq& s, const int* __restrict__ cu_seqlens_q,
                                       const int* __restrict__ cu_seqlens_k, int b, int G, int causal) {
    s2_seq_bounds(s, cu_seqlens_q, cu_seqlens_k, b);
    s2_seq_rows(s, G);
    s2_seq_shift(s, causal);
}

// 64-key blocks that hold the sequence's Lk keys.
__device__ __forceinline__ int key_blocks(int Lk) { return (Lk + 63) / 64; }

// The first selection-mask row of (sequence b, KV head h); token r's row is r / mask_q_block rows
// further (the masks layout of stage2_fwd's launch contract, sparse_fwd.cu).
__device__ __forceinline__ const unsigned* seq_mask_rows(const unsigned* __restrict__ masks,
                                                        const int* __restrict__ mask_base, int b, int h,
                                                        long long mask_h_stride, int n_words) {
    return masks + ((int64)mask_base[b] + (int64)h * mask_h_stride) * n_words;
}
