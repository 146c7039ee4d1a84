// Pieces shared by the CUDA kernels: scalar loads/stores in the accumulator type, the feature
// map of an op's inputs (phi itself: feature_maps.h), sequence geometry, and launch checks.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "attnrnn/attnrnn.h"
#include "feature_maps.h"
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

// phi and phi' of an element x of the op's q or k. The chunk backward with p.phi_given reads
// phi(q), phi(k) in their place (autograd saved them): phi is then x itself, phi' comes from it.
template <class A>
__device__ __forceinline__ A phi_of_input(const LinearAttnParams& p, A x) {
  return p.phi_given ? x : phi(p.feature_map, x);
}
template <class A>
__device__ __forceinline__ A dphi_of_input(const LinearAttnParams& p, A x) {
  return p.phi_given ? dphi_of_phi(p.feature_map, x) : dphi(p.feature_map, x);
}

// ---- geometry -----------------------------------------------------------------------------------
struct Seq {
  int64_t b, t0, len;
};

__device__ __forceinline__ Seq sequence(const LinearAttnParams& p, int64_t n) {
  if (p.cu_seqlens == nullptr) return Seq{n, 0, p.seqlen};
  int64_t begin, end;
  if (p.cu_seqlens_int64) {
    begin = static_cast<const int64_t*>(p.cu_seqlens)[n];
    end = static_cast<const int64_t*>(p.cu_seqlens)[n + 1];
  } else {
    begin = static_cast<const int32_t*>(p.cu_seqlens)[n];
    end = static_cast<const int32_t*>(p.cu_seqlens)[n + 1];
  }
  // Values are not validated on the device (that would need a host sync): clamping keeps a bad
  // cu_seqlens inside the tensors.
  begin = begin < 0 ? 0 : (begin > p.seqlen ? p.seqlen : begin);
  end = end < begin ? begin : (end > p.seqlen ? p.seqlen : end);
  return Seq{0, begin, end - begin};
}

template <class T>
__device__ __forceinline__ const T* row(const ConstView& v, int64_t b, int64_t t, int64_t h) {
  return static_cast<const T*>(v.data) + b * v.stride_b + t * v.stride_t + h * v.stride_h;
}
template <class T>
__device__ __forceinline__ T* row(const MutView& v, int64_t b, int64_t t, int64_t h) {
  return static_cast<T*>(v.data) + b * v.stride_b + t * v.stride_t + h * v.stride_h;
}

// The CUDA backward's scratch: two arrays of B*T*H accumulators, element token_index() per (token,
// query head). The generic path keeps den_t and dd_t there; the tensor-core path keeps
// w_t = s / den_t in the den slot and s * dd_t in the dd slot.
struct BwdWorkspace {
  template <class A>
  __device__ static A* den(const LinearAttnParams& p) { return static_cast<A*>(p.workspace); }
  template <class A>
  __device__ static A* dd(const LinearAttnParams& p) {
    return static_cast<A*>(p.workspace) + p.batch * p.seqlen * p.num_heads;
  }
};

__device__ __forceinline__ int64_t token_index(const LinearAttnParams& p, const Seq& seq, int64_t t, int64_t h) {
  return (seq.b * p.seqlen + t) * p.num_heads + h;
}

// The forward's w = scale / den of a lane's two rows t and t + 8 (the rows of an m16 accumulator),
// for the backward (LinearAttnParams::den_out, [B, T, H] like token_index); rows >= `rows` are past
// the chunk's end. One lane of the row's four writes.
__device__ __forceinline__ void store_den(const LinearAttnParams& p, const Seq& seq, int64_t t, int64_t h, int rows,
                                          const float (&w)[2], int lane) {
  if (lane % 4 != 0) return;
  float* den = static_cast<float*>(p.den_out);
  if (rows > 0) den[token_index(p, seq, t, h)] = w[0];
  if (rows > 8) den[token_index(p, seq, t + 8, h)] = w[1];
}

inline int64_t num_states(const LinearAttnParams& p) {
  return p.cu_seqlens != nullptr ? p.num_seqs : p.batch;
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

// Largest dynamic shared memory a block may opt into on the current device.
int max_dynamic_smem();

// The dynamic shared-memory limit set on a kernel on the current device so far (0: none), and
// recording a new one: cudaFuncSetAttribute costs microseconds of host time, once per launch
// otherwise (linear_attn.cu).
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
