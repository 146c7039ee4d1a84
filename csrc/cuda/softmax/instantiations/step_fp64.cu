#include "../launch.cuh"

template attnrnn::Status attnrnn::cuda::launch_softmax_step<double>(const SoftmaxAttnStepParams&);
