// Softmax attention (forward, backward, decode step) against a naive float64 reference written
// here: explicit softmax with the bottom-right causal mask, and the analytic backward
//   dV = Pᵀ dO,  dP = dO Vᵀ,  dS = P ∘ (dP - rowsum(dO ∘ O)),  dQ = scale dS K,  dK = scale dSᵀ Q
// (itself checked against central finite differences). Also: fully masked rows, varlen packing
// with empty and 1-token sequences, decode over a KV cache for several split sizes, rejection of
// invalid params, and bitwise equality between executors.
#include <algorithm>
#include <string>

#include "test_common.h"

using namespace test;
using attnrnn::Status;

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// ---- the float64 reference --------------------------------------------------------------------

// One problem's logical contents, contiguous float64: q [B,Tq,H,D], k [B,Tk,Hkv,D],
// v [B,Tk,Hkv,Dv], dout [B,Tq,H,Dv]; cu (optional, B == 1, Tq == Tk) packs sequences along T.
struct RefProblem {
  int64_t B, Tq, Tk, H, Hkv, D, Dv;
  std::vector<int64_t> cu;
  double scale;
  bool causal;
  vec q, k, v, dout;

  int64_t N() const { return cu.empty() ? B : static_cast<int64_t>(cu.size()) - 1; }
  // Sequence n: batch entry b, queries [q0, q0 + Lq), keys [k0, k0 + Lk).
  void seq(int64_t n, int64_t& b, int64_t& q0, int64_t& Lq, int64_t& k0, int64_t& Lk) const {
    if (cu.empty()) {
      b = n, q0 = 0, Lq = Tq, k0 = 0, Lk = Tk;
    } else {
      b = 0, q0 = k0 = cu[n], Lq = Lk = cu[n + 1] - cu[n];
    }
  }
  // Number of keys query i (0-based in its sequence) sees: bottom-right causal alignment.
  int64_t key_end(int64_t i, int64_t Lq, int64_t Lk) const {
    if (!causal) return Lk;
    return std::max<int64_t>(0, std::min<int64_t>(Lk, i + Lk - Lq + 1));
  }
  int64_t iq(int64_t b, int64_t t, int64_t h, int64_t d) const { return ((b * Tq + t) * H + h) * D + d; }
  int64_t ik(int64_t b, int64_t t, int64_t h, int64_t d) const { return ((b * Tk + t) * Hkv + h) * D + d; }
  int64_t iv(int64_t b, int64_t t, int64_t h, int64_t d) const { return ((b * Tk + t) * Hkv + h) * Dv + d; }
  int64_t io(int64_t b, int64_t t, int64_t h, int64_t d) const { return ((b * Tq + t) * H + h) * Dv + d; }
  int64_t il(int64_t b, int64_t h, int64_t t) const { return (b * H + h) * Tq + t; }

  // Scores of query t (global index) of head h against keys [k0, k0 + kend).
  vec scores(int64_t b, int64_t t, int64_t h, int64_t k0, int64_t kend) const {
    const int64_t g = h / (H / Hkv);
    vec s(kend);
    for (int64_t j = 0; j < kend; ++j) {
      double acc = 0;
      for (int64_t c = 0; c < D; ++c) acc += q[iq(b, t, h, c)] * k[ik(b, k0 + j, g, c)];
      s[j] = scale * acc;
    }
    return s;
  }

  void forward(vec& o, vec& lse) const {
    o.assign(B * Tq * H * Dv, 0.0);
    lse.assign(B * H * Tq, -kInf);
    const int64_t G = H / Hkv;
    for (int64_t n = 0; n < N(); ++n) {
      int64_t b, q0, Lq, k0, Lk;
      seq(n, b, q0, Lq, k0, Lk);
      for (int64_t h = 0; h < H; ++h)
        for (int64_t i = 0; i < Lq; ++i) {
          const int64_t kend = key_end(i, Lq, Lk), t = q0 + i;
          if (kend == 0) continue;  // o = 0, lse = -inf
          const vec s = scores(b, t, h, k0, kend);
          const double m = *std::max_element(s.begin(), s.end());
          double z = 0;
          for (double x : s) z += std::exp(x - m);
          for (int64_t j = 0; j < kend; ++j) {
            const double pj = std::exp(s[j] - m) / z;
            for (int64_t c = 0; c < Dv; ++c) o[io(b, t, h, c)] += pj * v[iv(b, k0 + j, h / G, c)];
          }
          lse[il(b, h, t)] = m + std::log(z);
        }
    }
  }

  void backward(vec& dq, vec& dk, vec& dv) const {
    vec o, lse;
    forward(o, lse);
    dq.assign(q.size(), 0.0);
    dk.assign(k.size(), 0.0);
    dv.assign(v.size(), 0.0);
    const int64_t G = H / Hkv;
    for (int64_t n = 0; n < N(); ++n) {
      int64_t b, q0, Lq, k0, Lk;
      seq(n, b, q0, Lq, k0, Lk);
      for (int64_t h = 0; h < H; ++h)
        for (int64_t i = 0; i < Lq; ++i) {
          const int64_t kend = key_end(i, Lq, Lk), t = q0 + i, g = h / G;
          if (kend == 0) continue;
          const vec s = scores(b, t, h, k0, kend);
          double Di = 0;
          for (int64_t c = 0; c < Dv; ++c) Di += dout[io(b, t, h, c)] * o[io(b, t, h, c)];
          for (int64_t j = 0; j < kend; ++j) {
            const double P = std::exp(s[j] - lse[il(b, h, t)]);
            double dP = 0;
            for (int64_t c = 0; c < Dv; ++c) {
              dP += dout[io(b, t, h, c)] * v[iv(b, k0 + j, g, c)];
              dv[iv(b, k0 + j, g, c)] += P * dout[io(b, t, h, c)];
            }
            const double dS = P * (dP - Di);
            for (int64_t c = 0; c < D; ++c) {
              dq[iq(b, t, h, c)] += scale * dS * k[ik(b, k0 + j, g, c)];
              dk[ik(b, k0 + j, g, c)] += scale * dS * q[iq(b, t, h, c)];
            }
          }
        }
    }
  }

