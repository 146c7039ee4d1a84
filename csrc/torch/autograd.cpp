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
// The forward saves its inputs (and, on CUDA with normalize, the output, whose do . o gives the
// denominator's gradient, and the denominators themselves where the forward's kernels write them:
// the CUDA backward then skips its sweep over the sequence for them, as FlashAttention keeps the
// softmax's log-sum-exp); the backward kernels recompute the states they need, but for the segment
// states of a split CUDA forward at K = V = 128 without normalize, which the forward writes for dq's
// sweep (new_segment_states). Where the CUDA forward and backward would each run a feature pass over
// q and k (elu1 on the tensor-core sweeps), the forward writes phi(q), phi(k) once (the features
// operator), runs on them with the identity map and saves them instead of q and k: the backward
// reads them with phi_given and runs no pass (saves_features). The backward ops are differentiable
// once (create_graph=True records them), but differentiating them again raises instead of silently
// treating their results as constants.
#include <ATen/ops/empty.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
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

// The two sequence forms share everything but their operators and the chunk_size argument (the
// recurrent form has none).
struct ChunkForm {
  static constexpr const char* kBackward = "attnrnn::chunk_bwd";
  static constexpr bool kHasChunkSize = true;
};
struct RecurrentForm {
  static constexpr const char* kBackward = "attnrnn::recurrent_bwd";
  static constexpr bool kHasChunkSize = false;
};

// The recurrent form saves no denominators: its den is an empty tensor.
template <class Form>
ForwardResult call_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const OptTensor& S0,
                           const OptTensor& z0, const OptTensor& cu_seqlens, double scale, double eps,
                           std::string_view feature_map, bool normalize, bool output_final_state,
                           int64_t chunk_size, bool save_den, const OptTensor& segment_states) {
  if constexpr (Form::kHasChunkSize) {
    if (segment_states.has_value()) {
      at::Tensor states = *segment_states;
      return operators::chunk_fwd_with_segment_states().call(q, k, v, S0, z0, cu_seqlens, scale, eps, feature_map,
                                                             normalize, output_final_state, chunk_size, save_den,
                                                             states);
    }
    return operators::chunk_fwd().call(q, k, v, S0, z0, cu_seqlens, scale, eps, feature_map, normalize,
                                       output_final_state, chunk_size, save_den);
  } else {
    auto [o, S, z] = operators::recurrent_fwd().call(q, k, v, S0, z0, cu_seqlens, scale, eps, feature_map, normalize,
                                                     output_final_state);
    return {o, S, z, at::Tensor()};
  }
}

template <class Form>
BackwardResult call_backward(const at::Tensor& dout, const OptTensor& o, const OptTensor& dS, const OptTensor& dz,
                             const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const OptTensor& S0,
                             const OptTensor& z0, const OptTensor& cu_seqlens, double scale, double eps,
                             std::string_view feature_map, bool normalize, int64_t chunk_size, const OptTensor& den,
                             const OptTensor& segment_states, bool phi_given) {
  if constexpr (Form::kHasChunkSize) {
    return operators::chunk_bwd().call(dout, o, dS, dz, q, k, v, S0, z0, cu_seqlens, scale, eps, feature_map,
                                       normalize, chunk_size, den, segment_states, phi_given);
  } else {
    return operators::recurrent_bwd().call(dout, o, dS, dz, q, k, v, S0, z0, cu_seqlens, scale, eps, feature_map,
                                           normalize);
  }
}

OptTensor present(const at::Tensor& t) { return t.defined() ? OptTensor(t) : std::nullopt; }

// A final state's gradient, when that state was returned (unrequested final states, and z
// without normalize, are empty tensors) and reaches the loss.
OptTensor state_grad(const at::Tensor& g, bool returned) {
  return returned && g.defined() ? OptTensor(g) : std::nullopt;
}

