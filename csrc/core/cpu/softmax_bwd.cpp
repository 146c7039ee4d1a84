// Softmax attention backward on the CPU, by recomputation from q, k, v, o and lse.
//
// With Q' = scale * Q, P = exp(Q' Kᵀ - lse) (masked), D_i = dout_i . o_i:
//   dV = Pᵀ dO,   dP = dO Vᵀ,   dS = P ∘ (dP - D),   dK = dSᵀ Q',   dQ = scale * dS K.
// Phases (each a parallel loop; no float atomics, every output element has one writer):
//   1. rowdot: D_i for every (query, head)                         items: (sequence, head)
//   2. dq:     per block of queries, over the key blocks it sees   items: (sequence, head, q block)
//   3. dk, dv: per block of keys, over the G query heads of its kv head and the query blocks that
//              see it                                              items: (sequence, kv head, k block)
// P is recomputed in phases 2 and 3 (twice the score FLOPs of FlashAttention-2's single pass,
// which needs atomics or a reduction over dq). Rows with lse = -inf (no key) give P = 0.
#include "softmax_common.h"

namespace attnrnn::cpu {

namespace {

using sm::kBlockK;
using sm::kBlockQ;

template <class A>
struct BwdScratch {
  std::vector<A> q;    // Bq x D    scaled queries
  std::vector<A> dO;   // Bq x Dv   output gradient
  std::vector<A> kb;   // Bk x D    key block
  std::vector<A> kt;   // D x Bk    key block transposed
  std::vector<A> vb;   // Bk x Dv   value block
  std::vector<A> vt;   // Dv x Bk   value block transposed
  std::vector<A> p;    // Bq x Bk   probabilities
  std::vector<A> dp;   // Bq x Bk   dP, then dS
  std::vector<A> acc;  // Bq x D (dq) or Bk x D (dk)
  std::vector<A> dv;   // Bk x Dv
  std::vector<A> part;  // max(Bq, Bk) x max(D, Dv)   one block's product before it joins its sum

