// The torch.ops.attnrnn operators: schemas, and the same ATen glue for CPU and CUDA tensors.
// Autograd and fake (meta) kernels are registered from Python (attnrnn/_ops.py).
#include <torch/library.h>

#include "attnrnn/torch.h"
#include "attnrnn/torch_softmax.h"

TORCH_LIBRARY(attnrnn, m) {
  m.def(
      "chunk_fwd(Tensor q, Tensor k, Tensor v, Tensor? initial_S, Tensor? initial_z, Tensor? cu_seqlens, "
      "float scale, float eps, str feature_map, bool normalize, bool output_final_state, int chunk_size) "
      "-> (Tensor, Tensor, Tensor)");
  m.def(
      "chunk_bwd(Tensor dout, Tensor? o, Tensor? d_final_S, Tensor? d_final_z, Tensor q, Tensor k, Tensor v, "
      "Tensor? initial_S, Tensor? initial_z, Tensor? cu_seqlens, float scale, float eps, str feature_map, "
      "bool normalize, int chunk_size) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "recurrent_fwd(Tensor q, Tensor k, Tensor v, Tensor? initial_S, Tensor? initial_z, Tensor? cu_seqlens, "
      "float scale, float eps, str feature_map, bool normalize, bool output_final_state) "
      "-> (Tensor, Tensor, Tensor)");
  m.def(
      "recurrent_bwd(Tensor dout, Tensor? o, Tensor? d_final_S, Tensor? d_final_z, Tensor q, Tensor k, Tensor v, "
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
}  // namespace

TORCH_LIBRARY_IMPL(attnrnn, CPU, m) { register_impls(m); }
TORCH_LIBRARY_IMPL(attnrnn, CUDA, m) { register_impls(m); }
