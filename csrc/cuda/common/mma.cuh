// Tensor-core building blocks: mma.sync m16n8k16 (bf16 or fp16 operands, fp32 accumulators),
// ldmatrix fragment loads from row-major shared tiles, and cp.async copies.
//
// Fragment layout of m16n8k16 (g = lane / 4, t = lane % 4):
//   A (16 x 16): a0 = (g, 2t..2t+1), a1 = (g+8, 2t..), a2 = (g, 2t+8..), a3 = (g+8, 2t+8..)
//   B (16 x 8):  b0 = (k 2t..2t+1, n g), b1 = (k 2t+8.., n g)
//   C (16 x 8):  c0,c1 = (g, 2t..2t+1), c2,c3 = (g+8, 2t..2t+1)
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace attnrnn::cuda {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

template <class T>
__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Two floats rounded to a packed pair of T (lo in the low half).
template <class T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  } else {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
}

template <class T>
__device__ __forceinline__ float2 unpack2(uint32_t x) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&x));
  } else {
    return __half22float2(*reinterpret_cast<const __half2*>(&x));
  }
}

// relu of a packed pair of T, exactly x < 0 ? 0 : x of each (NaN and -0 kept): a lane mask of the
// negatives, cleared.
template <class T>
__device__ __forceinline__ uint32_t relu2(uint32_t x) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return x & ~__hlt2_mask(*reinterpret_cast<const __nv_bfloat162*>(&x), __nv_bfloat162(0.0f, 0.0f));
  } else {
    return x & ~__hlt2_mask(*reinterpret_cast<const __half2*>(&x), __half2(0.0f, 0.0f));
  }
}

// A operand of k-step j (columns [16j, 16j+16)) from C accumulators c[2j], c[2j+1] (n-tiles of 8):
// the product of one mma feeds the next without going through shared memory.
template <class T>
__device__ __forceinline__ void c_to_a(uint32_t (&a)[4], const float (&c0)[4], const float (&c1)[4]) {
  a[0] = pack2<T>(c0[0], c0[1]);
  a[1] = pack2<T>(c0[2], c0[3]);
  a[2] = pack2<T>(c1[0], c1[1]);
  a[3] = pack2<T>(c1[2], c1[3]);
}

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

// A fragment at rows [m0, m0+16), columns [k0, k0+16) of a row-major tile X[m][k].
template <class T>
__device__ __forceinline__ void load_a(uint32_t (&a)[4], const T* X, int ld, int m0, int k0, int lane) {
  ldsm_x4(a, X + (m0 + (lane & 7) + ((lane >> 3) & 1) * 8) * ld + k0 + (lane >> 4) * 8);
}

// A fragment of X^T: element (m, k) read from a row-major tile X[k][m].
template <class T>
__device__ __forceinline__ void load_a_trans(uint32_t (&a)[4], const T* X, int ld, int m0, int k0, int lane) {
  const int mat = lane >> 3;
  ldsm_x4_trans(a, X + (k0 + (mat >> 1) * 8 + (lane & 7)) * ld + m0 + (mat & 1) * 8);
}

// B fragments of two n-tiles [n0, n0+8) and [n0+8, n0+16) at k [k0, k0+16): b[0..1] and b[2..3].
// load_b_nk reads element (k, n) from a row-major tile X[n][k]; load_b_kn from X[k][n].
template <class T>
__device__ __forceinline__ void load_b_nk(uint32_t (&b)[4], const T* X, int ld, int n0, int k0, int lane) {
  const int mat = lane >> 3;
  ldsm_x4(b, X + (n0 + (mat >> 1) * 8 + (lane & 7)) * ld + k0 + (mat & 1) * 8);
}
template <class T>
__device__ __forceinline__ void load_b_kn(uint32_t (&b)[4], const T* X, int ld, int n0, int k0, int lane) {
  const int mat = lane >> 3;
  ldsm_x4_trans(b, X + (k0 + (mat & 1) * 8 + (lane & 7)) * ld + n0 + (mat >> 1) * 8);
}

// Asynchronous global -> shared copies; valid == false writes zeros and reads nothing.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async4(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
               "r"(valid ? 4 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// The memory clobber keeps the compiler from moving shared-memory reads of the landed data above it.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

}  // namespace attnrnn::cuda
