// stage2/sparse_bwd.cu: token-level block-sparse attention backward (dq, dk, dv), SM80 path.
//
// Launch contract (mirrored by infllm_cupy/stage2/sparse_bwd.py, whose DELTA_PARAMS, TILES_PARAMS,
// DQ_PARAMS and DKDV_PARAMS declare the parameter structs below field by field; the loader checks the
// layouts at compile time). Each kernel takes the fields of its struct as its arguments. Inputs are
// those of stage2_fwd (sparse_fwd.cu: q, k, v, the bitmask rows `masks` with mask_base /
// mask_h_stride / mask_q_block, cu_seqlens_q/k, causal) plus dout [total_q, HQ, D] and the forward's
// lse [HQ, total_q] (natural log).
//   stage2_bwd_delta<T, D>(the fields of Stage2BwdDeltaParams<T>)   grid (cdiv(total_q * HQ, TILE_WARPS)), block 32 * TILE_WARPS
//       delta [HQ, total_q] f32 = rowsum(dout * out)
//   stage2_bwd_tiles(the fields of Stage2BwdTilesParams)   grid (cdiv(max_groups * n_words, TILE_WARPS), H, B), block 32 * TILE_WARPS
//       ut: for each (h, b, key block j) a bitmask over the sequence's query tiles of `tile_rows`
//       flattened (token, head-in-group) rows (64: the tiles of stage2_bwd_dkdv; G: one token per
//       bit, the gathered tiles of stage2_bwd_dkdv_sm90); bit i is set iff some token of tile i
//       selected j and may see it (causal). Row j of (h, b) starts at
//       h * ut_h_stride + ut_off[b] + j * words_b, words_b = cdiv(cdiv(Lq_b * G, tile_rows), 32).
//       Built by bit-transposing 32x32 blocks in registers: no atomics, no sort, no host sync.
//   stage2_bwd_dq<T, D, WARPS, QH>(the fields of Stage2BwdDqParams<T>)   grid (cdiv(max_seqlen_q * G, 16 * WARPS), H, B), block 32 * WARPS
//       dyn smem (2 * 16 * WARPS * D + 4 * 64 * D) * sizeof(T) + 4 * n_words
//       dq [total_q, HQ, D] T. The forward's loop (the union of the CTA's tokens' blocks) with
//       dS = P * (dP - delta) and dq += dS K in place of the online softmax.
//       QH in {0, 2} (default 0), field kv_group: per-query-head mask rows as stage2_fwd's
//       QH = 2 (sparse_fwd.cu): H = HQ, G = 1, query head h reads K/V head h / kv_group of k, v's
//       H / kv_group heads; grid (cdiv(max_seqlen_q, 16 * WARPS) * kv_group, H / kv_group, B), block x
//       = tile * kv_group + head in group (docs/stage2_bwd.md, "Per-query-head mask rows").
//   stage2_bwd_dkdv<T, D, KN, false, QH>(the fields of Stage2BwdDkdvParams<T>) grid (H, B, nz), block 128, in z-chunks:
//       the launch with field kb0 runs key blocks kb0 .. kb0 + nz - 1 (nz <= 65535, CUDA's grid.z limit);
//       the launcher covers cdiv(max_seqlen_k, 64) blocks with chunks of 65535 in order
//       dyn smem (2 * 64 * D + 4 * 64 * D) * sizeof(T) + 2 * 3 * 64 * 4
//       dk, dv [total_k, H, D] T. One CTA per 64-key block walks the query tiles in its ut row,
//       so it owns its keys' gradients outright: every key row is written exactly once (zeros when
//       no query selected it) and there are no float atomics, so results are bit-identical run to run.
//   stage2_bwd_dkdv<T, D, KN, true>: the same, also reading fields dk32, dv32 [total_k, H, D] f32
//       and `flush` >= 1 (which the <.., false> instance ignores): after every `flush` tiles summed
//       in registers, when more tiles follow, the CTA adds its sums into its own rows there (a store
//       the first time) and restarts from zero; it adds those rows back before the final store. A
//       CTA with at most `flush` tiles never touches them, and computes the bits of the
//       <.., false> instance (docs/stage2_bwd.md, 12. SM80 path).
//   QH = 2 (default 0), field kv_group: per-query-head mask rows. The launch passes
//       H = HQ and G = 1 (masks, ut and lse over HQ heads); query head h reads K and V at head
//       h / kv_group of their H / kv_group heads, and dk, dv (and dk32, dv32) are per-query-head
//       partials [total_k, HQ, D] that the launcher sums over each group in fp32.
// Semantics are the forward's: query (r, h*G+g) depends on key c iff c/64 is set in its mask row,
// c < Lk and, when causal, c <= r + Lk - Lq. Gradients are scaled like FlashAttention's.
#include "common/types.cuh"
#include "common/mma_sm80.cuh"
#include "common/params.cuh"
#include "stage2/cta_common.cuh"
#include "stage2/seq_common.cuh"

