// Internal entry points behind the public API: one set per device. api.cpp validates the params
// once and then calls exactly one of these.
#pragma once

#include "attnrnn/attnrnn.h"

namespace attnrnn {

// Records the detail of a failing status for last_error_message() and returns the status.
Status fail(Status status, const char* fmt, ...);

namespace cpu {
Status chunk_fwd(const LinearAttnParams& p);
Status chunk_bwd(const LinearAttnParams& p);
Status recurrent_fwd(const LinearAttnParams& p);
Status recurrent_bwd(const LinearAttnParams& p);
Status step(const LinearAttnStepParams& p);
Status features(const LinearAttnParams& p, void* phi_q, void* phi_k);
}  // namespace cpu

namespace cuda {
Status chunk_fwd(const LinearAttnParams& p);
Status chunk_bwd(const LinearAttnParams& p);
Status recurrent_fwd(const LinearAttnParams& p);
Status recurrent_bwd(const LinearAttnParams& p);
Status step(const LinearAttnStepParams& p);
int64_t workspace_bytes(const LinearAttnParams& p);  // forward when p.dout.data is null, else backward
bool chunk_fwd_writes_den(const LinearAttnParams& p);
int64_t chunk_fwd_segment_state_floats(const LinearAttnParams& p);
Status features(const LinearAttnParams& p, void* phi_q, void* phi_k);
bool chunk_saves_features(const LinearAttnParams& p);
}  // namespace cuda

}  // namespace attnrnn
