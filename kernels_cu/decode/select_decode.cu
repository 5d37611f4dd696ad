// decode/select_decode.cu: InfLLM-v2 stage 1 for decode (one query token per sequence) with each
// sequence's compressed keys split over many CTAs, and an exact merge. Design: docs/decode.md,
// "Stage 1 for decode: the split kernels".
//
// Semantics (docs/semantics.md, stage 1; non-causal): per KV head h of sequence b with L = seqlens[b],
// n1 = fine windows (32/16) and n2 = coarse windows (128/64) of L (exact mode: ck2 = ck1, n2 = n1):
//   bias_g = log2 sum_j 2^(sl2 q_g.ck2_j)            (max-shifted; sl2 = softmax_scale * log2 e)
//   score_i = round_kind(sum_{g < G} 2^(sl2 q_g.ck1_i - bias_g))    (0 for every i when n2 = 0)
//   block_j = max score_i over i in [4j - 1, 4j + 3] and [0, n1); -inf when empty
//   forced +inf: j < init_blocks and qb - local_blocks <= j <= qb, qb = max(L - 1, 0) / 64
//   topk_idx[h, b] = the K best blocks (ties to the lower index) ascending, blocks > qb -> -1
//
// Launch contract (mirrored by infllm_cupy/decode/select_decode.py, whose COARSE_PARAMS, FINE_PARAMS and
// TOPK_PARAMS declare each kernel's parameter struct field by field; the loader checks the layouts at
// compile time). Every kernel takes the fields of its struct as its arguments:
//
// ck1 [B, N1, H, D] T, ck2 [B, N2, H, D] T (sequence b's valid windows first in its row), q [B, HQ, D] T,
// seqlens int32 [B]. Every kernel reads n1/n2 from seqlens (n = L < ks ? 0 : (L - ks) / st + 1).
//
// select_decode_coarse<T, D, MT>(the fields of SelectDecodeCoarseParams<T>)   T in {__half, __nv_bfloat16},
//                                                                              D in {64, 128}, MT in {1, 2, 4}
//   grid (R2, H, B)  block (128 MT)  dynamic smem SelSmem<D, MT>::BYTES
//   CTA r takes coarse keys [64 T2 r, 64 T2 (r + 1)); writes part float2 [B, H, R2, G] = (max, sum)
//   of 2^(sl2 q_g.ck2_j) over its valid keys in the log2 domain ((-inf, 0) when it has none)
//   (exact: pass ck1 as ck2, N2 = N1, exact = 1)
// select_decode_fine<T, D, MT>(the fields of SelectDecodeFineParams<T>)
//   grid (R1, H, B)  block (128 MT)  dynamic smem SelSmem<D, MT>::BYTES + 4 * 64 T1
//   CTA r takes fine keys [64 T1 r - 1, 64 T1 (r + 1) - 1) (one key to the left of its blocks), merges
//   the R2 coarse partials into bias_g, and writes blocks [16 T1 r, 16 T1 (r + 1)) of
//   blk float [B, H, 16 T1 R1] (rounded score values; the last block of the range lacks its key
//   64 T1 (r + 1) - 1) and lead float [B, H, R1] = the score of its first key (-inf for r = 0).
//   CTAs whose first key is >= n1 exit without writing (the top-k kernel does not read them).
// select_decode_topk<KT>(the fields of SelectDecodeTopkParams)   KT = unsigned (score kind 0, fp32) or
//                                                                 unsigned short (bf16, fp16)
//   grid (H * B)  block (a multiple of 32, at most 512; 512 from the launcher)
//   dynamic smem olp * sizeof(KT) + 4 * SEL_TOPK_SCRATCH, olp = out_len rounded up to 64
//   completes each row (block j of range r's last slot: max with lead[r + 1]; blocks past the last
//   fine key: -inf; padding: key 0; forced blocks) and writes topk_idx int32 [H, B, kout]. The whole
//   CTA selects (radix select, then a compaction over all warps): the rows of select_row
//   (stage1/select_common.cuh) bit for bit.
//   topk_prefix > 0 (a test hook, as the prefill kernel's): the search prefix ends past block
//   max(topk_prefix, K) - 1 instead of past the query's own block, so that the whole-row rerun runs.
//
// dense_len (every kernel; 0: never): a step on which every sequence is shorter than dense_len is dense
//   (spec section 9, decided on the device so that a captured graph follows the lengths): the score
//   kernels exit at once and the top-k kernel writes blocks 0 .. cdiv(L, 64) - 1, then -1.
// kout (top-k kernel): the row length of topk_idx [H, B, kout], >= K (slots past K are -1) and, with
//   dense_len > 0, >= every dense row's blocks (cdiv(dense_len - 1, 64), at most out_len).
//
// The fine and top-k kernels may be launched as programmatic dependents of the kernel before them
// (sm_90): each waits (griddepcontrol.wait) before reading what that kernel wrote.
//
// Why (docs/decode.md): at 128k a sequence has 8191 fine windows per KV head (2 MB at D = 128); one CTA
// per (sequence, KV head) leaves most of a 132-SM GPU idle. Splitting the windows over ranges makes the
// scan bandwidth-bound; what crosses ranges is small and merged exactly: the coarse normaliser (a
// (max, sum) pair per head and range), and the one fine key a block shares with the previous range.
#include "common/types.cuh"
#include "common/mma_sm80.cuh"
#include "common/params.cuh"
#include "common/pdl.cuh"
#include "stage1/select_common.cuh"

