// stage2/sparse_fwd.cu: token-level block-sparse attention forward (InfLLM-v2 stage 2), SM80 path.
//
// Launch contract (mirrored by infllm_cupy/stage2/sparse_fwd.py):
//   kernel   stage2_fwd<T, D, WARPS>    T in {__half, __nv_bfloat16}, D in {64, 128}, WARPS in {4, 8}
//   grid     (cdiv(max_seqlen_q * G, 16 * WARPS), H, B)      block (32 * WARPS)
//   dyn smem (16 * WARPS * D + 4 * 64 * D) * sizeof(T) + 4 * n_words
//   q        [total_q, HQ, D] T, contiguous          k, v [total_k, H, D] T, contiguous
//   masks    uint32 bitmasks over 64-key blocks, n_words per row. The row of token r (local) of
//            sequence b for KV head h is  mask_base[b] + h * mask_h_stride + r / mask_q_block:
//              token-level topk_idx: mask_base = cu_seqlens_q, mask_h_stride = total_q, mask_q_block = 1
//              query-block layouts:  mask_base[b] = first row of b's layout, mask_q_block = 64 or 128
//   out      [total_q, HQ, D] T                        lse [HQ, total_q] float32 (natural log)
//   Semantics: query (r, head h*G+g) attends keys c of its sequence with c/64 set in its mask row,
//   c < Lk and, when causal, c <= r + Lk - Lq (bottom-right). No allowed key: out = 0, lse = +inf.
//
// Shape of the work (notes/stage2_design.md): a CTA owns 16*WARPS consecutive rows of the
// flattened (token, head-in-group) space of one sequence and one KV head: with G = 16 each warp is
// one token's 16 heads. The CTA walks the union of its tokens' blocks in ascending order, streaming
// each K/V block into shared memory once (cp.async, double buffered); a warp skips a block none of
// its rows selected (warp-uniform, no divergence) and masks rows that did not select it, so a
// block shared by all tokens costs what it costs in FlashAttention-2.
#include "common/types.cuh"
#include "common/mma_sm80.cuh"

#define BLOCK_N 64

// Shared-memory tiles are rows of D/8 16-byte chunks; chunk c of row r is stored at chunk
// c ^ (r % 8) so that the 8 row addresses of one ldmatrix hit 8 different bank groups.
template <int D>
__device__ __forceinline__ int swz(int row, int chunk) {
    return row * (D / 8) + (chunk ^ (row & 7));
}

// Next set bit at or after `from` in the union bitmask, or -1.
__device__ __forceinline__ int next_block(const unsigned* __restrict__ words, int n_words, int from) {
    int w = from >> 5;
    if (w >= n_words) return -1;
    unsigned bits = words[w] & (~0u << (from & 31));
    while (true) {
        if (bits) return (w << 5) + __ffs(bits) - 1;
        if (++w >= n_words) return -1;
        bits = words[w];
    }
}

