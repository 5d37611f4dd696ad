// The decode top-k's device code (sel_topk_row and the CTA top-k of kernels_cu/decode/select_decode.cu) run
// on host threads: one std::thread per CUDA thread, __syncthreads as a CTA barrier, the warp intrinsics
// as exchanges between the 32 threads of a warp, shared-memory atomics as host atomics. A CPU check of
// the kernel source itself against a stable sort (tests/decode/test_select_decode.py compiles and runs
// it; the GPU tests run the kernel). Only the fp32 (kind 0) and bf16 (kind 1) key paths are modelled.
// Usage: topk_host_harness SEED CASES; exit status 1 on a mismatch.
#include <algorithm>
#include <array>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <thread>
#include <vector>
using std::max; using std::min;
#define __device__
#define __forceinline__ inline
#define __restrict__
#define INFLLM_INF INFINITY
#define S1_FULL 0xffffffffu
#define SEL_FINE_KS 32
#define SEL_FINE_ST 16
typedef long long int64;
struct int4 { int x, y, z, w; };
inline int4 make_int4(int a, int b, int c, int d) { return {a, b, c, d}; }
inline int sel_windows(int L, int ks, int st) { return L < ks ? 0 : (L - ks) / st + 1; }

struct Ctx {
    int nthreads;
    std::barrier<>* bar;
    std::vector<std::barrier<>*> wbar;
    std::vector<std::array<unsigned, 32>> xch;
};
static Ctx* g;
thread_local int t_tid;
static void __syncthreads() { g->bar->arrive_and_wait(); }
static std::array<unsigned, 32> wx(unsigned v) {
    const int w = t_tid >> 5, l = t_tid & 31;
    g->xch[w][l] = v;
    g->wbar[w]->arrive_and_wait();
    std::array<unsigned, 32> a = g->xch[w];
    g->wbar[w]->arrive_and_wait();
    return a;
}
static unsigned __ballot_sync(unsigned, bool p) { auto a = wx(p); unsigned m = 0; for (int i = 0; i < 32; ++i) m |= (a[i] ? 1u : 0u) << i; return m; }
static int __shfl_up_sync(unsigned, int v, int o) { auto a = wx((unsigned)v); int l = t_tid & 31; return l >= o ? (int)a[l - o] : v; }
static unsigned __reduce_add_sync(unsigned, unsigned v) { auto a = wx(v); unsigned s = 0; for (auto x : a) s += x; return s; }
static unsigned __reduce_max_sync(unsigned, unsigned v) { auto a = wx(v); unsigned s = 0; for (auto x : a) s = max(s, x); return s; }
static int __ffs(unsigned x) { return __builtin_ffs((int)x); }
static int __popc(unsigned x) { return __builtin_popcount(x); }
static int atomicAdd(int* p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
static float __ldcg(const float* p) { return *p; }

template <typename KT> struct Score;
static unsigned short f2bf(float x) {   // round to nearest even (no NaN inputs)
    unsigned u; memcpy(&u, &x, 4);
    return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
template <> struct Score<unsigned short> {
    static constexpr int KEY_BITS = 16;
    static unsigned short bits(float x, int) { return f2bf(x); }
    static unsigned short key(unsigned short b) { unsigned u = b; return (unsigned short)((u & 0x8000u) ? (~u & 0xffffu) : (u | 0x8000u)); }
};
template <> struct Score<unsigned> {
    static constexpr int KEY_BITS = 32;
    static unsigned bits(float x, int) { unsigned u; memcpy(&u, &x, 4); return u; }
    static unsigned key(unsigned b) { return (b & 0x80000000u) ? ~b : (b | 0x80000000u); }
};
template <typename KT> KT score_key(float x, int kind) { return Score<KT>::key(Score<KT>::bits(x, kind)); }

#include "sel_topk_extract.cu"   // written by the test: the .cu from the CTA top-k to sel_topk_row

template <typename KT>
static int run_case(std::mt19937& rng, int it) {
    const int kind = sizeof(KT) == 4 ? 0 : 1;
    const int outs[] = {1, 5, 63, 64, 65, 100, 333, 1500, 2048, 4097};
    const int out_len = outs[rng() % 10];
    const int T1 = 1 + rng() % 3;
    const int nbr = 16 * T1, R1 = (out_len + 1 + nbr - 1) / nbr;
    const int olp = (out_len + 63) / 64 * 64;
    const int Lmax = 64 * out_len;
    int L;
    switch (rng() % 3) { case 0: L = Lmax; break; case 1: L = 1 + rng() % Lmax; break; default: L = 1 + rng() % 200; }
    const int topk = 1 + rng() % 120, local = rng() % 8, init = rng() % 3;
    const int K = min(topk + local, out_len);
    const int prefix = rng() % 2 ? 0 : 64 * (1 + rng() % 3);
    const int threads_opts[] = {32, 128, 256, 512};
    const int nthreads = threads_opts[rng() % 4];
    const int pattern = rng() % 5;
    std::normal_distribution<float> nd;
    auto val = [&]() -> float {
        switch (pattern) {
            case 0: return nd(rng);
            case 1: { float v[] = {0.25f, 0.5f, 1.f, 2.f, -INFINITY}; return v[rng() % 5]; }
            case 2: return 0.5f;
            case 3: return -INFINITY;
            default: { unsigned u = sizeof(KT) == 4 ? 0x3f800000u + rng() % 6 : (0x3f80u + rng() % 6) << 16; float f; memcpy(&f, &u, 4); return f; }
        }
    };
    std::vector<float> blk(nbr * R1), lead(R1);
    for (auto& x : blk) x = val();
    for (auto& x : lead) x = val();
    // reference
    const int n1 = sel_windows(L, 32, 16), nbv = n1 > 0 ? n1 / 4 + 1 : 0, qb = max(L - 1, 0) / 64;
    std::vector<unsigned> keys(out_len);
    for (int j = 0; j < out_len; ++j) {
        float x = -INFINITY;
        if (j < nbv) {
            x = blk[j];
            const int rn = (j + 1) / nbr;
            if ((j + 1) % nbr == 0 && rn < R1 && rn * nbr * 4 - 1 < n1) x = fmaxf(x, lead[rn]);
        }
        if (j < init || (j <= qb && j >= qb - local)) x = INFINITY;
        keys[j] = score_key<KT>(x, kind);
    }
    std::vector<int> idx(out_len);
    for (int j = 0; j < out_len; ++j) idx[j] = j;
    std::stable_sort(idx.begin(), idx.end(), [&](int a, int b) { return keys[a] > keys[b]; });
    std::vector<int> want(idx.begin(), idx.begin() + K);
    std::sort(want.begin(), want.end());
    for (auto& j : want) if (j > qb) j = -1;
    // the CUDA code on host threads
    std::vector<unsigned char> smem(olp * sizeof(KT) + 584 * 4 + 16, 0xAB);
    std::vector<int> out(K, -12345);
    Ctx ctx;
    ctx.nthreads = nthreads;
    std::barrier<> bar(nthreads);
    ctx.bar = &bar;
    std::vector<std::unique_ptr<std::barrier<>>> wb;
    for (int w = 0; w < nthreads / 32; ++w) { wb.emplace_back(new std::barrier<>(32)); ctx.wbar.push_back(wb.back().get()); }
    ctx.xch.resize(nthreads / 32);
    g = &ctx;
    std::vector<std::thread> ths;
    for (int t = 0; t < nthreads; ++t)
        ths.emplace_back([&, t]() {
            t_tid = t;
            sel_topk_row<KT>(reinterpret_cast<KT*>(smem.data()), reinterpret_cast<int*>(smem.data() + olp * sizeof(KT)),
                             blk.data(), lead.data(), L, 0, 0, 1, 1, T1, R1, out_len, olp, K, K, init, local, kind,
                             prefix, out.data(), t, nthreads);
        });
    for (auto& th : ths) th.join();
    if (out != want) {
        printf("MISMATCH it=%d KT=%zu out_len=%d L=%d K=%d prefix=%d threads=%d pattern=%d\n", it, sizeof(KT), out_len,
               L, K, prefix, nthreads, pattern);
        for (int i = 0; i < K && i < 20; ++i) printf("  %d %d\n", out[i], want[i]);
        return 1;
    }
    return 0;
}

int main(int argc, char** argv) {
    std::mt19937 rng(argc > 1 ? atoi(argv[1]) : 1);
    int bad = 0, n = argc > 2 ? atoi(argv[2]) : 300;
    for (int it = 0; it < n; ++it) bad += it % 2 ? run_case<unsigned>(rng, it) : run_case<unsigned short>(rng, it);
    printf("%d cases, %d mismatches\n", n, bad);
    return bad != 0;
}
