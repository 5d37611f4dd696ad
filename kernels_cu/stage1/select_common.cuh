// stage1/select_common.cuh: the parts of InfLLM-v2 stage 1 that the SM80 kernel (select.cu) and the
// sm_90a kernel (select_sm90.cu) share: score-dtype keys, visibility limits, the per-tile softmax
// steps on mma.m16n8 accumulator fragments, the group sum (reduce-scatter), block pooling and the
// per-token top-K. Fragments: s[mt][n][e] = (row 16 mt + g + 8 (e / 2), column 8 n + 2 c + e % 2),
// g = lane / 4, c = lane % 4; a thread's rows rr = 2 mt + half.
#pragma once
#include "common/types.cuh"
#include "common/params.cuh"

#define S1_TILE 64         // compressed keys per tile
#define S1_ST 68           // staging row: [3] = carry (previous tile's column 63), [4 + c] = column c
#define S1_FULL 0xffffffffu
#define S1_BIG 0x7fffffff

// The parameters of stage1_select (select.cu; select_sm90.cu's STAGE1_SELECT_SM90_PARAMS adds its two
// tensor maps). Shapes and meanings: the launch contract in select.cu's header. infllm_cupy/stage1/
// select.py declares the fields (SELECT_PARAMS); the loader checks the layout at compile time.
#define STAGE1_SELECT_PARAMS(F, M) STAGE1_SELECT_FIELDS(F, M) STAGE1_RANGE_FIELDS(F, M)
#define STAGE1_SELECT_FIELDS(F, M) \
    F(const T* __restrict__, q)             /* [total_q, HQ, D] */ \
    F(const T* __restrict__, ck1)           /* [total_c1, H, D] fine compressed keys */ \
    F(const T* __restrict__, ck2)           /* [total_c2, H, D] coarse compressed keys (ck1 in exact mode) */ \
    F(const int* __restrict__, cu_q)        /* [B + 1] */ \
    F(const int* __restrict__, cu_c1)       /* [B + 1] */ \
    F(const int* __restrict__, cu_c2)       /* [B + 1] */ \
    F(const int* __restrict__, cache_lens)  /* [B] or null (zeros) */ \
    F(int* __restrict__, topk_idx)          /* [H, total_q, K]; unused by a range pass */ \
    F(KT* __restrict__, scores)             /* [H, total_q, max_n1] or null (inspection) */ \
    F(KT* __restrict__, block_scores)       /* [H, total_q, out_len] or null (inspection) */ \
    F(KT* __restrict__, bs_scratch)         /* [H, total_q, olp] block-score keys in global memory, or null \
                                               (shared memory) */ \
    F(int, total_q) F(int, HQ) F(int, H) F(int, G) /* query rows, query heads, KV heads, G = HQ / H */ \
    F(int, lgp)                             /* log2 of GP, the smallest power of two >= G */ \
    F(int, B) F(int, n_tiles)               /* sequences; token tiles per sequence (grid = n_tiles * B * H) */ \
    F(int, max_seqlen_q) \
    F(int, out_len) F(int, olp)             /* key blocks; block-key row length (range pass: 64 + range width) */ \
    F(int, K) F(int, max_n1)                /* top-K width; scores row length (0 without scores) */ \
    F(int, init_blocks) F(int, local_blocks) \
    F(int, quirk) F(int, causal)            /* 0 / 1: varlen_offset_quirk, the causal mask */ \
    F(int, kind)                            /* score dtype: 0 float32, 1 bf16, 2 fp16 */ \
    F(int, s1) F(int, s2c)                  /* fine and coarse compression strides (16, 64) */ \
    F(float, sl2)                           /* softmax_scale * log2(e) */ \
    F(int, topk_prefix)                     /* 0, or a test hook forcing the top-K's whole-row rerun */
// the range fields, which a full launch ignores (S1_BODY_CALL_ARGS)
#define STAGE1_RANGE_FIELDS(F, M) \
    F(int, j_lo) F(int, j_hi)               /* range pass: blocks [j_lo, j_hi) */ \
    F(unsigned* __restrict__, cand_key)     /* range pass: [H, total_q, K] 32-bit block keys */ \
    F(int* __restrict__, cand_idx)          /* range pass: [H, total_q, K] block indices */ \
    F(float* __restrict__, row_bias)        /* range passes: [total_q, HQ] coarse-pass bias per row, or null */ \
    F(int, bias_mode)                       /* 0 none, 1 store row_bias, 2 load it and skip the coarse pass */
template <typename T, typename KT>
struct Stage1SelectParams { PARAM_FIELDS(STAGE1_SELECT_PARAMS) };

// Each kernel calls its body, a __forceinline__ function whose parameters are the kernel's fields
// (PARAM_REF_ARGS), with constants in place of the range fields in a full launch
// (S1_BODY_CALL_ARGS(RANGED), RANGED = false), so that the compiler drops the range code. The body is
// a function of its own, not the kernel with the constants assigned at its top: NVVM optimises the
// callee with the constants before it inlines it, and the assignment compiles to more code (8280
// instead of 8256 instructions for <bf16, unsigned, 64, false> on sm_90).
#define S1_BODY_CALL_ARGS(RANGED) \
    PARAM_NAMES(STAGE1_SELECT_FIELDS), \
    (RANGED) ? j_lo : 0, (RANGED) ? j_hi : out_len, (RANGED) ? cand_key : nullptr, \
    (RANGED) ? cand_idx : nullptr, (RANGED) ? row_bias : nullptr, (RANGED) ? bias_mode : 0

