// Pieces of the tensor-core chunk scan (chunk_tc.cuh) that read and write whole tiles or rows: the
// feature-map pass, the in-place tile transform, the den sweep's row outputs and the normalizer's
// column sums. Threads and tiles as in chunk_tc.cuh (kTcThreads threads, TcLayout<DI> in shared
// memory, lanes of a warp owning rows gr and gr + 8 of a 16-row block, columns t2 and t2 + 1).
#pragma once

#include "chunk_tc_plan.cuh"
#include "mma.cuh"

namespace attnrnn::cuda {

// phi(x) of a [B, T, H, K] view into a contiguous copy, 8 elements per thread and step (K % 8 == 0,
// rows 16-byte aligned: the tensor-core path's requirements). Rounding as in the sweep's own
// transform: phi in fp32 of the input element, rounded to nearest.
template <class T>
__global__ void feature_map_kernel(const ConstView in, int64_t B, int64_t Tn, int64_t H, int64_t K,
                                   FeatureMap fm, T* out) {
  const int64_t pieces = K / 8, total = B * Tn * H * pieces;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += gridDim.x * int64_t(blockDim.x)) {
    const int64_t r = i / pieces, h = r % H, t = (r / H) % Tn, b = r / H / Tn;
    uint4 x = *reinterpret_cast<const uint4*>(row<T>(in, b, t, h) + (i % pieces) * 8);
    uint32_t* u = reinterpret_cast<uint32_t*>(&x);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 f = unpack2<T>(u[j]);
      u[j] = pack2<T>(phi(fm, f.x), phi(fm, f.y));
    }
    reinterpret_cast<uint4*>(out)[i] = x;
  }
}

// phi on q/k tiles and the row weights w on dout tiles, in place (rows past the chunk's cl stay 0).
// Returns whether the tile changed (the caller then needs a barrier before reading it).
template <class T>
__device__ __forceinline__ bool tc_transform_tile(T* tile, int ld, TcSrc src, int width, int cl, const float* w,
                                                  const LinearAttnParams& p, const TcFeatures& feat, float scale,
                                                  int tid) {
  const bool fm = (src == TcSrc::kQ || src == TcSrc::kK) && p.feature_map != FeatureMap::kIdentity &&
                  feat.q.data == nullptr;
  if (!fm && src != TcSrc::kDout) return false;
  const int pieces = width / 8;
  for (int i = tid; i < kTcChunk * pieces; i += kTcThreads) {
    const int t = i / pieces, e = (i % pieces) * 8;
    if (t >= cl) continue;
    uint4 x = *reinterpret_cast<uint4*>(tile + t * ld + e);
    uint32_t* u = reinterpret_cast<uint32_t*>(&x);
    const float wt = src == TcSrc::kDout ? (p.normalize ? w[t] : scale) : 1.f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      float2 f = unpack2<T>(u[j]);
      f = fm ? make_float2(phi(p.feature_map, f.x), phi(p.feature_map, f.y)) : make_float2(f.x * wt, f.y * wt);
      u[j] = pack2<T>(f.x, f.y);
    }
    *reinterpret_cast<uint4*>(tile + t * ld + e) = x;
  }
  return true;
}

// The den sweep's outputs for chunk row t (of cl) of query head h: w_t = s / den_t and
// dd_t = -s (dout_t . o_t) / den_t. The row's 4 lanes split the dot product; every lane calls.
template <class T>
__device__ __forceinline__ void tc_store_w_dd(const LinearAttnParams& p, const Seq& seq, int64_t t0, int64_t h, int t,
                                              int cl, float den, float scale, float* ws_w, float* ws_dd, int lane) {
  const int64_t V = p.head_dim_v;
  const int t2 = (lane & 3) * 2;
  float dot = 0.f;
  if (t < cl) {
    const T* d_row = row<T>(p.dout, seq.b, t0 + t, h);
    const T* o_row = row<T>(p.out, seq.b, t0 + t, h);
    for (int v = t2; v < V; v += 8) {
      const float2 a2 = unpack2<T>(*reinterpret_cast<const uint32_t*>(d_row + v));
      const float2 b2 = unpack2<T>(*reinterpret_cast<const uint32_t*>(o_row + v));
      dot += a2.x * b2.x + a2.y * b2.y;
    }
  }
  dot += __shfl_xor_sync(0xffffffffu, dot, 1);
  dot += __shfl_xor_sync(0xffffffffu, dot, 2);
  if (t < cl && (lane & 3) == 0) {
    const int64_t idx = token_index(p, seq, t0 + t, h);
    ws_w[idx] = scale / den;
    ws_dd[idx] = -scale * dot / den;
  }
}

// The normalizer's sums after a chunk's update: z (DI floats) += the column sums of B (forward,
// den); the column vector on dq's and dk's NC output columns += the column sums of Cv, dk's rows
// weighted by dd. Rows past the chunk are zero in the tiles.
template <class T, TcRole R, int DI>
__device__ __forceinline__ void tc_add_column_sums(float* z, const T* Bs, const T* Cs, const float* dd_s, int tid) {
  using L = TcLayout<DI>;
  constexpr int C = kTcChunk;
  if constexpr (R == TcRole::kForward || R == TcRole::kDen) {
    for (int d = tid; d < DI; d += kTcThreads) {
      float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int t = 0; t < C; ++t) acc[t & 3] += static_cast<float>(Bs[t * L::LI + d]);
      z[d] += (acc[0] + acc[1]) + (acc[2] + acc[3]);
    }
  } else if constexpr (R == TcRole::kGradQ || R == TcRole::kGradK) {
    for (int c = tid; c < L::NC; c += kTcThreads) {
      float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int t = 0; t < C; ++t)
        acc[t & 3] += (R == TcRole::kGradK ? dd_s[t] : 1.f) * static_cast<float>(Cs[t * L::LC + c]);
      z[c] += (acc[0] + acc[1]) + (acc[2] + acc[3]);
    }
  }
}

}  // namespace attnrnn::cuda
