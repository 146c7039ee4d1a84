#include "../step_launch.cuh"

template attnrnn::Status attnrnn::cuda::launch_step<__nv_bfloat16>(const LinearAttnStepParams&);