  // The loss whose gradients backward() returns: sum(dout ∘ o).
  double loss() const {
    vec o, lse;
    forward(o, lse);
    double s = 0;
    for (size_t i = 0; i < o.size(); ++i) s += dout[i] * o[i];
    return s;
  }
};

// ---- one library problem ----------------------------------------------------------------------

struct Case {
  DType dt = DType::kFloat64;
  int64_t B = 1, Tq = 1, Tk = 1, H = 1, Hkv = 1, D = 16, Dv = 16;
  bool strided = false, causal = true, cu64 = false;
  std::vector<int64_t> cu;  // varlen offsets (B = 1, Tq = Tk = cu.back())
  double scale = 0.3;

  std::string str() const {
    char buf[256];
    std::snprintf(buf, sizeof buf, "[%s B=%lld Tq=%lld Tk=%lld H=%lld Hkv=%lld D=%lld Dv=%lld%s%s", dtype_name(dt),
                  (long long)B, (long long)Tq, (long long)Tk, (long long)H, (long long)Hkv, (long long)D,
                  (long long)Dv, strided ? " strided" : "", causal ? "" : " non-causal");
    std::string s = buf;
    if (!cu.empty()) {
      s += cu64 ? " cu64={" : " cu32={";
      for (size_t i = 0; i < cu.size(); ++i) s += (i ? "," : "") + std::to_string(cu[i]);
      s += "}";
    }
    return s + "]";
  }
};

struct Run {
  Case c;
  Tensor q, k, v, o, dout, dq, dk, dv;
  std::vector<unsigned char> lse;  // [B, H, Tq] in the state dtype
  std::vector<int32_t> cu32;
  std::vector<int64_t> cu64;
  attnrnn::SoftmaxAttnParams p;

  Run(const Case& c_, uint32_t seed) : c(c_) {
    std::mt19937 rng(seed);
    std::normal_distribution<double> nd(0.0, 1.0);
    q = Tensor(c.dt, c.B, c.Tq, c.H, c.D, c.strided);
    k = Tensor(c.dt, c.B, c.Tk, c.Hkv, c.D, c.strided);
    v = Tensor(c.dt, c.B, c.Tk, c.Hkv, c.Dv, c.strided);
    o = Tensor(c.dt, c.B, c.Tq, c.H, c.Dv, c.strided);
    dout = Tensor(c.dt, c.B, c.Tq, c.H, c.Dv, c.strided);
    dq = Tensor(c.dt, c.B, c.Tq, c.H, c.D, c.strided);
    dk = Tensor(c.dt, c.B, c.Tk, c.Hkv, c.D, c.strided);
    dv = Tensor(c.dt, c.B, c.Tk, c.Hkv, c.Dv, c.strided);
    for (Tensor* t : {&q, &k, &v, &dout})
      for (int64_t b = 0; b < t->B; ++b)
        for (int64_t s = 0; s < t->T; ++s)
          for (int64_t h = 0; h < t->H; ++h)
            for (int64_t d = 0; d < t->D; ++d) t->set(b, s, h, d, nd(rng));
    const DType sd = attnrnn::state_dtype(c.dt);
    const int64_t nl = c.B * c.H * c.Tq;
    lse.assign(std::max<int64_t>(1, nl) * elem_size(sd), 0);
    for (int64_t i = 0; i < nl; ++i) write_elem(sd, lse.data(), i, std::numeric_limits<double>::quiet_NaN());
    for (int64_t x : c.cu) cu32.push_back(static_cast<int32_t>(x)), cu64.push_back(x);

    p.dtype = c.dt;
    p.batch = c.B, p.seqlen_q = c.Tq, p.seqlen_k = c.Tk;
    p.num_heads = c.H, p.num_kv_heads = c.Hkv, p.head_dim = c.D, p.head_dim_v = c.Dv;
    if (!c.cu.empty()) {
      p.cu_seqlens = c.cu64 ? static_cast<const void*>(cu64.data()) : static_cast<const void*>(cu32.data());
      p.cu_seqlens_int64 = c.cu64;
      p.num_seqs = static_cast<int64_t>(c.cu.size()) - 1;
    }
    p.q = q.cview(), p.k = k.cview(), p.v = v.cview(), p.o = o.mview();
    p.lse = lse.data();
    p.dout = dout.cview(), p.out = o.cview();
    p.dq = dq.mview(), p.dk = dk.mview(), p.dv = dv.mview();
    p.scale = c.scale, p.causal = c.causal;
  }

