// Pieces shared by the softmax-attention kernels on CUDA cores (every dtype and head dim): 8 warps,
// accumulators in A = float/double in shared memory, blocks of 32 keys (or queries) with one lane
// per row of the block for the scores and one lane per column for the products that follow.
#pragma once

#include "common.cuh"

namespace attnrnn::cuda::sm {

constexpr int kGenWarps = 8, kGenThreads = 32 * kGenWarps, kGenBk = 32, kGenCols = 8;  // 8 x 32 >= 256 columns

// out[i] = sum over d < n of x[8 i n + d] y[d]: the warp's rows of a dense tile (x: the warp's
// first row, the others 8 rows apart) against the lane's row y of a padded tile, i.e. the scores
// (or dP) of the warp's rows against the block row of this lane. Callers pass the row pointers:
// indexing from the tile starts inside the helper changes the kernels' SASS.
template <int R, class A>
__device__ __forceinline__ void row_dots(A (&out)[R], const A* x, const A* y, int n) {
#pragma unroll
  for (int i = 0; i < R; ++i) out[i] = A(0);
  for (int d = 0; d < n; ++d) {
    const A yd = y[d];
#pragma unroll
    for (int i = 0; i < R; ++i) out[i] += x[kGenWarps * i * n + d] * yd;
  }
}

// acc[i][jj] += sum over k < n of w[8 i kGenBk + k] m[k ld + col] for the lane's columns
// col = lane + 32 jj < width: the warp's rows of a [rows][kGenBk] weight block (w: the warp's first
// row) times an [n][ld] value block, i.e. P V or dS K of one block. The block's products are summed
// first and added to acc once (short summation chains).
template <int R, class A>
__device__ __forceinline__ void accumulate_block(A (&acc)[R][kGenCols], const A* w, const A* m, int ld, int width,
                                                 int n, int lane) {
#pragma unroll
  for (int jj = 0; jj < kGenCols; ++jj) {
    const int col = lane + 32 * jj;
    if (col >= width) continue;
    A part[R];
#pragma unroll
    for (int i = 0; i < R; ++i) part[i] = A(0);
    for (int k = 0; k < n; ++k) {
      const A mk = m[k * ld + col];
#pragma unroll
      for (int i = 0; i < R; ++i) part[i] += w[kGenWarps * i * kGenBk + k] * mk;
    }
#pragma unroll
    for (int i = 0; i < R; ++i) acc[i][jj] += part[i];
  }
}

// out[col] = acc[jj] f for the lane's columns col = lane + 32 jj < n of one output row.
template <class T, class A>
__device__ __forceinline__ void store_row(T* out, const A (&acc)[kGenCols], A f, int n, int lane) {
#pragma unroll
  for (int jj = 0; jj < kGenCols; ++jj) {
    const int col = lane + 32 * jj;
    if (col < n) out[col] = from_acc<T, A>(acc[jj] * f);
  }
}

}  // namespace attnrnn::cuda::sm
