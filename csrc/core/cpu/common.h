// Shared pieces of the CPU kernels: dtype dispatch, problem geometry, the feature map applied on
// load (16-bit inputs become float in per-thread buffers), and the state's load/store.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "attnrnn/attnrnn.h"
#include "feature_maps.h"
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

inline Dims dims_of(const LinearAttnFwdParams& p) {
  const int64_t n = p.cu_seqlens != nullptr ? p.num_seqs : p.batch;
  return Dims{n, p.num_heads, p.num_kv_heads, p.num_heads / p.num_kv_heads, p.head_dim_k, p.head_dim_v};
}

// Sequence n: tokens [t0, t0 + len) of batch entry b.
struct Seq {
  int64_t b, t0, len;
};

inline Seq sequence(const LinearAttnFwdParams& p, int64_t n) {
  if (p.cu_seqlens == nullptr) return Seq{n, 0, p.seqlen};
  int64_t begin, end;
  cu_seqlens_bounds(p.cu_seqlens, p.cu_seqlens_int64, n, begin, end);
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

// dst[i] = scale * phi(x_i) and, where dphi is non-null, dphi[i] = scale * phi'(x_i) (taken from
// phi(x_i)). The map is a template argument so that each loop is one straight-line body the compiler
// vectorizes.
template <FeatureMap M, class T, class A>
inline void load_phi_as(const T* __restrict src, int64_t n, A scale, A* __restrict dst, A* __restrict dphi) {
  for (int64_t i = 0; i < n; ++i) {
    const A y = phi(M, static_cast<A>(to_float(src[i])));
    dst[i] = scale * y;
    if (dphi != nullptr) dphi[i] = scale * dphi_of_phi(M, y);
  }
}
template <class T, class A>
inline void load_phi(FeatureMap fm, const T* __restrict src, int64_t n, A scale, A* __restrict dst, A* __restrict dphi) {
  switch (fm) {
    case FeatureMap::kElu1: return load_phi_as<FeatureMap::kElu1>(src, n, scale, dst, dphi);
    case FeatureMap::kRelu: return load_phi_as<FeatureMap::kRelu>(src, n, scale, dst, dphi);
    default: return load_phi_as<FeatureMap::kIdentity>(src, n, scale, dst, dphi);
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

#if defined(__AVX512F__)
// dst (16 x 16, leading dimension ldd) = src (16 x 16, leading dimension lds) transposed, in
// registers: two-source shuffles of 4-, 8-, 16- then 32-element granules (64 shuffles per tile).
inline void transpose16(const float* __restrict src, int64_t lds, float* __restrict dst, int64_t ldd) {
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(src + i * lds);
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
    const __m512d c = _mm512_castps_pd(t[4 * i + 2]), d = _mm512_castps_pd(t[4 * i + 3]);
    r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  // r[4i + j], 128-bit lane l: rows 4i..4i+3 of column 4l + j.
  for (int j = 0; j < 4; ++j) {
    t[j] = _mm512_shuffle_f32x4(r[j], r[4 + j], 0x88);
    t[4 + j] = _mm512_shuffle_f32x4(r[j], r[4 + j], 0xdd);
    t[8 + j] = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0x88);
    t[12 + j] = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0xdd);
  }
  for (int j = 0; j < 4; ++j) {
    _mm512_storeu_ps(dst + j * ldd, _mm512_shuffle_f32x4(t[j], t[8 + j], 0x88));
    _mm512_storeu_ps(dst + (8 + j) * ldd, _mm512_shuffle_f32x4(t[j], t[8 + j], 0xdd));
    _mm512_storeu_ps(dst + (4 + j) * ldd, _mm512_shuffle_f32x4(t[4 + j], t[12 + j], 0x88));
    _mm512_storeu_ps(dst + (12 + j) * ldd, _mm512_shuffle_f32x4(t[4 + j], t[12 + j], 0xdd));
  }
}
#endif

// dst (cols x rows) = src (rows x cols) transposed (float: 16 x 16 tiles in registers).
template <class A>
inline void transpose(const A* __restrict src, int64_t rows, int64_t cols, A* __restrict dst) {
  int64_t r0 = 0, c0 = 0;
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<A, float>) {
    for (r0 = 0; r0 + 16 <= rows; r0 += 16)
      for (int64_t c = 0; c + 16 <= cols; c += 16) transpose16(src + r0 * cols + c, cols, dst + c * rows + r0, rows);
    c0 = cols / 16 * 16;
  }
#endif
  for (int64_t r = 0; r < rows; ++r)  // what the tiles left: rows from r0, columns from c0
    for (int64_t c = r < r0 ? c0 : 0; c < cols; ++c) dst[c * rows + r] = src[r * cols + c];
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
inline int64_t chunk_of(const LinearAttnFwdParams& p) {
  const int64_t c = p.chunk_size > 0 ? p.chunk_size : 32;
  return std::max<int64_t>(1, std::min(c, p.seqlen));
}

}  // namespace attnrnn::cpu
