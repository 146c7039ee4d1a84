// The mma.sync forward sweeps of padded head dims, fp32 on TF32 operands.
#include "../sweep.cuh"

namespace attnrnn::cuda {
ATTNRNN_PADDED_MMA_FORWARD(, float, false)
}  // namespace attnrnn::cuda
