// Decode step: against a float64 reference and against one recurrent token; state_indices skip
// (negative), rejection of out-of-range and duplicate indices with the state left untouched.
#include "test_problem.h"

using namespace test;

namespace {

struct StepCase {
  DType dt;
  int64_t B, H, Hkv, K, V, P;
  FeatureMap fm;
  bool normalize, strided, idx64;
  std::vector<int64_t> idx;  // empty: no state_indices (row b for entry b)
};

struct StepRun {
  Tensor q, k, v, o;
  StateBuf S, z;
  std::vector<int32_t> i32;
  std::vector<int64_t> i64;
  attnrnn::LinearAttnStepParams p;

  StepRun(const StepCase& c, uint32_t seed) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<double> u(c.normalize && c.fm == FeatureMap::kIdentity ? 0.05 : -1.0, 1.0),
        sym(-1, 1), pos(0.5, 1.5);
    q = Tensor(c.dt, c.B, 1, c.H, c.K, c.strided);
    k = Tensor(c.dt, c.B, 1, c.Hkv, c.K, c.strided);
    v = Tensor(c.dt, c.B, 1, c.Hkv, c.V, c.strided);
    o = Tensor(c.dt, c.B, 1, c.H, c.V, c.strided);
    Problem::fill(q, u, rng);
    Problem::fill(k, u, rng);
    Problem::fill(v, sym, rng);
    S = StateBuf(c.dt, c.P * c.Hkv * c.K * c.V);
    z = StateBuf(c.dt, c.P * c.Hkv * c.K);
    for (int64_t i = 0; i < S.n; ++i) S.set(i, sym(rng));
    for (int64_t i = 0; i < z.n; ++i) z.set(i, pos(rng));
    for (int64_t x : c.idx) i32.push_back(static_cast<int32_t>(x)), i64.push_back(x);
    p.dtype = c.dt;
    p.batch = c.B, p.num_heads = c.H, p.num_kv_heads = c.Hkv, p.head_dim_k = c.K, p.head_dim_v = c.V;
    p.q = q.cview(), p.k = k.cview(), p.v = v.cview(), p.o = o.mview();
    p.S = S.ptr();
    p.z = c.normalize ? z.ptr() : nullptr;
    p.pool_size = c.P;
    if (!c.idx.empty()) {
      p.state_indices = c.idx64 ? static_cast<const void*>(i64.data()) : static_cast<const void*>(i32.data());
      p.state_indices_int64 = c.idx64;
    }
    p.scale = 0.5, p.eps = 1e-6, p.feature_map = c.fm, p.normalize = c.normalize;
  }
};

void check_step(const StepCase& c, uint32_t seed) {
  StepRun run(c, seed);
  const vec S0 = run.S.values(), z0 = run.z.values();
  const attnrnn::Status s = attnrnn::linear_attn_step(run.p);
  EXPECT(s == attnrnn::Status::kSuccess, "step status %d: %s", (int)s, attnrnn::last_error_message());
  const int64_t G = c.H / c.Hkv, K = c.K, V = c.V;
  vec S = S0, z = z0;
  std::vector<bool> used(c.P, false);
  double err = 0, norm = 0;
  bool zero_ok = true;
  for (int64_t b = 0; b < c.B; ++b) {
    const int64_t r = c.idx.empty() ? b : c.idx[b];
    for (int64_t g = 0; g < c.Hkv; ++g) {
      if (r < 0) {
        for (int64_t h = g * G; h < (g + 1) * G; ++h)
          for (int64_t j = 0; j < V; ++j) zero_ok = zero_ok && run.o.get(b, 0, h, j) == 0.0;
        continue;
      }
      used[r] = true;
      double* Sr = &S[(r * c.Hkv + g) * K * V];
      double* zr = &z[(r * c.Hkv + g) * K];
      for (int64_t a = 0; a < K; ++a) {
        const double kp = phi(c.fm, run.k.get(b, 0, g, a));
        zr[a] += kp;
        for (int64_t j = 0; j < V; ++j) Sr[a * V + j] += kp * run.v.get(b, 0, g, j);
      }
      for (int64_t h = g * G; h < (g + 1) * G; ++h) {
        double den = c.normalize ? 1e-6 : 1.0;
        if (c.normalize)
          for (int64_t a = 0; a < K; ++a) den += 0.5 * phi(c.fm, run.q.get(b, 0, h, a)) * zr[a];
        for (int64_t j = 0; j < V; ++j) {
          double num = 0;
          for (int64_t a = 0; a < K; ++a) num += 0.5 * phi(c.fm, run.q.get(b, 0, h, a)) * Sr[a * V + j];
          const double ref = num / den, x = run.o.get(b, 0, h, j);
          err += (x - ref) * (x - ref);
          norm += ref * ref;
          if (!std::isfinite(x)) err = INFINITY;
        }
      }
    }
  }
  const double tol = tolerance(c.dt);
  EXPECT(std::sqrt(err) <= tol * std::sqrt(norm) + 1e-30, "step output rel rms %.3g (dtype %s, K=%lld)",
         std::sqrt(err / std::max(norm, 1e-300)), dtype_name(c.dt), (long long)K);
  EXPECT(zero_ok, "step output of skipped (negative index) entries is not zero");
  const double state_tol = c.dt == DType::kFloat64 ? 1e-12 : 1e-6;
  EXPECT(rel_rms(run.S.values(), S) <= state_tol, "step state S rel rms %.3g", rel_rms(run.S.values(), S));
  if (c.normalize) EXPECT(rel_rms(run.z.values(), z) <= state_tol, "step state z rel rms %.3g", rel_rms(run.z.values(), z));
  // Rows no entry addresses are bitwise untouched.
  for (int64_t r = 0; r < c.P; ++r) {
    if (used[r]) continue;
    bool same = true;
    for (int64_t i = r * c.Hkv * K * V; i < (r + 1) * c.Hkv * K * V; ++i) same = same && run.S.get(i) == S0[i];
    EXPECT(same, "unused pool row %lld was modified", (long long)r);
  }
}

