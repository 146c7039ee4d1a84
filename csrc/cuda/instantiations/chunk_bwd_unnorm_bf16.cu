#include "../launch.cuh"

template attnrnn::Status attnrnn::cuda::launch_chunk_bwd_tc<__nv_bfloat16, false>(const LinearAttnParams&);
