// stage1/select.cu: InfLLM-v2 stage 1 in one kernel (spec 4-6): for every query token and KV head,
// the relevance of the fine compressed keys under the coarse-key normaliser, summed over the G query
// heads of the group and rounded to the score dtype, max-pooled to 64-token blocks with the init and
// local blocks forced, and the top-K of those block scores: InfLLM-v2's topk_idx.
//
// Launch contract (mirrored by infllm_cupy/stage1/select.py):
//   kernel   stage1_select<T, KT, D>
//              T  in {__half, __nv_bfloat16}: q, ck1, ck2
//              KT = unsigned short for bf16/fp16 scores, unsigned for float32 scores: the score dtype's
//                 bit pattern; `kind` (0 float32, 1 bf16, 2 fp16) picks the rounding. Fine scores are
//                 rounded to the score dtype before pooling, and block scores are compared in it
//              D  in {64, 128}
//   grid     (n_tiles * B * H)   n_tiles = cdiv(max_seqlen_q, TOK); blockIdx.x = (n_tiles-1-tile)*B*H + b*H + h
//   block    32 * WARPS, WARPS in {1, 2, 4} and WARPS >= GP / 32, GP = the smallest power of two >= G
//            (1 <= G <= 128), lgp = log2(GP), LG = min(lgp, 5); the CTA owns 32 * WARPS rows =
//            TOK = 32 * WARPS / GP consecutive tokens of one sequence (rows are (token, head-in-group))
//   dyn smem 2 * 64 * D * sizeof(T)                      two key tiles (the Q tile before the loop)
//            + TOK * 68 * 4                              per-token staging row of one tile of fine scores
//            + (LG == 5 ? WARPS * 64 * 4 : 0)             per-warp partial sums (GP >= 64)
//            + (bs_scratch ? 0 : TOK * olp * sizeof(KT)) block-score keys
//   q        [total_q, HQ, D] T      ck1 [total_c1, H, D] T      ck2 [total_c2, H, D] T  (ck2 = ck1: exact mode)
//   cu_q / cu_c1 / cu_c2 int32 [B+1]; cache_lens int32 [B] or null (zeros)
//   topk_idx int32 [H, total_q, K] (every element written); 1 <= K <= out_len, K = 0 writes nothing
//   scores   [H, total_q, max_n1] or null; block_scores [H, total_q, out_len] or null, both in the score
//            dtype (every element written when given: the inspection outputs of return_scores)
//   bs_scratch KT [H, total_q, olp] or null: block-score keys in global memory instead of shared memory
//            (only when TOK * olp keys do not fit in shared memory)
//   olp      out_len rounded up to a multiple of 64;   s1 = 16 (fine stride), s2c = 64 (coarse stride)
//   sl2      softmax_scale * log2(e)
//
// Semantics (exactly infllm_cupy/stage1/naive.py): for query row r of sequence b (Lq queries, n1 fine
// and n2 coarse keys; exact mode iff n1 == n2, then the coarse pass uses stride s1), visible counts
// l(r, s, n) = causal ? min(n, max(0, (r+1)/s - 1 + n - (Lq-s+1)/s)) : n with C division.
// Head g: m_g, Z_g = max and sum of exp(scale (s2 - m_g)) over the l2 visible coarse keys;
// p_g(i) = exp(scale s1_i - scale m_g) / Z_g for i < l1, else 0; score(i) = round_S(sum_g p_g(i)),
// all zero when l2 == 0. Block j = max over fine keys [4j-1, 4j+4) clipped to [0, n1) (-inf if empty),
// +inf when j < init_blocks or off_bq - local_blocks <= j <= off_bq, off_bq = (r + cache) / 64.
// topk_idx = the K largest blocks (ties: lower block index first), ascending, an index above
// qb = (r + cache + (quirk ? max_seqlen_q - Lq : 0)) / 64 replaced by -1 (so -1 is tail padding).
//
// Shape of the work: the CTA's rows are tokens x heads of one KV head, as in stage 2 (G = 16: one
// m-tile is one token; GP > G pads a token with zero rows). Each warp holds its 32 rows of Q in
// registers. The CTA streams 64-key tiles through shared memory (cp.async, double buffered, one
// barrier per tile): first the visible coarse keys (online max and sum per row), then the visible
// fine keys, whose probabilities are summed over each token's rows in registers (a reduce-scatter
// butterfly that leaves every lane two or more columns of one token), rounded to S and staged per
// token in shared memory, from where each warp pools its tokens' 16 blocks of the tile into their
// block-score row (order-preserving integer keys). No [H, total_q, n1] tensor exists anywhere.
// After the last tile each warp runs the top-K of its tokens: the K-th largest key by a binary
// search over the key bits (per-bit count with a warp reduction), then one ascending sweep that
// takes every key above it and the lowest-index ties (ballot prefix sums give output positions).
#include "common/types.cuh"
#include "common/mma_sm80.cuh"

