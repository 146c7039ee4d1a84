// What every CUDA kernel of attnrnn shares: scalars in the accumulator type, rows of a [B, T, H, D]
// view, the dtype switch, launch checks and the device's limits.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "attnrnn/attnrnn.h"
#include "host_device.h"  // AccOf
#include "kernels.h"

namespace attnrnn::cuda {

// ---- scalars ------------------------------------------------------------------------------------
template <class A>
__device__ __forceinline__ A to_acc(float x) { return static_cast<A>(x); }
template <class A>
__device__ __forceinline__ A to_acc(double x) { return static_cast<A>(x); }
template <class A>
__device__ __forceinline__ A to_acc(__half x) { return static_cast<A>(__half2float(x)); }
template <class A>
__device__ __forceinline__ A to_acc(__nv_bfloat16 x) { return static_cast<A>(__bfloat162float(x)); }

template <class T, class A>
__device__ __forceinline__ T from_acc(A x);
template <>
__device__ __forceinline__ float from_acc<float, float>(float x) { return x; }
template <>
__device__ __forceinline__ double from_acc<double, double>(double x) { return x; }
template <>
__device__ __forceinline__ __half from_acc<__half, float>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_acc<__nv_bfloat16, float>(float x) { return __float2bfloat16_rn(x); }

// ---- rows ---------------------------------------------------------------------------------------
template <class T>
__device__ __forceinline__ const T* row(const ConstView& v, int64_t b, int64_t t, int64_t h) {
  return static_cast<const T*>(v.data) + b * v.stride_b + t * v.stride_t + h * v.stride_h;
}
template <class T>
__device__ __forceinline__ T* row(const MutView& v, int64_t b, int64_t t, int64_t h) {
  return static_cast<T*>(v.data) + b * v.stride_b + t * v.stride_t + h * v.stride_h;
}

// Calls f(T{}) with the CUDA type of the input dtype.
template <class F>
Status dispatch_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kFloat64: return f(double{});
    case DType::kFloat32: return f(float{});
    case DType::kFloat16: return f(__half{});
    case DType::kBFloat16: return f(__nv_bfloat16{});
  }
  return fail(Status::kInvalidArgument, "unknown dtype %d", static_cast<int>(dtype));
}

inline Status check_launch(const char* what) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return fail(Status::kDeviceError, "%s: %s", what, cudaGetErrorString(err));
  return Status::kSuccess;
}

// The current device's limits, read from the driver once per device (device.cu).
int max_dynamic_smem();  // the largest dynamic shared memory a block may opt into
int sm_count();
bool wgmma_device();     // compute capability 9.x: the sm_90a kernels run there

// The dynamic shared-memory limit set on a kernel on the current device so far (0: none), and
// recording a new one: cudaFuncSetAttribute costs microseconds of host time, once per launch
// otherwise (device.cu).
int64_t smem_allowed(const void* kernel);
void record_smem_allowed(const void* kernel, int64_t bytes);

// Sets the kernel's dynamic shared-memory limit when it exceeds the default 48 KiB (once per kernel,
// device and size).
template <class Kernel>
Status allow_smem(Kernel kernel, int64_t bytes, const char* what) {
  if (bytes > max_dynamic_smem())
    return fail(Status::kInvalidArgument, "%s needs %lld bytes of shared memory, the device has %d", what,
                (long long)bytes, max_dynamic_smem());
  const void* key = reinterpret_cast<const void*>(kernel);
  if (bytes > 48 * 1024 && smem_allowed(key) < bytes) {
    const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 static_cast<int>(bytes));
    if (err != cudaSuccess) return fail(Status::kDeviceError, "%s: %s", what, cudaGetErrorString(err));
    record_smem_allowed(key, bytes);
  }
  return Status::kSuccess;
}

}  // namespace attnrnn::cuda
