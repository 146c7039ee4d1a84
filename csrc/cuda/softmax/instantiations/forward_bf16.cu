#include "../launch.cuh"

template attnrnn::Status attnrnn::cuda::launch_softmax_fwd<__nv_bfloat16>(const SoftmaxAttnParams&);
