// Backward kernels (chunk and recurrent) against the float64 reference's analytic gradients; the
// reference gradients against finite differences; determinism across executors.
#include "test_problem.h"

using namespace test;

namespace {

// loss = Σ o·dout + Σ final_S·d_final_S + Σ final_z·d_final_z of the float64 reference.
double ref_loss(const Geom& g, const vec& q, const vec& k, const vec& v, const vec& S0, const vec& z0,
                const vec& dout, const vec& dSf, const vec& dzf) {
  vec o, Sf, zf;
  ref_forward(g, q, k, v, S0, z0, o, Sf, zf);
  double l = 0;
  for (size_t i = 0; i < o.size(); ++i) l += o[i] * dout[i];
  for (size_t i = 0; i < Sf.size(); ++i) l += Sf[i] * dSf[i];
  for (size_t i = 0; i < dzf.size(); ++i) l += zf[i] * dzf[i];
  return l;
}

// The reference's analytic gradients equal central finite differences of its loss.
void check_reference_gradients(FeatureMap fm, bool normalize) {
  Geom g{1, 0, 4, 2, 3, 2, {0, 3, 3, 5}, 0.7, 1e-6, fm, normalize};
  g.T = 5;
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> u(normalize && fm == FeatureMap::kIdentity ? 0.1 : -1.0, 1.0), pos(0.5, 1.5);
  auto rand_vec = [&](size_t n, bool positive) {
    vec x(n);
    for (double& e : x) e = positive ? pos(rng) : u(rng);
    return x;
  };
  const int64_t N = g.N();
  vec q = rand_vec(g.T * g.H * g.K, false), k = rand_vec(g.T * g.Hkv * g.K, false), v = rand_vec(g.T * g.Hkv * g.V, false);
  vec S0 = rand_vec(N * g.Hkv * g.K * g.V, false), z0 = normalize ? rand_vec(N * g.Hkv * g.K, true) : vec();
  const vec dout = rand_vec(g.T * g.H * g.V, false), dSf = rand_vec(S0.size(), false), dzf = rand_vec(z0.size(), false);
  vec dq, dk, dv, dS0, dz0;
  ref_backward(g, q, k, v, S0, z0, dout, dSf, dzf, dq, dk, dv, dS0, dz0);
  const std::pair<vec*, const vec*> inputs[] = {{&q, &dq}, {&k, &dk}, {&v, &dv}, {&S0, &dS0}, {&z0, &dz0}};
  const char* names[] = {"q", "k", "v", "S0", "z0"};
  for (int a = 0; a < 5; ++a) {
    vec& x = *inputs[a].first;
    const vec& grad = *inputs[a].second;
    if (x.empty()) continue;  // z0 without normalization
    vec fd(x.size());
    for (size_t i = 0; i < x.size(); ++i) {
      const double keep = x[i], h = 1e-6;
      x[i] = keep + h;
      const double lp = ref_loss(g, q, k, v, S0, z0, dout, dSf, dzf);
      x[i] = keep - h;
      const double lm = ref_loss(g, q, k, v, S0, z0, dout, dSf, dzf);
      x[i] = keep;
      fd[i] = (lp - lm) / (2 * h);
    }
    const double e = rel_rms(grad, fd);
    EXPECT(e < 1e-6, "reference d%s vs finite differences (%s, normalize=%d): rel rms %.3g", names[a],
           fm_name(fm), normalize, e);
  }
}

}  // namespace

