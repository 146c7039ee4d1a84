// Softmax attention forward on the CPU: the online-softmax recurrence, block by block.
//
// One work item is one (sequence, query head, block of kBlockQ queries); items run in parallel.
// Per item, with Q' = scale * Q of the block and running (m, z, Y) per query row:
//   for each block of kBlockK keys the rows can see (bottom-right causal limit):
//     load:    K block transposed (D x Lk), V block (Lk x Dv)
//     scores:  S = Q' Kᵀ                                    (gemm micro-kernel)
//     update:  m' = max(m, rowmax S), P = exp(S - m'), z = z e^{m-m'} + rowsum P, Y = Y e^{m-m'}
//     values:  Y += P V                                     (gemm micro-kernel)
//   finish:  o = Y / z, lse = m + log z   (o = 0, lse = -inf for a query with no key)
// Memory per thread: O(kBlockQ * (D + Dv) + kBlockK * (D + Dv) + kBlockQ * kBlockK); nothing of
// size Tq x Tk exists.
#include "softmax_common.h"

namespace attnrnn::cpu {

namespace {

using sm::kBlockK;
using sm::kBlockQ;

template <class A>
struct FwdScratch {
  std::vector<A> q;   // Bq x D    scaled queries
  std::vector<A> kb;  // Bk x D    key block (rows)
  std::vector<A> kt;  // D x Bk    key block transposed
  std::vector<A> vb;  // Bk x Dv   value block
  std::vector<A> s;   // Bq x Bk   scores, then probabilities
  std::vector<A> y;   // Bq x Dv   numerators
  std::vector<A> pv;  // Bq x Dv   P V of one key block
  std::vector<A> m, z;  // Bq     running max, denominator

  explicit FwdScratch(const sm::Dims& d)
      : q(kBlockQ * d.D), kb(kBlockK * d.D), kt(d.D * kBlockK), vb(kBlockK * d.Dv), s(kBlockQ * kBlockK),
        y(kBlockQ * d.Dv), pv(kBlockQ * d.Dv), m(kBlockQ), z(kBlockQ) {}
};

struct Item {
  int64_t n, h, i0;
};

// Items of every (sequence, head): query blocks in zig-zag order (first, last, second, ...) so
// that contiguous ranges of items, as the executor hands them out, carry similar causal work.
std::vector<Item> plan_items(const SoftmaxAttnParams& p, const sm::Dims& d) {
  std::vector<Item> items;
  for (int64_t n = 0; n < d.N; ++n) {
    const int64_t blocks = (sm::sequence_of(p, n).Lq + kBlockQ - 1) / kBlockQ;
    for (int64_t h = 0; h < d.H; ++h)
      for (int64_t lo = 0, hi = blocks - 1; lo <= hi; ++lo, --hi) {
        items.push_back({n, h, lo * kBlockQ});
        if (hi != lo) items.push_back({n, h, hi * kBlockQ});
      }
  }
  return items;
}

template <class T>
void forward_block(const SoftmaxAttnParams& p, const sm::Dims& d, const Item& it, FwdScratch<acc_t<T>>& w) {
  using A = acc_t<T>;
  const sm::Seq s = sm::sequence_of(p, it.n);
  const int64_t D = d.D, Dv = d.Dv, g = it.h / d.G;
  const int64_t rows = std::min(kBlockQ, s.Lq - it.i0);
  const int64_t kend = s.key_end(it.i0 + rows - 1);  // keys any row of the block sees

  // Load: Q' = scale * q; m = -inf, z = 0, Y = 0.
  sm::load_rows<T>(p.q, s.b, s.q0 + it.i0, it.h, rows, D, static_cast<A>(p.scale), w.q.data());
  std::fill(w.m.begin(), w.m.begin() + rows, sm::neg_inf<A>());
  std::fill(w.z.begin(), w.z.begin() + rows, A(0));
  std::fill(w.y.begin(), w.y.begin() + rows * Dv, A(0));

  for (int64_t j0 = 0; j0 < kend; j0 += kBlockK) {
    const int64_t L = std::min(kBlockK, kend - j0);
    sm::load_rows<T>(p.k, s.b, s.k0 + j0, g, L, D, A(1), w.kb.data());
    transpose(w.kb.data(), L, D, w.kt.data());
    sm::load_rows<T>(p.v, s.b, s.k0 + j0, g, L, Dv, A(1), w.vb.data());

    // Scores: S = Q' Kᵀ.
    gemm(rows, L, D, w.q.data(), D, int64_t(1), w.kt.data(), L, w.s.data(), L, false);
    // Keys of this block that row i sees: [0, visible(i)).
    const auto visible = [&](int64_t i) { return std::clamp<int64_t>(s.key_end(it.i0 + i) - j0, 0, L); };
    // Update: running max, rescaled denominator and numerators; S becomes P.
    sm::online_softmax_block(w.s.data(), rows, L, visible, w.m.data(), w.z.data(), w.y.data(), Dv);
    // Values: Y += P V (the block's product first, then one addition: short summation chains).
    // Each row reads only the values of the keys it sees: a masked 0 times a non-finite value of a
    // later key would reach the row.
    gemm_row_ranges(rows, Dv, [](int64_t) { return int64_t(0); }, visible, w.s.data(), L, int64_t(1), w.vb.data(),
                    Dv, w.pv.data(), Dv, false);
    for (int64_t e = 0; e < rows * Dv; ++e) w.y[e] += w.pv[e];
  }

  // Finish: o = Y / z, lse = m + log z.
  A* lse = static_cast<A*>(p.lse);
  for (int64_t i = 0; i < rows; ++i) {
    const bool any = w.z[i] > A(0);
    const A inv = any ? A(1) / w.z[i] : A(0);
    A* y = &w.y[i * Dv];
    for (int64_t c = 0; c < Dv; ++c) y[c] *= inv;
    store_row(y, Dv, at<T>(p.o, s.b, s.q0 + it.i0 + i, it.h));
    lse[sm::row_index(p, s, it.h, it.i0 + i)] = any ? w.m[i] + std::log(w.z[i]) : sm::neg_inf<A>();
  }
}

}  // namespace

Status softmax_fwd(const SoftmaxAttnParams& p) {
  return dispatch_dtype(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    using A = acc_t<T>;
    const sm::Dims d = sm::dims_of(p);
    const std::vector<Item> items = plan_items(p, d);
    parallel_for(p.executor, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
      FwdScratch<A> w(d);
      for (int64_t u = begin; u < end; ++u) forward_block<T>(p, d, items[u], w);
    });
    return Status::kSuccess;
  });
}

}  // namespace attnrnn::cpu
