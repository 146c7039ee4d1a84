// fp32's backward sweeps at fp32 accuracy (3xTF32), apart from the TF32 ones so that both build in parallel.
#include "../backward.cuh"

namespace attnrnn::cuda {
ATTNRNN_MMA_BACKWARD_SWEEPS(, float, true)
}  // namespace attnrnn::cuda