// phi_given (q and k hold phi already) is an option of the chunk backward only: the forwards and the
// recurrent backward refuse it, naming it, rather than apply phi once too often or not at all.
void check_phi_given_only_in_the_chunk_backward() {
  float q[2] = {0.5f, -1.0f}, k[2] = {0.25f, 2.0f}, v[2] = {1.0f, 3.0f}, o[2], dout[2] = {1.0f, 1.0f};
  float dq[2], dk[2], dv[2];
  attnrnn::LinearAttnParams p;
  p.batch = 1, p.seqlen = 1, p.num_heads = p.num_kv_heads = 1, p.head_dim_k = 2, p.head_dim_v = 2;
  p.q = {q, 2, 2, 2}, p.k = {k, 2, 2, 2}, p.v = {v, 2, 2, 2}, p.o = {o, 2, 2, 2};
  p.feature_map = FeatureMap::kElu1, p.phi_given = true;
  for (auto [op, name] : {std::pair{&attnrnn::chunk_linear_attn_fwd, "chunk forward"},
                          std::pair{&attnrnn::recurrent_linear_attn_fwd, "recurrent forward"}}) {
    const attnrnn::Status s = op(p);
    EXPECT(s == attnrnn::Status::kInvalidArgument && std::string(attnrnn::last_error_message()).find("phi_given") !=
                                                         std::string::npos,
           "%s with phi_given: status %d (%s)", name, (int)s, attnrnn::last_error_message());
  }
  p.dout = {dout, 2, 2, 2}, p.dq = {dq, 2, 2, 2}, p.dk = {dk, 2, 2, 2}, p.dv = {dv, 2, 2, 2};
  attnrnn::Status s = attnrnn::recurrent_linear_attn_bwd(p);
  EXPECT(s == attnrnn::Status::kInvalidArgument, "recurrent backward with phi_given: status %d", (int)s);
  s = attnrnn::chunk_linear_attn_bwd(p);
  EXPECT(s == attnrnn::Status::kSuccess, "chunk backward with phi_given: status %d (%s)", (int)s,
         attnrnn::last_error_message());
  // One token: dq = phi'(q) * scale * S (dout) with S = phi(k)^T v; phi' from phi(q) = q where
  // q < 1 (elu1's exp branch), 1 above it.
  const double s0 = 0.25 * 1.0 + 0.25 * 3.0, s1 = 2.0 * 1.0 + 2.0 * 3.0;  // rows of S times dout
  EXPECT(std::abs(dq[0] - 0.5 * s0) < 1e-6 && std::abs(dq[1] - (-1.0) * s1) < 1e-6,
         "chunk backward with phi_given: dq = (%g, %g), expected (%g, %g)", dq[0], dq[1], 0.5 * s0, -1.0 * s1);
}

int main() {
  check_phi_given_only_in_the_chunk_backward();

  // 1. The float64 reference backward is right.
  for (FeatureMap fm : {FeatureMap::kIdentity, FeatureMap::kElu1, FeatureMap::kRelu})
    for (bool normalize : {false, true}) check_reference_gradients(fm, normalize);

  // 2. Chunk and recurrent backward match the reference (and each other) over the shape sweep.
  for (const Case& c : sweep_cases()) {
    const Problem pb(c);
    const Results ref = pb.reference(true);
    const double tol = c.dt == DType::kFloat32 ? 2e-5 : tolerance(c.dt);
    const Results chunk = pb.run(true, true), rec = pb.run(false, true);
    compare(chunk, ref, tol, "chunk bwd " + c.str());
    compare(rec, ref, tol, "recurrent bwd " + c.str());
    compare(chunk, rec, 2 * tol, "chunk vs recurrent bwd " + c.str());
  }

  // 3. Empty problems: d_initial = d_final (zeros without one); outputs exist and are untouched.
  for (const Case& c : empty_cases()) {
    const Problem pb(c);
    const Results ref = pb.reference(true);
    compare(pb.run(true, true), ref, 0.0, "chunk bwd (empty) " + c.str());
    compare(pb.run(false, true), ref, 0.0, "recurrent bwd (empty) " + c.str());
  }

  // 4. Determinism: the default executor (any thread count), a serial executor and one running the
  //    items one by one in reverse give bitwise-identical outputs and gradients.
  //    A single long sequence is also cut into segments computed in parallel (chunk forward).
  for (DType dt : {DType::kFloat32, DType::kBFloat16}) {
    Case c;
    c.dt = dt, c.H = 4, c.Hkv = 2, c.K = 20, c.V = 36, c.fm = FeatureMap::kElu1, c.normalize = true;
    c.initial = true, c.lens = {40, 0, 129, 3, 77};
    if (dt == DType::kBFloat16) c.lens = {1000}, c.H = 2, c.Hkv = 1;
    const Problem pb(c);
    for (bool chunk : {true, false}) {
      attnrnn::CpuExecutor serial, reverse, three;
      serial.parallel_for = serial_for;
      reverse.parallel_for = reverse_for;
      three.num_threads = 3;
      const Results base = pb.run(chunk, true);
      for (const attnrnn::CpuExecutor& ex : {serial, reverse, three}) {
        const Results r = pb.run(chunk, true, ex);
        EXPECT(r.raw == base.raw, "%s results differ between executors for %s", chunk ? "chunk" : "recurrent",
               c.str().c_str());
      }
    }
  }
  return finish("test_backward");
}
