// attnrnn: causal linear attention as an RNN. Torch-free C++17 API.
//
// Every op takes one plain params struct of raw pointers, element strides and options, and returns
// a Status. The library never allocates device memory behind the caller's back, never synchronizes
// a device and never calls exit(); CPU kernels may allocate host scratch.
//
// Shapes (elements; the last dimension of every q/k/v/o view has unit stride):
//   q, o, do, dq : [B, T, H,   K] / [B, T, H, V]
//   k, dk        : [B, T, Hkv, K]
//   v, dv        : [B, T, Hkv, V]
//   S            : [N, Hkv, K, V] contiguous, state type (see state_dtype)
//   z            : [N, Hkv, K]    contiguous, state type
// N = B, or the number of sequences when cu_seqlens packs them along T (then B == 1).
// Query head h reads key/value head h / (H / Hkv).
//
// Math, with q' = scale * phi(q), k' = phi(k):
//   S_t = S_{t-1} + k'_t^T v_t,  z_t = z_{t-1} + k'_t,
//   o_t = q'_t S_t / (q'_t . z_t + eps)   (normalize)   or   q'_t S_t   (otherwise).
#pragma once

#include <cstdint>

namespace attnrnn {

enum class Status : int {
  kSuccess = 0,
  kInvalidArgument = 1,   // a params field is out of range; status_message() says which
  kNotImplemented = 2,    // the combination exists in the API but not for this device yet
  kNotCompiled = 3,       // the library was built without support for the requested device
  kDeviceError = 4,       // a CUDA runtime call failed
};

// Human-readable name of a status code.
const char* status_string(Status status);

// Detail of the last non-success status returned on this thread (names the offending field).
const char* last_error_message();

enum class DType : int { kFloat64 = 0, kFloat32 = 1, kFloat16 = 2, kBFloat16 = 3 };

// The state and accumulators are float64 for float64 inputs and float32 otherwise.
inline DType state_dtype(DType input) { return input == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32; }

enum class FeatureMap : int {
  kIdentity = 0,  // phi(x) = x
  kElu1 = 1,      // phi(x) = elu(x) + 1 = x + 1 (x > 0), exp(x) (x <= 0)
  kRelu = 2,      // phi(x) = max(x, 0)
};

enum class Device : int { kCPU = 0, kCUDA = 1 };

// How CPU kernels run work items in parallel. The default (parallel_for == nullptr) uses the
// library's persistent thread pool with num_threads threads; the PyTorch glue passes torch's
// intra-op thread count so torch.set_num_threads applies.
struct CpuExecutor {
  using Body = void (*)(void* body_ctx, int64_t begin, int64_t end);
  // Must call body(body_ctx, b, e) over disjoint ranges covering [0, n) and return when all are done.
  void (*parallel_for)(void* self, int64_t n, int64_t grain, Body body, void* body_ctx) = nullptr;
  void* self = nullptr;
  int num_threads = 0;  // used by the default executor; 0 = std::thread::hardware_concurrency()
};

// A [B, T, H, D] tensor with unit stride on D; strides in elements.
struct ConstView {
  const void* data = nullptr;
  int64_t stride_b = 0, stride_t = 0, stride_h = 0;
};
struct MutView {
  void* data = nullptr;
  int64_t stride_b = 0, stride_t = 0, stride_h = 0;
};

// The forward of the chunkwise and recurrent forms.
struct LinearAttnFwdParams {
  Device device = Device::kCPU;
  void* stream = nullptr;  // cudaStream_t for Device::kCUDA
  DType dtype = DType::kFloat32;

  int64_t batch = 0, seqlen = 0;
  int64_t num_heads = 0, num_kv_heads = 0;
  int64_t head_dim_k = 0, head_dim_v = 0;

  // Variable-length packing: [num_seqs + 1] offsets into T (int32 or int64), batch must be 1.
  const void* cu_seqlens = nullptr;
  bool cu_seqlens_int64 = false;
  int64_t num_seqs = 0;  // N when cu_seqlens is set

  ConstView q, k, v;
  MutView o;

  const void* initial_S = nullptr;  // optional; zeros when null
  const void* initial_z = nullptr;  // optional (normalize only)
  void* final_S = nullptr;          // optional output
  void* final_z = nullptr;          // optional output (normalize only)

