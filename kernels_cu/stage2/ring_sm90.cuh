// stage2/ring_sm90.cuh: the CTA that the sm_90a forward (stage2_fwd_sm90, sparse_fwd_sm90.cu) and
// the backward's dq (stage2_bwd_dq_ring_sm90, sparse_bwd_dq_sm90.cu) share: a warp-specialised CTA
// whose producer warpgroup streams the union of the CTA's K/V blocks through a ring of shared-memory
// stages and whose consumer warpgroups run wgmma steps over it. By role:
//   ring_cta_sm90          the CTA body: setup (shared-memory plan, sequence, exits, Q copies, the
//                          unions, key-range pass bookkeeping, step shape, the ring's barriers and
//                          stage map), then the producer's or a consumer warpgroup's part
//   ring_producer_walk     the producer's walk over the union (ring position -> block, who needs it)
//   ring_loader            producer warp 0 (2 with split rings): TMA copies into the ring stages
//   ring_forwarder         producer warp 1 (3): zeroes rows past the sequence, arrives on `full`
//   ring_steps64           consumer steps over 64-key blocks (forward: softmax, O += P V; dq:
//                          dS = P (dP - delta), dq += dS K)
//   ring_steps128          consumer steps over 128-key slots (forward, zero-waste CTAs; ping-pong)
//   ring_epilogue_fwd, ring_epilogue_dq   out and lse (merged with the earlier key-range passes by
//                          their lse), or dq
//   softmax_step, RingWalk, rescale_o     the step helpers
// The setup stays in ring_cta_sm90: moved into functions, it changed the code ptxas emits (more
// than scheduling), which tools/sass_diff.py checks. Design: docs/stage2_fwd.md, "sm_90a kernel:
// warp specialisation and the K/V ring" and "64- and 128-key steps, split rings"; dq:
// docs/stage2_bwd.md, "dq on the ring".
//
// Warp-specialised, as FlashAttention-3: warpgroups 0..NC-1 are consumers, each owning 64 rows of
// the flattened (token, head-in-group) space (4 tokens at G = 16); warpgroup NC is the producer.
// The producer walks the union of the CTA's blocks and streams K/V blocks into an NS-deep ring of
// 128-byte-swizzled stages. Its warp 0 is the loader: one thread issues the stage's TMA copies,
// which complete on `loaded(s)`. Its warp 1 forwards: it waits for `loaded(s)`, zeroes the V rows
// past the sequence's end in a last partial block (the copy brought the next sequence's rows),
// and arrives on `full(g, s)` of each consumer warpgroup g that needs the block. (A TMA copy
// completes on one barrier; each warpgroup needs its own, because a warpgroup that skips blocks
// cannot track the parity of a barrier that others advance.) Consumers run S = Q K^T and
// O += P V on wgmma (Q, K, V read from shared memory through descriptors, P from registers) and
// release a stage through `empty(g, s)`. A warpgroup never touches the barriers of a block its
// tokens did not select: warpgroups advance independently, so a block that one token picked costs
// that token's warpgroup alone (the SM80 kernel's block barrier made every warp wait for the
// slowest). Rows of a warpgroup that did not select a block are masked, as are keys past the
// causal limit or the sequence's end.
//
// Per step, a consumer issues S(n+1), rescales O (every earlier P V has completed), issues P(n) V,
// and only then walks to the next block and loads its mask limits, while S runs: what lies
// between S's completion and the next issue (softmax, P V wait, P packing) is the step's critical
// path. Where both warpgroups run the same slots they take turns to issue (ping-pong, FA3), so
// that one's softmax overlaps the other's products.
//
// Two step shapes, chosen per CTA at run time (both compute the same function):
//   64-key steps  one block per softmax step, S = Q K^T as m64n64 with Q in registers.
//   128-key steps the CTA union is cut into slots of two consecutive blocks (ring stages 2i, 2i+1,
//                 whose K rows are contiguous: the K ring is stored [D half][NS * 64 rows]), and a
//                 warpgroup that needs either block of a slot runs S over both as one m64n128
//                 product and one softmax step: half the O rescales, row maxima and waits per key,
//                 and wgmma at N = 128. A block the warpgroup did not select is masked: computed
//                 for nothing. Measured, 128-key steps are 6-10% faster where no block is wasted
//                 and already slower at the ~10% waste of InfLLM-like selections, so STEPS_AUTO
//                 takes them only where the waste is zero (block-shared selections and query-block
//                 layouts, whose tokens of a CTA share one selection; docs/stage2_fwd.md, "64- and
//                 128-key steps, split rings").
#pragma once
#include "common/types.cuh"
#include "common/mma_sm80.cuh"
#include "common/wgmma_sm90.cuh"
#include "stage2/cta_common.cuh"
#include "stage2/seq_common.cuh"

#define BLOCK_N 64
#define NC 2   // consumer warpgroups
// Registers per thread after setmaxnreg. A CTA keeps the registers of its launch (the
// __launch_bounds__ cap, 168 at 384 threads) and setmaxnreg.inc waits until the pool holds what
// it asks for: asking more than the pool has hangs the CTA, hence the assert.
#define REG_CONSUMER 224
#define REG_PRODUCER 56
static_assert(NC * REG_CONSUMER + REG_PRODUCER <= (NC + 1) * ((65536 / (128 * (NC + 1))) & ~7),
              "setmaxnreg budget exceeds the registers the CTA launches with");
// The forward's ping-pong (ring_steps128). The package compiles it in; 0 compiles it out, for
// A/B runs only: tools/ab_nvrtc_options.py's option set "nopingpong" passes -DFWD_PINGPONG=0.
#ifndef FWD_PINGPONG
#define FWD_PINGPONG 1
#endif
// step_mode: how the CTAs choose their step shape. STEPS_AUTO, what the launchers run, chooses per
// CTA after the setup (forward: 128-key steps where they waste nothing, else split rings where the
// warpgroups share under a quarter of the union, else 64-key steps on one ring; dq: the same
// without 128-key steps). The others force one shape in every CTA, for tests and A/B runs:
// STEPS_SINGLE 64-key steps on one ring, STEPS_PAIR 128-key steps (forward only), STEPS_SPLIT
// 64-key steps on split rings.
enum RingSteps { STEPS_SINGLE = 0, STEPS_AUTO = 1, STEPS_PAIR = 2, STEPS_SPLIT = 3 };

