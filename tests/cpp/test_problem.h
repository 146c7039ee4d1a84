// One random linear-attention problem: inputs in the test dtype, a call of the library, and the
// float64 reference on the same (already rounded) inputs.
#pragma once

#include "test_common.h"

namespace test {

struct Case {
  DType dt = DType::kFloat32;
  int64_t B = 1, T = 1, H = 1, Hkv = 1, K = 4, V = 4;
  FeatureMap fm = FeatureMap::kIdentity;
  bool normalize = false;
  bool initial = false;        // initial state and d_final state given
  bool strided = false;        // non-contiguous q/k/v/o/dout/dq/dk/dv
  std::vector<int64_t> lens;   // varlen sequence lengths (B = 1, T = sum) when non-empty
  bool cu64 = false;
  int64_t chunk = 0;
  uint32_t seed = 1;
  double eps = 1e-6;

  std::string str() const {
    char buf[256];
    std::snprintf(buf, sizeof buf, "%s B=%lld T=%lld H=%lld Hkv=%lld K=%lld V=%lld %s norm=%d init=%d strided=%d varlen=%zu chunk=%lld",
                  dtype_name(dt), (long long)B, (long long)T, (long long)H, (long long)Hkv, (long long)K,
                  (long long)V, fm_name(fm), normalize, initial, strided, lens.size(), (long long)chunk);
    return buf;
  }
};

struct Results {
  vec o, Sf, zf;                // forward
  vec dq, dk, dv, dS0, dz0;     // backward
  std::vector<unsigned char> raw;  // every output's bytes, for bitwise comparisons
};

struct Problem {
  Case c;
  Geom g;
  Tensor q, k, v, dout;
  StateBuf S0, z0, dSf, dzf;
  std::vector<int32_t> cu32;
  std::vector<int64_t> cu64;

  explicit Problem(const Case& c_) : c(c_) {
    if (!c.lens.empty()) {
      c.B = 1;
      c.T = 0;
      g.cu.push_back(0);
      for (int64_t l : c.lens) {
        c.T += l;
        g.cu.push_back(c.T);
      }
      for (int64_t x : g.cu) {
        cu32.push_back(static_cast<int32_t>(x));
        cu64.push_back(x);
      }
    }
    g.B = c.B, g.T = c.T, g.H = c.H, g.Hkv = c.Hkv, g.K = c.K, g.V = c.V;
    g.scale = 1.0 / std::sqrt(static_cast<double>(c.K));
    g.eps = c.eps;
    g.fm = c.fm;
    g.normalize = c.normalize;

    std::mt19937 rng(c.seed);
    // With normalization the denominators must stay away from 0: positive inputs for identity.
    double lo = -1, hi = 1;
    if (c.normalize && c.fm == FeatureMap::kIdentity) lo = 0.05;
    if (c.normalize && c.fm == FeatureMap::kRelu) lo = -0.5;
    std::uniform_real_distribution<double> qk(lo, hi), sym(-1, 1), pos(0.5, 1.5);
    q = Tensor(c.dt, c.B, c.T, c.H, c.K, c.strided);
    k = Tensor(c.dt, c.B, c.T, c.Hkv, c.K, c.strided);
    v = Tensor(c.dt, c.B, c.T, c.Hkv, c.V, c.strided);
    dout = Tensor(c.dt, c.B, c.T, c.H, c.V, c.strided);
    fill(q, qk, rng);
    fill(k, qk, rng);
    fill(v, sym, rng);
    fill(dout, sym, rng);
    const int64_t N = g.N();
    if (c.initial) {
      S0 = StateBuf(c.dt, N * c.Hkv * c.K * c.V);
      dSf = StateBuf(c.dt, N * c.Hkv * c.K * c.V);
      for (int64_t i = 0; i < S0.n; ++i) S0.set(i, sym(rng)), dSf.set(i, sym(rng));
      if (c.normalize) {
        z0 = StateBuf(c.dt, N * c.Hkv * c.K);
        dzf = StateBuf(c.dt, N * c.Hkv * c.K);
        for (int64_t i = 0; i < z0.n; ++i) z0.set(i, pos(rng)), dzf.set(i, sym(rng));
      }
    }
  }

  template <class D>
  static void fill(Tensor& x, D& dist, std::mt19937& rng) {
    for (int64_t b = 0; b < x.B; ++b)
      for (int64_t t = 0; t < x.T; ++t)
        for (int64_t h = 0; h < x.H; ++h)
          for (int64_t d = 0; d < x.D; ++d) x.set(b, t, h, d, dist(rng));
  }

