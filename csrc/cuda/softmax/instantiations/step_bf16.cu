#include "../launch.cuh"

template attnrnn::Status attnrnn::cuda::launch_softmax_step<__nv_bfloat16>(const SoftmaxAttnStepParams&);
