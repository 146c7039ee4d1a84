// Softmax attention as an RNN on at::Tensor (target attnrnn::torch); backs torch.ops.attnrnn.softmax_*.
//
// q [B,Tq,H,D], k [B,Tk,Hkv,D], v [B,Tk,Hkv,Dv] (any strides, unit stride on the last dim).
// lse is [B,H,Tq], float32 (float64 for float64 inputs). CPU kernels only for now: CUDA tensors
// raise NotImplementedError.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

namespace attnrnn::aten {

// -> (o [B,Tq,H,Dv], lse [B,H,Tq])
std::tuple<at::Tensor, at::Tensor> softmax_attn_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                    const std::optional<at::Tensor>& cu_seqlens, double scale,
                                                    bool causal);

// -> (dq, dk, dv)
std::tuple<at::Tensor, at::Tensor, at::Tensor> softmax_attn_bwd(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& o,
    const at::Tensor& lse, const std::optional<at::Tensor>& cu_seqlens, double scale, bool causal);

// One decode token: q [B,H,D]; caches [B,Lmax,Hkv,D(v)] (k_new/v_new [B,Hkv,D(v)] are written at
// row cache_seqlens[b] first); cache_seqlens int32 [B] is not updated. -> o [B,H,Dv]
at::Tensor softmax_attn_step(const at::Tensor& q, at::Tensor& k_cache, at::Tensor& v_cache,
                             const at::Tensor& cache_seqlens, const std::optional<at::Tensor>& k_new,
                             const std::optional<at::Tensor>& v_new, double scale, int64_t split_size);

}  // namespace attnrnn::aten
