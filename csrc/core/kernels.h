// Internal entry points behind the public API: one set per device. api.cpp validates the params
// once and then calls exactly one of these.
#pragma once

#include "attnrnn/attnrnn.h"

namespace attnrnn {

// Records the detail of a failing status for last_error_message() and returns the status.
Status fail(Status status, const char* fmt, ...);

namespace cpu {
Status chunk_fwd(const LinearAttnFwdParams& p);
Status chunk_bwd(const LinearAttnBwdParams& p);
Status recurrent_fwd(const LinearAttnFwdParams& p);
Status recurrent_bwd(const LinearAttnBwdParams& p);
Status step(const LinearAttnStepParams& p);
}  // namespace cpu

namespace cuda {
Status chunk_fwd(const LinearAttnFwdParams& p);
Status chunk_bwd(const LinearAttnBwdParams& p);
Status recurrent_fwd(const LinearAttnFwdParams& p);
Status recurrent_bwd(const LinearAttnBwdParams& p);
Status step(const LinearAttnStepParams& p);
int64_t chunk_saved_bytes(const LinearAttnFwdParams& p);
int64_t chunk_fwd_workspace_bytes(const LinearAttnFwdParams& p);
int64_t chunk_bwd_workspace_bytes(const LinearAttnBwdParams& p);
int64_t recurrent_bwd_workspace_bytes(const LinearAttnBwdParams& p);
}  // namespace cuda

}  // namespace attnrnn
