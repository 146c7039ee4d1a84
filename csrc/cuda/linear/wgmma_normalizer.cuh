// The normalizer's sums of the wgmma sweeps on the tensor cores. scan_wgmma.cuh's, as mma.sync
// m16n8k16 products over swizzled 64 x 64 tiles (wgmma.cuh): warp w of the warpgroup handles rows
// (or columns) [16 w, 16 w + 16) of each tile. A float vector enters a product as a [16 x 8] operand
// whose column 0 holds its 16-bit high part and column 1 the low part (~16 mantissa bits), so the
// sum of result columns 0 and 1 is the product with the fp32 vector. The 128-token forward's
// (scan_wgmma_pair.cuh) column sums, and in bf16 its a . z, run as m64n8k16 warpgroup MMAs inside its
// product groups (the end of this file); fp16's a . z stays in fp32 on the CUDA cores.
#pragma once

#include "../common/mma.cuh"
#include "../common/wgmma.cuh"

namespace attnrnn::cuda {

// The high and low 16-bit parts of two floats, each pair packed into one word: x = hi + lo to ~16
// mantissa bits.
template <class T>
__device__ __forceinline__ uint2 split_pair(float x0, float x1) {
  const uint32_t hi = pack2<T>(x0, x1);
  const float2 back = unpack2<T>(hi);
  return make_uint2(hi, pack2<T>(x0 - back.x, x1 - back.y));
}

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
    const uint2 parts = split_pair<T>(v.x, v.y);
    b[half] = col == 0 ? parts.x : col == 1 ? parts.y : 0u;
  }
}

// A vector kept beside its split (the forward's z, bf16): for each pair of dims (2m, 2m + 1), word 2m
// holds their packed high parts and word 2m + 1 their low parts, as split_pair makes them (one word per
// dim; a warp's reads hit 8 consecutive words). The sums then read their operand instead of splitting
// it again in every thread and step.
template <class T>
__device__ __forceinline__ void wg_split_operand(const uint32_t* xs, int k0, int lane, uint32_t (&b)[2]) {
  const int col = lane / 4;
  const uint32_t* x = xs + 2 * (lane % 4) + (col & 1);  // this lane's word of each k16 slice half
#pragma unroll
  for (int half = 0; half < 2; ++half) b[half] = col < 2 ? x[k0 + 8 * half] : 0u;
}
// Words [0, n) of xs for dims [0, n) of x, by threads tid < n / 2 (x from a function of the dim).
template <class T, class X>
__device__ __forceinline__ void split_vector(X&& x_of, int n, uint32_t* xs, int tid) {
  if (tid < n / 2) {
    const uint2 parts = split_pair<T>(x_of(2 * tid), x_of(2 * tid + 1));
    xs[2 * tid] = parts.x;
    xs[2 * tid + 1] = parts.y;
  }
}

// a_t . z for the thread's two rows of A (16 (tid / 32) + lane / 4 and + 8, the rows of its wgmma
// accumulators), on all four lanes of a row. A: DI / 64 tiles [64 rows][64 dims]. bf16 on the tensor
// cores, with z's B fragments from b_of(k0, lane, b); fp16 cannot hold z (it grows with T past fp16's
// range), so fp16 sums in fp32 (z_fp32).
template <class T, int DI, class Operand>
__device__ __forceinline__ void wg_row_dot(const unsigned char* A, Operand&& b_of, const float* z_fp32, int tid,
                                           float (&out)[2]) {
  const int lane = tid % 32, m0 = 16 * (tid / 32);
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    float c[2][4] = {};  // even and odd slices in two accumulators: two dependent chains of half the length
#pragma unroll
    for (int j = 0; j < DI / 16; ++j) {
      uint32_t a[4], b[2];
      ldsm_x4(a, A + wg_at(m0 + (lane & 7) + ((lane >> 3) & 1) * 8, 16 * j + (lane >> 4) * 8));
      b_of(16 * j, lane, b);
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
        acc += q2.x * z_fp32[d] + q2.y * z_fp32[d + 1];
      }
      acc += __shfl_xor_sync(0xffffffffu, acc, 1);
      out[r] = acc + __shfl_xor_sync(0xffffffffu, acc, 2);
    }
  }
}
// a_t . z with z split where it was last summed (zs, bf16; fp16 reads z).
template <class T, int DI>
__device__ __forceinline__ void wg_row_dot_z(const unsigned char* A, const float* z, const uint32_t* zs, int tid,
                                             float (&out)[2]) {
  wg_row_dot<T, DI>(A, [&](int k0, int lane, uint32_t(&b)[2]) { wg_split_operand<T>(zs, k0, lane, b); }, z, tid, out);
}