// The backward op with a backward of its own that refuses: second-order gradients through the
// attnrnn kernels are not implemented (the reference implementation has them).
template <class Form>
struct BackwardFunction : torch::autograd::Function<BackwardFunction<Form>> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& dout, const OptTensor& o, const OptTensor& dS,
                               const OptTensor& dz, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const OptTensor& S0, const OptTensor& z0, const OptTensor& cu_seqlens, double scale,
                               double eps, std::string_view feature_map, bool normalize, int64_t chunk_size,
                               const OptTensor& den, const OptTensor& segment_states, bool phi_given) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [dq, dk, dv, dS0, dz0] = call_backward<Form>(dout, o, dS, dz, q, k, v, S0, z0, cu_seqlens, scale, eps,
                                                      feature_map, normalize, chunk_size, den, segment_states,
                                                      phi_given);
    return {dq, dk, dv, dS0, dz0};
  }

  static variable_list backward(AutogradContext*, variable_list) {
    TORCH_CHECK_NOT_IMPLEMENTED(false, "double backward of ", Form::kBackward,
                                " is not supported (the gradient of the attnrnn backward op is not implemented); "
                                "differentiate the reference implementation for higher-order gradients");
  }
};

// Whether a gradient will flow back through this call: then the forward saves what the backward
// can reuse (the denominators; the op decides where its kernels produce them).
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

// The Autograd kernel of both backwards, also called by the forwards' backward. Outside
// create_graph (grad mode off, the usual backward) it skips BackwardFunction's node, whose only
// job is to refuse a second derivative.
template <class Form>
BackwardResult backward_op(const at::Tensor& dout, const OptTensor& o, const OptTensor& dS, const OptTensor& dz,
                           const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const OptTensor& S0,
                           const OptTensor& z0, const OptTensor& cu_seqlens, double scale, double eps,
                           std::string_view feature_map, bool normalize, int64_t chunk_size, const OptTensor& den,
                           const OptTensor& segment_states, bool phi_given) {
  if (!torch::autograd::GradMode::is_enabled() && !has_forward_grad(dout, o, dS, dz, q, k, v, S0, z0)) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return call_backward<Form>(dout, o, dS, dz, q, k, v, S0, z0, cu_seqlens, scale, eps, feature_map, normalize,
                               chunk_size, den, segment_states, phi_given);
  }
  const variable_list g = BackwardFunction<Form>::apply(dout, o, dS, dz, q, k, v, S0, z0, cu_seqlens, scale, eps,
                                                        feature_map, normalize, chunk_size, den, segment_states,
                                                        phi_given);
  return {g[0], g[1], g[2], g[3], g[4]};
}

// Where the forward saves its segment states for the backward's dq sweep (the operator
// chunk_fwd_with_segment_states, chunk_fwd_segment_state_floats: CUDA, K = V = 128 without
// normalize, split sweeps), a tensor for them; nothing elsewhere, and nothing for tensor subclasses and fake tensors (torch.compile's
// tracing), whose shapes a fake kernel could not tell: a compiled graph recomputes them instead.
// Plain CUDA tensors outside any dispatch mode: no subclass, fake tensor, functionalization or
// functorch wrapper, whose graphs must not depend on what this call's plan would save.
bool plain_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  const auto plain = [](const at::Tensor& t) {
    const c10::DispatchKeySet keys = t.key_set();
    return t.is_cuda() && !keys.has(c10::DispatchKey::Python) && !keys.has(c10::DispatchKey::Functionalize) &&
           !keys.has(c10::DispatchKey::FuncTorchBatched) && !keys.has(c10::DispatchKey::FuncTorchGradWrapper);
  };
  return !c10::impl::dispatch_mode_enabled() && plain(q) && plain(k) && plain(v);
}

OptTensor new_segment_states(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const OptTensor& cu_seqlens,
                             std::string_view feature_map, bool normalize, int64_t chunk_size) {
  if (normalize || !plain_cuda(q, k, v)) return std::nullopt;
  const int64_t floats =
      attnrnn::aten::chunk_fwd_segment_state_floats(q, k, v, cu_seqlens, feature_map, normalize, chunk_size);
  if (floats == 0) return std::nullopt;
  return at::empty({floats}, q.options().dtype(at::kFloat));
}

// Whether the forward saves phi(q), phi(k) for the backward (chunk_saves_features), for plain CUDA
// tensors only: a traced graph keeps q and k.
bool saves_features(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const OptTensor& cu_seqlens,
                    std::string_view feature_map, bool normalize, int64_t chunk_size) {
  return feature_map != "identity" && plain_cuda(q, k, v) &&
         attnrnn::aten::chunk_saves_features(q, k, v, cu_seqlens, feature_map, normalize, chunk_size);
}

