// How the CUDA softmax-attention kernels cut their work, where the host must know it before the
// launch: the decode step's split of the cache and the scratch every op needs. Pure C++ (no CUDA
// headers): softmax_workspace.cpp sizes the caller's workspace with it, and the CUDA launchers
// (csrc/cuda/softmax/launch.cuh) use the same numbers, so the two cannot disagree.
#pragma once

#include <algorithm>
#include <cstdint>

#include "attnrnn/attnrnn.h"

namespace attnrnn::plan {

// Decode step: enough splits that B * Hkv * splits >= kStepTargetBlocks (4 resident blocks on
// each of the H200's 132 SMs), at least kStepMinSplit keys per split, split sizes a multiple of
// kStepSplitAlign. Only Lmax is known on the host (cache_seqlens lives on the device), so the
// split is planned over Lmax; splits past a sequence's length exit at once.
constexpr int64_t kStepTargetBlocks = 4 * 132;
constexpr int64_t kStepMinSplit = 256;
constexpr int64_t kStepSplitAlign = 64;

inline int64_t acc_bytes(DType dtype) { return dtype == DType::kFloat64 ? 8 : 4; }

inline int64_t step_split_size(const SoftmaxAttnStepParams& p) {
  if (p.split_size > 0) return p.split_size;
  const int64_t rows = std::max<int64_t>(1, p.batch * p.num_kv_heads);
  const int64_t splits = (kStepTargetBlocks + rows - 1) / rows;
  const int64_t per = (std::max<int64_t>(p.max_seqlen, 1) + splits - 1) / splits;
  return std::max(kStepMinSplit, (per + kStepSplitAlign - 1) / kStepSplitAlign * kStepSplitAlign);
}

inline int64_t step_num_splits(const SoftmaxAttnStepParams& p) {
  const int64_t split = step_split_size(p);
  return p.max_seqlen == 0 ? 1 : 1 + (p.max_seqlen - 1) / split;  // no overflow at split_size = INT64_MAX
}

// Partial results of one (batch entry, query head, split): m, l, then acc[Dv].
inline int64_t step_partial_stride(const SoftmaxAttnStepParams& p) { return p.head_dim_v + 2; }

inline int64_t step_workspace_bytes(const SoftmaxAttnStepParams& p) {
  if (p.device != Device::kCUDA) return 0;
  const int64_t splits = step_num_splits(p);
  if (splits <= 1) return 0;  // one split writes o directly
  return p.batch * p.num_heads * splits * step_partial_stride(p) * acc_bytes(p.dtype);
}

// The shapes the tensor-core kernels take: bf16/fp16 with D = Dv in {64, 128} (the launchers also
// need 16-byte aligned rows, which the sizes below do not depend on).
inline bool tensor_core_shape(const SoftmaxAttnParams& p) {
  return (p.dtype == DType::kBFloat16 || p.dtype == DType::kFloat16) && p.head_dim == p.head_dim_v &&
         (p.head_dim == 64 || p.head_dim == 128);
}

// The non-finite flags of a tensor-core call (csrc/cuda/softmax/common.cuh): one unsigned per
// (sequence, query head) in the forward, per (sequence, kv head) in the backward.
inline int64_t num_sequences(const SoftmaxAttnParams& p) { return p.cu_seqlens != nullptr ? p.num_seqs : p.batch; }
inline int64_t fwd_flag_count(const SoftmaxAttnParams& p) {
  return tensor_core_shape(p) ? num_sequences(p) * p.num_heads : 0;
}
inline int64_t bwd_flag_count(const SoftmaxAttnParams& p) {
  return tensor_core_shape(p) ? num_sequences(p) * p.num_kv_heads : 0;
}

// Forward: the flags.
inline int64_t fwd_workspace_bytes(const SoftmaxAttnParams& p) {
  if (p.device != Device::kCUDA) return 0;
  return fwd_flag_count(p) * int64_t(sizeof(unsigned));
}

// Backward: D_i = dout_i . o_i per (batch, head, query), laid out like lse [B, H, Tq], then the
// flags from the first 256-byte boundary after it.
inline int64_t bwd_flags_offset(const SoftmaxAttnParams& p) {
  return (p.batch * p.num_heads * p.seqlen_q * acc_bytes(p.dtype) + 255) / 256 * 256;
}
inline int64_t bwd_workspace_bytes(const SoftmaxAttnParams& p) {
  if (p.device != Device::kCUDA) return 0;
  return bwd_flags_offset(p) + bwd_flag_count(p) * int64_t(sizeof(unsigned));
}

}  // namespace attnrnn::plan
