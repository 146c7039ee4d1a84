// ATen glue of the softmax-attention ops: check every argument (naming it), allocate outputs,
// fill the torch-free params, turn a status into an exception. No math lives here.
#include <ATen/MemoryOverlap.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/DeviceGuard.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <string>
#include <vector>

#include "attnrnn/attnrnn.h"
#include "attnrnn/torch_softmax.h"
#include "checks.h"

namespace attnrnn::aten {

namespace {

using namespace detail;

void head_dims(int64_t H, int64_t Hkv, int64_t D, int64_t Dv, const char* op) {
  TORCH_CHECK_VALUE(Hkv >= 1 && H % Hkv == 0, op, ": the heads of k and v (", Hkv,
                    ") must divide the heads of q (", H, ")");
  TORCH_CHECK_VALUE(D >= 1 && D <= 256, op, ": q and k head dim D must be in [1, 256], got ", D);
  TORCH_CHECK_VALUE(Dv >= 1 && Dv <= 256, op, ": v head dim Dv must be in [1, 256], got ", Dv);
}

// Device scratch the kernels asked for (undefined when none): bytes on q's device, on its stream's
// allocator, so CUDA graph capture records it like any other allocation.
at::Tensor scratch(int64_t bytes, const at::Tensor& q) {
  if (bytes <= 0) return at::Tensor();
  return at::empty({bytes}, q.options().dtype(at::kByte));
}

struct Args {
  SoftmaxAttnParams p;
  at::Tensor cu;  // kept alive
};

Args sequence_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const OptTensor& cu_seqlens,
                   double scale, bool causal, const char* op) {
  check_rank(q, 4, op, "q", "[B, Tq, H, D]");
  check_rank(k, 4, op, "k", "[B, Tk, Hkv, D]");
  check_rank(v, 4, op, "v", "[B, Tk, Hkv, Dv]");
  check_same_device(k, q, op, "k");
  check_same_device(v, q, op, "v");
  Args a;
  SoftmaxAttnParams& p = a.p;
  p.dtype = dtype_of(q, op, "q");
  check_same_dtype(k, q, op, "k");
  check_same_dtype(v, q, op, "v");
  const int64_t B = q.size(0), Tq = q.size(1), H = q.size(2), D = q.size(3);
  const int64_t Tk = k.size(1), Hkv = k.size(2), Dv = v.size(3);
  TORCH_CHECK_VALUE(k.size(0) == B, op, ": k must have the batch of q (", B, "), got shape ", shape_of(k));
  TORCH_CHECK_VALUE(k.size(3) == D, op, ": k must have the head dim of q (D = ", D, "), got shape ", shape_of(k));
  TORCH_CHECK_VALUE(v.size(0) == B && v.size(1) == Tk && v.size(2) == Hkv, op,
                    ": v must have the batch, length and heads of k (", B, ", ", Tk, ", ", Hkv, "), got shape ",
                    shape_of(v));
  head_dims(H, Hkv, D, Dv, op);
  check_unit_last_stride(q, op, "q");
  check_unit_last_stride(k, op, "k");
  check_unit_last_stride(v, op, "v");
  TORCH_CHECK_VALUE(std::isfinite(scale), op, ": scale must be finite, got ", scale);
  if (cu_seqlens.has_value()) {
    TORCH_CHECK_VALUE(Tq == Tk, op, ": q and k must have the same length with cu_seqlens (it packs both), got ",
                      Tq, " and ", Tk);
    a.cu = checked_cu_seqlens(*cu_seqlens, q, op);
    const at::Tensor& cu = a.cu;
    p.cu_seqlens = a.cu.data_ptr();
    p.cu_seqlens_int64 = cu.scalar_type() == at::kLong;
    p.num_seqs = cu.numel() - 1;
  }
  set_device(p, q);
  p.batch = B;
  p.seqlen_q = Tq;
  p.seqlen_k = Tk;
  p.num_heads = H;
  p.num_kv_heads = Hkv;
  p.head_dim = D;
  p.head_dim_v = Dv;
  p.q = const_view(q);
  p.k = const_view(k);
  p.v = const_view(v);
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
  at::Tensor lse = at::empty({p.batch, p.num_heads, p.seqlen_q}, q.options().dtype(state_scalar_type(q)));
  p.o = mut_view(o);
  p.lse = lse.data_ptr();
  const at::Tensor workspace = scratch(attnrnn::softmax_attn_fwd_workspace_bytes(p), q);
  p.workspace = workspace.defined() ? workspace.data_ptr() : nullptr;
  check_status(attnrnn::softmax_attn_fwd(p), op);
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
    check_same_device(*t, q, op, name);
    check_same_dtype(*t, q, op, name);
    TORCH_CHECK_VALUE(t->sizes() == at::IntArrayRef(o_shape), op, ": ", name, " must have shape ", o_shape, ", got ", t->sizes());
    check_unit_last_stride(*t, op, name);
  }
  check_same_device(lse, q, op, "lse");
  TORCH_CHECK_VALUE(lse.scalar_type() == state_scalar_type(q), op, ": lse must be ", state_scalar_type(q), ", got ", lse.scalar_type());
  const std::vector<int64_t> lse_shape{p.batch, p.num_heads, p.seqlen_q};
  TORCH_CHECK_VALUE(lse.sizes() == at::IntArrayRef(lse_shape), op, ": lse must have shape ", lse_shape, ", got ", lse.sizes());
  const at::Tensor lse_c = lse.contiguous();
  const c10::DeviceGuard guard(q.device());
  at::Tensor dq = at::empty(q.sizes(), q.options());
  at::Tensor dk = at::empty(k.sizes(), k.options());
  at::Tensor dv = at::empty(v.sizes(), v.options());
  p.dout = const_view(dout);
  p.out = const_view(o);
  p.lse = const_cast<void*>(lse_c.data_ptr());
  p.dq = mut_view(dq);
  p.dk = mut_view(dk);
  p.dv = mut_view(dv);
  const at::Tensor workspace = scratch(attnrnn::softmax_attn_bwd_workspace_bytes(p), q);
  p.workspace = workspace.defined() ? workspace.data_ptr() : nullptr;
  check_status(attnrnn::softmax_attn_bwd(p), op);
  return {dq, dk, dv};
}

