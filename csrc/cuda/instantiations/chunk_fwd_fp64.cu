#include "../launch.cuh"

template attnrnn::Status attnrnn::cuda::launch_chunk_fwd<double>(const LinearAttnParams&, bool);
