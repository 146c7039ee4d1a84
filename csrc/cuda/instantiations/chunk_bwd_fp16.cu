#include "../launch.cuh"

template attnrnn::Status attnrnn::cuda::launch_chunk_bwd<__half>(const LinearAttnParams&, bool);
namespace attnrnn::cuda {
ATTNRNN_BWD_TC_SWEEPS(, __half)
}  // namespace attnrnn::cuda
