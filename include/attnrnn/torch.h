// attnrnn ops on at::Tensor (target attnrnn::torch). The same functions back the
// torch.ops.attnrnn.* operators, whose autograd (csrc/torch/autograd.cpp) sits on top of them:
// these functions compute no gradients themselves; calling the operators through the dispatcher does.
//
// Shapes: q [B,T,H,K], k [B,T,Hkv,K], v [B,T,Hkv,V] (any strides, unit stride on the last dim),
// states S [N,Hkv,K,V] and z [N,Hkv,K] in float32 (float64 for float64 inputs).
// feature_map is "identity", "elu1" or "relu". chunk_size 0 lets the kernel choose.
// Returned tensors that were not asked for (final state without output_final_state, z without
// normalize, initial-state gradients without an initial state) are empty tensors of shape [0].
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string_view>
#include <tuple>

namespace attnrnn::aten {

// -> (o [B,T,H,V], S_final, z_final, den). With save_den (and normalize), den is w = scale / den_t
// [B,T,H] float32 of each (token, query head) where the forward's kernels produce it (the CUDA
// tensor-core forwards), for chunk_bwd to read instead of recomputing; otherwise empty.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> chunk_fwd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& initial_S, const std::optional<at::Tensor>& initial_z,
    const std::optional<at::Tensor>& cu_seqlens, double scale, double eps,
    std::string_view feature_map, bool normalize, bool output_final_state, int64_t chunk_size,
    bool save_den = false);

// o is the forward output (needed with normalize: the CUDA backward reads it instead of recomputing);
// den the forward's den output (optional; an empty tensor counts as absent).
// -> (dq, dk, dv, d_initial_S, d_initial_z)
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> chunk_bwd(
    const at::Tensor& dout, const std::optional<at::Tensor>& o, const std::optional<at::Tensor>& d_final_S,
    const std::optional<at::Tensor>& d_final_z, const at::Tensor& q, const at::Tensor& k,
    const at::Tensor& v, const std::optional<at::Tensor>& initial_S,
    const std::optional<at::Tensor>& initial_z, const std::optional<at::Tensor>& cu_seqlens,
    double scale, double eps, std::string_view feature_map, bool normalize, int64_t chunk_size,
    const std::optional<at::Tensor>& den = std::nullopt);

// The token-by-token forms: same arguments without chunk_size.
std::tuple<at::Tensor, at::Tensor, at::Tensor> recurrent_fwd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& initial_S, const std::optional<at::Tensor>& initial_z,
    const std::optional<at::Tensor>& cu_seqlens, double scale, double eps,
    std::string_view feature_map, bool normalize, bool output_final_state);

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> recurrent_bwd(
    const at::Tensor& dout, const std::optional<at::Tensor>& o, const std::optional<at::Tensor>& d_final_S,
    const std::optional<at::Tensor>& d_final_z, const at::Tensor& q, const at::Tensor& k,
    const at::Tensor& v, const std::optional<at::Tensor>& initial_S,
    const std::optional<at::Tensor>& initial_z, const std::optional<at::Tensor>& cu_seqlens,
    double scale, double eps, std::string_view feature_map, bool normalize);

// One decode step: q [B,H,K], k [B,Hkv,K], v [B,Hkv,V]; S [P,Hkv,K,V] and z [P,Hkv,K] are
// updated in place at rows state_indices (or 0..B-1); a negative index skips its row.
// -> o [B,H,V]
at::Tensor step(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& S,
                const std::optional<at::Tensor>& z, const std::optional<at::Tensor>& state_indices,
                double scale, double eps, std::string_view feature_map, bool normalize);

}  // namespace attnrnn::aten
