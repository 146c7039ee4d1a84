// Links attnrnn::torch: the ops on at::Tensor, checked against the chunk and recurrent forms agreeing
// (outputs, and gradients through the dispatcher's autograd) and against the invalid-argument path
// raising a c10::Error that names the argument.
#include <attnrnn/torch.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

int main() {
  torch::manual_seed(0);
  auto q = torch::randn({2, 50, 4, 16});
  auto k = torch::randn({2, 50, 2, 16});
  auto v = torch::randn({2, 50, 2, 8});
  auto [o_chunk, S_chunk, z_chunk, saved] = attnrnn::aten::chunk_fwd(q, k, v, std::nullopt, std::nullopt, std::nullopt,
                                                              0.25, 1e-6, "elu1", true, true, 16);
  auto [o_rec, S_rec, z_rec] = attnrnn::aten::recurrent_fwd(q, k, v, std::nullopt, std::nullopt, std::nullopt,
                                                            0.25, 1e-6, "elu1", true, true);
  const double err = (o_chunk - o_rec).abs().max().item<double>();
  const double err_S = (S_chunk - S_rec).abs().max().item<double>();
  std::printf("consumer_torch: max |chunk - recurrent| = %.3g (o), %.3g (S)\n", err, err_S);
  bool named = false;
  try {
    attnrnn::aten::chunk_fwd(q, k, v.to(torch::kDouble), std::nullopt, std::nullopt, std::nullopt, 0.25, 1e-6,
                             "elu1", true, false, 0);
  } catch (const c10::Error& e) {
    named = std::string(e.what()).find("v must have the dtype of q") != std::string::npos;
  }
  std::printf("consumer_torch: dtype mismatch error names v: %s\n", named ? "yes" : "no");

  // Through the dispatcher the ops carry their autograd (csrc/torch/autograd.cpp): the gradients of
  // sum(o * w) from the chunk and the recurrent form agree.
  const auto w = torch::randn({2, 50, 4, 8});
  auto gradients = [&](bool chunk) {
    auto qg = q.clone().requires_grad_(true), kg = k.clone().requires_grad_(true), vg = v.clone().requires_grad_(true);
    at::Tensor o;
    if (chunk) {
      static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("attnrnn::chunk_fwd", "").typed<
          std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
              const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
              const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, double, double, c10::string_view,
              bool, bool, int64_t, bool)>();
      o = std::get<0>(
          op.call(qg, kg, vg, std::nullopt, std::nullopt, std::nullopt, 0.25, 1e-6, "elu1", true, false, 16, false));
    } else {
      static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("attnrnn::recurrent_fwd", "").typed<
          std::tuple<at::Tensor, at::Tensor, at::Tensor>(
              const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
              const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, double, double, c10::string_view,
              bool, bool)>();
      o = std::get<0>(op.call(qg, kg, vg, std::nullopt, std::nullopt, std::nullopt, 0.25, 1e-6, "elu1", true, false));
    }
    (o * w).sum().backward();
    return std::vector<at::Tensor>{qg.grad(), kg.grad(), vg.grad()};
  };
  const auto from_chunk = gradients(true), from_recurrent = gradients(false);
  double err_grad = 0;
  for (size_t i = 0; i < from_chunk.size(); ++i)
    err_grad = std::max(err_grad, (from_chunk[i] - from_recurrent[i]).abs().max().item<double>());
  std::printf("consumer_torch: max |chunk - recurrent| = %.3g (gradients through the dispatcher)\n", err_grad);
  return err < 1e-4 && err_S < 1e-3 && named && err_grad < 1e-3 ? 0 : 1;
}
