// Public entry points: validate the params once, then hand them to the device's kernels.
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <initializer_list>
#include <utility>

#include "attnrnn/attnrnn.h"
#include "host_device.h"
#include "kernels.h"

namespace attnrnn {

namespace {
thread_local char g_last_error[512] = "";
}  // namespace

Status fail(Status status, const char* fmt, ...) {
  va_list args;
  va_start(args, fmt);
  std::vsnprintf(g_last_error, sizeof g_last_error, fmt, args);
  va_end(args);
  return status;
}

const char* last_error_message() { return g_last_error; }

const char* status_string(Status status) {
  switch (status) {
    case Status::kSuccess: return "success";
    case Status::kInvalidArgument: return "invalid argument";
    case Status::kNotImplemented: return "not implemented";
    case Status::kNotCompiled: return "not compiled";
    case Status::kDeviceError: return "device error";
  }
  return "unknown status";
}

int64_t chunk_linear_attn_saved_bytes(const LinearAttnFwdParams& p) {
#ifdef ATTNRNN_WITH_CUDA
  if (p.device == Device::kCUDA) return cuda::chunk_saved_bytes(p);
#else
  (void)p;
#endif
  return 0;
}

int64_t chunk_linear_attn_fwd_workspace_bytes(const LinearAttnFwdParams& p) {
#ifdef ATTNRNN_WITH_CUDA
  if (p.device == Device::kCUDA) return cuda::chunk_fwd_workspace_bytes(p);
#else
  (void)p;
#endif
  return 0;
}

int64_t chunk_linear_attn_bwd_workspace_bytes(const LinearAttnBwdParams& p) {
#ifdef ATTNRNN_WITH_CUDA
  if (p.device == Device::kCUDA) return cuda::chunk_bwd_workspace_bytes(p);
#else
  (void)p;
#endif
  return 0;
}

int64_t recurrent_linear_attn_bwd_workspace_bytes(const LinearAttnBwdParams& p) {
#ifdef ATTNRNN_WITH_CUDA
  if (p.device == Device::kCUDA) return cuda::recurrent_bwd_workspace_bytes(p);
#else
  (void)p;
#endif
  return 0;
}

bool built_with_cuda() {
#ifdef ATTNRNN_WITH_CUDA
  return true;
#else
  return false;
#endif
}

bool built_with_wgmma() {
#ifdef ATTNRNN_WGMMA
  return true;
#else
  return false;
#endif
}

namespace {

constexpr int64_t kMaxHeadDim = 256;

#define ATTNRNN_REQUIRE(cond, ...) \
  do {                             \
    if (!(cond)) return fail(Status::kInvalidArgument, __VA_ARGS__); \
  } while (0)

// The names of the head dims in the params struct being checked.
struct HeadDimNames {
  const char* k;
  const char* v;
};
constexpr HeadDimNames kLinearDims{"head_dim_k", "head_dim_v"}, kSoftmaxDims{"head_dim", "head_dim_v"};

Status check_common(int64_t batch, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim_k,
                    int64_t head_dim_v, double eps, HeadDimNames dims = kLinearDims) {
  ATTNRNN_REQUIRE(batch >= 0, "batch must be >= 0, got %lld", (long long)batch);
  ATTNRNN_REQUIRE(num_heads >= 1, "num_heads must be >= 1, got %lld", (long long)num_heads);
  ATTNRNN_REQUIRE(num_kv_heads >= 1 && num_heads % num_kv_heads == 0,
                  "num_kv_heads must divide num_heads (%lld), got %lld", (long long)num_heads,
                  (long long)num_kv_heads);
  ATTNRNN_REQUIRE(head_dim_k >= 1 && head_dim_k <= kMaxHeadDim, "%s must be in [1, 256], got %lld", dims.k,
                  (long long)head_dim_k);
  ATTNRNN_REQUIRE(head_dim_v >= 1 && head_dim_v <= kMaxHeadDim, "%s must be in [1, 256], got %lld", dims.v,
                  (long long)head_dim_v);
  ATTNRNN_REQUIRE(std::isfinite(eps) && eps >= 0, "eps must be finite and >= 0, got %g", eps);
  return Status::kSuccess;
}

// The largest tensor an op may index: 2^60 elements (an exabyte at 1 byte each), so that no
// element index, or index plus stride, overflows int64 in the kernels' arithmetic.
constexpr int64_t kMaxElements = int64_t(1) << 60;

// Whether a * b * c * d (each >= 0) stays within kMaxElements.
bool elements_fit(int64_t a, int64_t b, int64_t c, int64_t d) {
  int64_t n = a;
  for (int64_t f : {b, c, d})
    if (__builtin_mul_overflow(n, f, &n) || n > kMaxElements) return false;
  return true;  // every partial product, the last included, was checked in the loop
}

#define ATTNRNN_REQUIRE_FITS(a, b, c, d, what)                                                          \
  ATTNRNN_REQUIRE(elements_fit(a, b, c, d), "%s has more than 2^60 elements (%lld x %lld x %lld x %lld)", \
                  what, (long long)(a), (long long)(b), (long long)(c), (long long)(d))

bool known_feature_map(FeatureMap fm) {
  return fm == FeatureMap::kIdentity || fm == FeatureMap::kElu1 || fm == FeatureMap::kRelu;
}

// Offsets of packed sequences: read on the CPU only (device values would need a sync; the CUDA
// kernels clamp them instead).
Status check_cu_seqlens(Device device, const void* cu, bool is_int64, int64_t num_seqs, int64_t seqlen) {
  ATTNRNN_REQUIRE(num_seqs >= 0, "num_seqs must be >= 0, got %lld", (long long)num_seqs);
  if (device != Device::kCPU) return Status::kSuccess;
  auto at = [&](int64_t i) { return cu_seqlens_at(cu, is_int64, i); };
  ATTNRNN_REQUIRE(at(0) == 0, "cu_seqlens must start at 0, got %lld", (long long)at(0));
  ATTNRNN_REQUIRE(at(num_seqs) == seqlen, "cu_seqlens must end at seqlen = %lld, got %lld", (long long)seqlen,
                  (long long)at(num_seqs));
  for (int64_t i = 1; i <= num_seqs; ++i) {
    ATTNRNN_REQUIRE(at(i) >= at(i - 1), "cu_seqlens must be non-decreasing, got cu_seqlens[%lld] = %lld < %lld",
                    (long long)i, (long long)at(i), (long long)at(i - 1));
  }
  return Status::kSuccess;
}

Status check_sequence(const LinearAttnFwdParams& p, const LinearAttnBwdParams* backward) {
  Status s = check_common(p.batch, p.num_heads, p.num_kv_heads, p.head_dim_k, p.head_dim_v, p.eps);
  if (s != Status::kSuccess) return s;
  ATTNRNN_REQUIRE(p.seqlen >= 0, "seqlen must be >= 0, got %lld", (long long)p.seqlen);
  ATTNRNN_REQUIRE(p.chunk_size >= 0 && p.chunk_size <= 1024,
                  "chunk_size must be in [0, 1024] (0 = default), got %lld", (long long)p.chunk_size);
  ATTNRNN_REQUIRE(std::isfinite(p.scale), "scale must be finite, got %g", p.scale);
  ATTNRNN_REQUIRE(known_feature_map(p.feature_map), "feature_map must be kIdentity, kElu1 or kRelu, got %d",
                  static_cast<int>(p.feature_map));
  ATTNRNN_REQUIRE_FITS(p.batch, p.seqlen, p.num_heads, p.head_dim_k, "q [batch, seqlen, num_heads, head_dim_k]");
  ATTNRNN_REQUIRE_FITS(p.batch, p.seqlen, p.num_heads, p.head_dim_v, "o [batch, seqlen, num_heads, head_dim_v]");
  ATTNRNN_REQUIRE_FITS(p.cu_seqlens != nullptr ? p.num_seqs : p.batch, p.num_kv_heads, p.head_dim_k, p.head_dim_v,
                       "the state [num_states, num_kv_heads, head_dim_k, head_dim_v]");
  if (p.cu_seqlens != nullptr) {
    ATTNRNN_REQUIRE(p.batch == 1, "batch must be 1 with cu_seqlens, got %lld", (long long)p.batch);
    s = check_cu_seqlens(p.device, p.cu_seqlens, p.cu_seqlens_int64, p.num_seqs, p.seqlen);
    if (s != Status::kSuccess) return s;
  }
  const bool empty = p.batch == 0 || p.seqlen == 0;
  if (!empty) {
    ATTNRNN_REQUIRE(p.q.data && p.k.data && p.v.data, "q, k and v must not be null");
    if (backward == nullptr) ATTNRNN_REQUIRE(p.o.data, "o must not be null");
  }
  if (backward != nullptr && !empty) {
    ATTNRNN_REQUIRE(backward->dout.data, "dout must not be null");
    ATTNRNN_REQUIRE(backward->dq.data && backward->dk.data && backward->dv.data, "dq, dk and dv must not be null");
  }
  if (!p.normalize) {
    ATTNRNN_REQUIRE(p.initial_z == nullptr, "initial_z must be null when normalize is false");
    ATTNRNN_REQUIRE(p.final_z == nullptr, "final_z must be null when normalize is false");
    if (backward != nullptr) {
      ATTNRNN_REQUIRE(backward->d_final_z == nullptr, "d_final_z must be null when normalize is false");
      ATTNRNN_REQUIRE(backward->d_initial_z == nullptr, "d_initial_z must be null when normalize is false");
    }
  }
  return Status::kSuccess;
}

Status check_step(const LinearAttnStepParams& p) {
  Status s = check_common(p.batch, p.num_heads, p.num_kv_heads, p.head_dim_k, p.head_dim_v, p.eps);
  if (s != Status::kSuccess) return s;
  ATTNRNN_REQUIRE(p.pool_size >= 0, "pool_size must be >= 0, got %lld", (long long)p.pool_size);
  ATTNRNN_REQUIRE(std::isfinite(p.scale), "scale must be finite, got %g", p.scale);
  ATTNRNN_REQUIRE(known_feature_map(p.feature_map), "feature_map must be kIdentity, kElu1 or kRelu, got %d",
                  static_cast<int>(p.feature_map));
  ATTNRNN_REQUIRE_FITS(p.batch, p.num_heads, p.head_dim_k, p.head_dim_v, "q, o [batch, num_heads, head_dim]");
  ATTNRNN_REQUIRE_FITS(p.pool_size, p.num_kv_heads, p.head_dim_k, p.head_dim_v,
                       "the state pool [pool_size, num_kv_heads, head_dim_k, head_dim_v]");
  if (p.state_indices == nullptr) {
    ATTNRNN_REQUIRE(p.pool_size >= p.batch,
                    "pool_size (%lld) must be >= batch (%lld) without state_indices",
                    (long long)p.pool_size, (long long)p.batch);
  }
  if (p.batch > 0) {
    ATTNRNN_REQUIRE(p.q.data && p.k.data && p.v.data && p.o.data, "q, k, v and o must not be null");
    // An empty pool (every index negative, or out of range) has no rows to point at.
    ATTNRNN_REQUIRE(p.pool_size == 0 || p.S != nullptr, "S must not be null");
    ATTNRNN_REQUIRE(p.pool_size == 0 || !p.normalize || p.z != nullptr, "z must not be null when normalize is true");
  }
  return Status::kSuccess;
}


#ifdef ATTNRNN_WITH_CUDA
#define ATTNRNN_CUDA_KERNEL(name) cuda::name
#else
#define ATTNRNN_CUDA_KERNEL(name) nullptr
#endif

// A kernel entry point; a member typedef so that nullptr (no CUDA build) does not take part in
// template argument deduction.
template <class Params>
struct KernelOf {
  using type = Status (*)(const Params&);
};

// The checked params to the device's kernel.
template <class Params>
Status dispatch(const Params& p, Status checked, typename KernelOf<Params>::type on_cpu,
                typename KernelOf<Params>::type on_cuda) {
  if (checked != Status::kSuccess) return checked;
  switch (p.device) {
    case Device::kCPU: return on_cpu(p);
    case Device::kCUDA:
      if (on_cuda == nullptr) return fail(Status::kNotCompiled, "attnrnn was built without CUDA kernels");
      return on_cuda(p);
  }
  return fail(Status::kInvalidArgument, "unknown device %d", static_cast<int>(p.device));
}

}  // namespace

Status chunk_linear_attn_fwd(const LinearAttnFwdParams& p) {
  return dispatch(p, check_sequence(p, nullptr), cpu::chunk_fwd, ATTNRNN_CUDA_KERNEL(chunk_fwd));
}
Status chunk_linear_attn_bwd(const LinearAttnBwdParams& p) {
  return dispatch(p, check_sequence(p, &p), cpu::chunk_bwd, ATTNRNN_CUDA_KERNEL(chunk_bwd));
}
Status recurrent_linear_attn_fwd(const LinearAttnFwdParams& p) {
  return dispatch(p, check_sequence(p, nullptr), cpu::recurrent_fwd, ATTNRNN_CUDA_KERNEL(recurrent_fwd));
}
Status recurrent_linear_attn_bwd(const LinearAttnBwdParams& p) {
  return dispatch(p, check_sequence(p, &p), cpu::recurrent_bwd, ATTNRNN_CUDA_KERNEL(recurrent_bwd));
}

Status linear_attn_step(const LinearAttnStepParams& p) {
  return dispatch(p, check_step(p), cpu::step, ATTNRNN_CUDA_KERNEL(step));
}

}  // namespace attnrnn