// ------------------------------------------------------------------------------------------------
// Score dtype: scores are kept as the bit pattern of the score dtype (kind 0 = float32, 1 = bf16,
// 2 = fp16; KT = unsigned for float32, unsigned short for the 16-bit ones), and compared through
// order-preserving keys (key(a) < key(b) iff a < b, for non-NaN values)
// ------------------------------------------------------------------------------------------------
template <typename KT> struct Score;
template <> struct Score<unsigned short> {
    static constexpr int KEY_BITS = 16;
    static __device__ __forceinline__ unsigned short bits(float x, int kind) {
        return kind == 2 ? __half_as_ushort(__float2half_rn(x)) : __bfloat16_as_ushort(__float2bfloat16_rn(x));
    }
    static __device__ __forceinline__ float value(unsigned short b, int kind) {
        return kind == 2 ? __half2float(__ushort_as_half(b)) : __uint_as_float((unsigned)b << 16);
    }
    static __device__ __forceinline__ unsigned short key(unsigned short b) {
        const unsigned u = b;
        return (unsigned short)((u & 0x8000u) ? (~u & 0xffffu) : (u | 0x8000u));
    }
    static __device__ __forceinline__ unsigned short unkey(unsigned short k) {
        const unsigned u = k;
        return (unsigned short)((u & 0x8000u) ? (u & 0x7fffu) : (~u & 0xffffu));
    }
};
template <> struct Score<unsigned> {
    static constexpr int KEY_BITS = 32;
    static __device__ __forceinline__ unsigned bits(float x, int) { return __float_as_uint(x); }
    static __device__ __forceinline__ float value(unsigned b, int) { return __uint_as_float(b); }
    static __device__ __forceinline__ unsigned key(unsigned b) { return (b & 0x80000000u) ? ~b : (b | 0x80000000u); }
    static __device__ __forceinline__ unsigned unkey(unsigned k) { return (k & 0x80000000u) ? (k & 0x7fffffffu) : ~k; }
};
template <typename KT>
__device__ __forceinline__ float round_score(float x, int kind) { return Score<KT>::value(Score<KT>::bits(x, kind), kind); }
template <typename KT>
__device__ __forceinline__ KT score_key(float x, int kind) { return Score<KT>::key(Score<KT>::bits(x, kind)); }

// Visible compressed keys of query row r (spec 4.3, mask.h of the original); C truncating division.
__device__ __forceinline__ int vis_limit(int r, int s, int n, int Lq, int causal) {
    if (!causal) return n;
    const int lim = (r + 1) / s - 1 + n - (Lq - s + 1) / s;
    return min(n, max(0, lim));
}

// (m & a) | (~m & b) bit by bit in one LOP3: operands (a, b, m), the truth table of
// (c & a) | (~c & b) over PTX's a = 0xF0, b = 0xCC, c = 0xAA is 0xE4
__device__ __forceinline__ unsigned bitsel(unsigned m, unsigned a, unsigned b) {
    unsigned d;
    asm("lop3.b32 %0, %1, %2, %3, 0xE4;" : "=r"(d) : "r"(a), "r"(b), "r"(m));
    return d;
}

// Sum over the lanes that differ in bits 2 .. 2+LV-1 (the low LV bits of the accumulator row g =
// lane / 4), scattering the result: v holds 16 values v[2n + e] = column 8n + 2(lane%4) + e; after
// the call v[0 .. 16 >> LV) holds the sums of n-tiles n0 .. n0 + (8 >> LV), n0 = (g % 2^LV) * (8 >> LV).
template <int LV, int STEP = 0>
__device__ __forceinline__ void reduce_scatter(float (&v)[16], int lane) {
    if constexpr (STEP < LV) {
        constexpr int k = LV - 1 - STEP;       // reduces g bit k (lane bit 2 + k)
        constexpr int half = 8 >> STEP;        // values kept
        // lanes with the bit set keep the upper half; the selects are bit masks so that the compiler
        // never turns them into a select of addresses (which would put v in local memory), each one
        // LOP3 (bitsel: written out in C++ ptxas spent about two per select)
        const unsigned up = 0u - ((lane >> (2 + k)) & 1u);
#pragma unroll
        for (int i = 0; i < half; ++i) {
            const unsigned lo = __float_as_uint(v[i]), hi = __float_as_uint(v[i + half]);
            const float send = __uint_as_float(bitsel(up, lo, hi));
            const float keep = __uint_as_float(bitsel(up, hi, lo));
            v[i] = keep + __shfl_xor_sync(S1_FULL, send, 4 << k);
        }
        reduce_scatter<LV, STEP + 1>(v, lane);
    }
}

// Keys >= c (resp. > c) among the first nw words of a block-key row: 16-bit keys are read two per
// 32-bit word (key 2w in the low half, 2w + 1 in the high half).
template <typename key_t>
__device__ __forceinline__ int count_keys(const unsigned* words, int nw, unsigned c, bool strict, int lane) {
    unsigned cnt = 0;
    const unsigned c_ge = strict ? c + 1 : c;                  // > c is >= c + 1 (c below the key maximum)
#pragma unroll 4
    for (int x = lane; x < nw; x += 32) {
        const unsigned w = words[x];
        cnt += sizeof(key_t) == 2 ? (unsigned)(w >= (c_ge << 16)) + (unsigned)((w << 16) >= (c_ge << 16))
                                  : (unsigned)(w >= c_ge);
    }
    return (int)__reduce_add_sync(S1_FULL, cnt);
}

