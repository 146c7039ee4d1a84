// Timing of the CPU kernels (not a test). Usage: bench_cpu [chunk_size] [threads]
// fp32, B=2, T=4096, H=4, K=V=64: chunk forward, backward, forward+backward, recurrent forward;
// decode step with B=8, H=32, K=V=128. Prints median (min) over repeats in milliseconds.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <vector>

#include "attnrnn/attnrnn.h"

namespace {

// Median and minimum over `reps` timed calls after one warm-up call, in milliseconds.
struct Timing {
  double median, min;
};

Timing time_ms(const std::function<void()>& f, int reps) {
  f();
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    const auto a = std::chrono::steady_clock::now();
    f();
    t.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - a).count());
  }
  std::sort(t.begin(), t.end());
  return {t[t.size() / 2], t.front()};
}

std::vector<float> random(size_t n, float lo, float hi, std::mt19937& rng) {
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<float> x(n);
  for (float& e : x) e = u(rng);
  return x;
}

void check(attnrnn::Status s) {
  if (s != attnrnn::Status::kSuccess) {
    std::fprintf(stderr, "error: %s\n", attnrnn::last_error_message());
    std::exit(1);
  }
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t chunk = argc > 1 ? std::atoll(argv[1]) : 0;
  const int threads = argc > 2 ? std::atoi(argv[2]) : 0;
  std::mt19937 rng(0);
  const int64_t B = 2, T = 4096, H = 4, K = 64, V = 64;
  auto q = random(B * T * H * K, 0.f, 1.f, rng), k = random(B * T * H * K, 0.f, 1.f, rng);
  auto v = random(B * T * H * V, -1.f, 1.f, rng), dout = random(B * T * H * V, -1.f, 1.f, rng);
  std::vector<float> o(B * T * H * V), dq(q.size()), dk(k.size()), dv(v.size());
  std::vector<float> S(B * H * K * V), z(B * H * K);

  for (bool normalize : {false, true}) {
    attnrnn::LinearAttnBwdParams p;
    p.dtype = attnrnn::DType::kFloat32;
    p.batch = B, p.seqlen = T, p.num_heads = H, p.num_kv_heads = H, p.head_dim_k = K, p.head_dim_v = V;
    p.q = {q.data(), T * H * K, H * K, K};
    p.k = {k.data(), T * H * K, H * K, K};
    p.v = {v.data(), T * H * V, H * V, V};
    p.dout = {dout.data(), T * H * V, H * V, V};
    p.o = {o.data(), T * H * V, H * V, V};
    p.dq = {dq.data(), T * H * K, H * K, K};
    p.dk = {dk.data(), T * H * K, H * K, K};
    p.dv = {dv.data(), T * H * V, H * V, V};
    p.final_S = S.data();
    if (normalize) p.final_z = z.data();
    p.scale = 0.125, p.normalize = normalize, p.chunk_size = chunk;
    p.executor.num_threads = threads;
    const Timing fwd = time_ms([&] { check(attnrnn::chunk_linear_attn_fwd(p)); }, 21);
    const Timing bwd = time_ms([&] { check(attnrnn::chunk_linear_attn_bwd(p)); }, 11);
    const Timing fb = time_ms([&] {
      check(attnrnn::chunk_linear_attn_fwd(p));
      check(attnrnn::chunk_linear_attn_bwd(p));
    }, 11);
    const Timing rec = time_ms([&] { check(attnrnn::recurrent_linear_attn_fwd(p)); }, 5);
    std::printf("fp32 B=%lld T=%lld H=%lld K=V=%lld normalize=%d chunk=%lld: chunk fwd %.2f (%.2f) ms, "
                "chunk bwd %.2f (%.2f) ms, chunk fwd+bwd %.2f (%.2f) ms, recurrent fwd %.2f (%.2f) ms\n",
                (long long)B, (long long)T, (long long)H, (long long)K, normalize, (long long)chunk, fwd.median,
                fwd.min, bwd.median, bwd.min, fb.median, fb.min, rec.median, rec.min);
  }

  {  // One long sequence and one head: the forward is split into segments to use the threads.
    const int64_t T1 = 32768;
    auto q1 = random(T1 * K, 0.f, 1.f, rng), k1 = random(T1 * K, 0.f, 1.f, rng), v1 = random(T1 * V, -1.f, 1.f, rng);
    std::vector<float> o1(T1 * V);
    attnrnn::LinearAttnFwdParams p;
    p.batch = 1, p.seqlen = T1, p.num_heads = 1, p.num_kv_heads = 1, p.head_dim_k = K, p.head_dim_v = V;
    p.q = {q1.data(), T1 * K, K, K};
    p.k = {k1.data(), T1 * K, K, K};
    p.v = {v1.data(), T1 * V, V, V};
    p.o = {o1.data(), T1 * V, V, V};
    p.scale = 0.125, p.normalize = true, p.chunk_size = chunk;
    p.executor.num_threads = threads;
    const Timing fwd = time_ms([&] { check(attnrnn::chunk_linear_attn_fwd(p)); }, 11);
    std::printf("fp32 B=1 T=%lld H=1 K=V=%lld normalize=1 chunk=%lld: chunk fwd %.2f (%.2f) ms\n",
                (long long)T1, (long long)K, (long long)chunk, fwd.median, fwd.min);
  }

  const int64_t Bs = 8, Hs = 32, D = 128;
  auto sq = random(Bs * Hs * D, 0.f, 1.f, rng), sk = random(Bs * Hs * D, 0.f, 1.f, rng);
  auto sv = random(Bs * Hs * D, -1.f, 1.f, rng);
  std::vector<float> so(Bs * Hs * D), pool(Bs * Hs * D * D, 0.f), pz(Bs * Hs * D, 1.f);
  for (bool normalize : {false, true}) {
    attnrnn::LinearAttnStepParams sp;
    sp.dtype = attnrnn::DType::kFloat32;
    sp.batch = Bs, sp.num_heads = Hs, sp.num_kv_heads = Hs, sp.head_dim_k = D, sp.head_dim_v = D;
    sp.q = {sq.data(), Hs * D, 0, D};
    sp.k = {sk.data(), Hs * D, 0, D};
    sp.v = {sv.data(), Hs * D, 0, D};
    sp.o = {so.data(), Hs * D, 0, D};
    sp.S = pool.data();
    sp.z = normalize ? pz.data() : nullptr;
    sp.pool_size = Bs;
    sp.scale = 0.088, sp.normalize = normalize;
    sp.executor.num_threads = threads;
    const Timing t = time_ms([&] { check(attnrnn::linear_attn_step(sp)); }, 51);
    std::printf("fp32 step B=%lld H=%lld K=V=%lld normalize=%d: %.3f (%.3f) ms\n", (long long)Bs, (long long)Hs,
                (long long)D, normalize, t.median, t.min);
  }
  return 0;
}
