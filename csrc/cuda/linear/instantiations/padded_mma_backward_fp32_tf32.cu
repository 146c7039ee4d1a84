// The mma.sync backward sweeps of padded head dims, fp32 on TF32 operands.
#include "../sweep.cuh"

namespace attnrnn::cuda {
ATTNRNN_PADDED_MMA_BACKWARD(, float, false)
}  // namespace attnrnn::cuda
