// stage2/sparse_bwd_sm90.cu: token-level block-sparse attention backward, Hopper (sm_90a) path: dk, dv.
//
// Launch contract (mirrored by infllm_cupy/stage2/sparse_bwd.py, whose DKDV_SM90_PARAMS and
// DKDV_PARTS_PARAMS declare the parameter structs below field by field; the loader checks the layouts
// at compile time). Each kernel takes the fields of its struct as its arguments. Fields, semantics and
// outputs are those of stage2_bwd_dkdv in sparse_bwd.cu (delta and the transposed tile index come
// from that file's two small kernels); capability 9.0 only. The sm_90a dq kernel runs on the
// forward's K/V ring: stage2_bwd_dq_ring_sm90 in sparse_bwd_dq_sm90.cu (the ring: ring_sm90.cuh).
//   stage2_bwd_dkdv_sm90<T, D, GATHER, QH>(the fields of Stage2BwdDkdvSm90Params<T>)   grid (H B split0 + H B (n_kb - 1))   block 128
//       n_kb = cdiv(max_seqlen_k, 64). CTA order: first the split0 parts of block 0 of every
//       (sequence, head) (every token selects block 0: alone it would be the longest CTA), then
//       order = 1: one (sequence, head) after another, key blocks 1, 2, ... within it (CTAs in
//       flight then mostly share a head, and as every CTA walks its query tiles from the last one
//       down, they read the same recent tiles while those are in L2); order = 0: key block
//       slowest, (sequence, head) fastest. The launcher uses 1 for fixed tiles, 0 for gathered
//       ones (docs/stage2_bwd.md, "CTA order").
//       split0 > 1: part p of block 0 takes the p-th of split0 equal runs of its tiles (counted
//       from the top) and stores its unscaled fp32 sums to part0 [H B][split0][2][64][D] (dK, dV);
//       stage2_bwd_dkdv_parts adds them in part order (deterministic) into dk, dv.
//       tmap_q / tmap_do (use_tma = 1, needs 64 % G == 0, GATHER = false): 3-d maps over q, dout
//       [total_q, HQ, D] with boxes of 64 / G tokens x G heads x 64 elements (_tma.heads_map):
//       a whole 64-row tile is then one box per 64 columns, copied by one thread.
//       dyn smem 1 KB slack + 2 * 64 * D (K, V) + 2 * 2 * 64 * D (Q, dO double buffer) elements + 2 * 3 * 64 * 4
//       GATHER = false ("sm90a", the default): `ut` indexes 64-row tiles (stage2_bwd_tiles with
//       tile_rows = 64), as the SM80 kernel. GATHER = true ("sm90a_gather", 8 <= G <= 64): `ut`
//       indexes tokens (tile_rows = G) and a tile gathers the next 64 / G tokens that selected the
//       block, wherever they are: with per-token selections a key block's 64-row tiles then hold
//       only rows that use it (a 4-token tile of consecutive tokens holds about one at G = 16);
//       block-shared selections give the same tiles, at some cost for the walk (docs/stage2_bwd.md,
//       "Fixed tiles vs gathered tokens (auto)").
//       vt_off / vt: null, or ("sm90a_auto") the other mode's index: then the launcher runs both
//       instances and each keeps the key blocks its mode does best (see the fill test below).
//       dk32, dv32, q_lo, q_hi, last_pass: query-range passes. One launch: null, null, 0,
//       max_seqlen_q, 1. P launches in order on one stream, split0 = 1: each walks only the units
//       (tiles or tokens) whose first row is one of the tokens q_lo .. q_hi - 1 of its sequence and
//       adds its sums to fp32 dk32, dv32 [total_k, H, D] (zeroed before the first pass); the last
//       pass (last_pass = 1, every CTA, tiles or not) writes dk, dv from them. Why: a CTA reads
//       each query tile it needs once per key block, and one (sequence, head)'s Q and dO (256 MB at
//       32k, G = 16) outgrow the L2; within a pass the CTAs in flight read one range's tiles
//       (docs/stage2_bwd.md, "Query-range passes and PDL").
//       pdl = 1 (passes only; the launcher gives every pass after the first the programmatic
//       stream serialization attribute): each CTA lets the next pass start at once and waits for
//       the pass before (griddepcontrol) before it reads dk32, dv32; CTA 0 waits on every path,
//       so no pass completes before the one before it. pdl = 0: neither instruction runs.
//       QH = 3: the same rows (H = HQ, G = 1), but one CTA per (key block, KV head): grid
//       (H / kv_group) B (split0 + n_kb - 1) with split0 = 1, the CTA walks the index rows of the
//       group's kv_group query heads one after another and writes dk, dv (dk32, dv32) per KV head
//       [total_k, H / kv_group, D]: the group's sum in fp32 registers, no partials
//       (docs/stage2_bwd.md, "Per-query-head mask rows").
//       QH = 2 (default 0), field kv_group: per-query-head mask rows, as stage2_bwd_dkdv's
//       QH = 2 (sparse_bwd.cu): H = HQ, G = 1, K and V read at head h / kv_group, dk, dv (and dk32,
//       dv32, part0) per query head; the launcher sums dk, dv over each group in fp32.
//   stage2_bwd_dkdv_parts<T, D>(the fields of Stage2BwdDkdvPartsParams<T>)   grid (H B)   block 256: block 0's dk,
//       dv from the parts.
//
// One warpgroup per CTA, every product on wgmma with 128-byte-swizzled shared-memory tiles (the
// forward's layout): the SM80 kernel reads each operand fragment through ldmatrix into every
// warp's registers, which makes it shared-memory bound; wgmma reads B once per warpgroup.
//   S^T = K Q^T, dP^T = V dO^T over one 64-row query tile, then dV += P^T dO and
//   dK += dS^T Q with P^T / dS^T as register A operands (Q, dO MN-major).
// Q/dO tiles are double-buffered (TMA where use_tma and the tile lies inside its sequence, else
// cp.async with zero-filled rows past the sequence), one CTA barrier per tile; 2 CTAs per SM
// overlap each other's loads and elementwise work with wgmma. A tile's S^T/dP^T group is issued
// before the previous tile's dV/dK group has been waited for (wait_group 1, then a CTA barrier
// frees that tile's Q/dO stage for the next load), so the tensor pipe runs both back to back;
// not in the gathering instance at D = 128, which has no registers for it. Per-thread cp.async
// address math was most of the instructions before TMA (docs/stage2_bwd.md, "dk/dv: the tile step").
// By role: dkdv_cta_order (which key block and part of block 0 a CTA takes), the kernel body (the
// sequence, the index-row walk and the tile loads, then per tile S^T/dP^T, dkdv_p_ds, dV/dK on
// wgmma) and dkdv_epilogue (parts, query-range passes, dk/dv).
#include "common/types.cuh"
#include "common/mma_sm80.cuh"
#include "common/wgmma_sm90.cuh"
#include "common/params.cuh"
#include "stage2/cta_common.cuh"
#include "stage2/seq_common.cuh"

