#include "../launch.cuh"

template attnrnn::Status attnrnn::cuda::launch_softmax_bwd<__nv_bfloat16>(const SoftmaxAttnParams&);