  explicit BwdScratch(const sm::Dims& d)
      : q(kBlockQ * d.D), dO(kBlockQ * d.Dv), kb(kBlockK * d.D), kt(d.D * kBlockK), vb(kBlockK * d.Dv),
        vt(d.Dv * kBlockK), p(kBlockQ * kBlockK), dp(kBlockQ * kBlockK), acc(std::max(kBlockQ, kBlockK) * d.D),
        dv(kBlockK * d.Dv), part(std::max(kBlockQ, kBlockK) * std::max(d.D, d.Dv)) {}
};

// acc += x. Sums over many blocks are taken block by block (a chain of one block's length inside
// the gemm, then one addition per block), not as one long chain: a 2048-term fp32 chain was 4x
// PyTorch's error on dk and dv at T = 1024.
template <class A>
inline void add_to(const A* __restrict x, int64_t n, A* __restrict acc) {
  for (int64_t i = 0; i < n; ++i) acc[i] += x[i];
}

// Recomputes P = exp(S - lse) in place of the scores (rows x L, keys j0.. of the block) and
// turns dP into dS = P ∘ (dP - D).
template <class A>
void probabilities_and_ds(const sm::Seq& s, int64_t i0, int64_t j0, int64_t rows, int64_t L, const A* lse,
                          const A* Drow, A* P, A* dS) {
  for (int64_t i = 0; i < rows; ++i) {
    A* __restrict pr = P + i * L;
    A* __restrict dr = dS + i * L;
    const int64_t nv = std::min<int64_t>(L, std::max<int64_t>(0, s.key_end(i0 + i) - j0));
    if (nv == 0 || lse[i] == sm::neg_inf<A>()) {
      std::fill(pr, pr + L, A(0));
      std::fill(dr, dr + L, A(0));
      continue;
    }
    sm::exp_shift(pr, nv, lse[i]);
    std::fill(pr + nv, pr + L, A(0));
    for (int64_t j = 0; j < L; ++j) dr[j] = pr[j] * (dr[j] - Drow[i]);
  }
}

// Loads the q-side block: Q' rows, dO rows, lse and D of rows [i0, i0 + rows) of head h.
template <class T>
void load_query_side(const SoftmaxAttnParams& p, const sm::Dims& d, const sm::Seq& s, int64_t h, int64_t i0,
                     int64_t rows, const acc_t<T>* Dall, BwdScratch<acc_t<T>>& w, const acc_t<T>** lse,
                     const acc_t<T>** Drow) {
  using A = acc_t<T>;
  sm::load_rows<T>(p.q, s.b, s.q0 + i0, h, rows, d.D, static_cast<A>(p.scale), w.q.data());
  sm::load_rows<T>(p.dout, s.b, s.q0 + i0, h, rows, d.Dv, A(1), w.dO.data());
  *lse = static_cast<const A*>(p.lse) + sm::row_index(p, s, h, i0);
  *Drow = Dall + sm::row_index(p, s, h, i0);
}

template <class T>
void load_key_side(const SoftmaxAttnParams& p, const sm::Dims& d, const sm::Seq& s, int64_t g, int64_t j0,
                   int64_t L, BwdScratch<acc_t<T>>& w) {
  using A = acc_t<T>;
  sm::load_rows<T>(p.k, s.b, s.k0 + j0, g, L, d.D, A(1), w.kb.data());
  transpose(w.kb.data(), L, d.D, w.kt.data());
  sm::load_rows<T>(p.v, s.b, s.k0 + j0, g, L, d.Dv, A(1), w.vb.data());
  transpose(w.vb.data(), L, d.Dv, w.vt.data());
}

// Phase 2: dq of one query block.
template <class T>
void dq_block(const SoftmaxAttnParams& p, const sm::Dims& d, int64_t n, int64_t h, int64_t i0, const acc_t<T>* Dall,
              BwdScratch<acc_t<T>>& w) {
  using A = acc_t<T>;
  const sm::Seq s = sm::sequence_of(p, n);
  const int64_t D = d.D, Dv = d.Dv, g = h / d.G, rows = std::min(kBlockQ, s.Lq - i0);
  const int64_t kend = s.key_end(i0 + rows - 1);
  const A *lse, *Drow;
  load_query_side<T>(p, d, s, h, i0, rows, Dall, w, &lse, &Drow);
  std::fill(w.acc.begin(), w.acc.begin() + rows * D, A(0));
  for (int64_t j0 = 0; j0 < kend; j0 += kBlockK) {
    const int64_t L = std::min(kBlockK, kend - j0);
    load_key_side<T>(p, d, s, g, j0, L, w);
    gemm(rows, L, D, w.q.data(), D, int64_t(1), w.kt.data(), L, w.p.data(), L, false);     // S = Q' Kᵀ
    gemm(rows, L, Dv, w.dO.data(), Dv, int64_t(1), w.vt.data(), L, w.dp.data(), L, false);  // dP = dO Vᵀ
    probabilities_and_ds(s, i0, j0, rows, L, lse, Drow, w.p.data(), w.dp.data());
    // dQ += dS K over the keys each query sees (a masked 0 times a later key's non-finite value
    // would reach the query).
    const auto visible = [&](int64_t i) { return std::clamp<int64_t>(s.key_end(i0 + i) - j0, 0, L); };
    gemm_row_ranges(rows, D, [](int64_t) { return int64_t(0); }, visible, w.dp.data(), L, int64_t(1), w.kb.data(), D,
                    w.part.data(), D, false);
    add_to(w.part.data(), rows * D, w.acc.data());
  }
  const A scale = static_cast<A>(p.scale);
  for (int64_t i = 0; i < rows; ++i) {
    A* r = &w.acc[i * D];
    for (int64_t c = 0; c < D; ++c) r[c] *= scale;
    store_row(r, D, at<T>(p.dq, s.b, s.q0 + i0 + i, h));
  }
}

// Phase 3: dk, dv of one key block, summed over the query heads of kv head g.
template <class T>
void dkv_block(const SoftmaxAttnParams& p, const sm::Dims& d, int64_t n, int64_t g, int64_t j0, const acc_t<T>* Dall,
               BwdScratch<acc_t<T>>& w) {
  using A = acc_t<T>;
  const sm::Seq s = sm::sequence_of(p, n);
  const int64_t D = d.D, Dv = d.Dv, L = std::min(kBlockK, s.Lk - j0);
  // First query that sees key j0: i + Lk - Lq >= j0.
  const int64_t i_first = s.causal ? std::max<int64_t>(0, j0 - (s.Lk - s.Lq)) : 0;
  load_key_side<T>(p, d, s, g, j0, L, w);
  std::fill(w.acc.begin(), w.acc.begin() + L * D, A(0));
  std::fill(w.dv.begin(), w.dv.begin() + L * Dv, A(0));
  for (int64_t h = g * d.G; h < (g + 1) * d.G; ++h) {
    for (int64_t i0 = i_first; i0 < s.Lq; i0 += kBlockQ) {
      const int64_t rows = std::min(kBlockQ, s.Lq - i0);
      const A *lse, *Drow;
      load_query_side<T>(p, d, s, h, i0, rows, Dall, w, &lse, &Drow);
      gemm(rows, L, D, w.q.data(), D, int64_t(1), w.kt.data(), L, w.p.data(), L, false);     // S = Q' Kᵀ
      gemm(rows, L, Dv, w.dO.data(), Dv, int64_t(1), w.vt.data(), L, w.dp.data(), L, false);  // dP = dO Vᵀ
      probabilities_and_ds(s, i0, j0, rows, L, lse, Drow, w.p.data(), w.dp.data());
      // dV += Pᵀ dO and dK += dSᵀ Q' over the queries that see each key, from its first one: a
      // masked 0 times an earlier query's non-finite row would reach the key.
      const auto first_seer = [&](int64_t j) {
        return s.causal ? std::clamp<int64_t>(j0 + j - (s.Lk - s.Lq) - i0, 0, rows) : int64_t(0);
      };
      const auto all_rows = [rows](int64_t) { return rows; };
      gemm_row_ranges(L, Dv, first_seer, all_rows, w.p.data(), int64_t(1), L, w.dO.data(), Dv, w.part.data(), Dv,
                      false);
      add_to(w.part.data(), L * Dv, w.dv.data());
      gemm_row_ranges(L, D, first_seer, all_rows, w.dp.data(), int64_t(1), L, w.q.data(), D, w.part.data(), D, false);
      add_to(w.part.data(), L * D, w.acc.data());
    }
  }
  for (int64_t j = 0; j < L; ++j) {
    store_row(&w.acc[j * D], D, at<T>(p.dk, s.b, s.k0 + j0 + j, g));
    store_row(&w.dv[j * Dv], Dv, at<T>(p.dv, s.b, s.k0 + j0 + j, g));
  }
}

struct Item {
  int64_t n, head, start;
};

// (sequence, head, block start) items, blocks of one (sequence, head) in zig-zag order.
std::vector<Item> plan(const sm::Dims& d, int64_t heads, int64_t block, bool keys, const SoftmaxAttnParams& p) {
  std::vector<Item> items;
  for (int64_t n = 0; n < d.N; ++n) {
    const sm::Seq s = sm::sequence_of(p, n);
    const int64_t blocks = ((keys ? s.Lk : s.Lq) + block - 1) / block;
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t lo = 0, hi = blocks - 1; lo <= hi; ++lo, --hi) {
        items.push_back({n, h, lo * block});
        if (hi != lo) items.push_back({n, h, hi * block});
      }
  }
  return items;
}

}  // namespace

