// The mma.sync forward sweeps of padded head dims, fp32 on 3xTF32 operands (fp32 accuracy).
#include "../sweep.cuh"

namespace attnrnn::cuda {
ATTNRNN_PADDED_MMA_FORWARD(, float, true)
}  // namespace attnrnn::cuda
