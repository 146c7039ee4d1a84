// The plan of one chunkwise (or recurrent) linear-attention call on CUDA: which kernel runs each
// sweep over the sequences, how it splits them into segments, where its scratch lies in the
// workspace, and what the forward keeps in the saved buffer for the backward. make_forward_plan and
// make_backward_plan are pure functions of the call's params, the device and the test override
// (attnrnn/testing.h); the launchers (forward.cuh, backward.cuh) run a plan and decide nothing.
// The sizes and rules the plan applies, with their measured reasons, are in tiles.h.
#pragma once

#include <cstdint>

#include "attnrnn/attnrnn.h"
#include "attnrnn/testing.h"

namespace attnrnn::cuda {

// What the plan needs to know of the current device.
struct DeviceInfo {
  int sm_count = 1;
  int max_smem = 48 * 1024;  // dynamic shared memory a block may opt into
  bool wgmma = false;        // the build has sm_90a code and the device runs it (compute capability 9.x)
};
DeviceInfo current_device_info();

// The kernels a tensor-core sweep can run on.
enum class SweepKernel : uint8_t {
  kMma,        // scan_mma.cuh: mma.sync, 64-token chunks (every build)
  kWgmma,      // scan_wgmma.cuh: wgmma, 64-token chunks, one warpgroup per block (sm_90a)
  kWgmmaPair,  // scan_wgmma_pair.cuh: wgmma, 128-token chunks, two warpgroups per block (sm_90a)
  kWgmmaTf32,  // scan_wgmma_tf32.cuh: fp32 on TF32 wgmma without the normalizer, inner dims <= 128 (sm_90a)
};

// Where a split sweep's pass 1 (each segment's change of the state) comes from.
enum class FirstPass : uint8_t {
  kNone,         // no split: one pass
  kOwnKernel,    // the sweep's own kernel, summing only (SegmentSplit::state_only)
  kStateKernel,  // segment_state_kernel (segment_states.cuh), which reads only what the state needs
  kDone,         // already written: dq's by the forward (saved), dk's by dv's pass 1
};

// A buffer the plan places: `offset` bytes into the workspace, or into the saved buffer.
struct Region {
  int64_t offset = -1;  // -1: none
  bool in_saved = false;
};

// One sweep over the sequences.
struct Sweep {
  SweepKernel kernel = SweepKernel::kMma;
  int inner = 64;  // the inner dim DI of its products
  bool padded = false;  // its tiles padded with zeros to DI rows and 64 columns (tiles.h, padded_dims)
  int segments = 1;
  FirstPass first_pass = FirstPass::kNone;
  Region partials;             // its pass-1 partials (dq's from the forward: in saved)
  Region transposed_partials;  // pass 1 also writes its sums transposed here: the forward's for dq
                               // (saved), dv's for dk (workspace)
};

// How the backward makes dk and dv.
enum class GradKv : uint8_t {
  kSeparate,         // dk's sweep, then dv's
  kSharedFirstPass,  // dv's sweep first, whose pass 1 also writes dk's partials
  kFused64,          // one sweep (ScanRole::kGradKV of scan_wgmma.cuh) at K = V = 64: dk's Sweep
  kFused128,         // grad_kv_wgmma.cuh at K = V = 128 without the normalizer: dv's Sweep
};

// How a feature map other than the identity reaches the tensor-core sweeps.
enum class Features : uint8_t {
  kNone,     // the identity map
  kInSweep,  // relu, applied by the wgmma sweeps to the tiles they stage
  kPass,     // phi(q), phi(k) written to the workspace first (feature_pass_kernel), read as q and k
};

struct ChunkPlan {
  bool tensor_cores = false;  // else the generic CUDA-core kernels (any dtype and shape)
  int generic_chunk = 0;      // the generic kernels' chunk; with tensor cores,
                              // for the (sequence, kv head)s whose rows were not finite (args.cuh)
  Features features = Features::kNone;
  Sweep forward;
  Sweep dq, dk, dv;
  GradKv grad_kv = GradKv::kSeparate;
  bool out_rows_aligned16 = false;  // the backward's o: 16-byte loads where its rows allow

  // saved: [w = scale / den of each (token, query head), float32][the forward's segment states,
  // transposed into dq's partial layout]; offsets in bytes, -1 where not kept.
  int64_t saved_bytes = 0;
  int64_t saved_den = -1;
  int64_t saved_states = -1;

  // workspace: [w, dd of each (token, query head): the backward's][pass-1 partials][phi(q)][phi(k)]
  // [with tensor cores: a flag per (sequence, kv head), ChunkArgs::nonfinite]
  int64_t workspace_bytes = 0;
  int64_t phi_q = -1, phi_k = -1;
  int64_t nonfinite_flags = -1;
};

// recurrent: the token-by-token form, on the generic kernels (fp32 math throughout, tiles.h's
// GenericTiles chunk or the sequence where shorter).
ChunkPlan make_forward_plan(const LinearAttnFwdParams& p, bool recurrent, const DeviceInfo& device,
                            const testing::PlanOverride& forced);
ChunkPlan make_backward_plan(const LinearAttnBwdParams& p, bool recurrent, const DeviceInfo& device,
                             const testing::PlanOverride& forced);

}  // namespace attnrnn::cuda
