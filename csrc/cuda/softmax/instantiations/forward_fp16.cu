#include "../launch.cuh"

template attnrnn::Status attnrnn::cuda::launch_softmax_fwd<__half>(const SoftmaxAttnParams&);
