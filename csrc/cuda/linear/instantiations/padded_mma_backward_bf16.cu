// The mma.sync backward sweeps of padded head dims, bf16 (the path of GPUs without wgmma).
#include "../sweep.cuh"

namespace attnrnn::cuda {
ATTNRNN_PADDED_MMA_BACKWARD(, __nv_bfloat16, false)
}  // namespace attnrnn::cuda
