// Test hooks of the CUDA chunk plan (csrc/cuda/linear/plan.cu): they force the choices the plan
// otherwise makes from the shapes and the device, so that tests reach every kernel at small
// shapes. A forced choice is correct but may be slower; nothing but tests should set one.
#pragma once

namespace attnrnn::testing {

enum class Pairing : int {
  kAuto = 0,    // the plan's shape rule
  kAlways = 1,  // every inner-dim-128 wgmma sweep on 128-token chunks (where the chunk size allows)
  kNever = 2,   // every wgmma sweep on 64-token chunks
};

struct PlanOverride {
  bool mma_sync = false;       // the tensor-core sweeps on mma.sync even where wgmma exists
  int segments = 0;            // > 0: every tensor-core sweep split into this many segments (at most)
  Pairing pairing = Pairing::kAuto;
  bool separate_grad_kv = false;  // dk and dv as two sweeps where the plan would fuse them
};

// Process-wide; read by every chunk call made after it on any thread.
void set_plan_override(const PlanOverride& override_);
PlanOverride plan_override();

}  // namespace attnrnn::testing
