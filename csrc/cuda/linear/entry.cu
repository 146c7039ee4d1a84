// CUDA entry points of the linear-attention ops: each makes the call's plan once (plan.h), checks
// the buffers it needs, places the saved w, clears the non-finite flags of a tensor-core plan
// (args.cuh), and runs the plan through the launcher of its dtype.
#include "attnrnn/testing.h"
#include "launchers.h"
#include "plan.h"

namespace attnrnn::cuda {

namespace {

ChunkPlan forward_plan(const LinearAttnFwdParams& p, bool recurrent) {
  return make_forward_plan(p, recurrent, current_device_info(), testing::plan_override());
}
ChunkPlan backward_plan(const LinearAttnBwdParams& p, bool recurrent) {
  return make_backward_plan(p, recurrent, current_device_info(), testing::plan_override());
}

Status check_workspace(const LinearAttnFwdParams& p, const ChunkPlan& plan, const char* query) {
  if (plan.workspace_bytes > 0 && p.workspace == nullptr)
    return fail(Status::kInvalidArgument, "workspace must hold %s() = %lld bytes", query,
                (long long)plan.workspace_bytes);
  return Status::kSuccess;
}

float* saved_float(const LinearAttnFwdParams& p, int64_t offset) {
  return p.saved == nullptr || offset < 0 ? nullptr : reinterpret_cast<float*>(static_cast<char*>(p.saved) + offset);
}

// The flags of the (sequence, kv head)s whose rows the tensor-core kernels found not finite, cleared
// on the call's stream (args.cuh).
Status clear_nonfinite_flags(const ChunkPlan& plan, ChunkArgs& args, const char* op) {
  if (plan.nonfinite_flags < 0) return Status::kSuccess;
  args.nonfinite = reinterpret_cast<unsigned*>(static_cast<char*>(args.workspace) + plan.nonfinite_flags);
  const size_t bytes = static_cast<size_t>(num_states(args) * args.num_kv_heads) * sizeof(unsigned);
  cudaMemsetAsync(args.nonfinite, 0, bytes, static_cast<cudaStream_t>(args.stream));
  return check_launch(op);
}

Status forward(const LinearAttnFwdParams& p, bool recurrent) {
  const ChunkPlan plan = forward_plan(p, recurrent);
  Status s = check_workspace(p, plan, "chunk_linear_attn_fwd_workspace_bytes");
  if (s != Status::kSuccess) return s;
  ChunkArgs args;
  static_cast<LinearAttnFwdParams&>(args) = p;
  args.den_out = saved_float(p, plan.saved_den);
  s = clear_nonfinite_flags(plan, args, "chunk_linear_attn forward");
  if (s != Status::kSuccess) return s;
  return dispatch_dtype(p.dtype, [&](auto t) { return launch_chunk_fwd<decltype(t)>(plan, args); });
}

Status backward(const LinearAttnBwdParams& p, bool recurrent) {
  const ChunkPlan plan = backward_plan(p, recurrent);
  Status s = check_workspace(p, plan, recurrent ? "recurrent_linear_attn_bwd_workspace_bytes"
                                                : "chunk_linear_attn_bwd_workspace_bytes");
  if (s != Status::kSuccess) return s;
  if (plan.saved_bytes > 0 && p.saved == nullptr)
    return fail(Status::kInvalidArgument,
                "saved must be the forward's saved buffer (chunk_linear_attn_saved_bytes() = %lld bytes)",
                (long long)plan.saved_bytes);
  ChunkArgs args;
  static_cast<LinearAttnBwdParams&>(args) = p;
  args.den_in = saved_float(p, plan.saved_den);
  s = clear_nonfinite_flags(plan, args, "chunk_linear_attn backward");
  if (s != Status::kSuccess) return s;
  return dispatch_dtype(p.dtype, [&](auto t) { return launch_chunk_bwd<decltype(t)>(plan, args); });
}

}  // namespace

Status chunk_fwd(const LinearAttnFwdParams& p) { return forward(p, false); }
Status recurrent_fwd(const LinearAttnFwdParams& p) { return forward(p, true); }
Status chunk_bwd(const LinearAttnBwdParams& p) { return backward(p, false); }
Status recurrent_bwd(const LinearAttnBwdParams& p) { return backward(p, true); }

int64_t chunk_saved_bytes(const LinearAttnFwdParams& p) { return forward_plan(p, false).saved_bytes; }
int64_t chunk_fwd_workspace_bytes(const LinearAttnFwdParams& p) { return forward_plan(p, false).workspace_bytes; }
int64_t chunk_bwd_workspace_bytes(const LinearAttnBwdParams& p) { return backward_plan(p, false).workspace_bytes; }
int64_t recurrent_bwd_workspace_bytes(const LinearAttnBwdParams& p) { return backward_plan(p, true).workspace_bytes; }

Status step(const LinearAttnStepParams& p) {
  return dispatch_dtype(p.dtype, [&](auto t) { return launch_step<decltype(t)>(p); });
}

}  // namespace attnrnn::cuda
