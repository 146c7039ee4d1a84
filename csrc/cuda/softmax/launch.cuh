// Host side of the softmax-attention CUDA kernels: path choice, tiles, shared memory, launches.
// Each (op, dtype) is instantiated in its own small .cu (instantiations/softmax_*.cu).
//
// Tile table (H200: 228 KB shared memory and 64 K registers per SM):
//   path               block                      tile                         reason
//   forward, tensor    8 warps x 16 queries       128 queries x 64 keys,       128 queries halve the K/V
//   cores (bf16/fp16,                             K/V double-buffered          traffic from L2 against 64;
//   D = Dv in {64,128})                           (102 KB at D = 128)          2 blocks/SM fit in registers
//                                                                              (Q re-read per key block)
//   dq, tensor cores   4 warps (D = 128),         64 or 128 queries x 64 keys  dq, dS, dP, S in registers:
//                      8 warps (D = 64)           (104 / 72 KB)                ~160 at D = 128: 2 blocks/SM
//   dk/dv, tensor      8 warps x 16 keys          128 keys x 64 queries,       dK and dV in registers for the
//   cores                                         Q/dO double-buffered         whole loop (~230 at D = 128):
//                                                 (138 KB at D = 128)          1 block/SM
//   generic fwd/dq     8 warps x RQ queries       32 keys per step             lane = key: warp reductions
//   generic dk/dv      8 warps x RK keys          32 queries per step          only; RQ = RK = 4 unless the
//                                                                              tiles exceed shared memory (1)
//   step, fast         4 warps                    D/VEC lanes per key, U in    16-byte loads, >= 16 KB in
//   (D = Dv in                                    flight (U = 4, 2 for GT > 2) flight per block
//    {64,128})
//   step, generic      4 warps, 1 head            1 key per warp per step      any dims and dtypes
// Rows with bad alignment (not 16-byte rows), other head dims and fp32/fp64 take the generic paths.
// With cu_seqlens, fill_uncovered_kernel runs first: the tokens bad offsets may leave out (common.cuh).
// After the tensor-core kernels the generic ones run too, with the tensor-core kernels' flags: they
// write again the units whose results were not finite and return at once elsewhere (common.cuh,
// non-finite values); the flags are cleared on the call's stream before the tensor-core kernels.
#pragma once

#include <climits>
#include <type_traits>

#include "backward.cuh"
#include "generic_backward.cuh"
#include "forward.cuh"
#include "softmax_plan.h"
#include "step.cuh"

