// ATen glue of the linear-attention ops: check every argument (naming it in the error), allocate
// outputs, fill the torch-free params struct, pick the device's stream, and turn a status into an
// exception. No math lives here.
#include <ATen/Context.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/core/DeviceGuard.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "attnrnn/attnrnn.h"
#include "attnrnn/torch.h"
#include "checks.h"

namespace attnrnn::aten {

namespace {

using namespace detail;

// PyTorch's float32 matmul precision for CUDA: "high" and "medium" (torch.set_float32_matmul_precision,
// or torch.backends.cuda.matmul.fp32_precision = "tf32") let fp32 products read TF32 operands, as
// cuBLAS's matmuls then do; "highest" keeps fp32 accuracy.
bool fp32_matmul_allows_tf32() {
#if defined(ATTNRNN_TORCH_HAS_FLOAT32_PRECISION)
  return at::globalContext().float32Precision(at::Float32Backend::CUDA, at::Float32Op::MATMUL) ==
         at::Float32Precision::TF32;
#else
  return at::globalContext().allowTF32CuBLAS();
#endif
}

FeatureMap parse_feature_map(std::string_view name, const char* op) {
  if (name == "identity") return FeatureMap::kIdentity;
  if (name == "elu1") return FeatureMap::kElu1;
  if (name == "relu") return FeatureMap::kRelu;
  TORCH_CHECK_VALUE(false, op, ": feature_map must be 'identity', 'elu1' or 'relu', got '",
                    std::string(name), "'");
}

// A state tensor (S or z, or their gradients): on q's device, state dtype, the given shape.
at::Tensor checked_state(const at::Tensor& t, const at::Tensor& q, at::IntArrayRef shape, const char* op,
                         const char* name) {
  check_same_device(t, q, op, name);
  TORCH_CHECK_VALUE(t.scalar_type() == state_scalar_type(q), op, ": ", name, " must be ",
                    state_scalar_type(q), " (the state type for ", q.scalar_type(), " inputs), got ",
                    t.scalar_type());
  check_exact_shape(t, shape, op, name);
  return t.contiguous();
}

// q [..., H, K], k [..., Hkv, K], v [..., Hkv, V] of one op: devices, dtypes, heads, head dims,
// unit last-dim strides, and the scale and eps options. Returns the input dtype.
DType check_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale, double eps,
                const char* op) {
  check_same_device(k, q, op, "k");
  check_same_device(v, q, op, "v");
  const DType dtype = dtype_of(q, op, "q");
  TORCH_CHECK_VALUE(k.scalar_type() == q.scalar_type(), op, ": k must have the dtype of q (",
                    q.scalar_type(), "), got ", k.scalar_type());
  TORCH_CHECK_VALUE(v.scalar_type() == q.scalar_type(), op, ": v must have the dtype of q (",
                    q.scalar_type(), "), got ", v.scalar_type());
  const int64_t H = q.size(-2), K = q.size(-1), Hkv = k.size(-2), V = v.size(-1);
  TORCH_CHECK_VALUE(k.size(-1) == K, op, ": k must have the head dim of q (K = ", K, "), got shape ",
                    shape_of(k));
  TORCH_CHECK_VALUE(v.size(-2) == Hkv, op, ": v must have the heads of k (Hkv = ", Hkv, "), got shape ",
                    shape_of(v));
  TORCH_CHECK_VALUE(Hkv >= 1 && H % Hkv == 0, op, ": the heads of k and v (", Hkv,
                    ") must divide the heads of q (", H, ")");
  TORCH_CHECK_VALUE(K >= 1 && K <= 256, op, ": q and k head dim K must be in [1, 256], got ", K);
  TORCH_CHECK_VALUE(V >= 1 && V <= 256, op, ": v head dim V must be in [1, 256], got ", V);
  check_unit_last_stride(q, op, "q");
  check_unit_last_stride(k, op, "k");
  check_unit_last_stride(v, op, "v");
  TORCH_CHECK_VALUE(std::isfinite(scale), op, ": scale must be finite, got ", scale);
  TORCH_CHECK_VALUE(std::isfinite(eps) && eps >= 0, op, ": eps must be finite and >= 0, got ", eps);
  return dtype;
}

// Everything the forward and backward of both forms need to know about (q, k, v, state, varlen).
struct SequenceArgs {
  LinearAttnBwdParams params;  // the forward's fields filled; the backward adds its own
  at::Tensor initial_S, initial_z, cu_seqlens;  // kept alive (contiguous copies when needed)
  int64_t num_states = 0;                       // N
};

SequenceArgs sequence_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const OptTensor& initial_S, const OptTensor& initial_z, const OptTensor& cu_seqlens,
                           double scale, double eps, std::string_view feature_map, bool normalize,
                           int64_t chunk_size, const char* op) {
  check_rank(q, 4, op, "q", "[B, T, H, K]");
  check_rank(k, 4, op, "k", "[B, T, Hkv, K]");
  check_rank(v, 4, op, "v", "[B, T, Hkv, V]");
  SequenceArgs a;
  LinearAttnBwdParams& p = a.params;
  p.dtype = check_qkv(q, k, v, scale, eps, op);
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), K = q.size(3);
  const int64_t Hkv = k.size(2), V = v.size(3);
  TORCH_CHECK_VALUE(k.size(0) == B && k.size(1) == T, op, ": k must have the batch and length of q (",
                    B, ", ", T, "), got shape ", shape_of(k));
  TORCH_CHECK_VALUE(v.size(0) == B && v.size(1) == T, op, ": v must have the batch and length of q (",
                    B, ", ", T, "), got shape ", shape_of(v));
  TORCH_CHECK_VALUE(chunk_size >= 0 && chunk_size <= 1024, op,
                    ": chunk_size must be in [1, 1024] (or None for the default), got ", chunk_size);

  a.num_states = B;
  if (cu_seqlens.has_value()) {
    a.cu_seqlens = detail::checked_cu_seqlens(*cu_seqlens, q, op);
    const at::Tensor& cu = a.cu_seqlens;
    a.num_states = cu.numel() - 1;
    p.cu_seqlens = a.cu_seqlens.data_ptr();
    p.cu_seqlens_int64 = cu.scalar_type() == at::kLong;
    p.num_seqs = a.num_states;
  }
  const int64_t N = a.num_states;
  if (initial_S.has_value()) {
    a.initial_S = checked_state(*initial_S, q, {N, Hkv, K, V}, op, "initial_state.S");
    if (normalize) {
      TORCH_CHECK_VALUE(initial_z.has_value(), op,
                        ": initial_state.z [N, Hkv, K] is required with normalize=True");
    }
  } else {
    TORCH_CHECK_VALUE(!initial_z.has_value(), op, ": initial_state.z was given without initial_state.S");
  }
  if (initial_z.has_value()) {
    TORCH_CHECK_VALUE(normalize, op, ": initial_state.z must be None with normalize=False");
    a.initial_z = checked_state(*initial_z, q, {N, Hkv, K}, op, "initial_state.z");
  }

  set_device(p, q);
  p.batch = B;
  p.seqlen = T;
  p.num_heads = H;
  p.num_kv_heads = Hkv;
  p.head_dim_k = K;
  p.head_dim_v = V;
  p.q = const_view(q);
  p.k = const_view(k);
  p.v = const_view(v);
  p.initial_S = a.initial_S.defined() ? a.initial_S.data_ptr() : nullptr;
  p.initial_z = a.initial_z.defined() ? a.initial_z.data_ptr() : nullptr;
  p.scale = scale;
  p.eps = eps;
  p.feature_map = parse_feature_map(feature_map, op);
  p.normalize = normalize;
  p.chunk_size = chunk_size;
  p.allow_tf32 = fp32_matmul_allows_tf32();
  return a;
}

