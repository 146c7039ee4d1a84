// Pieces that the CPU kernels, the CUDA kernels and the host-side checks share: host and device
// functions under nvcc, plain inline functions elsewhere.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define ATTNRNN_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define ATTNRNN_HOST_DEVICE inline
#endif

namespace attnrnn {

// Accumulator type of an input type: double for double, float otherwise.
template <class T>
struct AccOf {
  using type = float;
};
template <>
struct AccOf<double> {
  using type = double;
};
template <class T>
using acc_t = typename AccOf<T>::type;

// Entry n of a cu_seqlens array of int64 or int32 offsets.
ATTNRNN_HOST_DEVICE int64_t cu_seqlens_at(const void* cu_seqlens, bool is_int64, int64_t n) {
  return is_int64 ? static_cast<const int64_t*>(cu_seqlens)[n] : int64_t(static_cast<const int32_t*>(cu_seqlens)[n]);
}

// Entries n and n + 1 of cu_seqlens: sequence n's first token and one past its last.
ATTNRNN_HOST_DEVICE void cu_seqlens_bounds(const void* cu_seqlens, bool is_int64, int64_t n, int64_t& begin,
                                           int64_t& end) {
  if (is_int64) {
    begin = static_cast<const int64_t*>(cu_seqlens)[n];
    end = static_cast<const int64_t*>(cu_seqlens)[n + 1];
  } else {
    begin = static_cast<const int32_t*>(cu_seqlens)[n];
    end = static_cast<const int32_t*>(cu_seqlens)[n + 1];
  }
}

}  // namespace attnrnn
