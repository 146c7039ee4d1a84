// Host side of the CUDA kernels: tile choices, shared-memory limits and launches. Each
// (op, dtype) pair is instantiated in its own small .cu file (instantiations/).
//
// Tensor-core forward (chunk_fwd_tc.cuh): bf16, K in {64, 128}, V % 64 == 0, chunk 64 (the
// default or asked for), 16-byte aligned rows; 4 warps, 64 value columns and 64 tokens per step.
//
// Tile table of the generic path (256 threads per block, CUDA-core FMAs):
//   forward   BV = min(64, V) value columns per block; chunk C = the largest power of two <= the
//             requested chunk (default 64) whose shared memory fits (C = 32 at K = 256 in fp32)
//   backward  BK = min(32, K) key rows per dq/dk block, BV = min(64, V) for dv; one C for all three
//   step      one block per (batch entry, kv head); float4 columns when V % 4 == 0; GT = heads per
//             register pass (1, 2, 4 or 8)
// Reasons: a block must hold its state slice and one chunk of q, k, v in shared memory; 64-column
// tiles keep 256 threads busy on the output and state phases for K, V >= 64.
#pragma once

#include "chunk_bwd.cuh"
#include "chunk_fwd.cuh"
#include "chunk_fwd_tc.cuh"
#include "common.cuh"
#include "step.cuh"

namespace attnrnn::cuda {

inline int64_t requested_chunk(const LinearAttnParams& p, bool recurrent) {
  if (recurrent) return 1;
  return p.chunk_size > 0 ? p.chunk_size : 64;
}

// The largest power of two <= want for which fits(C) holds (at least 1).
template <class Fits>
int pick_chunk(int64_t want, Fits fits) {
  int C = 1;
  while (C * 2 <= want && C * 2 <= 64) C *= 2;
  while (C > 1 && !fits(C)) C /= 2;
  return C;
}

inline bool aligned16(const ConstView& x) {
  return reinterpret_cast<uintptr_t>(x.data) % 16 == 0 && x.stride_b % 8 == 0 && x.stride_t % 8 == 0 &&
         x.stride_h % 8 == 0;
}

inline bool tensor_core_forward(const LinearAttnParams& p, bool recurrent) {
  return p.dtype == DType::kBFloat16 && !recurrent && (p.chunk_size == 0 || p.chunk_size == kTcChunk) &&
         (p.head_dim_k == 64 || p.head_dim_k == 128) && p.head_dim_v % kTcBV == 0 && aligned16(p.q) &&
         aligned16(p.k) && aligned16(p.v) && reinterpret_cast<uintptr_t>(p.o.data) % 4 == 0 &&
         p.o.stride_b % 2 == 0 && p.o.stride_t % 2 == 0 && p.o.stride_h % 2 == 0;
}

template <int K>
Status launch_chunk_fwd_tc(const LinearAttnParams& p) {
  const int64_t bytes = TcSmem{K}.bytes();
  Status s = allow_smem(chunk_fwd_tc_kernel<K>, bytes, "chunk_linear_attn forward (tensor cores)");
  if (s != Status::kSuccess) return s;
  const dim3 grid(static_cast<unsigned>(num_states(p)), static_cast<unsigned>(p.head_dim_v / kTcBV),
                  static_cast<unsigned>(p.num_kv_heads));
  chunk_fwd_tc_kernel<K><<<grid, kTcThreads, bytes, static_cast<cudaStream_t>(p.stream)>>>(p);
  return check_launch("chunk_linear_attn forward (tensor cores)");
}

template <class T>
Status launch_chunk_fwd(const LinearAttnParams& p, bool recurrent) {
  using A = typename AccOf<T>::type;
  const int64_t N = num_states(p), K = p.head_dim_k, V = p.head_dim_v;
  if (N == 0) return Status::kSuccess;
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    if (tensor_core_forward(p, recurrent))
      return K == 64 ? launch_chunk_fwd_tc<64>(p) : launch_chunk_fwd_tc<128>(p);
  }
  const int BV = static_cast<int>(V < 64 ? V : 64);
  const int64_t limit = max_dynamic_smem();
  const int C = pick_chunk(requested_chunk(p, recurrent),
                           [&](int c) { return fwd_smem(K, c, BV).total() * int64_t(sizeof(A)) <= limit; });
  const int64_t bytes = fwd_smem(K, C, BV).total() * int64_t(sizeof(A));
  Status s = allow_smem(chunk_fwd_kernel<T>, bytes, "chunk_linear_attn forward");
  if (s != Status::kSuccess) return s;
  const dim3 grid(static_cast<unsigned>(N), static_cast<unsigned>((V + BV - 1) / BV),
                  static_cast<unsigned>(p.num_kv_heads));
  chunk_fwd_kernel<T><<<grid, kFwdThreads, bytes, static_cast<cudaStream_t>(p.stream)>>>(p, C, BV);
  return check_launch("chunk_linear_attn forward");
}