// Device memory of `bytes` bytes on q's device (kept alive by the caller until the launch returns;
// stream-ordered), or an undefined tensor for 0.
at::Tensor device_bytes(int64_t bytes, const at::Tensor& q) {
  return bytes == 0 ? at::Tensor() : at::empty({bytes}, q.options().dtype(at::kByte));
}

// -> (o, S_final, z_final, saved); saved is what the chunk backward reads (bytes), empty unless
// for_backward.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> forward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const OptTensor& initial_S,
    const OptTensor& initial_z, const OptTensor& cu_seqlens, double scale, double eps,
    std::string_view feature_map, bool normalize, bool output_final_state, int64_t chunk_size, bool for_backward,
    bool recurrent, const char* op) {
  SequenceArgs a = sequence_args(q, k, v, initial_S, initial_z, cu_seqlens, scale, eps, feature_map,
                                 normalize, chunk_size, op);
  LinearAttnFwdParams& p = a.params;
  const c10::DeviceGuard guard(q.device());  // the plan asks the current device
  const auto state_opts = q.options().dtype(state_scalar_type(q));
  at::Tensor o = at::empty({p.batch, p.seqlen, p.num_heads, p.head_dim_v}, q.options());
  p.o = mut_view(o);
  at::Tensor S_final, z_final;
  if (output_final_state) {
    S_final = at::empty({a.num_states, p.num_kv_heads, p.head_dim_k, p.head_dim_v}, state_opts);
    p.final_S = mut_data_or_null(S_final);
    if (normalize) {
      z_final = at::empty({a.num_states, p.num_kv_heads, p.head_dim_k}, state_opts);
      p.final_z = mut_data_or_null(z_final);
    }
  }
  at::Tensor saved = for_backward && !recurrent ? device_bytes(chunk_linear_attn_saved_bytes(p), q) : at::Tensor();
  p.saved = saved.defined() ? saved.data_ptr() : nullptr;
  const at::Tensor workspace = recurrent ? at::Tensor() : device_bytes(chunk_linear_attn_fwd_workspace_bytes(p), q);
  p.workspace = workspace.defined() ? workspace.data_ptr() : nullptr;
  check_status(recurrent ? recurrent_linear_attn_fwd(p) : chunk_linear_attn_fwd(p), op);
  // The results the call was not asked for are empty tensors, made after the launch: the host's
  // time before the kernel starts is the call's latency on an idle GPU.
  if (!S_final.defined()) S_final = at::empty({0}, state_opts);
  if (!z_final.defined()) z_final = at::empty({0}, state_opts);
  if (!saved.defined()) saved = at::empty({0}, q.options().dtype(at::kByte));
  return {o, S_final, z_final, saved};
}

