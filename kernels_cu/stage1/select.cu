// stage1/select.cu: InfLLM-v2 stage 1 in one kernel (spec 4-6): for every query token and KV head,
// the relevance of the fine compressed keys under the coarse-key normaliser, summed over the G query
// heads of the group and rounded to the score dtype, max-pooled to 64-token blocks with the init and
// local blocks forced, and the top-K of those block scores: InfLLM-v2's topk_idx.
//
// Launch contract (mirrored by infllm_cupy/stage1/select.py, whose SELECT_PARAMS declares
// Stage1SelectParams (select_common.cuh) field by field; the loader checks the layout at compile time):
//   kernel   stage1_select<T, KT, D, RANGED>(the fields of Stage1SelectParams<T, KT>)   RANGED: a range
//              pass (below), else the full selection
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
//   sl2      softmax_scale * log2(e);   topk_prefix: 0, or a test hook forcing the top-K's whole-row
//            rerun (finish_token in select_common.cuh)
//   range pass (RANGED, cand_idx != null; docs/stage1.md, 9. Long context: key ranges): blocks [j_lo, j_hi),
//            j_lo a multiple of 64; olp = 64 + wr (wr >= K, a multiple of 64: the range row and a 64-key pad);
//            bs_scratch, scores and block_scores null; writes cand_key (32-bit keys) / cand_idx [H, total_q, K]
//            instead of topk_idx. bias_mode 1 stores the coarse pass's per-row bias to row_bias
//            [total_q, HQ] float, 2 loads it and skips the coarse pass. A full launch (RANGED = false)
//            ignores j_lo .. bias_mode (the launcher passes 0, out_len, null, null, null, 0).
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

#include "stage1/select_common.cuh"