#define SEL_TILE 64          // compressed keys per tile
#define SEL_NST 3            // ck tiles in flight per CTA (cp.async ring)
#define SEL_FINE_KS 32       // fine compression kernel / stride (the cache's, spec section 3)
#define SEL_FINE_ST 16
#define SEL_COARSE_KS 128
#define SEL_COARSE_ST 64
#define SEL_TOPK_SCRATCH 584 // ints of shared memory after the top-k row (sel_topk_row): 2 x 256 + 64 + 8

__device__ __forceinline__ int sel_windows(int L, int ks, int st) { return L < ks ? 0 : (L - ks) / st + 1; }

// The dense/sparse rule of spec section 9 on the device: the step is dense while every sequence (the
// current token included) is shorter than dense_len (0: never). Every thread reads the B lengths
// (cached; B is a batch), so a captured graph takes the right path at every replay.
__device__ __forceinline__ bool sel_dense_step(const int* __restrict__ seqlens, int B, int dense_len) {
    if (dense_len <= 0) return false;
    for (int i = 0; i < B; ++i)
        if (seqlens[i] >= dense_len) return false;
    return true;
}

// Programmatic dependent launch (common/pdl.cuh): the fine kernel starts while the coarse kernel
// runs and loads its Q and ck1 tiles (written before the coarse kernel started), then waits for the
// coarse partials; the top-k kernel's launch overlaps the fine kernel's tail.

// (M, Z) <- the pair of the union of two sets given by their (max, sum of 2^(x - max)) in log2 units.
__device__ __forceinline__ void sel_merge_pair(float& M, float& Z, float m, float z) {
    const float mn = fmaxf(M, m);
    if (mn == -INFLLM_INF) return;              // both empty
    Z = Z * exp2f(M - mn) + z * exp2f(m - mn);
    M = mn;
}

// Dynamic shared memory of the score kernels: Q [16 MT rows], the ck ring, per-warp row stats / group
// sums, then (fine kernel) the range's scores.
template <int D, int MT>
struct SelSmem {
    static constexpr int ROWB = 2 * D;
    static constexpr int TILE = SEL_TILE * ROWB;
    static constexpr int Q = 0;
    static constexpr int CK = Q + 16 * MT * ROWB;
    static constexpr int RED = CK + SEL_NST * TILE;             // float [4 MT][16] x 2 (coarse) / [MT][64] (fine)
    static constexpr int BIAS = RED + 2 * 4 * MT * 16 * 4;      // float [16 MT]
    static constexpr int BYTES = BIAS + 16 * MT * 4;            // fine kernel: + float [64 T1] scores
};

// Q rows of the group into shared memory (rows >= G as zeros), one cp.async group with the first tiles.
template <typename T, int D, int MT>
__device__ __forceinline__ void sel_load_q(u32 q_s, const T* __restrict__ q, int b, int h, int H, int G, int tid) {
    constexpr int CH = D / 8;
    const int HQ = H * G;
    for (int idx = tid; idx < 16 * MT * CH; idx += 128 * MT) {
        const int r = idx / CH, ch = idx % CH;
        const bool ok = r < G;
        const T* src = ok ? q + ((int64)b * HQ + (int64)h * G + r) * D + ch * 8 : q;
        cp_async_16(q_s + swz<D>(r, ch) * 16, src, ok ? 16 : 0);
    }
}

// Rows key0 .. key0 + 63 of ck (sequence b, head h) into stage `dst`; rows outside [0, n) are zeros.
template <typename T, int D, int MT>
__device__ __forceinline__ void sel_load_tile(u32 dst, const T* __restrict__ ck, int b, int h, int H, int N, int n,
                                              int key0, int tid) {
    constexpr int CH = D / 8;
#pragma unroll 2
    for (int idx = tid; idx < SEL_TILE * CH; idx += 128 * MT) {
        const int r = idx / CH, ch = idx % CH, key = key0 + r;
        const bool ok = key >= 0 && key < n;
        const T* src = ok ? ck + (((int64)b * N + key) * H + h) * D + ch * 8 : ck;
        cp_async_16(dst + swz<D>(r, ch) * 16, src, ok ? 16 : 0);
    }
}

