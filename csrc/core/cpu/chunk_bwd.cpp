// Chunkwise backward on the CPU; recomputes everything from q, k, v and the initial state.
//
// One work item is one (sequence n, kv head g). Per query head, with A = Q'K'ᵀ (s <= t),
// n_t = q'_t S_t, den_t = q'_t·z_t + eps (1 without normalization),
// dn_t = do_t / den_t, dd_t = -(do_t·n_t) / den_t² (0 without normalization) and
// dA[t,s] = dn_t·v_s + dd_t for s <= t:
//   pass 1 (forward over chunks, S, z at the chunk start):
//     dq' = dA K' + dN Sᵀ + dd zᵀ;  den and dd are kept per token for pass 2
//   pass 2 (reverse over chunks, dS̃, dz̃ = gradient flowing from the chunks after):
//     dk' = Σ_h dAᵀ Q' + V dS̃ᵀ + dz̃,  dv = Σ_h Aᵀ dN + K' dS̃
//     dS̃ += Σ_h Q'ᵀ dN,  dz̃ += Σ_h Σ_t dd_t q'_t
// With few items the sequences are cut into segments (segments.h): the states at segment starts
// come from the forward scan, pass 1 of each segment also sums its Σ_h Q'ᵀ dN, Σ dd q', and a
// suffix sum of those gives dS̃, dz̃ at every segment end for pass 2; all segments run in parallel.
#include "common.h"
#include "gemm.h"
#include "segments.h"

namespace attnrnn::cpu {

namespace {

// Per-thread buffers, sizes in elements (C = chunk size).
template <class A>
struct BwdScratch {
  std::vector<A> kp, dphi_k;  // C x K   k' and phi'(k)
  std::vector<A> kt;          // K x C   k' transposed
  std::vector<A> v;           // C x V
  std::vector<A> vt;          // V x C   v transposed
  std::vector<A> qp, dphi_q;  // C x K   q' and scale * phi'(q) of one query head
  std::vector<A> dn;          // C x V   dout, then dn
  std::vector<A> nn;          // C x V   numerators n (normalize only)
  std::vector<A> a, da;       // C x C   scores and their gradient
  std::vector<A> dx;          // C x K   dq' (pass 1), dk' (pass 2)
  std::vector<A> dv;          // C x V
  std::vector<A> St;          // V x K   S or dS̃ transposed

  BwdScratch(const Dims& d, int64_t C)
      : kp(C * d.K), dphi_k(C * d.K), kt(d.K * C), v(C * d.V), vt(d.V * C), qp(C * d.K),
        dphi_q(C * d.K), dn(C * d.V), nn(C * d.V), a(C * C), da(C * C), dx(C * d.K), dv(C * d.V),
        St(d.V * d.K) {}
};

// Context of one segment of one (sequence, kv head) item.
template <class T>
struct Work {
  using A = acc_t<T>;
  const LinearAttnBwdParams& p;
  const Dims& d;
  BwdScratch<A>& w;
  const Segment& sg;
  Seq seq;
  int64_t g, C;
  A scale, eps;
  A* den;  // seq.len x G: den and dd per token and query head (normalize only), kept for pass 2
  A* dd;
  A *S, *z;    // K x V, K: state (pass 1)
  A *dS, *dz;  // K x V, K: state gradient (pass 2)

  // k' (and phi'(k)), v and their transposes (k'ᵀ only when the scores are needed) for the L
  // tokens from t0.
  void load_kv(int64_t t0, int64_t L, bool with_dphi, bool with_kt) {
    const int64_t K = d.K, V = d.V;
    for (int64_t i = 0; i < L; ++i) {
      load_phi(p.feature_map, at<T>(p.k, seq.b, t0 + i, g), K, A(1), &w.kp[i * K],
               with_dphi ? &w.dphi_k[i * K] : nullptr);
      load_row(at<T>(p.v, seq.b, t0 + i, g), V, &w.v[i * V]);
    }
    if (with_kt) transpose(w.kp.data(), L, K, w.kt.data());
    transpose(w.v.data(), L, V, w.vt.data());
  }

