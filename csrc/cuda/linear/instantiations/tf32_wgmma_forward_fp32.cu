// The TF32 wgmma forward sweeps of fp32 (inner dims 64 and 128, exact and padded).
#include "../sweep.cuh"

namespace attnrnn::cuda {
ATTNRNN_TF32_SWEEP(, ScanRole::kForward, 64)
ATTNRNN_TF32_SWEEP(, ScanRole::kForward, 128)
}  // namespace attnrnn::cuda
