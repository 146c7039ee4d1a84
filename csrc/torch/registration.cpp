// The torch.ops.attnrnn operators: schemas, and the same ATen glue for CPU and CUDA tensors.
// Fake (meta) kernels and the softmax ops' autograd are registered from Python (attnrnn/_ops.py,
// attnrnn/softmax/_ops.py); the Autograd kernels of the linear ops and of both decode steps are in autograd.cpp.
#include <ATen/core/LegacyTypeDispatch.h>
#include <torch/library.h>

#include <initializer_list>
#include <string_view>
#include <utility>
#include <vector>

#include "attnrnn/torch.h"
#include "attnrnn/torch_softmax.h"
#include "operators.h"

TORCH_LIBRARY(attnrnn, m) {
  // for_backward: also return what chunk_bwd reads (saved, uint8; empty otherwise).
  m.def(
      "chunk_fwd(Tensor q, Tensor k, Tensor v, Tensor? initial_S, Tensor? initial_z, Tensor? cu_seqlens, "
      "float scale, float eps, str feature_map, bool normalize, bool output_final_state, int chunk_size, "
      "bool for_backward=False) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "chunk_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor? o, Tensor saved, Tensor? d_final_S, "
      "Tensor? d_final_z, Tensor? initial_S, Tensor? initial_z, Tensor? cu_seqlens, float scale, float eps, "
      "str feature_map, bool normalize, int chunk_size) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "recurrent_fwd(Tensor q, Tensor k, Tensor v, Tensor? initial_S, Tensor? initial_z, Tensor? cu_seqlens, "
      "float scale, float eps, str feature_map, bool normalize, bool output_final_state) "
      "-> (Tensor, Tensor, Tensor)");
  m.def(
      "recurrent_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor? o, Tensor? d_final_S, Tensor? d_final_z, "
      "Tensor? initial_S, Tensor? initial_z, Tensor? cu_seqlens, float scale, float eps, str feature_map, "
      "bool normalize) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "step(Tensor q, Tensor k, Tensor v, Tensor(a!) S, Tensor(b!)? z, Tensor? state_indices, float scale, "
      "float eps, str feature_map, bool normalize) -> Tensor");
  // Softmax attention as an RNN (csrc/torch/softmax_attn.cpp).
  m.def("softmax_attn_fwd(Tensor q, Tensor k, Tensor v, Tensor? cu_seqlens, float scale, bool causal) "
        "-> (Tensor, Tensor)");
  m.def(
      "softmax_attn_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, Tensor? cu_seqlens, "
      "float scale, bool causal) -> (Tensor, Tensor, Tensor)");
  m.def(
      "softmax_attn_step(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor cache_seqlens, Tensor? k_new, "
      "Tensor? v_new, float scale, int split_size) -> Tensor");
}

namespace {

using attnrnn::operators::OptTensor;

void register_impls(torch::Library& m) {
  m.impl("chunk_fwd", &attnrnn::aten::chunk_fwd);
  m.impl("chunk_bwd", &attnrnn::aten::chunk_bwd);
  m.impl("recurrent_fwd", &attnrnn::aten::recurrent_fwd);
  m.impl("recurrent_bwd", &attnrnn::aten::recurrent_bwd);
  m.impl("step", &attnrnn::aten::step);
  m.impl("softmax_attn_fwd", &attnrnn::aten::softmax_attn_fwd);
  m.impl("softmax_attn_bwd", &attnrnn::aten::softmax_attn_bwd);
  m.impl("softmax_attn_step", &attnrnn::aten::softmax_attn_step);
}

// The decode steps bump the version counter of every tensor their schema marks as written, as
// PyTorch's own in-place ops do: autograd then refuses a backward that would read a saved tensor
// they have since overwritten. Typed: boxing their arguments cost host time on every decoding step.
// The call below ADInplaceOrView, then the versions of what it wrote.
template <class Handle, class... Args>
at::Tensor call_and_bump(const Handle& op, c10::DispatchKeySet keys, std::initializer_list<const at::Tensor*> written,
                         Args&&... args) {
  at::Tensor o;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    o = op.redispatch(keys & c10::after_ADInplaceOrView_keyset, std::forward<Args>(args)...);
  }
  for (const at::Tensor* t : written)
    if (t != nullptr) t->unsafeGetTensorImpl()->bump_version();
  return o;
}
at::Tensor step_bumping_versions(c10::DispatchKeySet keys, const at::Tensor& q, const at::Tensor& k,
                                 const at::Tensor& v, at::Tensor& S, const OptTensor& z, const OptTensor& state_indices,
                                 double scale, double eps, std::string_view feature_map, bool normalize) {
  return call_and_bump(attnrnn::operators::step(), keys, {&S, z.has_value() ? &*z : nullptr}, q, k, v, S, z,
                       state_indices, scale, eps, feature_map, normalize);
}
at::Tensor softmax_attn_step_bumping_versions(c10::DispatchKeySet keys, const at::Tensor& q, at::Tensor& k_cache,
                                              at::Tensor& v_cache, const at::Tensor& cache_seqlens,
                                              const OptTensor& k_new, const OptTensor& v_new, double scale,
                                              int64_t split_size) {
  return call_and_bump(attnrnn::operators::softmax_attn_step(), keys, {&k_cache, &v_cache}, q, k_cache, v_cache,
                       cache_seqlens, k_new, v_new, scale, split_size);
}

}  // namespace

TORCH_LIBRARY_IMPL(attnrnn, CPU, m) { register_impls(m); }
TORCH_LIBRARY_IMPL(attnrnn, CUDA, m) { register_impls(m); }
TORCH_LIBRARY_IMPL(attnrnn, ADInplaceOrView, m) {
  m.impl("step", &step_bumping_versions);
  m.impl("softmax_attn_step", &softmax_attn_step_bumping_versions);
}