// The gradient edges of q and k, kept where the forward saves phi(q), phi(k) in their place: under
// create_graph the backward gives the phi rows these edges, so that its node leads back to q and k and
// a second derivative through dq or dk reaches that node and raises. An edge holds q's grad_fn (or
// its grad accumulator), not q's data.
struct InputEdges : torch::CustomClassHolder {
  torch::autograd::Edge q, k;
};

// phi rows standing in for an input in the backward's graph: detached, with the input's edge.
at::Tensor with_edge(const at::Tensor& phi, const torch::autograd::Edge& edge) {
  at::Tensor stand_in = phi.detach();
  if (edge.is_valid()) torch::autograd::impl::set_gradient_edge(stand_in, edge);
  return stand_in;
}

template <class Form>
struct SequenceFunction : torch::autograd::Function<SequenceFunction<Form>> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const OptTensor& S0, const OptTensor& z0, const OptTensor& cu_seqlens, double scale,
                               double eps, std::string_view feature_map, bool normalize, bool output_final_state,
                               int64_t chunk_size, bool save_den) {
    ForwardResult out;
    OptTensor states;
    // Where the forward and the backward would each run the feature pass, phi(q), phi(k) once here,
    // the forward on them with the identity map, and those saved in place of q and k (tensors of
    // their size): the backward reads them with phi_given instead of running its own pass.
    at::Tensor q_in = q, k_in = k;
    bool phi_given = false;
    {
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      if constexpr (Form::kHasChunkSize) {
        phi_given = saves_features(q, k, v, cu_seqlens, feature_map, normalize, chunk_size);
        if (phi_given) std::tie(q_in, k_in) = operators::features().call(q, k, feature_map);
        states = new_segment_states(q_in, k_in, v, cu_seqlens, feature_map, normalize, chunk_size);
      }
      out = call_forward<Form>(q_in, k_in, v, S0, z0, cu_seqlens, scale, eps, phi_given ? "identity" : feature_map,
                               normalize, output_final_state, chunk_size, save_den, states);
    }
    const at::Tensor& o = std::get<0>(out);
    const at::Tensor& den = std::get<3>(out);
    const bool keep_o = normalize && q.is_cuda();
    ctx->save_for_backward({q_in, k_in, v, S0.value_or(at::Tensor()), z0.value_or(at::Tensor()),
                            cu_seqlens.value_or(at::Tensor()), keep_o ? o : at::Tensor(), den,
                            states.value_or(at::Tensor())});
    ctx->saved_data["phi_given"] = phi_given;
    if (phi_given) {
      auto edges = c10::make_intrusive<InputEdges>();
      if (q.requires_grad()) edges->q = torch::autograd::impl::gradient_edge(q);
      if (k.requires_grad()) edges->k = torch::autograd::impl::gradient_edge(k);
      ctx->saved_data["input_edges"] = c10::IValue::make_capsule(std::move(edges));
    }
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["feature_map"] = std::string(feature_map);
    ctx->saved_data["normalize"] = normalize;
    ctx->saved_data["output_final_state"] = output_final_state;
    ctx->saved_data["chunk_size"] = chunk_size;
    // Gradients of outputs the loss does not use stay undefined instead of being filled with zeros.
    ctx->set_materialize_grads(false);
    if (!den.defined()) return {o, std::get<1>(out), std::get<2>(out)};
    ctx->mark_non_differentiable({den});
    return {o, std::get<1>(out), std::get<2>(out), den};
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
    const bool phi_given = ctx->saved_data["phi_given"].toBool();
    // Saved phi rows have no history: under create_graph they carry q's and k's edges (InputEdges).
    at::Tensor q_in = q, k_in = k;
    if (phi_given && torch::autograd::GradMode::is_enabled()) {
      const auto edges = c10::static_intrusive_pointer_cast<InputEdges>(ctx->saved_data["input_edges"].toCapsule());
      q_in = with_edge(q, edges->q);
      k_in = with_edge(k, edges->k);
    }
    const auto [dq, dk, dv, dS0, dz0] = backward_op<Form>(
        dout, present(saved[6]), state_grad(grads[1], output_final_state),
        state_grad(grads[2], output_final_state && normalize), q_in, k_in, v, present(S0), present(z0),
        present(saved[5]), ctx->saved_data["scale"].toDouble(), ctx->saved_data["eps"].toDouble(),
        std::string_view(feature_map), normalize, ctx->saved_data["chunk_size"].toInt(), present(saved[7]),
        present(saved[8]), phi_given);
    // One entry per forward argument: dq, dk, dv, the initial-state gradients, nothing for the rest.
    variable_list result(13);
    result[0] = dq;
    result[1] = dk;
    result[2] = dv;
    if (S0.defined()) result[3] = dS0;
    if (z0.defined()) result[4] = dz0;
    return result;
  }
};

