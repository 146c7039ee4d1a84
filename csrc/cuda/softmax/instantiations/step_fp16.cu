#include "../launch.cuh"

template attnrnn::Status attnrnn::cuda::launch_softmax_step<__half>(const SoftmaxAttnStepParams&);
