// The normalizer's sums of the wgmma sweeps (chunk_wg.cuh) on the tensor cores, as mma.sync
// m16n8k16 products over swizzled 64 x 64 tiles (wgmma.cuh): warp w of the warpgroup handles rows
// (or columns) [16 w, 16 w + 16) of each tile. A float vector enters a product as a [16 x 8] operand
// whose column 0 holds its 16-bit high part and column 1 the low part (~16 mantissa bits), so the
// sum of result columns 0 and 1 is the product with the fp32 vector.
#pragma once

#include "mma.cuh"
#include "wgmma.cuh"

namespace attnrnn::cuda {

// B fragment (k16 slice at k0 of a [k x 8] operand) of the vector x: column 0 hi, column 1 lo, the
// rest zero; x == nullptr stands for a vector of ones (exact in column 0 alone). Branch-free: every
// lane reads its two pairs and selects, because a lane-dependent branch here costs a reconvergence
// before each product (the normalize forward's steps were 10-17% slower with one, H200).
template <class T>
__device__ __forceinline__ void wg_vector_operand(const float* x, int k0, int lane, uint32_t (&b)[2]) {
  const int col = lane / 4, k = k0 + 2 * (lane % 4);
  if (x == nullptr) {
    b[0] = b[1] = col == 0 ? pack2<T>(1.f, 1.f) : 0u;
    return;
  }
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const float2 v = *reinterpret_cast<const float2*>(x + k + 8 * half);
    const uint32_t hi = pack2<T>(v.x, v.y);
    const float2 back = unpack2<T>(hi);
    const uint32_t lo = pack2<T>(v.x - back.x, v.y - back.y);
    b[half] = col == 0 ? hi : col == 1 ? lo : 0u;
  }
}

// a_t . z for the thread's two rows of A (16 (tid / 32) + lane / 4 and + 8, the rows of its wgmma
// accumulators), on all four lanes of a row. A: DI / 64 tiles [64 rows][64 dims]. bf16 on the tensor
// cores; fp16 cannot hold z (it grows with T past fp16's range), so fp16 sums in fp32.
template <class T, int DI>
__device__ __forceinline__ void wg_row_dot_z(const unsigned char* A, const float* z, int tid, float (&out)[2]) {
  const int lane = tid % 32, m0 = 16 * (tid / 32);
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    float c[2][4] = {};  // even and odd slices in two accumulators: two dependent chains of half the length
#pragma unroll
    for (int j = 0; j < DI / 16; ++j) {
      uint32_t a[4], b[2];
      ldsm_x4(a, A + wg_at(m0 + (lane & 7) + ((lane >> 3) & 1) * 8, 16 * j + (lane >> 4) * 8));
      wg_vector_operand<T>(z, 16 * j, lane, b);
      mma16816<T>(c[j % 2], a, b[0], b[1]);
    }
    // columns 0 + 1 of both accumulators, on the row's lane 0
    out[0] = __shfl_sync(0xffffffffu, (c[0][0] + c[0][1]) + (c[1][0] + c[1][1]), lane & ~3);
    out[1] = __shfl_sync(0xffffffffu, (c[0][2] + c[0][3]) + (c[1][2] + c[1][3]), lane & ~3);
  } else {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float acc = 0.f;
      for (int d = 2 * (lane % 4); d < DI; d += 8) {
        const float2 q2 = unpack2<T>(*reinterpret_cast<const uint32_t*>(A + wg_at(m0 + lane / 4 + 8 * r, d)));
        acc += q2.x * z[d] + q2.y * z[d + 1];
      }
      acc += __shfl_xor_sync(0xffffffffu, acc, 1);
      out[r] = acc + __shfl_xor_sync(0xffffffffu, acc, 2);
    }
  }
}

// The forward's output scale s / den of the thread's two rows, den = s (a . z + rowsum P) + eps, with
// rowsum the thread's partial sums of its rows of masked P (summed over a row's four lanes here).
template <class T, int DI>
__device__ __forceinline__ void wg_forward_scale(float (&rowsum)[2], const unsigned char* A, const float* z, int tid,
                                                 float scale, float eps, float (&inv)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    rowsum[r] += __shfl_xor_sync(0xffffffffu, rowsum[r], 1);
    rowsum[r] += __shfl_xor_sync(0xffffffffu, rowsum[r], 2);
  }
  float qz[2];
  wg_row_dot_z<T, DI>(A, z, tid, qz);
#pragma unroll
  for (int r = 0; r < 2; ++r) inv[r] = scale / (scale * (qz[r] + rowsum[r]) + eps);
}

// z[m] += sum_t weight_t X[t][m] over the 64 XT columns of tiles X [64 tokens][64 columns] (weight 1
// when weight == nullptr): X^T, read transposed, times the weight operand, one product per 16
// tokens. Each column has one writer (a lane with lane % 4 == 0; thread m on the fp16 fp32 path).
template <class T, int XT>
__device__ __forceinline__ void wg_add_column_sums(const unsigned char* X, const float* weight, float* z, int tid) {
  if constexpr (std::is_same_v<T, __half>) {
    if (weight != nullptr) {  // fp16 parts of small weights (dd) would be subnormal: fp32 sums instead
      for (int m = tid; m < 64 * XT; m += 128) {
        float acc[4] = {};  // four independent sums: a chain of 16 FMAs instead of 64
#pragma unroll
        for (int t = 0; t < 64; ++t)
          acc[t % 4] += weight[t] * __half2float(*reinterpret_cast<const __half*>(X + wg_at(t, m)));
        z[m] += (acc[0] + acc[1]) + (acc[2] + acc[3]);
      }
      return;
    }
  }
  const int lane = tid % 32, m0 = 16 * (tid / 32), mat = lane >> 3;
#pragma unroll
  for (int h = 0; h < XT; ++h) {
    const int d0 = 64 * h + m0;
    float c[2][4] = {};  // even and odd token slices: two dependent chains of half the length
#pragma unroll
    for (int j = 0; j < kWgTileBytes / 128 / 16; ++j) {
      uint32_t a[4], b[2];
      ldsm_x4_trans(a, X + wg_at(16 * j + (mat >> 1) * 8 + (lane & 7), d0 + (mat & 1) * 8));
      wg_vector_operand<T>(weight, 16 * j, lane, b);
      mma16816<T>(c[j % 2], a, b[0], b[1]);
    }
    if (lane % 4 == 0) {
      z[d0 + lane / 4] += (c[0][0] + c[0][1]) + (c[1][0] + c[1][1]);
      z[d0 + lane / 4 + 8] += (c[0][2] + c[0][3]) + (c[1][2] + c[1][3]);
    }
  }
}

}  // namespace attnrnn::cuda