// The score kernels' pipeline (docs/decode.md, 14. Stage 1 for decode: the split kernels): Q and the
// first SEL_NST - 1 tiles of ck keys [k0, k0 + 64 nt) into the ring, one cp.async group a tile (Q in
// the first); sel_score_tiles runs the loop.
template <typename T, int D, int MT>
__device__ __forceinline__ void sel_ring_start(u32 q_s, u32 ck_s, const T* __restrict__ q, const T* __restrict__ ck,
                                               int b, int h, int H, int G, int N, int n, int k0, int nt, int tid) {
    typedef SelSmem<D, MT> SM;
    if (nt > 0) sel_load_q<T, D, MT>(q_s, q, b, h, H, G, tid);
#pragma unroll
    for (int st = 0; st < SEL_NST - 1; ++st) {
        if (st < nt) sel_load_tile<T, D, MT>(ck_s + st * SM::TILE, ck, b, h, H, N, n, k0 + st * SEL_TILE, tid);
        cp_async_commit();
    }
}

// The tiles i < nt that sel_ring_start began: tile i + SEL_NST - 1 is copied while tile i is scored,
// and this warp's S of tile i (qk_tile_16x16: rows 16 mt + ..., keys 16 kw + ...) goes to use(i, s).
// `use` must pass a CTA barrier after its last read of the ring: the next copy overwrites tile i's stage.
template <typename T, int D, int MT, typename Use>
__device__ __forceinline__ void sel_score_tiles(u32 q_s, u32 ck_s, const T* __restrict__ ck, int b, int h, int H,
                                                int N, int n, int k0, int nt, int tid, int lane, int mt, int kw,
                                                Use&& use) {
    typedef SelSmem<D, MT> SM;
    u32 a_off[4], b_off[4], t_off[4];
    ldsm_offsets(lane, 16 * mt, SM::ROWB, a_off, b_off, t_off);
    for (int i = 0; i < nt; ++i) {
        if (i + SEL_NST - 1 < nt)
            sel_load_tile<T, D, MT>(ck_s + ((i + SEL_NST - 1) % SEL_NST) * SM::TILE, ck, b, h, H, N, n,
                                    k0 + (i + SEL_NST - 1) * SEL_TILE, tid);
        cp_async_commit();
        cp_async_wait<SEL_NST - 1>();
        __syncthreads();
        float s[2][4];
        qk_tile_16x16<T, D>(s, q_s, ck_s + (i % SEL_NST) * SM::TILE + 16 * kw * SM::ROWB, a_off, b_off);
        use(i, s);
    }
    cp_async_wait<0>();
}

#define SELECT_DECODE_COARSE_PARAMS(F, M) \
    F(const T* __restrict__, q)                 /* [B, HQ, D] */ \
    F(const T* __restrict__, ck2)               /* [B, N2, H, D] coarse windows (exact: ck1) */ \
    F(const int* __restrict__, seqlens)         /* [B] */ \
    F(int, N2) F(int, H) F(int, G)              /* ck2's windows per sequence, KV heads, query heads per KV head */ \
    F(int, T2)                                  /* 64-key tiles per CTA */ \
    F(int, exact)                               /* 1: ck2 holds the fine windows (32/16) */ \
    F(float, sl2)                               /* softmax_scale * log2(e) */ \
    F(int, dense_len)                           /* 0, or the length below which a step is dense */ \
    F(float2* __restrict__, part)               /* [B, H, R2, G] (max, sum) per range */
template <typename T>
struct SelectDecodeCoarseParams { PARAM_FIELDS(SELECT_DECODE_COARSE_PARAMS) };

