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

// acc[i][jj] += sum over k < n[i] of w[8 i kGenBk + k] m[k ld + col] for the lane's columns
// col = lane + 32 jj < width: the warp's rows of a [rows][kGenBk] weight block (w: the warp's first
// row) times the value block's rows [0, n[i]) (ld apart), i.e. P V or dS K of one block. Row i
// reads only the n[i] value rows it sees: a masked weight (0) times a later row's NaN or Inf would
// reach it. Rows every row sees are summed without the compare (all of a block off the diagonal).
// The block's products are summed first and added to acc once (short summation chains).
template <int R, class A>
__device__ __forceinline__ void accumulate_block(A (&acc)[R][kGenCols], const A* w, const A* m, int ld, int width,
                                                 const int (&n)[R], int lane) {
  int all = n[0], most = n[0];
#pragma unroll
  for (int i = 1; i < R; ++i) {
    all = min(all, n[i]);
    most = max(most, n[i]);
  }
#pragma unroll
  for (int jj = 0; jj < kGenCols; ++jj) {
    const int col = lane + 32 * jj;
    if (col >= width) continue;
    A part[R];
#pragma unroll
    for (int i = 0; i < R; ++i) part[i] = A(0);
    auto add = [&](int k, bool seen_by_all) {
      const A mk = m[k * ld + col];
#pragma unroll
      for (int i = 0; i < R; ++i)
        if (seen_by_all || k < n[i]) part[i] += w[kGenWarps * i * kGenBk + k] * mk;
    };
    for (int k = 0; k < all; ++k) add(k, true);
    for (int k = all; k < most; ++k) add(k, false);
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
