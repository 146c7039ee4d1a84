// Typed handles of the torch.ops.attnrnn operators in the dispatcher. A call through one runs
// every dispatch key the operator has (autograd, ADInplaceOrView, Python modes) as torch.ops does,
// without boxing the arguments. autograd.cpp calls them below the Autograd key; module.cpp's eager
// calls call them from the top.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <optional>
#include <string_view>
#include <tuple>

namespace attnrnn::operators {

using OptTensor = std::optional<at::Tensor>;
using ForwardResult = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;             // o, S, z, saved
using BackwardResult = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;  // dq, dk, dv, dS0, dz0

using ChunkFwd = ForwardResult(const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptTensor&,
                               const OptTensor&, const OptTensor&, double, double, std::string_view, bool, bool,
                               int64_t, bool);
using RecurrentFwd = std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                                    const at::Tensor&, const OptTensor&,
                                                                    const OptTensor&, const OptTensor&, double, double,
                                                                    std::string_view, bool, bool);
using ChunkBwd = BackwardResult(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const OptTensor&, const at::Tensor&, const OptTensor&, const OptTensor&,
                                const OptTensor&, const OptTensor&, const OptTensor&, double, double,
                                std::string_view, bool, int64_t);
using RecurrentBwd = BackwardResult(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                    const OptTensor&, const OptTensor&, const OptTensor&, const OptTensor&,
                                    const OptTensor&, const OptTensor&, double, double, std::string_view, bool);
using Step = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, at::Tensor&, const OptTensor&,
                        const OptTensor&, double, double, std::string_view, bool);
using SoftmaxAttnStep = at::Tensor(const at::Tensor&, at::Tensor&, at::Tensor&, const at::Tensor&, const OptTensor&,
                                   const OptTensor&, double, int64_t);

// The handle of `name` with the C++ signature Signature (each function below keeps its own).
template <class Signature>
c10::TypedOperatorHandle<Signature> find(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").template typed<Signature>();
}

inline const auto& chunk_fwd() {
  static const auto op = find<ChunkFwd>("attnrnn::chunk_fwd");
  return op;
}
inline const auto& recurrent_fwd() {
  static const auto op = find<RecurrentFwd>("attnrnn::recurrent_fwd");
  return op;
}
inline const auto& chunk_bwd() {
  static const auto op = find<ChunkBwd>("attnrnn::chunk_bwd");
  return op;
}
inline const auto& recurrent_bwd() {
  static const auto op = find<RecurrentBwd>("attnrnn::recurrent_bwd");
  return op;
}
inline const auto& step() {
  static const auto op = find<Step>("attnrnn::step");
  return op;
}
inline const auto& softmax_attn_step() {
  static const auto op = find<SoftmaxAttnStep>("attnrnn::softmax_attn_step");
  return op;
}

}  // namespace attnrnn::operators
