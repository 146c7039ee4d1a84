// Segments: with few (sequence, kv head) items, the chunked kernels also cut each sequence into
// runs of whole chunks so that all threads get work. The state at each segment start comes from a
// scan: the increment Σ K'ᵀ V of every segment (in parallel), then a prefix sum per item.
#pragma once

#include "common.h"
#include "gemm.h"

namespace attnrnn::cpu {

// A run of whole chunks [chunk_begin, chunk_end) of one (sequence, kv head) item. With fewer
// items than kMinItems, sequences are cut into several segments so that all threads get work: the
// plan depends only on the problem, never on the thread count, so results stay reproducible.
struct Segment {
  int64_t item, chunk_begin, chunk_end;
  bool first, last;  // first / last segment of its item
};

constexpr int64_t kMinItems = 8;
constexpr int64_t kMinChunksPerSegment = 4;

inline std::vector<Segment> plan_segments(const LinearAttnFwdParams& p, const Dims& d, int64_t C) {
  const int64_t items = d.N * d.Hkv;
  std::vector<Segment> plan;
  plan.reserve(items);
  for (int64_t item = 0; item < items; ++item) {
    const int64_t chunks = (sequence(p, item / d.Hkv).len + C - 1) / C;
    int64_t parts = 1;
    if (items < kMinItems)
      parts = std::max<int64_t>(1, std::min((kMinItems + items - 1) / items, chunks / kMinChunksPerSegment));
    for (int64_t j = 0; j < parts; ++j)
      plan.push_back({item, chunks * j / parts, chunks * (j + 1) / parts, j == 0, j == parts - 1});
  }
  return plan;
}

// Lockstep groups: plan entries of the same sequence and chunk range whose kv heads are adjacent,
// processed chunk by chunk together so that the rows of all their heads (adjacent in memory in the
// [B, T, H, D] layout) are read together: the strided per-head walk is several times slower. The
// grouping changes only the order in which independent segments interleave, never their
// arithmetic, so it may depend on the thread count: the largest head groups that still give every
// thread work.
inline std::vector<std::vector<int64_t>> lockstep_groups(const LinearAttnFwdParams& p, const Dims& d,
                                                         const std::vector<Segment>& plan) {
  const int64_t units = static_cast<int64_t>(plan.size()), threads = executor_threads(p.executor);
  int64_t hg = 1;  // kv heads per group
  if (threads > 0)
    for (int64_t h = d.Hkv; h > 1; --h) {
      const int64_t groups = units / d.Hkv * ((d.Hkv + h - 1) / h);
      if (groups >= threads && (groups % threads == 0 || groups >= 4 * threads)) {
        hg = h;
        break;
      }
    }
  // plan is item-major (item = n * Hkv + g) and every kv head of a sequence has the same segments.
  std::vector<std::vector<int64_t>> groups;
  for (int64_t u = 0; u < units;) {
    const int64_t n = plan[u].item / d.Hkv, parts = [&] {
      int64_t k = 0;
      while (u + k < units && plan[u + k].item == plan[u].item) ++k;
      return k;
    }();
    for (int64_t j = 0; j < parts; ++j)
      for (int64_t g0 = 0; g0 < d.Hkv; g0 += hg) {
        groups.emplace_back();
        for (int64_t g = g0; g < std::min(d.Hkv, g0 + hg); ++g) groups.back().push_back(u + g * parts + j);
      }
    u += d.Hkv * parts;
    (void)n;
  }
  return groups;
}

// Phases 1 and 2 of the scan: the state (S then z, `block` = K·V + K elements) at the start of
// every segment that is not the first of its item, at start[u * block]; empty when no item is cut.
template <class T>
std::vector<acc_t<T>> segment_starts(const LinearAttnFwdParams& p, const Dims& d, int64_t C,
                                     const std::vector<Segment>& plan) {
  using A = acc_t<T>;
  const int64_t K = d.K, V = d.V, KV = K * V, block = KV + K, units = static_cast<int64_t>(plan.size());
  std::vector<A> start;
  if (units == d.N * d.Hkv) return start;
  start.assign(units * block, A(0));

  // Phase 1: increment of segment u into start[u + 1]: Σ K'ᵀ V and Σ k' over its chunks.
  parallel_for(p.executor, units, 1, [&](int64_t begin, int64_t end) {
    std::vector<A> kp(C * K), v(C * V);
    for (int64_t u = begin; u < end; ++u) {
      const Segment& sg = plan[u];
      if (sg.last) continue;
      const int64_t g = sg.item % d.Hkv;
      const Seq seq = sequence(p, sg.item / d.Hkv);
      A* out = &start[(u + 1) * block];
      for (int64_t c0 = sg.chunk_begin * C; c0 < std::min(seq.len, sg.chunk_end * C); c0 += C) {
        const int64_t L = std::min(C, seq.len - c0), t0 = seq.t0 + c0;
        for (int64_t i = 0; i < L; ++i) {
          load_phi(p.feature_map, at<T>(p.k, seq.b, t0 + i, g), K, A(1), &kp[i * K],
                   static_cast<A*>(nullptr));
          load_row(at<T>(p.v, seq.b, t0 + i, g), V, &v[i * V]);
          for (int64_t k = 0; k < K; ++k) out[KV + k] += kp[i * K + k];
        }
        gemm(K, V, L, kp.data(), int64_t(1), K, v.data(), V, out, V, true);
      }
    }
  });

  // Phase 2: prefix sums, starting from the initial state of the item.
  std::vector<A> init(block);
  for (int64_t u = 0; u < units; ++u) {
    if (plan[u].first) continue;
    const A* prev = &start[(u - 1) * block];
    if (plan[u - 1].first) {
      load_state(p.initial_S, plan[u].item, KV, init.data());
      load_state(p.normalize ? p.initial_z : nullptr, plan[u].item, K, init.data() + KV);
      prev = init.data();
    }
    A* s = &start[u * block];
    for (int64_t i = 0; i < block; ++i) s[i] += prev[i];
  }
  return start;
}

// Loads the state at the start of segment u: the item's initial state or start[u].
template <class A>
void load_segment_start(const LinearAttnFwdParams& p, const Dims& d, const std::vector<Segment>& plan,
                        const std::vector<A>& start, int64_t u, A* S, A* z) {
  const int64_t KV = d.K * d.V, block = KV + d.K;
  if (plan[u].first) {
    load_state(p.initial_S, plan[u].item, KV, S);
    if (p.normalize) load_state(p.initial_z, plan[u].item, d.K, z);
  } else {
    std::copy(&start[u * block], &start[u * block] + KV, S);
    std::copy(&start[u * block] + KV, &start[(u + 1) * block], z);
  }
}

}  // namespace attnrnn::cpu
