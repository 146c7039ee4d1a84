// The backward of chunk_linear_attn and recurrent_linear_attn on CUDA: runs the plan's kernels
// (plan.h). Tensor cores, in order on the call's stream:
//   features  the feature pass where the plan has one
//   weights   with normalize, w_t = s / den_t and dd_t = -w_t (dout_t . o_t) per (token, query head)
//             from the forward's saved w (grad_weights.cuh), into the workspace
//   dq        its sweep; pass 1 from the forward's segment states where it saved them
//   dk, dv    two sweeps, one sweep (K = V = 64: ScanRole::kGradKV; K = V = 128 without normalize:
//             grad_kv_wgmma.cuh), or dv's then dk's with one pass 1 for both (GradKv)
//   repair    the generic kernels below, for the (sequence, kv head)s whose rows were not finite
//             (args.cuh)
// Otherwise the generic CUDA-core kernels: dq (which writes den_t, dd_t), then dk, then dv. The
// tensor-core sweeps are compiled once per normalize mode; the unnormalized ones are instantiated in
// instantiations/backward_unnormalized_*.cu, so that the two sets build in parallel, and the mma.sync
// sweeps they share once, in instantiations/backward_*.cu.
#pragma once

#include <algorithm>
#include <type_traits>

#include "generic_backward.cuh"
#include "grad_kv_wgmma.cuh"
#include "grad_weights.cuh"
#include "sweep.cuh"

