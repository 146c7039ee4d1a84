// Tensor-core building blocks: mma.sync m16n8k16 (bf16 or fp16 operands, fp32 accumulators),
// ldmatrix fragment loads from row-major shared tiles, cp.async copies, and MmaStep: one 16-deep
// step of a 16-row block's product in any operand type (bf16, fp16, or fp32 on TF32 mma).
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

// Two consecutive elements of a row, as loaded (Packed2: one word of a 16-bit T, a float2 of fp32),
// as floats, and two floats stored rounded to T.
template <class T>
using Packed2 = std::conditional_t<sizeof(T) == 4, float2, uint32_t>;
template <class T>
__device__ __forceinline__ Packed2<T> load_packed2(const T* p) {
  return *reinterpret_cast<const Packed2<T>*>(p);
}
template <class T>
__device__ __forceinline__ float2 packed2_floats(Packed2<T> x) {
  if constexpr (sizeof(T) == 4) {
    return x;
  } else {
    return unpack2<T>(x);
  }
}
template <class T>
__device__ __forceinline__ float2 load2(const T* p) {
  return packed2_floats<T>(load_packed2(p));
}
template <class T>
__device__ __forceinline__ void store2(T* p, float x0, float x1) {
  if constexpr (sizeof(T) == 4) {
    *reinterpret_cast<float2*>(p) = make_float2(x0, x1);
  } else {
    *reinterpret_cast<uint32_t*>(p) = pack2<T>(x0, x1);
  }
}

// Elements of T in the 16-byte pieces that cp.async moves and vector loads read.
template <class T>
constexpr int kPieceElems = 16 / static_cast<int>(sizeof(T));

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


// ---- fp32 operands on TF32 tensor cores ----------------------------------------------------------
// m16n8k8 tf32 (g = lane / 4, t = lane % 4), one element per register:
//   A (16 x 8): a0 = (g, t), a1 = (g+8, t), a2 = (g, t+4), a3 = (g+8, t+4)
//   B (8 x 8):  b0 = (k t, n g), b1 = (k t+4, n g);  C as in m16n8k16.
// Any order of k inside an 8-wide slice gives the same sum, as long as A and B share it; MmaStep<float>
// uses two:
// - natural (position t is column t): what ldmatrix delivers from 16-byte row pieces of 4 floats
//   (a_rows, b_nk), one instruction for four registers in the order the mma takes them;
// - paired (position t is column 2t, t + 4 is 2t + 1): A then holds the pairs (g, 2t..2t+1) that a C
//   tile holds, so a product feeds the next mma as it is (a_from_c); a_columns and b_kn read one
//   word per lane in this order.
// A product pairs a_rows with b_nk, and a_from_c or a_columns with b_kn.

// x rounded to TF32 (10 mantissa bits, to nearest, ties away), as the mma reads its operands.
__device__ __forceinline__ uint32_t to_tf32(float x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
  return r;
}
__device__ __forceinline__ float tf32_rounded(float x) { return __uint_as_float(to_tf32(x)); }
__device__ __forceinline__ float4 tf32_rounded(float4 x) {
  return make_float4(tf32_rounded(x.x), tf32_rounded(x.y), tf32_rounded(x.z), tf32_rounded(x.w));
}
// The same rounding for a finite x in two integer operations: cvt.rna's four (sm_90) also keep a NaN's
// payload out of the carry. 3xTF32's small part is finite wherever its big part is.
__device__ __forceinline__ uint32_t to_tf32_finite(float x) { return (__float_as_uint(x) + 0x1000u) & 0xffffe000u; }
// x's leading 11 significant bits (a TF32 value), rounded to nearest: Veltkamp's split with the factor
// 2^13 + 1, three fp32 operations against cvt.rna's four, exact for |x| < 2^115 (x 8193 overflows
// past that, and NaN comes out, as it does for a NaN or infinite x). __fmul_rn keeps the product
// rounded on its own: contracted into an FMA with the subtraction, the split would not be exact.
__device__ __forceinline__ float tf32_split_high(float x) {
  const float t = __fmul_rn(x, 8193.0f);
  return __fsub_rn(t, __fsub_rn(t, x));
}