#define BLOCK_N 64
#define QT 64

// x = A_x B_x^T and y = A_y B_y^T, 64 x 64 each over D, all four operands K-major 64-row tiles in
// 128-byte-swizzled shared memory (descriptors ax, bx, ay, by); issued together as one group,
// waited for by ss_product_pair_wait. The S^T and dP^T products of dk/dv: the caller
// walks to its next block or tile and issues its loads while they run.
template <typename T, int D>
__device__ __forceinline__ void ss_product_pair_issue(float (&x)[32], u64 ax, u64 bx, float (&y)[32], u64 ay, u64 by) {
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        const u32 koff = ((kk >> 2) * (64 * 128) + (kk & 3) * 32) >> 4;
        wgmma_ss<T, 64>(x, ax + koff, bx + koff, kk > 0);
    }
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        const u32 koff = ((kk >> 2) * (64 * 128) + (kk & 3) * 32) >> 4;
        wgmma_ss<T, 64>(y, ay + koff, by + koff, kk > 0);
    }
    wgmma_commit();
}

__device__ __forceinline__ void ss_product_pair_wait(float (&x)[32], float (&y)[32]) {
    wgmma_wait<0>();
    fence_regs(x);
    fence_regs(y);
}

// 64 rows x D of a [*, stride_rows, D] tensor into a swizzled tile; rows with ok = false are zeros.
template <typename T, int D>
__device__ __forceinline__ void load_tile_rows(u32 dst, const T* __restrict__ src_base, int tid,
                                               const int64 (&row_off)[64 * (D / 8) / 128], const bool (&row_ok)[64 * (D / 8) / 128]) {
    constexpr int CH = D / 8;
#pragma unroll
    for (int u = 0; u < 64 * CH / 128; ++u) {
        const int i = tid + 128 * u, row = i / CH, ch = i % CH;
        cp_async_16(dst + swz128(row, ch, 64), row_ok[u] ? src_base + row_off[u] + ch * 8 : src_base, row_ok[u] ? 16 : 0);
    }
}

// ---------------------------------------------------------------------------------------------
#define GATHER_MAX 8   // tokens per gathered tile (64 / G for G >= 8)

// Sum of `x` over the 128 threads of the CTA (every thread gets it); a CTA barrier.
__device__ __forceinline__ int cta_sum128(int x) {
    __shared__ int part[4];
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    __syncthreads();                       // `part` may still be read by a previous call
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = x;
    __syncthreads();
    return part[0] + part[1] + part[2] + part[3];
}

