// Forward kernels (chunk and recurrent) against the float64 reference, and against each other.
#include "test_problem.h"

using namespace test;

int main() {
  // 1. Chunk and recurrent forward match the reference over the shape sweep; chunk == recurrent.
  for (const Case& c : sweep_cases()) {
    const Problem pb(c);
    const Results ref = pb.reference(false);
    const Results chunk = pb.run(true, false), rec = pb.run(false, false);
    compare(chunk, ref, tolerance(c.dt), "chunk fwd " + c.str());
    compare(rec, ref, tolerance(c.dt), "recurrent fwd " + c.str());
    compare(chunk, rec, 2 * tolerance(c.dt), "chunk vs recurrent fwd " + c.str());
  }

  // 2. Empty problems: final state = initial state (zeros without one).
  for (const Case& c : empty_cases()) {
    const Problem pb(c);
    const Results ref = pb.reference(false);
    compare(pb.run(true, false), ref, 0.0, "chunk fwd (empty) " + c.str());
    compare(pb.run(false, false), ref, 0.0, "recurrent fwd (empty) " + c.str());
  }

  // 3. Every chunk size gives the same result within rounding (float64), also chunks longer than T.
  for (bool normalize : {false, true}) {
    Case c;
    c.dt = DType::kFloat64, c.B = 2, c.T = 130, c.H = 4, c.Hkv = 2, c.K = 24, c.V = 40;
    c.fm = FeatureMap::kElu1, c.normalize = normalize, c.initial = true;
    c.chunk = 1;
    const Results base = Problem(c).run(true, false);
    for (int64_t chunk : {2, 7, 16, 63, 64, 65, 100, 129, 130, 1024}) {
      c.chunk = chunk;
      compare(Problem(c).run(true, false), base, 1e-12, "chunk size invariance " + c.str());
    }
  }

  // 4. Long fp32 sequence: the long-range state is accurate (checked on the last quarter too).
  {
    Case c;
    c.dt = DType::kFloat32, c.B = 1, c.T = 1000, c.H = 2, c.Hkv = 1, c.K = 64, c.V = 64;
    c.fm = FeatureMap::kElu1, c.normalize = true, c.initial = true;
    const Problem pb(c);
    const Results ref = pb.reference(false), x = pb.run(true, false);
    compare(x, ref, 1e-5, "long fp32 " + c.str());
    const size_t from = x.o.size() * 3 / 4;
    const vec tail_x(x.o.begin() + from, x.o.end()), tail_ref(ref.o.begin() + from, ref.o.end());
    const double e = rel_rms(tail_x, tail_ref);
    EXPECT(e <= 1e-5, "long fp32 last quarter rel rms %.3g", e);
  }
  return finish("test_forward");
}