// The K-th largest key of the first nw words: the largest T with #(key >= T) >= K, one bit at a time
// from the top; `above` = #(key > T).
template <typename key_t>
__device__ __forceinline__ unsigned kth_key(const unsigned* words, int nw, int K, int& above, int lane) {
    constexpr int BITS = Score<key_t>::KEY_BITS;
    unsigned T = 0;
#pragma unroll 1
    for (int bit = BITS - 1; bit >= 0; --bit) {
        const unsigned cand = T | (1u << bit);
        if (count_keys<key_t>(words, nw, cand, false, lane) >= K) T = cand;
    }
    constexpr unsigned KEY_MAX = BITS == 16 ? 0xffffu : 0xffffffffu;
    above = T == KEY_MAX ? 0 : count_keys<key_t>(words, nw, T, true, lane);
    return T;
}

// The top-K sweep's output (sweep_words, select_keys): CAND = false writes block indices to out_idx,
// blocks above `qb_lo` (the token's own block) as -1 (topk_idx); CAND = true writes a key range's
// candidates, the key (zero-extended) to out_key and the global block qb_lo + j (qb_lo = j_lo) to out_idx.
// The ascending sweep of a top-K with threshold T over words w0 .. w1 - 1 of a block-key row (w0, w1
// multiples of 32; keys in index order: lane-major, low half first), 32 words a step, until `end`
// keys are taken. Keys > T are taken, and ties at T while fewer than `need` ties came before (ties
// to the lower index); ballot prefix sums give the output positions. eq_seen / taken: ties seen and
// keys taken before word w0.
template <typename key_t, bool CAND>
__device__ __forceinline__ void sweep_words(const unsigned* words, int w0, int w1, int end, unsigned T, int need,
                                            int lane, int eq_seen, int taken, int qb_lo, int* __restrict__ out_idx,
                                            unsigned* __restrict__ out_key) {
    constexpr int KPW = 4 / sizeof(key_t);                    // keys per 32-bit word
    const unsigned lt = (1u << lane) - 1u;
#pragma unroll 1
    for (int base = w0; base < w1 && taken < end; base += 32) {
        const unsigned w = words[base + lane];
        unsigned kk[KPW];
        if (KPW == 2) { kk[0] = w & 0xffffu; kk[KPW - 1] = w >> 16; } else { kk[0] = w; }
        bool eq[KPW], tk[KPW];
        unsigned be[KPW], bt[KPW];
        int below = 0;
#pragma unroll
        for (int x = 0; x < KPW; ++x) {
            eq[x] = kk[x] == T;
            be[x] = __ballot_sync(S1_FULL, eq[x]);
            below += __popc(be[x] & lt);
        }
        int rank = eq_seen + below;
#pragma unroll
        for (int x = 0; x < KPW; ++x) {
            tk[x] = kk[x] > T || (eq[x] && rank < need);
            rank += eq[x];
            eq_seen += __popc(be[x]);
        }
        int pos = taken;
#pragma unroll
        for (int x = 0; x < KPW; ++x) {
            bt[x] = __ballot_sync(S1_FULL, tk[x]);
            pos += __popc(bt[x] & lt);
        }
#pragma unroll
        for (int x = 0; x < KPW; ++x) {
            const int j = (base + lane) * KPW + x;
            if (tk[x]) {
                if (CAND) {
                    out_key[pos] = kk[x];
                    out_idx[pos] = qb_lo + j;
                } else {
                    out_idx[pos] = j > qb_lo ? -1 : j;
                }
            }
            pos += tk[x];
            taken += __popc(bt[x]);
        }
    }
}

// The K largest keys (ties to the lower index) of a block-key row of n keys (n a multiple of 64),
// ascending in index, written as sweep_words<key_t, CAND> writes them.
// The search first runs on the prefix of jpre keys (jpre a multiple of 64, at least K and past the
// token's own block): blocks after the token's own one are invisible to it (score 0 or -inf, or
// padding), so for most tokens the top-K lies in the prefix, which is on average half the row. It
// is kept when its K-th key T is >= every key after the prefix (then no later key can displace a
// prefix key: later ties lose to lower indices); otherwise the search reruns on the whole row.
template <typename key_t, bool CAND>
__device__ __forceinline__ void select_keys(const key_t* row, int n, int jpre, int K, int qb_lo, int lane,
                                            int* __restrict__ out_idx, unsigned* __restrict__ out_key) {
    constexpr int KPW = 4 / sizeof(key_t);                    // keys per 32-bit word
    const unsigned* words = reinterpret_cast<const unsigned*>(row);
    int nwords = n / KPW;                                     // a multiple of 32
    const int npre = min(jpre / KPW, nwords);                 // a multiple of 32 too
    unsigned tail_max = 0;
    for (int x = npre + lane; x < nwords; x += 32) {
        const unsigned w = words[x];
        tail_max = max(tail_max, sizeof(key_t) == 2 ? max(w & 0xffffu, w >> 16) : w);
    }
    tail_max = __reduce_max_sync(S1_FULL, tail_max);
    int above;
    unsigned T = kth_key<key_t>(words, npre, K, above, lane);
    if (npre < nwords && T < tail_max) T = kth_key<key_t>(words, nwords, K, above, lane);
    else nwords = npre;
    const int need = K - above;                               // ties at T to take, lowest index first
    sweep_words<key_t, CAND>(words, 0, nwords, K, T, need, lane, 0, 0, qb_lo, out_idx, out_key);
}

