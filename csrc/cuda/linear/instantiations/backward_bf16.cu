#include "../backward.cuh"

template attnrnn::Status attnrnn::cuda::launch_chunk_bwd<__nv_bfloat16>(const ChunkPlan&, const ChunkArgs&);
namespace attnrnn::cuda {
ATTNRNN_MMA_BACKWARD_SWEEPS(, __nv_bfloat16, false)
template Status launch_generic_backward<__nv_bfloat16>(const ChunkPlan&, const ChunkArgs&);
}  // namespace attnrnn::cuda
