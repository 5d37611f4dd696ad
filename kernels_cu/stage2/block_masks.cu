// stage2/block_masks.cu: per-token KV-block bitmasks from InfLLM-v2's topk_idx.
//
// Launch contract (mirrored by token_block_masks in infllm_cupy/stage2/sparse_fwd.py, whose
// MASK_PARAMS declares TokenBlockMasksParams field by field; the loader checks the layout at
// compile time):
//   kernel   token_block_masks(the fields of TokenBlockMasksParams)   (indices only: no template parameters)
//   grid     (cdiv(total_q, WARPS), H, 1)     block (32 * WARPS)   dyn smem = WARPS * n_words * 4
//   topk_idx [H, total_q, K] int32, contiguous  cu_seqlens_q/k int32 [B+1]
//   masks    [H, total_q, n_words] uint32: bit j of row (h, t) is set iff j appears in
//            topk_idx[h, t, :] and 0 <= j < cdiv(L_k(seq of t), 64). Negative and out-of-range
//            indices are dropped here; duplicates collapse; causality is applied by the consumer.
// One warp per (token, KV head) builds its row in shared memory, then writes it coalesced.
#include "common/types.cuh"
#include "common/params.cuh"

#define WARPS 8

#define TOKEN_BLOCK_MASKS_PARAMS(F, M) \
    F(const int* __restrict__, topk_idx)        /* [H, total_q, K] */ \
    F(const int* __restrict__, cu_seqlens_q)    /* [batch + 1] */ \
    F(const int* __restrict__, cu_seqlens_k)    /* [batch + 1] */ \
    F(unsigned* __restrict__, masks)            /* [H, total_q, n_words] */ \
    F(int, batch) F(int, total_q) F(int, K)     /* sequences, query tokens, indices per row */ \
    F(int, n_words)                             /* mask words per row */ \
    F(int, block_size)                          /* keys per block (64) */
struct TokenBlockMasksParams { PARAM_FIELDS(TOKEN_BLOCK_MASKS_PARAMS) };

__global__ void __launch_bounds__(32 * WARPS)
token_block_masks(PARAM_ARGS(TOKEN_BLOCK_MASKS_PARAMS)) {
    extern __shared__ unsigned rows[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int t = blockIdx.x * WARPS + warp;
    const int h = blockIdx.y;
    if (t >= total_q) return;
    unsigned* row = rows + warp * n_words;
    for (int w = lane; w < n_words; w += 32) row[w] = 0u;
    __syncwarp();
    const int b = find_sequence(cu_seqlens_q, batch, t);
    const int Lk = cu_seqlens_k[b + 1] - cu_seqlens_k[b];
    const int nb = min((Lk + block_size - 1) / block_size, n_words * 32);
    const int* idx = topk_idx + ((int64)h * total_q + t) * K;
    for (int i = lane; i < K; i += 32) {
        const int j = idx[i];
        if (j >= 0 && j < nb) atomicOr(&row[j >> 5], 1u << (j & 31));
    }
    __syncwarp();
    unsigned* out = masks + ((int64)h * total_q + t) * n_words;
    for (int w = lane; w < n_words; w += 32) out[w] = row[w];
}
