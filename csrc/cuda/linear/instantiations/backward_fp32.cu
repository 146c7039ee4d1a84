#include "../backward.cuh"

template attnrnn::Status attnrnn::cuda::launch_chunk_bwd<float>(const ChunkPlan&, const ChunkArgs&);