template <typename T, int D, int MT>
__global__ void __launch_bounds__(128 * MT)
select_decode_coarse(PARAM_ARGS(SELECT_DECODE_COARSE_PARAMS)) {
    typedef SelSmem<D, MT> SM;
    extern __shared__ __align__(128) unsigned char smem[];
    const int r2 = blockIdx.x, h = blockIdx.y, b = blockIdx.z, R2 = gridDim.x;
    pdl_launch_dependents();                               // the fine kernel may start its prologue now
    if (sel_dense_step(seqlens, gridDim.z, dense_len)) return;     // no selection on a dense step
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, mt = warp >> 2, kw = warp & 3;
    const int g4 = lane >> 2, c4 = lane & 3;
    const int L = seqlens[b];
    const int n2 = exact ? sel_windows(L, SEL_FINE_KS, SEL_FINE_ST) : sel_windows(L, SEL_COARSE_KS, SEL_COARSE_ST);
    const int k0 = r2 * T2 * SEL_TILE;
    const int nt = max(0, min(T2, (n2 - k0 + SEL_TILE - 1) / SEL_TILE));
    const u32 s_base = smem_u32(smem), q_s = s_base + SM::Q, ck_s = s_base + SM::CK;
    sel_ring_start<T, D, MT>(q_s, ck_s, q, ck2, b, h, H, G, N2, n2, k0, nt, tid);
    float m[2] = {-INFLLM_INF, -INFLLM_INF}, l[2] = {0.f, 0.f};
    sel_score_tiles<T, D, MT>(q_s, ck_s, ck2, b, h, H, N2, n2, k0, nt, tid, lane, mt, kw, [&](int i, float (&s)[2][4]) {
        const int key0 = k0 + i * SEL_TILE + 16 * kw + 2 * c4;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float x[4];
#pragma unroll
            for (int t = 0; t < 2; ++t)
#pragma unroll
                for (int e = 0; e < 2; ++e) x[2 * t + e] = key0 + 8 * t + e < n2 ? s[t][2 * r + e] * sl2 : -INFLLM_INF;
            float mx = fmaxf(fmaxf(x[0], x[1]), fmaxf(x[2], x[3]));
            mx = fmaxf(mx, __shfl_xor_sync(S1_FULL, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(S1_FULL, mx, 2));
            const float m_new = fmaxf(m[r], mx);
            const float m_use = m_new == -INFLLM_INF ? 0.f : m_new;
            float sum = 0.f;
#pragma unroll
            for (int e = 0; e < 4; ++e) sum += exp2f(x[e] - m_use);
            l[r] = l[r] * exp2f(m[r] - m_use) + sum;
            m[r] = m_new;
        }
        __syncthreads();   // the stage read here is the one tile i + NST lands in
    });
    // combine the 4 key-quarter warps of each row tile (fixed order: the same rounding every run)
    float* m_s = reinterpret_cast<float*>(smem + SM::RED);
    float* l_s = m_s + 4 * MT * 16;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        l[r] += __shfl_xor_sync(S1_FULL, l[r], 1);
        l[r] += __shfl_xor_sync(S1_FULL, l[r], 2);
        if (c4 == 0) {
            m_s[(mt * 4 + kw) * 16 + g4 + 8 * r] = m[r];
            l_s[(mt * 4 + kw) * 16 + g4 + 8 * r] = l[r];
        }
    }
    __syncthreads();
    for (int g = tid; g < G; g += 128 * MT) {
        const int rt = g >> 4, rr = g & 15;
        float M = -INFLLM_INF, Z = 0.f;
        for (int w = 0; w < 4; ++w) M = fmaxf(M, m_s[(rt * 4 + w) * 16 + rr]);
        if (M != -INFLLM_INF)
            for (int w = 0; w < 4; ++w) Z += l_s[(rt * 4 + w) * 16 + rr] * exp2f(m_s[(rt * 4 + w) * 16 + rr] - M);
        part[(((int64)b * H + h) * R2 + r2) * G + g] = make_float2(M, Z);
    }
}

#define SELECT_DECODE_FINE_PARAMS(F, M) \
    F(const T* __restrict__, q)                 /* [B, HQ, D] */ \
    F(const T* __restrict__, ck1)               /* [B, N1, H, D] fine windows */ \
    F(const int* __restrict__, seqlens)         /* [B] */ \
    F(int, N1) F(int, H) F(int, G)              /* ck1's windows per sequence, KV heads, query heads per KV head */ \
    F(int, T1)                                  /* 64-key tiles per CTA */ \
    F(int, R2)                                  /* coarse ranges (part's) */ \
    F(int, exact)                               /* 1: the coarse partials are over ck1 */ \
    F(int, kind)                                /* score dtype: 0 float32, 1 bf16, 2 fp16 */ \
    F(float, sl2)                               /* softmax_scale * log2(e) */ \
    F(int, dense_len)                           /* 0, or the length below which a step is dense */ \
    F(const float2* __restrict__, part)         /* [B, H, R2, G] the coarse kernel's (max, sum) */ \
    F(float* __restrict__, blk)                 /* [B, H, 16 T1 R1] block scores */ \
    F(float* __restrict__, lead)                /* [B, H, R1] each range's first key's score */
template <typename T>
struct SelectDecodeFineParams { PARAM_FIELDS(SELECT_DECODE_FINE_PARAMS) };

