// stage2/sparse_fwd.cu: token-level block-sparse attention forward (InfLLM-v2 stage 2), SM80 path.
//
// Launch contract (mirrored by infllm_cupy/stage2/sparse_fwd.py, whose FWD_PARAMS declares
// Stage2FwdParams field by field; the loader checks the layout at compile time):
//   kernel   stage2_fwd<T, D, WARPS, MT, KN, QH>(the fields of Stage2FwdParams<T>)
//            T in {__half, __nv_bfloat16}, D in {64, 128}, WARPS in
//            {4, 8}, MT in {1, 2} m-tiles of 16 rows per warp (a CTA owns M = 16 * MT * WARPS rows),
//            KN in {32, 64} keys per softmax sub-step, QH in {0, 2} (default 0): per-query-head
//            mask rows, see masks
//   grid     (cdiv(max_seqlen_q * G, M), H, B)      block (32 * WARPS)
//   dyn smem (M * D + 4 * 64 * D) * sizeof(T) + 4 * n_words
//   q        [total_q, HQ, D] T, contiguous          k, v [total_k, H, D] T, contiguous
//   masks    uint32 bitmasks over 64-key blocks, n_words per row. The row of token r (local) of
//            sequence b for KV head h is  mask_base[b] + h * mask_h_stride + r / mask_q_block:
//              token-level topk_idx: mask_base = cu_seqlens_q, mask_h_stride = total_q, mask_q_block = 1
//              query-block layouts:  mask_base[b] = first row of b's layout, mask_q_block = 64 or 128
//            QH = 2: each query head has its own rows, one query head per CTA: the
//            launch passes H = HQ and G = 1 (masks as a layout with HQ heads) and k, v keep their
//            H / kv_group heads: query head h reads K/V head h / kv_group; the grid is
//            (cdiv(max_seqlen_q, M) * kv_group, H / kv_group, B), block x = tile * kv_group + head
//            in group. kv_group is read only with QH = 2 (docs/stage2_fwd.md, "Per-query-head mask
//            rows").
//   out      [total_q, HQ, D] T                        lse [HQ, total_q] float32 (natural log)
//   Semantics: query (r, head h*G+g) attends keys c of its sequence with c/64 set in its mask row,
//   c < Lk and, when causal, c <= r + Lk - Lq (bottom-right). No allowed key: out = 0, lse = +inf.
//
// Shape of the work (docs/stage2_fwd.md, "SM80 kernel"): a CTA owns M consecutive rows of the flattened
// (token, head-in-group) space of one sequence and one KV head: with G = 16 each m-tile is one
// token's 16 heads, and MT = 2 gives a warp two tokens that share every K/V fragment it loads
// (FlashAttention-2's 32 rows per warp, half the shared-memory reads per FLOP of MT = 1). The CTA walks the union of its tokens' blocks in ascending order, streaming
// each K/V block into shared memory once (cp.async, double buffered); a warp skips a block none of
// its rows selected (warp-uniform, no divergence) and masks rows that did not select it, so a
// block shared by all tokens costs what it costs in FlashAttention-2.
#include "common/types.cuh"
#include "common/mma_sm80.cuh"
#include "common/params.cuh"
#include "stage2/cta_common.cuh"
#include "stage2/seq_common.cuh"

#define BLOCK_N 64

// The arguments (the masks rows and QH = 2's kv_group: the launch contract above).
#define STAGE2_FWD_PARAMS(F, M) \
    F(const T* __restrict__, q)                 /* [total_q, HQ, D] */ \
    F(const T* __restrict__, k)                 /* [total_k, H, D] (QH = 2: H / kv_group heads) */ \
    F(const T* __restrict__, v)                 /* [total_k, H, D] */ \
    STAGE2_FWD_ROW_FIELDS(F, M) \
    F(int, kv_group)                            /* QH = 2: query heads per K/V head */
template <typename T>
struct Stage2FwdParams { PARAM_FIELDS(STAGE2_FWD_PARAMS) };

