// CUDA entry points of the linear-attention ops: pick the input type, then the launcher of
// launch.cuh (whose instantiations live in instantiations/*.cu).
#include "launch.cuh"
#include "launch_decls.h"

namespace attnrnn::cuda {

int max_dynamic_smem() {
  int device = 0, bytes = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 48 * 1024;
  if (cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess)
    return 48 * 1024;
  return bytes;
}

bool wgmma_device() {
  int device = 0, major = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return false;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) return false;
  return major == 9;
}

int sm_count() {
  int device = 0, count = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 1;
  if (cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) return 1;
  return count;
}

int64_t workspace_bytes(const LinearAttnParams& p) { return workspace_bytes_for(p, p.dout.data != nullptr); }

Status chunk_fwd(const LinearAttnParams& p) {
  return dispatch_dtype(p.dtype, [&](auto t) { return launch_chunk_fwd<decltype(t)>(p, false); });
}
Status recurrent_fwd(const LinearAttnParams& p) {
  return dispatch_dtype(p.dtype, [&](auto t) { return launch_chunk_fwd<decltype(t)>(p, true); });
}
Status chunk_bwd(const LinearAttnParams& p) {
  return dispatch_dtype(p.dtype, [&](auto t) { return launch_chunk_bwd<decltype(t)>(p, false); });
}
Status recurrent_bwd(const LinearAttnParams& p) {
  return dispatch_dtype(p.dtype, [&](auto t) { return launch_chunk_bwd<decltype(t)>(p, true); });
}
Status step(const LinearAttnStepParams& p) {
  return dispatch_dtype(p.dtype, [&](auto t) { return launch_step<decltype(t)>(p); });
}

}  // namespace attnrnn::cuda