Status softmax_bwd(const SoftmaxAttnParams& p) {
  return dispatch_dtype(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    using A = acc_t<T>;
    const sm::Dims d = sm::dims_of(p);

    // Phase 1: D_i = dout_i . o_i for every (query, head), laid out like lse.
    std::vector<A> Dall(static_cast<size_t>(p.batch * d.H * p.seqlen_q));
    parallel_for(p.executor, d.N * d.H, 1, [&](int64_t begin, int64_t end) {
      std::vector<A> a(d.Dv), b(d.Dv);
      for (int64_t u = begin; u < end; ++u) {
        const sm::Seq s = sm::sequence_of(p, u / d.H);
        const int64_t h = u % d.H;
        for (int64_t i = 0; i < s.Lq; ++i) {
          load_row(at<T>(p.dout, s.b, s.q0 + i, h), d.Dv, a.data());
          load_row(at<T>(p.out, s.b, s.q0 + i, h), d.Dv, b.data());
          Dall[sm::row_index(p, s, h, i)] = dot(a.data(), b.data(), d.Dv);
        }
      }
    });

    // Phase 2: dq.
    const std::vector<Item> q_items = plan(d, d.H, kBlockQ, false, p);
    parallel_for(p.executor, static_cast<int64_t>(q_items.size()), 1, [&](int64_t begin, int64_t end) {
      BwdScratch<A> w(d);
      for (int64_t u = begin; u < end; ++u) dq_block<T>(p, d, q_items[u].n, q_items[u].head, q_items[u].start, Dall.data(), w);
    });

    // Phase 3: dk, dv.
    const std::vector<Item> k_items = plan(d, d.Hkv, kBlockK, true, p);
    parallel_for(p.executor, static_cast<int64_t>(k_items.size()), 1, [&](int64_t begin, int64_t end) {
      BwdScratch<A> w(d);
      for (int64_t u = begin; u < end; ++u) dkv_block<T>(p, d, k_items[u].n, k_items[u].head, k_items[u].start, Dall.data(), w);
    });
    return Status::kSuccess;
  });
}

}  // namespace attnrnn::cpu
