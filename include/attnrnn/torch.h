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

// -> (o [B,T,H,V], S_final, z_final, saved). With for_backward, saved is what chunk_bwd reads
// (uint8, chunk_linear_attn_saved_bytes() of attnrnn.h: on CUDA the forward's w = scale / den_t and,
// where its sweeps split the sequences, their segment states; empty elsewhere); without, empty.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> chunk_fwd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& initial_S, const std::optional<at::Tensor>& initial_z,
    const std::optional<at::Tensor>& cu_seqlens, double scale, double eps,
    std::string_view feature_map, bool normalize, bool output_final_state, int64_t chunk_size,
    bool for_backward = false);

// o and saved are the forward's results for the same q, k, v and options (o is read with normalize
// on CUDA, and may be absent elsewhere).
// -> (dq, dk, dv, d_initial_S, d_initial_z)
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> chunk_bwd(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& o,
    const at::Tensor& saved, const std::optional<at::Tensor>& d_final_S,
    const std::optional<at::Tensor>& d_final_z, const std::optional<at::Tensor>& initial_S,
    const std::optional<at::Tensor>& initial_z, const std::optional<at::Tensor>& cu_seqlens, double scale,
    double eps, std::string_view feature_map, bool normalize, int64_t chunk_size);

// The token-by-token forms: the same arguments without chunk_size (and nothing saved).
std::tuple<at::Tensor, at::Tensor, at::Tensor> recurrent_fwd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& initial_S, const std::optional<at::Tensor>& initial_z,
    const std::optional<at::Tensor>& cu_seqlens, double scale, double eps,
    std::string_view feature_map, bool normalize, bool output_final_state);

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> recurrent_bwd(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& o,
    const std::optional<at::Tensor>& d_final_S, const std::optional<at::Tensor>& d_final_z,
    const std::optional<at::Tensor>& initial_S, const std::optional<at::Tensor>& initial_z,
    const std::optional<at::Tensor>& cu_seqlens, double scale, double eps, std::string_view feature_map,
    bool normalize);

// One decode step: q [B,H,K], k [B,Hkv,K], v [B,Hkv,V]; S [P,Hkv,K,V] and z [P,Hkv,K] are
// updated in place at rows state_indices (or 0..B-1); a negative index skips its row.
// -> o [B,H,V]
at::Tensor step(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& S,
                const std::optional<at::Tensor>& z, const std::optional<at::Tensor>& state_indices,
                double scale, double eps, std::string_view feature_map, bool normalize);

}  // namespace attnrnn::aten
