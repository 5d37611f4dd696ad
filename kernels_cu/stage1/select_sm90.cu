// stage1/select_sm90.cu: InfLLM-v2 stage 1 in one kernel, Hopper (sm_90a) path. Same semantics,
// arguments and outputs as stage1_select in select.cu (its header states them); only the shape of
// the work differs.
//
// Launch contract (mirrored by infllm_cupy/stage1/select.py, whose SELECT_SM90_PARAMS declares
// Stage1SelectSm90Params (below: Stage1SelectParams's fields and tm1, tm2) field by field; the loader
// checks the layout at compile time):
//   kernel   stage1_select_sm90<T, KT, D, RANGED, PACKED>(the fields of Stage1SelectSm90Params<T, KT>)
//            (as stage1_select); capability 9.0, G <= 32. PACKED (16-bit scores, Stage1Plan.packed):
//            the group sum of tokens of 3 to 32 rows on f16 pairs (stage1/packed.cuh), within about
//            one bf16 step of the float32 sum; tokens of 1 or 2 rows take the float32 path either way
//   grid     (n_tiles * B * H)   n_tiles = cdiv(max_seqlen_q, TOK), TOK = 128 / GP; CTA order as stage1_select
//   block    256 (two warpgroups: 128 rows = TOK tokens x GP rows; lgp <= 5)
//   dyn smem 1024 (alignment) + 2 * 64 * D * sizeof(T) (Q, two 64-row tiles) + 2 * 64 * D * sizeof(T)
//            (two key tiles) + TOK * 68 * 4 (staging rows) + (lgp == 5 ? 8 * 64 * 4 : 0) (per-warp column
//            sums) + (bs_scratch ? 0 : TOK * olp * sizeof(KT)); the key ring's four mbarriers take 32 bytes
//            of the alignment slack (before the 1 KB-aligned tiles, or after the layout's end)
//   tm1, tm2 tensor maps (infllm_cupy/_tma.py rows_map, boxes of 64 rows x 64 elements) over ck1 and ck2
//            viewed as [rows, H * D] (a zero map for an empty tensor: its stream has no tile)
//   range pass (RANGED, cand_idx != null; docs/stage1.md, 9. Long context: key ranges): blocks [j_lo, j_hi),
//            j_lo a multiple of 64; olp = 64 + wr (wr >= K, a multiple of 64: the range row and a 64-key pad);
//            bs_scratch, scores and block_scores null; writes cand_key (32-bit keys) / cand_idx [H, total_q, K]
//            instead of topk_idx. bias_mode 1 stores the coarse pass's per-row bias to row_bias
//            [total_q, HQ] float, 2 loads it and skips the coarse pass. A full launch (RANGED = false)
//            ignores j_lo .. bias_mode (the launcher passes 0, out_len, null, null, null, 0).
//
// Why a second kernel: the SM80 kernel runs at ~40% issue utilisation with two warps per scheduler;
// its warps stall on their own dependency chains (mma.sync accumulators, exp, shuffles), and 128
// mma.sync + 32 ldmatrix per warp and tile take a fifth of its instructions. Here each warpgroup
// computes its 64 x 64 score tile with 8 asynchronous wgmma (Q and K both read from 128-byte-
// swizzled shared memory, so Q costs no registers), the accumulator is 32 registers per thread,
// and the kernel fits two CTAs (16 warps) per SM. The pooling of tile u - 1 runs while the tensor
// cores compute tile u. Warp w owns rows 16 w .. 16 w + 15 (a token at G = 16), so the softmax
// steps, the group sum and the top-K are select_common.cuh's with one m-tile per warp.
#include "common/types.cuh"
#include "common/mma_sm80.cuh"
#include "common/wgmma_sm90.cuh"
#include "stage1/select_common.cuh"
#include "stage1/packed.cuh"

// Stage1SelectParams's fields and the tensor maps of the key tiles (the launch contract above).
#define STAGE1_SELECT_SM90_PARAMS(F, M) \
    STAGE1_SELECT_PARAMS(F, M) \
    M(tm1) M(tm2)                           /* over ck1, ck2 viewed as [rows, H * D] */