  RefProblem ref() const {
    return RefProblem{c.B, c.Tq, c.Tk, c.H, c.Hkv, c.D, c.Dv, c.cu, c.scale, c.causal,
                      q.values(), k.values(), v.values(), dout.values()};
  }
  vec lse_values() const {
    vec out(c.B * c.H * c.Tq);
    for (size_t i = 0; i < out.size(); ++i) out[i] = read_elem(attnrnn::state_dtype(c.dt), lse.data(), i);
    return out;
  }
  Status fwd() { return attnrnn::softmax_attn_fwd(p); }
  Status bwd() { return attnrnn::softmax_attn_bwd(p); }
};

// Relative RMS of the finite entries; -inf must match -inf exactly; NaN anywhere fails.
double lse_error(const vec& x, const vec& ref, int64_t* mismatches) {
  vec xf, rf;
  *mismatches = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    if (ref[i] == -kInf) {
      if (x[i] != -kInf) ++*mismatches;
      continue;
    }
    if (!std::isfinite(x[i])) ++*mismatches;
    xf.push_back(x[i]);
    rf.push_back(ref[i]);
  }
  return xf.empty() ? 0.0 : rel_rms(xf, rf);
}

double fwd_tol(DType d) { return d == DType::kFloat64 ? 1e-12 : d == DType::kFloat32 ? 1e-5 : tolerance(d); }

void check_forward(const Case& c, uint32_t seed, bool also_backward) {
  Run run(c, seed);
  const Status s = run.fwd();
  EXPECT(s == Status::kSuccess, "fwd %s status %d: %s", c.str().c_str(), (int)s, attnrnn::last_error_message());
  if (s != Status::kSuccess) return;
  const RefProblem rp = run.ref();
  vec o_ref, lse_ref;
  rp.forward(o_ref, lse_ref);
  const vec o = run.o.values(), lse = run.lse_values();
  const double eo = rel_rms(o, o_ref);
  int64_t mism = 0;
  const double el = lse_error(lse, lse_ref, &mism);
  EXPECT(eo <= fwd_tol(c.dt), "fwd o %s rel rms %.3g", c.str().c_str(), eo);
  EXPECT(el <= fwd_tol(c.dt) && mism == 0, "fwd lse %s rel rms %.3g, %lld -inf/NaN mismatches", c.str().c_str(),
         el, (long long)mism);
  // Rows with no key: o exactly 0.
  int64_t bad = 0, masked = 0;
  for (int64_t b = 0; b < c.B; ++b)
    for (int64_t h = 0; h < c.H; ++h)
      for (int64_t t = 0; t < c.Tq; ++t)
        if (lse_ref[rp.il(b, h, t)] == -kInf) {
          ++masked;
          for (int64_t d = 0; d < c.Dv; ++d) bad += o[rp.io(b, t, h, d)] != 0.0;
        }
  EXPECT(bad == 0, "fwd %s: %lld nonzero o entries in %lld fully masked rows", c.str().c_str(), (long long)bad,
         (long long)masked);
  if (!also_backward) return;

  const Status sb = run.bwd();
  EXPECT(sb == Status::kSuccess, "bwd %s status %d: %s", c.str().c_str(), (int)sb, attnrnn::last_error_message());
  if (sb != Status::kSuccess) return;
  vec dq_ref, dk_ref, dv_ref;
  rp.backward(dq_ref, dk_ref, dv_ref);
  const double tol = tolerance(c.dt);
  const double eq = rel_rms(run.dq.values(), dq_ref), ek = rel_rms(run.dk.values(), dk_ref),
               ev = rel_rms(run.dv.values(), dv_ref);
  EXPECT(eq <= tol, "bwd dq %s rel rms %.3g", c.str().c_str(), eq);
  EXPECT(ek <= tol, "bwd dk %s rel rms %.3g", c.str().c_str(), ek);
  EXPECT(ev <= tol, "bwd dv %s rel rms %.3g", c.str().c_str(), ev);
}

// The reference backward against central finite differences of sum(dout ∘ o).
void check_reference_gradients() {
  for (bool varlen : {false, true}) {
    RefProblem rp{1, 6, 9, 4, 2, 5, 3, {}, 0.7, true, {}, {}, {}, {}};
    if (varlen) rp.Tq = rp.Tk = 9, rp.cu = {0, 0, 1, 5, 9};
    std::mt19937 rng(7);
    std::normal_distribution<double> nd(0, 1);
    rp.q.resize(rp.B * rp.Tq * rp.H * rp.D);
    rp.k.resize(rp.B * rp.Tk * rp.Hkv * rp.D);
    rp.v.resize(rp.B * rp.Tk * rp.Hkv * rp.Dv);
    rp.dout.resize(rp.B * rp.Tq * rp.H * rp.Dv);
    for (vec* x : {&rp.q, &rp.k, &rp.v, &rp.dout})
      for (double& e : *x) e = nd(rng);
    vec dq, dk, dv;
    rp.backward(dq, dk, dv);
    const double h = 1e-5;
    auto fd = [&](vec& x) {
      vec g(x.size());
      for (size_t i = 0; i < x.size(); ++i) {
        const double x0 = x[i];
        x[i] = x0 + h;
        const double lp = rp.loss();
        x[i] = x0 - h;
        const double lm = rp.loss();
        x[i] = x0;
        g[i] = (lp - lm) / (2 * h);
      }
      return g;
    };
    const double eq = rel_rms(dq, fd(rp.q)), ek = rel_rms(dk, fd(rp.k)), ev = rel_rms(dv, fd(rp.v));
    EXPECT(eq < 1e-7 && ek < 1e-7 && ev < 1e-7,
           "reference backward vs finite differences (varlen %d): dq %.3g dk %.3g dv %.3g", (int)varlen, eq, ek, ev);
  }
}

