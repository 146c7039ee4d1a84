// Argument checks shared by the ATen glue of every op: each names the op and the argument and says
// what was expected. Internal to csrc/torch.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#ifdef ATTNRNN_TORCH_CUDA
#include <c10/cuda/CUDAStream.h>
#endif

#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>

#include <optional>
#include <sstream>
#include <string>

#include "attnrnn/attnrnn.h"

namespace attnrnn::aten::detail {

using OptTensor = std::optional<at::Tensor>;

inline std::string shape_of(const at::Tensor& t) {
  std::ostringstream os;
  os << t.sizes();
  return os.str();
}

inline DType dtype_of(const at::Tensor& t, const char* op, const char* name) {
  switch (t.scalar_type()) {
    case at::kDouble: return DType::kFloat64;
    case at::kFloat: return DType::kFloat32;
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    default:
      TORCH_CHECK_VALUE(false, op, ": ", name,
                        " must be float64, float32, float16 or bfloat16, got ", t.scalar_type());
  }
}

inline at::ScalarType state_scalar_type(const at::Tensor& q) {
  return q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

inline void check_same_device(const at::Tensor& t, const at::Tensor& q, const char* op, const char* name) {
  TORCH_CHECK_VALUE(t.device() == q.device(), op, ": ", name, " must be on the device of q (",
                    q.device(), "), got ", t.device());
}

inline void check_rank(const at::Tensor& t, int64_t rank, const char* op, const char* name, const char* layout) {
  TORCH_CHECK_VALUE(t.dim() == rank, op, ": ", name, " must be a ", rank, "-D tensor ", layout,
                    ", got shape ", shape_of(t));
}

// An empty tensor passes whatever its strides: none of its elements is read (autograd's gradient of
// an empty output can come with all strides 0).
inline void check_unit_last_stride(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK_VALUE(t.numel() == 0 || t.size(-1) <= 1 || t.stride(-1) == 1, op, ": ", name,
                    " must have unit stride in its last dimension, got strides ", t.strides());
}

inline void check_exact_shape(const at::Tensor& t, at::IntArrayRef expected, const char* op, const char* name) {
  TORCH_CHECK_VALUE(t.sizes() == expected, op, ": ", name, " must have shape ", expected, ", got ",
                    t.sizes());
}

// An argument an op updates in place (`written`) must not share memory with another argument: the
// result would depend on the order of the writes and reads. Overlap ATen cannot decide (strided
// views of one buffer that are not dense) passes, as in ATen's own in-place ops.
inline void check_no_overlap(const at::Tensor& written, const char* written_name, const at::Tensor& other,
                             const char* other_name, const char* op) {
  const at::MemOverlapStatus status = at::get_overlap_status(written, other);
  TORCH_CHECK_VALUE(status != at::MemOverlapStatus::Full && status != at::MemOverlapStatus::Partial, op, ": ",
                    written_name, " and ", other_name, " must not share memory (", written_name,
                    " is updated in place)");
}

inline ConstView const_view(const at::Tensor& t) {
  return ConstView{t.data_ptr(), t.stride(0), t.stride(1), t.stride(2)};
}
inline MutView mut_view(const at::Tensor& t) { return MutView{t.data_ptr(), t.stride(0), t.stride(1), t.stride(2)}; }

inline void* mut_data_or_null(const at::Tensor& t) { return t.numel() > 0 ? t.data_ptr() : nullptr; }

template <class Params>
void set_device(Params& p, const at::Tensor& q) {
  // The library's own thread pool, sized like torch's intra-op pool (torch.set_num_threads).
  // at::parallel_for is not used: with torch's OpenMP backend its loop is a header template
  // that runs serially unless this library were compiled with torch's exact OpenMP runtime.
  p.executor.num_threads = at::get_num_threads();
  if (q.is_cuda()) {
    p.device = Device::kCUDA;
#ifdef ATTNRNN_TORCH_CUDA
    p.stream = c10::cuda::getCurrentCUDAStream(q.device().index()).stream();
#endif
  } else {
    TORCH_CHECK_VALUE(q.is_cpu(), "attnrnn: tensors must be on CPU or CUDA, got ", q.device());
    p.device = Device::kCPU;
  }
}

inline void check_status(Status status, const char* op) {
  if (status == Status::kSuccess) return;
  const std::string detail = last_error_message();
  TORCH_CHECK_VALUE(status != Status::kInvalidArgument, op, ": ", detail);
  TORCH_CHECK_NOT_IMPLEMENTED(status != Status::kNotImplemented && status != Status::kNotCompiled, op,
                              ": ", detail);
  TORCH_CHECK(false, op, ": ", status_string(status), ": ", detail);
}

inline void check_same_dtype(const at::Tensor& t, const at::Tensor& q, const char* op, const char* name) {
  TORCH_CHECK_VALUE(t.scalar_type() == q.scalar_type(), op, ": ", name, " must have the dtype of q (",
                    q.scalar_type(), "), got ", t.scalar_type());
}

// cu_seqlens [N + 1] (int32/int64) packing sequences along the time axis of q (batch 1). Its values
// are checked by the core library (on the CPU; reading device values back would synchronize).
// Returns the contiguous offsets.
inline at::Tensor checked_cu_seqlens(const at::Tensor& cu, const at::Tensor& q, const char* op) {
  check_same_device(cu, q, op, "cu_seqlens");
  TORCH_CHECK_VALUE(cu.scalar_type() == at::kInt || cu.scalar_type() == at::kLong, op,
                    ": cu_seqlens must be int32 or int64, got ", cu.scalar_type());
  TORCH_CHECK_VALUE(cu.dim() == 1 && cu.numel() >= 1, op, ": cu_seqlens must be a 1-D tensor [N + 1], got shape ",
                    shape_of(cu));
  TORCH_CHECK_VALUE(q.size(0) == 1, op, ": q, k and v must have batch size 1 with cu_seqlens, got B = ",
                    q.size(0));
  return cu.contiguous();
}

}  // namespace attnrnn::aten::detail
