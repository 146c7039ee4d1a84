#include "../launch.cuh"

template attnrnn::Status attnrnn::cuda::launch_chunk_bwd<double>(const LinearAttnParams&, bool);
