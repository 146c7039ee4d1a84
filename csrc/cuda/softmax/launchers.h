// Declarations of the softmax-attention launchers instantiated in instantiations/softmax_*.cu
// (one (op, dtype) per file).
#pragma once

#include "../common/device.cuh"

namespace attnrnn::cuda {

template <class T>
Status launch_softmax_fwd(const SoftmaxAttnParams& p);
template <class T>
Status launch_softmax_bwd(const SoftmaxAttnParams& p);
template <class T>
Status launch_softmax_step(const SoftmaxAttnStepParams& p);

#define ATTNRNN_DECLARE_SOFTMAX_LAUNCHERS(T)                              \
  extern template Status launch_softmax_fwd<T>(const SoftmaxAttnParams&); \
  extern template Status launch_softmax_bwd<T>(const SoftmaxAttnParams&); \
  extern template Status launch_softmax_step<T>(const SoftmaxAttnStepParams&);
ATTNRNN_DECLARE_SOFTMAX_LAUNCHERS(double)
ATTNRNN_DECLARE_SOFTMAX_LAUNCHERS(float)
ATTNRNN_DECLARE_SOFTMAX_LAUNCHERS(__half)
ATTNRNN_DECLARE_SOFTMAX_LAUNCHERS(__nv_bfloat16)
#undef ATTNRNN_DECLARE_SOFTMAX_LAUNCHERS

}  // namespace attnrnn::cuda
