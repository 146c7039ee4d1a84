#include "../backward.cuh"

template attnrnn::Status attnrnn::cuda::launch_chunk_bwd<double>(const ChunkPlan&, const ChunkArgs&);
