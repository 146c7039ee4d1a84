#include "../forward.cuh"

template attnrnn::Status attnrnn::cuda::launch_chunk_fwd<__half>(const ChunkPlan&, const ChunkArgs&);