namespace attnrnn::cuda {

// The weights kernel of value dims run as V lanes' worth (kPadded: the real dim is less than V),
// for o's rows aligned to 16 bytes or not.
template <class T, int V, bool kPadded>
auto grad_weights_for(bool out16) {
  return out16 ? grad_weights_kernel<T, V, true, kPadded> : grad_weights_kernel<T, V, false, kPadded>;
}

// w and dd from the forward's saved w: a grid of at most 8 blocks per SM (the grid-stride loop takes
// the rest), fewer where there are fewer rows.
template <class T>
Status launch_grad_weights(const ChunkPlan& plan, const ChunkArgs& p) {
  // value dims other than 64 and 128 run padded to 64, 128 or 256 lanes' worth, those past the real
  // dim adding zeros (256: bf16/fp16 on wgmma; fp32 stops at 128, mma.sync's largest)
  const int64_t V = p.head_dim_v <= 64 ? 64 : p.head_dim_v <= 128 ? 128 : 256;
  const bool padded = p.head_dim_v != V || V == 256;
  const int64_t rows = p.batch * p.seqlen * p.num_heads;
  const int64_t lanes = V / kPieceElems<T>;  // per row: grad_weights_lanes<T, V>()
  const int64_t rows_per_block = (kDdThreads / 32) * (32 / lanes) * kDdUnroll;
  const int64_t blocks = std::min<int64_t>((rows + rows_per_block - 1) / rows_per_block, int64_t(sm_count()) * 8);
  if (blocks == 0) return Status::kSuccess;
  const bool out16 = plan.out_rows_aligned16;
  decltype(&grad_weights_kernel<T, 64, true>) kernel = nullptr;
  if (V == 64) {
    kernel = padded ? grad_weights_for<T, 64, true>(out16) : grad_weights_for<T, 64, false>(out16);
  } else if (V == 128) {
    kernel = padded ? grad_weights_for<T, 128, true>(out16) : grad_weights_for<T, 128, false>(out16);
  } else if constexpr (sizeof(T) == 2) {
    kernel = grad_weights_for<T, 256, true>(out16);
  } else {
    return fail(Status::kInvalidArgument, "chunk_linear_attn backward: fp32 weights past V = 128");
  }
  kernel<<<static_cast<unsigned>(blocks), kDdThreads, 0, static_cast<cudaStream_t>(p.stream)>>>(p);
  return check_launch("chunk_linear_attn backward (weights from the forward's denominators)");
}

// dk and dv in one sweep at K = V = 128 (grad_kv_wgmma.cuh), after dv's pass 1 where it splits: the
// state kernel of dv's 64-token sweep, on two output tiles per block of this sweep.
template <class T, bool WithNormalizer>
Status run_grad_kv_128(const Sweep& sweep, const ChunkArgs& p, const ScanFeatures& feat) {
  const char* what = "chunk_linear_attn backward (dk and dv, K = V = 128)";
  if constexpr (WithNormalizer) {
    return fail(Status::kInvalidArgument, "%s: the fused sweep has no normalizer", what);
  } else {
    if (const Status s = check_normalize_mode<false>(p, what); s != Status::kSuccess) return s;
    const StateKernelPass<T, ScanRole::kGradV, 128, WgmmaLayout<128>::min_blocks, false> dv_first_pass{
        p, feat, kChunk, what, 2};
    // with one query head per kv head every step is a chunk's first and last (grad_kv_wgmma.cuh)
    auto kernel = p.num_heads == p.num_kv_heads ? wgmma_grad_kv_kernel<T, true> : wgmma_grad_kv_kernel<T, false>;
    return run_sweep(kernel, WgmmaGradKvLayout::smem_bytes, WgmmaGradKvLayout::threads, kChunk, p, sweep, 1, feat,
                     what, dv_first_pass);
  }
}

// dk and dv in one wgmma sweep (GradKv::kFused64, kFused128): bf16 and fp16 only.
template <class T, bool WithNormalizer>
Status run_fused_grad_kv(const ChunkPlan& plan, const ChunkArgs& p, const ScanFeatures& feat) {
  if constexpr (std::is_same_v<T, float>) {
    return fail(Status::kInvalidArgument, "chunk_linear_attn backward: fp32 has no fused dk + dv sweep");
  } else if (plan.grad_kv == GradKv::kFused64) {
    return run_wgmma_sweep<T, ScanRole::kGradKV, 64, WithNormalizer>(plan.dk, p, feat,
                                                                      "chunk_linear_attn backward (dk, dv)");
  } else {
    return run_grad_kv_128<T, WithNormalizer>(plan.dv, p, feat);
  }
}

template <class T, bool WithNormalizer>
Status launch_tensor_core_sweeps(const ChunkPlan& plan, const ChunkArgs& p) {
  ScanFeatures feat;
  Status s = prepare_features<T>(plan, p, feat);
  if constexpr (WithNormalizer) {
    if (s == Status::kSuccess) s = launch_grad_weights<T>(plan, p);
  }
  if (s == Status::kSuccess)
    s = run_planned_sweep<T, ScanRole::kGradQ, WithNormalizer>(plan.dq, p, feat, "chunk_linear_attn backward (dq)");
  if (s != Status::kSuccess) return s;
  switch (plan.grad_kv) {
    case GradKv::kFused64:
    case GradKv::kFused128:
      return run_fused_grad_kv<T, WithNormalizer>(plan, p, feat);
    case GradKv::kSharedFirstPass:  // dv first: its pass 1 writes dk's partials too
      s = run_planned_sweep<T, ScanRole::kGradV, WithNormalizer>(plan.dv, p, feat, "chunk_linear_attn backward (dv)");
      if (s != Status::kSuccess) return s;
      return run_planned_sweep<T, ScanRole::kGradK, WithNormalizer>(plan.dk, p, feat, "chunk_linear_attn backward (dk)");
    case GradKv::kSeparate:
      s = run_planned_sweep<T, ScanRole::kGradK, WithNormalizer>(plan.dk, p, feat, "chunk_linear_attn backward (dk)");
      if (s != Status::kSuccess) return s;
      return run_planned_sweep<T, ScanRole::kGradV, WithNormalizer>(plan.dv, p, feat, "chunk_linear_attn backward (dv)");
  }
  return fail(Status::kInvalidArgument, "chunk_linear_attn backward: no such dk/dv plan");
}

template <class T>
Status launch_generic_backward(const ChunkPlan& plan, const ChunkArgs& p);

template <class T, bool WithNormalizer>
Status launch_tensor_core_backward(const ChunkPlan& plan, const ChunkArgs& p) {
  const Status swept = launch_tensor_core_sweeps<T, WithNormalizer>(plan, p);
  return swept != Status::kSuccess ? swept : launch_generic_backward<T>(plan, p);
}

// The two normalize modes' sweeps live in separate files; the mma.sync sweeps, which have no
// normalize mode, are instantiated once, with the normalized half.
extern template Status launch_tensor_core_backward<__nv_bfloat16, false>(const ChunkPlan&, const ChunkArgs&);
extern template Status launch_tensor_core_backward<__half, false>(const ChunkPlan&, const ChunkArgs&);
// The mma.sync backward sweeps of operand type T (kTf32x3: fp32's exact variant), instantiated apart.
#define ATTNRNN_MMA_BACKWARD_SWEEP(PREFIX, T, R, DI, X3) \
  PREFIX template Status run_mma_sweep<T, R, DI, X3>(const Sweep&, const ChunkArgs&, const ScanFeatures&, const char*);
#define ATTNRNN_MMA_BACKWARD_SWEEPS(PREFIX, T, X3)                   \
  ATTNRNN_MMA_BACKWARD_SWEEP(PREFIX, T, ScanRole::kGradQ, 64, X3)  \
  ATTNRNN_MMA_BACKWARD_SWEEP(PREFIX, T, ScanRole::kGradQ, 128, X3) \
  ATTNRNN_MMA_BACKWARD_SWEEP(PREFIX, T, ScanRole::kGradK, 64, X3)  \
  ATTNRNN_MMA_BACKWARD_SWEEP(PREFIX, T, ScanRole::kGradK, 128, X3) \
  ATTNRNN_MMA_BACKWARD_SWEEP(PREFIX, T, ScanRole::kGradV, 64, X3)  \
  ATTNRNN_MMA_BACKWARD_SWEEP(PREFIX, T, ScanRole::kGradV, 128, X3)
ATTNRNN_MMA_BACKWARD_SWEEPS(extern, __nv_bfloat16, false)
ATTNRNN_MMA_BACKWARD_SWEEPS(extern, __half, false)
ATTNRNN_MMA_BACKWARD_SWEEPS(extern, float, false)
ATTNRNN_MMA_BACKWARD_SWEEPS(extern, float, true)

template <class T>
Status launch_generic_backward(const ChunkPlan& plan, const ChunkArgs& p) {
  using A = typename AccOf<T>::type;
  const int64_t N = num_states(p), K = p.head_dim_k, V = p.head_dim_v;
  cudaStream_t stream = static_cast<cudaStream_t>(p.stream);
  const int BK = static_cast<int>(K < GenericTiles::key_rows ? K : GenericTiles::key_rows);
  const int BV = static_cast<int>(V < GenericTiles::value_columns ? V : GenericTiles::value_columns);
  const int C = plan.generic_chunk;
  const int64_t a = sizeof(A);
  const int64_t dq_bytes = dq_smem(K, V, C, BK) * a, dk_bytes = dk_smem(V, C, BK) * a, dv_bytes = dv_smem(K, C, BV) * a;
  Status s = allow_smem(generic_grad_q_kernel<T>, dq_bytes, "chunk_linear_attn backward (dq)");
  if (s == Status::kSuccess) s = allow_smem(generic_grad_k_kernel<T>, dk_bytes, "chunk_linear_attn backward (dk)");
  if (s == Status::kSuccess) s = allow_smem(generic_grad_v_kernel<T>, dv_bytes, "chunk_linear_attn backward (dv)");
  if (s != Status::kSuccess) return s;
  const unsigned n = static_cast<unsigned>(N), g = static_cast<unsigned>(p.num_kv_heads);
  const unsigned k_tiles = static_cast<unsigned>((K + BK - 1) / BK), v_tiles = static_cast<unsigned>((V + BV - 1) / BV);
  generic_grad_q_kernel<T><<<dim3(n, k_tiles, g), kBwdThreads, dq_bytes, stream>>>(p, C, BK);
  s = check_launch("chunk_linear_attn backward (dq)");
  if (s != Status::kSuccess) return s;
  generic_grad_k_kernel<T><<<dim3(n, k_tiles, g), kBwdThreads, dk_bytes, stream>>>(p, C, BK);
  s = check_launch("chunk_linear_attn backward (dk)");
  if (s != Status::kSuccess) return s;
  generic_grad_v_kernel<T><<<dim3(n, v_tiles, g), kBwdThreads, dv_bytes, stream>>>(p, C, BV);
  return check_launch("chunk_linear_attn backward (dv)");
}

// Instantiated with the normalized half (instantiations/backward_*.cu); the unnormalized tensor-core
// backward calls it too.
extern template Status launch_generic_backward<__nv_bfloat16>(const ChunkPlan&, const ChunkArgs&);
extern template Status launch_generic_backward<__half>(const ChunkPlan&, const ChunkArgs&);

template <class T>
Status launch_chunk_bwd(const ChunkPlan& plan, const ChunkArgs& p) {
  if (num_states(p) == 0) return Status::kSuccess;
  if constexpr (std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half> || std::is_same_v<T, float>) {
    if (plan.tensor_cores)
      return p.normalize ? launch_tensor_core_backward<T, true>(plan, p) : launch_tensor_core_backward<T, false>(plan, p);
  }
  return launch_generic_backward<T>(plan, p);
}

}  // namespace attnrnn::cuda