// Mask and online softmax of a finished S over NB blocks (64 * NB columns; columns 64b.. belong to
// block b), in place: S becomes P. lim[b][r]: last visible key of this thread's row r in block b's
// terms (-1: the row did not select it). Returns the O rescale factors of the two rows.
//
// m_run is each row's reference maximum, the one P is taken against: it moves only when some row
// of the warp sees a maximum more than max_slack (2^8 in P, raw score units) above its own, as
// FlashAttention-4 does; otherwise P <= 256 (exact in fp32, and bf16/fp16 keep their relative
// precision), every alpha is 1 and rescale_o skips its 64 multiplies. Out = O / l and
// LSE = m_run + log l are the same either way.
template <int NB>
__device__ __forceinline__ void softmax_step(float (&s)[32 * NB], const int (&lim)[NB][2], float (&m_run)[2],
                                             float (&l_run)[2], float scale_log2, float max_slack, float (&alpha)[2]) {
    bool full_rows = true;
#pragma unroll
    for (int b = 0; b < NB; ++b) full_rows &= lim[b][0] >= BLOCK_N - 1 && lim[b][1] >= BLOCK_N - 1;
    if (!__all_sync(0xffffffffu, full_rows)) {   // warp-uniform: most blocks need no mask
        // thread's first column c0 moved to the limit's side, so that each test compares a
        // register with an immediate (c0 + a constant in a register costed 16 more instructions)
        const int c0 = (threadIdx.x & 3) * 2;
        int thr[NB][2];
#pragma unroll
        for (int b = 0; b < NB; ++b)
#pragma unroll
            for (int r = 0; r < 2; ++r) thr[b][r] = lim[b][r] - c0;
#pragma unroll
        for (int n = 0; n < 8 * NB; ++n)
#pragma unroll
            for (int i = 0; i < 4; ++i)
                if ((n & 7) * 8 + (i & 1) > thr[n >> 3][i >> 1]) s[4 * n + i] = -INFLLM_INF;
    }
    float mx[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        mx[r] = -INFLLM_INF;
#pragma unroll
        for (int n = 0; n < 8 * NB; ++n) mx[r] = fmaxf(mx[r], fmaxf(s[4 * n + 2 * r], s[4 * n + 2 * r + 1]));
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
    }
    // (a row whose reference is still -inf moves on any finite maximum)
    const bool move = __any_sync(0xffffffffu, mx[0] > m_run[0] + max_slack || mx[1] > m_run[1] + max_slack);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const float m_new = move ? fmaxf(m_run[r], mx[r]) : m_run[r];
        // log2 domain, the scale folded into the exponent's FMA; all masked so far: keep 0s
        const float m_use = m_new == -INFLLM_INF ? 0.f : m_new * scale_log2;
        alpha[r] = move ? exp2f(m_run[r] * scale_log2 - m_use) : 1.f;
        m_run[r] = m_new;
        float sum = 0.f;
#pragma unroll
        for (int n = 0; n < 8 * NB; ++n) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const float p = exp2f(fmaf(s[4 * n + 2 * r + e], scale_log2, -m_use));
                s[4 * n + 2 * r + e] = p;
                sum += p;
            }
        }
        l_run[r] = l_run[r] * alpha[r] + sum;
    }
}

// A consumer warpgroup's walk over the CTA union in ring order, with the current word of the
// union (sU) and of the warpgroup's own union (mine, a subset) held in registers: a step is a
// few ALU instructions, and shared memory is read once per 32 union blocks. `it` is the ring
// position (rank in the CTA union) of the last block returned. (The walk it replaces, a
// next_set_bit over shared memory plus a membership load per block, held 16% of the consumers'
// Nsight samples, between a step's wgmma issue and its softmax.)
struct RingWalk {
    const unsigned* u;
    const unsigned* mine;
    int n_words, w = 0, it = -1;
    unsigned left = 0u, mleft = 0u;   // bits of word w not walked yet: the union's, this warpgroup's
    __device__ __forceinline__ RingWalk(const unsigned* u_, const unsigned* mine_, int n) : u(u_), mine(mine_), n_words(n) {
        if (n > 0) { left = u[0]; mleft = mine[0]; }
    }
    // the next block of the CTA union (-1 at the end); is_mine: this warpgroup needs it
    __device__ __forceinline__ int next_any(bool& is_mine) {
        while (left == 0u) {
            if (++w >= n_words) { is_mine = false; return -1; }
            left = u[w];
            mleft = mine[w];
        }
        const unsigned low = left & (0u - left);
        is_mine = (mleft & low) != 0u;
        left ^= low;
        mleft &= ~low;
        ++it;
        return (w << 5) + 31 - __clz(low);
    }
    // the next block this warpgroup needs (-1 at the end); the others' still count in `it`
    __device__ __forceinline__ int next_mine() {
        while (mleft == 0u) {
            it += __popc(left);
            if (++w >= n_words) return -1;
            left = u[w];
            mleft = mine[w];
        }
        const unsigned low = mleft & (0u - mleft);
        it += __popc(left & (low - 1u)) + 1;
        left &= ~(low | (low - 1u));   // walked: every bit up to low
        mleft ^= low;
        return (w << 5) + 31 - __clz(low);
    }
};

// O *= alpha, skipped where the warp's reference maxima did not move (softmax_step). A
// warp-uniform branch placed after the S wgmma issue: ptxas keeps the issue back to back (without
// it, it spread the 64 multiplies between the S wgmmas).
template <int D>
__device__ __forceinline__ void rescale_o(float (&o)[D / 2], const float (&alpha)[2]) {
    if (__all_sync(0xffffffffu, alpha[0] == 1.f && alpha[1] == 1.f)) return;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
        o[4 * n] *= alpha[0];
        o[4 * n + 1] *= alpha[0];
        o[4 * n + 2] *= alpha[1];
        o[4 * n + 3] *= alpha[1];
    }
}

// Sizes of the ring CTA's shared-memory tiles (bytes).
template <typename T, int D, int NS>
struct RingLayout {
    static constexpr int M = 64 * NC;              // rows of the CTA
    static constexpr u32 TILE_Q = 64 * D * sizeof(T);
    static constexpr u32 TILE_KV = BLOCK_N * D * sizeof(T);
    static constexpr u32 HALF = 64 * 128;          // one 64-row, 64-element half tile
    static constexpr u32 KSTAGE = BLOCK_N * 128;   // K ring [D half][NS * 64 rows]: a stage's offset in a half
};

// Descriptor offset of K's 16-column step kk in a K ring stage (K-major, 128-byte swizzle).
template <int NS>
__device__ __forceinline__ u32 ring_k_off(int kk) {
    return (u32)(((kk >> 2) * (NS * (u32)(BLOCK_N * 128)) + (kk & 3) * 32) >> 4);
}