// The per-token top-K over a block-key row `row` (olp keys, out_len real, padding keys 0): the K
// largest (ties to the lower index), ascending, blocks above qb replaced by -1 (select_keys).
template <typename key_t>
__device__ __forceinline__ void select_row(key_t* row, int olp, int jpre, int K, int qb, int lane, int* __restrict__ out) {
    select_keys<key_t, false>(row, olp, jpre, K, qb, lane, out, nullptr);
}

// Pass 2, after the probabilities: sum each token's rows (s holds this thread's MT m-tiles x 8 n-tiles)
// and write the tile's 64 token columns, rounded to the score dtype (-inf past n1), to the token's
// staging row; GP >= 64 (nwt > 1) writes unrounded per-warp partial sums to sP instead.
//   LG <= 3: an m-tile holds 16 / GP tokens; rows g and g + 8 are different tokens
//   LG == 4: an m-tile is one token;  LG == 5 (MT = 2 only): the warp's 32 rows belong to one token
// tfirst is the warp's first token; its m-tiles hold consecutive rows.
template <typename KT, int LG, int MT>
__device__ __forceinline__ void stage_tokens(float (&s)[MT][8][4], float* __restrict__ sT, float* __restrict__ sP,
                                             int warp, int lane, int tfirst, int nwt, int kb, int n1, int kind) {
    static_assert(LG <= 4 || MT == 2, "a token of 32 rows needs both m-tiles of the warp");
    const int g = lane >> 2, c = lane & 3;
    if (LG >= 4) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int n = 0; n < 8; ++n) { s[mt][n][0] += s[mt][n][2]; s[mt][n][1] += s[mt][n][3]; }
    }
    if (LG == 5) {
#pragma unroll
        for (int n = 0; n < 8; ++n) { s[0][n][0] += s[MT - 1][n][0]; s[0][n][1] += s[MT - 1][n][1]; }
    }
    constexpr int NVEC = LG == 5 ? 1 : LG == 4 ? MT : 2 * MT;   // (m-tile, half) vectors left
    constexpr int LV = LG < 3 ? LG : 3;                  // butterfly levels over g
    constexpr int NN = 8 >> LV;                          // n-tiles kept per lane
    const int n0 = (g & ((1 << LV) - 1)) * NN;
#pragma unroll
    for (int vi = 0; vi < NVEC; ++vi) {
        const int mt = LG <= 3 ? vi >> 1 : LG == 4 ? vi : 0, hf = LG <= 3 ? vi & 1 : 0;
        float v[16];
#pragma unroll
        for (int n = 0; n < 8; ++n) { v[2 * n] = s[mt][n][2 * hf]; v[2 * n + 1] = s[mt][n][2 * hf + 1]; }
        reduce_scatter<LV>(v, lane);
        const int tw = LG <= 3 ? tfirst + mt * (16 >> LG) + hf * (8 >> LG) + (g >> LG) : LG == 4 ? tfirst + mt : tfirst;
#pragma unroll
        for (int i = 0; i < NN; ++i) {
            const int col = 8 * (n0 + i) + 2 * c;
            if (LG == 5 && nwt > 1) {
                *reinterpret_cast<float2*>(sP + warp * 64 + col) = make_float2(v[2 * i], v[2 * i + 1]);
            } else {
                const float a = kb + col < n1 ? round_score<KT>(v[2 * i], kind) : -INFLLM_INF;
                const float b = kb + col + 1 < n1 ? round_score<KT>(v[2 * i + 1], kind) : -INFLLM_INF;
                *reinterpret_cast<float2*>(sT + tw * S1_ST + 4 + col) = make_float2(a, b);
            }
        }
    }
}

// Tokens of 16 or 32 rows in the sm_90a kernel (G in 9..32, one m-tile of 16 rows per warp): the
// group sum, rounding and pooling of one fine tile without the staging row. After the reduce-scatter
// lane L holds the sums of columns 2L and 2L + 1 over the warp's rows (warp_rows_sum; at G > 16 two
// warps' sums are added), so block jl (columns 4 jl - 1 .. 4 jl + 3) is the max of lanes 2 jl and
// 2 jl + 1 and of lane 2 jl - 1's second column (for jl = 0: `carry`, column kb - 1 of the previous
// tile, updated here to column kb + 63). row: the token's block keys; scores_row: its inspection
// scores or null.
// The sum over the warp's 16 rows of columns 2 lane and 2 lane + 1 (unrounded).
__device__ __forceinline__ float2 warp_rows_sum(float (&s)[1][8][4], int lane) {
    float v[16];
#pragma unroll
    for (int n = 0; n < 8; ++n) {
        v[2 * n] = s[0][n][0] + s[0][n][2];
        v[2 * n + 1] = s[0][n][1] + s[0][n][3];
    }
    reduce_scatter<3>(v, lane);
    return make_float2(v[0], v[1]);
}

