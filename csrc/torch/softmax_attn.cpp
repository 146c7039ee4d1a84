// ATen glue of the softmax-attention ops: check every argument (naming it), allocate outputs,
// fill the torch-free params, turn a status into an exception. No math lives here.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/DeviceGuard.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <sstream>
#include <string>
#include <vector>

#include "attnrnn/attnrnn.h"
#include "attnrnn/torch_softmax.h"

namespace attnrnn::aten {

namespace {

using OptTensor = std::optional<at::Tensor>;

std::string shape_str(const at::Tensor& t) {
  std::ostringstream os;
  os << t.sizes();
  return os.str();
}

DType input_dtype(const at::Tensor& t, const char* op, const char* name) {
  switch (t.scalar_type()) {
    case at::kDouble: return DType::kFloat64;
    case at::kFloat: return DType::kFloat32;
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    default:
      TORCH_CHECK_VALUE(false, op, ": ", name, " must be float64, float32, float16 or bfloat16, got ",
                        t.scalar_type());
  }
}

at::ScalarType acc_type(const at::Tensor& q) { return q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat; }

void same_device(const at::Tensor& t, const at::Tensor& q, const char* op, const char* name) {
  TORCH_CHECK_VALUE(t.device() == q.device(), op, ": ", name, " must be on the device of q (", q.device(),
                    "), got ", t.device());
}

void same_dtype(const at::Tensor& t, const at::Tensor& q, const char* op, const char* name) {
  TORCH_CHECK_VALUE(t.scalar_type() == q.scalar_type(), op, ": ", name, " must have the dtype of q (",
                    q.scalar_type(), "), got ", t.scalar_type());
}

void rank(const at::Tensor& t, int64_t r, const char* op, const char* name, const char* layout) {
  TORCH_CHECK_VALUE(t.dim() == r, op, ": ", name, " must be a ", r, "-D tensor ", layout, ", got shape ",
                    shape_str(t));
}

void unit_last_stride(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK_VALUE(t.size(-1) <= 1 || t.stride(-1) == 1, op, ": ", name,
                    " must have unit stride in its last dimension, got strides ", t.strides());
}

void head_dims(int64_t H, int64_t Hkv, int64_t D, int64_t Dv, const char* op) {
  TORCH_CHECK_VALUE(Hkv >= 1 && H % Hkv == 0, op, ": the heads of k and v (", Hkv,
                    ") must divide the heads of q (", H, ")");
  TORCH_CHECK_VALUE(D >= 1 && D <= 256, op, ": q and k head dim D must be in [1, 256], got ", D);
  TORCH_CHECK_VALUE(Dv >= 1 && Dv <= 256, op, ": v head dim Dv must be in [1, 256], got ", Dv);
}

ConstView cview(const at::Tensor& t) { return ConstView{t.data_ptr(), t.stride(0), t.stride(1), t.stride(2)}; }
MutView mview(const at::Tensor& t) { return MutView{t.data_ptr(), t.stride(0), t.stride(1), t.stride(2)}; }

template <class Params>
void place(Params& p, const at::Tensor& q) {
  p.executor.num_threads = at::get_num_threads();
  p.device = q.is_cuda() ? Device::kCUDA : Device::kCPU;
  TORCH_CHECK_VALUE(q.is_cuda() || q.is_cpu(), "attnrnn: tensors must be on CPU or CUDA, got ", q.device());
}

void raise_on(Status status, const char* op) {
  if (status == Status::kSuccess) return;
  const std::string detail = last_error_message();
  TORCH_CHECK_VALUE(status != Status::kInvalidArgument, op, ": ", detail);
  TORCH_CHECK_NOT_IMPLEMENTED(status != Status::kNotImplemented && status != Status::kNotCompiled, op, ": ",
                              detail);
  TORCH_CHECK(false, op, ": ", status_string(status), ": ", detail);
}

struct Args {
  SoftmaxAttnParams p;
  at::Tensor cu;  // kept alive
};

Args sequence_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const OptTensor& cu_seqlens,
                   double scale, bool causal, const char* op) {
  rank(q, 4, op, "q", "[B, Tq, H, D]");
  rank(k, 4, op, "k", "[B, Tk, Hkv, D]");
  rank(v, 4, op, "v", "[B, Tk, Hkv, Dv]");
  same_device(k, q, op, "k");
  same_device(v, q, op, "v");
  Args a;
  SoftmaxAttnParams& p = a.p;
  p.dtype = input_dtype(q, op, "q");
  same_dtype(k, q, op, "k");
  same_dtype(v, q, op, "v");
  const int64_t B = q.size(0), Tq = q.size(1), H = q.size(2), D = q.size(3);
  const int64_t Tk = k.size(1), Hkv = k.size(2), Dv = v.size(3);
  TORCH_CHECK_VALUE(k.size(0) == B, op, ": k must have the batch of q (", B, "), got shape ", shape_str(k));
  TORCH_CHECK_VALUE(k.size(3) == D, op, ": k must have the head dim of q (D = ", D, "), got shape ", shape_str(k));
  TORCH_CHECK_VALUE(v.size(0) == B && v.size(1) == Tk && v.size(2) == Hkv, op,
                    ": v must have the batch, length and heads of k (", B, ", ", Tk, ", ", Hkv, "), got shape ",
                    shape_str(v));
  head_dims(H, Hkv, D, Dv, op);
  unit_last_stride(q, op, "q");
  unit_last_stride(k, op, "k");
  unit_last_stride(v, op, "v");
  TORCH_CHECK_VALUE(std::isfinite(scale), op, ": scale must be finite, got ", scale);
  if (cu_seqlens.has_value()) {
    const at::Tensor& cu = *cu_seqlens;
    same_device(cu, q, op, "cu_seqlens");
    TORCH_CHECK_VALUE(cu.scalar_type() == at::kInt || cu.scalar_type() == at::kLong, op,
                      ": cu_seqlens must be int32 or int64, got ", cu.scalar_type());
    TORCH_CHECK_VALUE(cu.dim() == 1 && cu.numel() >= 1, op, ": cu_seqlens must be a 1-D tensor [N + 1], got shape ",
                      shape_str(cu));
    TORCH_CHECK_VALUE(B == 1, op, ": q, k and v must have batch size 1 with cu_seqlens, got B = ", B);
    TORCH_CHECK_VALUE(Tq == Tk, op, ": q and k must have the same length with cu_seqlens (it packs both), got ",
                      Tq, " and ", Tk);
    if (cu.is_cpu()) {  // device values are not read back (that would synchronize)
      const at::Tensor c64 = cu.to(at::kLong);
      const int64_t* c = c64.data_ptr<int64_t>();
      const int64_t n = c64.numel();
      TORCH_CHECK_VALUE(c[0] == 0, op, ": cu_seqlens must start at 0, got ", c[0]);
      TORCH_CHECK_VALUE(c[n - 1] == Tq, op, ": cu_seqlens must end at the sequence length T = ", Tq, ", got ",
                        c[n - 1]);
      for (int64_t i = 1; i < n; ++i)
        TORCH_CHECK_VALUE(c[i] >= c[i - 1], op, ": cu_seqlens must be non-decreasing, got cu_seqlens[", i, "] = ",
                          c[i], " < cu_seqlens[", i - 1, "] = ", c[i - 1]);
    }
    a.cu = cu.contiguous();
    p.cu_seqlens = a.cu.data_ptr();
    p.cu_seqlens_int64 = cu.scalar_type() == at::kLong;
    p.num_seqs = cu.numel() - 1;
  }
  place(p, q);
  p.batch = B;
  p.seqlen_q = Tq;
  p.seqlen_k = Tk;
  p.num_heads = H;
  p.num_kv_heads = Hkv;
  p.head_dim = D;
  p.head_dim_v = Dv;
  p.q = cview(q);
  p.k = cview(k);
  p.v = cview(v);
  p.scale = scale;
  p.causal = causal;
  return a;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> softmax_attn_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                    const OptTensor& cu_seqlens, double scale, bool causal) {
  const char* op = "streaming_attn";
  Args a = sequence_args(q, k, v, cu_seqlens, scale, causal, op);
  SoftmaxAttnParams& p = a.p;
  const c10::DeviceGuard guard(q.device());
  at::Tensor o = at::empty({p.batch, p.seqlen_q, p.num_heads, p.head_dim_v}, q.options());
  at::Tensor lse = at::empty({p.batch, p.num_heads, p.seqlen_q}, q.options().dtype(acc_type(q)));
  p.o = mview(o);
  p.lse = lse.data_ptr();
  raise_on(attnrnn::softmax_attn_fwd(p), op);
  return {o, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> softmax_attn_bwd(const at::Tensor& dout, const at::Tensor& q,
                                                                const at::Tensor& k, const at::Tensor& v,
                                                                const at::Tensor& o, const at::Tensor& lse,
                                                                const OptTensor& cu_seqlens, double scale,
                                                                bool causal) {
  const char* op = "streaming_attn backward";
  Args a = sequence_args(q, k, v, cu_seqlens, scale, causal, op);
  SoftmaxAttnParams& p = a.p;
  const std::vector<int64_t> o_shape{p.batch, p.seqlen_q, p.num_heads, p.head_dim_v};
  for (auto [t, name] : {std::pair<const at::Tensor*, const char*>{&dout, "grad of o"}, {&o, "o"}}) {
    same_device(*t, q, op, name);
    same_dtype(*t, q, op, name);
    TORCH_CHECK_VALUE(t->sizes() == at::IntArrayRef(o_shape), op, ": ", name, " must have shape ", o_shape, ", got ", t->sizes());
    unit_last_stride(*t, op, name);
  }
  same_device(lse, q, op, "lse");
  TORCH_CHECK_VALUE(lse.scalar_type() == acc_type(q), op, ": lse must be ", acc_type(q), ", got ", lse.scalar_type());
  const std::vector<int64_t> lse_shape{p.batch, p.num_heads, p.seqlen_q};
  TORCH_CHECK_VALUE(lse.sizes() == at::IntArrayRef(lse_shape), op, ": lse must have shape ", lse_shape, ", got ", lse.sizes());
  const at::Tensor lse_c = lse.contiguous();
  const c10::DeviceGuard guard(q.device());
  at::Tensor dq = at::empty(q.sizes(), q.options());
  at::Tensor dk = at::empty(k.sizes(), k.options());
  at::Tensor dv = at::empty(v.sizes(), v.options());
  p.dout = cview(dout);
  p.out = cview(o);
  p.lse = const_cast<void*>(lse_c.data_ptr());
  p.dq = mview(dq);
  p.dk = mview(dk);
  p.dv = mview(dv);
  raise_on(attnrnn::softmax_attn_bwd(p), op);
  return {dq, dk, dv};
}

at::Tensor softmax_attn_step(const at::Tensor& q, at::Tensor& k_cache, at::Tensor& v_cache,
                             const at::Tensor& cache_seqlens, const OptTensor& k_new, const OptTensor& v_new,
                             double scale, int64_t split_size) {
  const char* op = "softmax_attn_step";
  rank(q, 3, op, "q", "[B, H, D]");
  rank(k_cache, 4, op, "k_cache", "[B, Lmax, Hkv, D]");
  rank(v_cache, 4, op, "v_cache", "[B, Lmax, Hkv, Dv]");
  same_device(k_cache, q, op, "k_cache");
  same_device(v_cache, q, op, "v_cache");
  SoftmaxAttnStepParams p;
  p.dtype = input_dtype(q, op, "q");
  same_dtype(k_cache, q, op, "k_cache");
  same_dtype(v_cache, q, op, "v_cache");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t L = k_cache.size(1), Hkv = k_cache.size(2), Dv = v_cache.size(3);
  TORCH_CHECK_VALUE(k_cache.size(0) == B && k_cache.size(3) == D, op,
                    ": k_cache must have the batch and head dim of q (", B, ", ", D, "), got shape ",
                    shape_str(k_cache));
  TORCH_CHECK_VALUE(v_cache.size(0) == B && v_cache.size(1) == L && v_cache.size(2) == Hkv, op,
                    ": v_cache must have the batch, length and heads of k_cache (", B, ", ", L, ", ", Hkv,
                    "), got shape ", shape_str(v_cache));
  head_dims(H, Hkv, D, Dv, op);
  unit_last_stride(q, op, "q");
  unit_last_stride(k_cache, op, "k_cache");
  unit_last_stride(v_cache, op, "v_cache");
  TORCH_CHECK_VALUE(std::isfinite(scale), op, ": scale must be finite, got ", scale);
  TORCH_CHECK_VALUE(split_size >= 0, op, ": split_size must be >= 0 (0 = default), got ", split_size);
  same_device(cache_seqlens, q, op, "cache_seqlens");
  TORCH_CHECK_VALUE(cache_seqlens.scalar_type() == at::kInt, op, ": cache_seqlens must be int32, got ",
                    cache_seqlens.scalar_type());
  TORCH_CHECK_VALUE(cache_seqlens.dim() == 1 && cache_seqlens.size(0) == B, op,
                    ": cache_seqlens must have shape [B] = [", B, "], got ", shape_str(cache_seqlens));
  TORCH_CHECK_VALUE(k_new.has_value() == v_new.has_value(), op, ": k_new and v_new must be given together");
  if (k_new.has_value()) {
    for (auto [t, name, dim] : {std::tuple<const at::Tensor*, const char*, int64_t>{&*k_new, "k_new", D},
                                {&*v_new, "v_new", Dv}}) {
      same_device(*t, q, op, name);
      same_dtype(*t, q, op, name);
      rank(*t, 3, op, name, "[B, Hkv, D]");
      const std::vector<int64_t> want{B, Hkv, dim};
      TORCH_CHECK_VALUE(t->sizes() == at::IntArrayRef(want), op, ": ", name, " must have shape ", want, ", got ", t->sizes());
      unit_last_stride(*t, op, name);
    }
  }
  const at::Tensor lens = cache_seqlens.contiguous();
  place(p, q);
  const c10::DeviceGuard guard(q.device());
  at::Tensor o = at::empty({B, H, Dv}, q.options());
  p.batch = B;
  p.max_seqlen = L;
  p.num_heads = H;
  p.num_kv_heads = Hkv;
  p.head_dim = D;
  p.head_dim_v = Dv;
  p.q = ConstView{q.data_ptr(), q.stride(0), 0, q.stride(1)};
  if (k_new.has_value()) {
    p.k_new = ConstView{k_new->data_ptr(), k_new->stride(0), 0, k_new->stride(1)};
    p.v_new = ConstView{v_new->data_ptr(), v_new->stride(0), 0, v_new->stride(1)};
  }
  p.o = MutView{o.data_ptr(), o.stride(0), 0, o.stride(1)};
  p.k_cache = mview(k_cache);
  p.v_cache = mview(v_cache);
  p.cache_seqlens = lens.data_ptr<int32_t>();
  p.scale = scale;
  p.split_size = split_size;
  raise_on(attnrnn::softmax_attn_step(p), op);
  return o;
}

}  // namespace attnrnn::aten