  attnrnn::LinearAttnBwdParams params() const {
    attnrnn::LinearAttnBwdParams p;
    p.dtype = c.dt;
    p.batch = c.B, p.seqlen = c.T, p.num_heads = c.H, p.num_kv_heads = c.Hkv;
    p.head_dim_k = c.K, p.head_dim_v = c.V;
    if (!g.cu.empty()) {
      p.cu_seqlens = c.cu64 ? static_cast<const void*>(cu64.data()) : static_cast<const void*>(cu32.data());
      p.cu_seqlens_int64 = c.cu64;
      p.num_seqs = g.N();
    }
    p.q = q.cview(), p.k = k.cview(), p.v = v.cview(), p.dout = dout.cview();
    if (c.initial) {
      p.initial_S = S0.bytes.data();
      p.d_final_S = dSf.bytes.data();
      if (c.normalize) p.initial_z = z0.bytes.data(), p.d_final_z = dzf.bytes.data();
    }
    p.scale = g.scale, p.eps = g.eps, p.feature_map = c.fm, p.normalize = c.normalize;
    p.chunk_size = c.chunk;
    return p;
  }

  // Runs forward (and backward when `backward`) with the chunk or recurrent kernels.
  Results run(bool chunk, bool backward, attnrnn::CpuExecutor ex = {}) const {
    attnrnn::LinearAttnBwdParams p = params();
    p.executor = ex;
    const int64_t N = g.N();
    Tensor o(c.dt, c.B, c.T, c.H, c.V, c.strided);
    StateBuf Sf(c.dt, N * c.Hkv * c.K * c.V), zf(c.dt, N * c.Hkv * c.K);
    p.o = o.mview();
    p.final_S = Sf.ptr();
    if (c.normalize) p.final_z = zf.ptr();
    attnrnn::Status s = chunk ? attnrnn::chunk_linear_attn_fwd(p) : attnrnn::recurrent_linear_attn_fwd(p);
    EXPECT(s == attnrnn::Status::kSuccess, "%s forward status %d (%s) for %s", chunk ? "chunk" : "recurrent",
           (int)s, attnrnn::last_error_message(), c.str().c_str());
    Results r;
    r.o = o.values();
    r.Sf = Sf.values();
    if (c.normalize) r.zf = zf.values();
    r.raw.insert(r.raw.end(), o.bytes.begin(), o.bytes.end());
    r.raw.insert(r.raw.end(), Sf.bytes.begin(), Sf.bytes.end());
    r.raw.insert(r.raw.end(), zf.bytes.begin(), zf.bytes.end());
    if (!backward) return r;

    Tensor dq(c.dt, c.B, c.T, c.H, c.K, c.strided), dk(c.dt, c.B, c.T, c.Hkv, c.K, c.strided),
        dv(c.dt, c.B, c.T, c.Hkv, c.V, c.strided);
    StateBuf dS0(c.dt, N * c.Hkv * c.K * c.V), dz0(c.dt, N * c.Hkv * c.K);
    p.dq = dq.mview(), p.dk = dk.mview(), p.dv = dv.mview();
    p.d_initial_S = dS0.ptr();
    if (c.normalize) p.d_initial_z = dz0.ptr();
    s = chunk ? attnrnn::chunk_linear_attn_bwd(p) : attnrnn::recurrent_linear_attn_bwd(p);
    EXPECT(s == attnrnn::Status::kSuccess, "%s backward status %d (%s) for %s", chunk ? "chunk" : "recurrent",
           (int)s, attnrnn::last_error_message(), c.str().c_str());
    r.dq = dq.values(), r.dk = dk.values(), r.dv = dv.values(), r.dS0 = dS0.values();
    if (c.normalize) r.dz0 = dz0.values();
    for (auto* t : {&dq.bytes, &dk.bytes, &dv.bytes, &dS0.bytes, &dz0.bytes})
      r.raw.insert(r.raw.end(), t->begin(), t->end());
    return r;
  }