// Registers: MT = 1 at 8 warps would spill under a 128-register cap, so 8-warp CTAs run one per SM
// with the full register file; 4-warp CTAs run two per SM (255 registers each).
template <typename T, int D, int WARPS, int MT, int KN, int QH = 0>
__global__ void __launch_bounds__(32 * WARPS, WARPS == 4 ? 2 : 1)
stage2_fwd(PARAM_ARGS(STAGE2_FWD_PARAMS)) {
    constexpr int THREADS = 32 * WARPS;
    constexpr int WROWS = 16 * MT;              // rows per warp
    constexpr int M = WROWS * WARPS;            // rows per CTA
    constexpr int CH = D / 8;                   // 16-byte chunks per row
    constexpr int NR = 2 * MT;                  // rows held by one thread
    extern __shared__ __align__(128) unsigned char smem[];
    T* sQ = reinterpret_cast<T*>(smem);
    T* sK = sQ + M * D;                         // [2][BLOCK_N * D]
    T* sV = sK + 2 * BLOCK_N * D;               // [2][BLOCK_N * D]
    unsigned* sU = reinterpret_cast<unsigned*>(sV + 2 * BLOCK_N * D);

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    // QH 2: grid.x runs over (row tile, head of the group), heads fastest (the group's heads of one
    // tile run together and share its K/V blocks in the L2); grid.y is the KV head
    const int h = QH == 2 ? (int)(blockIdx.y * kv_group + blockIdx.x % kv_group) : (int)blockIdx.y;
    const int b = blockIdx.z;
    S2Seq sq;
    s2_seq(sq, cu_seqlens_q, cu_seqlens_k, b, G, causal);
    const int64 m0 = (int64)(QH == 2 ? blockIdx.x / kv_group : blockIdx.x) * M;
    if (m0 >= sq.rows_total) return;
    const int nb = key_blocks(sq.Lk);
    const int t_lo = (int)(m0 / G);
    const int t_hi = (int)((min(m0 + M, sq.rows_total) - 1) / G);
    // last block any row of this CTA may see
    const int max_block = last_visible_block(min(nb, n_words * 32), causal, t_hi, sq.shift);
    const int nw = union_words(max_block);
    const unsigned* mrows = seq_mask_rows(masks, mask_base, b, h, mask_h_stride, n_words);

    // ---- union of the CTA's tokens' blocks, clipped to max_block
    cta_union(sU, mrows, n_words, t_lo / mask_q_block, t_hi / mask_q_block, max_block, nw, tid, THREADS);

    // ---- Q tile: rows are (token, head) pairs, zero past the sequence
    for (int i = tid; i < M * CH; i += THREADS) {
        const int row = i / CH, ch = i % CH;
        int bytes;
        const T* src = q_row_chunk(q, m0 + row, sq.rows_total, G, sq.qs, HQ, h, D, ch, bytes);
        cp_async_16(smem_u32(sQ + swz<D>(row, ch) * 8), src, bytes);
    }
    cp_async_commit();

    auto load_kv = [&](int j, int stage) {
        load_kv_block<T, D>(sK + stage * BLOCK_N * D, sV + stage * BLOCK_N * D, k, v, j, sq.ks, sq.Lk,
                            QH == 2 ? H / kv_group : H, QH == 2 ? h / kv_group : h, tid, THREADS);
    };

    __syncthreads();  // sU complete
    int j = next_set_bit(sU, nw, 0);
    if (j >= 0) load_kv(j, 0);
    cp_async_commit();

    // ---- this thread's rows: g and g + 8 of each of the warp's MT m-tiles (row r = 2 * mt + i)
    bool row_ok[NR];
    int rk[NR];
    const unsigned* mrow[NR];
    auto row_of = [&](int r) { return m0 + warp * WROWS + (r >> 1) * 16 + (lane >> 2) + 8 * (r & 1); };
#pragma unroll
    for (int r = 0; r < NR; ++r) {
        const int64 R = row_of(r);
        row_ok[r] = R < sq.rows_total;
        const int t = row_ok[r] ? (int)(R / G) : t_lo;
        rk[r] = causal ? t + sq.shift : sq.Lk - 1;
        mrow[r] = mrows + (int64)(t / mask_q_block) * n_words;
    }

    float o[MT][D / 8][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int n = 0; n < D / 8; ++n) o[mt][n][0] = o[mt][n][1] = o[mt][n][2] = o[mt][n][3] = 0.f;
    float m_run[NR], l_run[NR];
#pragma unroll
    for (int r = 0; r < NR; ++r) { m_run[r] = -INFLLM_INF; l_run[r] = 0.f; }

    // ldmatrix byte offsets. Every row an ldmatrix lane addresses has (row % 8) == lane % 8, so the
    // swizzle is a XOR of the chunk with it, and chunk c and c + 8 differ by 128 bytes: four offsets
    // per operand cover all of D (the rest are immediates), which keeps addresses out of the register file.
    constexpr int ROWB = CH * 16;               // bytes per tile row
    u32 q_off[4], k_off[4], v_off[4];
    ldsm_offsets(lane, warp * WROWS, ROWB, q_off, k_off, v_off);
    const u32 sQa = smem_u32(sQ), sKa = smem_u32(sK), sVa = smem_u32(sV);
    int stage = 0;
    while (j >= 0) {
        // One barrier per block: after it, block j is in shared memory for everyone and every warp
        // is done with the other stage, which the next block's copy may then overwrite.
        cp_async_wait<0>();
        __syncthreads();
        const int jn = next_set_bit(sU, nw, j + 1);
        if (jn >= 0) load_kv(jn, stage ^ 1);
        cp_async_commit();

        bool sel[NR];
        bool any = false, all_full = true;
        const int kbase = j * BLOCK_N;
#pragma unroll
        for (int r = 0; r < NR; ++r) {
            sel[r] = row_ok[r] && ((__ldg(mrow[r] + (j >> 5)) >> (j & 31)) & 1u) && kbase <= rk[r];
            any |= sel[r];
            all_full &= sel[r] && kbase + BLOCK_N - 1 <= rk[r];
        }
        if (__any_sync(0xffffffffu, any)) {
            const bool need_mask = !__all_sync(0xffffffffu, all_full);
            const u32 tK = sKa + stage * (BLOCK_N * D * (int)sizeof(T));
            const u32 tV = sVa + stage * (BLOCK_N * D * (int)sizeof(T));
            // The block is processed in sub-steps of KN keys: KN = 32 halves the S registers
            // (which lets MT = 2 fit at D = 128) at the price of a second online-softmax update.
#pragma unroll 1
            for (int sb = 0; sb < BLOCK_N / KN; ++sb) {
                // S = Q K^T for this warp's rows and KN keys; each K fragment serves MT m-tiles
                float s[MT][KN / 8][4];
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int n = 0; n < KN / 8; ++n) s[mt][n][0] = s[mt][n][1] = s[mt][n][2] = s[mt][n][3] = 0.f;
#pragma unroll
                for (int kk = 0; kk < D / 16; ++kk) {
                    u32 a[MT][4];
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt)
                        ldmatrix_x4(a[mt], sQa + q_off[kk & 3] + (kk >> 2) * 128 + mt * 16 * ROWB);
#pragma unroll
                    for (int np = 0; np < KN / 16; ++np) {
                        u32 bk[4];
                        ldmatrix_x4(bk, tK + k_off[kk & 3] + (kk >> 2) * 128 + (sb * KN + np * 16) * ROWB);
#pragma unroll
                        for (int mt = 0; mt < MT; ++mt) {
                            mma_16816<T>(s[mt][2 * np], a[mt], bk[0], bk[1]);
                            mma_16816<T>(s[mt][2 * np + 1], a[mt], bk[2], bk[3]);
                        }
                    }
                }
                // mask (only where some row needs it), then online softmax in the log2 domain
                const int cbase = kbase + sb * KN;
                bool rescale = false;
                float alpha[NR];
#pragma unroll
                for (int r = 0; r < NR; ++r) {
                    float (*sr)[4] = s[r >> 1];
                    const int e0 = 2 * (r & 1);
                    float mx = -INFLLM_INF;
#pragma unroll
                    for (int n = 0; n < KN / 8; ++n) {
#pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            float x = sr[n][e0 + e];
                            if (need_mask) {
                                const int c = cbase + n * 8 + (lane & 3) * 2 + e;
                                if (!sel[r] || c > rk[r]) x = -INFLLM_INF;
                                sr[n][e0 + e] = x;
                            }
                            mx = fmaxf(mx, x);
                        }
                    }
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                    const float m_new = fmaxf(m_run[r], mx);
                    // scores are raw q.k here; the scale folds into one FMA per element
                    const float m_use = m_new == -INFLLM_INF ? 0.f : m_new * scale_log2;  // all masked so far: 0s
                    alpha[r] = exp2f(m_run[r] * scale_log2 - m_use);
                    rescale |= m_new != m_run[r];
                    m_run[r] = m_new;
                    float sum = 0.f;
#pragma unroll
                    for (int n = 0; n < KN / 8; ++n) {
#pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            const float p = exp2f(fmaf(sr[n][e0 + e], scale_log2, -m_use));
                            sr[n][e0 + e] = p;
                            sum += p;
                        }
                    }
                    l_run[r] = l_run[r] * alpha[r] + sum;
                }
                // the running max rarely moves after the first blocks: skip the O rescale then
                if (__any_sync(0xffffffffu, rescale)) {
#pragma unroll
                    for (int r = 0; r < NR; ++r)
#pragma unroll
                        for (int n = 0; n < D / 8; ++n) {
                            o[r >> 1][n][2 * (r & 1)] *= alpha[r];
                            o[r >> 1][n][2 * (r & 1) + 1] *= alpha[r];
                        }
                }
                // O += P V; the S accumulator layout is the A-operand layout, so P never leaves registers
