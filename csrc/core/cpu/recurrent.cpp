// Token-by-token (recurrent) forward and backward on the CPU: O(K·V) work per token and head.
//
// One work item is one (sequence n, kv head g); the items run in parallel, each in a fixed order.
//   forward:  S_t = S_{t-1} + k'_tᵀ v_t,  z_t = z_{t-1} + k'_t,  o_t = q'_t S_t / (q'_t·z_t + eps)
//   backward: pass 1 runs forward again for dq' = dn S_tᵀ + dd z_t, storing den and dd per token;
//             pass 2 runs in reverse, accumulating dS̃ += q'ᵀ dn, dz̃ += dd q' before
//             dk' = dS̃ v + dz̃ and dv = k' dS̃.
#include "common.h"
#include "gemm.h"

namespace attnrnn::cpu {

namespace {

// Per-thread buffers (elements).
template <class A>
struct RecScratch {
  std::vector<A> S, dS;           // K x V  state and its reverse-accumulated gradient
  std::vector<A> z, dz;           // K
  std::vector<A> kp, dphi_k, dk;  // K  k', phi'(k), dk'
  std::vector<A> qp, dphi_q, dq;  // K  q', scale*phi'(q), dq'
  std::vector<A> v, dv, o, dn;    // V
  std::vector<A> den, dd;         // len x G  per token and query head of the group (backward)

