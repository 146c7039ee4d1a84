#include "../backward.cuh"

template attnrnn::Status attnrnn::cuda::launch_tensor_core_backward<__half, false>(const ChunkPlan&,
                                                                                        const ChunkArgs&);