// Round a token's sums of columns 2 lane, 2 lane + 1 of one fine tile, write the inspection scores,
// and pool the tile's 16 blocks.
template <typename KT>
__device__ __forceinline__ void pool_columns(float2 sum, float& carry, KT* __restrict__ row,
                                             KT* __restrict__ scores_row, int max_n1, int kb, int n1, int out_len,
                                             int lane, int kind) {
    const int col = kb + 2 * lane;
    const float a = col < n1 ? round_score<KT>(sum.x, kind) : -INFLLM_INF;
    const float b = col + 1 < n1 ? round_score<KT>(sum.y, kind) : -INFLLM_INF;
    if (scores_row != nullptr) {
        if (col < max_n1) scores_row[col] = Score<KT>::bits(col < n1 ? a : 0.f, kind);
        if (col + 1 < max_n1) scores_row[col + 1] = Score<KT>::bits(col + 1 < n1 ? b : 0.f, kind);
    }
    const float m = fmaxf(a, b);
    const float m_next = __shfl_down_sync(S1_FULL, m, 1);
    float prev = __shfl_up_sync(S1_FULL, b, 1);
    if (lane == 0) prev = carry;
    carry = __shfl_sync(S1_FULL, b, 31);
    const int j = (kb >> 2) + (lane >> 1);
    if (!(lane & 1) && j < out_len) row[j] = score_key<KT>(fmaxf(fmaxf(m, m_next), prev), kind);
}

template <typename KT>
__device__ __forceinline__ void sum_pool_token16(float (&s)[1][8][4], float& carry, KT* __restrict__ row,
                                                 KT* __restrict__ scores_row, int max_n1, int kb, int n1, int out_len,
                                                 int lane, int kind) {
    pool_columns<KT>(warp_rows_sum(s, lane), carry, row, scores_row, max_n1, kb, n1, out_len, lane, kind);
}

// Sets the elements of row rr at keys >= lim[rr] (key index kb + column) to `value`.
template <int MT>
__device__ __forceinline__ void mask_from(float (&s)[MT][8][4], const int (&lim)[2 * MT], int kb, int c, float value) {
#pragma unroll
    for (int rr = 0; rr < 2 * MT; ++rr)
#pragma unroll
        for (int n = 0; n < 8; ++n)
#pragma unroll
            for (int e = 0; e < 2; ++e)
                if (kb + 8 * n + 2 * c + e >= lim[rr]) s[rr >> 1][n][2 * (rr & 1) + e] = value;
}

// A CTA's share of the work: KV head h of sequence b, tokens t0 .. t0 + ntok - 1 (TOK per CTA, the
// heaviest last token tiles first), and the key tiles they need: nc coarse, then nf fine.
struct S1Cta {
    int h, b, qs, Lq, t0, ntok, c1s, n1, c2s, n2, cache, s2, nc, nf;
};

// Fills `w` for this CTA; false when the CTA has no token (its sequence is shorter).
__device__ __forceinline__ bool s1_cta(S1Cta& w, int TOK, int H, int B, int n_tiles, const int* __restrict__ cu_q,
                                       const int* __restrict__ cu_c1, const int* __restrict__ cu_c2,
                                       const int* __restrict__ cache_lens, int s1, int s2c, int causal) {
    w.h = blockIdx.x % H;
    const int rest = blockIdx.x / H;
    w.b = rest % B;
    const int tile = n_tiles - 1 - rest / B;
    w.qs = cu_q[w.b];
    w.Lq = cu_q[w.b + 1] - w.qs;
    w.t0 = tile * TOK;
    if (w.t0 >= w.Lq) return false;
    w.c1s = cu_c1[w.b];
    w.n1 = cu_c1[w.b + 1] - w.c1s;
    w.c2s = cu_c2[w.b];
    w.n2 = cu_c2[w.b + 1] - w.c2s;
    w.cache = cache_lens ? cache_lens[w.b] : 0;
    w.s2 = w.n1 == w.n2 ? s1 : s2c;       // exact mode: the coarse pass walks the fine keys
    w.ntok = min(TOK, w.Lq - w.t0);
    // visible counts grow with r: the CTA's last token bounds the tiles
    const int r_hi = w.t0 + w.ntok - 1;
    const int l2_hi = vis_limit(r_hi, w.s2, w.n2, w.Lq, causal);
    const int l1_hi = l2_hi > 0 ? vis_limit(r_hi, s1, w.n1, w.Lq, causal) : 0;
    w.nf = (l1_hi + S1_TILE - 1) / S1_TILE;
    w.nc = w.nf > 0 ? (l2_hi + S1_TILE - 1) / S1_TILE : 0;
    return true;
}

// Visibility limits and softmax state of CTA row R (token R >> lgp, head R % GP); true when the
// token exists. Padding rows (and rows whose token sees no coarse key) are not masked: their
// probabilities are exp2(-inf) = 0 through bias = +inf.
__device__ __forceinline__ bool s1_row_init(const S1Cta& w, int R, int lgp, int G, int s1, int causal, int& lim1,
                                            int& lim2, float& bias, float& m_run, float& z_run) {
    const int tok = R >> lgp, gh = R & ((1 << lgp) - 1);
    const bool valid = tok < w.ntok && gh < G;
    const int r = w.t0 + tok;
    const int l2 = valid ? vis_limit(r, w.s2, w.n2, w.Lq, causal) : 0;
    const int l1 = valid && l2 > 0 ? vis_limit(r, s1, w.n1, w.Lq, causal) : 0;
    lim2 = valid ? l2 : S1_BIG;
    lim1 = valid && l2 > 0 ? l1 : S1_BIG;
    bias = INFLLM_INF;
    m_run = -INFLLM_INF;
    z_run = 0.f;
    return tok < w.ntok;
}

