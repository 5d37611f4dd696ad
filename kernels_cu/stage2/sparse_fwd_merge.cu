// stage2/sparse_fwd_merge.cu: merge of the forward's key-range passes into one output.
//
// Launch contract (mirrored by infllm_cupy/stage2/sparse_fwd.py, `stage2_fwd` with kv_passes > 1):
//   kernel   stage2_fwd_merge<T, D>   T in {__half, __nv_bfloat16}, D in {64, 128}
//   grid     (cdiv(HQ * total_q, 256 / (D / 8)))     block (256): D / 8 threads per row, 8 elements each
//   out_p    [P, total_q, HQ, D] T: pass p's output, normalised over its own keys
//   lse_p    [P, HQ, total_q] float32: pass p's log-sum-exp (natural log); +inf where the pass had no
//            key for the row (its out_p row is then not read: a CTA with no block in the pass's
//            range wrote nothing there)
//   out      [total_q, HQ, D] T, lse [HQ, total_q] float32: the attention over all passes' keys;
//            a row no pass saw gets 0 and +inf, as the single-pass kernel writes it
// Rows are enumerated (head, token) with the token fastest, so that the lse reads are coalesced;
// each row's D values are contiguous in out_p and out. Accumulation in fp32.
#include "common/types.cuh"

template <typename T, int D>
__global__ void __launch_bounds__(256)
stage2_fwd_merge(const T* __restrict__ out_p, const float* __restrict__ lse_p, T* __restrict__ out,
                 float* __restrict__ lse, int total_q, int HQ, int P) {
    constexpr int TPR = D / 8;                   // threads per row
    const int64 row = (int64)blockIdx.x * (256 / TPR) + threadIdx.x / TPR;
    const int part = threadIdx.x % TPR;
    if (row >= (int64)HQ * total_q) return;
    const int hq = (int)(row / total_q), t = (int)(row - (int64)hq * total_q);
    const int64 lse_stride = (int64)HQ * total_q, out_stride = (int64)total_q * HQ * D;
    float m = -INFLLM_INF;
    for (int p = 0; p < P; ++p) {
        const float l = lse_p[p * lse_stride + row];
        if (l != INFLLM_INF) m = fmaxf(m, l);
    }
    const int64 elem = ((int64)t * HQ + hq) * D + part * 8;
    Vec<T, 8> v;
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f}, sum = 0.f;
    if (m != -INFLLM_INF) {
        for (int p = 0; p < P; ++p) {
            const float l = lse_p[p * lse_stride + row];
            if (l == INFLLM_INF) continue;
            const float w = __expf(l - m);
            sum += w;
            v.load(out_p + p * out_stride + elem);
#pragma unroll
            for (int i = 0; i < 8; ++i) acc[i] = fmaf(w, to_float(v.elem[i]), acc[i]);
        }
    }
    // sum >= 1 when some pass saw a key (the largest weight is exp(0)); else 0 and lse = +inf
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) v.elem[i] = from_float<T>(acc[i] * inv);
    v.store(out + elem);
    if (part == 0) lse[row] = sum > 0.f ? m + __logf(sum) : INFLLM_INF;
}