#define BLOCK_N 64
#define QT 64          // query rows per dk/dv tile (flattened (token, head-in-group) rows)
#define TILE_WARPS 8   // warps per CTA of stage2_bwd_delta and stage2_bwd_tiles, one row / item each

// x = A_x B_x^T and y = A_y B_y^T for one warp's 16 rows and NCOL columns, reduced over D: the
// S and dP products of both dq and dk/dv. A operands are the tiles at ax / ay (a_off: this warp's
// rows), B operands the N-major tiles at bx / by (b_off; column n at n * 16 D bytes).
template <typename T, int D, int NCOL>
__device__ __forceinline__ void two_products(float (&x)[NCOL / 8][4], float (&y)[NCOL / 8][4], u32 ax, u32 ay, u32 bx,
                                             u32 by, const u32 (&a_off)[4], const u32 (&b_off)[4]) {
    constexpr int ROWB = D * 2;
#pragma unroll
    for (int n = 0; n < NCOL / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) x[n][e] = y[n][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        u32 a0[4], a1[4];
        ldmatrix_x4(a0, ax + a_off[kk & 3] + (kk >> 2) * 128);
        ldmatrix_x4(a1, ay + a_off[kk & 3] + (kk >> 2) * 128);
#pragma unroll
        for (int np = 0; np < NCOL / 16; ++np) {
            u32 b0[4], b1[4];
            ldmatrix_x4(b0, bx + b_off[kk & 3] + (kk >> 2) * 128 + np * 16 * ROWB);
            ldmatrix_x4(b1, by + b_off[kk & 3] + (kk >> 2) * 128 + np * 16 * ROWB);
            mma_16816<T>(x[2 * np], a0, b0[0], b0[1]);
            mma_16816<T>(x[2 * np + 1], a0, b0[2], b0[3]);
            mma_16816<T>(y[2 * np], a1, b1[0], b1[1]);
            mma_16816<T>(y[2 * np + 1], a1, b1[2], b1[3]);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// delta = rowsum(dout * out) in fp32, one warp per (token, query head) row.
#define STAGE2_BWD_DELTA_PARAMS(F, M) \
    F(const T* __restrict__, dout)              /* [total_q, HQ, D] */ \
    F(const T* __restrict__, out)               /* [total_q, HQ, D], the forward's output */ \
    F(float* __restrict__, delta)               /* [HQ, total_q] */ \
    F(int, total_q) F(int, HQ)
template <typename T>
struct Stage2BwdDeltaParams { PARAM_FIELDS(STAGE2_BWD_DELTA_PARAMS) };

template <typename T, int D>
__global__ void __launch_bounds__(32 * TILE_WARPS)
stage2_bwd_delta(PARAM_ARGS(STAGE2_BWD_DELTA_PARAMS)) {
    constexpr int E = D / 32;
    const int64 row = (int64)blockIdx.x * TILE_WARPS + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= (int64)total_q * HQ) return;
    Vec<T, E> a, b;
    a.load(dout + row * D + lane * E);
    b.load(out + row * D + lane * E);
    float s = 0.f;
#pragma unroll
    for (int e = 0; e < E; ++e) s += to_float(a.elem[e]) * to_float(b.elem[e]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (lane == 0) {
        const int t = (int)(row / HQ), hq = (int)(row - (int64)t * HQ);
        delta[(int64)hq * total_q + t] = s;
    }
}

// ---------------------------------------------------------------------------------------------
// Transposed selection: one warp per (32-tile group, mask word) of one (h, b). Lane i ORs the mask
// words of tile i's tokens (clipped to blocks the tile may see), then 32 ballots turn the 32x32 bit
// block around: lane k keeps the ballot of bit k, the tile bits of key block 32 w + k.
#define STAGE2_BWD_TILES_PARAMS(F, M) \
    F(const unsigned* __restrict__, masks)      /* bitmask rows (stage2_fwd's layout, sparse_fwd.cu) */ \
    F(const int* __restrict__, mask_base)       /* [B] first mask row of each sequence */ \
    F(const int* __restrict__, cu_seqlens_q)    /* [B + 1] */ \
    F(const int* __restrict__, cu_seqlens_k)    /* [B + 1] */ \
    F(const long long* __restrict__, ut_off)    /* [B + 1] each sequence's first index word, per head */ \
    F(unsigned* __restrict__, ut)               /* [H * ut_h_stride] the transposed index (out) */ \
    F(long long, ut_h_stride)                   /* index words per head */ \
    F(int, G) F(int, n_words)                   /* query heads per KV head, mask words per row */ \
    F(long long, mask_h_stride)                 /* mask rows between heads */ \
    F(int, mask_q_block)                        /* tokens per mask row */ \
    F(int, causal) \
    F(int, tile_rows)                           /* flattened rows per bit: 64 (fixed tiles) or G (tokens) */
struct Stage2BwdTilesParams { PARAM_FIELDS(STAGE2_BWD_TILES_PARAMS) };

__global__ void __launch_bounds__(32 * TILE_WARPS)
stage2_bwd_tiles(PARAM_ARGS(STAGE2_BWD_TILES_PARAMS)) {
    const int lane = threadIdx.x & 31;
    const int64 item = (int64)blockIdx.x * TILE_WARPS + (threadIdx.x >> 5);
    const int h = blockIdx.y, b = blockIdx.z;
    S2Seq sq;
    s2_seq_bounds(sq, cu_seqlens_q, cu_seqlens_k, b);
    s2_seq_rows(sq, G);
    const int tiles = (int)((sq.rows_total + tile_rows - 1) / tile_rows);
    const int groups = (tiles + 31) >> 5;
    const int tg = (int)(item / n_words), w = (int)(item - (int64)tg * n_words);
    if (tg >= groups) return;
    const int nb = min(key_blocks(sq.Lk), n_words * 32);
    s2_seq_shift(sq, causal);
    const unsigned* mrows = seq_mask_rows(masks, mask_base, b, h, mask_h_stride, n_words);

    unsigned u = 0;
    const int tile = tg * 32 + lane;
    if (tile < tiles) {
        const int64 m0 = (int64)tile * tile_rows;
        const int t_lo = (int)(m0 / G), t_hi = (int)((min(m0 + tile_rows, sq.rows_total) - 1) / G);
        const int max_block = last_visible_block(nb, causal, t_hi, sq.shift);
        u = clip_word(rows_or(mrows, n_words, t_lo / mask_q_block, t_hi / mask_q_block, w), w, max_block);
    }
    unsigned mine = 0;
#pragma unroll
    for (int k = 0; k < 32; ++k) {
        const unsigned r = __ballot_sync(0xffffffffu, (u >> k) & 1u);
        if (lane == k) mine = r;
    }
    const int j = 32 * w + lane;
    if (j < nb) ut[(int64)h * ut_h_stride + ut_off[b] + (int64)j * groups + tg] = mine;
}

// ---------------------------------------------------------------------------------------------
// dq: CTA = M = 16 * WARPS consecutive flattened rows of one sequence and KV head, one m-tile per
// warp; walks the union of its tokens' blocks like the forward and recomputes P from the lse.
// 8-warp CTAs run one per SM with the full register file (a 128-register cap spills at D = 128).
#define STAGE2_BWD_DQ_PARAMS(F, M) \
    STAGE2_BWD_QKV_FIELDS(F, M) \
    F(T* __restrict__, dq)                      /* [total_q, HQ, D] (out) */ \
    STAGE2_BWD_ROW_FIELDS(F, M) \
    F(int, kv_group)                            /* QH 2: query heads per K/V head (read only there) */
template <typename T>
struct Stage2BwdDqParams { PARAM_FIELDS(STAGE2_BWD_DQ_PARAMS) };

template <typename T, int D, int WARPS, int QH = 0>
__global__ void __launch_bounds__(32 * WARPS, WARPS == 4 ? 2 : 1)
stage2_bwd_dq(PARAM_ARGS(STAGE2_BWD_DQ_PARAMS)) {
    constexpr int THREADS = 32 * WARPS;
    constexpr int M = 16 * WARPS;
    constexpr int CH = D / 8;
    extern __shared__ __align__(128) unsigned char smem[];
    T* sQ = reinterpret_cast<T*>(smem);
    T* sO = sQ + M * D;                         // dout tile
    T* sK = sO + M * D;                         // [2][BLOCK_N * D]
    T* sV = sK + 2 * BLOCK_N * D;               // [2][BLOCK_N * D]
    unsigned* sU = reinterpret_cast<unsigned*>(sV + 2 * BLOCK_N * D);

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    // QH 2: grid.x runs over (row tile, head of the group), heads fastest, as the forward's (the
    // group's heads of one tile read the same K/V blocks while they are in the L2)
    const int h = QH == 2 ? (int)(blockIdx.y * kv_group + blockIdx.x % kv_group) : (int)blockIdx.y;
    const int b = blockIdx.z;
    S2Seq sq;
    s2_seq(sq, cu_seqlens_q, cu_seqlens_k, b, G, causal);
    // last tiles first: they see the most blocks (causal), so the longest CTAs start earliest
    const int64 m0 = (int64)(QH == 2 ? gridDim.x / kv_group - 1 - blockIdx.x / kv_group : gridDim.x - 1 - blockIdx.x) * M;
    if (m0 >= sq.rows_total) return;
    const int nb = key_blocks(sq.Lk);
    const int t_lo = (int)(m0 / G);
    const int t_hi = (int)((min(m0 + M, sq.rows_total) - 1) / G);
    const int max_block = last_visible_block(min(nb, n_words * 32), causal, t_hi, sq.shift);
    const int nw = union_words(max_block);
    const unsigned* mrows = seq_mask_rows(masks, mask_base, b, h, mask_h_stride, n_words);
    cta_union(sU, mrows, n_words, t_lo / mask_q_block, t_hi / mask_q_block, max_block, nw, tid, THREADS);
    for (int i = tid; i < M * CH; i += THREADS) {
        const int row = i / CH, ch = i % CH;
        const int64 R = m0 + row;
        int64 off = 0;
        int bytes = 0;
        if (R < sq.rows_total) {
            const int t = (int)(R / G), g = (int)(R - (int64)t * G);
            off = ((int64)(sq.qs + t) * HQ + (int64)h * G + g) * D + ch * 8;
            bytes = 16;
        }
        cp_async_16(smem_u32(sQ + swz<D>(row, ch) * 8), q + off, bytes);
        cp_async_16(smem_u32(sO + swz<D>(row, ch) * 8), dout + off, bytes);
    }
    cp_async_commit();

    auto load_kv = [&](int j, int stage) {
        load_kv_block<T, D>(sK + stage * BLOCK_N * D, sV + stage * BLOCK_N * D, k, v, j, sq.ks, sq.Lk,
                            QH == 2 ? H / kv_group : H, QH == 2 ? h / kv_group : h, tid, THREADS);
    };

    __syncthreads();
    int j = next_set_bit(sU, nw, 0);
    if (j >= 0) load_kv(j, 0);
    cp_async_commit();

    // this thread's rows g and g + 8 of the warp's m-tile
    bool row_ok[2];
    int rk[2];
    float lse2[2], dlt[2];
    const unsigned* mrow[2];
    dq_row_state(m0 + warp * 16 + (lane >> 2), sq.rows_total, t_lo, G, causal, sq.shift, sq.Lk, mrows, mask_q_block, n_words, h,
                 total_q, sq.qs, lse, delta, row_ok, rk, mrow, lse2, dlt);

    float acc[D / 8][4];
#pragma unroll
    for (int n = 0; n < D / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;

    constexpr int ROWB = CH * 16;
    u32 a_off[4], b_off[4], t_off[4];
    ldsm_offsets(lane, warp * 16, ROWB, a_off, b_off, t_off);
    const u32 sQa = smem_u32(sQ), sOa = smem_u32(sO), sKa = smem_u32(sK), sVa = smem_u32(sV);
    int stage = 0;
    while (j >= 0) {
        cp_async_wait<0>();
        __syncthreads();
        const int jn = next_set_bit(sU, nw, j + 1);
        if (jn >= 0) load_kv(jn, stage ^ 1);
        cp_async_commit();

        bool sel[2];
        const int kbase = j * BLOCK_N;
#pragma unroll
        for (int r = 0; r < 2; ++r)
            sel[r] = row_ok[r] && ((__ldg(mrow[r] + (j >> 5)) >> (j & 31)) & 1u) && kbase <= rk[r];
        if (__any_sync(0xffffffffu, sel[0] || sel[1])) {
            const u32 tK = sKa + stage * (BLOCK_N * D * (int)sizeof(T));
            const u32 tV = sVa + stage * (BLOCK_N * D * (int)sizeof(T));
            float s[BLOCK_N / 8][4], dp[BLOCK_N / 8][4];
            // S = Q K^T and dP = dO V^T
            two_products<T, D, BLOCK_N>(s, dp, sQa, sOa, tK, tV, a_off, b_off);
            // P from the saved lse, dS = P (dP - delta); masked entries are exactly 0
#pragma unroll
            for (int n = 0; n < BLOCK_N / 8; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int r = e >> 1;
                    const int c = kbase + n * 8 + (lane & 3) * 2 + (e & 1);
                    const float p = sel[r] && c <= rk[r] ? exp2f(fmaf(s[n][e], scale_log2, -lse2[r])) : 0.f;
                    s[n][e] = p * (dp[n][e] - dlt[r]);
                }
            // dq += dS K
#pragma unroll
            for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
                u32 a[4];
                a_from_acc<T>(s[2 * kk], s[2 * kk + 1], a);
#pragma unroll
                for (int dd = 0; dd < D / 16; ++dd) {
                    u32 bk[4];
                    ldmatrix_x4_trans(bk, tK + t_off[dd & 3] + (dd >> 2) * 128 + kk * 16 * ROWB);
                    mma_16816<T>(acc[2 * dd], a, bk[0], bk[1]);
                    mma_16816<T>(acc[2 * dd + 1], a, bk[2], bk[3]);
                }
            }
        }
        stage ^= 1;
        j = jn;
    }
    cp_async_wait<0>();

#pragma unroll
    for (int r = 0; r < 2; ++r) {
        if (!row_ok[r]) continue;
        const int64 R = m0 + warp * 16 + (lane >> 2) + 8 * r;
        const int t = (int)(R / G), g = (int)(R - (int64)t * G);
        T* dst = dq + ((int64)(sq.qs + t) * HQ + (int64)h * G + g) * D + (lane & 3) * 2;
#pragma unroll
        for (int n = 0; n < D / 8; ++n)
            *reinterpret_cast<u32*>(dst + n * 8) = pack2<T>(acc[n][2 * r] * scale, acc[n][2 * r + 1] * scale);
    }
}

// ---------------------------------------------------------------------------------------------
// dk, dv: CTA = one 64-key block j of one (h, b); warp w owns keys 16 w .. 16 w + 15 and computes
// the transposed products S^T = K Q^T and dP^T = V dO^T over a tile's 64 query rows, KN at a
// time, so that P^T and dS^T are already A operands of dV += P^T dO and dK += dS^T Q.
#define STAGE2_BWD_DKDV_PARAMS(F, M) \
    STAGE2_BWD_QKV_FIELDS(F, M) \
    F(const long long* __restrict__, ut_off)    /* [B + 1] the transposed index (stage2_bwd_tiles, tile_rows 64) */ \
    F(const unsigned* __restrict__, ut) \
    F(long long, ut_h_stride)                   /* index words per head */ \
    F(T* __restrict__, dk)                      /* [total_k, H, D] (out; QH 2: per query head) */ \
    F(T* __restrict__, dv)                      /* as dk */ \
    STAGE2_BWD_ROW_FIELDS(F, M) \
    F(float* __restrict__, dk32)                /* FLUSH: [total_k, H, D] fp32 flushed sums (else unused) */ \
    F(float* __restrict__, dv32)                /* as dk32 */ \
    F(int, flush)                               /* FLUSH: query tiles summed in registers between flushes */ \
    F(int, kv_group)                            /* QH 2: query heads per K/V head (read only there) */ \
    F(int, kb0)                                 /* first key block of this launch's z-chunk */
template <typename T>
struct Stage2BwdDkdvParams { PARAM_FIELDS(STAGE2_BWD_DKDV_PARAMS) };

template <typename T, int D, int KN, bool FLUSH, int QH = 0>
__global__ void __launch_bounds__(128, 2)
stage2_bwd_dkdv(PARAM_ARGS(STAGE2_BWD_DKDV_PARAMS)) {
    constexpr int THREADS = 128;
    constexpr int CH = D / 8;
    constexpr float LOG2E = 1.4426950408889634f;
    extern __shared__ __align__(128) unsigned char smem[];
    T* sK = reinterpret_cast<T*>(smem);
    T* sV = sK + BLOCK_N * D;
    T* sQ = sV + BLOCK_N * D;                   // [2][QT * D]
    T* sO = sQ + 2 * QT * D;                    // [2][QT * D]
    float* sL = reinterpret_cast<float*>(sO + 2 * QT * D);   // [2][QT] lse * log2(e)
    float* sD = sL + 2 * QT;                                  // [2][QT] delta
    int* sLim = reinterpret_cast<int*>(sD + 2 * QT);          // [2][QT] last visible key, -1: none

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    // key block slowest in the launch order: blocks 0, 1, ... (selected by the most query tiles:
    // the forced init block, the earliest blocks) start first, so the longest CTAs do not trail.
    // kb0: the first key block of this launch's z-chunk (grid.z <= 65535; docs/stage2_bwd.md, "Limits")
    const int j = (int)blockIdx.z + kb0, h = blockIdx.x, b = blockIdx.y;
    S2Seq sq;
    s2_seq_bounds(sq, cu_seqlens_q, cu_seqlens_k, b);
    if (j >= key_blocks(sq.Lk)) return;
    s2_seq_shift(sq, causal);
    s2_seq_rows(sq, G);
    const int tiles = (int)((sq.rows_total + QT - 1) / QT);
    const int groups = (tiles + 31) >> 5;
    const unsigned* urow = ut + (int64)h * ut_h_stride + ut_off[b] + (int64)j * groups;
    const unsigned* mrows = seq_mask_rows(masks, mask_base, b, h, mask_h_stride, n_words);
    const int kbase = j * BLOCK_N;

    // QH 2: K/V of the query head's KV head (k, v have H / kv_group heads); dk, dv rows stay per query head
    const int kv_h = QH == 2 ? h / kv_group : h, kv_H = QH == 2 ? H / kv_group : H;
    for (int i = tid; i < BLOCK_N * CH; i += THREADS) {
        const int row = i / CH, ch = i % CH;
        const int key = kbase + row;
        const int64 off = ((int64)(sq.ks + key) * kv_H + kv_h) * D + ch * 8;
        const int bytes = key < sq.Lk ? 16 : 0;
        cp_async_16(smem_u32(sK + swz<D>(row, ch) * 8), bytes ? k + off : k, bytes);
        cp_async_16(smem_u32(sV + swz<D>(row, ch) * 8), bytes ? v + off : v, bytes);
    }

    // a query tile: Q and dO rows by cp.async, and each row's lse, delta and visibility of block j
    // rows of one sequence fit in 31 bits (launcher), so row -> (token, head) is a FastDiv: a 64-bit
    // division per copy had cost more than the copy's share of the math
    FastDiv divG;
    divG.init((unsigned)G);
    auto load_tile = [&](int tile, int stage) {
        const unsigned m0 = (unsigned)tile * QT;
        T* dq_ = sQ + stage * QT * D;
        T* do_ = sO + stage * QT * D;
        for (int i = tid; i < QT * CH; i += THREADS) {
            const int row = i / CH, ch = i % CH;
            const unsigned R = m0 + row;
            int64 off = 0;
            int bytes = 0;
            if (R < (unsigned)sq.rows_total) {
                const int t = (int)divG.div(R), g = (int)(R - (unsigned)t * G);
                off = (int64)(sq.qs + t) * (HQ * D) + ((h * G + g) * D + ch * 8);
                bytes = 16;
            }
            cp_async_16(smem_u32(dq_ + swz<D>(row, ch) * 8), q + off, bytes);
            cp_async_16(smem_u32(do_ + swz<D>(row, ch) * 8), dout + off, bytes);
        }
        if (tid < QT) {
            const unsigned R = m0 + tid;
            int lim = -1;
            float l2 = 0.f, dl = 0.f;
            if (R < (unsigned)sq.rows_total) {
                const int t = (int)divG.div(R), g = (int)(R - (unsigned)t * G);
                const bool s = (__ldg(mrows + (int64)(t / mask_q_block) * n_words + (j >> 5)) >> (j & 31)) & 1u;
                const int rk = causal ? t + sq.shift : sq.Lk - 1;
                if (s && rk >= kbase) {
                    lim = rk;
                    const int64 li = ((int64)h * G + g) * total_q + sq.qs + t;
                    l2 = lse[li] * LOG2E;
                    dl = delta[li];
                }
            }
            sLim[stage * QT + tid] = lim;
            sL[stage * QT + tid] = l2;
            sD[stage * QT + tid] = dl;
        }
    };

    auto next_tile = [&](int from) {   // first set bit >= from in this key block's tile row
        return next_set_bit(urow, groups, from);
    };
    int tile = next_tile(0);
    if (tile >= 0) load_tile(tile, 0);
    cp_async_commit();

    float adk[D / 8][4], adv[D / 8][4];
#pragma unroll
    for (int n = 0; n < D / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) adk[n][e] = adv[n][e] = 0.f;

    constexpr int ROWB = CH * 16;
    u32 a_off[4], b_off[4], t_off[4];
    ldsm_offsets(lane, warp * 16, ROWB, a_off, b_off, t_off);
    const u32 sKa = smem_u32(sK), sVa = smem_u32(sV), sQa = smem_u32(sQ), sOa = smem_u32(sO);
    const int key0 = kbase + warp * 16 + (lane >> 2);   // this thread's keys: key0 and key0 + 8

    // FLUSH: two-level sums (docs/stage2_bwd.md, 12. SM80 path): a key block selected by a million
    // tokens would add 2^18 tiles into these registers, and fp32 rounding grows with the count. Each
    // thread moves its own elements, so no barrier; rows of keys past Lk belong to the next sequence.
    auto flush_sums = [&](bool add) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int key = key0 + 8 * r;
            const int64 base = ((int64)(sq.ks + key) * H + h) * D + (lane & 3) * 2;
#pragma unroll
            for (int n = 0; n < D / 8; ++n) {
                float2 a = make_float2(adk[n][2 * r], adk[n][2 * r + 1]);
                float2 c = make_float2(adv[n][2 * r], adv[n][2 * r + 1]);
                if (key < sq.Lk) {
                    float2* pk = reinterpret_cast<float2*>(dk32 + base + n * 8);
                    float2* pv = reinterpret_cast<float2*>(dv32 + base + n * 8);
                    if (add) {
                        const float2 ok = *pk, ov = *pv;
                        a.x += ok.x; a.y += ok.y; c.x += ov.x; c.y += ov.y;
                    }
                    *pk = a;
                    *pv = c;
                }
                adk[n][2 * r] = adk[n][2 * r + 1] = adv[n][2 * r] = adv[n][2 * r + 1] = 0.f;
            }
        }
    };
    int since = 0;          // tiles summed in the registers since the last flush
    bool flushed = false;   // dk32 / dv32 hold this CTA's earlier sums
    int stage = 0;
    while (tile >= 0) {
        cp_async_wait<0>();
        __syncthreads();
        const int tn = next_tile(tile + 1);
        if (tn >= 0) load_tile(tn, stage ^ 1);
        cp_async_commit();

        const u32 tQ = sQa + stage * (QT * D * (int)sizeof(T));
        const u32 tO = sOa + stage * (QT * D * (int)sizeof(T));
        const int* lim = sLim + stage * QT;
        const float* l2 = sL + stage * QT;
        const float* dl = sD + stage * QT;
#pragma unroll 1
        for (int cb = 0; cb < QT; cb += KN) {
            // skip KN columns (query rows) none of which sees this warp's 16 keys
            bool act = false;
#pragma unroll
            for (int n = 0; n < KN / 8; ++n) {
                const int m = cb + n * 8 + (lane & 3) * 2;
                act |= lim[m] >= kbase + warp * 16 || lim[m + 1] >= kbase + warp * 16;
            }
            if (!__any_sync(0xffffffffu, act)) continue;
            float s[KN / 8][4], dp[KN / 8][4];
            // S^T = K Q^T, dP^T = V dO^T for this warp's 16 keys and KN query rows
            two_products<T, D, KN>(s, dp, sKa, sVa, tQ + cb * ROWB, tO + cb * ROWB, a_off, b_off);
            // P^T and dS^T; element e of n-tile n is key key0 + 8 (e >> 1), query row cb + 8 n + 2 c + (e & 1)
#pragma unroll
            for (int n = 0; n < KN / 8; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int m = cb + n * 8 + (lane & 3) * 2 + (e & 1);
                    const int key = key0 + 8 * (e >> 1);
                    const float p = key <= lim[m] ? exp2f(fmaf(s[n][e], scale_log2, -l2[m])) : 0.f;
                    s[n][e] = p;
                    dp[n][e] = p * (dp[n][e] - dl[m]);
                }
            // dV += P^T dO, dK += dS^T Q
#pragma unroll
            for (int kk = 0; kk < KN / 16; ++kk) {
                u32 ap[4], ad[4];
                a_from_acc<T>(s[2 * kk], s[2 * kk + 1], ap);
                a_from_acc<T>(dp[2 * kk], dp[2 * kk + 1], ad);
#pragma unroll
                for (int dd = 0; dd < D / 16; ++dd) {
                    u32 bo[4], bq[4];
                    ldmatrix_x4_trans(bo, tO + t_off[dd & 3] + (dd >> 2) * 128 + (cb + kk * 16) * ROWB);
                    ldmatrix_x4_trans(bq, tQ + t_off[dd & 3] + (dd >> 2) * 128 + (cb + kk * 16) * ROWB);
                    mma_16816<T>(adv[2 * dd], ap, bo[0], bo[1]);
                    mma_16816<T>(adv[2 * dd + 1], ap, bo[2], bo[3]);
                    mma_16816<T>(adk[2 * dd], ad, bq[0], bq[1]);
                    mma_16816<T>(adk[2 * dd + 1], ad, bq[2], bq[3]);
                }
            }
        }
        stage ^= 1;
        tile = tn;
        if (FLUSH && ++since == flush && tile >= 0) {
            flush_sums(flushed);
            flushed = true;
            since = 0;
        }
    }
    cp_async_wait<0>();

#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int key = key0 + 8 * r;
        if (key >= sq.Lk) continue;
        const int64 base = ((int64)(sq.ks + key) * H + h) * D + (lane & 3) * 2;
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
            if (FLUSH && flushed) {   // the remainder plus the earlier sums, in this order
                const float2 ok = *reinterpret_cast<const float2*>(dk32 + base + n * 8);
                const float2 ov = *reinterpret_cast<const float2*>(dv32 + base + n * 8);
                adk[n][2 * r] += ok.x;
                adk[n][2 * r + 1] += ok.y;
                adv[n][2 * r] += ov.x;
                adv[n][2 * r + 1] += ov.y;
            }
            *reinterpret_cast<u32*>(dk + base + n * 8) = pack2<T>(adk[n][2 * r] * scale, adk[n][2 * r + 1] * scale);
            *reinterpret_cast<u32*>(dv + base + n * 8) = pack2<T>(adv[n][2 * r], adv[n][2 * r + 1]);
        }
    }
}