// ---- decode step ------------------------------------------------------------------------------

struct StepCase {
  DType dt = DType::kFloat64;
  int64_t B = 3, Lmax = 300, H = 4, Hkv = 2, D = 32, Dv = 48;
  std::vector<int32_t> lens = {0, 137, 299};
  bool append = true, strided = false;
  int64_t split = 0;
  std::string str() const {
    char buf[200];
    std::snprintf(buf, sizeof buf, "[%s B=%lld Lmax=%lld H=%lld Hkv=%lld D=%lld Dv=%lld split=%lld%s%s lens=",
                  dtype_name(dt), (long long)B, (long long)Lmax, (long long)H, (long long)Hkv, (long long)D,
                  (long long)Dv, (long long)split, append ? " append" : "", strided ? " strided" : "");
    std::string s = buf;
    for (size_t i = 0; i < lens.size(); ++i) s += (i ? "," : "{") + std::to_string(lens[i]);
    return s + "}]";
  }
};

struct StepRun {
  StepCase c;
  Tensor q, kn, vn, o, kc, vc;
  attnrnn::SoftmaxAttnStepParams p;

  StepRun(const StepCase& c_, uint32_t seed) : c(c_) {
    std::mt19937 rng(seed);
    std::normal_distribution<double> nd(0.0, 1.0);
    q = Tensor(c.dt, c.B, 1, c.H, c.D, c.strided);
    kn = Tensor(c.dt, c.B, 1, c.Hkv, c.D, c.strided);
    vn = Tensor(c.dt, c.B, 1, c.Hkv, c.Dv, c.strided);
    o = Tensor(c.dt, c.B, 1, c.H, c.Dv, c.strided);
    kc = Tensor(c.dt, c.B, c.Lmax, c.Hkv, c.D, c.strided);
    vc = Tensor(c.dt, c.B, c.Lmax, c.Hkv, c.Dv, c.strided);
    for (Tensor* t : {&q, &kn, &vn})
      for (int64_t b = 0; b < t->B; ++b)
        for (int64_t h = 0; h < t->H; ++h)
          for (int64_t d = 0; d < t->D; ++d) t->set(b, 0, h, d, nd(rng));
    // Cache rows below cache_seqlens[b] are data; the row k_new goes to holds junk (overwritten);
    // rows past it stay NaN, which the kernel must not read.
    for (Tensor* t : {&kc, &vc})
      for (int64_t b = 0; b < c.B; ++b)
        for (int64_t s = 0; s < std::min<int64_t>(c.lens[b] + 1, c.Lmax); ++s)
          for (int64_t h = 0; h < t->H; ++h)
            for (int64_t d = 0; d < t->D; ++d) t->set(b, s, h, d, s == c.lens[b] && c.append ? 1e3 : nd(rng));
    p.dtype = c.dt;
    p.batch = c.B, p.max_seqlen = c.Lmax, p.num_heads = c.H, p.num_kv_heads = c.Hkv;
    p.head_dim = c.D, p.head_dim_v = c.Dv;
    p.q = q.cview(), p.o = o.mview();
    if (c.append) p.k_new = kn.cview(), p.v_new = vn.cview();
    p.k_cache = kc.mview(), p.v_cache = vc.mview();
    p.cache_seqlens = c.lens.data();
    p.scale = 0.25, p.split_size = c.split;
  }
};

// The decode token of batch entry b as a one-sequence problem over its L keys (the cache rows,
// with k_new/v_new appended when given); q rows of the sequence: the first L - 1 random, the last
// one the decode query (Tq = Tk = L; only the last row is compared).
RefProblem step_problem(const StepRun& r, int64_t b, std::mt19937& rng) {
  const StepCase& c = r.c;
  const int64_t L = c.lens[b] + (c.append ? 1 : 0);
  RefProblem rp{1, std::max<int64_t>(L, 1), L, c.H, c.Hkv, c.D, c.Dv, {}, 0.25, true, {}, {}, {}, {}};
  std::normal_distribution<double> nd(0, 1);
  rp.q.resize(rp.Tq * c.H * c.D);
  for (double& e : rp.q) e = nd(rng);
  for (int64_t h = 0; h < c.H; ++h)
    for (int64_t d = 0; d < c.D; ++d) rp.q[rp.iq(0, rp.Tq - 1, h, d)] = r.q.get(b, 0, h, d);
  rp.k.resize(L * c.Hkv * c.D);
  rp.v.resize(L * c.Hkv * c.Dv);
  for (int64_t j = 0; j < L; ++j)
    for (int64_t g = 0; g < c.Hkv; ++g) {
      const bool is_new = c.append && j == c.lens[b];
      for (int64_t d = 0; d < c.D; ++d) rp.k[rp.ik(0, j, g, d)] = is_new ? r.kn.get(b, 0, g, d) : r.kc.get(b, j, g, d);
      for (int64_t d = 0; d < c.Dv; ++d) rp.v[rp.iv(0, j, g, d)] = is_new ? r.vn.get(b, 0, g, d) : r.vc.get(b, j, g, d);
    }
  rp.dout.assign(rp.Tq * c.H * c.Dv, 0.0);
  return rp;
}

