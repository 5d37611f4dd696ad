// decode/sparse_decode.cu: split-KV (flash-decoding) attention of one query token per sequence over
// the selected 64-key blocks of its KV cache (or over every block), with optional attention weights.
// Design: docs/decode.md.
//
// Launch contract (mirrored by infllm_cupy/decode/sparse_decode.py, whose SPLIT_PARAMS, MERGE_PARAMS and
// WEIGHTS_PARAMS declare each kernel's parameter struct field by field; the loader checks the layouts at
// compile time). Every kernel takes the fields of its struct as its arguments:
//
// sparse_decode_split<T, D, MT>(the fields of SparseDecodeSplitParams<T>)   T in {__half, __nv_bfloat16},
//                                                                            D in {64, 128}, MT in {1, 2, 4}
//   grid   (S, H, B)    S = num_splits; one CTA per (split, KV head, sequence) computes all G query
//                       heads of the KV head (G <= 16 * MT rows, padded with zero rows to 16 * MT)
//   block  (128 * MT)   4 * MT warps: warp w takes rows 16 * (w / 4) .. +15 of the group and keys
//                       16 * (w % 4) .. +15 of every 64-key block
//   smem   dynamic, DecodePlan.split_smem_bytes(D, sparse, K) of the launcher (SplitSmem below + lists)
//   q      [B, HQ, D] T, HQ = H * G                    seqlens int32 [B], every L_b <= the cache's width
//   k, v   contiguous: [B, L_max, H, D] T  (block_table = nullptr, seq_rows = L_max)
//          paged:      [num_pages, page_size, H, D] T  with block_table int32 [B, max_pages]; page_size a
//                      multiple of 64 and every page of a position < L_b valid (the launcher's caller
//                      checks the table once, DecodeCache does)
//   topk   int32 [H, B, K] block indices local to the sequence (any order, -1 padding; negative,
//          >= cdiv(L_b, 64) and repeated entries ignored) or nullptr = every block (dense)
//   split s takes entries [s * per_split, (s + 1) * per_split) of its topk row (dense: those blocks)
//   o_part  float [B, HQ, S, D]   the split's normalised output (0 for a split with no valid key)
//   lse_part float [B, HQ, S]     its log2-sum-exp of the scaled logits (-inf for no valid key)
//   out, lse_out, lse2_out        nullptr, or (S = 1 only) the merge's outputs, written here instead of
//                                 o_part and lse_part: one split needs no merge (docs/decode.md, 4.)
//   prel    __half [B, HQ, W] or nullptr: the relative probability 2^(s - m) of every key the split
//           reads (rows g < G, positions < L_b; s its log2-domain scaled logit), where m is the running
//           max of the warp's row when the key's 16-key group was read (so prel <= 1); 8-byte aligned
//           rows (W % 4 == 0) get 8-byte stores that fill 32-byte sectors
//   pmax    float [B, H, cdiv(W, 16), GP], GP = G rounded up to 4: that m, per (16-key group read, row
//           g < GP; rows >= G hold the zero rows' m): a group's 4 heads are one 16-byte load
//
// sparse_decode_split<T, D, MT, fp8_e4m3>(the same fields): the FP8 KV cache (docs/decode.md §16,
//   infllm_cupy/decode/fp8.py): k, v hold e4m3 bytes in the same layouts; every full 64-token page
//   (block j with 64 j + 64 <= L_b) is read from them with its scales, dequantized as fp8.py reads it
//   ((e4m3 as fp32) * scale, rounded once to T) into the 16-bit tile the rest of the kernel reads; the
//   open page (the tail block, positions 64 (L_b / 64) .. L_b - 1) from the 16-bit buffers:
//   k_scale  float [rows, cdiv(R, 64), H, D]   R = seq_rows (contiguous) or page_size (paged): the
//            per-channel scales of page j of storage row r at [r, j]
//   v_scale  float [rows, R, H]                per token and KV head
//   k_recent T [B, 128, H, D]   position t at slot t % 128;   v_open  T [B, 64, H, D]   slot t % 64
//   smem     DecodePlan.split_smem_bytes(D, sparse, K, kv8=True): the 16-bit layout plus NSTAGE e4m3
//            staging stages (Fp8Stage<D>) before the lists
//   16-bit instances take these fields as nullptr and never read them.
//
// sparse_decode_merge<T, D>(the fields of SparseDecodeMergeParams<T>)
//   grid (B * HQ)  block (P * D / 4) for a power of two P, 32 .. 1024 threads (DecodePlan.merge_threads)
//   dynamic shared memory 16 * blockDim bytes (the groups' float4 sums)
//   may be launched as a programmatic dependent of the split kernel (it waits before reading)
//   out [B, HQ, D] T = sum_s 2^(lse_s - lse) o_s;  lse_out float [B, HQ] natural log (+inf when
//   no split saw a key, then out = 0);  lse2_out float [B * HQ] the same in log2 (weights pass)
//
// sparse_decode_weights(the fields of SparseDecodeWeightsParams)
//   grid (cdiv(W, WCHUNK), H, B)  block (WCHUNK / 4 = 256)  static shared memory; may be launched as a
//   programmatic dependent of the merge (it waits before reading)
//   out [B, HQ, W] (per_kv_head = 0) or [B, H, W] (per_kv_head = 1) float: prel * 2^(pmax - lse2) at
//   the selected positions < L_b, 0 elsewhere (prel, pmax: the split kernel's; no aliasing with out)
//
// Why this shape (docs/decode.md): decode reads each K/V byte once, so the kernel is bound by DRAM
// bandwidth; the G query heads of a KV head share every K/V tile in shared memory, the tensor cores
// (mma.sync m16n8k16, group rows padded to 16) keep the arithmetic far below the load time, and
// splits over the block list put enough CTAs on the machine at batch 1.
#include "common/types.cuh"
#include "common/mma_sm80.cuh"
#include "common/params.cuh"
#include "common/pdl.cuh"

#define BLK 64          // keys per selection block
#define WCHUNK 1024     // positions per CTA of the weights pass
#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f

