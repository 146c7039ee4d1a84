// Links attnrnn::attnrnn only (no torch): one chunkwise forward on raw float arrays, checked
// against the recurrence written out here.
#include <attnrnn/attnrnn.h>

#include <cmath>
#include <cstdio>
#include <vector>

int main() {
  const int64_t T = 37, K = 5, V = 3;
  std::vector<float> q(T * K), k(T * K), v(T * V), o(T * V);
  for (int64_t i = 0; i < T * K; ++i) {
    q[i] = std::sin(0.3 * i);
    k[i] = std::cos(0.7 * i);
  }
  for (int64_t i = 0; i < T * V; ++i) v[i] = std::sin(1.1 * i + 0.5);

  attnrnn::LinearAttnFwdParams p;
  p.dtype = attnrnn::DType::kFloat32;
  p.batch = 1;
  p.seqlen = T;
  p.num_heads = p.num_kv_heads = 1;
  p.head_dim_k = K;
  p.head_dim_v = V;
  p.q = {q.data(), T * K, K, K};
  p.k = {k.data(), T * K, K, K};
  p.v = {v.data(), T * V, V, V};
  p.o = {o.data(), T * V, V, V};
  p.scale = 0.5;
  p.chunk_size = 16;
  const attnrnn::Status status = attnrnn::chunk_linear_attn_fwd(p);
  if (status != attnrnn::Status::kSuccess) {
    std::printf("chunk_linear_attn_fwd failed: %s: %s\n", attnrnn::status_string(status),
                attnrnn::last_error_message());
    return 1;
  }
  std::vector<double> S(K * V, 0.0);
  double max_err = 0;
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t a = 0; a < K; ++a)
      for (int64_t b = 0; b < V; ++b) S[a * V + b] += double(k[t * K + a]) * v[t * V + b];
    for (int64_t b = 0; b < V; ++b) {
      double ref = 0;
      for (int64_t a = 0; a < K; ++a) ref += 0.5 * q[t * K + a] * S[a * V + b];
      max_err = std::fmax(max_err, std::fabs(ref - o[t * V + b]));
    }
  }
  std::printf("consumer_core: max |o - ref| = %.3g\n", max_err);
  return max_err < 1e-4 ? 0 : 1;
}