// Library forward over the same keys (Tq = Tk = L, the decode query last) as a second reference.
vec library_last_row(const RefProblem& rp) {
  Case c;
  c.dt = DType::kFloat64, c.B = 1, c.Tq = rp.Tq, c.Tk = rp.Tk, c.H = rp.H, c.Hkv = rp.Hkv, c.D = rp.D,
  c.Dv = rp.Dv, c.scale = rp.scale;
  Run run(c, 0);
  for (int64_t t = 0; t < c.Tq; ++t)
    for (int64_t h = 0; h < c.H; ++h)
      for (int64_t d = 0; d < c.D; ++d) run.q.set(0, t, h, d, rp.q[rp.iq(0, t, h, d)]);
  for (int64_t t = 0; t < c.Tk; ++t)
    for (int64_t g = 0; g < c.Hkv; ++g) {
      for (int64_t d = 0; d < c.D; ++d) run.k.set(0, t, g, d, rp.k[rp.ik(0, t, g, d)]);
      for (int64_t d = 0; d < c.Dv; ++d) run.v.set(0, t, g, d, rp.v[rp.iv(0, t, g, d)]);
    }
  vec out(c.H * c.Dv, 0.0);
  if (run.fwd() != Status::kSuccess) return vec(c.H * c.Dv, std::numeric_limits<double>::quiet_NaN());
  for (int64_t h = 0; h < c.H; ++h)
    for (int64_t d = 0; d < c.Dv; ++d) out[h * c.Dv + d] = run.o.get(0, c.Tq - 1, h, d);
  return out;
}

void check_step(const StepCase& c, uint32_t seed) {
  StepRun run(c, seed);
  const Tensor kc0 = run.kc, vc0 = run.vc;
  const Status s = attnrnn::softmax_attn_step(run.p);
  EXPECT(s == Status::kSuccess, "step %s status %d: %s", c.str().c_str(), (int)s, attnrnn::last_error_message());
  if (s != Status::kSuccess) return;
  const double tol = fwd_tol(c.dt);
  std::mt19937 rng(seed + 1);
  for (int64_t b = 0; b < c.B; ++b) {
    // Caches: only row cache_seqlens[b] changes (to k_new, v_new), and only when appending.
    int64_t changed = 0, wrong = 0;
    for (int64_t t = 0; t < c.Lmax; ++t)
      for (int64_t g = 0; g < c.Hkv; ++g) {
        const bool row = c.append && t == c.lens[b];
        for (int64_t d = 0; d < c.D; ++d) {
          const double x = run.kc.get(b, t, g, d), x0 = kc0.get(b, t, g, d);
          if (row) wrong += x != run.kn.get(b, 0, g, d);
          else changed += !(x == x0 || (std::isnan(x) && std::isnan(x0)));
        }
        for (int64_t d = 0; d < c.Dv; ++d) {
          const double x = run.vc.get(b, t, g, d), x0 = vc0.get(b, t, g, d);
          if (row) wrong += x != run.vn.get(b, 0, g, d);
          else changed += !(x == x0 || (std::isnan(x) && std::isnan(x0)));
        }
      }
    EXPECT(changed == 0 && wrong == 0, "step %s b=%lld: %lld cache entries changed, %lld appended entries wrong",
           c.str().c_str(), (long long)b, (long long)changed, (long long)wrong);

    vec o(c.H * c.Dv);
    for (int64_t h = 0; h < c.H; ++h)
      for (int64_t d = 0; d < c.Dv; ++d) o[h * c.Dv + d] = run.o.get(b, 0, h, d);
    const int64_t L = c.lens[b] + (c.append ? 1 : 0);
    if (L == 0) {
      bool zero = true;
      for (double x : o) zero = zero && x == 0.0;
      EXPECT(zero, "step %s b=%lld: no key, o must be 0", c.str().c_str(), (long long)b);
      continue;
    }
    const RefProblem rp = step_problem(run, b, rng);
    vec ro, rl;
    rp.forward(ro, rl);
    const vec ref(ro.end() - c.H * c.Dv, ro.end());
    const double e = rel_rms(o, ref);
    EXPECT(e <= tol, "step %s b=%lld vs reference last row: rel rms %.3g", c.str().c_str(), (long long)b, e);
    if (c.dt == DType::kFloat64) {
      const double e2 = rel_rms(o, library_last_row(rp));
      EXPECT(e2 <= 1e-12, "step %s b=%lld vs library forward last row: rel rms %.3g", c.str().c_str(), (long long)b,
             e2);
    }
  }
}

void check_step_rejects_out_of_range() {
  for (bool append : {true, false})
    for (int32_t badlen : {-1, 301, 300}) {
      if (!append && badlen == 300) continue;  // 300 keys fit without an append
      StepCase c;
      c.append = append;
      c.lens = {5, 137, badlen};  // the bad entry last: nothing may be appended for the good ones
      StepRun run(c, 11);
      const std::vector<unsigned char> k0 = run.kc.bytes, v0 = run.vc.bytes;
      const Status s = attnrnn::softmax_attn_step(run.p);
      const std::string msg = attnrnn::last_error_message();
      EXPECT(s == Status::kInvalidArgument, "step with cache_seqlens[2] = %d (append %d): status %d", badlen,
             (int)append, (int)s);
      EXPECT(msg.find("cache_seqlens") != std::string::npos, "step out-of-range message does not name cache_seqlens: %s",
             msg.c_str());
      EXPECT(run.kc.bytes == k0 && run.vc.bytes == v0,
             "step with cache_seqlens[2] = %d (append %d) modified the caches", badlen, (int)append);
    }
}

