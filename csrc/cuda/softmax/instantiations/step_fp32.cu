#include "../launch.cuh"

template attnrnn::Status attnrnn::cuda::launch_softmax_step<float>(const SoftmaxAttnStepParams&);