// ---- softmax attention as an RNN --------------------------------------------------------------
// CUDA params run the kernels of csrc/cuda/softmax/; a build without CUDA returns kNotCompiled.
#include "softmax_kernels.h"

namespace attnrnn {

namespace {

Status check_softmax(const SoftmaxAttnParams& p, bool backward) {
  Status s = check_common(p.batch, p.num_heads, p.num_kv_heads, p.head_dim, p.head_dim_v, 0.0, kSoftmaxDims);
  if (s != Status::kSuccess) return s;
  ATTNRNN_REQUIRE(p.seqlen_q >= 0 && p.seqlen_k >= 0, "seqlen_q and seqlen_k must be >= 0");
  const int64_t dim = p.head_dim > p.head_dim_v ? p.head_dim : p.head_dim_v;
  ATTNRNN_REQUIRE_FITS(p.batch, p.seqlen_q, p.num_heads, dim, "q, o [batch, seqlen_q, num_heads, head_dim]");
  ATTNRNN_REQUIRE_FITS(p.batch, p.seqlen_k, p.num_kv_heads, dim, "k, v [batch, seqlen_k, num_kv_heads, head_dim]");
  if (p.cu_seqlens != nullptr) {
    ATTNRNN_REQUIRE(p.batch == 1, "batch must be 1 with cu_seqlens, got %lld", (long long)p.batch);
    ATTNRNN_REQUIRE(p.seqlen_q == p.seqlen_k, "seqlen_q (%lld) must equal seqlen_k (%lld) with cu_seqlens",
                            (long long)p.seqlen_q, (long long)p.seqlen_k);
    s = check_cu_seqlens(p.device, p.cu_seqlens, p.cu_seqlens_int64, p.num_seqs, p.seqlen_q);
    if (s != Status::kSuccess) return s;
  }
  if (p.batch > 0 && p.seqlen_q > 0) {
    ATTNRNN_REQUIRE(p.q.data != nullptr, "q must not be null");
    ATTNRNN_REQUIRE(p.lse != nullptr, "lse must not be null");
    ATTNRNN_REQUIRE(backward || p.o.data != nullptr, "o must not be null");
    if (backward) {
      ATTNRNN_REQUIRE(p.dout.data && p.out.data && p.dq.data, "dout, out and dq must not be null");
    }
  }
  if (p.batch > 0 && p.seqlen_k > 0) {
    ATTNRNN_REQUIRE(p.k.data && p.v.data, "k and v must not be null");
    ATTNRNN_REQUIRE(!backward || (p.dk.data && p.dv.data), "dk and dv must not be null");
  }
  ATTNRNN_REQUIRE(std::isfinite(p.scale), "scale must be finite, got %g", p.scale);
  return Status::kSuccess;
}

Status check_softmax_step(const SoftmaxAttnStepParams& p) {
  Status s = check_common(p.batch, p.num_heads, p.num_kv_heads, p.head_dim, p.head_dim_v, 0.0, kSoftmaxDims);
  if (s != Status::kSuccess) return s;
  ATTNRNN_REQUIRE(p.max_seqlen >= 0, "max_seqlen must be >= 0, got %lld", (long long)p.max_seqlen);
  ATTNRNN_REQUIRE(p.split_size >= 0, "split_size must be >= 0, got %lld", (long long)p.split_size);
  const int64_t dim = p.head_dim > p.head_dim_v ? p.head_dim : p.head_dim_v;
  ATTNRNN_REQUIRE_FITS(p.batch, p.max_seqlen, p.num_kv_heads, dim,
                       "the caches [batch, max_seqlen, num_kv_heads, head_dim]");
  ATTNRNN_REQUIRE((p.k_new.data == nullptr) == (p.v_new.data == nullptr),
                          "k_new and v_new must be given together");
  if (p.batch > 0) {
    ATTNRNN_REQUIRE(p.q.data && p.o.data && p.cache_seqlens, "q, o and cache_seqlens must not be null");
    ATTNRNN_REQUIRE(p.max_seqlen == 0 || (p.k_cache.data && p.v_cache.data),
                            "k_cache and v_cache must not be null");
  }
  ATTNRNN_REQUIRE(std::isfinite(p.scale), "scale must be finite, got %g", p.scale);
  return Status::kSuccess;
}


}  // namespace

Status softmax_attn_fwd(const SoftmaxAttnParams& p) {
  return dispatch(p, check_softmax(p, false), cpu::softmax_fwd, ATTNRNN_CUDA_KERNEL(softmax_fwd));
}
Status softmax_attn_bwd(const SoftmaxAttnParams& p) {
  return dispatch(p, check_softmax(p, true), cpu::softmax_bwd, ATTNRNN_CUDA_KERNEL(softmax_bwd));
}
Status softmax_attn_step(const SoftmaxAttnStepParams& p) {
  return dispatch(p, check_softmax_step(p), cpu::softmax_step, ATTNRNN_CUDA_KERNEL(softmax_step));
}

}  // namespace attnrnn

#undef ATTNRNN_REQUIRE
