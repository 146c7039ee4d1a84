#include "../launch.cuh"

template attnrnn::Status attnrnn::cuda::launch_chunk_fwd<__half>(const LinearAttnParams&, bool);
