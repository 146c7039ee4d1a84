#include "../launch.cuh"

template attnrnn::Status attnrnn::cuda::launch_chunk_bwd<float>(const LinearAttnParams&, bool);
