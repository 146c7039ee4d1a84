// Small matrix products of the chunked kernels, register-blocked with GCC/Clang vector types.
//
//   gemm:  C[m x n] (=, +=) Σ_p a(i, p) B[p, j],  a(i, p) = A[i * ars + p * acs],  B row-major.
//
// The A operand has arbitrary strides (so Xᵀ Y is a gemm with ars = 1), B and C are row-major with
// unit column stride. The micro-kernel keeps an MR x NR block of C in vector registers while it
// streams the p loop: each step broadcasts MR values of A and does MR x NR fused multiply-adds
// against one NR-wide row of B. Column blocks run outermost so the kd x NR panel of B stays in
// cache. Also: dot and sum with vector accumulators, and the causal (triangular) products.
//
// The causal products read only the terms inside each row's range: a masked score is never
// multiplied by its operand row, since 0 · NaN = NaN would carry a non-finite value at token s
// into the outputs of the tokens before s.
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

// Row-ranged product: C[i, :] (=, +=) Σ_{p ∈ [begin(i), end(i))} a(i, p) B[p, :], a(i, p) =
// A[i * ars + p * acs], with begin and end nondecreasing in i. Terms outside a row's range are
// never read. Per block of MR rows, the range all its rows share runs on the micro-kernel and
// each row's remainder (at most MR - 1 terms where consecutive ranges move by one) as row updates.
template <class A, class Begin, class End>
void gemm_row_ranges(int64_t m, int64_t n, Begin begin, End end, const A* a, int64_t ars, int64_t acs,
                     const A* b, int64_t ldb, A* c, int64_t ldc, bool accumulate) {
  constexpr int MR = Tile<A>::MR;
  if (m == 0) return;
  if (begin(m - 1) == begin(0) && end(m - 1) == end(0)) {  // one range for all rows: a plain product
    const int64_t lo = begin(0), hi = std::max(lo, end(0));
    gemm(m, n, hi - lo, a + lo * acs, ars, acs, b + lo * ldb, ldb, c, ldc, accumulate);
    return;
  }
  for (int64_t i0 = 0; i0 < m; i0 += MR) {
    const int64_t mr = std::min<int64_t>(MR, m - i0);
    const int64_t lo = begin(i0 + mr - 1), hi = std::max(lo, end(i0));  // the shared range [lo, hi)
    gemm(mr, n, hi - lo, a + i0 * ars + lo * acs, ars, acs, b + lo * ldb, ldb, c + i0 * ldc, ldc, accumulate);
    for (int64_t i = i0; i < i0 + mr; ++i) {
      A* __restrict ci = c + i * ldc;
      const int64_t bi = begin(i), ei = end(i);
      auto add = [&](int64_t p0, int64_t p1) {
        for (int64_t p = p0; p < p1; ++p) {
          const A x = a[i * ars + p * acs];
          const A* __restrict bp = b + p * ldb;
          for (int64_t j = 0; j < n; ++j) ci[j] += x * bp[j];
        }
      };
      add(bi, std::min(lo, ei));  // before the shared range
      add(std::max(hi, bi), ei);  // after it
    }
  }
}

// C[t, :] (+)= Σ_{s <= t} M[t, s] B[s, :] with M lower-triangular (L x L), B L x n.
template <class A>
void causal_nn(int64_t L, int64_t n, const A* m, const A* b, int64_t ldb, A* c, int64_t ldc,
               bool accumulate) {
  gemm_row_ranges(L, n, [](int64_t) { return int64_t(0); }, [](int64_t t) { return t + 1; }, m, L, int64_t(1), b,
                  ldb, c, ldc, accumulate);
}

// C[s, :] (+)= Σ_{t >= s} M[t, s] B[t, :] with M lower-triangular (L x L), B L x n.
template <class A>
void causal_tn(int64_t L, int64_t n, const A* m, const A* b, int64_t ldb, A* c, int64_t ldc,
               bool accumulate) {
  gemm_row_ranges(L, n, [](int64_t s) { return s; }, [L](int64_t) { return L; }, m, int64_t(1), L, b, ldb, c, ldc,
                  accumulate);
}

}  // namespace attnrnn::cpu