// -> (dq, dk, dv, d_initial_S, d_initial_z)
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const OptTensor& o,
    const OptTensor& saved, const OptTensor& d_final_S, const OptTensor& d_final_z, const OptTensor& initial_S,
    const OptTensor& initial_z, const OptTensor& cu_seqlens, double scale, double eps, std::string_view feature_map,
    bool normalize, int64_t chunk_size, bool recurrent, const char* op) {
  SequenceArgs a = sequence_args(q, k, v, initial_S, initial_z, cu_seqlens, scale, eps, feature_map,
                                 normalize, chunk_size, op);
  LinearAttnBwdParams& p = a.params;
  const int64_t N = a.num_states, Hkv = p.num_kv_heads, K = p.head_dim_k, V = p.head_dim_v;
  // o, the forward's output: read with normalize on CUDA (dd_t = dout_t . o_t), unused elsewhere
  TORCH_CHECK_VALUE(o.has_value() || !(normalize && q.is_cuda()), op,
                    ": o (the forward output) is required with normalize=True");
  for (auto [t, name] : {std::pair<const at::Tensor*, const char*>{&dout, "grad of o"}, {o ? &*o : nullptr, "o"}}) {
    if (t == nullptr) continue;
    check_rank(*t, 4, op, name, "[B, T, H, V]");
    check_same_device(*t, q, op, name);
    check_same_dtype(*t, q, op, name);
    check_exact_shape(*t, {p.batch, p.seqlen, p.num_heads, V}, op, name);
    check_unit_last_stride(*t, op, name);
  }
  at::Tensor dS_final, dz_final;
  if (d_final_S.has_value()) dS_final = checked_state(*d_final_S, q, {N, Hkv, K, V}, op, "grad of final_state.S");
  if (d_final_z.has_value()) {
    TORCH_CHECK_VALUE(normalize, op, ": grad of final_state.z must be None with normalize=False");
    dz_final = checked_state(*d_final_z, q, {N, Hkv, K}, op, "grad of final_state.z");
  }

  const c10::DeviceGuard guard(q.device());
  const auto state_opts = q.options().dtype(state_scalar_type(q));
  at::Tensor dq = at::empty(q.sizes(), q.options());
  at::Tensor dk = at::empty(k.sizes(), k.options());
  at::Tensor dv = at::empty(v.sizes(), v.options());
  at::Tensor dS0, dz0;
  if (a.initial_S.defined()) dS0 = at::empty({N, Hkv, K, V}, state_opts);
  if (a.initial_z.defined()) dz0 = at::empty({N, Hkv, K}, state_opts);
  p.dout = const_view(dout);
  if (o.has_value()) p.out = const_view(*o);
  p.dq = mut_view(dq);
  p.dk = mut_view(dk);
  p.dv = mut_view(dv);
  p.d_final_S = dS_final.defined() ? dS_final.data_ptr() : nullptr;
  p.d_final_z = dz_final.defined() ? dz_final.data_ptr() : nullptr;
  if (dS0.defined()) p.d_initial_S = mut_data_or_null(dS0);
  if (dz0.defined()) p.d_initial_z = mut_data_or_null(dz0);
  if (saved.has_value()) {
    // What the forward of these inputs kept: its size is the plan's, whatever it holds.
    const int64_t bytes = chunk_linear_attn_saved_bytes(p);
    check_same_device(*saved, q, op, "saved");
    TORCH_CHECK_VALUE(saved->scalar_type() == at::kByte && saved->dim() == 1 && saved->numel() == bytes &&
                          saved->is_contiguous(),
                      op, ": saved must be the forward's saved tensor for these inputs (uint8 [", bytes,
                      "]), got ", saved->scalar_type(), " of shape ", shape_of(*saved));
    p.saved = bytes > 0 ? saved->data_ptr() : nullptr;
  }
  const at::Tensor workspace = device_bytes(
      recurrent ? recurrent_linear_attn_bwd_workspace_bytes(p) : chunk_linear_attn_bwd_workspace_bytes(p), q);
  p.workspace = workspace.defined() ? workspace.data_ptr() : nullptr;
  check_status(recurrent ? recurrent_linear_attn_bwd(p) : chunk_linear_attn_bwd(p), op);
  // As in the forward: the placeholders for gradients nobody asked for come after the launch.
  if (!dS0.defined()) dS0 = at::empty({0}, state_opts);
  if (!dz0.defined()) dz0 = at::empty({0}, state_opts);
  return {dq, dk, dv, dS0, dz0};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> chunk_fwd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const OptTensor& initial_S,
    const OptTensor& initial_z, const OptTensor& cu_seqlens, double scale, double eps,
    std::string_view feature_map, bool normalize, bool output_final_state, int64_t chunk_size, bool for_backward) {
  return forward(q, k, v, initial_S, initial_z, cu_seqlens, scale, eps, feature_map, normalize, output_final_state,
                 chunk_size, for_backward, false, "chunk_linear_attn");
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> recurrent_fwd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const OptTensor& initial_S,
    const OptTensor& initial_z, const OptTensor& cu_seqlens, double scale, double eps,
    std::string_view feature_map, bool normalize, bool output_final_state) {
  auto [o, S, z, saved] = forward(q, k, v, initial_S, initial_z, cu_seqlens, scale, eps, feature_map, normalize,
                                  output_final_state, 0, false, true, "recurrent_linear_attn");
  return {o, S, z};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> chunk_bwd(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const OptTensor& o,
    const at::Tensor& saved, const OptTensor& d_final_S, const OptTensor& d_final_z, const OptTensor& initial_S,
    const OptTensor& initial_z, const OptTensor& cu_seqlens, double scale, double eps, std::string_view feature_map,
    bool normalize, int64_t chunk_size) {
  return backward(dout, q, k, v, o, saved, d_final_S, d_final_z, initial_S, initial_z, cu_seqlens, scale, eps,
                  feature_map, normalize, chunk_size, false, "chunk_linear_attn backward");
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> recurrent_bwd(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const OptTensor& o,
    const OptTensor& d_final_S, const OptTensor& d_final_z, const OptTensor& initial_S, const OptTensor& initial_z,
    const OptTensor& cu_seqlens, double scale, double eps, std::string_view feature_map, bool normalize) {
  return backward(dout, q, k, v, o, std::nullopt, d_final_S, d_final_z, initial_S, initial_z, cu_seqlens, scale, eps,
                  feature_map, normalize, 0, true, "recurrent_linear_attn backward");
}

at::Tensor step(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& S,
                const OptTensor& z, const OptTensor& state_indices, double scale, double eps,
                std::string_view feature_map, bool normalize) {
  const char* op = "linear_attn_step";
  check_rank(q, 3, op, "q", "[B, H, K]");
  check_rank(k, 3, op, "k", "[B, Hkv, K]");
  check_rank(v, 3, op, "v", "[B, Hkv, V]");
  LinearAttnStepParams p;
  p.dtype = check_qkv(q, k, v, scale, eps, op);
  const int64_t B = q.size(0), H = q.size(1), K = q.size(2), Hkv = k.size(1), V = v.size(2);
  TORCH_CHECK_VALUE(k.size(0) == B && v.size(0) == B, op, ": k and v must have the batch of q (", B,
                    "), got shapes ", shape_of(k), " and ", shape_of(v));

  check_rank(S, 4, op, "state.S", "[P, Hkv, K, V]");
  check_same_device(S, q, op, "state.S");
  TORCH_CHECK_VALUE(S.scalar_type() == state_scalar_type(q), op, ": state.S must be ", state_scalar_type(q),
                    ", got ", S.scalar_type());
  const int64_t P = S.size(0);
  check_exact_shape(S, {P, Hkv, K, V}, op, "state.S");
  TORCH_CHECK_VALUE(S.is_contiguous(), op, ": state.S must be contiguous (it is updated in place)");
  if (normalize) {
    TORCH_CHECK_VALUE(z.has_value(), op, ": state.z [P, Hkv, K] is required with normalize=True");
    check_same_device(*z, q, op, "state.z");
    TORCH_CHECK_VALUE(z->scalar_type() == state_scalar_type(q), op, ": state.z must be ",
                      state_scalar_type(q), ", got ", z->scalar_type());
    check_exact_shape(*z, {P, Hkv, K}, op, "state.z");
    TORCH_CHECK_VALUE(z->is_contiguous(), op, ": state.z must be contiguous (it is updated in place)");
  } else {
    TORCH_CHECK_VALUE(!z.has_value(), op, ": state.z must be None with normalize=False");
  }
  at::Tensor indices;
  if (state_indices.has_value()) {
    check_same_device(*state_indices, q, op, "state_indices");
    TORCH_CHECK_VALUE(state_indices->scalar_type() == at::kInt || state_indices->scalar_type() == at::kLong,
                      op, ": state_indices must be int32 or int64, got ", state_indices->scalar_type());
    TORCH_CHECK_VALUE(state_indices->dim() == 1 && state_indices->size(0) == B, op,
                      ": state_indices must have shape [B] = [", B, "], got ", shape_of(*state_indices));
    indices = state_indices->contiguous();
    p.state_indices = indices.data_ptr();
    p.state_indices_int64 = indices.scalar_type() == at::kLong;
  } else {
    TORCH_CHECK_VALUE(P >= B, op, ": state.S must have at least B = ", B,
                      " rows without state_indices, got ", P);
  }
  // The state is updated in place: no other argument may share its memory.
  std::vector<std::pair<const at::Tensor*, const char*>> read{{&q, "q"}, {&k, "k"}, {&v, "v"}};
  if (state_indices.has_value()) read.emplace_back(&*state_indices, "state_indices");
  for (const auto& [t, name] : read) {
    check_no_overlap(S, "state.S", *t, name, op);
    if (normalize) check_no_overlap(*z, "state.z", *t, name, op);
  }
  if (normalize) check_no_overlap(*z, "state.z", S, "state.S", op);

  set_device(p, q);
  const c10::DeviceGuard guard(q.device());
  at::Tensor o = at::empty({B, H, V}, q.options());
  p.batch = B;
  p.num_heads = H;
  p.num_kv_heads = Hkv;
  p.head_dim_k = K;
  p.head_dim_v = V;
  p.q = ConstView{q.data_ptr(), q.stride(0), 0, q.stride(1)};
  p.k = ConstView{k.data_ptr(), k.stride(0), 0, k.stride(1)};
  p.v = ConstView{v.data_ptr(), v.stride(0), 0, v.stride(1)};
  p.o = MutView{o.data_ptr(), o.stride(0), 0, o.stride(1)};
  p.S = S.data_ptr();
  p.z = normalize ? z->data_ptr() : nullptr;
  p.pool_size = P;
  p.scale = scale;
  p.eps = eps;
  p.feature_map = parse_feature_map(feature_map, op);
  p.normalize = normalize;
  check_status(linear_attn_step(p), op);
  return o;
}

}  // namespace attnrnn::aten