// Units of a key block's index row with rank [r0, r1) counted from the highest set bit, where
// r0, r1 cut the row into `parts` equal runs: returns the highest of them (the descending walk's
// first position, -1 when none) and their count. Each thread counts one chunk of words; the one
// whose chunk holds rank r0 finds the bit. Two CTA barriers; once per CTA.
__device__ __forceinline__ int part_start(const unsigned* __restrict__ urow, int groups, int part, int parts, int& count) {
    __shared__ int cnt[128];
    __shared__ int s_pos;
    const int tid = threadIdx.x;
    const int per = (groups + 127) / 128, w0 = min(groups, tid * per), w1 = min(groups, w0 + per);
    int c = 0;
    for (int w = w0; w < w1; ++w) c += __popc(__ldg(urow + w));
    cnt[tid] = c;
    if (tid == 0) s_pos = -1;
    __syncthreads();
    int total = 0, above = 0;
    for (int i = 0; i < 128; ++i) {
        total += cnt[i];
        above += i > tid ? cnt[i] : 0;
    }
    const int r0 = (int)((int64)total * part / parts), r1 = (int)((int64)total * (part + 1) / parts);
    if (r0 < r1 && above <= r0 && r0 < above + c) {
        int pos = prev_set_bit(urow, 32 * w1 - 1);
        for (int skip = r0 - above; skip > 0; --skip) pos = prev_set_bit(urow, pos - 1);
        s_pos = pos;
    }
    __syncthreads();
    count = r1 - r0;
    return s_pos;
}

// ---- dk/dv setup: this CTA's key block j, (sequence, head) hb and part of block 0 (-1: not split),
// in the CTA order of the launch contract (docs/stage2_bwd.md, "CTA order").
__device__ __forceinline__ void dkdv_cta_order(int HB, int split0, int n_kb, int order, int& j, int& hb, int& part) {
    part = -1;
    if ((int)blockIdx.x < HB * split0) {
        hb = blockIdx.x / split0;
        j = 0;
        if (split0 > 1) part = blockIdx.x % split0;
    } else {
        const int rest = blockIdx.x - HB * split0;
        if (order) {
            hb = rest / (n_kb - 1);
            j = 1 + rest % (n_kb - 1);
        } else {                         // key block slowest (docs/stage2_bwd.md, "CTA order")
            j = 1 + rest / HB;
            hb = rest % HB;
        }
    }
}

// ---- dk/dv tile step, elementwise: S^T becomes P^T = exp2(S^T scale - lse) and dP^T becomes
// dS^T = P^T (dP^T - delta), in place; element 4n + i is key key_r0 + 8 (i / 2), query row
// 8 n + c0 + i % 2 of the tile. lim, l2, dl: the tile's rows' last visible key, lse in log2 units
// (+inf: the row did not select the block) and delta; any_cut: some row sees only part of the block.
__device__ __forceinline__ void dkdv_p_ds(float (&s)[32], float (&dp)[32], const int* lim, const float* l2,
                                          const float* dl, int c0, int key_r0, float scale_log2, bool any_cut) {
    // rows m, m + 1 (e = 0, 1) are adjacent: one 64-bit load each for lse, delta (and limits)
    if (!any_cut) {
#pragma unroll
        for (int n = 0; n < 8; ++n) {
            const int m = n * 8 + c0;
            const float2 lm2 = *reinterpret_cast<const float2*>(l2 + m), dm = *reinterpret_cast<const float2*>(dl + m);
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int i = 4 * n + 2 * r;
                const float p0 = exp2f(fmaf(s[i], scale_log2, -lm2.x)), p1 = exp2f(fmaf(s[i + 1], scale_log2, -lm2.y));
                s[i] = p0;
                s[i + 1] = p1;
                dp[i] = p0 * (dp[i] - dm.x);
                dp[i + 1] = p1 * (dp[i + 1] - dm.y);
            }
        }
    } else {
#pragma unroll
        for (int n = 0; n < 8; ++n) {
            const int m = n * 8 + c0;
            const int2 lm = *reinterpret_cast<const int2*>(lim + m);
            const float2 lm2 = *reinterpret_cast<const float2*>(l2 + m), dm = *reinterpret_cast<const float2*>(dl + m);
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int i = 4 * n + 2 * r;
                const float p0 = key_r0 + 8 * r <= lm.x ? exp2f(fmaf(s[i], scale_log2, -lm2.x)) : 0.f;
                const float p1 = key_r0 + 8 * r <= lm.y ? exp2f(fmaf(s[i + 1], scale_log2, -lm2.y)) : 0.f;
                s[i] = p0;
                s[i + 1] = p1;
                dp[i] = p0 * (dp[i] - dm.x);
                dp[i + 1] = p1 * (dp[i + 1] - dm.y);
            }
        }
    }
}

