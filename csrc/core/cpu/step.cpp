// One decode step on the CPU: per batch entry b and kv head g, with r the pool row of b,
//   S_r += k'ᵀ v,  z_r += k',  o_h = q'_h S_r / (q'_h·z_r + eps)  for the G query heads of g.
// The update and the read-out share one pass over the K rows of S_r (each row is read and written
// once). All state indices are validated before anything is written.
#include <algorithm>

#include "common.h"
#include "gemm.h"

namespace attnrnn::cpu {

namespace {

int64_t row_of(const LinearAttnStepParams& p, int64_t b) {
  if (p.state_indices == nullptr) return b;
  return p.state_indices_int64 ? static_cast<const int64_t*>(p.state_indices)[b]
                               : static_cast<const int32_t*>(p.state_indices)[b];
}

// Every index < pool_size, and no pool row used by two batch entries.
Status check_indices(const LinearAttnStepParams& p) {
  if (p.state_indices == nullptr) return Status::kSuccess;
  std::vector<std::pair<int64_t, int64_t>> used;  // (row, batch entry)
  used.reserve(p.batch);
  for (int64_t b = 0; b < p.batch; ++b) {
    const int64_t r = row_of(p, b);
    if (r >= p.pool_size)
      return fail(Status::kInvalidArgument,
                  "state_indices[%lld] = %lld is out of range [0, pool_size) with pool_size = %lld",
                  (long long)b, (long long)r, (long long)p.pool_size);
    if (r >= 0) used.emplace_back(r, b);
  }
  std::sort(used.begin(), used.end());
  for (size_t i = 1; i < used.size(); ++i) {
    if (used[i].first == used[i - 1].first)
      return fail(Status::kInvalidArgument,
                  "state_indices[%lld] and state_indices[%lld] are both %lld: each state row may be "
                  "used by one batch entry per step",
                  (long long)used[i - 1].second, (long long)used[i].second, (long long)used[i].first);
  }
  return Status::kSuccess;
}

template <class A>
struct StepScratch {
  std::vector<A> kp;  // K
  std::vector<A> v;   // V
  std::vector<A> qp;  // G x K  q' of the group's query heads
  std::vector<A> o;   // G x V

  StepScratch(int64_t G, int64_t K, int64_t V) : kp(K), v(V), qp(G * K), o(G * V) {}
};

template <class T>
void step_item(const LinearAttnStepParams& p, int64_t item, StepScratch<acc_t<T>>& w) {
  using A = acc_t<T>;
  const int64_t Hkv = p.num_kv_heads, G = p.num_heads / Hkv, K = p.head_dim_k, V = p.head_dim_v;
  const int64_t b = item / Hkv, g = item % Hkv, r = row_of(p, b);
  auto q_at = [&](int64_t h) {
    return static_cast<const T*>(p.q.data) + b * p.q.stride_b + h * p.q.stride_h;
  };
  auto o_at = [&](int64_t h) { return static_cast<T*>(p.o.data) + b * p.o.stride_b + h * p.o.stride_h; };

  if (r < 0) {  // padding entry: no state, zero output
    for (int64_t h = g * G; h < (g + 1) * G; ++h) std::fill(o_at(h), o_at(h) + V, from_float<T>(0.0f));
    return;
  }
  const A scale = static_cast<A>(p.scale), eps = static_cast<A>(p.eps);
  A* __restrict S = static_cast<A*>(p.S) + (r * Hkv + g) * K * V;
  load_phi(p.feature_map, static_cast<const T*>(p.k.data) + b * p.k.stride_b + g * p.k.stride_h, K, A(1),
           w.kp.data(), static_cast<A*>(nullptr));
  load_row(static_cast<const T*>(p.v.data) + b * p.v.stride_b + g * p.v.stride_h, V, w.v.data());
  for (int64_t hh = 0; hh < G; ++hh)
    load_phi(p.feature_map, q_at(g * G + hh), K, scale, &w.qp[hh * K], static_cast<A*>(nullptr));
  std::fill(w.o.begin(), w.o.end(), A(0));

  // Update and read-out in one pass over the rows of S: S[k,:] += k'[k] v; o_h += q'_h[k] S[k,:].
  const A* __restrict v = w.v.data();
  for (int64_t k = 0; k < K; ++k) {
    A* __restrict row = S + k * V;
    const A kk = w.kp[k];
    for (int64_t j = 0; j < V; ++j) row[j] += kk * v[j];
    for (int64_t hh = 0; hh < G; ++hh) {
      const A qk = w.qp[hh * K + k];
      A* __restrict o = &w.o[hh * V];
      for (int64_t j = 0; j < V; ++j) o[j] += qk * row[j];
    }
  }

  A* __restrict z = p.normalize ? static_cast<A*>(p.z) + (r * Hkv + g) * K : nullptr;
  if (p.normalize)
    for (int64_t k = 0; k < K; ++k) z[k] += w.kp[k];
  for (int64_t hh = 0; hh < G; ++hh) {
    A* __restrict o = &w.o[hh * V];
    if (p.normalize) {
      const A inv = A(1) / (dot(&w.qp[hh * K], z, K) + eps);
      for (int64_t j = 0; j < V; ++j) o[j] *= inv;
    }
    store_row(o, V, o_at(g * G + hh));
  }
}

}  // namespace

Status step(const LinearAttnStepParams& p) {
  const Status checked = check_indices(p);
  if (checked != Status::kSuccess) return checked;
  return dispatch_dtype(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    const int64_t G = p.num_heads / p.num_kv_heads;
    parallel_for(p.executor, p.batch * p.num_kv_heads, 4, [&](int64_t begin, int64_t end) {
      StepScratch<acc_t<T>> w(G, p.head_dim_k, p.head_dim_v);
      for (int64_t item = begin; item < end; ++item) step_item<T>(p, item, w);
    });
    return Status::kSuccess;
  });
}

}  // namespace attnrnn::cpu
