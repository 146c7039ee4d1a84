// Small matrix products of the chunked kernels, register-blocked with GCC/Clang vector types.
//
//   gemm:  C[m x n] (=, +=) Σ_p a(i, p) B[p, j],  a(i, p) = A[i * ars + p * acs],  B row-major.
//
// The A operand has arbitrary strides (so Xᵀ Y is a gemm with ars = 1), B and C are row-major with
// unit column stride. The micro-kernel keeps an MR x NR block of C in vector registers while it
// streams the p loop: each step broadcasts MR values of A and does MR x NR fused multiply-adds
// against one NR-wide row of B. Column blocks run outermost so the kd x NR panel of B stays in
// cache. Also: dot and sum with vector accumulators, and the causal (triangular) products.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace attnrnn::cpu {

// 512-bit vectors of the GCC/Clang vector extension hold the accumulators in registers.
template <class A>
struct Vec {
  typedef A type __attribute__((vector_size(64)));
  static constexpr int W = 64 / sizeof(A);
};

template <class A>
inline typename Vec<A>::type load_vec(const A* p) {
  typename Vec<A>::type x;
  std::memcpy(&x, p, sizeof x);
  return x;
}
template <class A>
inline void store_vec(A* p, typename Vec<A>::type x) {
  std::memcpy(p, &x, sizeof x);
}

// Σ_i x[i] y[i] and Σ_i x[i], vectorized with a fixed summation order (so still deterministic).
template <class A>
inline A dot(const A* __restrict x, const A* __restrict y, int64_t n) {
  using V = typename Vec<A>::type;
  constexpr int W = Vec<A>::W;
  V acc{};
  int64_t i = 0;
  for (; i + W <= n; i += W) acc += load_vec(x + i) * load_vec(y + i);
  A s = A(0);
  for (int j = 0; j < W; ++j) s += acc[j];
  for (; i < n; ++i) s += x[i] * y[i];
  return s;
}

template <class A>
inline A sum(const A* __restrict x, int64_t n) {
  using V = typename Vec<A>::type;
  constexpr int W = Vec<A>::W;
  V acc{};
  int64_t i = 0;
  for (; i + W <= n; i += W) acc += load_vec(x + i);
  A s = A(0);
  for (int j = 0; j < W; ++j) s += acc[j];
  for (; i < n; ++i) s += x[i];
  return s;
}

template <class A>
struct Tile {
  static constexpr int MR = 8;
  static constexpr int NV = 2;                 // vectors per row of the block
  static constexpr int NR = NV * Vec<A>::W;    // 32 floats / 16 doubles
};

