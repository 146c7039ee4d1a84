// CUDA entry points of the linear-attention ops: pick the input type, then the launcher of
// launch.cuh (whose instantiations live in instantiations/*.cu).
#include <atomic>
#include <cstdlib>
#include <map>
#include <mutex>
#include <utility>

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

namespace {
std::mutex smem_allowed_mutex;
std::map<std::pair<const void*, int>, int64_t> smem_allowed_by_kernel;  // (kernel, device) -> bytes
int current_device() {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) cudaGetLastError();
  return device;
}
}  // namespace

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

int max_dynamic_smem() {
  return cached_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin, smem_optin_cache, 48 * 1024);
}

bool wgmma_device() { return cached_attribute(cudaDevAttrComputeCapabilityMajor, major_cache, 0) == 9; }

int sm_count() { return cached_attribute(cudaDevAttrMultiProcessorCount, sm_count_cache, 1); }

namespace {
// The backward's side streams, two per device, made on first use and kept for the process (as
// library handles are): creating streams per call would cost more than the overlap gains.
std::mutex side_streams_mutex;
cudaStream_t side_streams_cache[kCachedDevices][2];

bool concurrent_sweeps_enabled() {
  static const bool enabled = [] {
    const char* env = std::getenv("ATTNRNN_BWD_CONCURRENT");
    return env != nullptr && std::atoi(env) != 0;
  }();
  return enabled;
}

// The side streams of the current device; false (and no error) where they cannot be had.
bool side_streams(cudaStream_t (&out)[2]) {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= kCachedDevices) {
    cudaGetLastError();
    return false;
  }
  std::lock_guard<std::mutex> lock(side_streams_mutex);
  cudaStream_t* cached = side_streams_cache[device];
  if (cached[0] == nullptr) {
    cudaStream_t made[2] = {nullptr, nullptr};
    for (cudaStream_t& stream : made) {
      if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess) {
        cudaGetLastError();
        for (cudaStream_t m : made)
          if (m != nullptr) cudaStreamDestroy(m);
        return false;
      }
    }
    cached[0] = made[0];
    cached[1] = made[1];
  }
  out[0] = cached[0];
  out[1] = cached[1];
  return true;
}

// True unless `stream` is certainly not being captured into a CUDA graph (an error, such as the
// legacy stream's while another stream captures, counts as capturing).
bool maybe_capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &capture) != cudaSuccess) {
    cudaGetLastError();
    return true;
  }
  return capture != cudaStreamCaptureStatusNone;
}

// `to` waits for what is enqueued on `from` so far (an event per call: events shared between host
// threads could hand one thread's fork to another's wait; destroying it right after the wait is
// allowed, the wait keeps what was recorded).
cudaError_t stream_waits_for(cudaStream_t to, cudaStream_t from) {
  cudaEvent_t event;
  cudaError_t err = cudaEventCreateWithFlags(&event, cudaEventDisableTiming);
  if (err != cudaSuccess) return err;
  err = cudaEventRecord(event, from);
  if (err == cudaSuccess) err = cudaStreamWaitEvent(to, event, 0);
  cudaEventDestroy(event);
  return err;
}
}  // namespace

// Inside a stream capture the sweeps stay on the captured stream: streams forked into a capture
// remain part of it until it ends, so shared side streams would tie other host threads' eager
// calls (or a second capture) to this graph.
Status fork_sweeps(void* main_ptr, SweepFork& fork) {
  fork = SweepFork{};
  cudaStream_t main = static_cast<cudaStream_t>(main_ptr);
  cudaStream_t side[2];
  if (!concurrent_sweeps_enabled() || maybe_capturing(main) || !side_streams(side)) return Status::kSuccess;
  cudaEvent_t forked = nullptr;
  cudaError_t err = cudaEventCreateWithFlags(&forked, cudaEventDisableTiming);
  if (err == cudaSuccess) err = cudaEventRecord(forked, main);
  for (int i = 0; i < 2 && err == cudaSuccess; ++i) {
    err = cudaStreamWaitEvent(side[i], forked, 0);
    if (err == cudaSuccess) fork.side[fork.sides++] = side[i];
  }
  if (forked != nullptr) cudaEventDestroy(forked);
  if (err != cudaSuccess) return fail(Status::kDeviceError, "chunk_linear_attn backward (fork): %s", cudaGetErrorString(err));
  return Status::kSuccess;
}

// Joins every side stream the fork reached, even after an error on one of them.
Status join_sweeps(void* main_ptr, const SweepFork& fork) {
  cudaError_t first = cudaSuccess;
  for (int i = 0; i < fork.sides; ++i) {
    const cudaError_t err = stream_waits_for(static_cast<cudaStream_t>(main_ptr), fork.side[i]);
    if (first == cudaSuccess) first = err;
  }
  if (first != cudaSuccess) return fail(Status::kDeviceError, "chunk_linear_attn backward (join): %s", cudaGetErrorString(first));
  return Status::kSuccess;
}

int64_t workspace_bytes(const LinearAttnParams& p) { return workspace_bytes_for(p, p.dout.data != nullptr); }

bool chunk_fwd_writes_den(const LinearAttnParams& p) {
  // Every CUDA chunk forward writes it (chunk_tc, chunk_wg, chunk_fwd): a condition on dtypes and
  // options only, so that the fake kernel can tell the output's shape too.
  return p.normalize && (p.dtype == DType::kBFloat16 || p.dtype == DType::kFloat16);
}

int64_t chunk_fwd_segment_state_floats(const LinearAttnParams& p) { return fwd_states_for_dq_floats(p); }

bool chunk_saves_features(const LinearAttnParams& p) {
  static const bool enabled = [] {
    const char* env = std::getenv("ATTNRNN_SAVE_FEATURES");
    return env == nullptr || std::atoi(env) != 0;
  }();
  return enabled && feature_bytes(p, false) > 0 && feature_bytes(p, true) > 0;
}

namespace {

// phi of every element of a [B, T, heads, K] view into a contiguous copy, one element per thread
// and step: linear_attn_features where feature_map_kernel's requirements do not hold.
template <class T>
__global__ void feature_map_elements_kernel(const ConstView in, int64_t B, int64_t Tn, int64_t heads, int64_t K,
                                            FeatureMap fm, T* out) {
  using A = typename AccOf<T>::type;
  const int64_t total = B * Tn * heads * K;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += gridDim.x * int64_t(blockDim.x)) {
    const int64_t r = i / K, h = r % heads, t = r / heads % Tn, b = r / heads / Tn;
    out[i] = from_acc<T, A>(phi(fm, to_acc<A>(row<T>(in, b, t, h)[i % K])));
  }
}

template <class T>
Status launch_features(const LinearAttnParams& p, T* fq, T* fk) {
  constexpr bool k16bit = sizeof(T) == 2;
  if constexpr (k16bit) {
    if (p.head_dim_k % 8 == 0 && aligned16(p.q) && aligned16(p.k)) return launch_feature_pass<T>(p, fq, fk);
  }
  return launch_over_q_and_k(feature_map_elements_kernel<T>, p, 1, fq, fk, "linear_attn_features");
}

}  // namespace

Status features(const LinearAttnParams& p, void* phi_q, void* phi_k) {
  return dispatch_dtype(p.dtype, [&](auto t) {
    using T = decltype(t);
    return launch_features<T>(p, static_cast<T*>(phi_q), static_cast<T*>(phi_k));
  });
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