// ---- producer warpgroup. visit(it, j, need) for ring position `it` <- block j, in the order the
// loader and the forwarder both follow (need bit g: consumer warpgroup g needs the block); in a
// slot (pair) both blocks go to every warpgroup that needs either, and j < 0 is the missing half of
// an odd last slot (zeros). The current union words sit in registers, as in the consumers' RingWalk.
template <class Visit>
__device__ __forceinline__ void ring_producer_walk(const unsigned* walk_words, const unsigned* sUw, int n_words,
                                                   bool pair, bool split, int ring, Visit&& visit) {
    int w = -1;
    unsigned left = 0u, gw[NC];
    auto next = [&](unsigned& need) {   // the next union block (-1 at the end) and who needs it
        while (left == 0u) {
            if (++w >= n_words) { need = 0u; return -1; }
            left = walk_words[w];
#pragma unroll
            for (int g = 0; g < NC; ++g) gw[g] = sUw[g * n_words + w];
        }
        const unsigned low = left & (0u - left);
        left ^= low;
        need = 0u;
#pragma unroll
        for (int g = 0; g < NC; ++g) need |= (gw[g] & low) ? 1u << g : 0u;
        if (split) need = 1u << ring;   // the other warpgroup gets its own copy
        return (w << 5) + 31 - __clz(low);
    };
    int it = 0;
    unsigned need_a, need_b;
    for (int j = next(need_a); j >= 0;) {
        if (pair) {
            const int j2 = next(need_b);
            visit(it++, j, need_a | need_b);
            visit(it++, j2, need_a | need_b);
            j = j2 < 0 ? -1 : next(need_a);
        } else {
            visit(it++, j, need_a);
            j = next(need_a);
        }
    }
}

// The loader: one thread issues 2 D / 64 TMA boxes per block into its stage, once every consumer
// warpgroup that needed the stage's previous block has released it.
template <typename T, int D, int NS, class Walk, class StageOf, class Empty, class Loaded>
__device__ __forceinline__ void ring_loader(const TmaMap& tmap_k, const TmaMap& tmap_v, int lane, int ring, int h,
                                            int ks, u32 sK, u32 sV, Walk&& walk, StageOf&& stage_of, Empty&& empty,
                                            Loaded&& loaded) {
    constexpr u32 TILE_KV = RingLayout<T, D, NS>::TILE_KV, HALF = RingLayout<T, D, NS>::HALF;
    constexpr u32 KSTAGE = RingLayout<T, D, NS>::KSTAGE;
    // ---- loader: one thread, 2 D / 64 TMA boxes per block
    if (lane != 0) return;
    tma_prefetch_map(tmap_k);
    tma_prefetch_map(tmap_v);
    unsigned prev_need = 0;     // bit NC*s + g: warpgroup g needed the block now in stage s
    unsigned empty_phase = 0;   // bit NS*g + s: parity of the next wait on empty(g, s)
    walk([&](int it, int j, unsigned need) {
        const int s = stage_of(ring, it);
#pragma unroll
        for (int g = 0; g < NC; ++g) {
            if ((prev_need >> (NC * s + g)) & 1u) {
                mbar_wait(empty(g, s), (empty_phase >> (NS * g + s)) & 1u);
                empty_phase ^= 1u << (NS * g + s);
            }
        }
        mbar_arrive_expect_tx(loaded(s), 2 * TILE_KV);
        const int row = j >= 0 ? ks + j * BLOCK_N : -BLOCK_N;   // all out of bounds: zeros
#pragma unroll
        for (int half = 0; half < D / 64; ++half) {
            tma_load_2d(sK + half * (NS * KSTAGE) + s * KSTAGE, tmap_k, h * D + half * 64, row, loaded(s));
            tma_load_2d(sV + s * TILE_KV + half * HALF, tmap_v, h * D + half * 64, row, loaded(s));
        }
        prev_need = (prev_need & ~(((1u << NC) - 1) << (NC * s))) | (need << (NC * s));
    });
}

// The forwarder: waits for a stage's copies, zeroes the rows past the sequence's end, and hands the
// stage to each consumer warpgroup that needs its block.
template <typename T, int D, int NS, bool DQ, class Walk, class StageOf, class FillParity, class Loaded, class Full>
__device__ __forceinline__ void ring_forwarder(int lane, int ring, int Lk, u32 sK, u32 sV, Walk&& walk,
                                               StageOf&& stage_of, FillParity&& fill_parity, Loaded&& loaded,
                                               Full&& full) {
    constexpr int CH = D / 8;
    constexpr u32 TILE_KV = RingLayout<T, D, NS>::TILE_KV, KSTAGE = RingLayout<T, D, NS>::KSTAGE;
    // ---- forwarder: every position's stage fills once, so its parity is the fill count's
    walk([&](int it, int j, unsigned need) {
        const int s = stage_of(ring, it);
        mbar_wait(loaded(s), fill_parity(it));
        const int valid = j >= 0 ? Lk - j * BLOCK_N : BLOCK_N;
        if (valid < BLOCK_N) {      // P is 0 there, but 0 * (non-finite V) would not be
            for (int i = lane; i < (BLOCK_N - valid) * CH; i += 32) {
                const int row = valid + i / CH, ch = i % CH;
                st_shared_zero16(sV + s * TILE_KV + swz128(row, ch, BLOCK_N));
                if constexpr (DQ)   // dS is 0 there, and dq += dS K reads K's rows
                    st_shared_zero16(sK + (ch >> 3) * (NS * KSTAGE) + s * KSTAGE + swz128(row, ch & 7, BLOCK_N));
            }
            fence_proxy_async();    // generic-proxy writes that wgmma reads
            __syncwarp();
        }
        if (lane == 0) {
#pragma unroll
            for (int g = 0; g < NC; ++g)
                if ((need >> g) & 1u) mbar_arrive(full(g, s));
        }
    });
}

// ---- consumer steps. The ring plumbing comes as the caller's lambdas: stage_of(g, it) (ring
// position -> stage), empty(g, s) (the barrier that releases a stage), wait_full(s), block_lims(j,
// lim) (this thread's rows' last visible keys in block j) and issue_pv(s, pa) (O += P V).

