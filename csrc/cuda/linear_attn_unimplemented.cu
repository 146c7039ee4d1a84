// CUDA entry points of the linear-attention ops. The CUDA kernels are the next milestone; until
// they land, every CUDA entry point reports kNotImplemented so the glue raises a clear error.
#include "kernels.h"

namespace attnrnn::cuda {

namespace {
Status not_yet(const char* op) {
  return fail(Status::kNotImplemented, "%s has no CUDA kernel in this build yet; use CPU tensors", op);
}
}  // namespace

Status chunk_fwd(const LinearAttnParams&) { return not_yet("chunk_linear_attn forward"); }
Status chunk_bwd(const LinearAttnParams&) { return not_yet("chunk_linear_attn backward"); }
Status recurrent_fwd(const LinearAttnParams&) { return not_yet("recurrent_linear_attn forward"); }
Status recurrent_bwd(const LinearAttnParams&) { return not_yet("recurrent_linear_attn backward"); }
Status step(const LinearAttnStepParams&) { return not_yet("linear_attn_step"); }

}  // namespace attnrnn::cuda
