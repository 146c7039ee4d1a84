// The device's limits and the per-kernel shared-memory opt-ins (common/device.cuh). Each is read
// from the driver once per device and kept: the decode step asks them on every launch, and a driver
// query costs microseconds of host time.
#include <atomic>
#include <map>
#include <mutex>
#include <utility>

#include "device.cuh"

namespace attnrnn::cuda {

namespace {

constexpr int kCachedDevices = 64;

int current_device() {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) cudaGetLastError();
  return device;
}

// 0 marks "not read yet" (no attribute used here is 0).
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

std::mutex smem_allowed_mutex;
std::map<std::pair<const void*, int>, int64_t> smem_allowed_by_kernel;  // (kernel, device) -> bytes

}  // namespace

int max_dynamic_smem() {
  return cached_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin, smem_optin_cache, 48 * 1024);
}

int sm_count() { return cached_attribute(cudaDevAttrMultiProcessorCount, sm_count_cache, 1); }

bool wgmma_device() { return cached_attribute(cudaDevAttrComputeCapabilityMajor, major_cache, 0) == 9; }

int64_t smem_allowed(const void* kernel) {
  const std::pair<const void*, int> key{kernel, current_device()};
  std::lock_guard<std::mutex> lock(smem_allowed_mutex);
  const auto found = smem_allowed_by_kernel.find(key);
  return found == smem_allowed_by_kernel.end() ? 0 : found->second;
}

void record_smem_allowed(const void* kernel, int64_t bytes) {
  const std::pair<const void*, int> key{kernel, current_device()};
  std::lock_guard<std::mutex> lock(smem_allowed_mutex);
  int64_t& allowed = smem_allowed_by_kernel[key];
  if (bytes > allowed) allowed = bytes;
}

}  // namespace attnrnn::cuda