// step == recurrent forward over one token starting from the same state row.
void check_step_vs_recurrent(DType dt, bool normalize) {
  const StepCase c{dt, 3, 4, 2, 9, 17, 3, FeatureMap::kElu1, normalize, false, false, {}};
  StepRun run(c, 99);
  const vec S0 = run.S.values(), z0 = run.z.values();
  EXPECT(attnrnn::linear_attn_step(run.p) == attnrnn::Status::kSuccess, "step failed: %s", attnrnn::last_error_message());
  attnrnn::LinearAttnFwdParams p;
  p.dtype = dt, p.batch = c.B, p.seqlen = 1, p.num_heads = c.H, p.num_kv_heads = c.Hkv;
  p.head_dim_k = c.K, p.head_dim_v = c.V;
  p.q = run.q.cview(), p.k = run.k.cview(), p.v = run.v.cview();
  Tensor o(dt, c.B, 1, c.H, c.V, false);
  StateBuf S(dt, S0.size()), z(dt, z0.size()), Sf(dt, S0.size()), zf(dt, z0.size());
  for (size_t i = 0; i < S0.size(); ++i) S.set(i, S0[i]);
  for (size_t i = 0; i < z0.size(); ++i) z.set(i, z0[i]);
  p.o = o.mview(), p.initial_S = S.ptr(), p.final_S = Sf.ptr();
  if (normalize) p.initial_z = z.ptr(), p.final_z = zf.ptr();
  p.scale = run.p.scale, p.eps = run.p.eps, p.feature_map = c.fm, p.normalize = normalize;
  EXPECT(attnrnn::recurrent_linear_attn_fwd(p) == attnrnn::Status::kSuccess, "recurrent failed");
  const double tol = dt == DType::kFloat64 ? 1e-13 : 1e-6;
  EXPECT(rel_rms(run.o.values(), o.values()) <= tol, "step o != recurrent o: %.3g", rel_rms(run.o.values(), o.values()));
  EXPECT(rel_rms(run.S.values(), Sf.values()) <= tol, "step S != recurrent final S");
  if (normalize) EXPECT(rel_rms(run.z.values(), zf.values()) <= tol, "step z != recurrent final z");
}

// A rejected call returns kInvalidArgument naming state_indices and writes nothing.
void check_rejected(const std::vector<int64_t>& idx, bool idx64, const char* expect_in_message) {
  const StepCase c{DType::kFloat32, static_cast<int64_t>(idx.size()), 2, 1, 8, 8, 4, FeatureMap::kIdentity, true, false, idx64, idx};
  StepRun run(c, 5);
  const auto S_before = run.S.bytes, z_before = run.z.bytes, o_before = run.o.bytes;
  const attnrnn::Status s = attnrnn::linear_attn_step(run.p);
  const std::string msg = attnrnn::last_error_message();
  EXPECT(s == attnrnn::Status::kInvalidArgument, "bad state_indices accepted (status %d)", (int)s);
  EXPECT(msg.find(expect_in_message) != std::string::npos && msg.find("state_indices") != std::string::npos,
         "message '%s' does not say '%s'", msg.c_str(), expect_in_message);
  EXPECT(run.S.bytes == S_before && run.z.bytes == z_before && run.o.bytes == o_before,
         "rejected step modified the state or the output");
}

