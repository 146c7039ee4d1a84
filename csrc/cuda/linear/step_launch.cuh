// Host side of the decode step (step.cuh): value tiles, register passes, launch. Tile table:
//   step      one block per (batch entry, kv head, value tile: step_value_tiles); float4 columns
//             when V % 4 == 0; GT = heads per register pass (1, 2, 4 or 8); 4 state rows per thread
//             and batch (kStepBatchRows)

#pragma once

#include <cstdint>

#include "step.cuh"

namespace attnrnn::cuda {

// Value-column tiles per (batch entry, kv head) of the decode step: V is split (into tiles of at least
// 8 vectors) only while the grid stays within one block per SM. Measured kernel times at H32 D128
// (the kernel alone, from a CUDA graph): B1 5.2 / 4.1 / 3.6 us with 1 / 2 / 4 tiles, but B8 8.2 / 10.0
// / 10.3 and B64 75 / 79 / 104 us. Normalize keeps one block per state row (it alone updates the key sum).
inline int step_value_tiles(const LinearAttnStepParams& p, int W) {
  if (p.normalize) return 1;
  const int64_t blocks = p.batch * p.num_kv_heads, min_tile = int64_t(W) * 8;
  auto fits = [&](int tiles) { return p.head_dim_v % (tiles * min_tile) == 0; };
  int tiles = 1;
  while (tiles < 4 && blocks * tiles * 2 <= sm_count() && fits(tiles * 2)) tiles *= 2;
  return tiles;
}

template <class T, int GT, int W>
Status launch_step_with(const LinearAttnStepParams& p) {
  using A = typename AccOf<T>::type;
  const int64_t K = p.head_dim_k, V = p.head_dim_v, G = p.num_heads / p.num_kv_heads;
  const int tiles = step_value_tiles(p, W);
  const int BV = static_cast<int>(V / tiles);
  const int cols = BV / W;
  const int row_sets = cols >= kStepThreads ? 1 : kStepThreads / cols;
  const int64_t bytes = step_smem(K, BV, G, GT, row_sets) * int64_t(sizeof(A));
  Status s = allow_smem(step_kernel<T, GT, W>, bytes, "linear_attn_step");
  if (s != Status::kSuccess) return s;
  const dim3 grid(static_cast<unsigned>(p.batch), static_cast<unsigned>(p.num_kv_heads), tiles);
  step_kernel<T, GT, W><<<grid, kStepThreads, bytes, static_cast<cudaStream_t>(p.stream)>>>(p, BV, row_sets);
  return check_launch("linear_attn_step");
}

template <class T, int W>
Status launch_step_width(const LinearAttnStepParams& p) {
  const int64_t G = p.num_heads / p.num_kv_heads;
  if (G <= 1) return launch_step_with<T, 1, W>(p);
  if (G <= 2) return launch_step_with<T, 2, W>(p);
  if (G <= 4) return launch_step_with<T, 4, W>(p);
  return launch_step_with<T, 8, W>(p);
}

template <class T>
Status launch_step(const LinearAttnStepParams& p) {
  if (p.batch == 0) return Status::kSuccess;
  const bool vec4 = p.head_dim_v % 4 == 0 && reinterpret_cast<uintptr_t>(p.S) % 16 == 0;
  return vec4 ? launch_step_width<T, 4>(p) : launch_step_width<T, 1>(p);
}

}  // namespace attnrnn::cuda
