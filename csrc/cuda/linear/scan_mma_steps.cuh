// Pieces of the mma.sync chunk scan (scan_mma.cuh) that read and write whole tiles: the in-place
// tile transform and the normalizer's column sums. Threads and tiles as in scan_mma.cuh
// (kScanThreads threads, MmaLayout<T, DI> in shared memory, lanes of a warp owning rows gr and gr + 8
// of a 16-row block, columns t2 and t2 + 1).
#pragma once

#include "scan_roles.cuh"
#include "../common/mma.cuh"

namespace attnrnn::cuda {

// fp32 tiles for TF32 mma alone (MmaStep<float, false> reads them as they are): each thread rounds
// the pieces of a landed tile that it copied itself (load_tile's rows and column piece), after its
// own cp.async wait and before the step's barrier, so that rounding needs no barrier of its own.
__device__ __forceinline__ void tf32_round_own_pieces(float* tile, int ld, int width, int tid) {
  const int pieces = width / kPieceElems<float>, rows_per_pass = kScanThreads / pieces;
  const int e = (tid % pieces) * kPieceElems<float>;
  for (int t = tid / pieces; t < kChunk; t += rows_per_pass) {
    float4* piece = reinterpret_cast<float4*>(tile + t * ld + e);
    *piece = tf32_rounded(*piece);
  }
}

// The same rounding for the tile whose column sums the normalizer adds (kTf32 with normalize: forward
// B, dq and dk Cv), after the landing barrier: thread c sums column c in fp32 as it landed (dk: rows
// weighted by dd, as tc_add_column_sums does) and writes it back rounded. Returns the sum (0 past
// width), which the thread adds to its column of z after the step's reads of z.
template <ScanRole R>
__device__ __forceinline__ float tf32_sum_and_round_column(float* tile, int ld, int width, const float* dd_s, int tid) {
  if (tid >= width) return 0.f;
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 8
  for (int t = 0; t < kChunk; ++t) {
    float& x = tile[t * ld + tid];
    acc[t & 3] += (R == ScanRole::kGradK ? dd_s[t] : 1.f) * x;
    x = tf32_rounded(x);
  }
  return (acc[0] + acc[1]) + (acc[2] + acc[3]);
}

// Whether tc_transform_tile rewrites tiles of source src: dout's always, q's and k's where the
// sweep applies the feature map itself.
__device__ __forceinline__ bool tc_transforms(Operand src, const ChunkArgs& p, const ScanFeatures& feat) {
  const bool fm = (src == Operand::kQ || src == Operand::kK) && p.feature_map != FeatureMap::kIdentity &&
                  feat.q.data == nullptr;
  return fm || src == Operand::kDout;
}

// phi on q/k tiles and the row weights w on dout tiles, in place (rows past the chunk's cl stay 0),
// the results of fp32 tiles rounded to TF32 where tf32 (TF32 mma alone, unless the normalizer sums
// the tile first).
// Returns whether the tile changed (the caller then needs a barrier before reading it).
template <class T>
__device__ __forceinline__ bool tc_transform_tile(T* tile, int ld, Operand src, int width, int cl, const float* w,
                                                  const ChunkArgs& p, const ScanFeatures& feat, float scale,
                                                  int tid, bool tf32 = false) {
  if (!tc_transforms(src, p, feat)) return false;
  const bool fm = src != Operand::kDout;
  const int pieces = width / kPieceElems<T>;
  for (int i = tid; i < kChunk * pieces; i += kScanThreads) {
    const int t = i / pieces, e = (i % pieces) * kPieceElems<T>;
    if (t >= cl) continue;
    uint4 x = *reinterpret_cast<uint4*>(tile + t * ld + e);
    uint32_t* u = reinterpret_cast<uint32_t*>(&x);
    const float wt = src == Operand::kDout ? (p.normalize ? w[t] : scale) : 1.f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if constexpr (sizeof(T) == 4) {
        const float f = __uint_as_float(u[j]), y = fm ? phi(p.feature_map, f) : f * wt;
        u[j] = tf32 ? to_tf32(y) : __float_as_uint(y);
      } else {
        float2 f = unpack2<T>(u[j]);
        f = fm ? make_float2(phi(p.feature_map, f.x), phi(p.feature_map, f.y)) : make_float2(f.x * wt, f.y * wt);
        u[j] = pack2<T>(f.x, f.y);
      }
    }
    *reinterpret_cast<uint4*>(tile + t * ld + e) = x;
  }
  return true;
}

// The normalizer's sums after a chunk's update: z (DI floats) += the column sums of B (forward); the column vector on dq's and dk's NC output columns += the column sums of Cv, dk's rows
// weighted by dd. Rows past the chunk are zero in the tiles.
template <class T, ScanRole R, int DI>
__device__ __forceinline__ void tc_add_column_sums(float* z, const T* Bs, const T* Cs, const float* dd_s, int tid) {
  using L = MmaLayout<T, DI>;
  constexpr int C = kChunk;
  if constexpr (R == ScanRole::kForward) {
    for (int d = tid; d < DI; d += kScanThreads) {
      float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int t = 0; t < C; ++t) acc[t & 3] += static_cast<float>(Bs[t * L::LI + d]);
      z[d] += (acc[0] + acc[1]) + (acc[2] + acc[3]);
    }
  } else if constexpr (R == ScanRole::kGradQ || R == ScanRole::kGradK) {
    for (int c = tid; c < L::NC; c += kScanThreads) {
      float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int t = 0; t < C; ++t)
        acc[t & 3] += (R == ScanRole::kGradK ? dd_s[t] : 1.f) * static_cast<float>(Cs[t * L::LC + c]);
      z[c] += (acc[0] + acc[1]) + (acc[2] + acc[3]);
    }
  }
}

}  // namespace attnrnn::cuda
