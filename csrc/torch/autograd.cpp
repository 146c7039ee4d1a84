// Autograd of the linear-attention sequence ops, registered at the Autograd key (and the two decode
// steps', which refuse to record a gradient).
//
// It lives in C++ rather than in torch.library's Python autograd because a training step then
// runs no Python between the forward and the backward kernels: the Python wrapper cost ~70 us of
// host time per forward+backward on the dev machine (148 -> 78 us), more on the H200's host, where
// the GPU sat idle between the forward and the backward at B8-T2048-H16-D64 (832 -> 559 us per
// call). C++ programs linking attnrnn::torch get the same gradients when they call the operators
// through the dispatcher (tests/consumer/consumer_torch.cpp).
//
// The forward saves its inputs, its output where the backward reads it (normalize on CUDA) and
// `saved`: what its kernels keep for the backward, as FlashAttention keeps the softmax's
// log-sum-exp. Autograd does not look inside it. The backward ops
// are differentiable once (create_graph=True records them), but differentiating them again raises
// instead of silently treating their results as constants.
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>  // zeros_symint
#include <torch/autograd.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <string_view>
#include <tuple>

#include "attnrnn/torch.h"
#include "operators.h"

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using attnrnn::operators::BackwardResult;
using attnrnn::operators::ForwardResult;
using attnrnn::operators::OptTensor;
namespace operators = attnrnn::operators;

// The two sequence forms share everything but their operators, the chunk_size argument and the saved
// buffer (the recurrent form has neither).
struct ChunkForm {
  static constexpr const char* kBackward = "attnrnn::chunk_bwd";
  static constexpr bool kChunked = true;
};
struct RecurrentForm {
  static constexpr const char* kBackward = "attnrnn::recurrent_bwd";
  static constexpr bool kChunked = false;
};

template <class Form>
ForwardResult call_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const OptTensor& S0,
                           const OptTensor& z0, const OptTensor& cu_seqlens, double scale, double eps,
                           std::string_view feature_map, bool normalize, bool output_final_state,
                           int64_t chunk_size, bool for_backward) {
  if constexpr (Form::kChunked) {
    return operators::chunk_fwd().call(q, k, v, S0, z0, cu_seqlens, scale, eps, feature_map, normalize,
                                       output_final_state, chunk_size, for_backward);
  } else {
    auto [o, S, z] = operators::recurrent_fwd().call(q, k, v, S0, z0, cu_seqlens, scale, eps, feature_map, normalize,
                                                     output_final_state);
    return {o, S, z, at::Tensor()};
  }
}

template <class Form>
BackwardResult call_backward(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const OptTensor& o, const OptTensor& saved, const OptTensor& dS, const OptTensor& dz,
                             const OptTensor& S0, const OptTensor& z0, const OptTensor& cu_seqlens, double scale,
                             double eps, std::string_view feature_map, bool normalize, int64_t chunk_size) {
  if constexpr (Form::kChunked) {
    return operators::chunk_bwd().call(dout, q, k, v, o, *saved, dS, dz, S0, z0, cu_seqlens, scale, eps, feature_map,
                                       normalize, chunk_size);
  } else {
    return operators::recurrent_bwd().call(dout, q, k, v, o, dS, dz, S0, z0, cu_seqlens, scale, eps, feature_map,
                                           normalize);
  }
}

OptTensor present(const at::Tensor& t) { return t.defined() ? OptTensor(t) : std::nullopt; }

// A final state's gradient, when that state was returned (unrequested final states, and z without
// normalize, are empty tensors) and reaches the loss.
OptTensor state_grad(const at::Tensor& g, bool returned) {
  return returned && g.defined() ? OptTensor(g) : std::nullopt;
}

// The backward op with a backward of its own that refuses: second-order gradients through the
// attnrnn kernels are not implemented (the reference implementation has them).
template <class Form>
struct BackwardFunction : torch::autograd::Function<BackwardFunction<Form>> {
  static variable_list forward(AutogradContext*, const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                               const at::Tensor& v, const OptTensor& o, const OptTensor& saved, const OptTensor& dS,
                               const OptTensor& dz, const OptTensor& S0, const OptTensor& z0,
                               const OptTensor& cu_seqlens, double scale, double eps, std::string_view feature_map,
                               bool normalize, int64_t chunk_size) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [dq, dk, dv, dS0, dz0] = call_backward<Form>(dout, q, k, v, o, saved, dS, dz, S0, z0, cu_seqlens, scale, eps,
                                                      feature_map, normalize, chunk_size);
    return {dq, dk, dv, dS0, dz0};
  }

  static variable_list backward(AutogradContext*, variable_list) {
    TORCH_CHECK_NOT_IMPLEMENTED(false, "double backward of ", Form::kBackward,
                                " is not supported (the gradient of the attnrnn backward op is not implemented); "
                                "differentiate the reference implementation for higher-order gradients");
  }
};

