// The mma.sync backward sweeps of padded head dims, fp16 (the path of GPUs without wgmma).
#include "../sweep.cuh"

namespace attnrnn::cuda {
ATTNRNN_PADDED_MMA_BACKWARD(, __half, false)
}  // namespace attnrnn::cuda
