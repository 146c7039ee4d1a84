// Internal entry points of the softmax-attention ops (api.cpp validates, then calls one of these).
#pragma once

#include "attnrnn/attnrnn.h"

namespace attnrnn::cpu {
Status softmax_fwd(const SoftmaxAttnParams& p);
Status softmax_bwd(const SoftmaxAttnParams& p);
Status softmax_step(const SoftmaxAttnStepParams& p);
}  // namespace attnrnn::cpu

// Defined in csrc/cuda/softmax_attn.cu; api.cpp reaches them only when built with ATTNRNN_WITH_CUDA.
namespace attnrnn::cuda {
Status softmax_fwd(const SoftmaxAttnParams& p);
Status softmax_bwd(const SoftmaxAttnParams& p);
Status softmax_step(const SoftmaxAttnStepParams& p);
}  // namespace attnrnn::cuda