  // q' (and scale * phi'(q)) and dout of head h.
  void load_q_do(int64_t t0, int64_t L, int64_t h, bool with_dphi) {
    for (int64_t i = 0; i < L; ++i) {
      load_phi(p.feature_map, at<T>(p.q, seq.b, t0 + i, h), d.K, scale, &w.qp[i * d.K],
               with_dphi ? &w.dphi_q[i * d.K] : nullptr);
      load_row(at<T>(p.dout, seq.b, t0 + i, h), d.V, &w.dn[i * d.V]);
    }
  }

  // dA = dN Vᵀ + dd (s <= t), dd read from the per-token store at offset c0 for head hh.
  void score_grad(int64_t c0, int64_t L, int64_t hh) {
    causal_scores(L, d.V, w.dn.data(), w.vt.data(), w.da.data());
    if (!p.normalize) return;
    for (int64_t i = 0; i < L; ++i) {
      const A dd = this->dd[(c0 + i) * d.G + hh];
      for (int64_t s = 0; s <= i; ++s) w.da[i * L + s] += dd;
    }
  }

  // Pass 1, chunk c, from the state in S, z (advanced past the chunk): dq for every query head of
  // the group, den and dd per token. When inc is non-null it receives the chunk's Σ_h Q'ᵀ dN and
  // Σ_h Σ_t dd_t q'_t (S then z).
  void forward_chunk(int64_t c, A* inc) {
    const int64_t K = d.K, V = d.V, G = d.G;
    {
      const int64_t c0 = c * C, L = std::min(C, seq.len - c0), t0 = seq.t0 + c0;
      load_kv(t0, L, false, p.normalize);
      transpose(S, K, V, w.St.data());
      for (int64_t hh = 0; hh < G; ++hh) {
        const int64_t h = g * G + hh;
        load_q_do(t0, L, h, true);

        // Numerators and denominators: n = A V + Q' S, den = Q' z + rowsum(A) + eps.
        if (p.normalize) {
          causal_scores(L, K, w.qp.data(), w.kt.data(), w.a.data());
          causal_nn(L, V, w.a.data(), w.v.data(), V, w.nn.data(), V, false);
          gemm(L, V, K, w.qp.data(), K, int64_t(1), S, V, w.nn.data(), V, true);
          for (int64_t i = 0; i < L; ++i) {
            const A den = dot(&w.qp[i * K], z, K) + sum(&w.a[i * L], i + 1) + eps;
            A* __restrict dn = &w.dn[i * V];
            const A don = dot(dn, &w.nn[i * V], V);
            for (int64_t j = 0; j < V; ++j) dn[j] /= den;
            this->den[(c0 + i) * G + hh] = den;
            this->dd[(c0 + i) * G + hh] = -don / (den * den);
          }
        }

        if (inc != nullptr) {  // this segment's share of the state gradient
          gemm(K, V, L, w.qp.data(), int64_t(1), K, w.dn.data(), V, inc, V, true);
          if (p.normalize)
            for (int64_t i = 0; i < L; ++i)
              for (int64_t k = 0; k < K; ++k) inc[K * V + k] += dd[(c0 + i) * G + hh] * w.qp[i * K + k];
        }

        // Intra-chunk: dq' = dA K'.
        score_grad(c0, L, hh);
        causal_nn(L, K, w.da.data(), w.kp.data(), K, w.dx.data(), K, false);
        // Inter-chunk: dq' += dN Sᵀ + dd z.
        gemm(L, K, V, w.dn.data(), V, int64_t(1), w.St.data(), K, w.dx.data(), K, true);
        for (int64_t i = 0; i < L; ++i) {
          const A ddi = p.normalize ? dd[(c0 + i) * G + hh] : A(0);
          A* __restrict dq = &w.dx[i * K];
          const A* __restrict f = &w.dphi_q[i * K];
          for (int64_t k = 0; k < K; ++k) dq[k] = f[k] * (dq[k] + ddi * z[k]);
          store_row(dq, K, at<T>(p.dq, seq.b, t0 + i, h));
        }
      }
      // State update: S += K'ᵀ V, z += Σ k'.
      gemm(K, V, L, w.kp.data(), int64_t(1), K, w.v.data(), V, S, V, true);
      if (p.normalize)
        for (int64_t i = 0; i < L; ++i)
          for (int64_t k = 0; k < K; ++k) z[k] += w.kp[i * K + k];
    }
  }

