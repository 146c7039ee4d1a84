#include "../backward.cuh"

template attnrnn::Status attnrnn::cuda::launch_chunk_bwd<float>(const ChunkPlan&, const ChunkArgs&);
namespace attnrnn::cuda {
ATTNRNN_MMA_BACKWARD_SWEEPS(, float, false)
}  // namespace attnrnn::cuda
