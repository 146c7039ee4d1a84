// What the linear-attention chunk kernels read (ChunkArgs: the call's params plus the buffers its
// plan placed), and the sequence geometry they share.
#pragma once

#include "../common/device.cuh"
#include "feature_maps.h"

namespace attnrnn::cuda {

// The params of a chunk call as its kernels see them: a forward's fields (the backward's stay null
// there), and the saved w = scale / den of each (token, query head), [B, T, H] float32 like
// token_index, in the forward's saved buffer (make_forward_plan places it).
struct ChunkArgs : LinearAttnBwdParams {
  float* den_out = nullptr;       // forward, normalize: written where the plan keeps it
  const float* den_in = nullptr;  // backward, normalize: the forward's den_out
  // [N][Hkv] flags of a tensor-core call (the plan's nonfinite_flags; null otherwise). A tensor-core
  // kernel sets the flag of its (sequence, kv head) when a row it writes is not finite; the generic
  // kernels then run for the flagged ones only and write them again (nonfinite_rows_repaired).
  unsigned* nonfinite = nullptr;
};

struct Seq {
  int64_t b, t0, len;
};

__device__ __forceinline__ Seq sequence(const ChunkArgs& p, int64_t n) {
  if (p.cu_seqlens == nullptr) return Seq{n, 0, p.seqlen};
  int64_t begin, end;
  if (p.cu_seqlens_int64) {
    begin = static_cast<const int64_t*>(p.cu_seqlens)[n];
    end = static_cast<const int64_t*>(p.cu_seqlens)[n + 1];
  } else {
    begin = static_cast<const int32_t*>(p.cu_seqlens)[n];
    end = static_cast<const int32_t*>(p.cu_seqlens)[n + 1];
  }
  // Values are not validated on the device (that would need a host sync): clamping keeps a bad
  // cu_seqlens inside the tensors.
  begin = begin < 0 ? 0 : (begin > p.seqlen ? p.seqlen : begin);
  end = end < begin ? begin : (end > p.seqlen ? p.seqlen : end);
  return Seq{0, begin, end - begin};
}

// The backward's scratch: two arrays of B*T*H accumulators at the workspace's start, element
// token_index() per (token, query head). The generic path keeps den_t and dd_t there; the
// tensor-core path keeps w_t = s / den_t in the den slot and s * dd_t in the dd slot.
struct BwdWorkspace {
  template <class A>
  __device__ static A* den(const ChunkArgs& p) { return static_cast<A*>(p.workspace); }
  template <class A>
  __device__ static A* dd(const ChunkArgs& p) {
    return static_cast<A*>(p.workspace) + p.batch * p.seqlen * p.num_heads;
  }
};

__device__ __forceinline__ int64_t token_index(const ChunkArgs& p, const Seq& seq, int64_t t, int64_t h) {
  return (seq.b * p.seqlen + t) * p.num_heads + h;
}

// The forward's w = scale / den of a lane's two rows t and t + 8 (the rows of an m16 accumulator),
// into den_out; rows >= `rows` are past the chunk's end. One lane of the row's four writes.
__device__ __forceinline__ void store_den(const ChunkArgs& p, const Seq& seq, int64_t t, int64_t h, int rows,
                                          const float (&w)[2], int lane) {
  if (lane % 4 != 0) return;
  float* den = p.den_out;
  if (rows > 0) den[token_index(p, seq, t, h)] = w[0];
  if (rows > 8) den[token_index(p, seq, t + 8, h)] = w[1];
}

// Why the flags: the tensor-core kernels mask a chunk's scores to 0 above the diagonal and multiply
// the whole chunk's rows by them, so a NaN or Inf in a later token's k or v (0 * NaN = NaN) would
// reach earlier tokens' rows; the generic kernels sum only over the tokens a row sees. Such a row is
// not finite, so a tensor-core kernel notes it (note_nonfinite) and its (sequence, kv head) is written
// again by the generic kernels, which skip every other one: causality costs the check of each
// written element (one FFMA) and the generic kernels' launch, which returns at once without a flag.
__device__ __forceinline__ void note_nonfinite(const ChunkArgs& p, int64_t state_row, bool bad) {
  if (bad && p.nonfinite != nullptr) atomicOr(p.nonfinite + state_row, 1u);
}
// Whether a generic kernel's (sequence n, kv head g) block has work: always in a generic call, only
// for a flagged one when it rewrites a tensor-core call's rows.
__device__ __forceinline__ bool generic_block_runs(const ChunkArgs& p, int64_t n, int64_t g) {
  return p.nonfinite == nullptr || p.nonfinite[n * p.num_kv_heads + g] != 0u;
}

inline int64_t num_states(const LinearAttnFwdParams& p) {
  return p.cu_seqlens != nullptr ? p.num_seqs : p.batch;
}

}  // namespace attnrnn::cuda