// 64-key steps (the forward's where 128-key steps do not pay; dq's always).
template <typename T, int D, int NS, bool DQ, class StageOf, class Empty, class WaitFull, class BlockLims, class IssuePV>
__device__ __forceinline__ void ring_steps64(float (&o)[D / 2], float (&m_run)[2], float (&l_run)[2],
                                             const float (&lse2)[2], const float (&dlt)[2], RingWalk& walk, bool split,
                                             int wg, int wwarp, int lane, u32 myQ, u32 sQ, u32 sO, u32 sK, u32 sV,
                                             u64 k_desc, float scale_log2, float max_slack, StageOf&& stage_of,
                                             Empty&& empty, WaitFull&& wait_full, BlockLims&& block_lims,
                                             IssuePV&& issue_pv) {
    constexpr u32 TILE_Q = RingLayout<T, D, NS>::TILE_Q, TILE_KV = RingLayout<T, D, NS>::TILE_KV;
    constexpr u32 HALF = RingLayout<T, D, NS>::HALF, KSTAGE = RingLayout<T, D, NS>::KSTAGE;
    constexpr int NH = NS / 2;
    // ---- 64-key steps (the forward's where 128-key steps do not pay; dq's always). Per block
    // the first products, then the second:
    //   forward  S = Q K^T with Q in registers as wgmma A fragments (the mma.m16n8k16 A layout
    //            per warp), so S reads only K from shared memory; softmax; O += P V.
    //   dq       S = Q K^T and dP = dO V^T as one group (Q, dO in shared memory: registers go to
    //            dq); dS = P (dP - delta) with P from the saved lse; dq += dS K (K MN-major in its
    //            ring stage).
    float sacc[32];
    float dpacc[DQ ? 32 : 1];
    u32 pa[4][4];                           // P (dq: dS) of the block whose second product is pending
    u32 qa[DQ ? 1 : D / 16][4];
    if constexpr (!DQ) {
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            const int mi = lane >> 3, lr = lane & 7;
            ldmatrix_x4(qa[kk], myQ + swz128(wwarp * 16 + (mi & 1) * 8 + lr, 2 * kk + (mi >> 1), 64));
        }
    }
    const u64 vk_desc = smem_desc(sV, 16, 1024);              // dq: V K-major, B of dP = dO V^T
    const u64 kt_desc = smem_desc(sK, NS * KSTAGE, 1024);     // dq: K MN-major, B of dq += dS K
    auto issue_first = [&](int s) {
        const u64 kd = k_desc + ((warp_uniform(s) * KSTAGE) >> 4);
        if constexpr (DQ) {
            const u64 vd = vk_desc + ((warp_uniform(s) * TILE_KV) >> 4);
            const u64 qd = smem_desc(sQ + warp_uniform(wg) * TILE_Q, 16, 1024);
            const u64 od = smem_desc(sO + warp_uniform(wg) * TILE_Q, 16, 1024);
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) {
                const u32 off = (((kk >> 2) * HALF) + (kk & 3) * 32) >> 4;
                wgmma_ss<T, 64>(sacc, qd + off, kd + ring_k_off<NS>(kk), kk > 0);
            }
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) {
                const u32 off = (((kk >> 2) * HALF) + (kk & 3) * 32) >> 4;
                wgmma_ss<T, 64>(dpacc, od + off, vd + off, kk > 0);
            }
        } else {                            // S = Q K^T, 64 rows x 64 keys, K K-major
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) wgmma_rs<T, 64>(sacc, qa[kk], kd + ring_k_off<NS>(kk), kk > 0);
        }
        wgmma_commit();
    };
    auto issue_second = [&](int s) {
        if constexpr (DQ) {
            const u64 kd = kt_desc + ((warp_uniform(s) * KSTAGE) >> 4);
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) wgmma_rs_tb<T, D>(o, pa[kk], kd + ((kk * 16 * 128) >> 4), 1);
            wgmma_commit();
        } else {
            issue_pv(s, pa);
        }
    };
    // after the first products' wait: S becomes P (forward) or dS (dq), in place
    auto step = [&](const int (&lim)[1][2], float (&alpha)[2]) {
        fence_regs(sacc);
        if constexpr (DQ) {
            fence_regs(dpacc);
            // P = 0 past each row's limit (a row that did not select the block: all of it)
            const int c0 = (lane & 3) * 2;
            if (__all_sync(0xffffffffu, lim[0][0] >= BLOCK_N - 1 && lim[0][1] >= BLOCK_N - 1)) {
#pragma unroll
                for (int i = 0; i < 32; ++i)
                    sacc[i] = exp2f(fmaf(sacc[i], scale_log2, -lse2[(i >> 1) & 1])) * (dpacc[i] - dlt[(i >> 1) & 1]);
            } else {
#pragma unroll
                for (int i = 0; i < 32; ++i) {
                    const int r = (i >> 1) & 1;
                    const float p = ((i >> 2) & 7) * 8 + (i & 1) <= lim[0][r] - c0
                                        ? exp2f(fmaf(sacc[i], scale_log2, -lse2[r])) : 0.f;
                    sacc[i] = p * (dpacc[i] - dlt[r]);
                }
            }
        } else {
            softmax_step<1>(sacc, lim, m_run, l_run, scale_log2, max_slack, alpha);
        }
    };
    // the next block this warpgroup needs and its ring position (j = -1 at the end): its rank
    // in the CTA union, or with split rings in the warpgroup's own union
    int own = -1;
    const int ring_len = split ? NH : NS;   // stages this warpgroup cycles through
    auto advance = [&](int& j, int& it) {
        j = walk.next_mine();
        it = split ? ++own : walk.it;
    };
    int j, it;
    advance(j, it);
    while (j >= 0) {
        float alpha[2];
        int s = stage_of(wg, it);
        wait_full(s);
        wgmma_fence();
        issue_first(s);
        int lim[1][2];                      // block j's mask limits: loaded while S runs
        block_lims(j, lim[0]);
        wgmma_wait<0>();
        step(lim, alpha);
        pack_a_frags<T, 4>(sacc, pa);       // O is rescaled just before its P V, below
        int jn, itn;
        advance(jn, itn);
        while (jn >= 0 && itn - it < ring_len) {
            const int sn = stage_of(wg, itn);
            wait_full(sn);
            wgmma_fence();
            issue_first(sn);
            if constexpr (!DQ) {
                rescale_o<D>(o, alpha);     // while S runs (O holds every earlier P V)
                wgmma_fence();
            }
            issue_second(s);
            int jf, itf;                    // the block after: found while S runs
            advance(jf, itf);
            block_lims(jn, lim[0]);
            wgmma_wait<1>();                // S(n) done; the previous block's second product may still run
            step(lim, alpha);
            wgmma_wait<0>();
            fence_regs(o);
            mbar_arrive(empty(wg, s));
            pack_a_frags<T, 4>(sacc, pa);
            j = jn;
            it = itn;
            s = sn;
            jn = jf;
            itn = itf;
        }
        if constexpr (!DQ) rescale_o<D>(o, alpha);
        wgmma_fence();
        issue_second(s);
        wgmma_wait<0>();
        fence_regs(o);
        mbar_arrive(empty(wg, s));
        j = jn;
        it = itn;
    }
}

