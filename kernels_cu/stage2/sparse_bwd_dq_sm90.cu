// stage2/sparse_bwd_dq_sm90.cu: token-level block-sparse attention backward, Hopper (sm_90a) path: dq.
//
// Launch contract (mirrored by infllm_cupy/stage2/sparse_bwd.py, whose DQ_RING_PARAMS declares
// Stage2BwdDqRingParams field by field; the loader checks the layout at compile time; dk and dv:
// sparse_bwd_sm90.cu):
//   kernel   stage2_bwd_dq_ring_sm90<T, D, NS, QH>(the fields of Stage2BwdDqRingParams<T>)  T in {__half, __nv_bfloat16},
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

#define STAGE2_BWD_DQ_RING_PARAMS(F, M) \
    F(const T* __restrict__, q)                 /* [total_q, HQ, D] */ \
    F(const T* __restrict__, dout)              /* [total_q, HQ, D] */ \
    M(tmap_k)                                   /* k [total_k, H, D] in 64-row boxes (_tma.rows_map; QH 2: H / kv_group heads) */ \
    M(tmap_v)                                   /* the same over v */ \
    STAGE2_BWD_INPUT_FIELDS(F, M) \
    F(T* __restrict__, dq)                      /* [total_q, HQ, D] (out) */ \
    STAGE2_BWD_ROW_FIELDS(F, M) \
    F(int, step_mode)                           /* 0 one ring, 1 split rings where the warpgroups share few blocks, 3 split */ \
    F(int, kv_group)                            /* QH 2: query heads per K/V head (read only there) */
template <typename T>
struct Stage2BwdDqRingParams { PARAM_FIELDS(STAGE2_BWD_DQ_RING_PARAMS) };

template <typename T, int D, int NS, int QH = 0>
__global__ void __launch_bounds__(128 * (NC + 1), 1)
stage2_bwd_dq_ring_sm90(PARAM_ARGS(STAGE2_BWD_DQ_RING_PARAMS)) {
    ring_cta_sm90<T, D, NS, true, QH>(q, dout, tmap_k, tmap_v, masks, mask_base, cu_seqlens_q, cu_seqlens_k, dq,
                                      const_cast<float*>(lse), delta, total_q, HQ, H, G, n_words, mask_h_stride,
                                      mask_q_block, scale_log2, scale, causal, step_mode, 0, 1 << 30, nullptr, 0, 0,
                                      kv_group);
}

