// One decode token per sequence over a KV cache, split over the cache length (flash-decoding).
//
// Phases:
//   0. check:   every cache_seqlens[b] in range (before anything is written)
//   1. append:  k_new, v_new into row cache_seqlens[b] of the caches (when given)
//   2. partial: items (b, kv head, split of split_size keys), in parallel: the G query heads of the
//               kv head, stacked as G rows, run the online-softmax recurrence over the split's
//               key blocks -> partial (m, z, y[Dv]) per (b, head, split)
//   3. combine: per (b, head): M = max m_s, z = Σ z_s e^{m_s - M}, o = Σ y_s e^{m_s - M} / z
// The split plan depends only on the problem (lengths, B, Hkv), never on the thread count, so the
// result is bitwise reproducible; one long sequence still gives many items.
#include "softmax_common.h"

namespace attnrnn::cpu {

namespace {

using sm::kBlockK;

// Keys per split: the caller's, or enough splits that B * Hkv * splits >= kTargetItems, with at
// least kMinSplit keys per split.
constexpr int64_t kTargetItems = 64;
constexpr int64_t kMinSplit = 256;

int64_t split_size_of(const SoftmaxAttnStepParams& p, int64_t longest) {
  if (p.split_size > 0) return p.split_size;
  const int64_t rows = std::max<int64_t>(1, p.batch * p.num_kv_heads);
  const int64_t splits = std::max<int64_t>(1, (kTargetItems + rows - 1) / rows);
  const int64_t per = (longest + splits - 1) / splits;
  return std::max(kMinSplit, (per + kBlockK - 1) / kBlockK * kBlockK);
}

template <class A>
struct StepScratch {
  std::vector<A> q;   // G x D   scaled queries of the group
  std::vector<A> kb;  // Bk x D
  std::vector<A> kt;  // D x Bk
  std::vector<A> vb;  // Bk x Dv
  std::vector<A> s;   // G x Bk
  std::vector<A> y;   // G x Dv
  std::vector<A> pv;  // G x Dv   P V of one key block
  std::vector<A> m, z;  // G

