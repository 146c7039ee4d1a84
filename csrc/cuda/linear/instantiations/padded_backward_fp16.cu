#include "../sweep.cuh"

namespace attnrnn::cuda {
ATTNRNN_PADDED_BACKWARD(, __half, true)
}  // namespace attnrnn::cuda
