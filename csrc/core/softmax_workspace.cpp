// Device scratch of the softmax-attention ops (the sizes are planned in softmax_plan.h).
#include "attnrnn/attnrnn.h"
#include "softmax_plan.h"

namespace attnrnn {

int64_t softmax_attn_fwd_workspace_bytes(const SoftmaxAttnParams& params) {
  return plan::fwd_workspace_bytes(params);
}

int64_t softmax_attn_bwd_workspace_bytes(const SoftmaxAttnParams& params) {
  return plan::bwd_workspace_bytes(params);
}

int64_t softmax_attn_step_workspace_bytes(const SoftmaxAttnStepParams& params) {
  return plan::step_workspace_bytes(params);
}

}  // namespace attnrnn
