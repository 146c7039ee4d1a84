// The launchers the entry points call, one instantiation per (direction, dtype) in
// instantiations/*.cu.
#pragma once

#include "args.cuh"
#include "plan.h"

namespace attnrnn::cuda {

template <class T>
Status launch_chunk_fwd(const ChunkPlan& plan, const ChunkArgs& p);
template <class T>
Status launch_chunk_bwd(const ChunkPlan& plan, const ChunkArgs& p);
template <class T>
Status launch_step(const LinearAttnStepParams& p);

#define ATTNRNN_DECLARE_LAUNCHERS(T)                                                  \
  extern template Status launch_chunk_fwd<T>(const ChunkPlan&, const ChunkArgs&);     \
  extern template Status launch_chunk_bwd<T>(const ChunkPlan&, const ChunkArgs&);     \
  extern template Status launch_step<T>(const LinearAttnStepParams&);
ATTNRNN_DECLARE_LAUNCHERS(double)
ATTNRNN_DECLARE_LAUNCHERS(float)
ATTNRNN_DECLARE_LAUNCHERS(__half)
ATTNRNN_DECLARE_LAUNCHERS(__nv_bfloat16)
#undef ATTNRNN_DECLARE_LAUNCHERS

}  // namespace attnrnn::cuda