template <typename T, typename KT>
struct Stage1SelectSm90Params { PARAM_FIELDS(STAGE1_SELECT_SM90_PARAMS) };

// The kernel's body (S1_BODY_CALL_ARGS): the full selection (the range fields constants) or a range pass.
template <typename T, typename KT, int D, bool PACKED>
__device__ __forceinline__ void stage1_select_sm90_body(PARAM_REF_ARGS(STAGE1_SELECT_SM90_PARAMS)) {
    typedef KT key_t;
    constexpr int CH = D / 8;                 // 16-byte chunks per row
    constexpr int MT = 1;                     // m-tiles per warp (16 rows)
    constexpr u32 TILE = 64 * D * sizeof(T);  // one 64-row tile (Q of a warpgroup, or 64 keys)
    constexpr u32 HALF = 64 * 128;            // bytes of one 64-row, 64-element half tile
    constexpr int NTHREADS = 256;
    extern __shared__ unsigned char smem[];
    const u32 raw = smem_u32(smem);
    const u32 base = (raw + 1023u) & ~1023u;  // swizzled tiles start on 1 KB boundaries
    const u32 sQ = base, sK = sQ + 2 * TILE;

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, wg = warp >> 2;
    const int GP = 1 << lgp;
    const int TOK = 128 >> lgp;               // tokens per CTA
    S1Cta w;
    if (!s1_cta(w, TOK, H, B, n_tiles, cu_q, cu_c1, cu_c2, cache_lens, s1, s2c, causal)) return;
    const bool ranged = cand_idx != nullptr;
    const int nf = s1_pass_fine_tiles(w, ranged, j_lo, j_hi, bias_mode);   // fine tiles from S1_FT_LO
#define S1_FT_LO max(0, j_lo / 16 - 1)
    const int NT = w.nc + nf;

    float* sT = reinterpret_cast<float*>(smem + (sK + 2 * TILE - raw));              // [TOK][68]
    float* sP = sT + TOK * S1_ST;                                                     // [8][64] if lgp == 5
    key_t* sB = reinterpret_cast<key_t*>(sP + (lgp == 5 ? 8 * 64 : 0));               // [TOK][olp]
    const int64 score_row0 = (int64)w.h * total_q + w.qs + w.t0;                      // row of token 0
    key_t* bs0 = bs_scratch ? bs_scratch + score_row0 * olp : sB;                    // token tok: bs0 + tok * olp
    // where the tiles pool block j of token tok: sBp[tok * olp + j] (a range row starts 64 keys in, at j_lo)
    key_t* sBp = ranged ? sB + 64 - j_lo : sB;

    for (int i = tid; i < TOK; i += NTHREADS) sT[i * S1_ST + 3] = -INFLLM_INF;        // no column -1

    // ---- this thread's rows rr = half: CTA row 16 warp + 8 half + g
    const int g = lane >> 2, c = lane & 3;
    int lim1[2], lim2[2];
    float bias[2], m_run[2], z_run[2];
    bool live = false;
#pragma unroll
    for (int rr = 0; rr < 2; ++rr)
        live |= s1_row_init(w, warp * 16 + rr * 8 + g, lgp, G, s1, causal, lim1[rr], lim2[rr], bias[rr], m_run[rr],
                            z_run[rr]);
    // a range pass after the first: the coarse pass's bias, parked in m_run (dead without coarse tiles)
    if (bias_mode == 2) s1_row_bias<2>(w, 2, row_bias, m_run, warp * 16 + g, lgp, G, HQ, c);
    live = __any_sync(S1_FULL, live);          // the warp has a real token
    const int tpw = 16 >> lgp;                 // tokens whose staging and pooling this warp owns
    const int tfirst = (warp * 16) >> lgp;

    if (NT > 0) {
        // ---- Q: 128 rows, two 64-row swizzled tiles (one per warpgroup), resident for the whole loop
        for (int i = tid; i < 128 * CH; i += NTHREADS) {
            const int row = i / CH, ch = i % CH;
            const int tok = row >> lgp, gh = row & (GP - 1);
            const T* src = q;
            int bytes = 0;
            if (tok < w.ntok && gh < G) {
                src = q + ((int64)(w.qs + w.t0 + tok) * HQ + (int64)w.h * G + gh) * D + ch * 8;
                bytes = 16;
            }
            cp_async_16(sQ + (row >> 6) * TILE + swz128(row & 63, ch, 64), src, bytes);
        }
        cp_async_commit();

        // ---- key tiles by TMA (docs/stage1.md, 3. The sm_90a kernel): thread 0 issues a 64-key tile as
        // D / 64 boxes of 64 rows x 128 bytes, the 128-byte-swizzled halves the descriptors read,
        // completing on full[stage]; each warp arrives on empty[stage] once its wgmma of the tile
        // completed, and the next copy into that stage waits for all eight (no CTA barrier per tile).
        // A tile's rows past its stream are the next sequence's keys (zeros past the tensor): the
        // visibility limits mask them as they masked the zero rows of the cp.async copy.
        const u32 lay_end = sK + 2 * TILE + TOK * S1_ST * 4 + (lgp == 5 ? 8 * 64 * 4 : 0) +
                            (bs_scratch ? 0 : TOK * olp * (int)sizeof(KT));
        const u32 bars = base - raw >= 32 ? raw : lay_end;   // the alignment slack, before or after the tiles
        auto full = [&](int st) { return bars + 8 * st; };
        auto empty = [&](int st) { return bars + 16 + 8 * st; };
        // the first key row of tile u in its tensor: the coarse keys, then the fine ones from S1_FT_LO
        auto tile_row = [&](int u) { return u < w.nc ? w.c2s + u * S1_TILE : w.c1s + (u - w.nc + S1_FT_LO) * S1_TILE; };
        auto load_tile = [&](int u, int st) {       // thread 0
            const u32 bar = full(st);
            mbar_arrive_expect_tx(bar, TILE);
#pragma unroll
            for (int hf = 0; hf < D / 64; ++hf)
                tma_load_2d(sK + st * TILE + hf * HALF, u < w.nc ? tm2 : tm1, w.h * D + hf * 64, tile_row(u), bar);
        };
        if (tid == 0) {
#pragma unroll
            for (int st = 0; st < 2; ++st) {
                mbar_init(full(st), 1);
                mbar_init(empty(st), NTHREADS / 32);
            }
            asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
            load_tile(0, 0);
            if (NT > 1) load_tile(1, 1);
        }
        // Q landed (generic-proxy copies that wgmma reads) and the barriers are initialised
        cp_async_wait<0>();
        fence_proxy_async();
        __syncthreads();

        // descriptors built once, as 32-bit halves: moving one by b bytes adds b >> 4 to the low half
        // (the start-address field; addresses lie below 256 KB, so nothing carries out of it)
        // warp-uniform bases (warp_uniform: a REDUX), so that ptxas keeps the descriptors in uniform
        // registers instead of moving each one over with R2UR before every wgmma
        const u64 q_desc = smem_desc(sQ + warp_uniform(wg) * TILE, 16, 1024), k_desc = smem_desc(sK, 16, 1024);
        const u32 q_lo = (u32)q_desc, k_lo = (u32)k_desc, desc_hi = (u32)(k_desc >> 32);
        // block keys in shared memory or in the global scratch: two call sites, so that the shared
        // one compiles to shared-memory loads and stores (a generic pointer costs 64-bit math)
        auto pool = [&](int kb) {
            if (bs_scratch) pool_tile<KT>(sT, bs0, olp, scores, score_row0, max_n1, tfirst, tpw, w.ntok, kb, w.n1, out_len, lane, kind);
            else pool_tile<KT>(sT, sBp, olp, scores, score_row0, max_n1, tfirst, tpw, w.ntok, kb, w.n1, out_len, lane, kind);
        };
        // G > 8 paths: the previous tile's column 63, and pooling from a lane's two column sums
        float carry = -INFLLM_INF;
        KT* srow = scores != nullptr ? scores + (score_row0 + tfirst) * max_n1 : nullptr;
        auto pool_cols = [&](float2 sum, int kb) {
            if (bs_scratch) pool_columns<KT>(sum, carry, bs0 + (int64)tfirst * olp, srow, max_n1, kb, w.n1, out_len, lane, kind);
            else pool_columns<KT>(sum, carry, sBp + tfirst * olp, srow, max_n1, kb, w.n1, out_len, lane, kind);
        };
        float s[MT][8][4];
        float (&sacc)[32] = reinterpret_cast<float (&)[32]>(s);

        int pend_kb = -1;                       // fine tile whose pooling is pending (its first key)
#pragma unroll 1
        for (int u = 0; u < NT; ++u) {
            const int stage = u & 1;
            // G > 16: a token's two warps exchange column sums in sP once per tile (below); the
            // barrier keeps a warp from overwriting its sums before its partner read them
            if (lgp == 5) __syncthreads();
            // tile u + 1 into the other stage once every warp's wgmma of tile u - 1 completed
            // (tiles 0 and 1 were issued before the loop)
            if (tid == 0 && u >= 1 && u + 1 < NT) {
                mbar_wait(empty(stage ^ 1), ((u - 1) >> 1) & 1);
                load_tile(u + 1, stage ^ 1);
            }
            __syncwarp();
            mbar_wait(full(stage), (u >> 1) & 1);   // tile u landed
            const bool fine = u >= w.nc;
            const int kb = (fine ? u - w.nc + S1_FT_LO : u) * S1_TILE;    // first key of the tile

            // S = Q K^T on the tensor cores (both warpgroups, always: wgmma is warpgroup-collective)
            const u32 kd = k_lo + ((warp_uniform(stage) * TILE) >> 4);
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) {
                const u32 koff = ((kk >> 2) * HALF + (kk & 3) * 32) >> 4;
                wgmma_ss<T, 64>(sacc, ((u64)desc_hi << 32) | (q_lo + koff), ((u64)desc_hi << 32) | (kd + koff), kk > 0);
            }
            wgmma_commit();
            // meanwhile: pool the previous fine tile from the staging rows (this warp's tokens' rows)
            __syncwarp();
            if (pend_kb >= 0 && live) pool(pend_kb);
            wgmma_wait<0>();
            fence_regs(sacc);
            if (lane == 0) mbar_arrive(empty(stage));     // this warp is done reading the stage

            if (!fine) {
                // ---- pass 1: online max and sum over the visible coarse keys
                if (live) coarse_update<MT>(s, lim2, m_run, z_run, kb, c, sl2);
                if (u == w.nc - 1) {
                    coarse_bias(z_run, m_run, lim1, bias, sl2);
                    // the first range pass keeps the bias for the others (a CTA without coarse tiles
                    // has no fine tile in any range: its rows' biases are never read)
                    if (bias_mode == 1) s1_row_bias<2>(w, 1, row_bias, bias, warp * 16 + g, lgp, G, HQ, c);
                }
                pend_kb = -1;
            } else {
                // ---- pass 2: fine-key probabilities, summed over each token's rows, staged
                if (bias_mode == 2 && u == 0) {
#pragma unroll
                    for (int rr = 0; rr < 2; ++rr) bias[rr] = m_run[rr];
                }
                if (live && PACKED && lgp >= 2) {
                    // the group sum on f16 pairs (stage1/packed.cuh): probabilities scaled by 2^pk
                    const float pk = pk_shift(lgp), inv = exp2f(-pk);
                    const float bsh[2] = {bias[0] - pk, bias[1] - pk};
                    fine_probs<MT>(s, lim1, bsh, kb, c, sl2);
                    // a sum past f16's range in the warp: the tile's sum again in float32
                    float2 sum;
                    switch (lgp) {   // CTA-uniform
                        case 2:
                            if (!stage_tokens_pk<KT, 2>(s, sT, lane, tfirst, kb, w.n1, kind, inv)) {
                                pk_unscale(s, inv);
                                stage_tokens<KT, 2, MT>(s, sT, nullptr, warp, lane, tfirst, 1, kb, w.n1, kind);
                            }
                            break;
                        case 3:
                            if (!stage_tokens_pk<KT, 3>(s, sT, lane, tfirst, kb, w.n1, kind, inv)) {
                                pk_unscale(s, inv);
                                stage_tokens<KT, 3, MT>(s, sT, nullptr, warp, lane, tfirst, 1, kb, w.n1, kind);
                            }
                            break;
                        case 4:
                            if (!warp_rows_sum_pk(s, lane, inv, sum)) { pk_unscale(s, inv); sum = warp_rows_sum(s, lane); }
                            pool_cols(sum, kb);
                            break;
                        default:
                            if (!warp_rows_sum_pk(s, lane, inv, sum)) { pk_unscale(s, inv); sum = warp_rows_sum(s, lane); }
                            *reinterpret_cast<float2*>(sP + warp * 64 + 2 * lane) = sum;
                    }
                } else if (live) {
                    fine_probs<MT>(s, lim1, bias, kb, c, sl2);
                    switch (lgp) {   // CTA-uniform
                        case 0: stage_tokens<KT, 0, MT>(s, sT, nullptr, warp, lane, tfirst, 1, kb, w.n1, kind); break;
                        case 1: stage_tokens<KT, 1, MT>(s, sT, nullptr, warp, lane, tfirst, 1, kb, w.n1, kind); break;
                        case 2: stage_tokens<KT, 2, MT>(s, sT, nullptr, warp, lane, tfirst, 1, kb, w.n1, kind); break;
                        case 3: stage_tokens<KT, 3, MT>(s, sT, nullptr, warp, lane, tfirst, 1, kb, w.n1, kind); break;
                        case 4:     // one token per warp: sum and pool in registers, no staging row
                            pool_cols(warp_rows_sum(s, lane), kb);
                            break;
                        default:    // a token on two warps: each sums its 16 rows, the first adds both
                            *reinterpret_cast<float2*>(sP + warp * 64 + 2 * lane) = warp_rows_sum(s, lane);
                            break;
                    }
                }
                if (lgp == 5) {
                    __syncthreads();                 // the partner's sums are in sP
                    if (live && (warp & 1) == 0) {
                        const float2 mine = *reinterpret_cast<const float2*>(sP + warp * 64 + 2 * lane);
                        const float2 theirs = *reinterpret_cast<const float2*>(sP + (warp + 1) * 64 + 2 * lane);
                        pool_cols(make_float2(mine.x + theirs.x, mine.y + theirs.y), kb);
                    }
                }
                pend_kb = lgp >= 4 ? -1 : kb;
            }
        }
        __syncwarp();
        if (pend_kb >= 0 && live) pool(pend_kb);
        if (lgp >= 4 && live && lane == 0 && (lgp == 4 || (warp & 1) == 0))
            sT[tfirst * S1_ST + 3] = carry;    // for the finish below
    }
    __syncthreads();                               // every token's block keys and carry are in place

    if (ranged) {
        s1_finish_range_all<KT>(w, w.nf, warp, NTHREADS / 32, lane, sT, sB, score_row0, olp, j_lo, j_hi, out_len,
                                init_blocks, local_blocks, K, cand_key, cand_idx, kind);
        return;
    }
    // ---- per token: finish the block-key row (forced, uncomputed tail, padding), then top-K
    s1_finish_all<KT>(w, warp, NTHREADS / 32, lane, sT, sB, bs_scratch, score_row0, olp, out_len, init_blocks, local_blocks, K,
                      max_n1, quirk, max_seqlen_q, scores, block_scores, topk_idx, topk_prefix, kind);
}
#undef S1_FT_LO

// The full selection (RANGED = false: the range fields replaced by constants, so that the compiler
// drops the range code) or a range pass (docs/stage1.md, 9. Long context: key ranges).
template <typename T, typename KT, int D, bool RANGED, bool PACKED = false>
__global__ void __launch_bounds__(256, 2)
stage1_select_sm90(PARAM_ARGS(STAGE1_SELECT_SM90_PARAMS)) {
    stage1_select_sm90_body<T, KT, D, PACKED>(S1_BODY_CALL_ARGS(RANGED), tm1, tm2);
}