// The forward's output scale s / den of the thread's two rows, den = s (a . z + rowsum P) + eps, with
// rowsum the thread's partial sums of its rows of masked P (summed over a row's four lanes here) and
// qz = a . z (wg_row_dot_z).
__device__ __forceinline__ void wg_forward_scale(float (&rowsum)[2], const float (&qz)[2], float scale, float eps,
                                                 float (&inv)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    rowsum[r] += __shfl_xor_sync(0xffffffffu, rowsum[r], 1);
    rowsum[r] += __shfl_xor_sync(0xffffffffu, rowsum[r], 2);
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) inv[r] = scale / (scale * (qz[r] + rowsum[r]) + eps);
}

// z[m] += sum_t weight_t X[t][m] over the 64 XT columns of tiles X [64 tokens][64 columns] (weight 1
// when weight == nullptr): X^T, read transposed, times the weight operand, one product per 16 tokens.
// Each column has one writer (a lane with lane % 4 == 0; thread m on the fp16 fp32 path). With zs
// (bf16, weight 1), the writers also split the new values into zs (wg_split_operand).
template <class T, int XT>
__device__ __forceinline__ void wg_sum_columns(const unsigned char* X, const float* weight, float* z, uint32_t* zs,
                                               int tid) {
  if constexpr (std::is_same_v<T, __half>) {
    if (weight != nullptr) {  // fp16 parts of small weights (dd) would be subnormal: fp32 sums instead
      for (int m = tid; m < 64 * XT; m += 128) {
        float acc[4] = {};  // four independent sums: a chain of 16 FMAs instead of 64
#pragma unroll
        for (int t = 0; t < 64; ++t) acc[t % 4] += weight[t] * __half2float(*reinterpret_cast<const __half*>(X + wg_at(t, m)));
        z[m] += (acc[0] + acc[1]) + (acc[2] + acc[3]);
      }
      return;
    }
  }
  const int lane = tid % 32, m0 = 16 * (tid / 32), mat = lane >> 3;
#pragma unroll
  for (int h = 0; h < XT; ++h) {
    const int d0 = 64 * h + m0, d = d0 + lane / 4;
    float c[2][4] = {};  // even and odd token slices: two dependent chains of half the length
#pragma unroll
    for (int j = 0; j < kWgTileBytes / 128 / 16; ++j) {
      uint32_t a[4], bw[2];
      ldsm_x4_trans(a, X + wg_at(16 * j + (mat >> 1) * 8 + (lane & 7), d0 + (mat & 1) * 8));
      wg_vector_operand<T>(weight, 16 * j, lane, bw);
      mma16816<T>(c[j % 2], a, bw[0], bw[1]);
    }
    float v[2] = {0.f, 0.f};
    if (lane % 4 == 0) {
      v[0] = z[d] + ((c[0][0] + c[0][1]) + (c[1][0] + c[1][1]));
      v[1] = z[d + 8] + ((c[0][2] + c[0][3]) + (c[1][2] + c[1][3]));
      z[d] = v[0];
      z[d + 8] = v[1];
    }
    if (zs != nullptr) {  // dims d (even on lanes 0, 8, 16, 24) and d + 1, the next writer's
      const float next[2] = {__shfl_down_sync(0xffffffffu, v[0], 4), __shfl_down_sync(0xffffffffu, v[1], 4)};
      if (lane % 8 == 0) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {  // dims d and d + 8
          const uint2 parts = split_pair<T>(v[r], next[r]);
          zs[d + 8 * r] = parts.x;
          zs[d + 8 * r + 1] = parts.y;
        }
      }
    }
  }
}
// ---- The forward's z on warpgroup MMAs (m64n8k16; scan_wgmma_pair.cuh) ----------------------------
// z over a warpgroup's 64 state dims lives in an m64n8 accumulator Z beside the state, every column
// the same sum: the chunk's column sums of B are B^T times a [tokens x 8] tile of ones, products with
// the state update's A operand in the update's own group. a_t . z is A times z's split tile [8][dims]
// (K-major: hi parts in the even rows, lo parts in the odd ones), so that columns 2c and 2c + 1 of the
// product add up to a_t . z on every lane, in the group of A S.

