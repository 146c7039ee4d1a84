// Pieces of the mma.sync chunk scan (scan_mma.cuh) that read and write whole tiles: the in-place
// tile transform and the normalizer's column sums. Threads and tiles as in scan_mma.cuh
// (kScanThreads threads, MmaLayout<T, DI> in shared memory, lanes of a warp owning rows gr and gr + 8
// of a 16-row block, columns t2 and t2 + 1).
#pragma once

#include "scan_roles.cuh"
#include "../common/mma.cuh"

namespace attnrnn::cuda {

// phi on q/k tiles and the row weights w on dout tiles, in place (rows past the chunk's cl stay 0).
// Returns whether the tile changed (the caller then needs a barrier before reading it).
template <class T>
__device__ __forceinline__ bool tc_transform_tile(T* tile, int ld, Operand src, int width, int cl, const float* w,
                                                  const ChunkArgs& p, const ScanFeatures& feat, float scale,
                                                  int tid) {
  const bool fm = (src == Operand::kQ || src == Operand::kK) && p.feature_map != FeatureMap::kIdentity &&
                  feat.q.data == nullptr;
  if (!fm && src != Operand::kDout) return false;
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
        const float f = __uint_as_float(u[j]);
        u[j] = __float_as_uint(fm ? phi(p.feature_map, f) : f * wt);
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
