#include "../launch.cuh"

template attnrnn::Status attnrnn::cuda::launch_softmax_bwd<double>(const SoftmaxAttnParams&);