  double scale = 1.0;
  double eps = 1e-6;
  FeatureMap feature_map = FeatureMap::kIdentity;
  bool normalize = false;
  int64_t chunk_size = 0;  // chunk ops: tokens per chunk, 0 = the kernel's own choice
  // fp32 on CUDA's tensor cores: the products may read their operands rounded to TF32 (10 mantissa
  // bits), as torch.get_float32_matmul_precision() "high" and "medium" allow; false keeps fp32
  // accuracy (each operand split into two TF32 parts, three products).
  bool allow_tf32 = false;

  // What the chunk forward keeps for its backward: chunk_linear_attn_saved_bytes(params) bytes,
  // 256-byte aligned, written by chunk_linear_attn_fwd and read by chunk_linear_attn_bwd (whose
  // q, k, v and options must be the forward's). Its layout is the library's own. Null in a forward
  // that no backward follows, or where the query says 0.
  void* saved = nullptr;

  // Device scratch of the call's *_workspace_bytes(params) bytes, 256-byte aligned (CUDA).
  void* workspace = nullptr;

  CpuExecutor executor;
};

// The backward: the forward's fields (saved is then read), plus the gradients.
struct LinearAttnBwdParams : LinearAttnFwdParams {
  ConstView dout;
  ConstView out;  // the forward's o: read with normalize (dd_t = dout_t . o_t); may be null otherwise
  MutView dq, dk, dv;
  const void* d_final_S = nullptr;  // optional gradient flowing into the final state
  const void* d_final_z = nullptr;
  void* d_initial_S = nullptr;      // optional outputs
  void* d_initial_z = nullptr;
};

// One decode step per sequence: the state rows are updated in place.
struct LinearAttnStepParams {
  Device device = Device::kCPU;
  void* stream = nullptr;
  DType dtype = DType::kFloat32;

  int64_t batch = 0, num_heads = 0, num_kv_heads = 0, head_dim_k = 0, head_dim_v = 0;

  // [B, H, K] / [B, Hkv, K] / [B, Hkv, V] / [B, H, V]; stride_t is unused.
  ConstView q, k, v;
  MutView o;

  void* S = nullptr;  // state pool [P, Hkv, K, V], updated in place
  void* z = nullptr;  // [P, Hkv, K] (normalize only)
  int64_t pool_size = 0;

  // Optional [B] rows of the pool per batch entry (int32 or int64); negative = skip (o is zeroed).
  // Null means row b for batch entry b (pool_size >= batch).
  const void* state_indices = nullptr;
  bool state_indices_int64 = false;

  double scale = 1.0;
  double eps = 1e-6;
  FeatureMap feature_map = FeatureMap::kIdentity;
  bool normalize = false;

  CpuExecutor executor;
};

Status chunk_linear_attn_fwd(const LinearAttnFwdParams& params);
Status chunk_linear_attn_bwd(const LinearAttnBwdParams& params);
Status recurrent_linear_attn_fwd(const LinearAttnFwdParams& params);
Status recurrent_linear_attn_bwd(const LinearAttnBwdParams& params);
Status linear_attn_step(const LinearAttnStepParams& params);

// Bytes of params.saved a chunk forward fills for its backward (0 on the CPU, and where the backward
// reads nothing of it). Depends on the shapes, dtype, options and device only, not on the pointers.
int64_t chunk_linear_attn_saved_bytes(const LinearAttnFwdParams& params);

// Bytes of params.workspace each call needs (0 on the CPU). Fill every other field first.
int64_t chunk_linear_attn_fwd_workspace_bytes(const LinearAttnFwdParams& params);
int64_t chunk_linear_attn_bwd_workspace_bytes(const LinearAttnBwdParams& params);
int64_t recurrent_linear_attn_bwd_workspace_bytes(const LinearAttnBwdParams& params);

// True when the library was built with its CUDA kernels, and with their sm_90a (wgmma) code.
bool built_with_cuda();
bool built_with_wgmma();

}  // namespace attnrnn

