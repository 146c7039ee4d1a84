// Links attnrnn::torch: the ops on at::Tensor, checked against the chunk and recurrent forms agreeing
// and against the invalid-argument path raising a c10::Error that names the argument.
#include <attnrnn/torch.h>
#include <torch/torch.h>

#include <cstdio>
#include <string>

int main() {
  torch::manual_seed(0);
  auto q = torch::randn({2, 50, 4, 16});
  auto k = torch::randn({2, 50, 2, 16});
  auto v = torch::randn({2, 50, 2, 8});
  auto [o_chunk, S_chunk, z_chunk] = attnrnn::aten::chunk_fwd(q, k, v, std::nullopt, std::nullopt, std::nullopt,
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
  return err < 1e-4 && err_S < 1e-3 && named ? 0 : 1;
}