// The Autograd kernel of both forwards. Inference (no_grad, or no input requiring grad) skips
// the autograd Function: no graph node, no saved tensors, less host time before the launch.
template <class Form>
ForwardResult forward_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const OptTensor& S0,
                         const OptTensor& z0, const OptTensor& cu_seqlens, double scale, double eps,
                         std::string_view feature_map, bool normalize, bool output_final_state, int64_t chunk_size,
                         bool save_den) {
  const bool recording = records_gradient(q, k, v, S0, z0);
  if (!recording && !has_forward_grad(q, k, v, S0, z0)) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return call_forward<Form>(q, k, v, S0, z0, cu_seqlens, scale, eps, feature_map, normalize, output_final_state,
                              chunk_size, save_den, std::nullopt);
  }
  save_den = save_den || (normalize && recording);
  const variable_list out = SequenceFunction<Form>::apply(q, k, v, S0, z0, cu_seqlens, scale, eps, feature_map,
                                                          normalize, output_final_state, chunk_size, save_den);
  return {out[0], out[1], out[2], out.size() > 3 ? out[3] : at::Tensor()};
}

ForwardResult chunk_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const OptTensor& S0,
                        const OptTensor& z0, const OptTensor& cu_seqlens, double scale, double eps,
                        std::string_view feature_map, bool normalize, bool output_final_state, int64_t chunk_size,
                        bool save_den) {
  return forward_op<ChunkForm>(q, k, v, S0, z0, cu_seqlens, scale, eps, feature_map, normalize, output_final_state,
                               chunk_size, save_den);
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

BackwardResult recurrent_bwd(const at::Tensor& dout, const OptTensor& o, const OptTensor& dS, const OptTensor& dz,
                             const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const OptTensor& S0,
                             const OptTensor& z0, const OptTensor& cu_seqlens, double scale, double eps,
                             std::string_view feature_map, bool normalize) {
  return backward_op<RecurrentForm>(dout, o, dS, dz, q, k, v, S0, z0, cu_seqlens, scale, eps, feature_map, normalize,
                                    0, std::nullopt, std::nullopt, false);
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

// The features op's Autograd kernel: its rows are what autograd saves, not a differentiable result.
std::tuple<at::Tensor, at::Tensor> features(c10::DispatchKeySet keys, const at::Tensor& q, const at::Tensor& k,
                                            std::string_view feature_map) {
  TORCH_CHECK(!records_gradient(q, k) && !has_forward_grad(q, k),
              "attnrnn features is not differentiable (it writes what the chunk forward saves for its backward); "
              "apply the feature map with torch ops for gradients");
  at::AutoDispatchBelowAutograd below_autograd;
  return operators::features().redispatch(keys & c10::after_autograd_keyset, q, k, feature_map);
}

}  // namespace

TORCH_LIBRARY_IMPL(attnrnn, Autograd, m) {
  m.impl("features", &features);
  m.impl("step", &step);
  m.impl("softmax_attn_step", &softmax_attn_step);
  m.impl("chunk_fwd", &chunk_fwd);
  m.impl("recurrent_fwd", &recurrent_fwd);
  m.impl("chunk_bwd", &backward_op<ChunkForm>);
  m.impl("recurrent_bwd", &recurrent_bwd);
}
