// Shared pieces of the CPU kernels: dtype dispatch, problem geometry, the feature map applied on
// load (16-bit inputs become float in per-thread buffers), and the state's load/store.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "attnrnn/attnrnn.h"
#include "kernels.h"
#include "numeric.h"
#include "parallel.h"

namespace attnrnn::cpu {

// Calls f(T{}) with the C++ type of the input dtype.
template <class F>
Status dispatch_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kFloat64: return f(double{});
    case DType::kFloat32: return f(float{});
    case DType::kFloat16: return f(fp16_t{});
    case DType::kBFloat16: return f(bf16_t{});
  }
  return fail(Status::kInvalidArgument, "unknown dtype %d", static_cast<int>(dtype));
}

// Sizes of one call: N sequences, H query heads in Hkv groups of G heads.
struct Dims {
  int64_t N, H, Hkv, G, K, V;
};

inline Dims dims_of(const LinearAttnParams& p) {
  const int64_t n = p.cu_seqlens != nullptr ? p.num_seqs : p.batch;
  return Dims{n, p.num_heads, p.num_kv_heads, p.num_heads / p.num_kv_heads, p.head_dim_k, p.head_dim_v};
}

// Sequence n: tokens [t0, t0 + len) of batch entry b.
struct Seq {
  int64_t b, t0, len;
};

inline Seq sequence(const LinearAttnParams& p, int64_t n) {
  if (p.cu_seqlens == nullptr) return Seq{n, 0, p.seqlen};
  int64_t begin, end;
  if (p.cu_seqlens_int64) {
    const int64_t* cu = static_cast<const int64_t*>(p.cu_seqlens);
    begin = cu[n];
    end = cu[n + 1];
  } else {
    const int32_t* cu = static_cast<const int32_t*>(p.cu_seqlens);
    begin = cu[n];
    end = cu[n + 1];
  }
  return Seq{0, begin, end - begin};
}

template <class T>
inline const T* at(const ConstView& v, int64_t b, int64_t t, int64_t h) {
  return static_cast<const T*>(v.data) + b * v.stride_b + t * v.stride_t + h * v.stride_h;
}
template <class T>
inline T* at(const MutView& v, int64_t b, int64_t t, int64_t h) {
  return static_cast<T*>(v.data) + b * v.stride_b + t * v.stride_t + h * v.stride_h;
}

// dst[i] = scale * phi(src[i]); when dphi is non-null also dphi[i] = scale * phi'(src[i]).
template <class T, class A>
inline void load_phi(FeatureMap fm, const T* __restrict src, int64_t n, A scale, A* __restrict dst,
                     A* __restrict dphi) {
  switch (fm) {
    case FeatureMap::kIdentity:
      for (int64_t i = 0; i < n; ++i) dst[i] = scale * static_cast<A>(to_float(src[i]));
      if (dphi != nullptr)
        for (int64_t i = 0; i < n; ++i) dphi[i] = scale;
      break;
    case FeatureMap::kElu1:
      for (int64_t i = 0; i < n; ++i) {
        const A x = static_cast<A>(to_float(src[i]));
        const A e = x > A(0) ? A(1) : std::exp(x);
        dst[i] = scale * (x > A(0) ? x + A(1) : e);
        if (dphi != nullptr) dphi[i] = scale * e;
      }
      break;
    case FeatureMap::kRelu:
      for (int64_t i = 0; i < n; ++i) {
        const A x = static_cast<A>(to_float(src[i]));
        dst[i] = x > A(0) ? scale * x : A(0);
        if (dphi != nullptr) dphi[i] = x > A(0) ? scale : A(0);
      }
      break;
  }
}

template <class T, class A>
inline void load_row(const T* __restrict src, int64_t n, A* __restrict dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<A>(to_float(src[i]));
}

template <class T, class A>
inline void store_row(const A* __restrict src, int64_t n, T* __restrict dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = from_float<T>(src[i]);
}

// dst (cols x rows) = src (rows x cols) transposed.
template <class A>
inline void transpose(const A* __restrict src, int64_t rows, int64_t cols, A* __restrict dst) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) dst[c * rows + r] = src[r * cols + c];
}

// Copies `count` state elements of item `item` from src (zeros when src is null).
template <class A>
inline void load_state(const void* src, int64_t item, int64_t count, A* dst) {
  if (src == nullptr) {
    std::fill(dst, dst + count, A(0));
  } else {
    std::memcpy(dst, static_cast<const A*>(src) + item * count, count * sizeof(A));
  }
}

template <class A>
inline void store_state(const A* src, int64_t item, int64_t count, void* dst) {
  if (dst != nullptr) std::memcpy(static_cast<A*>(dst) + item * count, src, count * sizeof(A));
}

// The chunk size in use: the caller's, or 32 (fastest measured for K = V = 64 with AVX-512);
// never longer than the longest sequence needs.
inline int64_t chunk_of(const LinearAttnParams& p) {
  const int64_t c = p.chunk_size > 0 ? p.chunk_size : 32;
  return std::max<int64_t>(1, std::min(c, p.seqlen));
}

}  // namespace attnrnn::cpu
