#include "../launch.cuh"

template attnrnn::Status attnrnn::cuda::launch_chunk_bwd<__nv_bfloat16>(const LinearAttnParams&, bool);
namespace attnrnn::cuda {
ATTNRNN_BWD_TC_SWEEPS(, __nv_bfloat16)
}  // namespace attnrnn::cuda
