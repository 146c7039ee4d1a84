#include "../launch.cuh"

template attnrnn::Status attnrnn::cuda::launch_chunk_bwd_tc<__half, false>(const LinearAttnParams&);
