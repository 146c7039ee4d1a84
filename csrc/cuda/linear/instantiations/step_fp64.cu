#include "../step_launch.cuh"

template attnrnn::Status attnrnn::cuda::launch_step<double>(const LinearAttnStepParams&);
