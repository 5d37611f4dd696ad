// stage1/merge_cand.cu: the exact merge of one key-range pass's candidates into the running top-K
// (docs/stage1.md, 9. Long context: key ranges; its paragraph "The merge kernel").
//
// Launch contract (mirrored by _merge_into_kernel in infllm_cupy/stage1/select.py, whose MERGE_PARAMS
// declares MergeRangeCandidatesParams field by field; the loader checks the layout at compile time):
//   kernel   merge_range_candidates<NI>(the fields of MergeRangeCandidatesParams)   NI: candidates per
//            lane, K <= 32 * NI
//   grid     (cdiv(rows, MERGE_WARPS), 1, 1)   block (32 * MERGE_WARPS)   dyn smem = MERGE_WARPS * 2 * K * 8
//   cand_key [rows, K] uint32 (int32 storage): the range kernel's order-preserving block keys,
//            zero-extended from 16 or 32 bits;  cand_idx [rows, K] int32: their global block indices
//   run      [rows, K] int64, in place: with has_run, the running top-K as merge keys sorted
//            descending; on return the top-K of (run U candidates), sorted descending. has_run = 0
//            (the first pass): run is output only, the candidates sorted.
//   rows = H x total_q; K >= 1.
// Merge key of (key, block): (key << 31) | (2^31 - 1 - block), as a signed int64 (exactly the torch
// reference _merge_into_torch's arithmetic): larger is better, equal block keys order by the lower
// block. Precondition: the 2K merge keys of a row are distinct, which holds because a row's blocks are
// distinct (a range pass writes K distinct blocks of its range; ranges are disjoint). A row that breaks
// it gets an unspecified row, written inside the row only.
//
// One warp per row, no atomics, deterministic. Each candidate's rank in the union is its rank among
// the candidates (counted against all K, shared-memory broadcast reads) plus the running entries
// >= it (binary search in the sorted running list); each running entry's rank is its position plus
// the candidates > it (binary search in the candidates, sorted in shared memory by their ranks).
// The ranks are a permutation of [0, 2K): the entries of rank < K are the new top-K, written at
// position = rank, so the list stays sorted. Work per row: K^2 / 32 compares per lane (the count),
// plus 2 NI binary searches; memory: 24 K bytes read and written.
#include "common/types.cuh"
#include "common/params.cuh"

#define MERGE_WARPS 4

// Entries of the descending list a[0, n) that are > v (strict) or >= v (!strict).
__device__ __forceinline__ int count_above(const int64* a, int n, int64 v, bool strict) {
    int lo = 0;
#pragma unroll 1
    while (n > 0) {
        const int half = n >> 1;
        const int64 x = a[lo + half];
        if (strict ? x > v : x >= v) { lo += half + 1; n -= half + 1; }
        else n = half;
    }
    return lo;
}

#define MERGE_RANGE_CANDIDATES_PARAMS(F, M) \
    F(const unsigned* __restrict__, cand_key)   /* [rows, K] order-preserving block keys */ \
    F(const int* __restrict__, cand_idx)        /* [rows, K] their global block indices */ \
    F(int64*, run)                              /* [rows, K] merge keys, sorted descending, in place */ \
    F(int64, rows)                              /* H x total_q */ \
    F(int, K) \
    F(int, has_run)                             /* 0: the first pass (run is output only) */
struct MergeRangeCandidatesParams { PARAM_FIELDS(MERGE_RANGE_CANDIDATES_PARAMS) };

template <int NI>
__global__ void __launch_bounds__(32 * MERGE_WARPS)
merge_range_candidates(PARAM_ARGS(MERGE_RANGE_CANDIDATES_PARAMS)) {
    extern __shared__ int64 merge_smem[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int64 row = (int64)blockIdx.x * MERGE_WARPS + warp;
    if (row >= rows) return;
    int64* cs = merge_smem + (int64)warp * 2 * K;        // candidates: input order, then sorted
    int64* rs = cs + K;                                   // the running list, sorted descending
    const unsigned* ck = cand_key + row * K;
    const int* ci = cand_idx + row * K;
    int64* rr = run + row * K;

    int64 c[NI];
    int rank[NI];
#pragma unroll
    for (int s = 0; s < NI; ++s) {
        const int i = lane + 32 * s;
        c[s] = 0x7fffffffffffffffLL;                      // beyond K: above everything, never counted
        rank[s] = 0;
        if (i < K) {
            c[s] = ((int64)ck[i] << 31) | (0x7fffffffLL - (int64)ci[i]);
            cs[i] = c[s];
            if (has_run) rs[i] = rr[i];
        }
    }
    __syncwarp();   // every read of this row's run is done: the writes below may go in place

    // rank among the candidates: how many are larger (shared-memory broadcast, NI compares per load)
#pragma unroll 4
    for (int j = 0; j < K; ++j) {
        const int64 x = cs[j];
#pragma unroll
        for (int s = 0; s < NI; ++s) rank[s] += x > c[s];
    }
    __syncwarp();
#pragma unroll
    for (int s = 0; s < NI; ++s)
        if (lane + 32 * s < K) cs[rank[s]] = c[s];        // the candidates, sorted descending
    __syncwarp();

#pragma unroll
    for (int s = 0; s < NI; ++s) {
        const int i = lane + 32 * s;
        if (i >= K) continue;
        // a running entry equal to a candidate (never, by the precondition) would rank first
        const int rc = rank[s] + (has_run ? count_above(rs, K, c[s], false) : 0);
        if (rc < K) rr[rc] = c[s];
        if (has_run) {
            const int64 r = rs[i];
            const int rk = i + count_above(cs, K, r, true);
            if (rk < K) rr[rk] = r;
        }
    }
}
