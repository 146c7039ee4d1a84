// Shared helpers of the torch-free C++ tests: typed strided tensors, a float64 reference of the
// math (forward and analytic backward, recurrent form), and error checks.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "attnrnn/attnrnn.h"
#include "numeric.h"

namespace test {

using attnrnn::DType;
using attnrnn::FeatureMap;
using vec = std::vector<double>;

inline int g_failures = 0;
inline int g_checks = 0;

#define EXPECT(cond, ...)                                                  \
  do {                                                                     \
    ++::test::g_checks;                                                    \
    if (!(cond)) {                                                         \
      ++::test::g_failures;                                                \
      std::printf("FAILED %s:%d: %s: ", __FILE__, __LINE__, #cond);        \
      std::printf(__VA_ARGS__);                                            \
      std::printf("\n");                                                   \
    }                                                                      \
  } while (0)

inline int finish(const char* name) {
  std::printf("%s: %d checks, %d failures\n", name, g_checks, g_failures);
  return g_failures == 0 ? 0 : 1;
}

inline const char* dtype_name(DType d) {
  switch (d) {
    case DType::kFloat64: return "f64";
    case DType::kFloat32: return "f32";
    case DType::kFloat16: return "f16";
    case DType::kBFloat16: return "bf16";
  }
  return "?";
}
inline const char* fm_name(FeatureMap f) {
  return f == FeatureMap::kIdentity ? "identity" : f == FeatureMap::kElu1 ? "elu1" : "relu";
}

inline size_t elem_size(DType d) { return d == DType::kFloat64 ? 8 : d == DType::kFloat32 ? 4 : 2; }

inline double read_elem(DType d, const void* base, int64_t i) {
  switch (d) {
    case DType::kFloat64: return static_cast<const double*>(base)[i];
    case DType::kFloat32: return static_cast<const float*>(base)[i];
    case DType::kFloat16: return attnrnn::to_float(static_cast<const attnrnn::fp16_t*>(base)[i]);
    case DType::kBFloat16: return attnrnn::to_float(static_cast<const attnrnn::bf16_t*>(base)[i]);
  }
  return 0;
}
inline void write_elem(DType d, void* base, int64_t i, double x) {
  switch (d) {
    case DType::kFloat64: static_cast<double*>(base)[i] = x; break;
    case DType::kFloat32: static_cast<float*>(base)[i] = static_cast<float>(x); break;
    case DType::kFloat16:
      static_cast<attnrnn::fp16_t*>(base)[i] = attnrnn::from_float<attnrnn::fp16_t>(static_cast<float>(x));
      break;
    case DType::kBFloat16:
      static_cast<attnrnn::bf16_t*>(base)[i] = attnrnn::from_float<attnrnn::bf16_t>(static_cast<float>(x));
      break;
  }
}

// A [B, T, H, D] tensor of dtype `dt`. Strided tensors use a (t, b, h) storage order with padding,
// which the kernels may not read: the padding holds NaN.
struct Tensor {
  DType dt = DType::kFloat32;
  int64_t B = 0, T = 0, H = 0, D = 0, sb = 0, st = 0, sh = 0;
  std::vector<unsigned char> bytes;

  Tensor() = default;
  Tensor(DType dt_, int64_t B_, int64_t T_, int64_t H_, int64_t D_, bool strided)
      : dt(dt_), B(B_), T(T_), H(H_), D(D_) {
    if (strided) {
      sh = D + 3;
      sb = H * sh;
      st = B * sb + 1;
    } else {
      sh = D;
      st = H * D;
      sb = T * st;
    }
    const int64_t n = std::max<int64_t>(1, strided ? T * st + 8 : B * sb);
    bytes.assign(n * elem_size(dt), 0);
    for (int64_t i = 0; i < n; ++i) write_elem(dt, bytes.data(), i, std::numeric_limits<double>::quiet_NaN());
  }
  int64_t off(int64_t b, int64_t t, int64_t h, int64_t d) const { return b * sb + t * st + h * sh + d; }
  double get(int64_t b, int64_t t, int64_t h, int64_t d) const {
    return read_elem(dt, bytes.data(), off(b, t, h, d));
  }
  void set(int64_t b, int64_t t, int64_t h, int64_t d, double x) {
    write_elem(dt, bytes.data(), off(b, t, h, d), x);
  }
  attnrnn::ConstView cview() const { return {bytes.data(), sb, st, sh}; }
  attnrnn::MutView mview() { return {bytes.data(), sb, st, sh}; }
  // Logical contents, contiguous [B, T, H, D] in float64.
  vec values() const {
    vec out(B * T * H * D);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < T; ++t)
        for (int64_t h = 0; h < H; ++h)
          for (int64_t d = 0; d < D; ++d) out[((b * T + t) * H + h) * D + d] = get(b, t, h, d);
    return out;
  }
};

// A contiguous state buffer in the state dtype (float64 for float64 inputs, float32 otherwise).
struct StateBuf {
  DType dt = DType::kFloat32;
  std::vector<unsigned char> bytes;
  int64_t n = 0;
  StateBuf() = default;
  StateBuf(DType input, int64_t n_)
      : dt(attnrnn::state_dtype(input)), bytes(std::max<int64_t>(1, n_) * elem_size(dt)), n(n_) {
    for (int64_t i = 0; i < n; ++i) write_elem(dt, bytes.data(), i, std::numeric_limits<double>::quiet_NaN());
  }
  void* ptr() { return bytes.data(); }
  double get(int64_t i) const { return read_elem(dt, bytes.data(), i); }
  void set(int64_t i, double x) { write_elem(dt, bytes.data(), i, x); }
  vec values() const {
    vec out(n);
    for (int64_t i = 0; i < n; ++i) out[i] = get(i);
    return out;
  }
};

inline double phi(FeatureMap f, double x) {
  switch (f) {
    case FeatureMap::kIdentity: return x;
    case FeatureMap::kElu1: return x > 0 ? x + 1 : std::exp(x);
    case FeatureMap::kRelu: return x > 0 ? x : 0;
  }
  return 0;
}
inline double dphi(FeatureMap f, double x) {
  switch (f) {
    case FeatureMap::kIdentity: return 1;
    case FeatureMap::kElu1: return x > 0 ? 1 : std::exp(x);
    case FeatureMap::kRelu: return x > 0 ? 1 : 0;
  }
  return 0;
}

// Geometry of one reference problem; seqs are (b, t0, len) per sequence.
struct Geom {
  int64_t B, T, H, Hkv, K, V;
  std::vector<int64_t> cu;  // empty: N = B, one sequence per batch entry
  double scale, eps;
  FeatureMap fm;
  bool normalize;
  int64_t N() const { return cu.empty() ? B : static_cast<int64_t>(cu.size()) - 1; }
  void seq(int64_t n, int64_t& b, int64_t& t0, int64_t& len) const {
    if (cu.empty()) {
      b = n, t0 = 0, len = T;
    } else {
      b = 0, t0 = cu[n], len = cu[n + 1] - cu[n];
    }
  }
  // Index of element d of head h (of HH heads of width D) at token t of batch entry b.
  int64_t qi(int64_t b, int64_t t, int64_t h, int64_t d, int64_t D, int64_t HH) const {
    return ((b * T + t) * HH + h) * D + d;
  }
};

// dst = block `index` (of `count` elements) of src; dst is left as it is when src is empty.
inline void copy_block(const vec& src, int64_t index, int64_t count, vec& dst) {
  if (!src.empty()) std::copy(src.begin() + index * count, src.begin() + (index + 1) * count, dst.begin());
}

// Float64 reference forward: o [B,T,H,V] and the final state. S0, z0 may be empty (zeros).
inline void ref_forward(const Geom& g, const vec& q, const vec& k, const vec& v, const vec& S0, const vec& z0,
                        vec& o, vec& Sf, vec& zf) {
  const int64_t K = g.K, V = g.V, G = g.H / g.Hkv;
  o.assign(g.B * g.T * g.H * V, 0.0);
  Sf.assign(g.N() * g.Hkv * K * V, 0.0);
  zf.assign(g.N() * g.Hkv * K, 0.0);
  for (int64_t n = 0; n < g.N(); ++n)
    for (int64_t kh = 0; kh < g.Hkv; ++kh) {
      int64_t b, t0, len;
      g.seq(n, b, t0, len);
      vec S(K * V, 0.0), z(K, 0.0);
      copy_block(S0, n * g.Hkv + kh, K * V, S);
      copy_block(z0, n * g.Hkv + kh, K, z);
      for (int64_t t = t0; t < t0 + len; ++t) {
        for (int64_t a = 0; a < K; ++a) {
          const double kp = phi(g.fm, k[g.qi(b, t, kh, a, K, g.Hkv)]);
          z[a] += kp;
          for (int64_t c = 0; c < V; ++c) S[a * V + c] += kp * v[g.qi(b, t, kh, c, V, g.Hkv)];
        }
        for (int64_t h = kh * G; h < (kh + 1) * G; ++h) {
          double den = 0;
          for (int64_t a = 0; a < K; ++a) den += g.scale * phi(g.fm, q[g.qi(b, t, h, a, K, g.H)]) * z[a];
          den = g.normalize ? den + g.eps : 1.0;
          for (int64_t c = 0; c < V; ++c) {
            double num = 0;
            for (int64_t a = 0; a < K; ++a)
              num += g.scale * phi(g.fm, q[g.qi(b, t, h, a, K, g.H)]) * S[a * V + c];
            o[g.qi(b, t, h, c, V, g.H)] = num / den;
          }
        }
      }
      std::copy(S.begin(), S.end(), Sf.begin() + (n * g.Hkv + kh) * K * V);
      std::copy(z.begin(), z.end(), zf.begin() + (n * g.Hkv + kh) * K);
    }
}

// Float64 reference backward by the analytic formulas (validated against finite differences).
inline void ref_backward(const Geom& g, const vec& q, const vec& k, const vec& v, const vec& S0,
                         const vec& z0,
                         const vec& dout, const vec& dSf, const vec& dzf, vec& dq, vec& dk, vec& dv, vec& dS0,
                         vec& dz0) {
  const int64_t K = g.K, V = g.V, G = g.H / g.Hkv;
  dq.assign(g.B * g.T * g.H * K, 0.0);
  dk.assign(g.B * g.T * g.Hkv * K, 0.0);
  dv.assign(g.B * g.T * g.Hkv * V, 0.0);
  dS0.assign(g.N() * g.Hkv * K * V, 0.0);
  dz0.assign(g.N() * g.Hkv * K, 0.0);
  for (int64_t n = 0; n < g.N(); ++n)
    for (int64_t kh = 0; kh < g.Hkv; ++kh) {
      int64_t b, t0, len;
      g.seq(n, b, t0, len);
      // Forward, keeping S_t and z_t of every token.
      std::vector<vec> Ss(len), zs(len);
      vec S(K * V, 0.0), z(K, 0.0);
      copy_block(S0, n * g.Hkv + kh, K * V, S);
      copy_block(z0, n * g.Hkv + kh, K, z);
      for (int64_t i = 0; i < len; ++i) {
        const int64_t t = t0 + i;
        for (int64_t a = 0; a < K; ++a) {
          const double kp = phi(g.fm, k[g.qi(b, t, kh, a, K, g.Hkv)]);
          z[a] += kp;
          for (int64_t c = 0; c < V; ++c) S[a * V + c] += kp * v[g.qi(b, t, kh, c, V, g.Hkv)];
        }
        Ss[i] = S;
        zs[i] = z;
      }
      vec dS(K * V, 0.0), dz(K, 0.0);
      copy_block(dSf, n * g.Hkv + kh, K * V, dS);
      copy_block(dzf, n * g.Hkv + kh, K, dz);
      for (int64_t i = len - 1; i >= 0; --i) {
        const int64_t t = t0 + i;
        for (int64_t h = kh * G; h < (kh + 1) * G; ++h) {
          vec qp(K), num(V, 0.0), dn(V);
          for (int64_t a = 0; a < K; ++a) qp[a] = g.scale * phi(g.fm, q[g.qi(b, t, h, a, K, g.H)]);
          double den = 1, dd = 0;
          for (int64_t c = 0; c < V; ++c)
            for (int64_t a = 0; a < K; ++a) num[c] += qp[a] * Ss[i][a * V + c];
          if (g.normalize) {
            den = g.eps;
            for (int64_t a = 0; a < K; ++a) den += qp[a] * zs[i][a];
          }
          double don = 0;
          for (int64_t c = 0; c < V; ++c) {
            const double d_o = dout[g.qi(b, t, h, c, V, g.H)];
            dn[c] = d_o / den;
            don += d_o * num[c];
          }
          if (g.normalize) dd = -don / (den * den);
          for (int64_t a = 0; a < K; ++a) {
            double acc = g.normalize ? dd * zs[i][a] : 0.0;
            for (int64_t c = 0; c < V; ++c) acc += dn[c] * Ss[i][a * V + c];
            dq[g.qi(b, t, h, a, K, g.H)] = g.scale * dphi(g.fm, q[g.qi(b, t, h, a, K, g.H)]) * acc;
            for (int64_t c = 0; c < V; ++c) dS[a * V + c] += qp[a] * dn[c];
            if (g.normalize) dz[a] += dd * qp[a];
          }
        }
        for (int64_t a = 0; a < K; ++a) {
          const double kx = k[g.qi(b, t, kh, a, K, g.Hkv)];
          double acc = g.normalize ? dz[a] : 0.0;
          for (int64_t c = 0; c < V; ++c) acc += dS[a * V + c] * v[g.qi(b, t, kh, c, V, g.Hkv)];
          dk[g.qi(b, t, kh, a, K, g.Hkv)] = dphi(g.fm, kx) * acc;
        }
        for (int64_t c = 0; c < V; ++c) {
          double acc = 0;
          for (int64_t a = 0; a < K; ++a) acc += phi(g.fm, k[g.qi(b, t, kh, a, K, g.Hkv)]) * dS[a * V + c];
          dv[g.qi(b, t, kh, c, V, g.Hkv)] = acc;
        }
      }
      std::copy(dS.begin(), dS.end(), dS0.begin() + (n * g.Hkv + kh) * K * V);
      std::copy(dz.begin(), dz.end(), dz0.begin() + (n * g.Hkv + kh) * K);
    }
}

// Relative RMS error ||x - ref|| / ||ref|| (absolute when ref is ~0); NaN anywhere fails.
inline double rel_rms(const vec& x, const vec& ref) {
  if (x.size() != ref.size()) return std::numeric_limits<double>::infinity();
  double num = 0, den = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    if (!std::isfinite(x[i])) return std::numeric_limits<double>::infinity();
    num += (x[i] - ref[i]) * (x[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  return std::sqrt(num) / std::max(std::sqrt(den), 1e-30 + (den == 0 ? 1.0 : 0.0));
}

// Relative RMS tolerance of a dtype (the output itself is rounded to it).
inline double tolerance(DType d) {
  switch (d) {
    case DType::kFloat64: return 1e-10;
    case DType::kFloat32: return 1e-5;
    case DType::kFloat16: return 2e-3;
    case DType::kBFloat16: return 8e-3;
  }
  return 0;
}

// Serial executor: one call over [0, n). Another one runs the items one by one in reverse order.
inline void serial_for(void*, int64_t n, int64_t, attnrnn::CpuExecutor::Body body, void* ctx) {
  body(ctx, 0, n);
}
inline void reverse_for(void*, int64_t n, int64_t, attnrnn::CpuExecutor::Body body, void* ctx) {
  for (int64_t i = n - 1; i >= 0; --i) body(ctx, i, i + 1);
}

}  // namespace test