at::Tensor softmax_attn_step(const at::Tensor& q, at::Tensor& k_cache, at::Tensor& v_cache,
                             const at::Tensor& cache_seqlens, const OptTensor& k_new, const OptTensor& v_new,
                             double scale, int64_t split_size) {
  const char* op = "softmax_attn_step";
  check_rank(q, 3, op, "q", "[B, H, D]");
  check_rank(k_cache, 4, op, "k_cache", "[B, Lmax, Hkv, D]");
  check_rank(v_cache, 4, op, "v_cache", "[B, Lmax, Hkv, Dv]");
  check_same_device(k_cache, q, op, "k_cache");
  check_same_device(v_cache, q, op, "v_cache");
  SoftmaxAttnStepParams p;
  p.dtype = dtype_of(q, op, "q");
  check_same_dtype(k_cache, q, op, "k_cache");
  check_same_dtype(v_cache, q, op, "v_cache");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t L = k_cache.size(1), Hkv = k_cache.size(2), Dv = v_cache.size(3);
  TORCH_CHECK_VALUE(k_cache.size(0) == B && k_cache.size(3) == D, op,
                    ": k_cache must have the batch and head dim of q (", B, ", ", D, "), got shape ",
                    shape_of(k_cache));
  TORCH_CHECK_VALUE(v_cache.size(0) == B && v_cache.size(1) == L && v_cache.size(2) == Hkv, op,
                    ": v_cache must have the batch, length and heads of k_cache (", B, ", ", L, ", ", Hkv,
                    "), got shape ", shape_of(v_cache));
  head_dims(H, Hkv, D, Dv, op);
  check_unit_last_stride(q, op, "q");
  check_unit_last_stride(k_cache, op, "k_cache");
  check_unit_last_stride(v_cache, op, "v_cache");
  TORCH_CHECK_VALUE(std::isfinite(scale), op, ": scale must be finite, got ", scale);
  TORCH_CHECK_VALUE(split_size >= 0, op, ": split_size must be >= 0 (0 = default), got ", split_size);
  check_same_device(cache_seqlens, q, op, "cache_seqlens");
  TORCH_CHECK_VALUE(cache_seqlens.scalar_type() == at::kInt, op, ": cache_seqlens must be int32, got ",
                    cache_seqlens.scalar_type());
  TORCH_CHECK_VALUE(cache_seqlens.dim() == 1 && cache_seqlens.size(0) == B, op,
                    ": cache_seqlens must have shape [B] = [", B, "], got ", shape_of(cache_seqlens));
  TORCH_CHECK_VALUE(k_new.has_value() == v_new.has_value(), op, ": k_new and v_new must be given together");
  if (k_new.has_value()) {
    for (auto [t, name, dim] : {std::tuple<const at::Tensor*, const char*, int64_t>{&*k_new, "k_new", D},
                                {&*v_new, "v_new", Dv}}) {
      check_same_device(*t, q, op, name);
      check_same_dtype(*t, q, op, name);
      check_rank(*t, 3, op, name, "[B, Hkv, D]");
      const std::vector<int64_t> want{B, Hkv, dim};
      TORCH_CHECK_VALUE(t->sizes() == at::IntArrayRef(want), op, ": ", name, " must have shape ", want, ", got ", t->sizes());
      check_unit_last_stride(*t, op, name);
    }
    // The append writes one row per batch entry: rows that share memory (an expand()ed cache)
    // would take each other's writes.
    for (auto [t, name] : {std::pair<const at::Tensor*, const char*>{&k_cache, "k_cache"}, {&v_cache, "v_cache"}}) {
      TORCH_CHECK_VALUE(at::has_internal_overlap(*t) != at::MemOverlap::Yes, op, ": ", name,
                        " must not have elements that share memory (strides ", t->strides(),
                        ") when k_new and v_new are appended to it");
      for (auto [other, other_name] : {std::pair<const at::Tensor*, const char*>{&q, "q"}, {&*k_new, "k_new"},
                                       {&*v_new, "v_new"}, {&cache_seqlens, "cache_seqlens"}})
        check_no_overlap(*t, name, *other, other_name, op);
    }
    check_no_overlap(v_cache, "v_cache", k_cache, "k_cache", op);
  }
  const at::Tensor lens = cache_seqlens.contiguous();
  set_device(p, q);
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
  p.k_cache = mut_view(k_cache);
  p.v_cache = mut_view(v_cache);
  p.cache_seqlens = lens.data_ptr<int32_t>();
  p.scale = scale;
  p.split_size = split_size;
  const at::Tensor workspace = scratch(attnrnn::softmax_attn_step_workspace_bytes(p), q);
  p.workspace = workspace.defined() ? workspace.data_ptr() : nullptr;
  check_status(attnrnn::softmax_attn_step(p), op);
  return o;
}

}  // namespace attnrnn::aten
