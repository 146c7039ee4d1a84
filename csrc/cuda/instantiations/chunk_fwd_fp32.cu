#include "../launch.cuh"

template attnrnn::Status attnrnn::cuda::launch_chunk_fwd<float>(const LinearAttnParams&, bool);
