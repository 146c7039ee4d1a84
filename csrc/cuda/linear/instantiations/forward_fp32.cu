#include "../forward.cuh"

template attnrnn::Status attnrnn::cuda::launch_chunk_fwd<float>(const ChunkPlan&, const ChunkArgs&);
