#include "../forward.cuh"

template attnrnn::Status attnrnn::cuda::launch_chunk_fwd<double>(const ChunkPlan&, const ChunkArgs&);