// 128-key steps over slots of two ring stages (the forward where every consumer warpgroup needs
// every block of the CTA union).
template <typename T, int D, int NS, class StageOf, class Empty, class WaitFull, class BlockLims, class IssuePV>
__device__ __forceinline__ void ring_steps128(float (&o)[D / 2], float (&m_run)[2], float (&l_run)[2], RingWalk& walk,
                                              bool all_same, int64 m0, int64 rows_total, int wg, u32 sQ, u64 k_desc,
                                              float scale_log2, float max_slack, StageOf&& stage_of, Empty&& empty,
                                              WaitFull&& wait_full, BlockLims&& block_lims, IssuePV&& issue_pv) {
    constexpr u32 TILE_Q = RingLayout<T, D, NS>::TILE_Q;
    constexpr u32 HALF = RingLayout<T, D, NS>::HALF, KSTAGE = RingLayout<T, D, NS>::KSTAGE;
    constexpr int M = RingLayout<T, D, NS>::M;
    // ---- 128-key steps over slots (ring positions it, it + 1; it even, so the two stages'
    // K rows are contiguous). Q is read from shared memory: registers go to the 64-column S.
    float sacc[64];
    u32 pa[8][4];
    auto issue_s = [&](int s) {             // S = Q [K_a; K_b]^T, 64 rows x 128 keys
        // Q's descriptor is rebuilt here, not hoisted: ptxas then keeps it in uniform
        // registers instead of 8 per-lane descriptors moved over before each wgmma
        const u64 q_desc = smem_desc(sQ + warp_uniform(wg) * TILE_Q, 16, 1024);
        const u64 kd = k_desc + ((warp_uniform(s) * KSTAGE) >> 4);
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk)
            wgmma_ss<T, 128>(sacc, q_desc + ((((kk >> 2) * HALF) + (kk & 3) * 32) >> 4), kd + ring_k_off<NS>(kk), kk > 0);
        wgmma_commit();
    };
    // the mask limits of the slot's blocks: loaded while S runs, off the path from S to the softmax
    auto slot_lims = [&](int ja, int jb, int (&lim)[2][2]) {
        block_lims(ja, lim[0]);
        block_lims(jb, lim[1]);
    };
    // the next slot this warpgroup needs and its first ring position: jb = -1 for an odd last
    // slot, ja = -1 at the end
    auto advance = [&](int& ja, int& jb, int& it) {
        bool ma = false, mb = false;
        do {
            ja = walk.next_any(ma);
            it = walk.it;
            jb = ja >= 0 ? walk.next_any(mb) : -1;
        } while (ja >= 0 && !ma && !mb);
    };
    auto wait_slot = [&](int s) {
        wait_full(s);
        wait_full(s + 1);
    };
    auto release_slot = [&](int s) {
        mbar_arrive(empty(wg, s));
        mbar_arrive(empty(wg, s + 1));
    };
    // Ping-pong, as FlashAttention-3: where both warpgroups run the same slots (each needs the
    // whole union, and both have rows), they take turns to issue their wgmma groups (named
    // barriers 3 and 4), so that one warpgroup's softmax runs while the other's products
    // hold the tensor cores, instead of both softmaxes at once with the tensor cores idle.
    int ja, jb, it;
    advance(ja, jb, it);
    const bool pp = FWD_PINGPONG && NC == 2 && all_same && m0 + M <= rows_total && ja >= 0;
    auto my_turn = [&]() { if (pp) named_barrier(3 + wg, 256); };
    auto your_turn = [&]() { if (pp) named_barrier_arrive(3 + (wg ^ 1), 256); };
    if (pp && wg == 1) named_barrier_arrive(3, 256);   // warpgroup 0 goes first
    while (ja >= 0) {
        float alpha[2];
        int s = it % NS;
        wait_slot(s);
        my_turn();
        wgmma_fence();
        issue_s(s);
        your_turn();
        int lim[2][2];
        slot_lims(ja, jb, lim);
        wgmma_wait<0>();
        fence_regs(sacc);
        softmax_step<2>(sacc, lim, m_run, l_run, scale_log2, max_slack, alpha);
        pack_a_frags<T, 8>(sacc, pa);       // O is rescaled just before its P V, below
        int na, nb2, itn;
        advance(na, nb2, itn);
        while (na >= 0 && itn + 1 - it < NS) {
            const int sn = itn % NS;
            wait_slot(sn);
            my_turn();
            wgmma_fence();
            issue_s(sn);
            rescale_o<D>(o, alpha);         // while S runs (O holds every earlier P V), not
            wgmma_fence();                  // between P V's completion and the next issue
            issue_pv(s, pa);
            your_turn();
            int fa, fb, itf;                // the slot after: found while S runs
            advance(fa, fb, itf);
            slot_lims(na, nb2, lim);
            wgmma_wait<1>();
            fence_regs(sacc);
            softmax_step<2>(sacc, lim, m_run, l_run, scale_log2, max_slack, alpha);
            wgmma_wait<0>();
            fence_regs(o);
            release_slot(s);
            pack_a_frags<T, 8>(sacc, pa);
            ja = na;
            jb = nb2;
            it = itn;
            s = sn;
            na = fa;
            nb2 = fb;
            itn = itf;
        }
        my_turn();
        rescale_o<D>(o, alpha);
        wgmma_fence();
        issue_pv(s, pa);
        if (na >= 0 || wg == 0) your_turn();   // every turn warpgroup 0 takes was given: no spare arrival
        wgmma_wait<0>();
        fence_regs(o);
        release_slot(s);
        ja = na;
        jb = nb2;
        it = itn;
    }
}

// ---- epilogues: this thread's rows row_ok[r], r = 0, 1: row m0 + 64 wg + 16 wwarp + lane / 4 + 8 r of
// the flattened (token, head-in-group) space

// dq rows, scaled by the softmax scale.
template <typename T, int D>
__device__ __forceinline__ void ring_epilogue_dq(T* out, const float (&o)[D / 2], const bool (&row_ok)[2], int64 m0,
                                                 int wg, int wwarp, int lane, int G, int qs, int HQ, int h,
                                                 float scale) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        if (!row_ok[r]) continue;
        const int64 R = m0 + 64 * wg + wwarp * 16 + (lane >> 2) + 8 * r;
        const int t = (int)(R / G), g = (int)(R - (int64)t * G);
        T* dst = out + ((int64)(qs + t) * HQ + (int64)h * G + g) * D + (lane & 3) * 2;
#pragma unroll
        for (int n = 0; n < D / 8; ++n)
            *reinterpret_cast<u32*>(dst + n * 8) = pack2<T>(o[4 * n + 2 * r] * scale, o[4 * n + 2 * r + 1] * scale);
    }
}

