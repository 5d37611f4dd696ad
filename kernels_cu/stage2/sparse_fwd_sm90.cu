// stage2/sparse_fwd_sm90.cu: token-level block-sparse attention forward, Hopper (sm_90a) path.
//
// Launch contract (mirrored by infllm_cupy/stage2/sparse_fwd.py, whose SM90_PARAMS declares
// Stage2FwdSm90Params field by field; the loader checks the layout at compile time. Arguments as
// stage2_fwd's in sparse_fwd.cu, same semantics and outputs, except that K and V come as TMA tensor
// maps, and the step shape and key-range pass fields below):
//   kernel   stage2_fwd_sm90<T, D, NS, QH>(the fields of Stage2FwdSm90Params<T>)
//            T in {__half, __nv_bfloat16}, D in {64, 128}, NS in {4, 6} K/V ring
//            stages (6 where the shared memory holds them: faster on block-shared selections, see
//            docs/stage2_fwd.md, "sm_90a kernel: warp specialisation and the K/V ring"); capability 9.0;
//            QH in {0, 2} (default 0): per-query-head mask rows and kv_group, as stage2_fwd's
//            (sparse_fwd.cu)
//   grid     (cdiv(max_seqlen_q * G, 64 * NC), H, B)     block (128 * (NC + 1))
//   dyn smem 1 KB alignment slack + NC Q tiles + NS K and V stages + (2 NC + 1) NS mbarriers
//            + (NC + 1) * n_words union words (fwd_smem_bytes in the launcher)
//   tmap_k, tmap_v  K and V [total_k, H, D] viewed as [total_k, H * D], boxes of 64 rows x 64
//               elements, 128-byte swizzle, zero fill (infllm_cupy/_tma.py, rows_map)
//   step_mode   a RingSteps value (ring_sm90.cuh). The launcher passes STEPS_AUTO: 128-key steps in
//               the CTAs where every consumer warpgroup needs every block of the CTA union, split
//               rings (one per warpgroup) in the CTAs whose warpgroups share under a quarter of it,
//               else 64-key steps on one ring. STEPS_SINGLE, STEPS_PAIR and STEPS_SPLIT force one of
//               these shapes in every CTA (the launcher's _force_steps: tests and A/B runs)
//   blk_lo, blk_hi, cta_split, split_min, x_off  key-range passes. One launch: 0, 2^30, null, -, 0. P passes
//               over 64-key block ranges [blk_lo, blk_hi), launched in order on one stream with
//               cta_split an int per CTA ([B][H][gridDim.x]): pass 0 (blk_lo = 0) counts each CTA's
//               whole union and records in cta_split whether it exceeds split_min blocks; a CTA
//               that does not split attends all its blocks in pass 0, one that does only those in
//               [0, blk_hi). A later pass runs only the CTAs that split, attends the range's blocks
//               and merges its rows into out and lse by their lse (out rounded to T in between).
//               x_off: the launch covers CTAs x_off .. x_off + gridDim.x - 1 of the row grid (a
//               later pass may leave out leading CTAs whose rows cannot see its range).
//               Why: at long contexts per-token picks read K/V blocks all over a sequence whose
//               K/V outgrow the L2, so most copies go to DRAM; one pass's range fits the L2.
//               Block-shared CTAs (small unions) gain nothing from it (docs/stage2_fwd.md,
//               "Key-range passes").
//   block    (the CTA body, its roles and the design: ring_sm90.cuh) warpgroups 0 .. NC - 1 consume,
//            warpgroup NC produces; setmaxnreg moves registers from the producer to the consumers.
#include "common/params.cuh"
#include "stage2/ring_sm90.cuh"

#define STAGE2_FWD_SM90_PARAMS(F, M) \
    F(const T* __restrict__, q)                 /* [total_q, HQ, D] */ \
    M(tmap_k) M(tmap_v)                         /* K, V [total_k, H, D] as [total_k, H * D] (rows_map) */ \
    STAGE2_FWD_ROW_FIELDS(F, M) \
    F(int, step_mode)                           /* RingSteps: STEPS_AUTO, or one step shape forced (above) */ \
    F(int, blk_lo) F(int, blk_hi)               /* this pass's 64-key blocks [blk_lo, blk_hi) */ \
    F(int* __restrict__, cta_split)             /* [B][H][row CTAs] pass flags, or null: one pass */ \
    F(int, split_min)                           /* pass 0: a CTA splits when its union exceeds this many blocks */ \
    F(int, x_off)                               /* first row CTA of this launch */ \
    F(int, kv_group)                            /* QH = 2: query heads per K/V head */
template <typename T>
struct Stage2FwdSm90Params { PARAM_FIELDS(STAGE2_FWD_SM90_PARAMS) };

template <typename T, int D, int NS, int QH = 0>
__global__ void __launch_bounds__(128 * (NC + 1), 1)
stage2_fwd_sm90(PARAM_ARGS(STAGE2_FWD_SM90_PARAMS)) {
    ring_cta_sm90<T, D, NS, false, QH>(q, nullptr, tmap_k, tmap_v, masks, mask_base, cu_seqlens_q, cu_seqlens_k, out, lse,
                                       nullptr, total_q, HQ, H, G, n_words, mask_h_stride, mask_q_block, scale_log2, 1.f,
                                       causal, step_mode, blk_lo, blk_hi, cta_split, split_min, x_off, kv_group);
}