// Whether a gradient will flow back through this call.
bool wants_grad(const at::Tensor& t) { return t.requires_grad(); }
bool wants_grad(const OptTensor& t) { return t.has_value() && t->requires_grad(); }
template <class... Tensors>
bool records_gradient(const Tensors&... tensors) {
  return torch::autograd::GradMode::is_enabled() && (wants_grad(tensors) || ...);
}

// Whether a forward-mode gradient rides on any of the tensors: the custom Functions have to raise
// then (they have no jvp), so such calls never take the node-free paths below.
bool dual(const at::Tensor& t) { return t._fw_grad(/*level=*/0).defined(); }
bool dual(const OptTensor& t) { return t.has_value() && dual(*t); }
template <class... Tensors>
bool has_forward_grad(const Tensors&... tensors) {
  return (dual(tensors) || ...);
}

// The Autograd kernel of both backwards (saved: the chunk form's), also called by the forwards'
// backward. Outside create_graph (grad mode off, the usual backward) it skips BackwardFunction's
// node, whose only job is to refuse a second derivative.
template <class Form>
BackwardResult backward_op(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const OptTensor& o, const OptTensor& saved, const OptTensor& dS, const OptTensor& dz,
                           const OptTensor& S0, const OptTensor& z0, const OptTensor& cu_seqlens, double scale,
                           double eps, std::string_view feature_map, bool normalize, int64_t chunk_size) {
  if (!torch::autograd::GradMode::is_enabled() && !has_forward_grad(dout, q, k, v, o, dS, dz, S0, z0)) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return call_backward<Form>(dout, q, k, v, o, saved, dS, dz, S0, z0, cu_seqlens, scale, eps, feature_map,
                               normalize, chunk_size);
  }
  const variable_list g = BackwardFunction<Form>::apply(dout, q, k, v, o, saved, dS, dz, S0, z0, cu_seqlens, scale,
                                                        eps, feature_map, normalize, chunk_size);
  return {g[0], g[1], g[2], g[3], g[4]};
}

template <class Form>
struct SequenceFunction : torch::autograd::Function<SequenceFunction<Form>> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const OptTensor& S0, const OptTensor& z0, const OptTensor& cu_seqlens, double scale,
                               double eps, std::string_view feature_map, bool normalize, bool output_final_state,
                               int64_t chunk_size) {
    ForwardResult out;
    {
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      out = call_forward<Form>(q, k, v, S0, z0, cu_seqlens, scale, eps, feature_map, normalize, output_final_state,
                               chunk_size, true);
    }
    const auto& [o, S, z, saved] = out;
    // o only where the backward reads it (normalize on CUDA): elsewhere it may be changed in place.
    const bool keep_o = normalize && q.is_cuda();
    ctx->save_for_backward({q, k, v, S0.value_or(at::Tensor()), z0.value_or(at::Tensor()),
                            cu_seqlens.value_or(at::Tensor()), keep_o ? o : at::Tensor(), saved});
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["feature_map"] = std::string(feature_map);
    ctx->saved_data["normalize"] = normalize;
    ctx->saved_data["output_final_state"] = output_final_state;
    ctx->saved_data["chunk_size"] = chunk_size;
    // Gradients of outputs the loss does not use stay undefined instead of being filled with zeros.
    ctx->set_materialize_grads(false);
    if (!saved.defined()) return {o, S, z};
    ctx->mark_non_differentiable({saved});
    return {o, S, z, saved};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &q = saved[0], &k = saved[1], &v = saved[2], &S0 = saved[3], &z0 = saved[4];
    at::Tensor dout = grads[0];
    if (!dout.defined()) {
      // Only the final state reaches the loss.
      dout = at::zeros_symint({q.sym_size(0), q.sym_size(1), q.sym_size(2), v.sym_size(3)}, q.options());
    } else if (dout.stride(-1) != 1) {
      dout = dout.contiguous();
    }
    const std::string feature_map = ctx->saved_data["feature_map"].toStringRef();
    const bool normalize = ctx->saved_data["normalize"].toBool();
    const bool output_final_state = ctx->saved_data["output_final_state"].toBool();
    const auto [dq, dk, dv, dS0, dz0] = backward_op<Form>(
        dout, q, k, v, present(saved[6]), present(saved[7]), state_grad(grads[1], output_final_state),
        state_grad(grads[2], output_final_state && normalize), present(S0), present(z0), present(saved[5]),
        ctx->saved_data["scale"].toDouble(), ctx->saved_data["eps"].toDouble(), std::string_view(feature_map),
        normalize, ctx->saved_data["chunk_size"].toInt());
    // One entry per forward argument: dq, dk, dv, the initial-state gradients, nothing for the rest.
    variable_list result(12);
    result[0] = dq;
    result[1] = dk;
    result[2] = dv;
    if (S0.defined()) result[3] = dS0;
    if (z0.defined()) result[4] = dz0;
    return result;
  }
};

