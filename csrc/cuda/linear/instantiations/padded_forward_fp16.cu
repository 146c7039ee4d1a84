#include "../sweep.cuh"

namespace attnrnn::cuda {
ATTNRNN_PADDED_FORWARD(, __half)
}  // namespace attnrnn::cuda