template <typename T, int D, int MT>
__global__ void __launch_bounds__(128 * MT, 1)
select_decode_fine(PARAM_ARGS(SELECT_DECODE_FINE_PARAMS)) {
    typedef SelSmem<D, MT> SM;
    extern __shared__ __align__(128) unsigned char smem[];
    const int r1 = blockIdx.x, h = blockIdx.y, b = blockIdx.z, R1 = gridDim.x;
    if (sel_dense_step(seqlens, gridDim.z, dense_len)) {     // no selection on a dense step
        pdl_wait();
        return;
    }
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, mt = warp >> 2, kw = warp & 3;
    const int g4 = lane >> 2, c4 = lane & 3;
    const int L = seqlens[b];
    const int n1 = sel_windows(L, SEL_FINE_KS, SEL_FINE_ST);
    const int n2 = exact ? n1 : sel_windows(L, SEL_COARSE_KS, SEL_COARSE_ST);
    const int k0 = r1 * T1 * SEL_TILE - 1;            // the key block 16 T1 r1 shares with the previous range
    if (r1 > 0 && k0 >= n1) {                        // no block of this range has a key (never read)
        pdl_wait();                              // (completes after the coarse grid, as every CTA)
        return;
    }
    const int nt = max(0, min(T1, (n1 - k0 + SEL_TILE - 1) / SEL_TILE));
    const u32 s_base = smem_u32(smem), q_s = s_base + SM::Q, ck_s = s_base + SM::CK;
    float* red = reinterpret_cast<float*>(smem + SM::RED);     // [MT][64] group sums of the tile
    float* bias_s = reinterpret_cast<float*>(smem + SM::BIAS);
    float* sc = reinterpret_cast<float*>(smem + SM::BYTES);     // [64 T1] the range's rounded scores
    sel_ring_start<T, D, MT>(q_s, ck_s, q, ck1, b, h, H, G, N1, n1, k0, nt, tid);
    // the exact coarse normaliser of each head: merge the R2 (max, sum) partials while the tiles load.
    // Warp w takes heads w + 4 MT i (i < 4 covers the 16 MT rows), its lanes ranges lane + 32 k; all
    // loads of a round are issued before use (one memory latency per 32 ranges, not one per range),
    // and the butterfly's fixed order gives every fine CTA of the row the same bias bit for bit.
    pdl_wait();                                  // the coarse partials are complete from here
    {
        constexpr int NW = 4 * MT;
        const float2* pb = part + ((int64)b * H + h) * R2 * G;
        float M[4], Z[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) { M[i] = -INFLLM_INF; Z[i] = 0.f; }
        for (int r0 = 0; r0 < R2; r0 += 32) {
            const int r = r0 + lane;
            float2 x[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int g = warp + NW * i;
                x[i] = g < G && r < R2 && n2 > 0 ? pb[(int64)r * G + g] : make_float2(-INFLLM_INF, 0.f);
            }
#pragma unroll
            for (int i = 0; i < 4; ++i) sel_merge_pair(M[i], Z[i], x[i].x, x[i].y);
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) {
#pragma unroll
            for (int o = 16; o; o >>= 1) {
                const float mo = __shfl_xor_sync(S1_FULL, M[i], o), zo = __shfl_xor_sync(S1_FULL, Z[i], o);
                sel_merge_pair(M[i], Z[i], mo, zo);
            }
            const int g = warp + NW * i;        // padding rows and rows of a sequence without coarse keys:
            if (lane == 0)                       // 2^(x - inf) = 0
                bias_s[g] = g < G && n2 > 0 && M[i] != -INFLLM_INF ? M[i] + log2f(Z[i]) : INFLLM_INF;
        }
    }
    for (int i = tid; i < 64 * T1; i += 128 * MT) sc[i] = -INFLLM_INF;
    __syncthreads();
    float bias[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) bias[r] = bias_s[16 * mt + g4 + 8 * r];
    sel_score_tiles<T, D, MT>(q_s, ck_s, ck1, b, h, H, N1, n1, k0, nt, tid, lane, mt, kw, [&](int i, float (&s)[2][4]) {
        // p = 2^(sl2 s - bias_g), summed over the warp's 16 rows (lanes of equal c4)
        float v[2][2];
#pragma unroll
        for (int t = 0; t < 2; ++t)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                float x = exp2f(fmaf(s[t][e], sl2, -bias[0])) + exp2f(fmaf(s[t][2 + e], sl2, -bias[1]));
                x += __shfl_xor_sync(S1_FULL, x, 4);
                x += __shfl_xor_sync(S1_FULL, x, 8);
                x += __shfl_xor_sync(S1_FULL, x, 16);
                v[t][e] = x;
            }
        if (g4 == 0) {
#pragma unroll
            for (int t = 0; t < 2; ++t)
                *reinterpret_cast<float2*>(red + mt * 64 + 16 * kw + 8 * t + 2 * c4) = make_float2(v[t][0], v[t][1]);
        }
        __syncthreads();   // also: the stage read here is the one tile i + NST lands in
        if (tid < SEL_TILE) {
            float x = 0.f;
#pragma unroll
            for (int m2 = 0; m2 < MT; ++m2) x += red[m2 * 64 + tid];
            const int key = k0 + i * SEL_TILE + tid;
            const float xr = kind == 0 ? x : round_score<unsigned short>(x, kind);
            sc[i * SEL_TILE + tid] = key < 0 || key >= n1 ? -INFLLM_INF : n2 > 0 ? xr : 0.f;
        }
        // red is rewritten only after the next tile's barrier
    });
    __syncthreads();
    // max pooling: block 16 T1 r1 + jl = columns 4 jl .. 4 jl + 4 (the range's last block lacks column 64 T1)
    const int64 row = (int64)b * H + h;
    const int nbr = 16 * T1;
    for (int jl = tid; jl < nbr; jl += 128 * MT) {
        const float* c = sc + 4 * jl;
        float mx = fmaxf(fmaxf(c[0], c[1]), fmaxf(c[2], c[3]));
        if (jl + 1 < nbr) mx = fmaxf(mx, c[4]);
        blk[row * nbr * R1 + (int64)r1 * nbr + jl] = mx;
    }
    if (tid == 0) lead[row * R1 + r1] = sc[0];
    pdl_launch_dependents();
}