#define S1_TILE 64         // compressed keys per tile
#define S1_ST 68           // staging row: [3] = carry (previous tile's column 63), [4 + c] = column c
#define S1_FULL 0xffffffffu
#define S1_BIG 0x7fffffff

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

// 16-bit keys are read two per 32-bit word (key 2w in the low half, 2w+1 in the high half).
// Number of keys in `w` that are >= c (resp. > c).
__device__ __forceinline__ unsigned count_ge(unsigned w, unsigned c, unsigned short*) {
    return (unsigned)(w >= (c << 16)) + (unsigned)((w << 16) >= (c << 16));
}
__device__ __forceinline__ unsigned count_gt(unsigned w, unsigned c, unsigned short*) {
    return (unsigned)(w > ((c << 16) | 0xffffu)) + (unsigned)((w << 16) > (c << 16));
}
__device__ __forceinline__ unsigned count_ge(unsigned w, unsigned c, unsigned*) { return (unsigned)(w >= c); }
__device__ __forceinline__ unsigned count_gt(unsigned w, unsigned c, unsigned*) { return (unsigned)(w > c); }

// Visible compressed keys of query row r (spec 4.3, mask.h of the original); C truncating division.
__device__ __forceinline__ int vis_limit(int r, int s, int n, int Lq, int causal) {
    if (!causal) return n;
    const int lim = (r + 1) / s - 1 + n - (Lq - s + 1) / s;
    return min(n, max(0, lim));
}

template <int D>
__device__ __forceinline__ int swz(int row, int chunk) {
    return row * (D / 8) + (chunk ^ (row & 7));
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
        // never turns them into a select of addresses (which would put v in local memory)
        const unsigned up = 0u - ((lane >> (2 + k)) & 1u);
#pragma unroll
        for (int i = 0; i < half; ++i) {
            const unsigned lo = __float_as_uint(v[i]), hi = __float_as_uint(v[i + half]);
            const float send = __uint_as_float((lo & up) | (hi & ~up));
            const float keep = __uint_as_float((hi & up) | (lo & ~up));
            v[i] = keep + __shfl_xor_sync(S1_FULL, send, 4 << k);
        }
        reduce_scatter<LV, STEP + 1>(v, lane);
    }
}

// The per-token top-K over a block-key row `row` (olp keys, out_len real, padding keys 0).
template <typename key_t>
__device__ __forceinline__ void select_row(key_t* row, int olp, int K, int qb, int lane, int* __restrict__ out) {
    constexpr int KPW = 4 / sizeof(key_t);                    // keys per 32-bit word
    constexpr int BITS = Score<key_t>::KEY_BITS;
    const unsigned* words = reinterpret_cast<const unsigned*>(row);
    const int nwords = olp / KPW;                             // a multiple of 32
    key_t* tag = nullptr;
    // K-th largest key: the largest T with #(key >= T) >= K, one bit at a time from the top
    unsigned T = 0;
#pragma unroll 1
    for (int bit = BITS - 1; bit >= 0; --bit) {
        const unsigned cand = T | (1u << bit);
        unsigned cnt = 0;
#pragma unroll 4
        for (int x = lane; x < nwords; x += 32) cnt += count_ge(words[x], cand, tag);
        cnt = __reduce_add_sync(S1_FULL, cnt);
        if (cnt >= (unsigned)K) T = cand;
    }
    unsigned gt = 0;
#pragma unroll 4
    for (int x = lane; x < nwords; x += 32) gt += count_gt(words[x], T, tag);
    const int need = K - (int)__reduce_add_sync(S1_FULL, gt); // ties at T to take, lowest index first
    // ascending sweep; keys in index order: lane-major, low half first
    const unsigned lt = (1u << lane) - 1u;
    int eq_seen = 0, taken = 0;
#pragma unroll 1
    for (int base = 0; base < nwords && taken < K; base += 32) {
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
            if (tk[x]) out[pos] = j > qb ? -1 : j;
            pos += tk[x];
            taken += __popc(bt[x]);
        }
    }
}