// ---------------------------------------------------------------------------------------------
// Causal softmax attention as an RNN (the online-softmax recurrence). Per query i, over keys j:
//   s_ij = scale * q_i . k_j,   m_i = max_j s_ij,   z_i = sum_j exp(s_ij - m_i),
//   y_i = sum_j exp(s_ij - m_i) v_j,   o_i = y_i / z_i,   lse_i = m_i + log z_i,
// computed block by block over the keys (m, y, z are rescaled as m grows), never forming Tq x Tk.
// Causal masks align bottom-right: query i of Tq attends keys j <= i + Tk - Tq (FlashAttention's
// rule for Tq != Tk). A query with no key (Tq > Tk, empty sequences) gets o = 0 and lse = -inf.
//
// Shapes (elements; unit stride on the last dimension of every view):
//   q, o, dout, dq : [B, Tq, H, D] / [B, Tq, H, Dv]
//   k, dk          : [B, Tk, Hkv, D]
//   v, dv          : [B, Tk, Hkv, Dv]
//   lse            : [B, H, Tq] contiguous, float32 (float64 for float64 inputs)
// With cu_seqlens (B == 1, Tq == Tk) the N packed sequences are attended separately. Bad offsets
// are an error on the CPU; on CUDA they are not read back (no host sync): they are clamped into
// [0, T], tokens in no sequence get o = 0, lse = -inf and zero gradients, and nothing outside the
// tensors is touched (decreasing offsets: rows of overlapping sequences are undefined).
namespace attnrnn {

struct SoftmaxAttnParams {
  Device device = Device::kCPU;
  void* stream = nullptr;
  DType dtype = DType::kFloat32;

  int64_t batch = 0, seqlen_q = 0, seqlen_k = 0;
  int64_t num_heads = 0, num_kv_heads = 0;
  int64_t head_dim = 0, head_dim_v = 0;

  const void* cu_seqlens = nullptr;  // [num_seqs + 1] offsets for q and k alike (int32 or int64)
  bool cu_seqlens_int64 = false;
  int64_t num_seqs = 0;

  ConstView q, k, v;
  MutView o;         // forward output
  void* lse = nullptr;  // forward output [B, H, Tq]; backward input (const)

  // Backward: dout and the forward output o (for D_i = dout_i . o_i), gradients out.
  ConstView dout, out;
  MutView dq, dk, dv;

  double scale = 1.0;
  bool causal = true;

  // Device scratch of softmax_attn_{fwd,bwd}_workspace_bytes(params) bytes on CUDA (D_i per query,
  // laid out like lse, for the backward; a few flags for the tensor-core kernels); 256-byte
  // aligned. Unused on the CPU.
  void* workspace = nullptr;

  CpuExecutor executor;
};

// One decode token per sequence over a KV cache, split over the cache length (flash-decoding).
//   q [B, H, D], k_new [B, Hkv, D], v_new [B, Hkv, Dv], o [B, H, Dv] (stride_t unused);
//   k_cache [B, Lmax, Hkv, D], v_cache [B, Lmax, Hkv, Dv]; cache_seqlens int32 [B].
// With k_new/v_new, row cache_seqlens[b] of the caches is overwritten with them and the token
// attends over cache_seqlens[b] + 1 keys; without, over cache_seqlens[b] keys. cache_seqlens is
// read, never updated (the caller advances it). A length out of range is an error on the CPU
// (nothing written); on CUDA it is not read back (no host sync): that entry's o is NaN and its
// cache rows are left alone.
struct SoftmaxAttnStepParams {
  Device device = Device::kCPU;
  void* stream = nullptr;
  DType dtype = DType::kFloat32;

  int64_t batch = 0, max_seqlen = 0, num_heads = 0, num_kv_heads = 0, head_dim = 0, head_dim_v = 0;

  ConstView q, k_new, v_new;  // k_new.data == nullptr: nothing to append
  MutView o, k_cache, v_cache;
  const int32_t* cache_seqlens = nullptr;

  double scale = 1.0;
  int64_t split_size = 0;  // keys per split; 0 = the kernel's choice

  // Device scratch of softmax_attn_step_workspace_bytes(params) bytes (CUDA, when the cache is
  // cut into more than one split: partial (m, l, y[Dv]) per (b, head, split)); 256-byte aligned.
  void* workspace = nullptr;

  CpuExecutor executor;
};

Status softmax_attn_fwd(const SoftmaxAttnParams& params);
Status softmax_attn_bwd(const SoftmaxAttnParams& params);
Status softmax_attn_step(const SoftmaxAttnStepParams& params);

// Bytes of device scratch these calls need in params.workspace (0 on the CPU). They depend on the
// shapes, dtype, cu_seqlens (whether given, and num_seqs) and device, not on the pointers; the
// step's on batch, num_heads, num_kv_heads, head_dim_v, max_seqlen, split_size and dtype only.
int64_t softmax_attn_fwd_workspace_bytes(const SoftmaxAttnParams& params);
int64_t softmax_attn_bwd_workspace_bytes(const SoftmaxAttnParams& params);
int64_t softmax_attn_step_workspace_bytes(const SoftmaxAttnStepParams& params);

}  // namespace attnrnn
