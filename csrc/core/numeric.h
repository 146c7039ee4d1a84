// Scalar types of the torch-free library: IEEE half and bfloat16 storage with float conversion.
#pragma once

#include <cstdint>
#include <cstring>

#include "host_device.h"

#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace attnrnn {

struct bf16_t {
  uint16_t bits;
};
struct fp16_t {
  uint16_t bits;
};

inline float to_float(float x) { return x; }
inline double to_float(double x) { return x; }

inline float to_float(bf16_t x) {
  uint32_t u = static_cast<uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline float to_float(fp16_t x) {
#if defined(__F16C__)
  return _cvtsh_ss(x.bits);
#else
  const uint32_t sign = (x.bits & 0x8000u) << 16;
  uint32_t exp = (x.bits >> 10) & 0x1fu;
  uint32_t man = x.bits & 0x3ffu;
  uint32_t u;
  if (exp == 0x1f) {
    u = sign | 0x7f800000u | (man << 13);  // inf / nan
  } else if (exp != 0) {
    u = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    u = sign;
  } else {  // subnormal: normalize the mantissa
    int shift = 0;
    while ((man & 0x400u) == 0) {
      man <<= 1;
      ++shift;
    }
    man &= 0x3ffu;
    u = sign | (static_cast<uint32_t>(113 - shift) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

// Round-to-nearest-even conversions from float; NaN stays NaN.
template <class T>
inline T from_float(float x);
template <class T>
inline T from_float(double x);

template <>
inline float from_float<float>(float x) { return x; }
template <>
inline double from_float<double>(double x) { return x; }
template <>
inline float from_float<float>(double x) { return static_cast<float>(x); }
template <>
inline double from_float<double>(float x) { return x; }

template <>
inline bf16_t from_float<bf16_t>(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16_t{static_cast<uint16_t>((u >> 16) | 0x40u)};
  u += 0x7fffu + ((u >> 16) & 1u);
  return bf16_t{static_cast<uint16_t>(u >> 16)};
}

template <>
inline fp16_t from_float<fp16_t>(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return fp16_t{static_cast<uint16_t>(sign | 0x7e00u)};  // nan
  if (abs >= 0x477ff000u) return fp16_t{static_cast<uint16_t>(sign | 0x7c00u)};  // overflow -> inf
  if (abs < 0x38800000u) {  // result is subnormal or zero: round abs * 2^24 to an integer
    float f;
    std::memcpy(&f, &abs, sizeof f);
    const float scaled = f * 16777216.0f;  // exact: power of two
    // round half to even by adding and subtracting 2^23 (valid for scaled < 2^23)
    const float rounded = (scaled + 8388608.0f) - 8388608.0f;
    return fp16_t{static_cast<uint16_t>(sign | static_cast<uint16_t>(rounded))};
  }
  uint32_t mant_round = abs + 0xfffu + ((abs >> 13) & 1u);  // round to nearest even at bit 13
  return fp16_t{static_cast<uint16_t>(sign | ((mant_round - 0x38000000u) >> 13))};
}

template <>
inline bf16_t from_float<bf16_t>(double x) { return from_float<bf16_t>(static_cast<float>(x)); }
template <>
inline fp16_t from_float<fp16_t>(double x) { return from_float<fp16_t>(static_cast<float>(x)); }

}  // namespace attnrnn