// ---- invalid params ---------------------------------------------------------------------------

void expect_invalid(Status s, const std::string& what) {
  EXPECT(s == Status::kInvalidArgument, "%s: status %d (%s), expected invalid argument", what.c_str(), (int)s,
         attnrnn::last_error_message());
  if (s == Status::kInvalidArgument)
    EXPECT(std::strlen(attnrnn::last_error_message()) > 0, "%s: empty error message", what.c_str());
}

void check_invalid_params() {
  Case c;
  c.dt = DType::kFloat32, c.B = 1, c.Tq = c.Tk = 10, c.H = 4, c.Hkv = 2, c.D = 8, c.Dv = 8;
  using P = attnrnn::SoftmaxAttnParams;
  struct Mut {
    const char* name;
    void (*f)(P&);
    bool fwd, bwd;  // which ops must reject it
  };
  static int32_t bad_start[] = {1, 5, 10}, decreasing[] = {0, 6, 4, 10}, short_end[] = {0, 5, 9},
                 long_end[] = {0, 5, 11};
  static int64_t bad_start64[] = {1, 5, 10};
  const Mut muts[] = {
      {"q null", [](P& p) { p.q.data = nullptr; }, true, true},
      {"k null", [](P& p) { p.k.data = nullptr; }, true, true},
      {"v null", [](P& p) { p.v.data = nullptr; }, true, true},
      {"o null", [](P& p) { p.o.data = nullptr; }, true, false},
      {"lse null", [](P& p) { p.lse = nullptr; }, true, true},
      {"dout null", [](P& p) { p.dout.data = nullptr; }, false, true},
      {"out null", [](P& p) { p.out.data = nullptr; }, false, true},
      {"dq null", [](P& p) { p.dq.data = nullptr; }, false, true},
      {"dk null", [](P& p) { p.dk.data = nullptr; }, false, true},
      {"dv null", [](P& p) { p.dv.data = nullptr; }, false, true},
      {"H % Hkv != 0", [](P& p) { p.num_kv_heads = 3; }, true, true},
      {"Hkv 0", [](P& p) { p.num_kv_heads = 0; }, true, true},
      {"H 0", [](P& p) { p.num_heads = 0; }, true, true},
      {"head_dim 0", [](P& p) { p.head_dim = 0; }, true, true},
      {"head_dim 257", [](P& p) { p.head_dim = 257; }, true, true},
      {"head_dim_v 0", [](P& p) { p.head_dim_v = 0; }, true, true},
      {"head_dim_v 257", [](P& p) { p.head_dim_v = 257; }, true, true},
      {"batch -1", [](P& p) { p.batch = -1; }, true, true},
      {"seqlen_q -1", [](P& p) { p.seqlen_q = -1; }, true, true},
      {"seqlen_k -1", [](P& p) { p.seqlen_k = -1; }, true, true},
      {"scale NaN", [](P& p) { p.scale = std::numeric_limits<double>::quiet_NaN(); }, true, true},
      {"scale inf", [](P& p) { p.scale = std::numeric_limits<double>::infinity(); }, true, true},
      {"seqlen 2^62", [](P& p) { p.seqlen_q = p.seqlen_k = int64_t(1) << 62; }, true, true},
      {"cu_seqlens not starting at 0", [](P& p) { p.cu_seqlens = bad_start, p.num_seqs = 2; }, true, true},
      {"cu_seqlens (int64) not starting at 0",
       [](P& p) { p.cu_seqlens = bad_start64, p.cu_seqlens_int64 = true, p.num_seqs = 2; }, true, true},
      {"cu_seqlens decreasing", [](P& p) { p.cu_seqlens = decreasing, p.num_seqs = 3; }, true, true},
      {"cu_seqlens ending before T", [](P& p) { p.cu_seqlens = short_end, p.num_seqs = 2; }, true, true},
      {"cu_seqlens ending after T", [](P& p) { p.cu_seqlens = long_end, p.num_seqs = 2; }, true, true},
      {"cu_seqlens with batch 2",
       [](P& p) { p.cu_seqlens = short_end, p.num_seqs = 2, p.batch = 2, short_end[2] = 10; }, true, true},
      {"cu_seqlens with Tq != Tk", [](P& p) { p.cu_seqlens = short_end, p.num_seqs = 2, p.seqlen_k = 9; }, true, true},
      {"num_seqs -1", [](P& p) { static int32_t z[] = {0}; p.cu_seqlens = z, p.num_seqs = -1; }, true, true},
  };
  {
    Run run(c, 3);
    EXPECT(run.fwd() == Status::kSuccess && run.bwd() == Status::kSuccess, "invalid-params base case must pass: %s",
           attnrnn::last_error_message());
  }
  for (const Mut& m : muts) {
    short_end[2] = 9;
    Run run(c, 3);
    const std::vector<unsigned char> o0 = run.o.bytes;
    m.f(run.p);
    if (m.fwd) {
      expect_invalid(run.fwd(), std::string("softmax_attn_fwd with ") + m.name);
      EXPECT(run.o.bytes == o0, "softmax_attn_fwd with %s wrote o", m.name);
    }
    if (m.bwd) expect_invalid(run.bwd(), std::string("softmax_attn_bwd with ") + m.name);
  }

  // The decode step.
  using SP = attnrnn::SoftmaxAttnStepParams;
  struct SMut {
    const char* name;
    void (*f)(SP&);
  };
  const SMut smuts[] = {
      {"q null", [](SP& p) { p.q.data = nullptr; }},
      {"o null", [](SP& p) { p.o.data = nullptr; }},
      {"cache_seqlens null", [](SP& p) { p.cache_seqlens = nullptr; }},
      {"k_cache null", [](SP& p) { p.k_cache.data = nullptr; }},
      {"v_cache null", [](SP& p) { p.v_cache.data = nullptr; }},
      {"k_new without v_new", [](SP& p) { p.v_new.data = nullptr; }},
      {"v_new without k_new", [](SP& p) { p.k_new.data = nullptr; }},
      {"H % Hkv != 0", [](SP& p) { p.num_kv_heads = 3; }},
      {"head_dim 0", [](SP& p) { p.head_dim = 0; }},
      {"head_dim 257", [](SP& p) { p.head_dim = 257; }},
      {"head_dim_v 0", [](SP& p) { p.head_dim_v = 0; }},
      {"head_dim_v 257", [](SP& p) { p.head_dim_v = 257; }},
      {"max_seqlen -1", [](SP& p) { p.max_seqlen = -1; }},
      {"split_size -1", [](SP& p) { p.split_size = -1; }},
      {"scale NaN", [](SP& p) { p.scale = std::numeric_limits<double>::quiet_NaN(); }},
      {"scale inf", [](SP& p) { p.scale = std::numeric_limits<double>::infinity(); }},
      {"max_seqlen 2^62", [](SP& p) { p.max_seqlen = int64_t(1) << 62; }},
  };
  StepCase sc;
  sc.dt = DType::kFloat32, sc.Lmax = 40, sc.lens = {0, 10, 39};
  for (const SMut& m : smuts) {
    StepRun run(sc, 5);
    const std::vector<unsigned char> k0 = run.kc.bytes, v0 = run.vc.bytes;
    m.f(run.p);
    expect_invalid(attnrnn::softmax_attn_step(run.p), std::string("softmax_attn_step with ") + m.name);
    EXPECT(run.kc.bytes == k0 && run.vc.bytes == v0, "softmax_attn_step with %s modified the caches", m.name);
  }
  // The softmax structs call their first head dim head_dim: errors must too.
  {
    Run run(c, 3);
    run.p.head_dim = 0;
    run.fwd();
    const std::string msg = attnrnn::last_error_message();
    EXPECT(msg.rfind("head_dim must", 0) == 0, "head_dim 0 gave '%s', not naming head_dim", msg.c_str());
  }
  // split_size = INT64_MAX is valid (one split): the same output as the default plan's single split.
  {
    StepRun a(sc, 5), b(sc, 5);
    b.p.split_size = std::numeric_limits<int64_t>::max();
    EXPECT(attnrnn::softmax_attn_step(a.p) == Status::kSuccess && attnrnn::softmax_attn_step(b.p) == Status::kSuccess,
           "step with split_size INT64_MAX: %s", attnrnn::last_error_message());
    EXPECT(a.o.bytes == b.o.bytes, "split_size INT64_MAX changed the output");
  }
}