// 8 warps: one CTA per SM with the full register file (128 registers would spill at D = 128);
// 4 warps: two CTAs per SM.
template <typename T, int D, int WARPS>
__global__ void __launch_bounds__(32 * WARPS, WARPS == 8 ? 1 : 2)
stage2_fwd(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
           const unsigned* __restrict__ masks, const int* __restrict__ mask_base,
           const int* __restrict__ cu_seqlens_q, const int* __restrict__ cu_seqlens_k,
           T* __restrict__ out, float* __restrict__ lse,
           int total_q, int HQ, int H, int G, int n_words, long long mask_h_stride, int mask_q_block,
           float scale_log2, int causal) {
    constexpr int THREADS = 32 * WARPS;
    constexpr int M = 16 * WARPS;
    constexpr int CH = D / 8;                   // 16-byte chunks per row
    extern __shared__ __align__(128) unsigned char smem[];
    T* sQ = reinterpret_cast<T*>(smem);
    T* sK = sQ + M * D;                         // [2][BLOCK_N * D]
    T* sV = sK + 2 * BLOCK_N * D;               // [2][BLOCK_N * D]
    unsigned* sU = reinterpret_cast<unsigned*>(sV + 2 * BLOCK_N * D);

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int h = blockIdx.y, b = blockIdx.z;
    const int qs = cu_seqlens_q[b], Lq = cu_seqlens_q[b + 1] - qs;
    const int ks = cu_seqlens_k[b], Lk = cu_seqlens_k[b + 1] - ks;
    const int64 rows_total = (int64)Lq * G;
    const int64 m0 = (int64)blockIdx.x * M;
    if (m0 >= rows_total) return;
    const int shift = causal ? Lk - Lq : 0;     // key c is visible to token r iff c <= r + shift
    const int nb = (Lk + BLOCK_N - 1) / BLOCK_N;
    const int t_lo = (int)(m0 / G);
    const int t_hi = (int)((min(m0 + M, rows_total) - 1) / G);
    // last block any row of this CTA may see
    int max_block = min(nb, n_words * 32) - 1;
    if (causal) max_block = min(max_block, (t_hi + shift) < 0 ? -1 : (t_hi + shift) / BLOCK_N);
    const int nw = max_block >= 0 ? (max_block >> 5) + 1 : 0;
    const unsigned* mrows = masks + ((int64)mask_base[b] + (int64)h * mask_h_stride) * n_words;

    // ---- union of the CTA's tokens' blocks, clipped to max_block
    const int q_lo = t_lo / mask_q_block, q_hi = t_hi / mask_q_block;
    for (int w = tid; w < nw; w += THREADS) {
        unsigned u = 0;
        for (int r = q_lo; r <= q_hi; ++r) u |= __ldg(mrows + (int64)r * n_words + w);
        if (w == (max_block >> 5) && (max_block & 31) != 31) u &= (2u << (max_block & 31)) - 1u;
        sU[w] = u;
    }

    // ---- Q tile: rows are (token, head) pairs, zero past the sequence
    for (int i = tid; i < M * CH; i += THREADS) {
        const int row = i / CH, ch = i % CH;
        const int64 R = m0 + row;
        const T* src = q;
        int bytes = 0;
        if (R < rows_total) {
            const int t = (int)(R / G), g = (int)(R - (int64)t * G);
            src = q + ((int64)(qs + t) * HQ + (int64)h * G + g) * D + ch * 8;
            bytes = 16;
        }
        cp_async_16(smem_u32(sQ + swz<D>(row, ch) * 8), src, bytes);
    }
    cp_async_commit();

    auto load_kv = [&](int j, int stage) {
        T* dk = sK + stage * BLOCK_N * D;
        T* dv = sV + stage * BLOCK_N * D;
        for (int i = tid; i < BLOCK_N * CH; i += THREADS) {
            const int row = i / CH, ch = i % CH;
            const int key = j * BLOCK_N + row;
            const int64 off = ((int64)(ks + key) * H + h) * D + ch * 8;
            const int bytes = key < Lk ? 16 : 0;
            cp_async_16(smem_u32(dk + swz<D>(row, ch) * 8), bytes ? k + off : k, bytes);
            cp_async_16(smem_u32(dv + swz<D>(row, ch) * 8), bytes ? v + off : v, bytes);
        }
    };

    __syncthreads();  // sU complete
    int j = next_block(sU, nw, 0);
    if (j >= 0) load_kv(j, 0);
    cp_async_commit();

    // ---- this thread's two rows (g and g + 8 of the warp's 16-row tile)
    bool row_ok[2];
    int rk[2];
    const unsigned* mrow[2];
    int64 Rr[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        Rr[i] = m0 + warp * 16 + (lane >> 2) + 8 * i;
        row_ok[i] = Rr[i] < rows_total;
        const int t = row_ok[i] ? (int)(Rr[i] / G) : t_lo;
        rk[i] = causal ? t + shift : Lk - 1;
        mrow[i] = mrows + (int64)(t / mask_q_block) * n_words;
    }

    float o[D / 8][4];
#pragma unroll
    for (int n = 0; n < D / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    float m_run[2] = {-INFLLM_INF, -INFLLM_INF};
    float l_run[2] = {0.f, 0.f};

    const int mi = lane >> 3, lr = lane & 7;    // ldmatrix: which matrix this lane addresses, and its row
    int stage = 0;
    while (j >= 0) {
        const int jn = next_block(sU, nw, j + 1);
        if (jn >= 0) load_kv(jn, stage ^ 1);
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();

        bool sel[2];
#pragma unroll
        for (int i = 0; i < 2; ++i)
            sel[i] = row_ok[i] && ((__ldg(mrow[i] + (j >> 5)) >> (j & 31)) & 1u) && j * BLOCK_N <= rk[i];
        if (__any_sync(0xffffffffu, sel[0] || sel[1])) {
            const T* tK = sK + stage * BLOCK_N * D;
            const T* tV = sV + stage * BLOCK_N * D;
            // S = Q K^T for this warp's 16 rows and the block's 64 keys
            float s[BLOCK_N / 8][4];
#pragma unroll
            for (int n = 0; n < BLOCK_N / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) {
                u32 a[4];
                ldmatrix_x4(a, smem_u32(sQ + swz<D>(warp * 16 + (mi & 1) * 8 + lr, 2 * kk + (mi >> 1)) * 8));
#pragma unroll
                for (int np = 0; np < BLOCK_N / 16; ++np) {
                    u32 bk[4];
                    ldmatrix_x4(bk, smem_u32(tK + swz<D>((2 * np + (mi >> 1)) * 8 + lr, 2 * kk + (mi & 1)) * 8));
                    mma_16816<T>(s[2 * np], a, bk[0], bk[1]);
                    mma_16816<T>(s[2 * np + 1], a, bk[2], bk[3]);
                }
            }
            // mask, then online softmax in the log2 domain
            const int kbase = j * BLOCK_N;
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                const bool partial = kbase + BLOCK_N - 1 > rk[i];
                float mx = -INFLLM_INF;
#pragma unroll
                for (int n = 0; n < BLOCK_N / 8; ++n) {
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        float x = s[n][2 * i + e] * scale_log2;
                        const int c = kbase + n * 8 + (lane & 3) * 2 + e;
                        if (!sel[i] || (partial && c > rk[i])) x = -INFLLM_INF;
                        s[n][2 * i + e] = x;
                        mx = fmaxf(mx, x);
                    }
                }
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                const float m_new = fmaxf(m_run[i], mx);
                const float m_use = m_new == -INFLLM_INF ? 0.f : m_new;   // all masked so far: keep 0s
                const float alpha = exp2f(m_run[i] - m_use);
                m_run[i] = m_new;
                float sum = 0.f;
#pragma unroll
                for (int n = 0; n < BLOCK_N / 8; ++n) {
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const float p = exp2f(s[n][2 * i + e] - m_use);
                        s[n][2 * i + e] = p;
                        sum += p;
                    }
                }
                l_run[i] = l_run[i] * alpha + sum;
#pragma unroll
                for (int n = 0; n < D / 8; ++n) {
                    o[n][2 * i] *= alpha;
                    o[n][2 * i + 1] *= alpha;
                }
            }
            // O += P V; the S accumulator layout is the A-operand layout, so P never leaves registers
#pragma unroll
            for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
                u32 a[4];
                a[0] = pack2<T>(s[2 * kk][0], s[2 * kk][1]);
                a[1] = pack2<T>(s[2 * kk][2], s[2 * kk][3]);
                a[2] = pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
                a[3] = pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
                for (int dp = 0; dp < D / 16; ++dp) {
                    u32 bv[4];
                    ldmatrix_x4_trans(bv, smem_u32(tV + swz<D>(kk * 16 + (mi & 1) * 8 + lr, 2 * dp + (mi >> 1)) * 8));
                    mma_16816<T>(o[2 * dp], a, bv[0], bv[1]);
                    mma_16816<T>(o[2 * dp + 1], a, bv[2], bv[3]);
                }
            }
        }
        __syncthreads();  // every warp is done with this stage before the next load overwrites it
        stage ^= 1;
        j = jn;
    }
    cp_async_wait<0>();

    // ---- epilogue: normalise, write O and the LSE
    const float LN2 = 0.69314718055994531f;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        float l = l_run[i];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        if (!row_ok[i]) continue;
        const int t = (int)(Rr[i] / G), g = (int)(Rr[i] - (int64)t * G);
        const float inv = l > 0.f ? 1.f / l : 0.f;
        T* dst = out + ((int64)(qs + t) * HQ + (int64)h * G + g) * D + (lane & 3) * 2;
#pragma unroll
        for (int n = 0; n < D / 8; ++n)
            *reinterpret_cast<u32*>(dst + n * 8) = pack2<T>(o[n][2 * i] * inv, o[n][2 * i + 1] * inv);
        if ((lane & 3) == 0)
            lse[((int64)h * G + g) * total_q + qs + t] = l > 0.f ? (m_run[i] + log2f(l)) * LN2 : INFLLM_INF;
    }
}
