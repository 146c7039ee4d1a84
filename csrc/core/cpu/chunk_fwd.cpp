// Chunkwise forward on the CPU.
//
// One work item is one (sequence n, kv head g); the items run in parallel. Inside an item the
// sequence is cut into chunks of C tokens. With S, z the state at the start of a chunk and
// A = Q' K'ᵀ masked to s <= t:
//   intra-chunk:  O  = A V                       (the chunk's own tokens, current one included)
//   inter-chunk:  O += Q' S,   den = Q' z + rowsum(A) + eps
//   state update: S += K'ᵀ V,  z += Σ_t k'_t
// With few items (plan_segments) a sequence is also cut into segments of whole chunks, computed in
// three phases: the state increment Σ K'ᵀ V of each segment, a prefix sum giving the state at
// each segment start, then the chunks of every segment from its start state, all in parallel.
// Every segment runs on one thread in a fixed order, so results do not depend on the executor.
#include "common.h"
#include "gemm.h"
#include "segments.h"

namespace attnrnn::cpu {

namespace {

// Per-thread buffers, sizes in elements (C = chunk size).
template <class A>
struct FwdScratch {
  std::vector<A> kp;   // C x K   k' of the chunk
  std::vector<A> kt;   // K x C   k' transposed
  std::vector<A> v;    // C x V
  std::vector<A> qp;   // C x K   q' of one query head
  std::vector<A> a;    // C x C   causal scores
  std::vector<A> o;    // C x V   output rows before normalization
  std::vector<A> den;  // C
  std::vector<A> S;    // K x V   running state
  std::vector<A> z;    // K

  FwdScratch(const Dims& d, int64_t C)
      : kp(C * d.K), kt(d.K * C), v(C * d.V), qp(C * d.K), a(C * C), o(C * d.V), den(C),
        S(d.K * d.V), z(d.K) {}
};

// The chunks of one segment, starting from the state in w.S, w.z.
template <class T>
void forward_segment(const LinearAttnFwdParams& p, const Dims& d, int64_t C, const Segment& sg,
                     FwdScratch<acc_t<T>>& w) {
  using A = acc_t<T>;
  const int64_t g = sg.item % d.Hkv, K = d.K, V = d.V;
  const Seq seq = sequence(p, sg.item / d.Hkv);
  const A scale = static_cast<A>(p.scale), eps = static_cast<A>(p.eps);
  const int64_t end = std::min(seq.len, sg.chunk_end * C);

  for (int64_t c0 = sg.chunk_begin * C; c0 < end; c0 += C) {
    const int64_t L = std::min(C, end - c0), t0 = seq.t0 + c0;

    // Load: k' = phi(k) and v of the chunk, k' transposed for the score product.
    for (int64_t i = 0; i < L; ++i) {
      load_phi(p.feature_map, at<T>(p.k, seq.b, t0 + i, g), K, A(1), &w.kp[i * K], static_cast<A*>(nullptr));
      load_row(at<T>(p.v, seq.b, t0 + i, g), V, &w.v[i * V]);
    }
    transpose(w.kp.data(), L, K, w.kt.data());

    for (int64_t h = g * d.G; h < (g + 1) * d.G; ++h) {
      for (int64_t i = 0; i < L; ++i) {
        load_phi(p.feature_map, at<T>(p.q, seq.b, t0 + i, h), K, scale, &w.qp[i * K],
                 static_cast<A*>(nullptr));
      }

      // Intra-chunk: A = Q' K'ᵀ (s <= t), O = A V.
      causal_scores(L, K, w.qp.data(), w.kt.data(), w.a.data());
      causal_nn(L, V, w.a.data(), w.v.data(), V, w.o.data(), V, false);

      // Inter-chunk: O += Q' S.
      gemm(L, V, K, w.qp.data(), K, int64_t(1), w.S.data(), V, w.o.data(), V, true);

      if (p.normalize) {
        for (int64_t i = 0; i < L; ++i) {
          const A* __restrict q = &w.qp[i * K];
          const A* __restrict arow = &w.a[i * L];
          const A inv = A(1) / (dot(q, w.z.data(), K) + sum(arow, i + 1) + eps);
          A* __restrict orow = &w.o[i * V];
          for (int64_t j = 0; j < V; ++j) orow[j] *= inv;
        }
      }
      for (int64_t i = 0; i < L; ++i) store_row(&w.o[i * V], V, at<T>(p.o, seq.b, t0 + i, h));
    }

    // State update: S += K'ᵀ V, z += Σ_t k'_t.
    gemm(K, V, L, w.kp.data(), int64_t(1), K, w.v.data(), V, w.S.data(), V, true);
    if (p.normalize)
      for (int64_t i = 0; i < L; ++i)
        for (int64_t k = 0; k < K; ++k) w.z[k] += w.kp[i * K + k];
  }
}

}  // namespace

Status chunk_fwd(const LinearAttnFwdParams& p) {
  return dispatch_dtype(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    using A = acc_t<T>;
    const Dims d = dims_of(p);
    const int64_t C = chunk_of(p), K = d.K, KV = d.K * d.V;
    const std::vector<Segment> plan = plan_segments(p, d, C);

    // Phases 1 and 2: the state at the start of every segment.
    const std::vector<A> start = segment_starts<T>(p, d, C, plan);

    // Phase 3: every segment from its start state; the last one of an item writes the final state.
    parallel_for(p.executor, static_cast<int64_t>(plan.size()), 1, [&](int64_t begin, int64_t end) {
      FwdScratch<A> w(d, C);
      for (int64_t u = begin; u < end; ++u) {
        const Segment& sg = plan[u];
        load_segment_start(p, d, plan, start, u, w.S.data(), w.z.data());
        forward_segment<T>(p, d, C, sg, w);
        if (sg.last) {
          store_state(w.S.data(), sg.item, KV, p.final_S);
          if (p.normalize) store_state(w.z.data(), sg.item, K, p.final_z);
        }
      }
    });
    return Status::kSuccess;
  });
}

}  // namespace attnrnn::cpu
