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

// chunk_fwd that also writes its segment states into segment_states (float32,
// chunk_fwd_segment_state_floats() elements, which must not be 0), for chunk_bwd's dq sweep.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> chunk_fwd_with_segment_states(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& initial_S, const std::optional<at::Tensor>& initial_z,
    const std::optional<at::Tensor>& cu_seqlens, double scale, double eps,
    std::string_view feature_map, bool normalize, bool output_final_state, int64_t chunk_size,
    bool save_den, at::Tensor& segment_states);

// Elements of chunk_fwd's segment_states for these inputs: 0 (pass none) except on CUDA (sm_90a) with
// bf16/fp16, normalize=False and K = V = 128 at shapes whose sweeps split the sequences into segments
// (few sequences and kv heads, long T), where the backward's dq sweep then reads the forward's
// segment states instead of summing them again.
int64_t chunk_fwd_segment_state_floats(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                       const std::optional<at::Tensor>& cu_seqlens,
                                       std::string_view feature_map, bool normalize, int64_t chunk_size);

// phi(q), phi(k) under feature_map as contiguous tensors of q's dtype: the rows the CUDA chunk
// kernels' feature pass writes. Not differentiable (autograd calls it for what it saves).
std::tuple<at::Tensor, at::Tensor> features(const at::Tensor& q, const at::Tensor& k, std::string_view feature_map);

// Whether autograd saves features(q, k) for chunk_bwd (phi_given) instead of q and k: on CUDA where
// the forward and the backward would each run the feature pass (linear_attn_chunk_saves_features).
bool chunk_saves_features(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const std::optional<at::Tensor>& cu_seqlens, std::string_view feature_map, bool normalize,
                          int64_t chunk_size);

// o is the forward output (needed with normalize: the CUDA backward reads it instead of recomputing);
// den the forward's den output (optional; an empty tensor counts as absent); segment_states the
// tensor the forward wrote its segment states to (optional). phi_given: q and k are features(q, k)
// of the forward's inputs; dq and dk are still the gradients of those inputs.
// -> (dq, dk, dv, d_initial_S, d_initial_z)
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> chunk_bwd(
    const at::Tensor& dout, const std::optional<at::Tensor>& o, const std::optional<at::Tensor>& d_final_S,
    const std::optional<at::Tensor>& d_final_z, const at::Tensor& q, const at::Tensor& k,
    const at::Tensor& v, const std::optional<at::Tensor>& initial_S,
    const std::optional<at::Tensor>& initial_z, const std::optional<at::Tensor>& cu_seqlens,
    double scale, double eps, std::string_view feature_map, bool normalize, int64_t chunk_size,
    const std::optional<at::Tensor>& den = std::nullopt,
    const std::optional<at::Tensor>& segment_states = std::nullopt, bool phi_given = false);

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
