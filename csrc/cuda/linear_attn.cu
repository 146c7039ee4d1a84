// CUDA entry points of the linear-attention ops: pick the input type, then the launcher of
// launch.cuh (whose instantiations live in instantiations/*.cu).
#include <atomic>

#include "launch.cuh"
#include "launch_decls.h"

namespace attnrnn::cuda {

namespace {
// Device attributes are asked on every launch (the decode step is latency critical), so each is
// read from the driver once per device and kept; 0 marks "not read yet" (no attribute used here is 0).
constexpr int kCachedDevices = 64;
int cached_attribute(cudaDeviceAttr attr, std::atomic<int> (&cache)[kCachedDevices], int fallback) {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return fallback;
  if (device >= 0 && device < kCachedDevices) {
    if (const int known = cache[device].load(std::memory_order_relaxed)) return known;
  }
  int value = 0;
  if (cudaDeviceGetAttribute(&value, attr, device) != cudaSuccess || value <= 0) return fallback;
  if (device >= 0 && device < kCachedDevices) cache[device].store(value, std::memory_order_relaxed);
  return value;
}
std::atomic<int> smem_optin_cache[kCachedDevices], major_cache[kCachedDevices], sm_count_cache[kCachedDevices];
}  // namespace

int max_dynamic_smem() {
  return cached_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin, smem_optin_cache, 48 * 1024);
}

bool wgmma_device() { return cached_attribute(cudaDevAttrComputeCapabilityMajor, major_cache, 0) == 9; }

int sm_count() { return cached_attribute(cudaDevAttrMultiProcessorCount, sm_count_cache, 1); }

int64_t workspace_bytes(const LinearAttnParams& p) { return workspace_bytes_for(p, p.dout.data != nullptr); }

bool chunk_fwd_writes_den(const LinearAttnParams& p) {
  // Every CUDA chunk forward writes it (chunk_tc, chunk_wg, chunk_fwd): a condition on dtypes and
  // options only, so that the fake kernel can tell the output's shape too.
  return p.normalize && (p.dtype == DType::kBFloat16 || p.dtype == DType::kFloat16);
}

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