__device__ __forceinline__ void mma1688_tf32(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// ---- one k16 step of a 16-row block: C[16 x 8] += A[16 x 16] B[16 x 8] for each of two n-tiles ----
// The chunk scans are written once against these operations; T is the operand type in shared
// memory. bf16 / fp16: one m16n8k16 per n-tile, fragments through ldmatrix.
template <class T, bool kTf32x3 = false>
struct MmaStep {
  struct A { uint32_t r[4]; };
  struct B { uint32_t r[4]; };  // n-tile 0 in r[0..1], n-tile 1 in r[2..3]
  // A at rows [m0, m0+16), k [k0, k0+16) of a row-major X[m][k], or of X^T from X[k][m]
  static __device__ __forceinline__ void a_rows(A& a, const T* X, int ld, int m0, int k0, int lane) {
    load_a<T>(a.r, X, ld, m0, k0, lane);
  }
  static __device__ __forceinline__ void a_columns(A& a, const T* X, int ld, int m0, int k0, int lane) {
    load_a_trans<T>(a.r, X, ld, m0, k0, lane);
  }
  // B of the n-tiles [n0, n0+8), [n0+8, n0+16) at k [k0, k0+16): element (k, n) from X[n][k] or X[k][n]
  static __device__ __forceinline__ void b_nk(B& b, const T* X, int ld, int n0, int k0, int lane) {
    load_b_nk<T>(b.r, X, ld, n0, k0, lane);
  }
  static __device__ __forceinline__ void b_kn(B& b, const T* X, int ld, int n0, int k0, int lane) {
    load_b_kn<T>(b.r, X, ld, n0, k0, lane);
  }
  // A from the accumulators of two n-tiles (k [0, 8) and [8, 16)): a product feeding the next mma
  static __device__ __forceinline__ void a_from_c(A& a, const float (&c0)[4], const float (&c1)[4]) {
    c_to_a<T>(a.r, c0, c1);
  }
  static __device__ __forceinline__ void mma(float (&c)[4], const A& a, const B& b, int n_tile) {
    mma16816<T>(c, a.r, b.r[2 * n_tile], b.r[2 * n_tile + 1]);
  }
};

// fp32: two m16n8k8 TF32 mmas per n-tile (one per 8-wide k slice). kTf32x3 keeps fp32 accuracy
// ("3xTF32"): each operand x is split into big = tf32(x) and small = tf32(x - big), and
// a b = big_a big_b + big_a small_b + small_a big_b (small_a small_b, ~2^-22 of the product, dropped).
// The tensor cores round each accumulation toward zero, a bias that grows with the number of mmas
// summed into one accumulator (the state and o collect thousands): 3xTF32 sums the step's products in
// one fresh accumulator, the small ones first (their truncation stays at their own scale), then the
// two k slices' big ones, and adds it to c with one fp32 add (round to nearest). Each big product
// meets one truncation at the step's scale, as it would alone.
// TF32 alone (kTf32x3 false) takes operands read from shared memory as they are: the tiles there are
// TF32 already (the caller rounds each element once, where it lands), so that a fragment load is
// only loads, not a conversion per element of each of the 2-4 loads of it. Products re-packed as A
// (a_from_c) are rounded here.
template <bool kTf32x3>
struct MmaStep<float, kTf32x3> {
  static constexpr int kParts = kTf32x3 ? 2 : 1;  // big, then small
  struct A { uint32_t r[2][kParts][4]; };          // [k slice][part][register]
  struct B { uint32_t r[2][2][kParts][2]; };       // [n-tile][k slice][part][register]

  // element i of an operand: split into parts (3xTF32) or rounded, or, for a TF32 value read from a
  // tile (kFromTile without kTf32x3), taken as it is
  template <bool kFromTile, int N>
  static __device__ __forceinline__ void split(uint32_t (&parts)[kParts][N], int i, float x) {
    if constexpr (kFromTile && !kTf32x3) {
      parts[0][i] = __float_as_uint(x);
    } else if constexpr (kTf32x3) {
      const float big = tf32_split_high(x);
      parts[0][i] = __float_as_uint(big);
      parts[1][i] = to_tf32_finite(x - big);
    } else {
      parts[0][i] = to_tf32(x);
    }
  }
  // one k slice of A from its four elements (g, 2t), (g+8, 2t), (g, 2t+1), (g+8, 2t+1)
  template <bool kFromTile>
  static __device__ __forceinline__ void set_a(A& a, int s, float top0, float bottom0, float top1, float bottom1) {
    split<kFromTile>(a.r[s], 0, top0);
    split<kFromTile>(a.r[s], 1, bottom0);
    split<kFromTile>(a.r[s], 2, top1);
    split<kFromTile>(a.r[s], 3, bottom1);
  }
  // natural order: one ldmatrix per k slice, matrices (rows 0-7 | 8-15) x (columns 0-3 | 4-7)
  static __device__ __forceinline__ void a_rows(A& a, const float* X, int ld, int m0, int k0, int lane) {
    const float* row = X + (m0 + (lane & 7) + ((lane >> 3) & 1) * 8) * ld + k0 + (lane >> 4) * 4;
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      uint32_t r[4];
      ldsm_x4(r, row + 8 * s);
      set_a<true>(a, s, __uint_as_float(r[0]), __uint_as_float(r[1]), __uint_as_float(r[2]), __uint_as_float(r[3]));
    }
  }
  // paired order: rows 2t and 2t + 1 of X[k][m]
  static __device__ __forceinline__ void a_columns(A& a, const float* X, int ld, int m0, int k0, int lane) {
    const float* k_row = X + (k0 + 2 * (lane & 3)) * ld + m0 + (lane >> 2);
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      const float* r = k_row + 8 * s * ld;
      set_a<true>(a, s, r[0], r[8], r[ld], r[ld + 8]);
    }
  }
  // natural order: one ldmatrix per k slice, matrices (n-tile 0 | 1) x (k 0-3 | 4-7)
  static __device__ __forceinline__ void b_nk(B& b, const float* X, int ld, int n0, int k0, int lane) {
    const int mat = lane >> 3;
    const float* row = X + (n0 + (mat >> 1) * 8 + (lane & 7)) * ld + k0 + (mat & 1) * 4;
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      uint32_t r[4];
      ldsm_x4(r, row + 8 * s);
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        split<true>(b.r[nt][s], 0, __uint_as_float(r[2 * nt]));
        split<true>(b.r[nt][s], 1, __uint_as_float(r[2 * nt + 1]));
      }
    }
  }
  // paired order: rows 2t and 2t + 1 of X[k][n]
  static __device__ __forceinline__ void b_kn(B& b, const float* X, int ld, int n0, int k0, int lane) {
    const float* k_row = X + (k0 + 2 * (lane & 3)) * ld + n0 + (lane >> 2);
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int s = 0; s < 2; ++s) {
        const float* r = k_row + 8 * s * ld + 8 * nt;
        split<true>(b.r[nt][s], 0, r[0]);
        split<true>(b.r[nt][s], 1, r[ld]);
      }
  }
  static __device__ __forceinline__ void a_from_c(A& a, const float (&c0)[4], const float (&c1)[4]) {
    set_a<false>(a, 0, c0[0], c0[2], c0[1], c0[3]);
    set_a<false>(a, 1, c1[0], c1[2], c1[1], c1[3]);
  }
  static __device__ __forceinline__ void mma(float (&c)[4], const A& a, const B& b, int n_tile) {
    if constexpr (kTf32x3) {
      float step[4] = {};
#pragma unroll
      for (int s = 0; s < 2; ++s) {
        mma1688_tf32(step, a.r[s][0], b.r[n_tile][s][1]);
        mma1688_tf32(step, a.r[s][1], b.r[n_tile][s][0]);
      }
#pragma unroll
      for (int s = 0; s < 2; ++s) mma1688_tf32(step, a.r[s][0], b.r[n_tile][s][0]);
#pragma unroll
      for (int e = 0; e < 4; ++e) c[e] += step[e];
    } else {
#pragma unroll
      for (int s = 0; s < 2; ++s) mma1688_tf32(c, a.r[s][0], b.r[n_tile][s][0]);
    }
  }
};

}  // namespace attnrnn::cuda