// ---- executors --------------------------------------------------------------------------------

struct Outputs {
  std::vector<unsigned char> o, lse, dq, dk, dv;
};

Outputs run_with(const Case& c, attnrnn::CpuExecutor ex) {
  Run run(c, 21);
  run.p.executor = ex;
  EXPECT(run.fwd() == Status::kSuccess && run.bwd() == Status::kSuccess, "executor run %s: %s", c.str().c_str(),
         attnrnn::last_error_message());
  return {run.o.bytes, run.lse, run.dq.bytes, run.dk.bytes, run.dv.bytes};
}

std::vector<unsigned char> step_with(const StepCase& c, attnrnn::CpuExecutor ex) {
  StepRun run(c, 23);
  run.p.executor = ex;
  EXPECT(attnrnn::softmax_attn_step(run.p) == Status::kSuccess, "executor step %s: %s", c.str().c_str(),
         attnrnn::last_error_message());
  std::vector<unsigned char> out = run.o.bytes;
  out.insert(out.end(), run.kc.bytes.begin(), run.kc.bytes.end());
  return out;
}

void check_executors() {
  attnrnn::CpuExecutor serial, reverse, pool1, pool4, pool_default;
  serial.parallel_for = serial_for;
  reverse.parallel_for = reverse_for;
  pool1.num_threads = 1;
  pool4.num_threads = 4;
  const std::pair<const char*, attnrnn::CpuExecutor> others[] = {
      {"reverse", reverse}, {"pool(1)", pool1}, {"pool(4)", pool4}, {"pool(default)", pool_default}};
  std::vector<Case> cases;
  {
    Case c;
    c.dt = DType::kFloat32, c.B = 2, c.Tq = 150, c.Tk = 200, c.H = 4, c.Hkv = 2, c.D = 40, c.Dv = 24;
    cases.push_back(c);
    c.B = 1, c.Tq = c.Tk = 260, c.cu = {0, 0, 1, 100, 101, 260}, c.strided = true;
    cases.push_back(c);
    c.dt = DType::kFloat64;
    cases.push_back(c);
  }
  for (const Case& c : cases) {
    const Outputs base = run_with(c, serial);
    for (const auto& [name, ex] : others) {
      const Outputs x = run_with(c, ex);
      EXPECT(x.o == base.o && x.lse == base.lse, "fwd %s: %s executor differs bitwise from serial", c.str().c_str(),
             name);
      EXPECT(x.dq == base.dq && x.dk == base.dk && x.dv == base.dv,
             "bwd %s: %s executor differs bitwise from serial", c.str().c_str(), name);
    }
  }
  for (int64_t split : {0, 64}) {
    StepCase sc;
    sc.dt = DType::kFloat32, sc.Lmax = 1000, sc.lens = {0, 517, 999}, sc.split = split;
    const auto base = step_with(sc, serial);
    for (const auto& [name, ex] : others)
      EXPECT(step_with(sc, ex) == base, "step %s: %s executor differs bitwise from serial", sc.str().c_str(), name);
  }
}

}  // namespace