// The kernel's body (S1_BODY_CALL_ARGS): the full selection (the range fields constants) or a range pass.
template <typename T, typename KT, int D>
__device__ __forceinline__ void stage1_select_body(PARAM_REF_ARGS(STAGE1_SELECT_PARAMS)) {
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
    S1Cta w;
    if (!s1_cta(w, TOK, H, B, n_tiles, cu_q, cu_c1, cu_c2, cache_lens, s1, s2c, causal)) return;
    const bool ranged = cand_idx != nullptr;
    const int nf = s1_pass_fine_tiles(w, ranged, j_lo, j_hi, bias_mode);   // fine tiles from S1_FT_LO
#define S1_FT_LO max(0, j_lo / 16 - 1)
    const int NT = w.nc + nf;

    T* sK = reinterpret_cast<T*>(smem);                                               // [2][64 * D]
    float* sT = reinterpret_cast<float*>(smem + 2 * S1_TILE * D * sizeof(T));         // [TOK][68]
    float* sP = sT + TOK * S1_ST;                                                     // [nwarps][64]
    key_t* sB = reinterpret_cast<key_t*>(sP + (LG == 5 ? nwarps * 64 : 0));           // [TOK][olp]
    const int64 score_row0 = (int64)w.h * total_q + w.qs + w.t0;                      // row of token 0
    // token tok pools block j into bs0[tok * olp + j] (a range row starts 64 keys in, at block j_lo)
    key_t* bs0 = bs_scratch ? bs_scratch + score_row0 * olp : ranged ? sB + 64 - j_lo : sB;

    for (int i = tid; i < TOK; i += nthreads) sT[i * S1_ST + 3] = -INFLLM_INF;        // no column -1

    // ---- this thread's rows: r = 2 * mt + half -> CTA row 32 warp + 16 mt + 8 half + g
    const int g = lane >> 2, c = lane & 3;
    int lim1[4], lim2[4];
    float bias[4], m_run[4], z_run[4];
    bool live = false;
#pragma unroll
    for (int rr = 0; rr < 4; ++rr)
        live |= s1_row_init(w, warp * 32 + (rr >> 1) * 16 + (rr & 1) * 8 + g, lgp, G, s1, causal, lim1[rr], lim2[rr],
                            bias[rr], m_run[rr], z_run[rr]);
    // a range pass after the first: the coarse pass's bias, parked in m_run (dead without coarse tiles)
    if (bias_mode == 2) s1_row_bias<4>(w, 2, row_bias, m_run, warp * 32 + g, lgp, G, HQ, c);
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
            if (tok < w.ntok && gh < G) {
                src = q + ((int64)(w.qs + w.t0 + tok) * HQ + (int64)w.h * G + gh) * D + ch * 8;
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
            const bool coarse = u < w.nc;
            const T* base = coarse ? ck2 : ck1;
            const int cs = coarse ? w.c2s : w.c1s, n = coarse ? w.n2 : w.n1;
            const int key0 = (coarse ? u : u - w.nc + S1_FT_LO) * S1_TILE;
            const int rows = min(S1_TILE, n - key0);           // keys of the tile that exist
            const T* src = base + (int64)(cs + key0 + ld_row0) * key_stride + (int64)w.h * D + ld_ch * 8;
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
            const bool fine = u >= w.nc;
            const int kb = (fine ? u - w.nc + S1_FT_LO : u) * S1_TILE;    // first key of the tile

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
                if (live) coarse_update<MT>(s, lim2, m_run, z_run, kb, c, sl2);
                if (u == w.nc - 1) {
                    coarse_bias(z_run, m_run, lim1, bias, sl2);
                    // the first range pass keeps the bias for the others (a CTA without coarse tiles
                    // has no fine tile in any range: its rows' biases are never read)
                    if (bias_mode == 1) s1_row_bias<4>(w, 1, row_bias, bias, warp * 32 + g, lgp, G, HQ, c);
                }
            } else {
                // ---- pass 2: fine-key probabilities, summed over each token's rows
                if (bias_mode == 2 && u == 0) {
#pragma unroll
                    for (int rr = 0; rr < 4; ++rr) bias[rr] = m_run[rr];
                }
                if (live) {
                    fine_probs<MT>(s, lim1, bias, kb, c, sl2);
                    switch (LG) {   // CTA-uniform
                        case 0: stage_tokens<KT, 0, MT>(s, sT, sP, warp, lane, tfirst, nwt, kb, w.n1, kind); break;
                        case 1: stage_tokens<KT, 1, MT>(s, sT, sP, warp, lane, tfirst, nwt, kb, w.n1, kind); break;
                        case 2: stage_tokens<KT, 2, MT>(s, sT, sP, warp, lane, tfirst, nwt, kb, w.n1, kind); break;
                        case 3: stage_tokens<KT, 3, MT>(s, sT, sP, warp, lane, tfirst, nwt, kb, w.n1, kind); break;
                        case 4: stage_tokens<KT, 4, MT>(s, sT, sP, warp, lane, tfirst, nwt, kb, w.n1, kind); break;
                        default: stage_tokens<KT, 5, MT>(s, sT, sP, warp, lane, tfirst, nwt, kb, w.n1, kind); break;
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
                        const float a = kb + col < w.n1 ? round_score<KT>(acc.x, kind) : -INFLLM_INF;
                        const float bb = kb + col + 1 < w.n1 ? round_score<KT>(acc.y, kind) : -INFLLM_INF;
                        *reinterpret_cast<float2*>(sT + tfirst * S1_ST + 4 + col) = make_float2(a, bb);
                    }
                }
                if (live && owner)
                    pool_tile<KT>(sT, bs0, olp, scores, score_row0, max_n1, tfirst, tpw, w.ntok, kb, w.n1, out_len, lane, kind);
            }
            stage ^= 1;
        }
        cp_async_wait<0>();
    }
    __syncthreads();                               // every token's block keys and carry are in place
    if (ranged) {
        s1_finish_range_all<KT>(w, w.nf, warp, nwarps, lane, sT, sB, score_row0, olp, j_lo, j_hi, out_len,
                                init_blocks, local_blocks, K, cand_key, cand_idx, kind);
        return;
    }

    // ---- per token: finish the block-key row (forced, uncomputed tail, padding), then top-K
    s1_finish_all<KT>(w, warp, nwarps, lane, sT, sB, bs_scratch, score_row0, olp, out_len, init_blocks, local_blocks, K,
                      max_n1, quirk, max_seqlen_q, scores, block_scores, topk_idx, topk_prefix, kind);
}
#undef S1_FT_LO

// The full selection (RANGED = false: the range fields replaced by constants, so that the compiler
// drops the range code) or a range pass (docs/stage1.md, 9. Long context: key ranges).
template <typename T, typename KT, int D, bool RANGED>
__global__ void __launch_bounds__(128, 2)
stage1_select(PARAM_ARGS(STAGE1_SELECT_PARAMS)) {
    stage1_select_body<T, KT, D>(S1_BODY_CALL_ARGS(RANGED));
}
