#include "../forward.cuh"

template attnrnn::Status attnrnn::cuda::launch_chunk_fwd<__nv_bfloat16>(const ChunkPlan&, const ChunkArgs&);
