// The TF32 wgmma dq, dk and dv sweeps of fp32 (exact and padded dims).
#include "../sweep.cuh"

namespace attnrnn::cuda {
ATTNRNN_TF32_BACKWARD()
}  // namespace attnrnn::cuda