// The top-k kernel's fields (select_decode_topk, after the CTA top-k below; here, so that the host
// test of that code, tests/decode/test_select_decode.py, compiles it without params.cuh).
#define SELECT_DECODE_TOPK_PARAMS(F, M) \
    F(const float* __restrict__, blk)           /* [B, H, 16 T1 R1] the fine kernel's block scores */ \
    F(const float* __restrict__, lead)          /* [B, H, R1] its ranges' first key scores */ \
    F(const int* __restrict__, seqlens)         /* [B] */ \
    F(int, B) F(int, H)                         /* sequences, KV heads */ \
    F(int, T1) F(int, R1)                       /* the fine kernel's tiles per range and ranges */ \
    F(int, out_len)                             /* blocks per row */ \
    F(int, olp)                                 /* out_len rounded up to 64 (the row in shared memory) */ \
    F(int, K) F(int, kout)                      /* blocks selected; topk_idx's row length (>= K, padded with -1) */ \
    F(int, init_blocks) F(int, local_blocks) \
    F(int, kind)                                /* score dtype: 0 float32, 1 bf16, 2 fp16 */ \
    F(int, topk_prefix)                         /* 0, or a test hook forcing the whole-row rerun */ \
    F(int, dense_len)                           /* 0, or the length below which a step is dense */ \
    F(int* __restrict__, topk_idx)              /* [H, B, kout] */
struct SelectDecodeTopkParams { PARAM_FIELDS(SELECT_DECODE_TOPK_PARAMS) };

// ------------------------------------------------------------------------------------------------
// The CTA-wide top-K of one block-key row (docs/decode.md, "Stage 1 for decode: the split kernels",
// the top-k). The same selection as select_row (stage1/select_common.cuh): the K largest keys, ties to
// the lower index, ascending, blocks past qb -> -1; but where select_row searches the K-th key with a
// bisection on one warp (16 or 32 sequential counts of the row), every warp here takes a share:
//   1. radix select of the K-th key T, 8-bit digits from the top (2 passes for 16-bit keys, 4 for
//      fp32): a shared-memory histogram of the digit over the keys that match the digits found so
//      far (all threads), then one warp finds the digit at which the count from the top reaches K;
//   2. compaction: each warp counts the keys > T and == T of its contiguous share of the row; after
//      one barrier every warp knows, from the warps before it, how many ties at T are taken before
//      its share (ties go to the lower index) and where its first output lands, and writes its
//      share's selected blocks with select_row's ballot sweep (sweep_words, stage1/select_common.cuh).
// Scratch (SEL_TOPK_SCRATCH ints of shared memory): two histograms of 256 bins (a pass counts into
// one while the search of the pass before zeroes the other: one barrier less per pass), per-warp
// counts, and the search's digit and remaining rank.
// ------------------------------------------------------------------------------------------------

