#include "../launch.cuh"

template attnrnn::Status attnrnn::cuda::launch_softmax_fwd<double>(const SoftmaxAttnParams&);