// Options the core refuses for the step and the sequence ops alike: an unknown feature map (the
// kernels' switch had no such case and left their outputs zero), non-finite scale or eps, sizes
// whose element counts overflow, and a z pointer without normalize (named).
void check_rejected_options() {
  const StepCase c{DType::kFloat32, 2, 2, 1, 8, 8, 4, FeatureMap::kIdentity, true, false, false, {}};
  struct Mut {
    const char* name;
    void (*f)(attnrnn::LinearAttnStepParams&);
    const char* in_message;
  };
  const Mut muts[] = {
      {"feature_map 9", [](attnrnn::LinearAttnStepParams& p) { p.feature_map = static_cast<FeatureMap>(9); }, "feature_map"},
      {"scale NaN", [](attnrnn::LinearAttnStepParams& p) { p.scale = std::nan(""); }, "scale"},
      {"scale inf", [](attnrnn::LinearAttnStepParams& p) { p.scale = INFINITY; }, "scale"},
      {"eps inf", [](attnrnn::LinearAttnStepParams& p) { p.eps = INFINITY; }, "eps"},
      {"pool 2^62", [](attnrnn::LinearAttnStepParams& p) { p.pool_size = int64_t(1) << 62; }, "2^60"},
      {"batch 2^62", [](attnrnn::LinearAttnStepParams& p) { p.batch = int64_t(1) << 62, p.pool_size = p.batch; }, "2^60"},
  };
  for (const Mut& m : muts) {
    StepRun run(c, 7);
    const auto S_before = run.S.bytes, o_before = run.o.bytes;
    m.f(run.p);
    const attnrnn::Status s = attnrnn::linear_attn_step(run.p);
    const std::string msg = attnrnn::last_error_message();
    EXPECT(s == attnrnn::Status::kInvalidArgument, "step with %s accepted (status %d)", m.name, (int)s);
    EXPECT(msg.find(m.in_message) != std::string::npos, "step with %s: message '%s' does not say '%s'", m.name,
           msg.c_str(), m.in_message);
    EXPECT(run.S.bytes == S_before && run.o.bytes == o_before, "rejected step (%s) wrote something", m.name);
  }
  // The sequence ops, on an empty batch (no buffers needed: the options are checked first).
  float dummy = 0.f;
  struct SeqMut {
    const char* name;
    void (*f)(attnrnn::LinearAttnBwdParams&, float*);
    const char* in_message;
  };
  const SeqMut seq_muts[] = {
      {"feature_map -1", [](attnrnn::LinearAttnBwdParams& p, float*) { p.feature_map = static_cast<FeatureMap>(-1); }, "feature_map"},
      {"scale inf", [](attnrnn::LinearAttnBwdParams& p, float*) { p.scale = -INFINITY; }, "scale"},
      {"seqlen 2^62", [](attnrnn::LinearAttnBwdParams& p, float*) { p.batch = 4, p.seqlen = int64_t(1) << 62; }, "2^60"},
      {"final_z without normalize", [](attnrnn::LinearAttnBwdParams& p, float* z) { p.normalize = false, p.final_z = z; }, "final_z"},
      {"d_initial_z without normalize", [](attnrnn::LinearAttnBwdParams& p, float* z) { p.normalize = false, p.d_initial_z = z; }, "d_initial_z"},
  };
  for (const SeqMut& m : seq_muts) {
    attnrnn::LinearAttnBwdParams p;
    p.dtype = DType::kFloat32, p.batch = 0, p.seqlen = 5, p.num_heads = 2, p.num_kv_heads = 1;
    p.head_dim_k = p.head_dim_v = 8, p.scale = 0.5, p.normalize = true;
    m.f(p, &dummy);
    // the gradient fields belong to the backward's params: the forward does not read them
    const bool backward_only = std::string(m.name).rfind("d_", 0) == 0;
    for (bool backward : {false, true}) {
      if (backward_only && !backward) continue;
      const attnrnn::Status s = backward ? attnrnn::chunk_linear_attn_bwd(p) : attnrnn::chunk_linear_attn_fwd(p);
      const std::string msg = attnrnn::last_error_message();
      EXPECT(s == attnrnn::Status::kInvalidArgument && msg.find(m.in_message) != std::string::npos,
             "chunk %s with %s: status %d, message '%s'", backward ? "bwd" : "fwd", m.name, (int)s, msg.c_str());
    }
  }
}

}  // namespace

int main() {
  uint32_t seed = 1;
  for (DType dt : {DType::kFloat64, DType::kFloat32, DType::kFloat16, DType::kBFloat16})
    for (FeatureMap fm : {FeatureMap::kIdentity, FeatureMap::kElu1, FeatureMap::kRelu})
      for (bool normalize : {false, true}) {
        check_step({dt, 4, 4, 2, 60, 100, 4, fm, normalize, seed % 2 == 0, false, {}}, seed);
        check_step({dt, 5, 3, 3, 1, 7, 9, fm, normalize, seed % 3 == 0, seed % 2 == 0, {8, -1, 0, 3, -5}}, seed + 1);
        check_step({dt, 2, 2, 1, 256, 256, 2, fm, normalize, true, true, {1, 0}}, seed + 2);
        seed += 3;
      }
  for (DType dt : {DType::kFloat64, DType::kFloat32, DType::kBFloat16})
    for (bool normalize : {false, true}) check_step_vs_recurrent(dt, normalize);
  check_rejected({0, 4}, false, "out of range");
  check_rejected({1, 2, 9}, true, "out of range");
  check_rejected({3, -1, 3}, false, "both");
  check_rejected({0, 1, 2, 0}, true, "both");
  check_rejected_options();
  return finish("test_step");
}
