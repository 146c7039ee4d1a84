// Shared pieces of the softmax-attention CPU kernels: sequence geometry with the bottom-right
// causal alignment, block loads, a vectorized exp, and the online-softmax update of one block.
//
// Block sizes: kBlockQ query rows x kBlockK keys; a 64 x 64 fp32 score tile (16 KB) and the q,
// k, v tiles of a block pair stay in L1/L2 while the gemm micro-kernels stream them.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "common.h"
#include "gemm.h"
#include "softmax_kernels.h"

namespace attnrnn::cpu::sm {

constexpr int64_t kBlockQ = 64;
constexpr int64_t kBlockK = 64;

struct Dims {
  int64_t N, H, Hkv, G, D, Dv;
};

inline Dims dims_of(const SoftmaxAttnParams& p) {
  const int64_t n = p.cu_seqlens != nullptr ? p.num_seqs : p.batch;
  return Dims{n, p.num_heads, p.num_kv_heads, p.num_heads / p.num_kv_heads, p.head_dim, p.head_dim_v};
}

// Sequence n: queries [q0, q0 + Lq) and keys [k0, k0 + Lk) of batch entry b.
struct Seq {
  int64_t b, q0, Lq, k0, Lk;
  // Keys visible to query i (0-based in the sequence): [0, key_end(i)), possibly empty.
  // Causal masks align bottom-right: query i sees key j iff j <= i + Lk - Lq.
  bool causal;
  int64_t key_end(int64_t i) const {
    if (!causal) return Lk;
    return std::max<int64_t>(0, std::min<int64_t>(Lk, i + Lk - Lq + 1));
  }
};

inline Seq sequence_of(const SoftmaxAttnParams& p, int64_t n) {
  if (p.cu_seqlens == nullptr) return Seq{n, 0, p.seqlen_q, 0, p.seqlen_k, p.causal};
  int64_t begin, end;
  cu_seqlens_bounds(p.cu_seqlens, p.cu_seqlens_int64, n, begin, end);
  return Seq{0, begin, end - begin, begin, end - begin, p.causal};
}

// lse / D are [B, H, Tq]: element of query i of sequence s, head h.
inline int64_t row_index(const SoftmaxAttnParams& p, const Seq& s, int64_t h, int64_t i) {
  return (s.b * p.num_heads + h) * p.seqlen_q + s.q0 + i;
}

// rows x n block of a view starting at token t, head h, into dst (row-major, ld n), times scale.
template <class T, class A>
inline void load_rows(const ConstView& v, int64_t b, int64_t t, int64_t h, int64_t rows, int64_t n, A scale,
                      A* dst) {
  for (int64_t i = 0; i < rows; ++i) {
    const T* src = at<T>(v, b, t + i, h);
    A* d = dst + i * n;
    if (scale == A(1)) {
      load_row(src, n, d);
    } else {
      for (int64_t c = 0; c < n; ++c) d[c] = scale * static_cast<A>(to_float(src[c]));
    }
  }
}

template <class A>
constexpr A neg_inf() {
  return -std::numeric_limits<A>::infinity();
}

// x[i] = exp(x[i] - shift) for i < n; returns the sum. x[i] - shift <= ~0 everywhere it is used.
inline float exp_shift(float* __restrict x, int64_t n, float shift) {
  using V = Vec<float>::type;
  using VI = int32_t __attribute__((vector_size(64)));
  constexpr int W = Vec<float>::W;
  auto vexp = [](V a) {  // Cephes expf: 2^n * p(r), |r| <= ln2 / 2, ~1 ulp
    const V lo = V{} - 87.0f;
    a = a < lo ? lo : a;
    V fx = a * 1.44269504088896341f + 0.5f;
    VI ni = __builtin_convertvector(fx, VI);
    V fn = __builtin_convertvector(ni, V);
    const VI adj = fn > fx;  // truncation rounded up a negative value: floor
    ni += adj;               // adj is -1 where true
    fn = __builtin_convertvector(ni, V);
    V r = a - fn * 0.693359375f + fn * 2.12194440e-4f;
    V y = V{} + 1.9875691500e-4f;
    y = y * r + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    y = y * (r * r) + r + 1.0f;
    VI bits = (ni + 127) << 23;
    V scale;
    std::memcpy(&scale, &bits, sizeof scale);
    return y * scale;
  };
  V acc{};
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    const V e = vexp(load_vec(x + i) - shift);
    store_vec(x + i, e);
    acc += e;
  }
  float s = 0.0f;
  if (i < n) {
    alignas(64) float tail[W];
    for (int j = 0; j < W; ++j) tail[j] = i + j < n ? x[i + j] - shift : -100.0f;
    const V e = vexp(load_vec(tail));
    for (int j = 0; i + j < n; ++j) {
      x[i + j] = e[j];
      s += e[j];
    }
  }
  for (int j = 0; j < W; ++j) s += acc[j];
  return s;
}

inline double exp_shift(double* __restrict x, int64_t n, double shift) {
  double s = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    x[i] = std::exp(x[i] - shift);
    s += x[i];
  }
  return s;
}

// Online-softmax update with one block of scores S [rows x L] (overwritten with P):
//   m' = max(m, max_j s_ij),  P = exp(S - m'),  z = z e^{m - m'} + rowsum(P),  Y *= e^{m - m'}.
// Only the first valid(i) keys of row i count (the rest of the row becomes 0); a row with none
// is left unchanged. The caller then accumulates Y += P V.
template <class A, class Valid>
void online_softmax_block(A* S, int64_t rows, int64_t L, Valid valid, A* m, A* z, A* Y, int64_t Dv) {
  for (int64_t i = 0; i < rows; ++i) {
    A* __restrict row = S + i * L;
    const int64_t nv = std::min<int64_t>(L, valid(i));
    if (nv <= 0) {
      std::fill(row, row + L, A(0));
      continue;
    }
    A bmax = row[0];
    for (int64_t j = 1; j < nv; ++j) bmax = std::max(bmax, row[j]);
    const A mnew = std::max(m[i], bmax);
    const A alpha = std::exp(m[i] - mnew);  // 0 on the first block (m = -inf)
    const A sum = exp_shift(row, nv, mnew);
    std::fill(row + nv, row + L, A(0));
    z[i] = z[i] * alpha + sum;
    if (alpha != A(1)) {
      A* __restrict y = Y + i * Dv;
      for (int64_t c = 0; c < Dv; ++c) y[c] *= alpha;
    }
    m[i] = mnew;
  }
}

}  // namespace attnrnn::cpu::sm