// The K-th largest of the first n keys of `rowk` (n >= K): the digits of T from the top, and `need`,
// the number of keys == T among the K (K minus the keys > T). hist[0 .. 256) holds the first pass's
// counts (`counted`: the caller filled it) or zeros; on return it is zero again, so a second call may
// follow. Every thread calls it past a barrier that follows the last write to rowk and hist.
template <typename KT>
__device__ __forceinline__ unsigned sel_radix_kth(const KT* rowk, int n, int K, bool counted, int* hist, int* res,
                                                  int& need, int tid, int nthreads) {
    constexpr int BITS = Score<KT>::KEY_BITS, PASSES = BITS / 8;
    const int lane = tid & 31;
    unsigned prefix = 0;
    int kk = K;                                       // rank of T among the keys matching the prefix
#pragma unroll
    for (int p = 0; p < PASSES; ++p) {
        const int shift = BITS - 8 * (p + 1);
        int* hp = hist + (p & 1) * 256;
        if (p > 0 || !counted) {
#pragma unroll 4
            for (int j = tid; j < n; j += nthreads) {
                const unsigned k = rowk[j];
                if (p == 0 || (k >> (shift + 8)) == (prefix >> (shift + 8))) atomicAdd(hp + ((k >> shift) & 255), 1);
            }
            __syncthreads();
        }
        if (tid < 32) {
            // lane l holds bins 255 - 8 l - i (i < 8): digits descend along the lanes
            const int4 lo = *reinterpret_cast<const int4*>(hp + 248 - 8 * lane);
            const int4 hi = *reinterpret_cast<const int4*>(hp + 252 - 8 * lane);
            const int c[8] = {hi.w, hi.z, hi.y, hi.x, lo.w, lo.z, lo.y, lo.x};
            int s = 0;
#pragma unroll
            for (int i = 0; i < 8; ++i) s += c[i];
            int incl = s;                             // keys of this lane's bins and all higher bins
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const int t = __shfl_up_sync(S1_FULL, incl, o);
                if (lane >= o) incl += t;
            }
            const unsigned hit = __ballot_sync(S1_FULL, incl >= kk);
            // the other histogram: the next pass counts into it (the pass before searched it already)
            int4* other = reinterpret_cast<int4*>(hist + ((p + 1) & 1) * 256 + 8 * lane);
            other[0] = make_int4(0, 0, 0, 0);
            other[1] = make_int4(0, 0, 0, 0);
            if (lane == __ffs(hit) - 1) {
                int excl = incl - s, d = -1;
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    if (d < 0) {
                        if (excl + c[i] >= kk) d = 255 - 8 * lane - i;
                        else excl += c[i];
                    }
                }
                res[0] = d;
                res[1] = kk - excl;
            }
        }
        __syncthreads();
        prefix |= (unsigned)res[0] << shift;
        kk = res[1];
    }
    need = kk;
    return prefix;
}

// Writes the K selected blocks of the first n keys (n a multiple of 64) ascending to out, given their
// K-th key T and the ties at T to take (`need`, lowest index first); blocks past qb as -1. wv: 64 ints.
template <typename KT>
__device__ __forceinline__ void sel_compact(const KT* rowk, int n, unsigned T, int need, int qb, int* wv, int tid,
                                            int nthreads, int* __restrict__ out) {
    constexpr int KPW = 4 / sizeof(KT);               // keys per 32-bit word (index order: low half first)
    const unsigned* words = reinterpret_cast<const unsigned*>(rowk);
    const int lane = tid & 31, warp = tid >> 5, nwarps = nthreads >> 5;
    const int ngroups = n / (32 * KPW);               // groups of 32 words, one word per lane
    const int gpw = (ngroups + nwarps - 1) / nwarps;
    const int g0 = min(warp * gpw, ngroups), g1 = min(g0 + gpw, ngroups);
    int gt = 0, eq = 0;
    for (int g = g0; g < g1; ++g) {
        const unsigned w = words[g * 32 + lane];
#pragma unroll
        for (int x = 0; x < KPW; ++x) {
            const unsigned k = KPW == 2 ? (x ? w >> 16 : w & 0xffffu) : w;
            gt += k > T;
            eq += k == T;
        }
    }
    gt = (int)__reduce_add_sync(S1_FULL, (unsigned)gt);
    eq = (int)__reduce_add_sync(S1_FULL, (unsigned)eq);
    if (lane == 0) {
        wv[warp] = gt;
        wv[32 + warp] = eq;
    }
    __syncthreads();
    const int gv = lane < nwarps ? wv[lane] : 0, ev = lane < nwarps ? wv[32 + lane] : 0;
    const int gt_off = (int)__reduce_add_sync(S1_FULL, lane < warp ? (unsigned)gv : 0u);   // keys > T before
    const int eq_off = (int)__reduce_add_sync(S1_FULL, lane < warp ? (unsigned)ev : 0u);   // ties before
    const int end = gt_off + gt + min(eq_off + eq, need);   // output position after this warp's share
    sweep_words<KT, false>(words, g0 * 32, g1 * 32, end, T, need, lane, eq_off, gt_off + min(eq_off, need), qb, out,
                           nullptr);
}