template <int D>
struct KVLayout {
    static constexpr int ROWB = D * 2;                      // bytes of one 16-bit row
    static constexpr int TILE = BLK * ROWB;                 // one K or V block
    static constexpr int STAGE = 2 * TILE;                  // K then V
    // K/V ring depth: block i + 1 loads while block i is computed. A first probe with 3 stages at
    // D = 128 was no faster (docs/decode.md, section 3) and costs residency (two CTAs per SM, not three)
    static constexpr int NSTAGE = 2;
};

// The FP8 cache's storage element (k, v of the FP8 instances): one e4m3 byte (sign, 4 exponent bits
// with bias 7, 3 mantissa bits; no infinities), converted by bit manipulation (e4m3_dequant4 below):
// sm_80 has no e4m3 conversion instruction.
struct fp8_e4m3 { unsigned char bits; };

// One staging stage of an FP8 block (the cp.async target; converted into the 16-bit K/V stage):
// e4m3 K [64][D], e4m3 V [64][D] (rows of D bytes, unswizzled), K's D channel scales, V's 64 row scales.
template <int D>
struct Fp8Stage {
    static constexpr int K8 = 0, V8 = BLK * D, KS = 2 * BLK * D, VS = KS + 4 * D;
    static constexpr int BYTES = VS + 4 * BLK;
};

// Dynamic shared memory: Q [16 MT rows], 2 K/V stages, per-warp row stats, warp counts, (FP8) the
// staging stages, block list.
template <int D, int MT, bool KV8 = false>
struct SplitSmem {
    static constexpr int Q = 0;
    static constexpr int KV = Q + 16 * MT * KVLayout<D>::ROWB;
    static constexpr int STATS = KV + KVLayout<D>::NSTAGE * KVLayout<D>::STAGE;          // m, l: float [MT][4][16] each
    static constexpr int WCNT = STATS + 2 * MT * 4 * 16 * 4;           // int [4 MT]
    static constexpr int STG = WCNT + 4 * MT * 4;                      // FP8: NSTAGE Fp8Stage<D>
    static constexpr int LIST = STG + (KV8 ? KVLayout<D>::NSTAGE * Fp8Stage<D>::BYTES : 0);   // int [per_split], then int [K] (sparse)
};

// 16-byte cp.async forms of the split kernel's K/V loads (docs/decode.md, 3. The split kernel): a full
// block needs no src-size operand.
__device__ __forceinline__ void cp_async_16_full(u32 dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" :: "r"(dst), "l"(src));
}
// p + bytes, opaque to the scheduler: the unrolled passes of a block load then step one pointer per
// tensor instead of computing every pass's 64-bit address up front (which cost registers and spills)
__device__ __forceinline__ const void* step_ptr(const void* p, long long bytes) {
    asm volatile("add.s64 %0, %0, %1;\n" : "+l"(p) : "l"(bytes));
    return p;
}

// 16-byte shared store of two 8-byte halves at a shared-space address
__device__ __forceinline__ void st_shared_16(u32 addr, uint2 lo, uint2 hi) {
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" :: "r"(addr), "r"(lo.x), "r"(lo.y), "r"(hi.x), "r"(hi.y));
}

// 4-byte cp.async (through L1: the .cg form takes 16 bytes only), for V's per-token scales
__device__ __forceinline__ void cp_async_4(u32 dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" :: "r"(dst), "l"(src));
}

// Four e4m3 values (the bytes of w, lowest first) times their fp32 scales s, rounded once to T: what
// infllm_cupy/decode/fp8.py's reads compute ((e4m3 as fp32) * scale, then .to(T)). Each byte moves into
// the fp16 bit pattern of value * 2^-8 (sign to bit 15, exponent and mantissa bits 7 places up: the
// exponent bias 15 of fp16 against 7, subnormals included, and fp16 holds every e4m3 value exactly);
// s holds scale * 256 (exact: a power of two), so the fp32 product is the reference's product exactly.
// The byte 0x7f (e4m3's NaN) reads 480 * scale, not NaN: a stored NaN comes only from a group whose
// amax, hence scale, is NaN, and reads NaN either way.
template <typename T>
__device__ __forceinline__ uint2 e4m3_dequant4(u32 w, float4 s) {
    const u32 x01 = __byte_perm(w, 0u, 0x1404), x23 = __byte_perm(w, 0u, 0x3424);   // bytes at 8..15, 24..31
    const u32 h01 = (x01 & 0x80008000u) | ((x01 >> 1) & 0x3f803f80u);
    const u32 h23 = (x23 & 0x80008000u) | ((x23 >> 1) & 0x3f803f80u);
    const float2 f01 = unpack2<__half>(h01), f23 = unpack2<__half>(h23);
    return make_uint2(pack2<T>(__fmul_rn(f01.x, s.x), __fmul_rn(f01.y, s.y)),
                      pack2<T>(__fmul_rn(f23.x, s.z), __fmul_rn(f23.y, s.w)));
}

// Programmatic dependent launch (common/pdl.cuh): the merge and the weights pass may be launched as
// dependents of the kernel before them, so that their launch overlaps that kernel's tail
// (DecodePlan.pdl); they wait before reading its output (the merge's wait covers the split kernel for
// the weights pass too: the merge completes after it). The split kernel and the merge trigger early,
// once every CTA is resident or done, so the early dependents cannot keep one of them from running.

// The epilogue's fp32 sum buffers over the (free) K/V stages: NBUF buffers of 16 MT rows of OROW
// floats, then the 16 MT reciprocal row sums. Rows padded by 8 floats: the float2 stores of a fragment
// row (8 rows x 4 lanes x 8 bytes per half-warp) then hit 32 distinct banks.
template <int D, int MT>
struct EpilogueSmem {
    static constexpr int OROW = D + 8;
    static constexpr int BUF = 16 * MT * OROW * 4;                     // bytes of one buffer
    static constexpr int AVAIL = KVLayout<D>::NSTAGE * KVLayout<D>::STAGE - 16 * MT * 4;
    // one buffer per key-quarter warp where they fit (one round), else 2 or 1 (2 or 4 rounds)
    static constexpr int NBUF = 4 * BUF <= AVAIL ? 4 : 2 * BUF <= AVAIL ? 2 : 1;
    static constexpr int ROWL = NBUF * BUF;                            // float [16 MT]: 1 / row sum
};

