// The TF32 wgmma forward sweeps of fp32 (exact and padded dims).
#include "../sweep.cuh"

namespace attnrnn::cuda {
ATTNRNN_TF32_SWEEP(, ScanRole::kForward)
}  // namespace attnrnn::cuda