// One (KV head, sequence) row: the block keys in shared memory (`rowk`, olp keys), completed, then the
// top-K by the whole CTA. blk and lead (the fine kernel's, read once) are loaded through L2 (__ldcg).
// scratch: SEL_TOPK_SCRATCH ints of shared memory. Every thread of the CTA calls it (barriers inside).
template <typename KT>
__device__ __forceinline__ void sel_topk_row(KT* rowk, int* scratch, const float* __restrict__ blk,
                                             const float* __restrict__ lead, int L, int b, int h, int B, int H, int T1,
                                             int R1, int out_len, int olp, int K, int kout, int init_blocks,
                                             int local_blocks, int kind, int topk_prefix, int* __restrict__ topk_idx,
                                             int tid, int nthreads) {
    constexpr int KB = Score<KT>::KEY_BITS;
    constexpr int UNR = 8;                            // blocks per thread in flight (L2 latency): 2048 blocks
                                                      // on 256 threads in one round
    if (K <= 0) return;
    const int n1 = sel_windows(L, SEL_FINE_KS, SEL_FINE_ST);
    const int nbv = n1 > 0 ? n1 / 4 + 1 : 0;          // blocks j with a fine key (4 j - 1 < n1)
    const int qb = max(L - 1, 0) / 64;                // the query's own block (cache_lens = L - 1)
    const int nbr = 16 * T1;
    const int64 row = (int64)b * H + h;
    const float* bp = blk + row * nbr * R1;
    const float* lp = lead + row * R1;
    int* out = topk_idx + ((int64)h * B + b) * kout;
    for (int j = K + tid; j < kout; j += nthreads) out[j] = -1;      // the row's slots past K
    // select_row's search prefix: blocks after the query's own one are -inf or padding, so the top-K
    // lies in the prefix unless a key after it beats the prefix's K-th (then the whole row is searched)
    const int jpre = ((topk_prefix > 0 ? max(topk_prefix, K) - 1 : max(qb, K - 1)) / 64 + 1) * 64;
    const int npk = min(jpre, olp);
    int* hist = scratch;                              // [2][256]
    int* wv = scratch + 512;                          // [64] per-warp values
    int* res = scratch + 576;                         // the search's digit and remaining rank
    for (int i = tid; i < 512; i += nthreads) hist[i] = 0;
    __syncthreads();
    const KT key_inf = score_key<KT>(INFLLM_INF, kind);
    unsigned tmax = 0;                                // the largest key after the prefix
    // complete the row, counting the first digit of the prefix's keys
    for (int j0 = tid; j0 < olp; j0 += UNR * nthreads) {
        float x[UNR];
#pragma unroll
        for (int u = 0; u < UNR; ++u) {
            const int j = j0 + u * nthreads;
            x[u] = -INFLLM_INF;
            if (j < out_len && j < nbv) {
                x[u] = __ldcg(bp + j);
                const int rn = (j + 1) / nbr;         // the range whose first key closes block j
                if ((j + 1) % nbr == 0 && rn < R1 && rn * nbr * 4 - 1 < n1) x[u] = fmaxf(x[u], __ldcg(lp + rn));
            }
        }
#pragma unroll
        for (int u = 0; u < UNR; ++u) {
            const int j = j0 + u * nthreads;
            if (j >= olp) break;
            KT k = 0;                                 // padding: below every real key, never selected
            if (j < out_len) {
                k = score_key<KT>(x[u], kind);
                if (j < init_blocks || (j <= qb && j >= qb - local_blocks)) k = key_inf;
            }
            rowk[j] = k;
            if (j < npk) atomicAdd(hist + ((unsigned)k >> (KB - 8)), 1);
            else tmax = max(tmax, (unsigned)k);
        }
    }
    const int lane = tid & 31, warp = tid >> 5;
    tmax = __reduce_max_sync(S1_FULL, tmax);
    if (lane == 0) wv[warp] = (int)tmax;
    __syncthreads();
    const unsigned tail_max = __reduce_max_sync(S1_FULL, lane < (nthreads >> 5) ? (unsigned)wv[lane] : 0u);
    int need, n = npk;
    unsigned T = sel_radix_kth<KT>(rowk, npk, K, true, hist, res, need, tid, nthreads);
    if (npk < olp && T < tail_max) {                  // a key after the prefix beats its K-th: whole row
        n = olp;
        T = sel_radix_kth<KT>(rowk, olp, K, false, hist, res, need, tid, nthreads);
    }
    sel_compact<KT>(rowk, n, T, need, qb, wv, tid, nthreads, out);
}

template <typename KT>
__global__ void __launch_bounds__(512)
select_decode_topk(PARAM_ARGS(SELECT_DECODE_TOPK_PARAMS)) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int h = blockIdx.x / B, b = blockIdx.x % B;
    if (sel_dense_step(seqlens, B, dense_len)) {      // every block up to the query's: dense attention
        const int nb = (seqlens[b] + 63) / 64;
        int* out = topk_idx + ((int64)h * B + b) * kout;
        for (int j = threadIdx.x; j < kout; j += blockDim.x) out[j] = j < nb ? j : -1;
        return;
    }
    pdl_wait();                                  // blk and lead of the fine kernel
    sel_topk_row<KT>(reinterpret_cast<KT*>(smem), reinterpret_cast<int*>(smem + (size_t)olp * sizeof(KT)), blk, lead,
                     seqlens[b], b, h, B, H, T1, R1, out_len, olp, K, kout, init_blocks, local_blocks, kind,
                     topk_prefix, topk_idx, threadIdx.x, blockDim.x);
}
