// Declarations of the launchers instantiated in instantiations/*.cu (one (op, dtype) per file).
#pragma once

#include "common.cuh"

namespace attnrnn::cuda {

// recurrent = true runs the token-by-token form (chunks of one token).
template <class T>
Status launch_chunk_fwd(const LinearAttnParams& p, bool recurrent);
template <class T>
Status launch_chunk_bwd(const LinearAttnParams& p, bool recurrent);
template <class T>
Status launch_step(const LinearAttnStepParams& p);

#define ATTNRNN_DECLARE_LAUNCHERS(T)                                                   \
  extern template Status launch_chunk_fwd<T>(const LinearAttnParams&, bool);          \
  extern template Status launch_chunk_bwd<T>(const LinearAttnParams&, bool);          \
  extern template Status launch_step<T>(const LinearAttnStepParams&);
ATTNRNN_DECLARE_LAUNCHERS(double)
ATTNRNN_DECLARE_LAUNCHERS(float)
ATTNRNN_DECLARE_LAUNCHERS(__half)
ATTNRNN_DECLARE_LAUNCHERS(__nv_bfloat16)
#undef ATTNRNN_DECLARE_LAUNCHERS

}  // namespace attnrnn::cuda