  StepScratch(int64_t G, int64_t D, int64_t Dv)
      : q(G * D), kb(kBlockK * D), kt(D * kBlockK), vb(kBlockK * Dv), s(G * kBlockK), y(G * Dv), pv(G * Dv), m(G), z(G) {}
};

// The cache as [B, Lmax, Hkv, *] views for the shared block loads.
ConstView as_const(const MutView& v) { return ConstView{v.data, v.stride_b, v.stride_t, v.stride_h}; }

}  // namespace

Status softmax_step(const SoftmaxAttnStepParams& p) {
  const bool append = p.k_new.data != nullptr;
  // Phase 0: check the lengths before writing anything.
  int64_t longest = 0;
  for (int64_t b = 0; b < p.batch; ++b) {
    const int64_t len = p.cache_seqlens[b];
    if (len < 0 || len + (append ? 1 : 0) > p.max_seqlen)
      return fail(Status::kInvalidArgument,
                  "cache_seqlens[%lld] = %lld is out of range: must be in [0, %lld] (the cache holds %lld "
                  "positions%s)",
                  (long long)b, (long long)len, (long long)(p.max_seqlen - (append ? 1 : 0)),
                  (long long)p.max_seqlen, append ? " and k_new is written at cache_seqlens[b]" : "");
    longest = std::max(longest, len + (append ? 1 : 0));
  }
  return dispatch_dtype(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    using A = acc_t<T>;
    const int64_t B = p.batch, H = p.num_heads, Hkv = p.num_kv_heads, G = H / Hkv, D = p.head_dim,
                  Dv = p.head_dim_v;
    const ConstView kc = as_const(p.k_cache), vc = as_const(p.v_cache);

    // Phase 1: append the new token's key and value.
    if (append) {
      for (int64_t b = 0; b < B; ++b)
        for (int64_t g = 0; g < Hkv; ++g) {
          const int64_t t = p.cache_seqlens[b];
          std::copy_n(static_cast<const T*>(p.k_new.data) + b * p.k_new.stride_b + g * p.k_new.stride_h, D,
                      at<T>(p.k_cache, b, t, g));
          std::copy_n(static_cast<const T*>(p.v_new.data) + b * p.v_new.stride_b + g * p.v_new.stride_h, Dv,
                      at<T>(p.v_cache, b, t, g));
        }
    }

    // Phase 2: partial (m, z, y) per (b, head, split).
    const int64_t split = split_size_of(p, longest);
    const int64_t S = longest == 0 ? 1 : 1 + (longest - 1) / split;  // no overflow at split_size = INT64_MAX
    const int64_t stride = 2 + Dv;  // m, z, y[Dv]
    std::vector<A> part(static_cast<size_t>(B * H * S * stride));
    parallel_for(p.executor, B * Hkv * S, 1, [&](int64_t begin, int64_t end) {
      StepScratch<A> w(G, D, Dv);
      for (int64_t u = begin; u < end; ++u) {
        const int64_t b = u / (Hkv * S), g = u / S % Hkv, sp = u % S;
        const int64_t len = p.cache_seqlens[b] + (append ? 1 : 0);
        const int64_t j_begin = sp * split, j_end = std::min(len, j_begin + split);
        for (int64_t hh = 0; hh < G; ++hh) {
          const T* qr = static_cast<const T*>(p.q.data) + b * p.q.stride_b + (g * G + hh) * p.q.stride_h;
          const A scale = static_cast<A>(p.scale);
          for (int64_t c = 0; c < D; ++c) w.q[hh * D + c] = scale * static_cast<A>(to_float(qr[c]));
        }
        std::fill(w.m.begin(), w.m.end(), sm::neg_inf<A>());
        std::fill(w.z.begin(), w.z.end(), A(0));
        std::fill(w.y.begin(), w.y.end(), A(0));
        for (int64_t j0 = j_begin; j0 < j_end; j0 += kBlockK) {
          const int64_t L = std::min(kBlockK, j_end - j0);
          sm::load_rows<T>(kc, b, j0, g, L, D, A(1), w.kb.data());
          transpose(w.kb.data(), L, D, w.kt.data());
          sm::load_rows<T>(vc, b, j0, g, L, Dv, A(1), w.vb.data());
          gemm(G, L, D, w.q.data(), D, int64_t(1), w.kt.data(), L, w.s.data(), L, false);
          sm::online_softmax_block(w.s.data(), G, L, [&](int64_t) { return L; }, w.m.data(), w.z.data(),
                                   w.y.data(), Dv);
          gemm(G, Dv, L, w.s.data(), L, int64_t(1), w.vb.data(), Dv, w.pv.data(), Dv, false);
          for (int64_t e = 0; e < G * Dv; ++e) w.y[e] += w.pv[e];
        }
        for (int64_t hh = 0; hh < G; ++hh) {
          A* dst = &part[((b * H + g * G + hh) * S + sp) * stride];
          dst[0] = w.m[hh];
          dst[1] = w.z[hh];
          std::copy_n(&w.y[hh * Dv], Dv, dst + 2);
        }
      }
    });

    // Phase 3: combine the splits.
    parallel_for(p.executor, B * H, 8, [&](int64_t begin, int64_t end) {
      std::vector<A> o(Dv);
      for (int64_t u = begin; u < end; ++u) {
        const A* pr = &part[u * S * stride];
        A M = sm::neg_inf<A>();
        bool nan = false;  // NaN scores everywhere leave M at -inf and z NaN: not an empty row
        for (int64_t sp = 0; sp < S; ++sp) {
          M = std::max(M, pr[sp * stride]);
          nan = nan || std::isnan(pr[sp * stride + 1]);
        }
        std::fill(o.begin(), o.end(), nan ? std::numeric_limits<A>::quiet_NaN() : A(0));
        A z = A(0);
        if (!nan && M != sm::neg_inf<A>()) {
          for (int64_t sp = 0; sp < S; ++sp) {
            const A* e = pr + sp * stride;
            if (e[1] == A(0)) continue;
            const A f = std::exp(e[0] - M);
            z += f * e[1];
            for (int64_t c = 0; c < Dv; ++c) o[c] += f * e[2 + c];
          }
        }
        const A inv = nan ? A(1) : z > A(0) ? A(1) / z : A(0);
        for (int64_t c = 0; c < Dv; ++c) o[c] *= inv;
        const int64_t b = u / H, h = u % H;
        store_row(o.data(), Dv, static_cast<T*>(p.o.data) + b * p.o.stride_b + h * p.o.stride_h);
      }
    });
    return Status::kSuccess;
  });
}

}  // namespace attnrnn::cpu