// Pass 2, after the probabilities: sum each token's rows (s holds this thread's 2 m-tiles x 8 n-tiles)
// and write the tile's 64 token columns, rounded to the score dtype (-inf past n1), to the token's
// staging row; GP >= 64 (nwt > 1) writes unrounded per-warp partial sums to sP instead.
//   LG <= 3: an m-tile holds 16 / GP tokens; rows g and g + 8 are different tokens
//   LG == 4: an m-tile is one token;  LG == 5: the warp's 32 rows belong to one token
template <typename KT, int LG>
__device__ __forceinline__ void stage_tokens(float (&s)[2][8][4], float* __restrict__ sT, float* __restrict__ sP,
                                             int warp, int lane, int tfirst, int nwt, int kb, int n1, int kind) {
    const int g = lane >> 2, c = lane & 3;
    if (LG >= 4) {
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
            for (int n = 0; n < 8; ++n) { s[mt][n][0] += s[mt][n][2]; s[mt][n][1] += s[mt][n][3]; }
    }
    if (LG == 5) {
#pragma unroll
        for (int n = 0; n < 8; ++n) { s[0][n][0] += s[1][n][0]; s[0][n][1] += s[1][n][1]; }
    }
    constexpr int NVEC = LG == 5 ? 1 : LG == 4 ? 2 : 4;   // (m-tile, half) vectors left
    constexpr int LV = LG < 3 ? LG : 3;                  // butterfly levels over g
    constexpr int NN = 8 >> LV;                          // n-tiles kept per lane
    const int n0 = (g & ((1 << LV) - 1)) * NN;
#pragma unroll
    for (int vi = 0; vi < NVEC; ++vi) {
        const int mt = NVEC == 4 ? vi >> 1 : vi, hf = NVEC == 4 ? vi & 1 : 0;
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

template <typename T, typename KT, int D>
__global__ void __launch_bounds__(128, 2)
stage1_select(const T* __restrict__ q, const T* __restrict__ ck1, const T* __restrict__ ck2,
              const int* __restrict__ cu_q, const int* __restrict__ cu_c1, const int* __restrict__ cu_c2,
              const int* __restrict__ cache_lens, int* __restrict__ topk_idx, KT* __restrict__ scores,
              KT* __restrict__ block_scores, KT* __restrict__ bs_scratch,
              int total_q, int HQ, int H, int G, int lgp, int B, int n_tiles, int max_seqlen_q,
              int out_len, int olp, int K, int max_n1, int init_blocks, int local_blocks,
              int quirk, int causal, int kind, int s1, int s2c, float sl2) {
    typedef KT key_t;
    constexpr int CH = D / 8;                 // 16-byte chunks per row
    constexpr int ROWB = CH * 16;             // bytes per tile row
    constexpr int MT = 2;                     // m-tiles per warp (32 rows)
    extern __shared__ __align__(128) unsigned char smem[];

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int nwarps = blockDim.x >> 5, nthreads = blockDim.x;
    const int GP = 1 << lgp;
    const int LG = min(lgp, 5);
    const int TOK = (32 * nwarps) >> lgp;     // tokens per CTA
    const int nwt = GP > 32 ? GP >> 5 : 1;    // warps per token
    const int h = blockIdx.x % H;
    const int rest = blockIdx.x / H;
    const int b = rest % B;
    const int tile = n_tiles - 1 - rest / B;  // heaviest (last) token tiles first
    const int qs = cu_q[b], Lq = cu_q[b + 1] - qs;
    const int t0 = tile * TOK;
    if (t0 >= Lq) return;
    const int c1s = cu_c1[b], n1 = cu_c1[b + 1] - c1s;
    const int c2s = cu_c2[b], n2 = cu_c2[b + 1] - c2s;
    const int cache = cache_lens ? cache_lens[b] : 0;
    const int s2 = n1 == n2 ? s1 : s2c;       // exact mode: the coarse pass walks the fine keys
    const int ntok = min(TOK, Lq - t0);
    // visible counts grow with r: the CTA's last token bounds the tiles
    const int r_hi = t0 + ntok - 1;
    const int l2_hi = vis_limit(r_hi, s2, n2, Lq, causal);
    const int l1_hi = l2_hi > 0 ? vis_limit(r_hi, s1, n1, Lq, causal) : 0;
    const int nf = (l1_hi + S1_TILE - 1) / S1_TILE;           // fine tiles
    const int nc = nf > 0 ? (l2_hi + S1_TILE - 1) / S1_TILE : 0;
    const int NT = nc + nf;

    T* sK = reinterpret_cast<T*>(smem);                                               // [2][64 * D]
    float* sT = reinterpret_cast<float*>(smem + 2 * S1_TILE * D * sizeof(T));         // [TOK][68]
    float* sP = sT + TOK * S1_ST;                                                     // [nwarps][64]
    key_t* sB = reinterpret_cast<key_t*>(sP + (LG == 5 ? nwarps * 64 : 0));           // [TOK][olp]
    const int64 scratch_row0 = (int64)h * total_q + qs + t0;                          // row of token 0
    auto bs_row = [&](int tok) -> key_t* {
        return bs_scratch ? bs_scratch + (scratch_row0 + tok) * olp : sB + (int64)tok * olp;
    };

    for (int i = tid; i < TOK; i += nthreads) sT[i * S1_ST + 3] = -INFLLM_INF;        // no column -1

    // ---- this thread's rows: r = 2 * mt + half -> CTA row 32 warp + 16 mt + 8 half + g
    const int g = lane >> 2, c = lane & 3;
    int lim1[4], lim2[4];
    float bias[4], m_run[4], z_run[4];
    bool live = false;
#pragma unroll
    for (int rr = 0; rr < 4; ++rr) {
        const int R = warp * 32 + (rr >> 1) * 16 + (rr & 1) * 8 + g;
        const int tok = R >> lgp, gh = R & (GP - 1);
        const bool valid = tok < ntok && gh < G;
        const int r = t0 + tok;
        const int l2 = valid ? vis_limit(r, s2, n2, Lq, causal) : 0;
        const int l1 = valid && l2 > 0 ? vis_limit(r, s1, n1, Lq, causal) : 0;
        // rows that are padding (or whose token sees no coarse key) are not masked: their
        // probabilities are exp2(-inf) = 0 through bias = +inf
        lim2[rr] = valid ? l2 : S1_BIG;
        lim1[rr] = valid && l2 > 0 ? l1 : S1_BIG;
        bias[rr] = INFLLM_INF;
        m_run[rr] = -INFLLM_INF;
        z_run[rr] = 0.f;
        live |= tok < ntok;
    }
    live = __any_sync(S1_FULL, live);          // the warp has a real token

    // tokens whose staging and pooling this warp owns (GP >= 64: the first warp of the token)
    const bool owner = LG <= 4 || (warp & (nwt - 1)) == 0;
    const int tpw = LG <= 4 ? (32 >> LG) : 1;
    const int tfirst = LG <= 4 ? ((warp * 32) >> LG) : ((warp * 32) >> lgp);

    if (NT > 0) {
        // ---- Q tile (aliases the key tiles), then into registers
        const int M = 32 * nwarps;
        for (int i = tid; i < M * CH; i += nthreads) {
            const int row = i / CH, ch = i % CH;
            const int tok = row >> lgp, gh = row & (GP - 1);
            const T* src = q;
            int bytes = 0;
            if (tok < ntok && gh < G) {
                src = q + ((int64)(qs + t0 + tok) * HQ + (int64)h * G + gh) * D + ch * 8;
                bytes = 16;
            }
            cp_async_16(smem_u32(sK + swz<D>(row, ch) * 8), src, bytes);
        }
        cp_async_commit();
        cp_async_wait<0>();
        __syncthreads();
        const int mi = lane >> 3, lr = lane & 7;   // ldmatrix: matrix addressed by this lane, and its row
        const u32 sKa = smem_u32(sK);
        u32 qf[MT][D / 16][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk)
                ldmatrix_x4(qf[mt][kk], sKa + (warp * 32 + mt * 16 + (mi & 1) * 8 + lr) * ROWB
                                            + (((2 * (kk & 3) + (mi >> 1)) ^ lr) << 4) + (kk >> 2) * 128);
        u32 k_off[4];
#pragma unroll
        for (int cc = 0; cc < 4; ++cc) k_off[cc] = ((mi >> 1) * 8 + lr) * ROWB + (((2 * cc + (mi & 1)) ^ lr) << 4);
        __syncthreads();                           // every warp has its Q: the tiles may be overwritten

        // Each thread copies the same 16-byte chunk `ld_ch` of rows ld_row0, ld_row0 + ld_rstep, ...
        // of every tile: the per-copy address math is one pointer step (the generic i / CH, i % CH
        // form with 64-bit offsets cost ~30 instructions per copy, a quarter of the kernel's issue slots).
        const int ld_ch = tid % CH, ld_row0 = tid / CH, ld_rstep = nthreads / CH;
        const int64 key_stride = (int64)H * D;                 // elements between consecutive keys
        auto load_tile = [&](int u, int stage) {
            const bool coarse = u < nc;
            const T* base = coarse ? ck2 : ck1;
            const int cs = coarse ? c2s : c1s, n = coarse ? n2 : n1;
            const int key0 = (coarse ? u : u - nc) * S1_TILE;
            const int rows = min(S1_TILE, n - key0);           // keys of the tile that exist
            const T* src = base + (int64)(cs + key0 + ld_row0) * key_stride + (int64)h * D + ld_ch * 8;
            const u32 dst = sKa + stage * (S1_TILE * D * (int)sizeof(T));
#pragma unroll 4
            for (int row = ld_row0; row < S1_TILE; row += ld_rstep, src += ld_rstep * key_stride) {
                const int bytes = row < rows ? 16 : 0;
                cp_async_16(dst + swz<D>(row, ld_ch) * 16, bytes ? src : base, bytes);
            }
        };
        load_tile(0, 0);
        cp_async_commit();

        int stage = 0;
#pragma unroll 1
        for (int u = 0; u < NT; ++u) {
            // one barrier per tile: tile u is in shared memory for everyone, and every warp is done
            // with the other stage, which the next tile's copy may then overwrite
            cp_async_wait<0>();
            __syncthreads();
            if (u + 1 < NT) load_tile(u + 1, stage ^ 1);
            cp_async_commit();
            const bool fine = u >= nc;
            const int kb = (fine ? u - nc : u) * S1_TILE;    // first key of the tile

            float s[MT][8][4];
            if (live) {
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int n = 0; n < 8; ++n) s[mt][n][0] = s[mt][n][1] = s[mt][n][2] = s[mt][n][3] = 0.f;
                const u32 tK = sKa + stage * (S1_TILE * D * (int)sizeof(T));
#pragma unroll
                for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
                    for (int np = 0; np < 4; ++np) {
                        u32 bk[4];
                        ldmatrix_x4(bk, tK + k_off[kk & 3] + (kk >> 2) * 128 + np * 16 * ROWB);
#pragma unroll
                        for (int mt = 0; mt < MT; ++mt) {
                            mma_16816<T>(s[mt][2 * np], qf[mt][kk], bk[0], bk[1]);
                            mma_16816<T>(s[mt][2 * np + 1], qf[mt][kk], bk[2], bk[3]);
                        }
                    }
                }
            }

            if (!fine) {
                // ---- pass 1: online max and sum over the visible coarse keys
                if (live) {
                    int mn = S1_BIG;
#pragma unroll
                    for (int rr = 0; rr < 4; ++rr) mn = min(mn, lim2[rr]);
                    const bool need = __any_sync(S1_FULL, mn < kb + S1_TILE);
                    if (need) {                 // only the tiles at some row's visibility limit
#pragma unroll
                        for (int rr = 0; rr < 4; ++rr)
#pragma unroll
                            for (int n = 0; n < 8; ++n)
#pragma unroll
                                for (int e = 0; e < 2; ++e)
                                    if (kb + 8 * n + 2 * c + e >= lim2[rr]) s[rr >> 1][n][2 * (rr & 1) + e] = -INFLLM_INF;
                    }
#pragma unroll
                    for (int rr = 0; rr < 4; ++rr) {
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
                if (u == nc - 1) {
                    // p = exp2(s * sl2 - bias) = exp(scale (s - m)) / Z
#pragma unroll
                    for (int rr = 0; rr < 4; ++rr) {
                        float z = z_run[rr];
                        z += __shfl_xor_sync(S1_FULL, z, 1);
                        z += __shfl_xor_sync(S1_FULL, z, 2);
                        bias[rr] = lim1[rr] != S1_BIG ? fmaf(m_run[rr], sl2, log2f(z)) : INFLLM_INF;
                    }
                }
            } else {
                // ---- pass 2: fine-key probabilities, summed over each token's rows
                if (live) {
                    int mn = S1_BIG;
#pragma unroll
                    for (int rr = 0; rr < 4; ++rr) mn = min(mn, lim1[rr]);
                    const bool need = __any_sync(S1_FULL, mn < kb + S1_TILE);
#pragma unroll
                    for (int rr = 0; rr < 4; ++rr)
#pragma unroll
                        for (int n = 0; n < 8; ++n)
#pragma unroll
                            for (int e = 0; e < 2; ++e) {
                                float& x = s[rr >> 1][n][2 * (rr & 1) + e];
                                x = exp2f(fmaf(x, sl2, -bias[rr]));
                            }
                    if (need) {                 // only the tiles at some row's visibility limit
#pragma unroll
                        for (int rr = 0; rr < 4; ++rr)
#pragma unroll
                            for (int n = 0; n < 8; ++n)
#pragma unroll
                                for (int e = 0; e < 2; ++e)
                                    if (kb + 8 * n + 2 * c + e >= lim1[rr]) s[rr >> 1][n][2 * (rr & 1) + e] = 0.f;
                    }
                    switch (LG) {   // CTA-uniform
                        case 0: stage_tokens<KT, 0>(s, sT, sP, warp, lane, tfirst, nwt, kb, n1, kind); break;
                        case 1: stage_tokens<KT, 1>(s, sT, sP, warp, lane, tfirst, nwt, kb, n1, kind); break;
                        case 2: stage_tokens<KT, 2>(s, sT, sP, warp, lane, tfirst, nwt, kb, n1, kind); break;
                        case 3: stage_tokens<KT, 3>(s, sT, sP, warp, lane, tfirst, nwt, kb, n1, kind); break;
                        case 4: stage_tokens<KT, 4>(s, sT, sP, warp, lane, tfirst, nwt, kb, n1, kind); break;
                        default: stage_tokens<KT, 5>(s, sT, sP, warp, lane, tfirst, nwt, kb, n1, kind); break;
                    }
                }
                if (nwt > 1) {
                    // a token spans nwt warps: its first warp adds their partial sums in a fixed order
                    __syncthreads();
                    if (live && owner) {
                        float2 acc = make_float2(0.f, 0.f);
                        for (int k = 0; k < nwt; ++k) {
                            const float2 p = *reinterpret_cast<const float2*>(sP + (warp + k) * 64 + 2 * lane);
                            acc.x += p.x;
                            acc.y += p.y;
                        }
                        const int col = 2 * lane;
                        const float a = kb + col < n1 ? round_score<KT>(acc.x, kind) : -INFLLM_INF;
                        const float bb = kb + col + 1 < n1 ? round_score<KT>(acc.y, kind) : -INFLLM_INF;
                        *reinterpret_cast<float2*>(sT + tfirst * S1_ST + 4 + col) = make_float2(a, bb);
                    }
                }
                if (live && owner) {
                    __syncwarp();
                    if (scores != nullptr) {                   // inspection: the fine scores of this tile
                        for (int i = lane; i < tpw * 64; i += 32) {
                            const int tok = tfirst + (i >> 6), col = i & 63, cg = kb + col;
                            if (tok < ntok && cg < max_n1)
                                scores[((int64)h * total_q + qs + t0 + tok) * max_n1 + cg] =
                                    Score<KT>::bits(cg < n1 ? sT[tok * S1_ST + 4 + col] : 0.f, kind);
                        }
                    }
                    // block jl of the tile = max over staging [3 + 4 jl, 8 + 4 jl) = columns [4 jl - 1, 4 jl + 4)
                    const int jb = (u - nc) * 16;
                    for (int i = lane; i < tpw * 16; i += 32) {
                        const int tok = tfirst + (i >> 4), jl = i & 15;
                        const float* st = sT + tok * S1_ST;
                        const float4 o = *reinterpret_cast<const float4*>(st + 4 + 4 * jl);
                        const float mx = fmaxf(fmaxf(fmaxf(o.x, o.y), fmaxf(o.z, o.w)), st[3 + 4 * jl]);
                        if (tok < ntok && jb + jl < out_len) bs_row(tok)[jb + jl] = score_key<KT>(mx, kind);
                    }
                    __syncwarp();
                    for (int i = lane; i < tpw; i += 32) sT[(tfirst + i) * S1_ST + 3] = sT[(tfirst + i) * S1_ST + 67];
                }
            }
            stage ^= 1;
        }
        cp_async_wait<0>();
    }
    __syncthreads();                               // every token's block keys and carry are in place

    // ---- per token: finish the block-key row (forced, uncomputed tail, padding), then top-K
    const int jt = 16 * nf;                        // first block whose fine keys no token here sees
    const int q_shift = quirk ? max_seqlen_q - Lq : 0;
    const key_t key_inf = score_key<KT>(INFLLM_INF, kind), key_zero = score_key<KT>(0.f, kind);
    const key_t key_ninf = score_key<KT>(-INFLLM_INF, kind);
#pragma unroll 1
    for (int tok = warp; tok < ntok; tok += nwarps) {
        const int r = t0 + tok;
        const int64 trow = (int64)h * total_q + qs + r;
        const int off_bq = (r + cache) / 64;
        const int qb = (r + cache + q_shift) / 64;
        const key_t key_carry = score_key<KT>(sT[tok * S1_ST + 3], kind);   // column 64 nf - 1 (or -inf)
        auto finish = [&](key_t* row) {
            // blocks [0, jt) were pooled in the tile loop; only the tail and the forced blocks change
            for (int j = jt + lane; j < olp; j += 32) {
                key_t k = 0;                        // padding: below every real key, never selected
                if (j < out_len) {
                    // columns >= 64 nf are invisible to every token of the CTA: 0 where they exist
                    const key_t own = 4 * j < n1 ? key_zero : key_ninf;
                    const key_t prev = j == 0 ? key_ninf : j == jt ? key_carry : (4 * j - 1 < n1 ? key_zero : key_ninf);
                    k = own > prev ? own : prev;
                }
                row[j] = k;
            }
            __syncwarp();                           // forced blocks overwrite tail values of other lanes
            for (int j = lane; j < min(init_blocks, out_len); j += 32) row[j] = key_inf;
            for (int j = max(0, off_bq - local_blocks) + lane; j <= off_bq; j += 32) row[j] = key_inf;
            __syncwarp();
            if (block_scores != nullptr)
                for (int j = lane; j < out_len; j += 32) block_scores[trow * out_len + j] = Score<KT>::unkey(row[j]);
            if (K > 0) select_row(row, olp, K, qb, lane, topk_idx + trow * K);
        };
        if (bs_scratch) finish(bs_scratch + (scratch_row0 + tok) * olp);
        else finish(sB + (int64)tok * olp);
        if (scores != nullptr)
            for (int cg = 64 * nf + lane; cg < max_n1; cg += 32) scores[trow * max_n1 + cg] = Score<KT>::bits(0.f, kind);
    }
}
