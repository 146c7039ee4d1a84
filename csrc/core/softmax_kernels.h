// Internal entry points of the softmax-attention ops (api.cpp validates, then calls one of these).
#pragma once

#include "attnrnn/attnrnn.h"

namespace attnrnn::cpu {
Status softmax_fwd(const SoftmaxAttnParams& p);
Status softmax_bwd(const SoftmaxAttnParams& p);
Status softmax_step(const SoftmaxAttnStepParams& p);
}  // namespace attnrnn::cpu