// The tile of ones [8][64] (1 KiB), by threads [0, threads).
template <class T>
__device__ __forceinline__ void wg_fill_ones(unsigned char* tile, int tid, int threads) {
  for (int i = tid; i < 256; i += threads) reinterpret_cast<uint32_t*>(tile)[i] = pack2<T>(1.f, 1.f);
}
// Z's two sums (rows wg_acc_row(t, 0) and + 8 of the accumulator) to dst[row], from lane 0 of each quad.
__device__ __forceinline__ void wg_store_z(const float (&Z)[4], float* dst, int t) {
  if (t % 4 == 0) {
    dst[wg_acc_row(t, 0)] = Z[0];
    dst[wg_acc_row(t, 2)] = Z[2];
  }
}
// Z's sums, dims dim0 + its rows, for the next a . z: bf16 into z's split tile (lane q of each quad
// writes rows 2q and 2q + 1), fp16 in fp32 into z_fp32 (fp16 cannot hold z, which grows with T).
template <class T>
__device__ __forceinline__ void wg_publish_z(const float (&Z)[4], unsigned char* zsplit, float* z_fp32, int dim0,
                                             int t) {
  if constexpr (std::is_same_v<T, __half>) {
    wg_store_z(Z, z_fp32 + dim0, t);
  } else {
    const int q = t % 4;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int d = dim0 + wg_acc_row(t, 2 * r);
      const uint2 parts = split_pair<T>(Z[2 * r], 0.f);
      unsigned char* tile = zsplit + (d / 64) * 1024;
      *reinterpret_cast<uint16_t*>(tile + wg_swizzled(2 * q, d % 64)) = static_cast<uint16_t>(parts.x);
      *reinterpret_cast<uint16_t*>(tile + wg_swizzled(2 * q + 1, d % 64)) = static_cast<uint16_t>(parts.y);
    }
  }
}
// Z += X^T ones over NB row blocks of 64 tokens, the 64-dim tile at X + offset + b block_bytes each
// (read transposed, as the state update reads it): the column sums, issued into the caller's group.
template <class T, int NB>
__device__ __forceinline__ void wg_add_key_sums(float (&Z)[4], const unsigned char* X, int offset, int block_bytes,
                                                const unsigned char* ones) {
#pragma unroll
  for (int b = 0; b < NB; ++b)
#pragma unroll
    for (int j = 0; j < 4; ++j)
      wg_mma_n8_ss<T, 1, 0>(Z, wg_descriptor(X, offset + b * block_bytes + 2048 * j), wg_descriptor(ones, 32 * j), 1);
}
// QZ = A z_hi | A z_lo over the DI dims of A's tiles (bf16): a_t . z = QZ[0] + QZ[1] (row
// wg_acc_row(t, 0)) and QZ[2] + QZ[3] (+ 8), issued into the caller's product group.
template <class T, int DI>
__device__ __forceinline__ void wg_dot_z_products(float (&QZ)[4], const unsigned char* A, const unsigned char* zsplit) {
#pragma unroll
  for (int j = 0; j < DI / 16; ++j) {
    const int at = (j / 4) * kWgTileBytes + 32 * (j % 4), zat = (j / 4) * 1024 + 32 * (j % 4);
    wg_mma_n8_ss<T, 0, 0>(QZ, wg_descriptor(A, at), wg_descriptor(zsplit, zat), j > 0);
  }
}

// wg_sum_columns without the split.
template <class T, int XT>
__device__ __forceinline__ void wg_add_column_sums(const unsigned char* X, const float* weight, float* z, int tid) {
  wg_sum_columns<T, XT>(X, weight, z, nullptr, tid);
}

}  // namespace attnrnn::cuda
