// common/mma_sm80.cuh: the SM80 tensor-core and async-copy primitives (run on sm_80 .. sm_90).
//
// Fragment layouts of mma.m16n8k16 (PTX ISA), with g = lane / 4 and c = lane % 4:
//   A 16x16 (4 x b32): a0 (row g, k 2c..2c+1), a1 (row g+8, k 2c..), a2 (row g, k 8+2c..), a3 (row g+8, k 8+2c..)
//   B 16x8  (2 x b32): b0 (k 2c..2c+1, col g), b1 (k 8+2c.., col g)
//   C 16x8  (4 x f32): c0,c1 (row g, cols 2c, 2c+1), c2,c3 (row g+8, cols 2c, 2c+1)
// ldmatrix.x4: lanes 8i..8i+7 address the 8 rows of matrix i; register i receives matrix i with
// lane holding (row lane/4, cols 2(lane%4), +1) — or, with .trans, of the transposed matrix.
#pragma once
#include "common/types.cuh"

typedef unsigned int u32;

__device__ __forceinline__ u32 smem_u32(const void* p) {
    return static_cast<u32>(__cvta_generic_to_shared(p));
}

// 16-byte global -> shared copy that bypasses L1; src_bytes = 0 writes zeros without reading.
__device__ __forceinline__ void cp_async_16(u32 dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(dst), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" :: "n"(N)); }

__device__ __forceinline__ void ldmatrix_x4(u32 r[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(u32 r[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// C += A * B for one 16x8x16 tile, fp32 accumulate.
template <typename T> __device__ __forceinline__ void mma_16816(float c[4], const u32 a[4], u32 b0, u32 b1);
template <> __device__ __forceinline__ void mma_16816<__nv_bfloat16>(float c[4], const u32 a[4], u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <> __device__ __forceinline__ void mma_16816<__half>(float c[4], const u32 a[4], u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two floats rounded to T and packed into one b32 register (lower address = x).
template <typename T> __device__ __forceinline__ u32 pack2(float x, float y);
template <> __device__ __forceinline__ u32 pack2<__nv_bfloat16>(float x, float y) {
    __nv_bfloat162 v = __floats2bfloat162_rn(x, y);
    return *reinterpret_cast<u32*>(&v);
}
template <> __device__ __forceinline__ u32 pack2<__half>(float x, float y) {
    __half2 v = __floats2half2_rn(x, y);
    return *reinterpret_cast<u32*>(&v);
}
// The two elements of a packed b32 register as floats (inverse of pack2 up to rounding).
template <typename T> __device__ __forceinline__ float2 unpack2(u32 w);
template <> __device__ __forceinline__ float2 unpack2<__nv_bfloat16>(u32 w) {
    return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&w));
}
template <> __device__ __forceinline__ float2 unpack2<__half>(u32 w) {
    return __half22float2(*reinterpret_cast<__half2*>(&w));
}

// Shared-memory tiles of the SM80 kernels are rows of D/8 16-byte chunks; chunk c of row r is
// stored at chunk c ^ (r % 8) so that the 8 row addresses of one ldmatrix hit 8 different bank
// groups. Index (in 16-byte chunks) of chunk `chunk` of `row`:
template <int D>
__device__ __forceinline__ int swz(int row, int chunk) {
    return row * (D / 8) + (chunk ^ (row & 7));
}

// ldmatrix.x4 lane addresses (byte offsets) into a swizzled tile of rowb-byte rows, whose 16-byte
// chunk ch of row r sits at chunk ch ^ (r % 8); entry c covers k chunks 2c, 2c + 1 of a 64-element
// half (add 128 per further half):
//   a_off  the A operand: 16 rows from row0 (a multiple of 8);
//   b_off  a B operand stored N-major: 16 N rows (two n8 tiles) x 16 k;
//   t_off  a B operand stored K-major, read with ldmatrix .trans: 16 K rows x 16 n.
__device__ __forceinline__ void ldsm_offsets(int lane, int row0, int rowb, u32 (&a_off)[4], u32 (&b_off)[4],
                                             u32 (&t_off)[4]) {
    const int mi = lane >> 3, lr = lane & 7;
#pragma unroll
    for (int c = 0; c < 4; ++c) {
        a_off[c] = (row0 + (mi & 1) * 8 + lr) * rowb + (((2 * c + (mi >> 1)) ^ lr) << 4);
        b_off[c] = ((mi >> 1) * 8 + lr) * rowb + (((2 * c + (mi & 1)) ^ lr) << 4);
        t_off[c] = ((mi & 1) * 8 + lr) * rowb + (((2 * c + (mi >> 1)) ^ lr) << 4);
    }
}

// S = Q K^T of one 16-row x 16-key tile over D, from swizzled shared-memory tiles at q_s and kt
// (offsets from ldsm_offsets): s[t][e] is row g + 8 (e / 2), key 8 t + 2 c + e % 2 (g = lane / 4,
// c = lane % 4). Q fragments are read from shared memory at every k step: holding them in registers
// (D / 4 per thread) would cost the decode kernels the occupancy that keeps their loads in flight.
template <typename T, int D>
__device__ __forceinline__ void qk_tile_16x16(float (&s)[2][4], u32 q_s, u32 kt, const u32 (&a_off)[4],
                                              const u32 (&b_off)[4]) {
#pragma unroll
    for (int t = 0; t < 2; ++t) s[t][0] = s[t][1] = s[t][2] = s[t][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
        u32 qf[4], bk[4];
        ldmatrix_x4(qf, q_s + a_off[ks & 3] + (ks >> 2) * 128);
        ldmatrix_x4(bk, kt + b_off[ks & 3] + (ks >> 2) * 128);
        mma_16816<T>(s[0], qf, bk[0], bk[1]);
        mma_16816<T>(s[1], qf, bk[2], bk[3]);
    }
}

// The A fragment of a 16x16 operand from two 16x8 accumulator tiles (columns 0-7 and 8-15): the
// C layout of mma.m16n8k16 is its A layout, so P or dS feeds the next product from registers.
template <typename T>
__device__ __forceinline__ void a_from_acc(const float (&lo)[4], const float (&hi)[4], u32 (&a)[4]) {
    a[0] = pack2<T>(lo[0], lo[1]);
    a[1] = pack2<T>(lo[2], lo[3]);
    a[2] = pack2<T>(hi[0], hi[1]);
    a[3] = pack2<T>(hi[2], hi[3]);
}