  Results reference(bool backward) const {
    Results r;
    const vec qv = q.values(), kv = k.values(), vv = v.values();
    const vec S0v = c.initial ? S0.values() : vec(), z0v = c.initial && c.normalize ? z0.values() : vec();
    ref_forward(g, qv, kv, vv, S0v, z0v, r.o, r.Sf, r.zf);
    if (!c.normalize) r.zf.clear();
    if (backward) {
      const vec dSv = c.initial ? dSf.values() : vec(), dzv = c.initial && c.normalize ? dzf.values() : vec();
      ref_backward(g, qv, kv, vv, S0v, z0v, dout.values(), dSv, dzv, r.dq, r.dk, r.dv, r.dS0, r.dz0);
      if (!c.normalize) r.dz0.clear();
    }
    return r;
  }
};

// Compares every field present in both results with a relative RMS tolerance.
inline void compare(const Results& x, const Results& ref, double tol, const std::string& what) {
  const std::pair<const char*, std::pair<const vec*, const vec*>> fields[] = {
      {"o", {&x.o, &ref.o}},       {"final_S", {&x.Sf, &ref.Sf}}, {"final_z", {&x.zf, &ref.zf}},
      {"dq", {&x.dq, &ref.dq}},    {"dk", {&x.dk, &ref.dk}},      {"dv", {&x.dv, &ref.dv}},
      {"d_initial_S", {&x.dS0, &ref.dS0}}, {"d_initial_z", {&x.dz0, &ref.dz0}}};
  for (const auto& f : fields) {
    if (f.second.second->empty() && f.second.first->empty()) continue;
    const double e = rel_rms(*f.second.first, *f.second.second);
    EXPECT(e <= tol, "%s: %s rel rms error %.3g > %.3g", what.c_str(), f.first, e, tol);
  }
}

// The shape sweep shared by the forward and backward tests: every shape with every feature map,
// normalization and dtype; chunk size, initial state and strides vary from case to case.
inline std::vector<Case> sweep_cases() {
  struct Shape {
    int64_t B, T, H, Hkv, K, V;
    std::vector<int64_t> lens;
  };
  const Shape shapes[] = {
      {2, 1, 1, 1, 1, 1, {}},
      {1, 2, 2, 1, 3, 5, {}},
      {2, 63, 4, 2, 16, 8, {}},
      {1, 65, 3, 3, 60, 100, {}},
      {1, 200, 2, 1, 32, 64, {}},
      {1, 65, 1, 1, 256, 256, {}},
      {1, 0, 4, 1, 8, 12, {5, 0, 1, 63, 0, 70}},
      {1, 0, 2, 2, 100, 3, {1, 0, 2}},
  };
  const int64_t chunks[] = {0, 1, 16, 64, 100};
  const DType dtypes[] = {DType::kFloat64, DType::kFloat32, DType::kFloat16, DType::kBFloat16};
  const FeatureMap fms[] = {FeatureMap::kIdentity, FeatureMap::kElu1, FeatureMap::kRelu};
  std::vector<Case> cases;
  uint32_t i = 0;
  for (const Shape& s : shapes)
    for (DType dt : dtypes)
      for (FeatureMap fm : fms)
        for (bool normalize : {false, true}) {
          Case c;
          c.dt = dt, c.B = s.B, c.T = s.T, c.H = s.H, c.Hkv = s.Hkv, c.K = s.K, c.V = s.V, c.lens = s.lens;
          c.fm = fm, c.normalize = normalize;
          c.chunk = chunks[i % 5];
          c.initial = i % 2 == 0;
          c.strided = i % 3 == 0;
          c.cu64 = i % 4 < 2;
          c.seed = 1000 + i;
          // Without an initial state, a normalized output of few tokens is ~independent of q and k
          // (o = q'k'v / (q'k' + eps) for one token): dq, dk are O(eps) differences of O(1) terms.
          // A larger eps keeps those gradients well-conditioned enough for a relative check.
          if (normalize && !c.initial) c.eps = 0.25;
          ++i;
          cases.push_back(c);
        }
  return cases;
}

// Empty problems: batch 0, seqlen 0, and varlen with only empty sequences.
inline std::vector<Case> empty_cases() {
  std::vector<Case> cases;
  for (DType dt : {DType::kFloat64, DType::kFloat32, DType::kBFloat16})
    for (bool normalize : {false, true})
      for (bool initial : {false, true}) {
        Case c;
        c.dt = dt, c.normalize = normalize, c.initial = initial, c.H = 2, c.Hkv = 1, c.K = 5, c.V = 3;
        c.B = 0, c.T = 7;
        cases.push_back(c);
        c.B = 3, c.T = 0;
        cases.push_back(c);
        c.lens = {0, 0};
        cases.push_back(c);
      }
  return cases;
}

}  // namespace test