  // Pass 2, chunk c, from the gradient in dS, dz (at the chunk end): dk, dv; leaves dS̃, dz̃ at the
  // chunk start in dS, dz.
  void reverse_chunk(int64_t c) {
    const int64_t K = d.K, V = d.V, G = d.G;
    {
      const int64_t c0 = c * C, L = std::min(C, seq.len - c0), t0 = seq.t0 + c0;
      load_kv(t0, L, true, true);

      // Inter-chunk: dk' = V dS̃ᵀ + dz̃, dv = K' dS̃ (dS̃, dz̃ from the chunks after this one).
      transpose(dS, K, V, w.St.data());
      gemm(L, K, V, w.v.data(), V, int64_t(1), w.St.data(), K, w.dx.data(), K, false);
      if (p.normalize)
        for (int64_t i = 0; i < L; ++i)
          for (int64_t k = 0; k < K; ++k) w.dx[i * K + k] += dz[k];
      gemm(L, V, K, w.kp.data(), K, int64_t(1), dS, V, w.dv.data(), V, false);

      for (int64_t hh = 0; hh < G; ++hh) {
        const int64_t h = g * G + hh;
        load_q_do(t0, L, h, false);
        if (p.normalize)
          for (int64_t i = 0; i < L; ++i) {
            const A inv = A(1) / den[(c0 + i) * G + hh];
            for (int64_t j = 0; j < V; ++j) w.dn[i * V + j] *= inv;
          }

        // Intra-chunk: dk' += dAᵀ Q', dv += Aᵀ dN.
        causal_scores(L, K, w.qp.data(), w.kt.data(), w.a.data());
        score_grad(c0, L, hh);
        causal_tn(L, K, w.da.data(), w.qp.data(), K, w.dx.data(), K, true);
        causal_tn(L, V, w.a.data(), w.dn.data(), V, w.dv.data(), V, true);

        // State gradient: dS̃ += Q'ᵀ dN, dz̃ += Σ_t dd_t q'_t.
        gemm(K, V, L, w.qp.data(), int64_t(1), K, w.dn.data(), V, dS, V, true);
        if (p.normalize)
          for (int64_t i = 0; i < L; ++i) {
            const A ddi = dd[(c0 + i) * G + hh];
            for (int64_t k = 0; k < K; ++k) dz[k] += ddi * w.qp[i * K + k];
          }
      }

      for (int64_t i = 0; i < L; ++i) {
        A* __restrict dk = &w.dx[i * K];
        for (int64_t k = 0; k < K; ++k) dk[k] *= w.dphi_k[i * K + k];
        store_row(dk, K, at<T>(p.dk, seq.b, t0 + i, g));
        store_row(&w.dv[i * V], V, at<T>(p.dv, seq.b, t0 + i, g));
      }
    }
  }
};

}  // namespace

Status chunk_bwd(const LinearAttnBwdParams& p) {
  return dispatch_dtype(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    using A = acc_t<T>;
    const Dims d = dims_of(p);
    const int64_t C = chunk_of(p), K = d.K, KV = d.K * d.V, block = KV + K;
    const std::vector<Segment> plan = plan_segments(p, d, C);
    const int64_t units = static_cast<int64_t>(plan.size()), items = d.N * d.Hkv;
    const std::vector<std::vector<int64_t>> groups = lockstep_groups(p, d, plan);

    // Per-token den and dd of every item (normalize only): item i at offset[i].
    std::vector<int64_t> offset(items + 1, 0);
    for (int64_t i = 0; i < items; ++i)
      offset[i + 1] = offset[i] + (p.normalize ? sequence(p, i / d.Hkv).len * d.G : 0);
    std::vector<A> den(offset[items]), dd(offset[items]);
    auto work = [&](BwdScratch<A>& w, int64_t u, A* state) {
      const Segment& sg = plan[u];
      return Work<T>{p, d, w, sg, sequence(p, sg.item / d.Hkv), sg.item % d.Hkv, C,
                     static_cast<A>(p.scale), static_cast<A>(p.eps), den.data() + offset[sg.item],
                     dd.data() + offset[sg.item], state, state + KV, state, state + KV};
    };

    // States at segment starts; ends[u] will hold dS̃, dz̃ at the end of segment u (not last).
    const std::vector<A> start = segment_starts<T>(p, d, C, plan);
    std::vector<A> ends(start.empty() ? 0 : units * block, A(0));

    // Runs body(us, members) for every lockstep group on the executor: the group's segments us,
    // each with its Work on a slice of one state buffer, set up by init(u, member). The segments of
    // a group share their chunks [chunk_begin, chunk_end).
    auto over_groups = [&](auto&& init, auto&& body) {
      parallel_for(p.executor, static_cast<int64_t>(groups.size()), 1, [&](int64_t begin, int64_t end) {
        BwdScratch<A> w(d, C);
        std::vector<A> state;
        std::vector<Work<T>> members;
        for (int64_t gi = begin; gi < end; ++gi) {
          const std::vector<int64_t>& us = groups[gi];
          const int64_t m = static_cast<int64_t>(us.size());
          state.assign(m * block, A(0));
          members.clear();
          for (int64_t j = 0; j < m; ++j) {
            members.push_back(work(w, us[j], &state[j * block]));
            init(us[j], members[j]);
          }
          body(us, members);
        }
      });
    };

    // Pass 1 of every segment; segment u's share of the state gradient goes to ends[u - 1]. The
    // segments of a group (same sequence and chunks, several kv heads) advance chunk by chunk
    // together so that their rows, adjacent in memory, are read together.
    over_groups([&](int64_t u, Work<T>& m) { load_segment_start(p, d, plan, start, u, m.S, m.z); },
                [&](const std::vector<int64_t>& us, std::vector<Work<T>>& members) {
                  for (int64_t c = plan[us[0]].chunk_begin; c < plan[us[0]].chunk_end; ++c)
                    for (size_t j = 0; j < us.size(); ++j) {
                      const int64_t u = us[j];
                      members[j].forward_chunk(c, ends.empty() || plan[u].first ? nullptr : &ends[(u - 1) * block]);
                    }
                });

    // Suffix sums: dS̃ at the end of segment u = d_final + the shares of the segments after it.
    std::vector<A> fin(block);
    for (int64_t u = units - 1; u >= 0 && !ends.empty(); --u) {
      if (plan[u].last) continue;
      const A* next = &ends[(u + 1) * block];
      if (plan[u + 1].last) {
        load_state(p.d_final_S, plan[u].item, KV, fin.data());
        load_state(p.normalize ? p.d_final_z : nullptr, plan[u].item, K, fin.data() + KV);
        next = fin.data();
      }
      for (int64_t i = 0; i < block; ++i) ends[u * block + i] += next[i];
    }

    // Pass 2 of every segment from the gradient at its end; the first one writes d_initial.
    over_groups(
        [&](int64_t u, Work<T>& m) {
          const Segment& sg = plan[u];
          if (sg.last) {
            load_state(p.d_final_S, sg.item, KV, m.dS);
            if (p.normalize) load_state(p.d_final_z, sg.item, K, m.dz);
          } else {
            std::copy(&ends[u * block], &ends[(u + 1) * block], m.dS);
          }
        },
        [&](const std::vector<int64_t>& us, std::vector<Work<T>>& members) {
          for (int64_t c = plan[us[0]].chunk_end - 1; c >= plan[us[0]].chunk_begin; --c)
            for (Work<T>& m : members) m.reverse_chunk(c);
          for (size_t j = 0; j < us.size(); ++j)
            if (plan[us[j]].first) {
              store_state(members[j].dS, plan[us[j]].item, KV, p.d_initial_S);
              if (p.normalize) store_state(members[j].dz, plan[us[j]].item, K, p.d_initial_z);
            }
        });
    return Status::kSuccess;
  });
}

}  // namespace attnrnn::cpu
