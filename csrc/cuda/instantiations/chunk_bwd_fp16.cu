#include "../launch.cuh"

template attnrnn::Status attnrnn::cuda::launch_chunk_bwd<__half>(const LinearAttnParams&, bool);