// Fields more than one kernel has, in the same order: the topk rows and the shape they index, and the
// merge's outputs (which the split writes itself when S = 1).
#define SPARSE_DECODE_TOPK_FIELDS(F) \
    F(const int* __restrict__, topk)            /* [H, B, K] block indices, or nullptr (dense: every block) */ \
    F(int, K) F(int, B) F(int, H) F(int, G)     /* topk entries per row, sequences, KV heads, query heads per KV head */
#define SPARSE_DECODE_MERGED_FIELDS(F) \
    F(T* __restrict__, out)                     /* [B, HQ, D] */ \
    F(float* __restrict__, lse_out)             /* [B, HQ] natural log */ \
    F(float* __restrict__, lse2_out)            /* [B * HQ] log2 */

#define SPARSE_DECODE_SPLIT_PARAMS(F, M) \
    F(const T* __restrict__, q)                 /* [B, HQ, D] */ \
    F(const KT* __restrict__, k)                /* [B, L_max, H, D], or [num_pages, page_size, H, D] (paged) */ \
    F(const KT* __restrict__, v)                /* as k */ \
    F(const int* __restrict__, seqlens)         /* [B] */ \
    F(const int* __restrict__, block_table)     /* [B, max_pages] (paged), or nullptr (contiguous) */ \
    F(int, max_pages) F(int, page_size)         /* the table's width and the page size (paged) */ \
    F(int, seq_rows)                            /* L_max (contiguous) */ \
    SPARSE_DECODE_TOPK_FIELDS(F) \
    F(int, per_split)                           /* topk entries (dense: blocks) per split */ \
    F(float, scale_log2)                        /* softmax_scale * log2(e) */ \
    F(float* __restrict__, o_part)              /* [B, HQ, S, D], or nullptr when out is given */ \
    F(float* __restrict__, lse_part)            /* [B, HQ, S], or nullptr when out is given */ \
    F(__half* __restrict__, prel)               /* [B, HQ, W], or nullptr (no weights) */ \
    F(float* __restrict__, pmax)                /* [B, H, cdiv(W, 16), GP], or nullptr (no weights) */ \
    F(int, W)                                   /* the cache's width (prel's rows) */ \
    SPARSE_DECODE_MERGED_FIELDS(F)              /* S = 1: written here instead of o_part, lse_part; or nullptr */ \
    F(const float* __restrict__, k_scale)       /* FP8: [rows, cdiv(R, 64), H, D]; nullptr (16-bit) */ \
    F(const float* __restrict__, v_scale)       /* FP8: [rows, R, H] */ \
    F(const T* __restrict__, k_recent)          /* FP8: [B, 128, H, D] the last 128 keys (the open page's) */ \
    F(const T* __restrict__, v_open)            /* FP8: [B, 64, H, D] the open page's values */
// KT: the K/V storage element, T (the 16-bit cache) or fp8_e4m3 (the FP8 cache)
template <typename T, typename KT = T>
struct SparseDecodeSplitParams { PARAM_FIELDS(SPARSE_DECODE_SPLIT_PARAMS) };

