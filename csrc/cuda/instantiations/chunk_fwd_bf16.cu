#include "../launch.cuh"

template attnrnn::Status attnrnn::cuda::launch_chunk_fwd<__nv_bfloat16>(const LinearAttnParams&, bool);
