#include "../backward.cuh"

template attnrnn::Status attnrnn::cuda::launch_tensor_core_backward<__nv_bfloat16, false>(const ChunkPlan&,
                                                                                        const ChunkArgs&);
