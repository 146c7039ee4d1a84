// The TF32 wgmma dq, dk and dv sweeps of fp32 at inner dim 128 (exact and padded).
#include "../sweep.cuh"

namespace attnrnn::cuda {
ATTNRNN_TF32_BACKWARD(, 128)
}  // namespace attnrnn::cuda
