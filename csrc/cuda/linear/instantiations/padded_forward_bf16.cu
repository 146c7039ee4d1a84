#include "../sweep.cuh"

namespace attnrnn::cuda {
ATTNRNN_PADDED_FORWARD(, __nv_bfloat16)
}  // namespace attnrnn::cuda
