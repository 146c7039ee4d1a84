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

int main() {
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
