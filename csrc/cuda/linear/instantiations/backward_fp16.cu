#include "../backward.cuh"

template attnrnn::Status attnrnn::cuda::launch_chunk_bwd<__half>(const ChunkPlan&, const ChunkArgs&);
namespace attnrnn::cuda {
ATTNRNN_MMA_BACKWARD_SWEEPS(, __half, false)
template Status launch_generic_backward<__half>(const ChunkPlan&, const ChunkArgs&);
}  // namespace attnrnn::cuda
