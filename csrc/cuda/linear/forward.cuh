// The forward of chunk_linear_attn and recurrent_linear_attn on CUDA: runs the plan's kernels
// (plan.h). Tensor cores: the feature pass where the plan has one, then the forward sweep (mma.sync,
// or wgmma on 64- or 128-token chunks, in one pass or two), then the generic kernel for the
// (sequence, kv head)s whose rows were not finite (args.cuh). Otherwise the generic CUDA-core kernel.
// Instantiated per dtype in instantiations/forward_*.cu.
#pragma once

#include <type_traits>

#include "generic_forward.cuh"
#include "sweep.cuh"

namespace attnrnn::cuda {

template <class T>
Status launch_generic_forward(const ChunkPlan& plan, const ChunkArgs& p);

template <class T>
Status launch_tensor_core_forward(const ChunkPlan& plan, const ChunkArgs& p) {
  ScanFeatures feat;
  const Status s = prepare_features<T>(plan, p, feat);
  if (s != Status::kSuccess) return s;
  const char* what = plan.forward.kernel == SweepKernel::kWgmmaPair ? "chunk_linear_attn forward (wgmma, 128-token chunks)"
                     : plan.forward.kernel == SweepKernel::kWgmma   ? "chunk_linear_attn forward (wgmma)"
                                                                    : "chunk_linear_attn forward (mma.sync)";
  // Without normalize the wgmma forward runs kernels compiled without the normalizer.
  const Status swept = p.normalize ? run_planned_sweep<T, ScanRole::kForward, true>(plan.forward, p, feat, what)
                                   : run_planned_sweep<T, ScanRole::kForward, false>(plan.forward, p, feat, what);
  return swept != Status::kSuccess ? swept : launch_generic_forward<T>(plan, p);
}

template <class T>
Status launch_generic_forward(const ChunkPlan& plan, const ChunkArgs& p) {
  using A = typename AccOf<T>::type;
  const int64_t K = p.head_dim_k, V = p.head_dim_v;
  const int BV = static_cast<int>(V < GenericTiles::value_columns ? V : GenericTiles::value_columns);
  const int C = plan.generic_chunk;
  const int64_t bytes = fwd_smem(K, C, BV).total() * int64_t(sizeof(A));
  Status s = allow_smem(generic_forward_kernel<T>, bytes, "chunk_linear_attn forward");
  if (s != Status::kSuccess) return s;
  const dim3 grid(static_cast<unsigned>(num_states(p)), static_cast<unsigned>((V + BV - 1) / BV),
                  static_cast<unsigned>(p.num_kv_heads));
  generic_forward_kernel<T><<<grid, kFwdThreads, bytes, static_cast<cudaStream_t>(p.stream)>>>(p, C, BV);
  return check_launch("chunk_linear_attn forward");
}

template <class T>
Status launch_chunk_fwd(const ChunkPlan& plan, const ChunkArgs& p) {
  if (num_states(p) == 0) return Status::kSuccess;
  if constexpr (std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half> || std::is_same_v<T, float>) {
    if (plan.tensor_cores) return launch_tensor_core_forward<T>(plan, p);
  }
  return launch_generic_forward<T>(plan, p);
}

}  // namespace attnrnn::cuda
