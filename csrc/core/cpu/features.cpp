// phi(q) and phi(k) into contiguous copies (linear_attn_features): what autograd saves for the
// chunk backward in place of q and k where the CUDA kernels would otherwise run the same pass
// twice (LinearAttnParams::phi_given). On the CPU it serves the op's callers and tests.
#include <vector>

#include "common.h"
#include "parallel.h"

namespace attnrnn::cpu {

namespace {

// phi of the rows of `in` [B, T, heads, K] into `out`, contiguous, row by row.
template <class T>
void phi_rows(const LinearAttnParams& p, const ConstView& in, int64_t heads, T* out) {
  using A = acc_t<T>;
  const int64_t K = p.head_dim_k, rows = p.batch * p.seqlen * heads;
  parallel_for(p.executor, rows, 64, [&](int64_t begin, int64_t end) {
    std::vector<A> row(K);
    for (int64_t r = begin; r < end; ++r) {
      const int64_t h = r % heads, t = r / heads % p.seqlen, b = r / heads / p.seqlen;
      load_phi(p.feature_map, at<T>(in, b, t, h), K, A(1), row.data(), static_cast<A*>(nullptr));
      store_row(row.data(), K, out + r * K);
    }
  });
}

}  // namespace

Status features(const LinearAttnParams& p, void* phi_q, void* phi_k) {
  return dispatch_dtype(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    phi_rows<T>(p, p.q, p.num_heads, static_cast<T*>(phi_q));
    phi_rows<T>(p, p.k, p.num_kv_heads, static_cast<T*>(phi_k));
    return Status::kSuccess;
  });
}

}  // namespace attnrnn::cpu
