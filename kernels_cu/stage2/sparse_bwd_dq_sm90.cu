// stage2/sparse_bwd_dq_sm90.cu: token-level block-sparse attention backward, Hopper (sm_90a) path: dq.
//
// Launch contract (mirrored by infllm_cupy/stage2/sparse_bwd.py, whose DQ_RING_PARAMS declares
// Stage2BwdDqRingParams field by field; the loader checks the layout at compile time; dk and dv:
// sparse_bwd_sm90.cu):
//   kernel   stage2_bwd_dq_ring_sm90<T, D, NS, QH>(Stage2BwdDqRingParams<T>)  T in {__half, __nv_bfloat16},
//            D in {64, 128}, NS in {4, 6}
//            K/V ring stages (the deepest that fits); capability 9.0; QH in {0, 2} (default 0) and the
//            field kv_group: per-query-head mask rows as stage2_fwd_sm90's (H = HQ, G = 1, K/V head
//            h / kv_group, grid (cdiv(max_seqlen_q, 64 * NC) * kv_group, H / kv_group, B), head
//            fastest in x; the row tiles still run last first)
//   grid     (cdiv(max_seqlen_q * G, 64 * NC), H, B)     block (128 * (NC + 1)); CTAs in reverse order
//            (last tiles first: causal, they see the most blocks)
//   dyn smem as stage2_fwd_sm90 (sparse_fwd_sm90.cu) plus NC dout tiles (placed after the Q tiles)
//   fields   as stage2_bwd_dq's in sparse_bwd.cu, with K and V as the TMA tensor maps of
//            stage2_fwd_sm90 and step_mode (0, 1 or 3: 64-key steps on one ring or split rings;
//            no 128-key steps)
//   dq       [total_q, HQ, D] T = scale * sum over the allowed keys of dS K, dS = P (dP - delta),
//            P = exp(S - lse) recomputed from the forward's lse, dP = dO V^T
// The forward's CTA on the forward's K/V ring (ring_sm90.cuh, RingCta<T, D, NS, true>): the same
// producer, unions and walk; per 64-key block a consumer warpgroup runs S = Q K^T and dP = dO V^T
// as one wgmma group (Q, dO in shared memory: registers go to dq), then dq += dS K with K
// MN-major in its ring stage (docs/stage2_bwd.md, "dq on the ring").
#include "common/params.cuh"
#include "stage2/ring_sm90.cuh"

template <typename T>
struct Stage2BwdDqRingParams {
    const T* q;                   // [total_q, HQ, D]
    const T* dout;                // [total_q, HQ, D]
    TmaMap tmap_k;                // k [total_k, H, D] in 64-row boxes (_tma.rows_map; QH 2: H / kv_group heads)
    TmaMap tmap_v;                // the same over v
    const float* lse;             // [HQ, total_q], the forward's (natural log)
    const float* delta;           // [HQ, total_q] (stage2_bwd_delta)
    const unsigned* masks;        // bitmask rows (stage2_fwd's layout, sparse_fwd.cu)
    const int* mask_base;         // [B] first mask row of each sequence
    const int* cu_seqlens_q;      // [B + 1]
    const int* cu_seqlens_k;      // [B + 1]
    T* dq;                        // [total_q, HQ, D] (out)
    int total_q, HQ, H, G;        // H, G: of the row space (QH 2: HQ, 1)
    int n_words;                  // mask words per row
    long long mask_h_stride;      // mask rows between heads
    int mask_q_block;             // tokens per mask row
    float scale_log2, scale;      // softmax scale times log2(e), softmax scale
    int causal;
    int step_mode;                // 0 one ring, 1 split rings where the warpgroups share few blocks, 3 split
    int kv_group;                 // QH 2: query heads per K/V head (read only there)
};

template <typename T, int D, int NS, int QH = 0>
__global__ void __launch_bounds__(128 * (NC + 1), 1)
stage2_bwd_dq_ring_sm90(const __grid_constant__ Stage2BwdDqRingParams<T> p) {
    const T* __restrict__ q = param_field(p.q);
    const T* __restrict__ dout = param_field(p.dout);
    const float* __restrict__ lse = param_field(p.lse);
    const float* __restrict__ delta = param_field(p.delta);
    const unsigned* __restrict__ masks = param_field(p.masks);
    const int* __restrict__ mask_base = param_field(p.mask_base);
    const int* __restrict__ cu_seqlens_q = param_field(p.cu_seqlens_q);
    const int* __restrict__ cu_seqlens_k = param_field(p.cu_seqlens_k);
    T* __restrict__ dq = param_field(p.dq);
    const int total_q = param_field(p.total_q), HQ = param_field(p.HQ), H = param_field(p.H), G = param_field(p.G);
    const int n_words = param_field(p.n_words);
    const long long mask_h_stride = param_field(p.mask_h_stride);
    const int mask_q_block = param_field(p.mask_q_block);
    const float scale_log2 = param_field(p.scale_log2), scale = param_field(p.scale);
    const int causal = param_field(p.causal), step_mode = param_field(p.step_mode), kv_group = param_field(p.kv_group);
    ring_cta_sm90<T, D, NS, true, QH>(q, dout, p.tmap_k, p.tmap_v, masks, mask_base, cu_seqlens_q, cu_seqlens_k, dq,
                                      const_cast<float*>(lse), delta, total_q, HQ, H, G, n_words, mask_h_stride,
                                      mask_q_block, scale_log2, scale, causal, step_mode, 0, 1 << 30, nullptr, 0, 0,
                                      kv_group);
}