// Full MR x NR block.
template <class A, int MR>
inline void micro_kernel(int64_t kd, const A* __restrict a, int64_t ars, int64_t acs,
                         const A* __restrict b, int64_t ldb, A* __restrict c, int64_t ldc,
                         bool accumulate) {
  using V = typename Vec<A>::type;
  constexpr int NV = Tile<A>::NV, W = Vec<A>::W;
  V t[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NV; ++j) t[r][j] = accumulate ? load_vec(c + r * ldc + j * W) : V{};
  for (int64_t p = 0; p < kd; ++p) {
    V bp[NV];
    for (int j = 0; j < NV; ++j) bp[j] = load_vec(b + p * ldb + j * W);
    for (int r = 0; r < MR; ++r) {
      const A ar = a[r * ars + p * acs];
      for (int j = 0; j < NV; ++j) t[r][j] += ar * bp[j];
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NV; ++j) store_vec(c + r * ldc + j * W, t[r][j]);
}

// Right-edge column block (nc < NR): B is packed into a zero-padded kd x NR panel and each block of
// C is staged in an MR x NR tile, so the full-width micro-kernel runs there too.
template <class A, int MR>
inline void edge_block(int64_t kd, const A* a, int64_t ars, int64_t acs, const A* panel, A* c,
                       int64_t ldc, int64_t nc, bool accumulate) {
  constexpr int NR = Tile<A>::NR;
  alignas(64) A tile[MR * NR] = {};
  if (accumulate)
    for (int r = 0; r < MR; ++r) std::copy(c + r * ldc, c + r * ldc + nc, tile + r * NR);
  micro_kernel<A, MR>(kd, a, ars, acs, panel, NR, tile, NR, accumulate);
  for (int r = 0; r < MR; ++r) std::copy(tile + r * NR, tile + r * NR + nc, c + r * ldc);
}

template <class A>
void gemm(int64_t m, int64_t n, int64_t kd, const A* a, int64_t ars, int64_t acs, const A* b,
          int64_t ldb, A* c, int64_t ldc, bool accumulate) {
  constexpr int MR = Tile<A>::MR, NR = Tile<A>::NR;
  thread_local std::vector<A> panel;  // kd x NR, the zero-padded right edge of B
  for (int64_t j0 = 0; j0 < n; j0 += NR) {
    const int64_t nc = std::min<int64_t>(NR, n - j0);
    A* cj = c + j0;
    if (nc == NR) {
      const A* bj = b + j0;
      int64_t i = 0;
      for (; i + MR <= m; i += MR)
        micro_kernel<A, MR>(kd, a + i * ars, ars, acs, bj, ldb, cj + i * ldc, ldc, accumulate);
      if (i + 4 <= m) {
        micro_kernel<A, 4>(kd, a + i * ars, ars, acs, bj, ldb, cj + i * ldc, ldc, accumulate);
        i += 4;
      }
      for (; i < m; ++i)
        micro_kernel<A, 1>(kd, a + i * ars, ars, acs, bj, ldb, cj + i * ldc, ldc, accumulate);
    } else {
      panel.assign(kd * NR, A(0));
      for (int64_t p = 0; p < kd; ++p) std::copy(b + p * ldb + j0, b + p * ldb + j0 + nc, &panel[p * NR]);
      int64_t i = 0;
      for (; i + MR <= m; i += MR)
        edge_block<A, MR>(kd, a + i * ars, ars, acs, panel.data(), cj + i * ldc, ldc, nc, accumulate);
      if (i + 4 <= m) {
        edge_block<A, 4>(kd, a + i * ars, ars, acs, panel.data(), cj + i * ldc, ldc, nc, accumulate);
        i += 4;
      }
      for (; i < m; ++i)
        edge_block<A, 1>(kd, a + i * ars, ars, acs, panel.data(), cj + i * ldc, ldc, nc, accumulate);
    }
  }
}

// Causal scores: C[t, s] = Σ_p X[t, p] Yᵀ[p, s] for s <= t, 0 above the diagonal.
// X is L x d row-major, Yt is d x L (Y transposed), C is L x L. Column blocks that lie entirely
// above the diagonal of a row block are skipped.
template <class A>
void causal_scores(int64_t L, int64_t d, const A* x, const A* yt, A* c) {
  constexpr int MR = Tile<A>::MR, NR = Tile<A>::NR;
  for (int64_t i0 = 0; i0 < L; i0 += MR) {
    const int64_t mr = std::min<int64_t>(MR, L - i0);
    const int64_t cols = std::min<int64_t>(L, (i0 + mr + NR - 1) / NR * NR);
    gemm(mr, cols, d, x + i0 * d, d, int64_t(1), yt, L, c + i0 * L, L, false);
  }
  for (int64_t t = 0; t < L; ++t) std::fill(c + t * L + t + 1, c + (t + 1) * L, A(0));
}

// C[t, :] (+)= Σ_{s <= t} M[t, s] B[s, :] with M lower-triangular (L x L), B L x n.
template <class A>
void causal_nn(int64_t L, int64_t n, const A* m, const A* b, int64_t ldb, A* c, int64_t ldc,
               bool accumulate) {
  constexpr int MR = Tile<A>::MR;
  for (int64_t i0 = 0; i0 < L; i0 += MR) {
    const int64_t mr = std::min<int64_t>(MR, L - i0);
    gemm(mr, n, i0 + mr, m + i0 * L, L, int64_t(1), b, ldb, c + i0 * ldc, ldc, accumulate);
  }
}

// C[s, :] (+)= Σ_{t >= s} M[t, s] B[t, :] with M lower-triangular (L x L), B L x n.
template <class A>
void causal_tn(int64_t L, int64_t n, const A* m, const A* b, int64_t ldb, A* c, int64_t ldc,
               bool accumulate) {
  constexpr int MR = Tile<A>::MR;
  for (int64_t s0 = 0; s0 < L; s0 += MR) {
    const int64_t mr = std::min<int64_t>(MR, L - s0);
    gemm(mr, n, L - s0, m + s0 * L + s0, int64_t(1), L, b + s0 * ldb, ldb, c + s0 * ldc, ldc, accumulate);
  }
}

}  // namespace attnrnn::cpu