  explicit RecScratch(const Dims& d)
      : S(d.K * d.V), dS(d.K * d.V), z(d.K), dz(d.K), kp(d.K), dphi_k(d.K), dk(d.K), qp(d.K),
        dphi_q(d.K), dq(d.K), v(d.V), dv(d.V), o(d.V), dn(d.V) {}
};

// o = q' S (V), returns q'·z + eps (or 1 without normalization).
template <class A>
A read_out(const A* __restrict qp, const A* __restrict S, const A* __restrict z, int64_t K, int64_t V,
           bool normalize, A eps, A* __restrict o) {
  std::fill(o, o + V, A(0));
  for (int64_t k = 0; k < K; ++k) {
    const A qk = qp[k];
    const A* __restrict row = S + k * V;
    for (int64_t j = 0; j < V; ++j) o[j] += qk * row[j];
  }
  if (!normalize) return A(1);
  return dot(qp, z, K) + eps;
}

// S += k'ᵀ v, z += k'.
template <class A>
void rank1_update(const A* __restrict kp, const A* __restrict v, int64_t K, int64_t V, bool normalize,
                  A* __restrict S, A* __restrict z) {
  for (int64_t k = 0; k < K; ++k) {
    const A kk = kp[k];
    A* __restrict row = S + k * V;
    for (int64_t j = 0; j < V; ++j) row[j] += kk * v[j];
  }
  if (normalize)
    for (int64_t k = 0; k < K; ++k) z[k] += kp[k];
}

template <class T>
void forward_item(const LinearAttnFwdParams& p, const Dims& d, int64_t item, RecScratch<acc_t<T>>& w) {
  using A = acc_t<T>;
  const int64_t n = item / d.Hkv, g = item % d.Hkv, K = d.K, V = d.V;
  const Seq seq = sequence(p, n);
  const A scale = static_cast<A>(p.scale), eps = static_cast<A>(p.eps);
  load_state(p.initial_S, item, K * V, w.S.data());
  if (p.normalize) load_state(p.initial_z, item, K, w.z.data());

  for (int64_t t = seq.t0; t < seq.t0 + seq.len; ++t) {
    load_phi(p.feature_map, at<T>(p.k, seq.b, t, g), K, A(1), w.kp.data(), static_cast<A*>(nullptr));
    load_row(at<T>(p.v, seq.b, t, g), V, w.v.data());
    rank1_update(w.kp.data(), w.v.data(), K, V, p.normalize, w.S.data(), w.z.data());
    for (int64_t h = g * d.G; h < (g + 1) * d.G; ++h) {
      load_phi(p.feature_map, at<T>(p.q, seq.b, t, h), K, scale, w.qp.data(), static_cast<A*>(nullptr));
      const A inv = A(1) / read_out(w.qp.data(), w.S.data(), w.z.data(), K, V, p.normalize, eps, w.o.data());
      for (int64_t j = 0; j < V; ++j) w.o[j] *= inv;
      store_row(w.o.data(), V, at<T>(p.o, seq.b, t, h));
    }
  }
  store_state(w.S.data(), item, K * V, p.final_S);
  if (p.normalize) store_state(w.z.data(), item, K, p.final_z);
}

template <class T>
void backward_item(const LinearAttnBwdParams& p, const Dims& d, int64_t item, RecScratch<acc_t<T>>& w) {
  using A = acc_t<T>;
  const int64_t n = item / d.Hkv, g = item % d.Hkv, K = d.K, V = d.V, G = d.G;
  const Seq seq = sequence(p, n);
  const A scale = static_cast<A>(p.scale), eps = static_cast<A>(p.eps);
  w.den.resize(seq.len * G);
  w.dd.resize(seq.len * G);

  // Pass 1 (forward): n_t, den_t, dd_t and dq'_t = dn_t S_tᵀ + dd_t z_t.
  load_state(p.initial_S, item, K * V, w.S.data());
  if (p.normalize) load_state(p.initial_z, item, K, w.z.data());
  for (int64_t i = 0; i < seq.len; ++i) {
    const int64_t t = seq.t0 + i;
    load_phi(p.feature_map, at<T>(p.k, seq.b, t, g), K, A(1), w.kp.data(), static_cast<A*>(nullptr));
    load_row(at<T>(p.v, seq.b, t, g), V, w.v.data());
    rank1_update(w.kp.data(), w.v.data(), K, V, p.normalize, w.S.data(), w.z.data());
    for (int64_t hh = 0; hh < G; ++hh) {
      const int64_t h = g * G + hh;
      load_phi(p.feature_map, at<T>(p.q, seq.b, t, h), K, scale, w.qp.data(), w.dphi_q.data());
      load_row(at<T>(p.dout, seq.b, t, h), V, w.dn.data());
      A den = A(1), dd = A(0);
      if (p.normalize) {
        den = read_out(w.qp.data(), w.S.data(), w.z.data(), K, V, true, eps, w.o.data());
        const A don = dot(w.dn.data(), w.o.data(), V);
        dd = -don / (den * den);
        for (int64_t j = 0; j < V; ++j) w.dn[j] /= den;
      }
      w.den[i * G + hh] = den;
      w.dd[i * G + hh] = dd;
      for (int64_t k = 0; k < K; ++k) {
        const A acc = dot(w.dn.data(), &w.S[k * V], V);
        w.dq[k] = w.dphi_q[k] * (acc + (p.normalize ? dd * w.z[k] : A(0)));
      }
      store_row(w.dq.data(), K, at<T>(p.dq, seq.b, t, h));
    }
  }

  // Pass 2 (reverse): dS̃_s = d_final_S + Σ_{t>=s} Σ_h q'_tᵀ dn_t, then dk'_s and dv_s.
  load_state(p.d_final_S, item, K * V, w.dS.data());
  if (p.normalize) load_state(p.d_final_z, item, K, w.dz.data());
  for (int64_t i = seq.len - 1; i >= 0; --i) {
    const int64_t t = seq.t0 + i;
    for (int64_t hh = 0; hh < G; ++hh) {
      const int64_t h = g * G + hh;
      load_phi(p.feature_map, at<T>(p.q, seq.b, t, h), K, scale, w.qp.data(), static_cast<A*>(nullptr));
      load_row(at<T>(p.dout, seq.b, t, h), V, w.dn.data());
      const A inv = A(1) / w.den[i * G + hh], dd = w.dd[i * G + hh];
      for (int64_t j = 0; j < V; ++j) w.dn[j] *= inv;
      rank1_update(w.qp.data(), w.dn.data(), K, V, false, w.dS.data(), w.dz.data());
      if (p.normalize)
        for (int64_t k = 0; k < K; ++k) w.dz[k] += dd * w.qp[k];
    }
    load_phi(p.feature_map, at<T>(p.k, seq.b, t, g), K, A(1), w.kp.data(), w.dphi_k.data());
    load_row(at<T>(p.v, seq.b, t, g), V, w.v.data());
    std::fill(w.dv.begin(), w.dv.end(), A(0));
    for (int64_t k = 0; k < K; ++k) {
      const A* __restrict row = &w.dS[k * V];
      const A kk = w.kp[k];
      for (int64_t j = 0; j < V; ++j) w.dv[j] += kk * row[j];
      w.dk[k] = w.dphi_k[k] * (dot(row, w.v.data(), V) + (p.normalize ? w.dz[k] : A(0)));
    }
    store_row(w.dk.data(), K, at<T>(p.dk, seq.b, t, g));
    store_row(w.dv.data(), V, at<T>(p.dv, seq.b, t, g));
  }
  store_state(w.dS.data(), item, K * V, p.d_initial_S);
  if (p.normalize) store_state(w.dz.data(), item, K, p.d_initial_z);
}

}  // namespace

Status recurrent_fwd(const LinearAttnFwdParams& p) {
  return dispatch_dtype(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    const Dims d = dims_of(p);
    parallel_for(p.executor, d.N * d.Hkv, 1, [&](int64_t begin, int64_t end) {
      RecScratch<acc_t<T>> w(d);
      for (int64_t item = begin; item < end; ++item) forward_item<T>(p, d, item, w);
    });
    return Status::kSuccess;
  });
}

Status recurrent_bwd(const LinearAttnBwdParams& p) {
  return dispatch_dtype(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    const Dims d = dims_of(p);
    parallel_for(p.executor, d.N * d.Hkv, 1, [&](int64_t begin, int64_t end) {
      RecScratch<acc_t<T>> w(d);
      for (int64_t item = begin; item < end; ++item) backward_item<T>(p, d, item, w);
    });
    return Status::kSuccess;
  });
}

}  // namespace attnrnn::cpu