// ---- dk/dv epilogue: this thread's keys key_r0 and key_r0 + 8 of the block (columns c0, c0 + 1 of
// each 8-column group). Block 0's parts store unscaled fp32 sums to part0 (stage2_bwd_dkdv_parts
// adds them); with query-range passes the sums accumulate in dk32, dv32 and the last pass writes
// dk, dv; one launch writes dk (scaled), dv.
template <typename T, int D>
__device__ __forceinline__ void dkdv_epilogue(float (&adk)[D / 2], float (&adv)[D / 2], int part, int hb,
                                              int split0, float* part0, int key_r0, int c0, int kbase, int ks, int Lk,
                                              int H, int h, bool passes, int last_pass, int pdl, float scale,
                                              float* dk32, float* dv32, T* dk, T* dv) {
    if (part >= 0) {
        // unscaled fp32 sums of this part of block 0; stage2_bwd_dkdv_parts adds the parts
        float* pk = part0 + ((int64)hb * split0 + part) * 2 * 64 * D;
        float* pv = pk + 64 * D;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int o = (key_r0 + 8 * r) * D + c0;
#pragma unroll
            for (int n = 0; n < D / 8; ++n) {
                *reinterpret_cast<float2*>(pk + o + n * 8) = make_float2(adk[4 * n + 2 * r], adk[4 * n + 2 * r + 1]);
                *reinterpret_cast<float2*>(pv + o + n * 8) = make_float2(adv[4 * n + 2 * r], adv[4 * n + 2 * r + 1]);
            }
        }
        return;
    }
    if (pdl) pdl_wait();   // the pass before has added its sums to dk32, dv32
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int key = kbase + key_r0 + 8 * r;
        if (key >= Lk) continue;
        const int64 o = ((int64)(ks + key) * H + h) * D + c0;
        if (passes) {       // this CTA alone owns these rows in this pass; passes run in order
#pragma unroll
            for (int n = 0; n < D / 8; ++n) {
                float2* pk = reinterpret_cast<float2*>(dk32 + o + n * 8);
                float2* pv = reinterpret_cast<float2*>(dv32 + o + n * 8);
                const float2 xk = *pk, xv = *pv;
                adk[4 * n + 2 * r] += xk.x;
                adk[4 * n + 2 * r + 1] += xk.y;
                adv[4 * n + 2 * r] += xv.x;
                adv[4 * n + 2 * r + 1] += xv.y;
                if (!last_pass) {
                    *pk = make_float2(adk[4 * n + 2 * r], adk[4 * n + 2 * r + 1]);
                    *pv = make_float2(adv[4 * n + 2 * r], adv[4 * n + 2 * r + 1]);
                }
            }
            if (!last_pass) continue;
        }
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
            *reinterpret_cast<u32*>(dk + o + n * 8) = pack2<T>(adk[4 * n + 2 * r] * scale, adk[4 * n + 2 * r + 1] * scale);
            *reinterpret_cast<u32*>(dv + o + n * 8) = pack2<T>(adv[4 * n + 2 * r], adv[4 * n + 2 * r + 1]);
        }
    }
}

#define STAGE2_BWD_DKDV_SM90_PARAMS(F, M) \
    STAGE2_BWD_QKV_FIELDS(F, M) \
    F(const long long* __restrict__, ut_off)    /* [B + 1] this instance's transposed index (stage2_bwd_tiles) */ \
    F(const unsigned* __restrict__, ut) \
    F(long long, ut_h_stride)                   /* index words per head */ \
    F(const long long* __restrict__, vt_off)    /* the other mode's index ("sm90a_auto"), or null */ \
    F(const unsigned* __restrict__, vt) \
    F(long long, vt_h_stride) \
    F(T* __restrict__, dk)                      /* [total_k, H, D] (out; QH 2: per query head, QH 3: per KV head) */ \
    F(T* __restrict__, dv)                      /* as dk */ \
    F(float* __restrict__, part0)               /* split0 > 1: [H B][split0][2][64][D] block 0's part sums */ \
    F(int, n_seq) F(int, n_kb)                  /* sequences, cdiv(max_seqlen_k, 64) */ \
    F(int, split0)                              /* CTAs of block 0 per (sequence, head) */ \
    F(int, order)                               /* CTA order: 1 (sequence, head) slowest, 0 key block slowest */ \
    M(tmap_q)                                   /* use_tma: q [total_q, HQ, D] in boxes of 64 / G tokens x G heads */ \
    M(tmap_do)                                  /* the same over dout */ \
    F(int, use_tma) \
    STAGE2_BWD_ROW_FIELDS(F, M) \
    F(float* __restrict__, dk32)                /* query-range passes: [total_k, H, D] fp32 sums, else null */ \
    F(float* __restrict__, dv32)                /* as dk32 */ \
    F(int, q_lo) F(int, q_hi)                   /* this pass's tokens of each sequence */ \
    F(int, last_pass)                           /* 1: this pass writes dk, dv */ \
    F(int, pdl)                                 /* 1: passes launched as programmatic dependents (griddepcontrol) */ \
    F(int, kv_group)                            /* QH 2, 3: query heads per K/V head (read only there) */
template <typename T>
struct Stage2BwdDkdvSm90Params { PARAM_FIELDS(STAGE2_BWD_DKDV_SM90_PARAMS) };