int main() {
  // 0. The reference backward itself.
  check_reference_gradients();

  // 1. Forward and backward against the reference: Tq != Tk, GQA, D != Dv, strides, dtypes.
  const std::pair<int64_t, int64_t> shapes[] = {{1, 239}, {3, 799}, {64, 64}, {65, 130}, {130, 65}, {100, 40},
                                                {7, 0},   {0, 9},   {1, 1},   {200, 200}};
  uint32_t seed = 100;
  for (DType dt : {DType::kFloat64, DType::kFloat32})
    for (auto [Tq, Tk] : shapes)
      for (int variant = 0; variant < 3; ++variant) {
        Case c;
        c.dt = dt, c.Tq = Tq, c.Tk = Tk;
        if (variant == 0) c.B = 2, c.H = 2, c.Hkv = 2, c.D = 32, c.Dv = 32;
        if (variant == 1) c.B = 1, c.H = 6, c.Hkv = 2, c.D = 24, c.Dv = 40, c.strided = true;  // GQA
        if (variant == 2) c.B = 3, c.H = 4, c.Hkv = 1, c.D = 65, c.Dv = 7, c.scale = 0.15;    // MQA
        check_forward(c, seed++, true);
      }

  // 2. Non-causal, and large head dims.
  for (DType dt : {DType::kFloat64, DType::kFloat32}) {
    Case c;
    c.dt = dt, c.B = 2, c.Tq = 70, c.Tk = 150, c.H = 4, c.Hkv = 2, c.D = 20, c.Dv = 36, c.causal = false;
    check_forward(c, seed++, true);
    c.causal = true, c.Tq = 33, c.Tk = 70, c.H = 2, c.D = 256, c.Dv = 256, c.scale = 0.06, c.strided = true;
    check_forward(c, seed++, true);
  }

  // 3. Varlen: empty and 1-token sequences, int32 and int64 offsets, both dtypes; empty packing.
  const std::vector<std::vector<int64_t>> packings = {
      {0, 0, 1, 1, 50, 51, 130}, {0, 130}, {0, 1}, {0, 0}, {0, 65, 65, 66, 200}, {0}};
  for (DType dt : {DType::kFloat64, DType::kFloat32})
    for (const auto& cu : packings)
      for (bool cu64 : {false, true}) {
        Case c;
        c.dt = dt, c.B = 1, c.Tq = c.Tk = cu.back(), c.H = 4, c.Hkv = 2, c.D = 16, c.Dv = 24;
        c.cu = cu, c.cu64 = cu64, c.strided = cu64;
        check_forward(c, seed++, true);
        c.causal = false;
        check_forward(c, seed++, true);
      }

  // 4. Half precisions: forward within their own tolerance.
  for (DType dt : {DType::kFloat16, DType::kBFloat16}) {
    Case c;
    c.dt = dt, c.B = 2, c.Tq = 65, c.Tk = 130, c.H = 4, c.Hkv = 2, c.D = 32, c.Dv = 48;
    check_forward(c, seed++, false);
  }

  // 5. Decode step: several split sizes, with and without append, GQA, strides, both dtypes.
  for (DType dt : {DType::kFloat64, DType::kFloat32})
    for (int64_t split : {0, 1, 7, 64, 100, 1000})
      for (bool append : {true, false}) {
        StepCase sc;
        sc.dt = dt, sc.split = split, sc.append = append, sc.strided = split % 2 == 1;
        if (!append) sc.lens = {0, 137, 300};
        check_step(sc, seed++);
      }
  {
    StepCase sc;  // MHA, D != Dv small, long caches
    sc.dt = DType::kFloat32, sc.B = 2, sc.Lmax = 2000, sc.H = 3, sc.Hkv = 3, sc.D = 8, sc.Dv = 5,
    sc.lens = {1999, 1};
    check_step(sc, seed++);
    sc.lens = {0, 0};
    check_step(sc, seed++);
  }
  check_step_rejects_out_of_range();

  // 6. Invalid params.
  check_invalid_params();

  // 7. Executors: bitwise identical.
  check_executors();

  return finish("test_softmax");
}