// out = O / l and lse (natural log); in a later key-range pass merged with what the earlier passes
// wrote, by their lse.
template <typename T, int D>
__device__ __forceinline__ void ring_epilogue_fwd(T* out, float* lse, float (&o)[D / 2], const float (&m_run)[2],
                                                  const float (&l_run)[2], const bool (&row_ok)[2], int64 m0,
                                                  int wg, int wwarp, int lane, int G, int qs, int HQ, int h,
                                                  int total_q, float scale_log2, bool later_pass) {
    const float LN2 = 0.69314718055994531f;
    // a later pass merges into what the earlier ones wrote (out normalised over their keys, lse):
    // every lane reads its rows' earlier lse before any lane of the warp writes one
    float lse_prev[2] = {INFLLM_INF, INFLLM_INF};
    if (later_pass) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int64 R = m0 + 64 * wg + wwarp * 16 + (lane >> 2) + 8 * r;
            if (row_ok[r]) {
                const int t = (int)(R / G), g = (int)(R - (int64)t * G);
                lse_prev[r] = lse[((int64)h * G + g) * total_q + qs + t];
            }
        }
        __syncwarp();
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float l = l_run[r];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        if (!row_ok[r]) continue;
        const int64 R = m0 + 64 * wg + wwarp * 16 + (lane >> 2) + 8 * r;
        const int t = (int)(R / G), g = (int)(R - (int64)t * G);
        float inv = l > 0.f ? 1.f / l : 0.f;
        float row_lse = l > 0.f ? (m_run[r] * scale_log2 + log2f(l)) * LN2 : INFLLM_INF;
        T* dst = out + ((int64)(qs + t) * HQ + (int64)h * G + g) * D + (lane & 3) * 2;
        if (later_pass) {
            if (l == 0.f) continue;                         // nothing in this pass: keep the earlier result
            if (lse_prev[r] != INFLLM_INF) {
                // out = (w_prev out_prev + w_this o / l) / (w_prev + w_this), weights exp(lse - max)
                const float mx = fmaxf(lse_prev[r], row_lse);
                const float w_prev = __expf(lse_prev[r] - mx), w_this = __expf(row_lse - mx);
                const float norm = 1.f / (w_prev + w_this);
                const float c_prev = w_prev * norm;
                inv *= w_this * norm;
#pragma unroll
                for (int n = 0; n < D / 8; ++n) {
                    const float2 prev = unpack2<T>(*reinterpret_cast<const u32*>(dst + n * 8));
                    o[4 * n + 2 * r] = fmaf(o[4 * n + 2 * r], inv, c_prev * prev.x);
                    o[4 * n + 2 * r + 1] = fmaf(o[4 * n + 2 * r + 1], inv, c_prev * prev.y);
                }
                inv = 1.f;
                row_lse = mx + __logf(w_prev + w_this);
            }
        }
#pragma unroll
        for (int n = 0; n < D / 8; ++n)
            *reinterpret_cast<u32*>(dst + n * 8) = pack2<T>(o[4 * n + 2 * r] * inv, o[4 * n + 2 * r + 1] * inv);
        if ((lane & 3) == 0)
            lse[((int64)h * G + g) * total_q + qs + t] = row_lse;
    }
}