template <class T>
Status launch_chunk_bwd(const LinearAttnParams& p, bool recurrent) {
  using A = typename AccOf<T>::type;
  const int64_t N = num_states(p), K = p.head_dim_k, V = p.head_dim_v;
  cudaStream_t stream = static_cast<cudaStream_t>(p.stream);
  const int64_t elems = p.batch * p.seqlen * p.num_heads;
  if (elems > 0 && p.workspace == nullptr)
    return fail(Status::kInvalidArgument, "workspace must hold linear_attn_workspace_bytes() bytes");
  if (N == 0) return Status::kSuccess;
  const int BK = static_cast<int>(K < 32 ? K : 32), BV = static_cast<int>(V < 64 ? V : 64);
  const int64_t limit = max_dynamic_smem(), a = sizeof(A);
  const int C = pick_chunk(requested_chunk(p, recurrent), [&](int c) {
    return dq_smem(K, V, c, BK) * a <= limit && dk_smem(V, c, BK) * a <= limit && dv_smem(K, c, BV) * a <= limit;
  });
  const int64_t dq_bytes = dq_smem(K, V, C, BK) * a, dk_bytes = dk_smem(V, C, BK) * a,
                dv_bytes = dv_smem(K, C, BV) * a;
  Status s = allow_smem(chunk_bwd_dq_kernel<T>, dq_bytes, "chunk_linear_attn backward (dq)");
  if (s == Status::kSuccess) s = allow_smem(chunk_bwd_dk_kernel<T>, dk_bytes, "chunk_linear_attn backward (dk)");
  if (s == Status::kSuccess) s = allow_smem(chunk_bwd_dv_kernel<T>, dv_bytes, "chunk_linear_attn backward (dv)");
  if (s != Status::kSuccess) return s;
  const unsigned n = static_cast<unsigned>(N), g = static_cast<unsigned>(p.num_kv_heads);
  const unsigned k_tiles = static_cast<unsigned>((K + BK - 1) / BK), v_tiles = static_cast<unsigned>((V + BV - 1) / BV);
  chunk_bwd_dq_kernel<T><<<dim3(n, k_tiles, g), kBwdThreads, dq_bytes, stream>>>(p, C, BK);
  s = check_launch("chunk_linear_attn backward (dq)");
  if (s != Status::kSuccess) return s;
  chunk_bwd_dk_kernel<T><<<dim3(n, k_tiles, g), kBwdThreads, dk_bytes, stream>>>(p, C, BK);
  s = check_launch("chunk_linear_attn backward (dk)");
  if (s != Status::kSuccess) return s;
  chunk_bwd_dv_kernel<T><<<dim3(n, v_tiles, g), kBwdThreads, dv_bytes, stream>>>(p, C, BV);
  return check_launch("chunk_linear_attn backward (dv)");
}

template <class T, int GT, int W>
Status launch_step_with(const LinearAttnStepParams& p) {
  using A = typename AccOf<T>::type;
  const int64_t K = p.head_dim_k, V = p.head_dim_v, G = p.num_heads / p.num_kv_heads;
  const int cols = static_cast<int>(V / W);
  const int row_sets = cols >= kStepThreads ? 1 : kStepThreads / cols;
  const int64_t bytes = step_smem(K, V, G, GT, row_sets) * int64_t(sizeof(A));
  Status s = allow_smem(step_kernel<T, GT, W>, bytes, "linear_attn_step");
  if (s != Status::kSuccess) return s;
  const dim3 grid(static_cast<unsigned>(p.batch), static_cast<unsigned>(p.num_kv_heads));
  step_kernel<T, GT, W><<<grid, kStepThreads, bytes, static_cast<cudaStream_t>(p.stream)>>>(p, row_sets);
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