// The Autograd kernel of both forwards. Inference (no_grad, or no input requiring grad) skips
// the autograd Function: no graph node, nothing saved, less host time before the launch.
template <class Form>
ForwardResult forward_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const OptTensor& S0,
                         const OptTensor& z0, const OptTensor& cu_seqlens, double scale, double eps,
                         std::string_view feature_map, bool normalize, bool output_final_state, int64_t chunk_size,
                         bool for_backward) {
  if (!records_gradient(q, k, v, S0, z0) && !has_forward_grad(q, k, v, S0, z0)) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return call_forward<Form>(q, k, v, S0, z0, cu_seqlens, scale, eps, feature_map, normalize, output_final_state,
                              chunk_size, for_backward);
  }
  const variable_list out = SequenceFunction<Form>::apply(q, k, v, S0, z0, cu_seqlens, scale, eps, feature_map,
                                                          normalize, output_final_state, chunk_size);
  return {out[0], out[1], out[2], out.size() > 3 ? out[3] : at::Tensor()};
}

ForwardResult chunk_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const OptTensor& S0,
                        const OptTensor& z0, const OptTensor& cu_seqlens, double scale, double eps,
                        std::string_view feature_map, bool normalize, bool output_final_state, int64_t chunk_size,
                        bool for_backward) {
  return forward_op<ChunkForm>(q, k, v, S0, z0, cu_seqlens, scale, eps, feature_map, normalize, output_final_state,
                               chunk_size, for_backward);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> recurrent_fwd(const at::Tensor& q, const at::Tensor& k,
                                                             const at::Tensor& v, const OptTensor& S0,
                                                             const OptTensor& z0, const OptTensor& cu_seqlens,
                                                             double scale, double eps, std::string_view feature_map,
                                                             bool normalize, bool output_final_state) {
  const ForwardResult out = forward_op<RecurrentForm>(q, k, v, S0, z0, cu_seqlens, scale, eps, feature_map,
                                                      normalize, output_final_state, int64_t{0}, false);
  return {std::get<0>(out), std::get<1>(out), std::get<2>(out)};
}

BackwardResult recurrent_bwd(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const OptTensor& o, const OptTensor& dS, const OptTensor& dz, const OptTensor& S0,
                             const OptTensor& z0, const OptTensor& cu_seqlens, double scale, double eps,
                             std::string_view feature_map, bool normalize) {
  return backward_op<RecurrentForm>(dout, q, k, v, o, std::nullopt, dS, dz, S0, z0, cu_seqlens, scale, eps,
                                    feature_map, normalize, 0);
}

BackwardResult chunk_bwd(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const OptTensor& o, const at::Tensor& saved, const OptTensor& dS, const OptTensor& dz,
                         const OptTensor& S0, const OptTensor& z0, const OptTensor& cu_seqlens, double scale,
                         double eps, std::string_view feature_map, bool normalize, int64_t chunk_size) {
  return backward_op<ChunkForm>(dout, q, k, v, o, saved, dS, dz, S0, z0, cu_seqlens, scale, eps, feature_map,
                                normalize, chunk_size);
}

// The decode step's Autograd kernel. The step writes the state in place and has no derivative, so a
// call that would record one (or carries a forward-mode gradient) is refused, as the Python function
// does before it. Typed rather than autograd's boxed fallback, which turned the ten arguments into
// IValues on every decoding step.
at::Tensor step(c10::DispatchKeySet keys, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& S,
                const OptTensor& z, const OptTensor& state_indices, double scale, double eps,
                std::string_view feature_map, bool normalize) {
  TORCH_CHECK(!records_gradient(q, k, v, S, z) && !has_forward_grad(q, k, v, S, z),
              "linear_attn_step updates the state in place and is not differentiable; use recurrent_linear_attn "
              "or chunk_linear_attn with initial_state for gradients");
  at::AutoDispatchBelowAutograd below_autograd;
  return operators::step().redispatch(keys & c10::after_autograd_keyset, q, k, v, S, z, state_indices, scale, eps,
                                      feature_map, normalize);
}

// The softmax decode step's Autograd kernel, for the same reasons: it appends to the KV cache in place.
at::Tensor softmax_attn_step(c10::DispatchKeySet keys, const at::Tensor& q, at::Tensor& k_cache, at::Tensor& v_cache,
                             const at::Tensor& cache_seqlens, const OptTensor& k_new, const OptTensor& v_new,
                             double scale, int64_t split_size) {
  TORCH_CHECK(!records_gradient(q, k_cache, v_cache, k_new, v_new) &&
                  !has_forward_grad(q, k_cache, v_cache, k_new, v_new),
              "softmax_attn_step writes the KV cache in place and is not differentiable; use streaming_attn for "
              "gradients");
  at::AutoDispatchBelowAutograd below_autograd;
  return operators::softmax_attn_step().redispatch(keys & c10::after_autograd_keyset, q, k_cache, v_cache,
                                                   cache_seqlens, k_new, v_new, scale, split_size);
}

}  // namespace

TORCH_LIBRARY_IMPL(attnrnn, Autograd, m) {
  m.impl("step", &step);
  m.impl("softmax_attn_step", &softmax_attn_step);
  m.impl("chunk_fwd", &chunk_fwd);
  m.impl("recurrent_fwd", &recurrent_fwd);
  m.impl("chunk_bwd", &chunk_bwd);
  m.impl("recurrent_bwd", &recurrent_bwd);
}