namespace attnrnn::cuda {

namespace smh {

template <class T>
constexpr bool kHalf = std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>;


inline Status grid_blocks(int64_t blocks, const char* what, unsigned& out) {
  if (blocks > INT_MAX) return fail(Status::kInvalidArgument, "%s: %lld blocks exceed the grid limit", what, (long long)blocks);
  out = static_cast<unsigned>(blocks);
  return Status::kSuccess;
}

// Launches kernel over batch x heads x blocks_per_head(blk) blocks, with the call's non-finite flags
// (null for a generic call).
template <class Kernel>
Status launch_blocks(Kernel kernel, const SoftmaxAttnParams& p, int64_t T, int blk, int64_t heads, int threads,
                     int64_t smem, const char* what, unsigned* flags) {
  const int64_t per = sm::blocks_per_head(p, T, blk);
  unsigned blocks = 0;
  Status s = grid_blocks(p.batch * heads * per, what, blocks);
  if (s == Status::kSuccess) s = allow_smem(kernel, smem, what);
  if (s != Status::kSuccess || blocks == 0) return s;
  kernel<<<blocks, threads, smem, static_cast<cudaStream_t>(p.stream)>>>(p, per, flags);
  return check_launch(what);
}

// The non-finite flags of a tensor-core call, at byte `at` of the workspace (softmax_plan.h).
inline unsigned* flags_at(const SoftmaxAttnParams& p, int64_t at) {
  return reinterpret_cast<unsigned*>(static_cast<char*>(p.workspace) + at);
}

// Clears them on the call's stream, before the tensor-core kernels set them.
inline Status clear_flags(const SoftmaxAttnParams& p, unsigned* flags, int64_t count, const char* what) {
  cudaMemsetAsync(flags, 0, static_cast<size_t>(count) * sizeof(unsigned), static_cast<cudaStream_t>(p.stream));
  return check_launch(what);
}

// With cu_seqlens, before the attention kernels: the tokens that bad offsets may leave out get
// o = 0, lse = -inf (forward) or zero gradients (backward); nothing for well-formed offsets.
template <class T>
Status fill_uncovered(const SoftmaxAttnParams& p, bool bwd) {
  if (p.cu_seqlens == nullptr || p.seqlen_q == 0) return Status::kSuccess;
  const int64_t cols = p.head_dim > p.head_dim_v ? p.head_dim : p.head_dim_v;
  const int64_t want = (p.seqlen_q * p.num_heads * cols + 4 * sm::kFillThreads - 1) / (4 * sm::kFillThreads);
  const unsigned blocks = static_cast<unsigned>(want < sm::kFillMaxBlocks ? want : sm::kFillMaxBlocks);
  sm::fill_uncovered_kernel<T><<<blocks, sm::kFillThreads, 0, static_cast<cudaStream_t>(p.stream)>>>(p, bwd);
  return check_launch(bwd ? "streaming_attn backward (uncovered tokens)" : "streaming_attn forward (uncovered tokens)");
}

}  // namespace smh

template <class T>
Status launch_softmax_fwd(const SoftmaxAttnParams& p) {
  using A = typename AccOf<T>::type;
  if (p.batch == 0 || p.seqlen_q == 0) return Status::kSuccess;
  if (plan::fwd_workspace_bytes(p) > 0 && p.workspace == nullptr)
    return fail(Status::kInvalidArgument, "workspace must hold softmax_attn_fwd_workspace_bytes() = %lld bytes",
                (long long)plan::fwd_workspace_bytes(p));
  const char* what = "streaming_attn forward";
  if (const Status s = smh::fill_uncovered<T>(p, false); s != Status::kSuccess || plan::num_sequences(p) == 0)
    return s;  // no sequence (cu_seqlens of one offset): every token is uncovered
  unsigned* flags = nullptr;
  if constexpr (smh::kHalf<T>) {
    if (plan::tensor_core_shape(p) && sm::rows16(p.q, 2) && sm::rows16(p.k, 2) && sm::rows16(p.v, 2) &&
        sm::rows16(p.o, 2)) {
      flags = smh::flags_at(p, 0);
      Status s = smh::clear_flags(p, flags, plan::fwd_flag_count(p), what);
      if (s == Status::kSuccess)
        s = p.head_dim == 64 ? smh::launch_blocks(sm::fwd_tc_kernel<T, 64>, p, p.seqlen_q, sm::kFwdBr, p.num_heads,
                                                  sm::kFwdThreads, sm::FwdTcSmem<64>::kBytes, what, flags)
                             : smh::launch_blocks(sm::fwd_tc_kernel<T, 128>, p, p.seqlen_q, sm::kFwdBr, p.num_heads,
                                                  sm::kFwdThreads, sm::FwdTcSmem<128>::kBytes, what, flags);
      if (s != Status::kSuccess) return s;
    }
  }
  // The generic kernel: the whole call, or with flags the heads the tensor-core kernel flagged.
  const int64_t big = sm::FwdGenSmem{p.head_dim, p.head_dim_v, 4 * sm::kGenWarps}.total() * int64_t(sizeof(A));
  if (big <= max_dynamic_smem())
    return smh::launch_blocks(sm::fwd_generic_kernel<T, 4>, p, p.seqlen_q, 4 * sm::kGenWarps, p.num_heads,
                              sm::kGenThreads, big, what, flags);
  const int64_t small = sm::FwdGenSmem{p.head_dim, p.head_dim_v, sm::kGenWarps}.total() * int64_t(sizeof(A));
  return smh::launch_blocks(sm::fwd_generic_kernel<T, 1>, p, p.seqlen_q, sm::kGenWarps, p.num_heads, sm::kGenThreads,
                            small, what, flags);
}

template <class T>
Status launch_softmax_bwd(const SoftmaxAttnParams& p) {
  using A = typename AccOf<T>::type;
  if (p.batch == 0 || (p.seqlen_q == 0 && p.seqlen_k == 0)) return Status::kSuccess;
  if (plan::bwd_workspace_bytes(p) > 0 && p.workspace == nullptr)
    return fail(Status::kInvalidArgument, "workspace must hold softmax_attn_bwd_workspace_bytes() = %lld bytes",
                (long long)plan::bwd_workspace_bytes(p));
  cudaStream_t stream = static_cast<cudaStream_t>(p.stream);
  const char* what_dq = "streaming_attn backward (dq)";
  const char* what_dkv = "streaming_attn backward (dk, dv)";
  Status s = Status::kSuccess;

  // 1. D_i = dout_i . o_i.
  const int64_t rows = p.batch * p.seqlen_q * p.num_heads;
  if (rows > 0) {
    unsigned blocks = 0;
    s = smh::grid_blocks((rows * 32 + sm::kDotThreads - 1) / sm::kDotThreads, "streaming_attn backward (dot)", blocks);
    if (s != Status::kSuccess) return s;
    sm::bwd_dot_kernel<T><<<blocks, sm::kDotThreads, 0, stream>>>(p);
    s = check_launch("streaming_attn backward (dot)");
    if (s != Status::kSuccess) return s;
  }
  s = smh::fill_uncovered<T>(p, true);
  if (s != Status::kSuccess || plan::num_sequences(p) == 0) return s;  // no sequence: as in the forward

  unsigned* flags = nullptr;
  if constexpr (smh::kHalf<T>) {
    if (plan::tensor_core_shape(p) && sm::rows16(p.q, 2) && sm::rows16(p.k, 2) && sm::rows16(p.v, 2) &&
        sm::rows16(p.dout, 2) && sm::rows16(p.dq, 2) && sm::rows16(p.dk, 2) && sm::rows16(p.dv, 2)) {
      // 2. dq, 3. dk, dv.
      flags = smh::flags_at(p, plan::bwd_flags_offset(p));
      s = smh::clear_flags(p, flags, plan::bwd_flag_count(p), what_dq);
      if (s == Status::kSuccess)
        s = p.head_dim == 64 ? smh::launch_blocks(sm::bwd_dq_tc_kernel<T, 64, 8>, p, p.seqlen_q, 128, p.num_heads, 256,
                                                  sm::DqSmem<64, 8>::kBytes, what_dq, flags)
                             : smh::launch_blocks(sm::bwd_dq_tc_kernel<T, 128, 4>, p, p.seqlen_q, 64, p.num_heads, 128,
                                                  sm::DqSmem<128, 4>::kBytes, what_dq, flags);
      if (s == Status::kSuccess)
        s = p.head_dim == 64 ? smh::launch_blocks(sm::bwd_dkv_tc_kernel<T, 64>, p, p.seqlen_k, sm::kDkvBc,
                                                  p.num_kv_heads, sm::kDkvThreads, sm::DkvSmem<64>::kBytes, what_dkv,
                                                  flags)
                             : smh::launch_blocks(sm::bwd_dkv_tc_kernel<T, 128>, p, p.seqlen_k, sm::kDkvBc,
                                                  p.num_kv_heads, sm::kDkvThreads, sm::DkvSmem<128>::kBytes, what_dkv,
                                                  flags);
      if (s != Status::kSuccess) return s;
    }
  }
  // 2. dq, 3. dk, dv on CUDA cores: the whole call, or with flags the kv heads the tensor-core
  // kernels flagged. 4 rows per warp unless the tiles exceed shared memory.
  const int64_t limit = max_dynamic_smem(), a = sizeof(A), D = p.head_dim, Dv = p.head_dim_v;
  const int64_t dq4 = sm::DqGenSmem{D, Dv, 4 * sm::kGenWarps}.total() * a;
  const int64_t dq1 = sm::DqGenSmem{D, Dv, sm::kGenWarps}.total() * a;
  s = dq4 <= limit ? smh::launch_blocks(sm::bwd_dq_generic_kernel<T, 4>, p, p.seqlen_q, 4 * sm::kGenWarps, p.num_heads,
                                        sm::kGenThreads, dq4, what_dq, flags)
                   : smh::launch_blocks(sm::bwd_dq_generic_kernel<T, 1>, p, p.seqlen_q, sm::kGenWarps, p.num_heads,
                                        sm::kGenThreads, dq1, what_dq, flags);
  if (s != Status::kSuccess) return s;
  const int64_t kv4 = sm::DkvGenSmem{D, Dv, 4 * sm::kGenWarps}.total() * a;
  const int64_t kv1 = sm::DkvGenSmem{D, Dv, sm::kGenWarps}.total() * a;
  return kv4 <= limit ? smh::launch_blocks(sm::bwd_dkv_generic_kernel<T, 4>, p, p.seqlen_k, 4 * sm::kGenWarps,
                                           p.num_kv_heads, sm::kGenThreads, kv4, what_dkv, flags)
                      : smh::launch_blocks(sm::bwd_dkv_generic_kernel<T, 1>, p, p.seqlen_k, sm::kGenWarps,
                                           p.num_kv_heads, sm::kGenThreads, kv1, what_dkv, flags);
}

namespace smh {

template <class T, int D, int GT>
Status launch_step_fast(const SoftmaxAttnStepParams& p, sm::StepPlan pl) {
  constexpr int U = GT > 2 ? 2 : 4;
  const int64_t G = p.num_heads / p.num_kv_heads;
  pl.passes = static_cast<int>((G + GT - 1) / GT);
  const int64_t gy = p.num_kv_heads * pl.passes;
  if (gy > 65535) return fail(Status::kInvalidArgument, "softmax_attn_step: num_kv_heads = %lld is too large", (long long)p.num_kv_heads);
  unsigned gx = 0;
  Status s = grid_blocks(p.batch * pl.splits, "softmax_attn_step", gx);
  if (s != Status::kSuccess) return s;
  sm::step_fast_kernel<T, D, GT, U><<<dim3(gx, static_cast<unsigned>(gy)), sm::kStepThreads, 0,
                                      static_cast<cudaStream_t>(p.stream)>>>(p, pl);
  return check_launch("softmax_attn_step");
}

template <class T, int D>
Status launch_step_fast_heads(const SoftmaxAttnStepParams& p, sm::StepPlan pl) {
  const int64_t G = p.num_heads / p.num_kv_heads;
  if (G == 1) return launch_step_fast<T, D, 1>(p, pl);
  if (G == 2) return launch_step_fast<T, D, 2>(p, pl);
  if (G <= 4) return launch_step_fast<T, D, 4>(p, pl);
  return launch_step_fast<T, D, 8>(p, pl);
}

template <class View>
bool rows16_any(const View& x, int elem_bytes) {
  return x.data == nullptr || sm::rows16(x, elem_bytes);
}

}  // namespace smh

template <class T>
Status launch_softmax_step(const SoftmaxAttnStepParams& p) {
  if (p.batch == 0) return Status::kSuccess;
  sm::StepPlan pl{plan::step_split_size(p), plan::step_num_splits(p), 1};
  if (pl.splits > 1 && p.workspace == nullptr)
    return fail(Status::kInvalidArgument, "workspace must hold softmax_attn_step_workspace_bytes() = %lld bytes",
                (long long)plan::step_workspace_bytes(p));
  cudaStream_t stream = static_cast<cudaStream_t>(p.stream);
  Status s = Status::kSuccess;
  constexpr int eb = sizeof(T);
  const bool fast = !std::is_same_v<T, double> && p.head_dim == p.head_dim_v &&
                    (p.head_dim == 64 || p.head_dim == 128) && sm::rows16(p.k_cache, eb) &&
                    sm::rows16(p.v_cache, eb) && smh::rows16_any(p.k_new, eb) && smh::rows16_any(p.v_new, eb);
  if constexpr (!std::is_same_v<T, double>) {
    if (fast) s = p.head_dim == 64 ? smh::launch_step_fast_heads<T, 64>(p, pl) : smh::launch_step_fast_heads<T, 128>(p, pl);
  }
  if (!fast) {
    unsigned gx = 0;
    s = smh::grid_blocks(p.batch * pl.splits, "softmax_attn_step", gx);
    if (s != Status::kSuccess) return s;
    if (p.num_heads > 65535) return fail(Status::kInvalidArgument, "softmax_attn_step: num_heads = %lld is too large", (long long)p.num_heads);
    sm::step_generic_kernel<T><<<dim3(gx, static_cast<unsigned>(p.num_heads)), sm::kStepThreads, 0, stream>>>(p, pl);
    s = check_launch("softmax_attn_step");
  }
  if (s != Status::kSuccess || pl.splits == 1) return s;
  unsigned blocks = 0;
  s = smh::grid_blocks(p.batch * p.num_heads, "softmax_attn_step (combine)", blocks);
  if (s != Status::kSuccess) return s;
  sm::step_combine_kernel<T><<<blocks, sm::kStepThreads, 0, stream>>>(p, pl);
  return check_launch("softmax_attn_step (combine)");
}

}  // namespace attnrnn::cuda