template <typename T, int D, bool GATHER, int QH = 0>
__global__ void __launch_bounds__(128, 2)
stage2_bwd_dkdv_sm90(PARAM_ARGS(STAGE2_BWD_DKDV_SM90_PARAMS)) {
    constexpr int CH = D / 8;
    constexpr u32 TILE = 64 * D * sizeof(T);
    constexpr u32 HALF = 64 * 128;
    // a tile's S^T/dP^T issue goes behind the previous tile's dV/dK group, not after waiting for it;
    // the gathering walk and the group walk (QH 3) at D = 128 have no registers for both groups in
    // flight (ptxas spills)
    constexpr bool PIPE = (!GATHER && QH != 3) || D < 128;
    constexpr float LOG2E = 1.4426950408889634f;
    extern __shared__ unsigned char smem[];
    const u32 raw = smem_u32(smem);
    const u32 base = (raw + 1023u) & ~1023u;
    const u32 sK = base, sV = sK + TILE, sQ = sV + TILE, sO = sQ + 2 * TILE;
    float* sL = reinterpret_cast<float*>(smem + (sO + 2 * TILE - raw));   // [2][QT]
    float* sD = sL + 2 * QT;                                               // [2][QT]
    int* sLim = reinterpret_cast<int*>(sD + 2 * QT);                       // [2][QT]
    __shared__ alignas(8) unsigned long long tile_bar[2];                  // TMA fills of the Q/dO stages

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    // query-range passes launched as programmatic dependents (launch contract): the next pass's
    // CTAs may take SMs as this one's last CTAs drain. A CTA waits for the pass before where it
    // reads dk32 / dv32; of the CTAs that leave early only CTA 0 waits, which is enough to keep a
    // pass from completing before the one before it (a pass p + 1 waits for p alone) without
    // holding SMs with CTAs that have nothing to do
    if (pdl) pdl_launch_dependents();
    // the CTA order of the launch contract: block 0's parts of every (sequence, head), then
    // (sequence, head) slowest and key block fastest
    // QH 3: one CTA per (key block, KV head) walks the group's query heads one after another
    const int HC = QH == 3 ? H / kv_group : H;      // heads of the CTA grid
    const int HB = HC * n_seq;
    int j, hb, part;
    dkdv_cta_order(HB, split0, n_kb, order, j, hb, part);
    const int b = hb / HC, hc = hb - b * HC;
    int h = QH == 3 ? hc * kv_group : hc;           // the (query) head of the index row being walked
    S2Seq sq;
    s2_seq_bounds(sq, cu_seqlens_q, cu_seqlens_k, b);
    if (j >= key_blocks(sq.Lk)) {
        if (pdl && blockIdx.x == 0) pdl_wait();
        return;
    }
    s2_seq_shift(sq, causal);
    s2_seq_rows(sq, G);
    // bits of one index row: tokens (GATHER) or 64-row tiles
    const int units = GATHER ? sq.Lq : (int)((sq.rows_total + QT - 1) / QT);
    const int groups = (units + 31) >> 5;
    const unsigned* urow = ut + (int64)h * ut_h_stride + ut_off[b] + (int64)j * groups;
    const unsigned* mrows = seq_mask_rows(masks, mask_base, b, h, mask_h_stride, n_words);
    const int kbase = j * BLOCK_N;
    const int tpt = GATHER ? min(64 / G, GATHER_MAX) : 0;   // tokens per gathered tile

    // "sm90a_auto" (vt != null): both kernels run over every key block and each keeps the blocks
    // its mode does best; vt is the other mode's index. The fill of the block's fixed tiles, (tokens
    // that selected it) x G / (64-row tiles that contain one of them x 64), decides: below 1/2 the
    // gathered tiles (full rows) win, above it the fixed ones (no walk). Both kernels count the
    // same two index rows, so every block is done by exactly one of them.
    if (vt != nullptr) {
        const int units_v = GATHER ? (int)((sq.rows_total + QT - 1) / QT) : sq.Lq;
        const int groups_v = (units_v + 31) >> 5;
        const unsigned* vrow = vt + (int64)h * vt_h_stride + vt_off[b] + (int64)j * groups_v;
        int own = 0, other = 0;
        for (int w = tid; w < groups; w += 128) own += __popc(__ldg(urow + w));
        for (int w = tid; w < groups_v; w += 128) other += __popc(__ldg(vrow + w));
        const int tokens = cta_sum128(GATHER ? own : other);
        const int tiles_n = cta_sum128(GATHER ? other : own);
        const bool gather_wins = 2 * (int64)tokens * G < (int64)tiles_n * QT;
        if (gather_wins != GATHER) {
            if (pdl && blockIdx.x == 0) pdl_wait();
            return;
        }
    }

    // The next tile to load, walking the index row downwards. Tile mode: its index `tile` (rows
    // 64 tile ..). Gather mode: the tokens tok[0 .. ntok) (rows s G .. s G + G - 1 are token
    // tok[s]'s heads); every thread walks the index row itself from `cursor` down, so the list
    // needs no barrier to be shared. `left`: units this CTA may still take (its part of block 0).
    // query-range passes (dk32 set): this pass takes the units whose first row is one of the
    // tokens q_lo .. q_hi - 1
    const bool passes = dk32 != nullptr;
    const int u_lo = !passes ? 0 : GATHER ? min(q_lo, units) : (int)min(((int64)q_lo * G + QT - 1) / QT, (int64)units);
    const int u_hi = !passes ? units : GATHER ? min(q_hi, units)
                                              : (int)min(((int64)q_hi * G + QT - 1) / QT, (int64)units);
    int left = 1 << 30, top = u_hi - 1;
    if (part >= 0) top = part_start(urow, groups, part, split0, left);
    int tile = top + 1, ntok = 0, cursor = top;
    // tile mode: the index word being walked (wcur) and its bits not taken yet, so most steps
    // read no memory
    int wcur = top >> 5;
    unsigned wbits = top >= 0 ? __ldg(urow + wcur) & (~0u >> (31 - (top & 31))) : 0u;
    FastDiv divG, divM;
    divG.init((unsigned)G);
    divM.init((unsigned)mask_q_block);
    int tok[GATHER_MAX];
#pragma unroll
    for (int i = 0; i < GATHER_MAX; ++i) tok[i] = 0;
    auto advance = [&]() -> bool {
        if (!GATHER) {
            if (left <= 0) return false;
            if constexpr (QH == 3) {
                for (;;) {
                    while (wbits == 0u && wcur > 0) wbits = __ldg(urow + --wcur);
                    if (wbits != 0u) {
                        tile = 32 * wcur + 31 - __clz(wbits);
                        if (tile >= u_lo) {
                            wbits &= ~(1u << (tile & 31));
                            return true;
                        }
                    }
                    // this head's row is done: the next query head of the group, from the top
                    // (the row's top recomputed, not kept: registers are at the cap at D = 128)
                    if ((h + 1) % kv_group == 0) return false;
                    ++h;
                    urow += ut_h_stride;
                    mrows += mask_h_stride * n_words;
                    const int units_ = (int)((sq.rows_total + QT - 1) / QT);
                    const int t_ = (dk32 != nullptr ? (int)min(((int64)q_hi * G + QT - 1) / QT, (int64)units_) : units_) - 1;
                    wcur = t_ >> 5;
                    wbits = t_ >= 0 ? __ldg(urow + wcur) & (~0u >> (31 - (t_ & 31))) : 0u;
                }
            }
            while (wbits == 0u) {
                if (--wcur < 0) return false;
                wbits = __ldg(urow + wcur);
            }
            tile = 32 * wcur + 31 - __clz(wbits);
            if (tile < u_lo) return false;
            wbits &= ~(1u << (tile & 31));
            --left;
            return true;
        }
        ntok = 0;
#pragma unroll
        for (int i = 0; i < GATHER_MAX; ++i) {
            if (i < tpt && cursor >= 0 && left > 0) {
                const int t = prev_set_bit(urow, cursor);
                if (t >= u_lo) {
                    tok[i] = t;
                    ntok = i + 1;
                    --left;
                }
                cursor = t >= u_lo ? t - 1 : -1;
            }
        }
        return ntok > 0;
    };
    // token and head of row `row` of the next tile; false past the tile's rows. Every copy of a
    // tile row needs this: a division by G was ~20 instructions of each copy (half the kernel's
    // instructions with the 64-bit offset math), FastDiv is two.
    auto row_token = [&](int row, int& t, int& g) -> bool {
        if (GATHER) {
            const int slot = (int)divG.div((unsigned)row);
            int tt = tok[0];
#pragma unroll
            for (int i = 1; i < GATHER_MAX; ++i) if (slot == i) tt = tok[i];
            t = tt;
            g = row - slot * G;
            return slot < ntok;
        }
        const unsigned R = (unsigned)tile * QT + row;   // rows of one sequence fit in 31 bits (launcher)
        t = (int)divG.div(R);
        g = (int)(R - (unsigned)t * G);
        return R < (unsigned)sq.rows_total;
    };

    // the first tile; a pass that finds none adds nothing (except the last, which writes dk, dv)
    bool have = advance();
    if (passes && !have && !last_pass) {
        if (pdl && blockIdx.x == 0) pdl_wait();
        return;
    }
    {
        constexpr int U = 64 * CH / 128;
        int64 off[U];
        bool ok[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int key = kbase + (tid + 128 * u) / CH;
            ok[u] = key < sq.Lk;
            // QH 2: the query head's KV head of k, v's H / kv_group heads (dk, dv rows stay per query head)
            off[u] = QH >= 2 ? ((int64)(sq.ks + key) * (H / kv_group) + h / kv_group) * D
                             : ((int64)(sq.ks + key) * H + h) * D;
        }
        load_tile_rows<T, D>(sK, k, tid, off, ok);
        load_tile_rows<T, D>(sV, v, tid, off, ok);
    }

    // row info of a tile, in two halves: fetch (global loads into registers, issued while the
    // previous tile computes) and commit (shared-memory stores at the top of the tile's own step,
    // before its barrier)
    int f_word = 0, f_rk = -1;
    float f_l = 0.f, f_d = 0.f;
    auto fetch_info = [&]() {
        f_rk = -1;
        int t, g;
        if (tid < QT && row_token(tid, t, g)) {
            const int64 li = ((int64)h * G + g) * total_q + sq.qs + t;
            f_word = (int)__ldg(mrows + (int64)divM.div((unsigned)t) * n_words + (j >> 5));
            f_l = __ldg(lse + li);
            f_d = __ldg(delta + li);
            f_rk = causal ? t + sq.shift : sq.Lk - 1;
        }
    };
    // sL holds +inf for a row that did not select the block, so exp2(S - lse) is 0 there without
    // a compare; returns whether the row sees only part of the block (the causal diagonal)
    auto commit_info = [&](int stage) -> bool {
        bool cut = false;
        if (tid < QT) {
            const bool sel = f_rk >= kbase && ((((unsigned)f_word) >> (j & 31)) & 1u);
            sLim[stage * QT + tid] = sel ? f_rk - kbase : -1;
            sL[stage * QT + tid] = sel ? f_l * LOG2E : INFLLM_INF;
            sD[stage * QT + tid] = sel ? f_d : 0.f;
            cut = sel && f_rk - kbase < BLOCK_N - 1;
        }
        return cut;
    };
    // Q/dO of the next tile into `stage`. Whole fixed tiles (G divides 64, so a tile is 64 / G
    // tokens x G heads, a box of the 3-d maps) come by two or four TMA copies from one thread and
    // complete on tile_bar[stage]; a sequence's last, partial tile and gathered tiles by cp.async,
    // 16 bytes per thread and copy, rows past the tile zero-filled. Returns whether TMA was used.
    const u32 bar0 = smem_u32(&tile_bar[0]);
    if (!GATHER && use_tma) {
        if (tid == 0) {
            mbar_init(bar0, 1);
            mbar_init(bar0 + 8, 1);
            asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
        }
        __syncthreads();                // every thread may wait on them
    }
    auto load_tile = [&](int stage) -> bool {
        const u32 dq_ = sQ + stage * TILE, do_ = sO + stage * TILE;
        if (!GATHER && use_tma && (int64)(tile + 1) * QT <= sq.rows_total) {
            if (tid == 0) {
                const u32 bar = bar0 + 8 * stage;
                const int t0 = (int)divG.div((unsigned)tile * QT);
                mbar_arrive_expect_tx(bar, 2 * TILE);
#pragma unroll
                for (int half = 0; half < D / 64; ++half) {
                    tma_load_3d(dq_ + half * HALF, tmap_q, half * 64, h * G, sq.qs + t0, bar);
                    tma_load_3d(do_ + half * HALF, tmap_do, half * 64, h * G, sq.qs + t0, bar);
                }
            }
            return true;
        }
#pragma unroll 2
        for (int u = 0; u < 64 * CH / 128; ++u) {
            const int i = tid + 128 * u, row = i / CH, ch = i % CH;
            int t, g;
            int64 off = 0;
            int bytes = 0;
            if (row_token(row, t, g)) {
                off = (int64)(sq.qs + t) * (HQ * D) + ((h * G + g) * D + ch * 8);
                bytes = 16;
            }
            cp_async_16(dq_ + swz128(row, ch, 64), q + off, bytes);
            cp_async_16(do_ + swz128(row, ch, 64), dout + off, bytes);
        }
        return false;
    };

    // bit s: stage s's current fill came by TMA / the parity its barrier completes next
    unsigned tma_fill = 0u, tma_parity = 0u;
    if (have) {
        if (load_tile(0)) tma_fill = 1u;
        fetch_info();
    }
    cp_async_commit();

    float adk[D / 2], adv[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) adk[i] = adv[i] = 0.f;
    float s[32], dp[32];
    u32 pa[4][4], da[4][4];
    const u64 k_desc = smem_desc(sK, 16, 1024), v_desc = smem_desc(sV, 16, 1024);
    const u64 q_desc = smem_desc(sQ, 16, 1024), o_desc = smem_desc(sO, 16, 1024);      // K-major B
    const u64 qt_desc = smem_desc(sQ, HALF, 1024), ot_desc = smem_desc(sO, HALF, 1024);  // MN-major B
    const int c0 = (lane & 3) * 2;
    const int key_r0 = warp * 16 + (lane >> 2);     // this thread's keys in the block: key_r0, key_r0 + 8

    int stage = 0;
    while (have) {
        // this tile's row info was fetched during the previous tile: its loads had all of that
        // tile's math to land (committing it right after the math exposed their latency)
        const bool cut = commit_info(stage);
        cp_async_wait<0>();
        if ((tma_fill >> stage) & 1u) {
            mbar_wait(bar0 + 8 * stage, (tma_parity >> stage) & 1u);
            tma_parity ^= 1u << stage;
        }
        fence_proxy_async();
        // any row of the tile cut by the causal diagonal: then every element is compared
        const bool any_cut = __syncthreads_or(cut);
        // S^T and dP^T first, queued behind the previous tile's dV/dK so the tensor pipe runs both
        // back to back; once that group is done in every warp (wait 1 + barrier) its Q/dO stage is
        // free, and the walk to the next tile and its loads run while S^T/dP^T compute
        ss_product_pair_issue<T, D>(s, k_desc, q_desc + ((stage * TILE) >> 4), dp, v_desc, o_desc + ((stage * TILE) >> 4));
        if (PIPE) {
            wgmma_wait<1>();
            fence_regs(adv);
            fence_regs(adk);
            __syncthreads();
        }
        const bool have_next = advance();
        if (have_next) {
            const unsigned bit = 1u << (stage ^ 1);
            tma_fill = load_tile(stage ^ 1) ? tma_fill | bit : tma_fill & ~bit;
            fetch_info();                       // global loads in flight during this tile's math
        }
        cp_async_commit();
        ss_product_pair_wait(s, dp);
        // element 4n + i: key key_r0 + 8 (i / 2), query row 8 n + c0 + i % 2 of the tile
        const int* lim = sLim + stage * QT;
        const float* l2 = sL + stage * QT;
        const float* dl = sD + stage * QT;
        dkdv_p_ds(s, dp, lim, l2, dl, c0, key_r0, scale_log2, any_cut);
        // both A operands packed before one fence: a wgmma.fence between the dV and dK issues
        // would wait for the dV group to finish
        pack_a_frags<T, 4>(s, pa);
        pack_a_frags<T, 4>(dp, da);
        const u64 qtd = qt_desc + ((stage * TILE) >> 4), otd = ot_desc + ((stage * TILE) >> 4);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) wgmma_rs_tb<T, D>(adv, pa[kk], otd + ((kk * 16 * 128) >> 4), 1);
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) wgmma_rs_tb<T, D>(adk, da[kk], qtd + ((kk * 16 * 128) >> 4), 1);
        wgmma_commit();
        if (!PIPE) {
            wgmma_wait<0>();
            fence_regs(adv);
            fence_regs(adk);
        }
        stage ^= 1;
        have = have_next;
    }
    wgmma_wait<0>();
    fence_regs(adv);
    fence_regs(adk);
    cp_async_wait<0>();

    // QH 3: dk, dv (and dk32, dv32) per KV head, the group's sum made here in fp32
    dkdv_epilogue<T, D>(adk, adv, part, hb, split0, part0, key_r0, c0, kbase, sq.ks, sq.Lk, HC, hc, passes, last_pass,
                        pdl, scale, dk32, dv32, dk, dv);
}