// The CTA body of both ring kernels. DQ = false: the forward (out, lse written). DQ = true:
// the backward's dq over the same ring (out = dq; lse and delta read; dout tiles beside Q).
template <typename T, int D, int NS, bool DQ, int QH = 0>
__device__ __forceinline__ void
ring_cta_sm90(const T* __restrict__ q, const T* __restrict__ dout, const TmaMap& tmap_k, const TmaMap& tmap_v,
              const unsigned* __restrict__ masks, const int* __restrict__ mask_base,
              const int* __restrict__ cu_seqlens_q, const int* __restrict__ cu_seqlens_k,
              T* __restrict__ out, float* __restrict__ lse, const float* __restrict__ delta,
              int total_q, int HQ, int H, int G, int n_words, long long mask_h_stride, int mask_q_block,
              float scale_log2, float scale, int causal, int step_mode, int blk_lo, int blk_hi,
              int* __restrict__ cta_split, int split_min, int x_off, int kv_group = 1) {
    // QH (docs/stage2_fwd.md, "Per-query-head mask rows"): 0 one mask row per KV head; 2 one per query
    // head, one query head per CTA (h is the query head, G = 1 in the row space; K/V head h / kv_group)
    static_assert(QH == 0 || QH == 2, "QH: 0 (rows per KV head) or 2 (one query head per CTA)");
    constexpr int M = 64 * NC;
    constexpr int CH = D / 8;
    constexpr u32 TILE_Q = 64 * D * sizeof(T);
    constexpr u32 TILE_KV = BLOCK_N * D * sizeof(T);
    constexpr u32 HALF = 64 * 128;             // bytes of one 64-row, 64-element half tile
    extern __shared__ unsigned char smem[];
    const u32 raw = smem_u32(smem);
    const u32 base = (raw + 1023u) & ~1023u;   // swizzled tiles start on 1 KB boundaries
    // Q tiles, then (DQ) the dout tiles, then the K and V rings
    const u32 sQ = base, sO = sQ + NC * TILE_Q, sK = sO + (DQ ? NC * TILE_Q : 0), sV = sK + NS * TILE_KV;
    // one full and one empty barrier per (consumer warpgroup, stage): a warpgroup only ever
    // touches the barriers of blocks it needs, so skipping costs it nothing
    const u32 bar_full = sV + NS * TILE_KV, bar_empty = bar_full + 8 * NS * NC;
    auto full = [&](int g, int s) { return bar_full + 8 * (g * NS + s); };
    auto empty = [&](int g, int s) { return bar_empty + 8 * (g * NS + s); };
    const u32 bar_loaded = bar_empty + 8 * NS * NC;   // one per stage: the TMA copies landed
    auto loaded = [&](int s) { return bar_loaded + 8 * s; };
    unsigned* sU = reinterpret_cast<unsigned*>(smem + (bar_loaded + 8 * NS - raw));   // CTA union
    unsigned* sUw = sU + n_words;                                                    // [NC][n_words]

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, wg = warp >> 2;
    // QH 2: grid.x runs over (row tile, head of the group), heads fastest, so that the group's heads
    // of one tile run together and share its K/V blocks in the L2; grid.y is the KV head
    const int h = QH == 2 ? (int)(blockIdx.y * kv_group + blockIdx.x % kv_group) : (int)blockIdx.y;
    const int b = blockIdx.z;
    // key-range passes (cta_split != null; see the launch contract): pass 0 decides per CTA and
    // records it; a later pass runs only the CTAs that split (checked first: most CTAs of a
    // block-shared selection leave here), and only those whose rows can see a block of its range
    const bool passes = cta_split != nullptr, later_pass = passes && blk_lo > 0;
    const int cta_x = (QH == 2 ? (int)(blockIdx.x / kv_group) : (int)blockIdx.x) + x_off;
    const int cta_id = (b * H + h) * ((int)gridDim.x + x_off) + cta_x;
    if (later_pass && cta_split[cta_id] == 0) return;
    S2Seq sq;
    s2_seq_bounds(sq, cu_seqlens_q, cu_seqlens_k, b);
    s2_seq_rows(sq, G);
    // dq: last tiles first (they see the most blocks when causal), so the longest CTAs start early
    // (QH 2: over the row tiles, the group's heads of a tile still side by side)
    const int64 m0 = (int64)(DQ ? (QH == 2 ? gridDim.x / kv_group - 1 - blockIdx.x / kv_group : gridDim.x - 1 - blockIdx.x)
                                : cta_x) * M;
    if (m0 >= sq.rows_total) return;
    s2_seq_shift(sq, causal);
    const int nb = min(key_blocks(sq.Lk), n_words * 32);
    if (later_pass && last_visible_block(nb, causal, (int)((min(m0 + M, sq.rows_total) - 1) / G), sq.shift) < blk_lo)
        return;
    const unsigned* mrows = seq_mask_rows(masks, mask_base, b, h, mask_h_stride, n_words);

    // ---- each consumer warpgroup's Q tile: issued first, so that it lands during the setup
    if (wg < NC) {
        for (int i = tid & 127; i < 64 * CH; i += 128) {
            const int row = i / CH, ch = i % CH;
            int bytes;
            const T* src = q_row_chunk(q, m0 + 64 * wg + row, sq.rows_total, G, sq.qs, HQ, h, D, ch, bytes);
            cp_async_16(sQ + wg * TILE_Q + swz128(row, ch, 64), src, bytes);
            if constexpr (DQ)
                cp_async_16(sO + wg * TILE_Q + swz128(row, ch, 64), bytes ? dout + (src - q) : dout, bytes);
        }
        cp_async_commit();
    }

    // ---- per-warpgroup unions (clipped to what its last row may see, and to the pass's key range
    // except in pass 0, which first counts the whole union) and the CTA union
    bool same_union = true;     // every warpgroup with rows needs every block of the CTA union
    const bool first_pass = passes && !later_pass;
    const int clip_hi = first_pass ? nb : min(nb, blk_hi);
    int n_union = 0;            // pass 0: this thread's words of the whole CTA union, counted
    unsigned mixed = 0u;        // bit g: rows of warpgroup g differ in some block of its union (this thread's words)
    {
        int q_lo[NC], q_hi[NC], lim[NC];
#pragma unroll
        for (int g = 0; g < NC; ++g) {
            const int64 r_lo = m0 + 64 * g, r_hi = min(m0 + 64 * (g + 1), sq.rows_total) - 1;
            if (r_lo > r_hi) {
                q_lo[g] = 1; q_hi[g] = 0; lim[g] = -1;
                continue;
            }
            const int t_lo = (int)(r_lo / G), t_hi = (int)(r_hi / G);
            q_lo[g] = t_lo / mask_q_block;
            q_hi[g] = t_hi / mask_q_block;
            lim[g] = last_visible_block(clip_hi, causal, t_hi, sq.shift);
        }
        for (int w = tid; w < n_words; w += 128 * (NC + 1)) {
            unsigned u[NC], all = 0;
#pragma unroll
            for (int g = 0; g < NC; ++g) {
                unsigned a;
                const unsigned o = rows_or_and(mrows, n_words, q_lo[g], q_hi[g], w, a);
                u[g] = clip_word_below(clip_word(o, w, lim[g]), w, blk_lo);
                if (u[g] != clip_word_below(clip_word(a, w, lim[g]), w, blk_lo)) mixed |= 1u << g;
                sUw[g * n_words + w] = u[g];
                all |= u[g];
            }
            sU[w] = all;
            n_union += __popc(all);
#pragma unroll
            for (int g = 0; g < NC; ++g) same_union &= q_lo[g] > q_hi[g] || u[g] == all;   // no rows: no work
        }
    }
    __shared__ int s_union_count[4 * (NC + 1)];
    __shared__ unsigned s_mixed[4 * (NC + 1)];   // per warp, published by the barrier below
    mixed = __reduce_or_sync(0xffffffffu, mixed);
    if (lane == 0) s_mixed[warp] = mixed;
    if (first_pass) {
        n_union = __reduce_add_sync(0xffffffffu, n_union);
        if (lane == 0) s_union_count[warp] = n_union;
    }
    if (tid == 0) {
        for (int i = 0; i < NS * NC; ++i) {
            mbar_init(bar_full + 8 * i, 1);       // the forwarding producer warp
            mbar_init(bar_empty + 8 * i, 128);    // one consumer warpgroup
        }
        for (int s = 0; s < NS; ++s) mbar_init(loaded(s), 1);   // the loader's arrive.expect_tx
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    // (also the barrier that publishes the unions and the mbarriers) 128-key steps where allowed
    // and no warpgroup would compute a block it did not select
    const bool all_same = __syncthreads_and(same_union);
    if (first_pass) {
        // a CTA whose tokens picked many different blocks (per-token selections: a union of over
        // split_min blocks) splits over the passes; the others do all their blocks in this pass
        int total = 0;
#pragma unroll
        for (int i = 0; i < 4 * (NC + 1); ++i) total += s_union_count[i];
        const bool split_cta = total > split_min;
        if (tid == 0) cta_split[cta_id] = split_cta ? 1 : 0;
        if (split_cta) {
            for (int w = tid; w < n_words; w += 128 * (NC + 1)) {
                sU[w] = clip_word(sU[w], w, blk_hi - 1);
#pragma unroll
                for (int g = 0; g < NC; ++g) sUw[g * n_words + w] = clip_word(sUw[g * n_words + w], w, blk_hi - 1);
            }
            __syncthreads();
        }
    }
    // dq: 64-key steps only
    const bool pair = !DQ && (step_mode == STEPS_PAIR || (step_mode == STEPS_AUTO && all_same));
    // Split rings, in CTAs of 64-key steps whose warpgroups need few common blocks (per-token
    // picks at long context): each warpgroup gets its own NS / 2 stages, filled along its own
    // union, so that neither holds stages the other one waits for; a block both need is loaded
    // twice. STEPS_SPLIT splits every such CTA (tests), STEPS_AUTO those where under a quarter of the
    // union is common. Every warp counts the same shared words, so all agree.
    constexpr int NH = NS / 2;
    bool split = false;
    if (NC == 2 && !pair && (step_mode == STEPS_AUTO || step_mode == STEPS_SPLIT)) {
        int both = 0, any = 0;
        for (int w = lane; w < n_words; w += 32) {
            both += __popc(sUw[w] & sUw[n_words + w]);
            any += __popc(sU[w]);
        }
        both = __reduce_add_sync(0xffffffffu, both);
        any = __reduce_add_sync(0xffffffffu, any);
        split = step_mode == STEPS_SPLIT || 4 * both < any;
    }
    // ring position -> stage, and the parity of that stage's fills up to it (constant divisors)
    auto stage_of = [&](int g, int it) { return split ? g * NH + it % NH : it % NS; };
    auto fill_parity = [&](int it) { return (split ? it / NH : it / NS) & 1; };

    if (wg == NC) {
        // ================= producer warpgroup: K/V ring
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" :: "n"(REG_PRODUCER) : "memory");   // registers go to the consumers
        const int pwarp = warp - 4 * NC;
        if (pwarp > (split ? 3 : 1)) return;
        // warps 0 and 1 load and forward; with split rings warps 2 and 3 do the same for
        // warpgroup 1's ring and warps 0 and 1 serve warpgroup 0's
        const int ring = split ? pwarp >> 1 : 0;
        const unsigned* walk_words = split ? sUw + ring * n_words : sU;
        auto walk = [&](auto&& visit) { ring_producer_walk(walk_words, sUw, n_words, pair, split, ring, visit); };
        if ((pwarp & 1) == 0)
            ring_loader<T, D, NS>(tmap_k, tmap_v, lane, ring, QH == 2 ? h / kv_group : h, sq.ks, sK, sV, walk,
                                  stage_of, empty, loaded);
        else
            ring_forwarder<T, D, NS, DQ>(lane, ring, sq.Lk, sK, sV, walk, stage_of, fill_parity, loaded, full);
        return;
    }

    // ================= consumer warpgroup `wg`: 64 rows
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" :: "n"(REG_CONSUMER) : "memory");
    const int wwarp = warp & 3;
    const u32 myQ = sQ + wg * TILE_Q;
    cp_async_wait<0>();     // this thread's Q copies, issued before the setup
    fence_proxy_async();
    named_barrier(1 + wg, 128);

    bool row_ok[2];
    int rk[2];
    const unsigned* mrow[2];
    float lse2[2], dlt[2];                      // dq: each row's lse (log2 units) and delta
    if constexpr (DQ) {
        dq_row_state(m0 + 64 * wg + wwarp * 16 + (lane >> 2), sq.rows_total, 0, G, causal, sq.shift, sq.Lk, mrows, mask_q_block,
                     n_words, h, total_q, sq.qs, lse, delta, row_ok, rk, mrow, lse2, dlt);
    } else {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int64 R = m0 + 64 * wg + wwarp * 16 + (lane >> 2) + 8 * r;
            row_ok[r] = R < sq.rows_total;
            const int t = row_ok[r] ? (int)(R / G) : 0;
            rk[r] = causal ? t + sq.shift : sq.Lk - 1;
            mrow[r] = mrows + (int64)(t / mask_q_block) * n_words;
        }
    }
    float o[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
    float m_run[2] = {-INFLLM_INF, -INFLLM_INF}, l_run[2] = {0.f, 0.f};
    const float max_slack = 8.f / scale_log2;   // 2^8 in P, in raw score units (softmax_step)
    RingWalk walk(sU, sUw + wg * n_words, n_words);

    unsigned full_phase = 0;                    // bit s: parity of the next wait on full(wg, s)
    auto wait_full = [&](int s) {
        mbar_wait(full(wg, s), (full_phase >> s) & 1u);
        full_phase ^= 1u << s;
    };
    // last visible key of this thread's two rows in block j's terms: -1 when the row did not
    // select it (or j < 0, the missing half of a slot). Each row's mask word is kept and loaded
    // again only when j moves to another word (blocks come in ascending order).
    int row_w = -1;                             // word index of row_bits (the same for both rows)
    unsigned row_bits[2] = {0u, 0u};
    // Where every row of this warpgroup selected every block of its union (block-shared
    // selections, query-block layouts) and the walk only brings blocks of that union (64-key steps
    // walk their own; 128-key slots do where all warpgroups need the whole CTA union), a row's
    // limit needs no mask word: at long contexts each block of a walk sits in another word, and
    // its load was ~1% of the instructions (docs/stage2_fwd.md, "sm_90a kernel: warp specialisation
    // and the K/V ring").
    bool rows_share = true;
#pragma unroll
    for (int i = 0; i < 4 * (NC + 1); ++i) rows_share &= ((s_mixed[i] >> wg) & 1u) == 0u;
    rows_share = rows_share && (!pair || all_same);
    auto block_lims = [&](int j, int (&lim)[2]) {
        if (rows_share) {                       // warp-uniform
#pragma unroll
            for (int r = 0; r < 2; ++r) lim[r] = j >= 0 && row_ok[r] ? rk[r] - j * BLOCK_N : -1;
            return;
        }
        if (j >= 0 && (j >> 5) != row_w) {      // warp-uniform
            row_w = j >> 5;
#pragma unroll
            for (int r = 0; r < 2; ++r) row_bits[r] = row_ok[r] ? __ldg(mrow[r] + row_w) : 0u;
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const bool sel = j >= 0 && ((row_bits[r] >> (j & 31)) & 1u);
            lim[r] = sel ? rk[r] - j * BLOCK_N : -1;
        }
    };
    // Descriptors are built once: the start-address field holds addr >> 4 and shared memory lies
    // below 256 KB, so moving a descriptor by b bytes is adding b >> 4 (no carry out of the field).
    // Every per-step part (ring stage, warpgroup) goes through warp_uniform, so that ptxas builds
    // the descriptors in uniform registers: from per-lane values it moved each one to a uniform
    // register before every wgmma (48 R2UR and ~50 more moves and adds per 128-key step).
    const u64 k_desc = smem_desc(sK, 16, 1024);
    const u64 v_desc = smem_desc(sV, HALF, 1024);
    // O += P V over NB consecutive ring stages from s, P from registers, V MN-major
    auto issue_pv = [&](int s, auto& pa) {
        constexpr int NKK = sizeof(pa) / sizeof(pa[0]);
        const u64 vd = v_desc + ((warp_uniform(s) * TILE_KV) >> 4);
#pragma unroll
        for (int kk = 0; kk < NKK; ++kk)
            wgmma_rs_tb<T, D>(o, pa[kk], vd + (((kk >> 2) * TILE_KV + (kk & 3) * 16 * 128) >> 4), 1);
        wgmma_commit();
    };

    // Software pipeline over the steps this warpgroup needs, in runs: inside a run, step n's
    // S = Q K^T and step n-1's O += P V go to the tensor cores back to back and the warpgroup
    // waits only for S, so the softmax of n overlaps the P V of n-1. A run ends where the next
    // step's last block is a ring length (NS, or NS / 2 with split rings) or more positions past
    // the held step's first (the producer may need the held stages back before it can fill it):
    // the pending P V is flushed and its stages released. Every wgmma sits in straight-line code
    // (loop bodies), so ptxas keeps them asynchronous.
    if (!pair)
        ring_steps64<T, D, NS, DQ>(o, m_run, l_run, lse2, dlt, walk, split, wg, wwarp, lane, myQ, sQ, sO, sK, sV, k_desc,
                                   scale_log2, max_slack, stage_of, empty, wait_full, block_lims, issue_pv);
    else
        ring_steps128<T, D, NS>(o, m_run, l_run, walk, all_same, m0, sq.rows_total, wg, sQ, k_desc, scale_log2,
                                max_slack, stage_of, empty, wait_full, block_lims, issue_pv);
    // ---- epilogue
    if constexpr (DQ)
        ring_epilogue_dq<T, D>(out, o, row_ok, m0, wg, wwarp, lane, G, sq.qs, HQ, h, scale);
    else
        ring_epilogue_fwd<T, D>(out, lse, o, m_run, l_run, row_ok, m0, wg, wwarp, lane, G, sq.qs, HQ, h, total_q,
                                scale_log2, later_pass);
}
