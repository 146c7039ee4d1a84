// The mma.sync forward sweeps of padded head dims, bf16 (the path of GPUs without wgmma).
#include "../sweep.cuh"

namespace attnrnn::cuda {
ATTNRNN_PADDED_MMA_FORWARD(, __nv_bfloat16, false)
}  // namespace attnrnn::cuda