// At most 128 registers per thread (4 / MT CTAs of 128 MT threads per SM): enough for the fp32 output
// tile of D = 128, and without the bound ptxas picked 80 at D = 64 on sm_80 and spilled.
// KT = fp8_e4m3: the FP8 cache (the launch contract above); the 16-bit instances compile to the code
// they had before it (every FP8 step is under `if constexpr (KV8)`). The FP8 instances' staging stages
// leave room for two CTAs per SM at MT <= 2 and one at MT = 4 (D = 128; Fp8Stage), so their bound is
// the registers of that residency: 255 at MT = 1, 128 at MT = 2 and 4.
template <typename T, int D, int MT, typename KT = T>
__global__ void __launch_bounds__(128 * MT, sizeof(KT) == 1 ? (MT == 4 ? 1 : 2) : 4 / MT)
sparse_decode_split(PARAM_ARGS(SPARSE_DECODE_SPLIT_PARAMS)) {
    constexpr bool KV8 = sizeof(KT) == 1;
    constexpr int NT = 128 * MT, NW = 4 * MT, ROWB = KVLayout<D>::ROWB, CH = D / 8;
    typedef SplitSmem<D, MT, KV8> SM;
    extern __shared__ __align__(128) unsigned char smem[];
    float* m_s = reinterpret_cast<float*>(smem + SM::STATS);
    float* l_s = m_s + MT * 64;
    int* wcnt = reinterpret_cast<int*>(smem + SM::WCNT);
    int* list = reinterpret_cast<int*>(smem + SM::LIST);

    const int split = blockIdx.x, h = blockIdx.y, b = blockIdx.z, S = gridDim.x;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int mt = warp >> 2, kw = warp & 3;
    const int HQ = H * G;
    const int L = seqlens[b];
    const int nb = (L + BLK - 1) / BLK;

    const u32 s_base = smem_u32(smem);
    const u32 q_s = s_base + SM::Q, kv_s = s_base + SM::KV;
    // Q rows of the group (rows >= G read as zeros), in flight while the block list is built
    for (int idx = tid; idx < 16 * MT * CH; idx += NT) {
        const int r = idx / CH, ch = idx % CH;
        const bool ok = r < G;
        const T* src = ok ? q + ((int64)b * HQ + (int64)h * G + r) * D + ch * 8 : q;
        cp_async_16(q_s + swz<D>(r, ch) * 16, src, ok ? 16 : 0);
    }

    // ---- the blocks this split reads, in entry order (dense: a range; sparse: valid first occurrences)
    const int e0 = split * per_split;
    int n;
    if (topk == nullptr) {
        n = max(0, min(e0 + per_split, nb) - e0);
    } else {
        const int* row = topk + ((int64)h * B + b) * K;
        const int e1 = min(e0 + per_split, K);
        int* row_s = list + per_split;                  // entries [0, e1) of the row: one coalesced read
        for (int i = tid; i < e1; i += NT) row_s[i] = row[i];
        __syncthreads();
        // a row whose valid entries come first and ascend strictly (what stage 1 writes) repeats no
        // block: then the quadratic first-occurrence scan below is skipped
        int ascending = 1;
        for (int i = tid; i + 1 < e1; i += NT) {
            const int a = row_s[i], c = row_s[i + 1];
            ascending &= c < 0 || (a >= 0 && a < c);
        }
        const bool no_repeats = __syncthreads_and(ascending) != 0;
        int base = 0;
        for (int c0 = e0; c0 < e1; c0 += NT) {
            const int i = c0 + tid;
            int x = -1;
            bool keep = false;
            if (i < e1) {
                x = row_s[i];
                bool dup = false;
                if (!no_repeats)
#pragma unroll 4
                    for (int j = 0; j < i; ++j) dup |= row_s[j] == x;   // count a repeated block once
                keep = x >= 0 && x < nb && !dup;
            }
            const unsigned bal = __ballot_sync(0xffffffffu, keep);
            if (lane == 0) wcnt[warp] = __popc(bal);
            __syncthreads();
            int off = base;
            for (int w = 0; w < warp; ++w) off += wcnt[w];
            if (keep) list[off + __popc(bal & ((1u << lane) - 1))] = x;
            int tot = 0;
            for (int w = 0; w < NW; ++w) tot += wcnt[w];
            base += tot;
            __syncthreads();
        }
        n = base;
    }
    auto block_of = [&](int i) { return topk == nullptr ? e0 + i : list[i]; };

    // ---- K/V block loads. Chunk idx = tid + NT p of a block is row tid / CH + RPI p, 16-byte chunk
    // tid % CH: RPI = NT / CH is a multiple of 8, so the swizzle (chunk ^ row % 8) and the offsets are
    // the same in every pass p and hoisted here; per pass, a full block costs two cp.async and the
    // pointer steps (docs/decode.md, 3. The split kernel).
    constexpr int RPI = NT / CH, NPASS = BLK / RPI;
    static_assert(RPI % 8 == 0 && BLK % RPI == 0, "rows per load pass");
    const int64 tok_stride = (int64)H * D;     // elements between consecutive positions of one head
    const int ld_r = tid / CH;
    const u32 ld_dst = swz<D>(ld_r, tid % CH) * 16;
    const int ld_src = (ld_r * H + h) * D + (tid % CH) * 8;    // 32-bit: within 64 rows of one block
    const int pass_stride = RPI * H * D;
    // a 64-key block lies in one page (page_size % 64 == 0): block j is block j % bpp of page j / bpp,
    // a shift for the usual power-of-two page sizes (a FastDiv here cost registers and spills on sm_80)
    const int bpp = block_table != nullptr ? page_size / BLK : 1;
    const int bpp_log2 = (bpp & (bpp - 1)) == 0 ? __ffs(bpp) - 1 : -1;
    // FP8 staging loads: 16-byte chunk ld8_c of row ld8_r + RPI8 p (rows of D e4m3 bytes)
    constexpr int CH8 = D / 16, RPI8 = NT / CH8, NPASS8 = RPI8 >= BLK ? 1 : BLK / RPI8;
    const int ld8_r = tid / CH8, ld8_c = tid % CH8;
    auto load_block = [&](int j, int st) {
        int64 row0, srow;                      // srow (FP8): k_scale's row of block j's page
        if (block_table != nullptr) {
            const int pg = bpp_log2 >= 0 ? j >> bpp_log2 : j / bpp;
            const int p = block_table[(int64)b * max_pages + pg];
            row0 = (int64)p * page_size + (j - pg * bpp) * BLK;
            srow = (int64)p * bpp + (j - pg * bpp);
        } else {
            row0 = (int64)b * seq_rows + (int64)j * BLK;
            srow = (int64)b * ((seq_rows + BLK - 1) / BLK) + j;
        }
        if constexpr (KV8) {
            if (L - j * BLK >= BLK) {          // a stored page: e4m3 bytes and scales into the staging stage
                const u32 stg = s_base + SM::STG + st * Fp8Stage<D>::BYTES;
                const unsigned char* k8 = reinterpret_cast<const unsigned char*>(k) + row0 * tok_stride;
                const unsigned char* v8 = reinterpret_cast<const unsigned char*>(v) + row0 * tok_stride;
#pragma unroll
                for (int p = 0; p < NPASS8; ++p) {
                    const int r = ld8_r + RPI8 * p;
                    if (RPI8 <= BLK || r < BLK) {
                        const int src = (r * H + h) * D + ld8_c * 16;
                        cp_async_16_full(stg + Fp8Stage<D>::K8 + r * D + ld8_c * 16, k8 + src);
                        cp_async_16_full(stg + Fp8Stage<D>::V8 + r * D + ld8_c * 16, v8 + src);
                    }
                }
                // page j's channel scales, then V's scales of its 64 tokens
                if (tid < D / 4) cp_async_16_full(stg + Fp8Stage<D>::KS + 16 * tid, k_scale + (srow * H + h) * D + 4 * tid);
                if (tid < BLK) cp_async_4(stg + Fp8Stage<D>::VS + 4 * tid, v_scale + (row0 + tid) * H + h);
                return;
            }
        }
        // the open page of an FP8 cache comes from its 16-bit buffers, as a 16-bit cache's tail block
        const int64 off = KV8 ? ((int64)b * 2 * BLK + (j & 1) * BLK) * tok_stride + ld_src : row0 * tok_stride + ld_src;
        const int64 voff = KV8 ? (int64)b * BLK * tok_stride + ld_src : off;
        const T* kbase = KV8 ? k_recent : reinterpret_cast<const T*>(k);
        const T* vbase = KV8 ? v_open : reinterpret_cast<const T*>(v);
        const void* kp = kbase + off;
        const void* vp = vbase + voff;
        const long long step = (long long)pass_stride * sizeof(T);
        const u32 ks = kv_s + st * KVLayout<D>::STAGE + ld_dst, vs = ks + KVLayout<D>::TILE;
        const int avail = L - j * BLK;         // rows of the block below L (CTA-uniform)
        if (!KV8 && avail >= BLK) {
#pragma unroll
            for (int p = 0; p < NPASS; ++p) {
                if (p > 0) kp = step_ptr(kp, step), vp = step_ptr(vp, step);
                cp_async_16_full(ks + p * RPI * ROWB, kp);
                cp_async_16_full(vs + p * RPI * ROWB, vp);
            }
        } else {                               // the tail of the last block reads zeros
#pragma unroll
            for (int p = 0; p < NPASS; ++p) {
                const bool ok = ld_r + RPI * p < avail;
                if (p > 0) kp = step_ptr(kp, step), vp = step_ptr(vp, step);
                cp_async_16(ks + p * RPI * ROWB, ok ? kp : kbase, ok ? 16 : 0);
                cp_async_16(vs + p * RPI * ROWB, ok ? vp : vbase, ok ? 16 : 0);
            }
        }
    };
    constexpr int NS = KVLayout<D>::NSTAGE;
#pragma unroll
    for (int st = 0; st < NS - 1; ++st) {               // group st: block st (group 0 also holds Q)
        if (st < n) load_block(block_of(st), st);
        cp_async_commit();
    }

    u32 a_off[4], b_off[4], t_off[4];
    ldsm_offsets(lane, 16 * mt, ROWB, a_off, b_off, t_off);
    const int g4 = lane >> 2, c4 = lane & 3;

    float o[D / 8][4];
#pragma unroll
    for (int i = 0; i < D / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
    float m[2] = {-INFLLM_INF, -INFLLM_INF}, l[2] = {0.f, 0.f};

    for (int i = 0; i < n; ++i) {
        const int j = block_of(i);
        if (i + NS - 1 < n) load_block(block_of(i + NS - 1), (i + NS - 1) % NS);
        cp_async_commit();
        cp_async_wait<NS - 1>();                           // block i has landed
        __syncthreads();
        if constexpr (KV8) {
            if (j * BLK + BLK <= L) {                      // CTA-uniform: a stored page, dequantized here
                const unsigned char* stg = smem + SM::STG + (i % NS) * Fp8Stage<D>::BYTES;
                const u32 tile = kv_s + (i % NS) * KVLayout<D>::STAGE;
                const float* kscale = reinterpret_cast<const float*>(stg + Fp8Stage<D>::KS) + ld8_c * 16;
                const float* vscale = reinterpret_cast<const float*>(stg + Fp8Stage<D>::VS);
                // one pass at a time (unrolled, the passes' loads were hoisted together and spilled at D = 128)
#pragma unroll 1
                for (int p = 0; p < NPASS8; ++p) {
                    const int r = ld8_r + RPI8 * p;
                    if (RPI8 <= BLK || r < BLK) {
                        // elements 16 c .. 16 c + 15 of row r: 16-byte chunks 2 c and 2 c + 1 of the tile
                        const uint4 k8w = *reinterpret_cast<const uint4*>(stg + Fp8Stage<D>::K8 + r * D + ld8_c * 16);
                        const uint4 v8w = *reinterpret_cast<const uint4*>(stg + Fp8Stage<D>::V8 + r * D + ld8_c * 16);
                        const u32 kc0 = tile + swz<D>(r, 2 * ld8_c) * 16, kc1 = tile + swz<D>(r, 2 * ld8_c + 1) * 16;
                        const float vsc = vscale[r] * 256.f;
                        const float4 vs4 = make_float4(vsc, vsc, vsc, vsc);
                        st_shared_16(kc0 + KVLayout<D>::TILE, e4m3_dequant4<T>(v8w.x, vs4), e4m3_dequant4<T>(v8w.y, vs4));
                        st_shared_16(kc1 + KVLayout<D>::TILE, e4m3_dequant4<T>(v8w.z, vs4), e4m3_dequant4<T>(v8w.w, vs4));
                        auto ksc = [&](int e) {           // K's scales of elements 4 e .. 4 e + 3, times 256
                            const float4 x = *reinterpret_cast<const float4*>(kscale + 4 * e);
                            return make_float4(x.x * 256.f, x.y * 256.f, x.z * 256.f, x.w * 256.f);
                        };
                        st_shared_16(kc0, e4m3_dequant4<T>(k8w.x, ksc(0)), e4m3_dequant4<T>(k8w.y, ksc(1)));
                        st_shared_16(kc1, e4m3_dequant4<T>(k8w.z, ksc(2)), e4m3_dequant4<T>(k8w.w, ksc(3)));
                    }
                }
                __syncthreads();
            }
        }
        const u32 kt = kv_s + (i % NS) * KVLayout<D>::STAGE + 16 * kw * ROWB;
        const u32 vt = kt + KVLayout<D>::TILE;

        float s[2][4];
        qk_tile_16x16<T, D>(s, q_s, kt, a_off, b_off);
#pragma unroll
        for (int t = 0; t < 2; ++t)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[t][e] *= scale_log2;
        const bool tail = j * BLK + BLK > L;               // CTA-uniform: only the last block is masked
        const int key0 = j * BLK + 16 * kw;
        if (tail) {
#pragma unroll
            for (int t = 0; t < 2; ++t)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    if (key0 + 2 * c4 + 8 * t + (e & 1) >= L) s[t][e] = -INFLLM_INF;
        }
        float alpha[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float mx = fmaxf(fmaxf(s[0][2 * r], s[0][2 * r + 1]), fmaxf(s[1][2 * r], s[1][2 * r + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float m_new = fmaxf(m[r], mx);
            const float m_use = m_new == -INFLLM_INF ? 0.f : m_new;   // nothing valid yet: every p is 0
            alpha[r] = exp2f(m[r] - m_use);
            m[r] = m_new;
            float sum = 0.f;
#pragma unroll
            for (int t = 0; t < 2; ++t)
#pragma unroll
                for (int e = 2 * r; e < 2 * r + 2; ++e) {
                    s[t][e] = exp2f(s[t][e] - m_use);
                    sum += s[t][e];
                }
            l[r] = l[r] * alpha[r] + sum;
            if (prel != nullptr) {
                // weights (docs/decode.md, 5. Attention weights): s now holds 2^(logit - m_use) <= 1,
                // stored as fp16 with m_use per 16-key group; the weights pass rescales by 2^(m_use - lse2).
                // Row and pointers are recomputed per block (a few instructions, only with weights)
                // rather than held in registers; rows >= G store nothing
                const int row = 16 * mt + g4 + 8 * r;
                const int64 rowi = (int64)b * HQ + (int64)h * G + row;
                __half* pr = prel + rowi * W;
                const u32 w0 = pack2<__half>(s[0][2 * r], s[0][2 * r + 1]);   // keys 2 c4, 2 c4 + 1
                const u32 w1 = pack2<__half>(s[1][2 * r], s[1][2 * r + 1]);   // keys 8 + 2 c4, + 1
                if ((W & 3) == 0 && !tail) {
                    // one exchange with lane c4 ^ 1 gives each lane 4 consecutive keys (even lanes keys
                    // 2 c4 .. + 3, odd lanes 8 + 2 (c4 - 1) .. + 3): a row's 16 keys are 4 8-byte stores
                    // of one 32-byte sector
                    const bool odd = c4 & 1;
                    const u32 y = __shfl_xor_sync(0xffffffffu, odd ? w0 : w1, 1);
                    if (row < G)
                        *reinterpret_cast<uint2*>(pr + key0 + 4 * (c4 >> 1) + 8 * (c4 & 1)) =
                            odd ? make_uint2(y, w1) : make_uint2(w0, y);
                } else if (row < G) {
                    const int kk = key0 + 2 * c4;
                    const __half2 h0 = *reinterpret_cast<const __half2*>(&w0), h1 = *reinterpret_cast<const __half2*>(&w1);
                    if (kk < L) pr[kk] = __low2half(h0);
                    if (kk + 1 < L) pr[kk + 1] = __high2half(h0);
                    if (kk + 8 < L) pr[kk + 8] = __low2half(h1);
                    if (kk + 9 < L) pr[kk + 9] = __high2half(h1);
                }
                // key0 < L: a tail block's later key quarters may lie past W (not a multiple of 64)
                if (c4 == 0 && row < ((G + 3) & ~3) && key0 < L)
                    pmax[(((int64)b * H + h) * ((W + 15) >> 4) + (key0 >> 4)) * ((G + 3) & ~3) + row] = m_use;
            }
        }
        // rescale the output tile only where some row's max moved (x 1 is exact, so skipping it
        // changes no bit); a warp-uniform test, since the tile is the warp's
        if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
            for (int nt = 0; nt < D / 8; ++nt) {
                o[nt][0] *= alpha[0];
                o[nt][1] *= alpha[0];
                o[nt][2] *= alpha[1];
                o[nt][3] *= alpha[1];
            }
        }
        u32 pa[4];
        a_from_acc<T>(s[0], s[1], pa);
#pragma unroll
        for (int nc = 0; nc < D / 16; ++nc) {
            u32 bv[4];
            ldmatrix_x4_trans(bv, vt + t_off[nc & 3] + (nc >> 2) * 128);
            mma_16816<T>(o[2 * nc], pa, bv[0], bv[1]);
            mma_16816<T>(o[2 * nc + 1], pa, bv[2], bv[3]);
        }
        __syncthreads();   // the stage read here is the one block i + NS lands in
    }
    cp_async_wait<0>();
    pdl_launch_dependents();      // the merge (or weights pass) may launch during the epilogue

    // ---- combine the 4 key-quarter warps of each row tile, then write the split's partial result
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
        if (c4 == 0) {
            m_s[(mt * 4 + kw) * 16 + g4 + 8 * r] = m[r];
            l_s[(mt * 4 + kw) * 16 + g4 + 8 * r] = l[r];
        }
    }
    __syncthreads();
    typedef EpilogueSmem<D, MT> EP;
    constexpr int OROW = EP::OROW, NBUF = EP::NBUF;
    float* obuf = reinterpret_cast<float*>(smem + SM::KV);          // the K/V stages are free now
    float* row_inv = reinterpret_cast<float*>(smem + SM::KV + EP::ROWL);
    // each row's max and sum once (not per output element): 1 / sum for the final pass, lse_part here
    if (tid < G) {
        const int rt = tid >> 4, rr = tid & 15;
        float M = -INFLLM_INF, Lsum = 0.f;
        for (int w = 0; w < 4; ++w) M = fmaxf(M, m_s[(rt * 4 + w) * 16 + rr]);
        if (M != -INFLLM_INF)
            for (int w = 0; w < 4; ++w) Lsum += l_s[(rt * 4 + w) * 16 + rr] * exp2f(m_s[(rt * 4 + w) * 16 + rr] - M);
        row_inv[tid] = Lsum > 0.f ? 1.f / Lsum : 0.f;    // 0: the split saw no key, o_part is 0
        const int64 hq = (int64)b * HQ + (int64)h * G + tid;
        const float lse2 = M + __log2f(Lsum);
        if (out != nullptr) {                           // the only split: the merge's outputs
            lse2_out[hq] = Lsum > 0.f ? lse2 : INFLLM_INF;
            lse_out[hq] = Lsum > 0.f ? lse2 * LN2 : INFLLM_INF;
        } else {
            lse_part[hq * S + split] = Lsum > 0.f ? lse2 : -INFLLM_INF;
        }
    }
    float sc[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float M = -INFLLM_INF;
#pragma unroll
        for (int w = 0; w < 4; ++w) M = fmaxf(M, m_s[(mt * 4 + w) * 16 + g4 + 8 * r]);
        sc[r] = M == -INFLLM_INF ? 0.f : exp2f(m[r] - M);
    }
    // key-quarter warp kw adds its scaled tile into buffer kw % NBUF in round kw / NBUF (one round
    // when the 4 buffers fit); the final pass sums the buffers in order
    float* mine = obuf + kw % NBUF * (16 * MT * OROW) + (16 * mt + g4) * OROW + 2 * c4;
#pragma unroll
    for (int round = 0; round < 4 / NBUF; ++round) {
        if (kw / NBUF == round) {
#pragma unroll
            for (int nt = 0; nt < D / 8; ++nt)
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    float2* dst = reinterpret_cast<float2*>(mine + 8 * r * OROW + nt * 8);
                    float2 x = make_float2(o[nt][2 * r] * sc[r], o[nt][2 * r + 1] * sc[r]);
                    if (round > 0) {
                        const float2 y = *dst;
                        x = make_float2(y.x + x.x, y.y + x.y);
                    }
                    *dst = x;
                }
        }
        __syncthreads();
    }
    constexpr int DV = D / 4;
    float* o_part_s = o_part + (((int64)b * HQ + (int64)h * G) * S + split) * D;   // row r at + r S D
    for (int idx = tid; idx < G * DV; idx += NT) {
        const int r = idx / DV, d = 4 * (idx % DV);
        float4 a = *reinterpret_cast<const float4*>(obuf + r * OROW + d);
#pragma unroll
        for (int bf = 1; bf < NBUF; ++bf) {
            const float4 c = *reinterpret_cast<const float4*>(obuf + bf * (16 * MT * OROW) + r * OROW + d);
            a = make_float4(a.x + c.x, a.y + c.y, a.z + c.z, a.w + c.w);
        }
        const float inv = row_inv[r];
        if (out != nullptr) {
            Vec<T, 4> res;
            res.elem[0] = from_float<T>(a.x * inv);
            res.elem[1] = from_float<T>(a.y * inv);
            res.elem[2] = from_float<T>(a.z * inv);
            res.elem[3] = from_float<T>(a.w * inv);
            res.store(out + ((int64)b * HQ + (int64)h * G + r) * D + d);
        } else {
            *reinterpret_cast<float4*>(o_part_s + (int64)r * S * D + d) = make_float4(a.x * inv, a.y * inv, a.z * inv, a.w * inv);
        }
    }
}

// P = blockDim.x / (D / 4) thread groups (a power of two): group p merges splits p, p + P, .. in one
// pass with a running max (its loads of lse_s and o_s do not wait for a row-wide max: one round trip
// to the L2, docs/decode.md, 4. Splits and the merge), 16-byte loads of 4 output dims per thread;
// then a tree over the groups in shared memory, each step rescaling both sides to the larger max.
#define SPARSE_DECODE_MERGE_PARAMS(F, M) \
    F(const float* __restrict__, o_part)        /* [B, HQ, S, D] the splits' normalised outputs */ \
    F(const float* __restrict__, lse_part)      /* [B, HQ, S] their log2-sum-exp */ \
    F(int, S)                                   /* splits */ \
    SPARSE_DECODE_MERGED_FIELDS(F)
template <typename T>
struct SparseDecodeMergeParams { PARAM_FIELDS(SPARSE_DECODE_MERGE_PARAMS) };

template <typename T, int D>
__global__ void __launch_bounds__(1024)
sparse_decode_merge(PARAM_ARGS(SPARSE_DECODE_MERGE_PARAMS)) {
    constexpr int DV = D / 4;
    constexpr int MAXP = 1024 / DV;
    extern __shared__ float4 merge_smem[];        // [P][DV] group sums (the launch's 16 * blockDim bytes)
    __shared__ float m_s[MAXP], l_s[MAXP];        // each group's running max and sum
    const int NTH = blockDim.x, P = NTH / DV;
    float4* acc_s = merge_smem;
    const int64 row = blockIdx.x;
    const int tid = threadIdx.x;
    const int d4 = tid % DV, part = tid / DV;
    pdl_wait();
    pdl_launch_dependents();      // the weights pass may launch while the merge runs
    const float* lp = lse_part + row * S;
    const float4* op = reinterpret_cast<const float4*>(o_part + row * S * D) + d4;
    // every split wrote its o_part rows (zeros, lse -inf, when it saw no key): -inf splits are skipped,
    // so no weight is ever 0 * NaN or exp2(-inf - -inf)
    float M = -INFLLM_INF, sum = 0.f;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 4
    for (int s = part; s < S; s += P) {
        const float l = lp[s];
        const float4 x = op[(int64)s * DV];
        if (l == -INFLLM_INF) continue;
        if (l > M) {                               // rescale what was summed to the new max
            const float c = M == -INFLLM_INF ? 0.f : exp2f(M - l);
            acc = make_float4(acc.x * c, acc.y * c, acc.z * c, acc.w * c);
            sum *= c;
            M = l;
        }
        const float w = exp2f(l - M);
        sum += w;
        acc = make_float4(acc.x + w * x.x, acc.y + w * x.y, acc.z + w * x.z, acc.w + w * x.w);
    }
    for (int half = P >> 1; half > 0; half >>= 1) {
        if (part >= half && part < 2 * half) {
            acc_s[part * DV + d4] = acc;
            if (d4 == 0) m_s[part] = M, l_s[part] = sum;
        }
        __syncthreads();
        if (part < half) {
            const float4 c4 = acc_s[(part + half) * DV + d4];
            const float Mo = m_s[part + half], lo = l_s[part + half];
            const float Mn = fmaxf(M, Mo);
            const float a = M == -INFLLM_INF ? 0.f : exp2f(M - Mn), bo = Mo == -INFLLM_INF ? 0.f : exp2f(Mo - Mn);
            acc = make_float4(acc.x * a + c4.x * bo, acc.y * a + c4.y * bo, acc.z * a + c4.z * bo, acc.w * a + c4.w * bo);
            sum = sum * a + lo * bo;
            M = Mn;
        }
        __syncthreads();
    }
    if (part == 0) {
        Vec<T, 4> res;
        res.elem[0] = from_float<T>(sum > 0.f ? acc.x / sum : 0.f);
        res.elem[1] = from_float<T>(sum > 0.f ? acc.y / sum : 0.f);
        res.elem[2] = from_float<T>(sum > 0.f ? acc.z / sum : 0.f);
        res.elem[3] = from_float<T>(sum > 0.f ? acc.w / sum : 0.f);
        res.store(out + row * D + 4 * d4);
        if (tid == 0) {
            const float lse2 = sum > 0.f ? M + __log2f(sum) : INFLLM_INF;
            lse2_out[row] = lse2;
            lse_out[row] = sum > 0.f ? lse2 * LN2 : INFLLM_INF;
        }
    }
}

#define SPARSE_DECODE_WEIGHTS_PARAMS(F, M) \
    F(const __half* __restrict__, prel)         /* [B, HQ, W] the split kernel's relative probabilities */ \
    F(const float* __restrict__, pmax)          /* [B, H, cdiv(W, 16), GP] their maxima */ \
    F(const float* __restrict__, lse2)          /* [B * HQ] log2-sum-exp (the merge's lse2_out) */ \
    F(const int* __restrict__, seqlens)         /* [B] */ \
    SPARSE_DECODE_TOPK_FIELDS(F) \
    F(int, W)                                   /* the cache's width */ \
    F(int, per_kv_head)                         /* 0: per query head; 1: summed over the group */ \
    F(float* __restrict__, out)                 /* [B, HQ, W] (per_kv_head = 0) or [B, H, W] */
struct SparseDecodeWeightsParams { PARAM_FIELDS(SPARSE_DECODE_WEIGHTS_PARAMS) };

// At most 40 registers (6 CTAs per SM; ptxas takes 40 unbounded too): the bound only keeps an edit
// from silently losing residency. Registers were not the per-KV-head regression of 4827195 (48
// registers bounded to 40 ran as slow); the pass's shape is in docs/decode.md, 5. Attention weights.
__global__ void __launch_bounds__(256, 6)
sparse_decode_weights(PARAM_ARGS(SPARSE_DECODE_WEIGHTS_PARAMS)) {
    __shared__ int sel[WCHUNK / BLK];
    __shared__ float lse_s[64];
    const int h = blockIdx.y, b = blockIdx.z, tid = threadIdx.x;
    const int p0 = blockIdx.x * WCHUNK, blk0 = p0 / BLK;
    pdl_wait();
    const int L = seqlens[b], nb = (L + BLK - 1) / BLK;
    const int HQ = H * G, NG = (W + 15) >> 4;
    for (int g = tid; g < G; g += blockDim.x) lse_s[g] = lse2[(int64)b * HQ + (int64)h * G + g];
    if (tid < WCHUNK / BLK) sel[tid] = topk == nullptr ? (blk0 + tid < nb) : 0;
    __syncthreads();
    if (topk != nullptr) {
        const int* row = topk + ((int64)h * B + b) * K;
        for (int e = tid; e < K; e += blockDim.x) {
            const int x = row[e];
            if (x >= 0 && x < nb && x >= blk0 && x < blk0 + WCHUNK / BLK) sel[x - blk0] = 1;   // same value from every writer
        }
        __syncthreads();
    }
    // WCHUNK = 4 * blockDim.x: each thread takes 4 consecutive positions of one 16-key group (one pmax),
    // as one 8-byte load and one 16-byte store per head when the rows are aligned (W % 4 == 0)
    const int pos = p0 + 4 * tid;
    if (pos >= W) return;
    const bool vec = (W & 3) == 0;
    const int64 row0 = (int64)b * HQ + (int64)h * G;                // the group's first query-head row
    float* dst = out + (per_kv_head ? (int64)b * H + h : row0) * W + pos;
    const int n_out = per_kv_head ? 1 : G;                          // output rows of this thread
    if (!(sel[(pos - p0) / BLK] != 0 && pos < L)) {
        // nothing read here (most positions of a sparse row): zeros, without the heads' loop (the
        // same bits: every x was 0 there)
        for (int g = 0; g < n_out; ++g, dst += W) {
            if (vec) {
                *reinterpret_cast<float4*>(dst) = make_float4(0.f, 0.f, 0.f, 0.f);
            } else {
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    if (pos + e < W) dst[e] = 0.f;
            }
        }
        return;
    }
    const __half* src = prel + row0 * W + pos;
    // the 16-key group's maxes of the G heads (padded to GP), 4 heads per 16-byte load
    const float* msrc = pmax + (((int64)b * H + h) * NG + (pos >> 4)) * ((G + 3) & ~3);
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    // head g's 4 weights: summed (per KV head) or stored. The products are __fmul_rn: a product that
    // the compiler contracted into the sum (an FFMA) would change the per-KV-head bits
    auto emit = [&](int g, float x0, float x1, float x2, float x3) {
        if (per_kv_head) {
            acc[0] += x0; acc[1] += x1; acc[2] += x2; acc[3] += x3;
        } else if (vec) {
            *reinterpret_cast<float4*>(dst + (int64)g * W) = make_float4(x0, x1, x2, x3);
        } else {
            const float x[4] = {x0, x1, x2, x3};
#pragma unroll
            for (int e = 0; e < 4; ++e)
                if (pos + e < W) dst[(int64)g * W + e] = x[e];
        }
    };
    if (vec && pos + 3 < L) {
        // heads four at a time, every load issued before the arithmetic: one load per thread in
        // flight is too little to cover the memory latency
        const __half* sp = src;                         // head g0's row, 4 W further per pass
        for (int g0 = 0; g0 < G; g0 += 4, sp += 4 * (int64)W) {
            uint2 pv[4];
#pragma unroll
            for (int i = 0; i < 4; ++i)
                pv[i] = g0 + i < G ? *reinterpret_cast<const uint2*>(sp + (int64)i * W) : make_uint2(0u, 0u);
            const float4 m4 = *reinterpret_cast<const float4*>(msrc + g0);
            const float mv[4] = {m4.x, m4.y, m4.z, m4.w};
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int g = g0 + i;
                if (g >= G) break;
                // 2^(m - lse2) <= 1: m is the max of some of the row's logits, lse2 their log-sum-exp
                const float f = exp2f(mv[i] - lse_s[g]);
                const float2 a = unpack2<__half>(pv[i].x), c = unpack2<__half>(pv[i].y);
                emit(g, __fmul_rn(a.x, f), __fmul_rn(a.y, f), __fmul_rn(c.x, f), __fmul_rn(c.y, f));
            }
        }
    } else {
        // the row's last positions, or rows not 8-byte aligned: 2-byte loads, a head at a time
        for (int g = 0; g < G; ++g) {
            const float f = exp2f(msrc[g] - lse_s[g]);
            float x[4];
#pragma unroll
            for (int e = 0; e < 4; ++e)
                x[e] = pos + e < L && pos + e < W ? __fmul_rn(__half2float(src[(int64)g * W + e]), f) : 0.f;
            emit(g, x[0], x[1], x[2], x[3]);
        }
    }
    if (per_kv_head) {
        if (vec) {
            *reinterpret_cast<float4*>(dst) = make_float4(acc[0], acc[1], acc[2], acc[3]);
        } else {
#pragma unroll
            for (int e = 0; e < 4; ++e)
                if (pos + e < W) dst[e] = acc[e];
        }
    }
}