// Pass 1 on one tile of coarse scores: online max and sum per row over the keys below lim2.
template <int MT>
__device__ __forceinline__ void coarse_update(float (&s)[MT][8][4], const int (&lim2)[2 * MT], float (&m_run)[2 * MT],
                                              float (&z_run)[2 * MT], int kb, int c, float sl2) {
    int mn = S1_BIG;
#pragma unroll
    for (int rr = 0; rr < 2 * MT; ++rr) mn = min(mn, lim2[rr]);
    if (__any_sync(S1_FULL, mn < kb + S1_TILE)) mask_from<MT>(s, lim2, kb, c, -INFLLM_INF);
#pragma unroll
    for (int rr = 0; rr < 2 * MT; ++rr) {
        const int mt = rr >> 1, e0 = 2 * (rr & 1);
        float mx = -INFLLM_INF;
#pragma unroll
        for (int n = 0; n < 8; ++n) mx = fmaxf(mx, fmaxf(s[mt][n][e0], s[mt][n][e0 + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(S1_FULL, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(S1_FULL, mx, 2));
        const float m_new = fmaxf(m_run[rr], mx);
        const float m_use = m_new == -INFLLM_INF ? 0.f : m_new * sl2;   // all masked so far
        const float alpha = exp2f(fmaf(m_run[rr], sl2, -m_use));
        float sum = 0.f;
#pragma unroll
        for (int n = 0; n < 8; ++n)
#pragma unroll
            for (int e = 0; e < 2; ++e) sum += exp2f(fmaf(s[mt][n][e0 + e], sl2, -m_use));
        z_run[rr] = fmaf(z_run[rr], alpha, sum);
        m_run[rr] = m_new;
    }
}

// After the last coarse tile: p = exp2(s * sl2 - bias) = exp(scale (s - m)) / Z for every row.
template <int NR>
__device__ __forceinline__ void coarse_bias(const float (&z_run)[NR], const float (&m_run)[NR], const int (&lim1)[NR],
                                            float (&bias)[NR], float sl2) {
#pragma unroll
    for (int rr = 0; rr < NR; ++rr) {
        float z = z_run[rr];
        z += __shfl_xor_sync(S1_FULL, z, 1);
        z += __shfl_xor_sync(S1_FULL, z, 2);
        bias[rr] = lim1[rr] != S1_BIG ? fmaf(m_run[rr], sl2, log2f(z)) : INFLLM_INF;
    }
}

// Pass 2 on one tile of fine scores: probabilities, 0 at keys at or past lim1.
template <int MT>
__device__ __forceinline__ void fine_probs(float (&s)[MT][8][4], const int (&lim1)[2 * MT], const float (&bias)[2 * MT],
                                           int kb, int c, float sl2) {
    int mn = S1_BIG;
#pragma unroll
    for (int rr = 0; rr < 2 * MT; ++rr) mn = min(mn, lim1[rr]);
    const bool need = __any_sync(S1_FULL, mn < kb + S1_TILE);
#pragma unroll
    for (int rr = 0; rr < 2 * MT; ++rr)
#pragma unroll
        for (int n = 0; n < 8; ++n)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                float& x = s[rr >> 1][n][2 * (rr & 1) + e];
                x = exp2f(fmaf(x, sl2, -bias[rr]));
            }
    if (need) mask_from<MT>(s, lim1, kb, c, 0.f);   // only the tiles at some row's visibility limit
}

// One warp's tokens tfirst .. tfirst + tpw - 1 after their staging rows hold fine tile `kb / 64`:
// the inspection scores of the tile, the tile's 16 block keys (block jl = max over staging
// [3 + 4 jl, 8 + 4 jl) = columns [4 jl - 1, 4 jl + 4)), and the carry of column 63 to the next tile.
// bs0 + tok * olp is token tok's block-key row; score_row0 is the scores row of the CTA's token 0.
template <typename KT>
__device__ __forceinline__ void pool_tile(float* __restrict__ sT, KT* __restrict__ bs0, int olp, KT* __restrict__ scores,
                                          int64 score_row0, int max_n1, int tfirst, int tpw, int ntok, int kb,
                                          int n1, int out_len, int lane, int kind) {
    __syncwarp();
    if (scores != nullptr) {
        for (int i = lane; i < tpw * 64; i += 32) {
            const int tok = tfirst + (i >> 6), col = i & 63, cg = kb + col;
            if (tok < ntok && cg < max_n1)
                scores[(score_row0 + tok) * max_n1 + cg] = Score<KT>::bits(cg < n1 ? sT[tok * S1_ST + 4 + col] : 0.f, kind);
        }
    }
    const int jb = kb / 4;
    for (int i = lane; i < tpw * 16; i += 32) {
        const int tok = tfirst + (i >> 4), jl = i & 15;
        const float* st = sT + tok * S1_ST;
        const float4 o = *reinterpret_cast<const float4*>(st + 4 + 4 * jl);
        const float mx = fmaxf(fmaxf(fmaxf(o.x, o.y), fmaxf(o.z, o.w)), st[3 + 4 * jl]);
        if (tok < ntok && jb + jl < out_len) (bs0 + (int64)tok * olp)[jb + jl] = score_key<KT>(mx, kind);
    }
    __syncwarp();
    for (int i = lane; i < tpw; i += 32) sT[(tfirst + i) * S1_ST + 3] = sT[(tfirst + i) * S1_ST + 67];
}

// After the last tile, one warp per token: complete its block-key row (the tail no tile reached,
// padding, forced init and local blocks), write the inspection block scores, take the top-K.
//   row: the token's olp block keys, [0, jt) pooled by the tiles; carry: pooled column 64 nf - 1
//   (-inf when no fine tile ran); off_bq / qb: the token's own block for forcing / for the -1 tail
template <typename KT>
__device__ __forceinline__ void finish_token(KT* row, int jt, float carry, int off_bq, int qb, int n1, int olp,
                                             int out_len, int init_blocks, int local_blocks, int K,
                                             KT* __restrict__ block_scores, int64 trow, int* __restrict__ topk_idx,
                                             int topk_prefix, int lane, int kind) {
    const KT key_inf = score_key<KT>(INFLLM_INF, kind), key_zero = score_key<KT>(0.f, kind);
    const KT key_ninf = score_key<KT>(-INFLLM_INF, kind), key_carry = score_key<KT>(carry, kind);
    // blocks [0, min(jt, out_len)) were pooled in the tile loop; the tail, the padding and the forced
    // blocks are written here
    for (int j = min(jt, out_len) + lane; j < olp; j += 32) {
        KT k = 0;                               // padding: below every real key, never selected
        if (j < out_len) {
            // columns >= 64 nf are invisible to every token of the CTA: 0 where they exist
            const KT own = 4 * j < n1 ? key_zero : key_ninf;
            const KT prev = j == 0 ? key_ninf : j == jt ? key_carry : (4 * j - 1 < n1 ? key_zero : key_ninf);
            k = own > prev ? own : prev;
        }
        row[j] = k;
    }
    __syncwarp();                               // forced blocks overwrite tail values of other lanes
    for (int j = lane; j < min(init_blocks, out_len); j += 32) row[j] = key_inf;
    for (int j = max(0, off_bq - local_blocks) + lane; j <= off_bq; j += 32) row[j] = key_inf;
    __syncwarp();
    if (block_scores != nullptr)
        for (int j = lane; j < out_len; j += 32) block_scores[trow * out_len + j] = Score<KT>::unkey(row[j]);
    // the search prefix: blocks up to max(own block, K - 1), rounded up to 64 keys (topk_prefix > 0,
    // a test hook, replaces the own block by topk_prefix - 1 so that the whole-row rerun is exercised)
    const int jpre = ((topk_prefix > 0 ? max(topk_prefix, K) - 1 : max(off_bq, K - 1)) / 64 + 1) * 64;
    if (K > 0) select_row(row, olp, jpre, K, qb, lane, topk_idx + trow * K);
}

// After the tile loop and a CTA barrier: warp `warp` of `nwarps` finishes tokens warp, warp + nwarps,
// ... (finish_token), and writes the inspection scores past the last fine tile as 0. Block keys are
// in shared memory (sB) unless bs_scratch is given; two call sites, so that the shared one compiles
// to shared-memory accesses. sT[tok * S1_ST + 3] holds each token's carry (pooled column 64 nf - 1).
template <typename KT>
__device__ __forceinline__ void s1_finish_all(const S1Cta& w, int warp, int nwarps, int lane, const float* sT, KT* sB,
                                              KT* __restrict__ bs_scratch, int64 score_row0, int olp, int out_len,
                                              int init_blocks, int local_blocks, int K, int max_n1, int quirk,
                                              int max_seqlen_q, KT* __restrict__ scores, KT* __restrict__ block_scores,
                                              int* __restrict__ topk_idx, int topk_prefix, int kind) {
    const int jt = 16 * w.nf;                        // first block whose fine keys no token here sees
    const int q_shift = quirk ? max_seqlen_q - w.Lq : 0;
#pragma unroll 1
    for (int tok = warp; tok < w.ntok; tok += nwarps) {
        const int r = w.t0 + tok;
        const int64 trow = score_row0 + tok;
        const float carry = sT[tok * S1_ST + 3];
        const int off_bq = (r + w.cache) / 64, qb = (r + w.cache + q_shift) / 64;
        if (bs_scratch)
            finish_token<KT>(bs_scratch + trow * olp, jt, carry, off_bq, qb, w.n1, olp, out_len, init_blocks, local_blocks,
                             K, block_scores, trow, topk_idx, topk_prefix, lane, kind);
        else
            finish_token<KT>(sB + tok * olp, jt, carry, off_bq, qb, w.n1, olp, out_len, init_blocks, local_blocks, K,
                             block_scores, trow, topk_idx, topk_prefix, lane, kind);
        if (scores != nullptr)
            for (int cg = 64 * w.nf + lane; cg < max_n1; cg += 32) scores[trow * max_n1 + cg] = Score<KT>::bits(0.f, kind);
    }
}

// ------------------------------------------------------------------------------------------------
// Key-range passes (docs/stage1.md, 9. Long context: key ranges). A pass covers blocks [j_lo, j_hi)
// (j_lo a multiple of 64): its CTA computes the fine tiles [max(0, j_lo / 16 - 1), j_hi / 16) (one
// tile of overlap gives the carry, column 4 j_lo - 1, of the pooling window of block j_lo), pools
// into a per-token row of olp = 64 + wr keys whose first 64 keys are a landing pad for the overlap
// tile's blocks (block j at row[64 + j - j_lo]), and writes the range's K best (key, block index)
// candidates; the exact merge of the ranges' candidates runs after the last pass.
// ------------------------------------------------------------------------------------------------

// select_row's K largest keys (ties to the lower index) of one range row of wr keys, written as
// candidates: the order-preserving key (zero-extended to 32 bits) and the global block j_lo + j.
// Same search, prefix rule and sweep as select_row (select_keys); the output is ascending in block index.
template <typename key_t>
__device__ __forceinline__ void select_row_cand(key_t* row, int wr, int jpre, int K, int j_lo, int lane,
                                                unsigned* __restrict__ out_key, int* __restrict__ out_idx) {
    select_keys<key_t, true>(row, wr, jpre, K, j_lo, lane, out_idx, out_key);
}

// The number of fine tiles a CTA computes: the w.nf its tokens see, or in a range pass (`ranged`)
// those of [ft_lo, ft_lo + nf) that reach [j_lo, j_hi), ft_lo = max(0, j_lo / 16 - 1) (S1_FT_LO,
// re-derived from j_lo where it is used; w.nf stays the CTA's visible tiles). A range pass drops the
// coarse tiles (w.nc = 0) where it loads the row bias (bias_mode 2), or has no fine tile and no bias
// to store.
__device__ __forceinline__ int s1_pass_fine_tiles(S1Cta& w, bool ranged, int j_lo, int j_hi, int bias_mode) {
    int nf = w.nf;
    if (ranged) {
        const int ft_lo = max(0, j_lo / 16 - 1);
        nf = max(0, min(w.nf, (j_hi + 15) / 16) - ft_lo);
        if (bias_mode == 2 || (nf == 0 && bias_mode != 1)) w.nc = 0;
    }
    return nf;
}

// A range pass after the tile loop: warp `warp` of `nwarps` completes each of its tokens' range row
// as finish_token does (pooled [j_lo, min(jt, j_hi)), the tail by the visibility rule with the carry
// at jt, padding past min(j_hi, out_len), forced init and local blocks inside the range) and writes
// its K candidates to cand_key / cand_idx [H, total_q, K]. sB + tok * olp + 64 is token tok's row.
template <typename KT>
__device__ __forceinline__ void s1_finish_range_all(const S1Cta& w, int nf_all, int warp, int nwarps, int lane,
                                                    const float* sT, KT* sB, int64 score_row0, int olp, int j_lo,
                                                    int j_hi, int out_len, int init_blocks, int local_blocks, int K,
                                                    unsigned* __restrict__ cand_key, int* __restrict__ cand_idx,
                                                    int kind) {
    const int jt = 16 * nf_all;                      // first block whose fine keys no token here sees
    const int wr = olp - 64, jend = min(j_hi, out_len);
    const KT key_inf = score_key<KT>(INFLLM_INF, kind), key_zero = score_key<KT>(0.f, kind);
    const KT key_ninf = score_key<KT>(-INFLLM_INF, kind);
#pragma unroll 1
    for (int tok = warp; tok < w.ntok; tok += nwarps) {
        const int r = w.t0 + tok;
        const int64 trow = score_row0 + tok;
        KT* row = sB + tok * olp + 64;
        const KT key_carry = score_key<KT>(sT[tok * S1_ST + 3], kind);
        const int off_bq = (r + w.cache) / 64;
        for (int j = max(min(jt, jend), j_lo) + lane; j < j_lo + wr; j += 32) {
            KT k = 0;                               // padding: below every real key
            if (j < jend) {
                const KT own = 4 * j < w.n1 ? key_zero : key_ninf;
                const KT prev = j == 0 ? key_ninf : j == jt ? key_carry : (4 * j - 1 < w.n1 ? key_zero : key_ninf);
                k = own > prev ? own : prev;
            }
            row[j - j_lo] = k;
        }
        __syncwarp();
        for (int j = j_lo + lane; j < min(init_blocks, jend); j += 32) row[j - j_lo] = key_inf;
        for (int j = max(j_lo, off_bq - local_blocks) + lane; j <= min(off_bq, jend - 1); j += 32) row[j - j_lo] = key_inf;
        __syncwarp();
        const int jpre = ((max(off_bq - j_lo, K - 1)) / 64 + 1) * 64;
        if (K > 0) select_row_cand(row, wr, max(jpre, 64), K, j_lo, lane, cand_key + trow * K, cand_idx + trow * K);
    }
}

// Row statistics of the coarse pass (the exp2 bias of fine_probs) for a range pass: mode 1 stores
// this thread's rows' biases to row_bias [total_q, HQ] (after the coarse pass), mode 2 loads them
// (the coarse pass is skipped; rows of padding heads or past the CTA's tokens get +inf, as
// s1_row_init gives them). This thread's row rr is CTA row row0 + 8 rr (both kernels' layout).
template <int NR>
__device__ __forceinline__ void s1_row_bias(const S1Cta& w, int mode, float* __restrict__ row_bias, float (&bias)[NR],
                                            int row0, int lgp, int G, int HQ, int c) {
#pragma unroll
    for (int rr = 0; rr < NR; ++rr) {
        const int tok = (row0 + 8 * rr) >> lgp, gh = (row0 + 8 * rr) & ((1 << lgp) - 1);
        const bool valid = tok < w.ntok && gh < G;
        const float* p = row_bias + ((int64)(w.qs + w.t0 + tok) * HQ + (int64)w.h * G + gh);
        if (mode == 2) bias[rr] = valid ? *p : INFLLM_INF;
        else if (valid && c == 0) *const_cast<float*>(p) = bias[rr];
    }
}