// dk, dv of block 0 from the split0 parts' fp32 sums (see the launch contract), added in part
// order so the result is the same bits on every run.   grid (H B)   block 256
#define STAGE2_BWD_DKDV_PARTS_PARAMS(F, M) \
    F(const float* __restrict__, part0)         /* [H B][split0][2][64][D] (stage2_bwd_dkdv_sm90) */ \
    F(const int* __restrict__, cu_seqlens_k)    /* [B + 1] */ \
    F(T* __restrict__, dk)                      /* [total_k, H, D] (out: block 0's rows) */ \
    F(T* __restrict__, dv)                      /* as dk */ \
    F(int, H) F(int, split0) \
    F(float, scale)                             /* softmax scale (dk's) */
template <typename T>
struct Stage2BwdDkdvPartsParams { PARAM_FIELDS(STAGE2_BWD_DKDV_PARTS_PARAMS) };

template <typename T, int D>
__global__ void __launch_bounds__(256)
stage2_bwd_dkdv_parts(PARAM_ARGS(STAGE2_BWD_DKDV_PARTS_PARAMS)) {
    const int hb = blockIdx.x, b = hb / H, h = hb - b * H;
    const int ks = cu_seqlens_k[b], Lk = min(cu_seqlens_k[b + 1] - ks, 64);
    const float* pk = part0 + (int64)hb * split0 * 2 * 64 * D;
    for (int i = threadIdx.x; i < Lk * D; i += blockDim.x) {
        float sk = 0.f, sv = 0.f;
        for (int part = 0; part < split0; ++part) {
            sk += pk[(int64)part * 2 * 64 * D + i];
            sv += pk[(int64)part * 2 * 64 * D + 64 * D + i];
        }
        const int64 o = ((int64)(ks + i / D) * H + h) * D + i % D;
        dk[o] = from_float<T>(sk * scale);
        dv[o] = from_float<T>(sv);
    }
}