#pragma unroll
                for (int kk = 0; kk < KN / 16; ++kk) {
                    u32 a[MT][4];
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) {
                        a_from_acc<T>(s[mt][2 * kk], s[mt][2 * kk + 1], a[mt]);
                    }
#pragma unroll
                    for (int dp = 0; dp < D / 16; ++dp) {
                        u32 bv[4];
                        ldmatrix_x4_trans(bv, tV + v_off[dp & 3] + (dp >> 2) * 128 + (sb * KN + kk * 16) * ROWB);
#pragma unroll
                        for (int mt = 0; mt < MT; ++mt) {
                            mma_16816<T>(o[mt][2 * dp], a[mt], bv[0], bv[1]);
                            mma_16816<T>(o[mt][2 * dp + 1], a[mt], bv[2], bv[3]);
                        }
                    }
                }
            }
        }
        stage ^= 1;
        j = jn;
    }
    cp_async_wait<0>();

    // ---- epilogue: normalise, write O and the LSE
    const float LN2 = 0.69314718055994531f;
#pragma unroll
    for (int r = 0; r < NR; ++r) {
        float l = l_run[r];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        if (!row_ok[r]) continue;
        const int64 R = row_of(r);
        const int t = (int)(R / G), g = (int)(R - (int64)t * G);
        const float inv = l > 0.f ? 1.f / l : 0.f;
        const int e0 = 2 * (r & 1);
        T* dst = out + ((int64)(sq.qs + t) * HQ + (int64)h * G + g) * D + (lane & 3) * 2;
#pragma unroll
        for (int n = 0; n < D / 8; ++n)
            *reinterpret_cast<u32*>(dst + n * 8) = pack2<T>(o[r >> 1][n][e0] * inv, o[r >> 1][n][e0 + 1] * inv);
        if ((lane & 3) == 0)
            lse[((int64)h * G + g) * total_q + sq.qs + t] =
                l > 0.f ? (m_run[r] * scale_log2 + log2f(l)) * LN2 : INFLLM_INF;
    }
}
