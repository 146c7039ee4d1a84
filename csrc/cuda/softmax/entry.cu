// CUDA entry points of the softmax-attention ops: pick the input type, then the launcher of
// launch.cuh (whose instantiations live in instantiations/*.cu).
#include "softmax_kernels.h"
#include "launchers.h"

namespace attnrnn::cuda {

Status softmax_fwd(const SoftmaxAttnParams& p) {
  return dispatch_dtype(p.dtype, [&](auto t) { return launch_softmax_fwd<decltype(t)>(p); });
}
Status softmax_bwd(const SoftmaxAttnParams& p) {
  return dispatch_dtype(p.dtype, [&](auto t) { return launch_softmax_bwd<decltype(t)>(p); });
}
Status softmax_step(const SoftmaxAttnStepParams& p) {
  return dispatch_dtype(p.dtype, [&](auto t) { return launch_softmax_step<decltype(t)>(p); });
}

}  // namespace attnrnn::cuda
