#include "../sweep.cuh"

namespace attnrnn::cuda {
ATTNRNN_PADDED_BACKWARD(, __nv_bfloat16, false)
}  // namespace attnrnn::cuda
