// Running one planned sweep (plan.h's Sweep) of a tensor-core scan: its pass 1 where it splits, then
// pass 2; and the buffers of the plan resolved to pointers. Shared by forward.cuh and backward.cuh.
#pragma once

#include <type_traits>

#include "features.cuh"
#include "plan.h"
#include "scan_mma.cuh"
#include "scan_wgmma.cuh"
#include "scan_wgmma_pair.cuh"
#include "scan_wgmma_tf32.cuh"
#include "segment_states.cuh"

namespace attnrnn::cuda {

// A region of the plan as a pointer (null where none is placed).
inline float* region_at(const ChunkArgs& p, const Region& r) {
  if (r.offset < 0) return nullptr;
  char* base = static_cast<char*>(r.in_saved ? p.saved : p.workspace);
  return reinterpret_cast<float*>(base + r.offset);
}
inline float* workspace_at(const ChunkArgs& p, int64_t offset) { return region_at(p, Region{offset, false}); }

// phi(q), phi(k) as the plan has them reach the sweeps: written by the feature pass into the
// workspace (then read as q and k), applied by the wgmma sweeps themselves, or not at all.
template <class T>
Status prepare_features(const ChunkPlan& plan, const ChunkArgs& p, ScanFeatures& feat) {
  feat = ScanFeatures{};
  if (plan.features == Features::kInSweep) {
    feat.relu_in_sweep = true;
    return Status::kSuccess;
  }
  if (plan.features != Features::kPass) return Status::kSuccess;
  T* fq = reinterpret_cast<T*>(workspace_at(p, plan.phi_q));
  T* fk = reinterpret_cast<T*>(workspace_at(p, plan.phi_k));
  const Status s = launch_feature_pass<T>(p, fq, fk);
  if (s != Status::kSuccess) return s;
  const int64_t K = p.head_dim_k, Tn = p.seqlen;
  feat.q = ConstView{fq, Tn * p.num_heads * K, p.num_heads * K, K};
  feat.k = ConstView{fk, Tn * p.num_kv_heads * K, p.num_kv_heads * K, K};
  return Status::kSuccess;
}

// One sweep of `kernel` (mma_scan_kernel, wgmma_scan_kernel, wgmma_pair_scan_kernel,
// wgmma_tf32_scan_kernel or wgmma_grad_kv_kernel): grid (sequences x segments x tiles, kv heads) of
// `threads`, over chunks of `chunk` tokens. Where it splits, pass 1 runs first as the plan says: the
// kernel itself summing only, state_pass(split, grid, stream), or nothing (its partials were written
// before).
template <class Kernel, class StatePass>
Status run_sweep(Kernel kernel, int64_t smem_bytes, int threads, int chunk, const ChunkArgs& p, const Sweep& sweep,
                 int64_t tiles, const ScanFeatures& feat, const char* what, StatePass state_pass) {
  Status s = allow_smem(kernel, smem_bytes, what);
  if (s != Status::kSuccess) return s;
  SegmentSplit split;
  split.segments = sweep.segments;
  const dim3 grid(static_cast<unsigned>(num_states(p) * split.segments * tiles), static_cast<unsigned>(p.num_kv_heads));
  cudaStream_t stream = static_cast<cudaStream_t>(p.stream);
  if (split.segments > 1) {
    const int64_t chunks = (p.seqlen + chunk - 1) / chunk;
    split.seg_chunks = static_cast<int>((chunks + split.segments - 1) / split.segments);
    split.partial = region_at(p, sweep.partials);
    split.state_only = true;
    if (sweep.first_pass == FirstPass::kOwnKernel) {
      kernel<<<grid, threads, smem_bytes, stream>>>(p, split, feat);
    } else if (sweep.first_pass == FirstPass::kStateKernel) {
      SegmentSplit with_transposed = split;
      with_transposed.partial_t = region_at(p, sweep.transposed_partials);
      s = state_pass(with_transposed, grid, stream);
      if (s != Status::kSuccess) return s;
    }
    s = check_launch(what);
    if (s != Status::kSuccess) return s;
    split.state_only = false;
  }
  kernel<<<grid, threads, smem_bytes, stream>>>(p, split, feat);
  return check_launch(what);
}

// Pass 1 of a wgmma sweep on segment_state_kernel: BlocksPerSm is what pass 2's split assumes, chunk
// pass 2's chunk length (the pass sums 64-token tiles in pass 2's order).
template <class T, ScanRole R, int DI, int BlocksPerSm, bool WithNormalizer, bool kPadded = false>
struct StateKernelPass {
  const ChunkArgs& p;
  const ScanFeatures& feat;
  int chunk;
  const char* what;
  unsigned grid_scale = 1;  // blocks of the state pass per block of pass 2 (the fused dk + dv sweep: 2)

  Status operator()(const SegmentSplit& split, dim3 grid, cudaStream_t stream) const {
    auto kernel = segment_state_kernel<T, R, DI, BlocksPerSm, WithNormalizer, kPadded>;
    constexpr int64_t bytes = SegmentStateLayoutOf<R, DI, BlocksPerSm, WithNormalizer>::smem_bytes;
    const Status s = allow_smem(kernel, bytes, what);
    if (s != Status::kSuccess) return s;
    kernel<<<dim3(grid.x * grid_scale, grid.y), kScanThreads, bytes, stream>>>(p, split, feat, chunk);
    return Status::kSuccess;
  }
};
// The sweeps whose pass 1 runs on their own kernel (the plan never asks a state kernel of them).
struct NoStateKernel {
  Status operator()(const SegmentSplit&, dim3, cudaStream_t) const {
    return fail(Status::kInvalidArgument, "the plan asked a state kernel of a sweep that has none");
  }
};

// Output tiles of 64 columns of a wgmma sweep: the forward's and dv's over V, dq's and dk's over K
// (the last one partly padded where kPadded).
template <ScanRole R, bool kPadded = false>
int64_t wgmma_tiles(const ChunkArgs& p) {
  const int64_t cols = R == ScanRole::kForward || RoleInfo<R>::dv_like ? p.head_dim_v : p.head_dim_k;
  return kPadded ? (cols + 63) / 64 : cols / 64;
}

// Each wgmma kernel is compiled for one normalize mode (WithNormalizer): the sweeps without it carry
// none of the normalizer's registers and branches (the unnormalized forward at B4-T8192-H16-D128:
// 249.5 -> 255.7 us when they came in). This check refuses any other pairing.
template <bool WithNormalizer>
Status check_normalize_mode(const ChunkArgs& p, const char* what) {
  if (WithNormalizer == p.normalize) return Status::kSuccess;
  return fail(Status::kInvalidArgument, "%s: a kernel compiled for normalize=%d launched with normalize=%d", what,
              int(WithNormalizer), int(p.normalize));
}

template <class T, ScanRole R, int DI, bool kTf32x3 = false, bool kPadded = false>
Status run_mma_sweep(const Sweep& sweep, const ChunkArgs& p, const ScanFeatures& feat, const char* what) {
  return run_sweep(mma_scan_kernel<T, R, DI, kTf32x3, kPadded>, MmaLayout<T, DI>::bytes, kScanThreads, kChunk, p,
                   sweep, tc_tiles<T, R, DI, kPadded>(p), feat, what, NoStateKernel{});
}

// The mma.sync sweeps of padded head dims (Sweep::padded: inner dims up to 128), instantiated apart
// (instantiations/padded_mma_*.cu) like the padded wgmma sweeps.
template <class T, ScanRole R, int DI, bool kTf32x3>
Status run_padded_mma_sweep(const Sweep& sweep, const ChunkArgs& p, const ScanFeatures& feat, const char* what) {
  return run_mma_sweep<T, R, DI, kTf32x3, true>(sweep, p, feat, what);
}
#define ATTNRNN_PADDED_MMA_SWEEP(PREFIX, T, R, X3)                                                            \
  PREFIX template Status run_padded_mma_sweep<T, R, 64, X3>(const Sweep&, const ChunkArgs&, const ScanFeatures&, \
                                                            const char*);                                      \
  PREFIX template Status run_padded_mma_sweep<T, R, 128, X3>(const Sweep&, const ChunkArgs&, const ScanFeatures&, \
                                                             const char*);
#define ATTNRNN_PADDED_MMA_FORWARD(PREFIX, T, X3) ATTNRNN_PADDED_MMA_SWEEP(PREFIX, T, ScanRole::kForward, X3)
#define ATTNRNN_PADDED_MMA_BACKWARD(PREFIX, T, X3)        \
  ATTNRNN_PADDED_MMA_SWEEP(PREFIX, T, ScanRole::kGradQ, X3) \
  ATTNRNN_PADDED_MMA_SWEEP(PREFIX, T, ScanRole::kGradK, X3) \
  ATTNRNN_PADDED_MMA_SWEEP(PREFIX, T, ScanRole::kGradV, X3)
ATTNRNN_PADDED_MMA_FORWARD(extern, __nv_bfloat16, false)
ATTNRNN_PADDED_MMA_FORWARD(extern, __half, false)
ATTNRNN_PADDED_MMA_FORWARD(extern, float, false)
ATTNRNN_PADDED_MMA_FORWARD(extern, float, true)
ATTNRNN_PADDED_MMA_BACKWARD(extern, __nv_bfloat16, false)
ATTNRNN_PADDED_MMA_BACKWARD(extern, __half, false)
ATTNRNN_PADDED_MMA_BACKWARD(extern, float, false)
ATTNRNN_PADDED_MMA_BACKWARD(extern, float, true)

// An mma.sync sweep on the inner dim its plan names, padded where the plan says.
template <class T, ScanRole R, bool kTf32x3 = false>
Status run_planned_mma_sweep(const Sweep& sweep, const ChunkArgs& p, const ScanFeatures& feat, const char* what) {
  if (sweep.padded)
    return sweep.inner == 64 ? run_padded_mma_sweep<T, R, 64, kTf32x3>(sweep, p, feat, what)
                             : run_padded_mma_sweep<T, R, 128, kTf32x3>(sweep, p, feat, what);
  return sweep.inner == 64 ? run_mma_sweep<T, R, 64, kTf32x3>(sweep, p, feat, what)
                           : run_mma_sweep<T, R, 128, kTf32x3>(sweep, p, feat, what);
}

template <class T, ScanRole R, int DI, bool WithNormalizer, bool kPadded = false>
Status run_wgmma_sweep(const Sweep& sweep, const ChunkArgs& p, const ScanFeatures& feat, const char* what) {
  if (const Status s = check_normalize_mode<WithNormalizer>(p, what); s != Status::kSuccess) return s;
  using L = WgmmaLayoutOf<R, DI>;
  auto kernel = wgmma_scan_kernel<T, R, DI, WithNormalizer, kPadded>;
  const int64_t tiles = wgmma_tiles<R, kPadded>(p);
  if constexpr (kHasSegmentStateKernel<R, WithNormalizer>) {
    return run_sweep(kernel, L::smem_bytes, kScanThreads, kChunk, p, sweep, tiles, feat, what,
                     StateKernelPass<T, R, DI, L::min_blocks, WithNormalizer, kPadded>{p, feat, kChunk, what});
  } else {
    return run_sweep(kernel, L::smem_bytes, kScanThreads, kChunk, p, sweep, tiles, feat, what, NoStateKernel{});
  }
}

// The 64-token wgmma sweeps of padded head dims (Sweep::padded), instantiated apart
// (instantiations/padded_*.cu) so that the exact dims' translation units do not compile them.
template <class T, ScanRole R, int DI, bool WithNormalizer>
Status run_padded_wgmma_sweep(const Sweep& sweep, const ChunkArgs& p, const ScanFeatures& feat, const char* what) {
  return run_wgmma_sweep<T, R, DI, WithNormalizer, true>(sweep, p, feat, what);
}
#define ATTNRNN_PADDED_SWEEP(PREFIX, T, R, DI, N) \
  PREFIX template Status run_padded_wgmma_sweep<T, R, DI, N>(const Sweep&, const ChunkArgs&, const ScanFeatures&, const char*);
#define ATTNRNN_PADDED_SWEEPS_OF(PREFIX, T, R, N) \
  ATTNRNN_PADDED_SWEEP(PREFIX, T, R, 64, N)       \
  ATTNRNN_PADDED_SWEEP(PREFIX, T, R, 128, N)      \
  ATTNRNN_PADDED_SWEEP(PREFIX, T, R, 192, N)      \
  ATTNRNN_PADDED_SWEEP(PREFIX, T, R, 256, N)
#define ATTNRNN_PADDED_FORWARD(PREFIX, T) ATTNRNN_PADDED_SWEEPS_OF(PREFIX, T, ScanRole::kForward, true) \
  ATTNRNN_PADDED_SWEEPS_OF(PREFIX, T, ScanRole::kForward, false)
#define ATTNRNN_PADDED_BACKWARD(PREFIX, T, N)          \
  ATTNRNN_PADDED_SWEEPS_OF(PREFIX, T, ScanRole::kGradQ, N) \
  ATTNRNN_PADDED_SWEEPS_OF(PREFIX, T, ScanRole::kGradK, N) \
  ATTNRNN_PADDED_SWEEPS_OF(PREFIX, T, ScanRole::kGradV, N)
ATTNRNN_PADDED_FORWARD(extern, __nv_bfloat16)
ATTNRNN_PADDED_FORWARD(extern, __half)
ATTNRNN_PADDED_BACKWARD(extern, __nv_bfloat16, true)
ATTNRNN_PADDED_BACKWARD(extern, __nv_bfloat16, false)
ATTNRNN_PADDED_BACKWARD(extern, __half, true)
ATTNRNN_PADDED_BACKWARD(extern, __half, false)

template <class T, ScanRole R, bool WithNormalizer>
Status run_wgmma_pair_sweep(const Sweep& sweep, const ChunkArgs& p, const ScanFeatures& feat, const char* what) {
  if (const Status s = check_normalize_mode<WithNormalizer>(p, what); s != Status::kSuccess) return s;
  using L = WgmmaPairLayout;
  constexpr int DI = 64 * L::KT;
  return run_sweep(wgmma_pair_scan_kernel<T, R, WithNormalizer>, L::smem_bytes, L::threads, L::chunk, p, sweep,
                   wgmma_tiles<R>(p), feat, what,
                   StateKernelPass<T, R, DI, WgmmaPairTiles::blocks_per_sm, WithNormalizer>{p, feat, L::chunk, what});
}

// The TF32 wgmma sweeps of fp32 (Sweep::kernel kWgmmaTf32: TF32 allowed, no normalizer), inner dim DI,
// instantiated apart (instantiations/tf32_wgmma_*_fp32.cu).
template <ScanRole R, int DI, bool kPadded>
Status run_wgmma_tf32_sweep(const Sweep& sweep, const ChunkArgs& p, const ScanFeatures& feat, const char* what) {
  if (const Status s = check_normalize_mode<false>(p, what); s != Status::kSuccess) return s;
  if (!p.allow_tf32) return fail(Status::kInvalidArgument, "%s: the TF32 sweep on a call that does not allow TF32", what);
  using L = WgmmaTf32Layout<DI>;
  const int64_t cols = R == ScanRole::kForward || RoleInfo<R>::dv_like ? p.head_dim_v : p.head_dim_k;
  const int64_t tiles = kPadded ? (cols + L::NC - 1) / L::NC : cols / L::NC;
  return run_sweep(wgmma_tf32_scan_kernel<R, DI, kPadded>, L::smem_bytes, kScanThreads, kChunk, p, sweep, tiles,
                   feat, what, NoStateKernel{});
}
#define ATTNRNN_TF32_SWEEP(PREFIX, R, DI)                                                                         \
  PREFIX template Status run_wgmma_tf32_sweep<R, DI, false>(const Sweep&, const ChunkArgs&, const ScanFeatures&, \
                                                            const char*);                                          \
  PREFIX template Status run_wgmma_tf32_sweep<R, DI, true>(const Sweep&, const ChunkArgs&, const ScanFeatures&,  \
                                                           const char*);
#define ATTNRNN_TF32_BACKWARD(PREFIX, DI)            \
  ATTNRNN_TF32_SWEEP(PREFIX, ScanRole::kGradQ, DI) \
  ATTNRNN_TF32_SWEEP(PREFIX, ScanRole::kGradK, DI) \
  ATTNRNN_TF32_SWEEP(PREFIX, ScanRole::kGradV, DI)
ATTNRNN_TF32_SWEEP(extern, ScanRole::kForward, 64)
ATTNRNN_TF32_SWEEP(extern, ScanRole::kForward, 128)
ATTNRNN_TF32_BACKWARD(extern, 64)
ATTNRNN_TF32_BACKWARD(extern, 128)

// A TF32 wgmma sweep on the inner dim its plan names, padded where the plan says.
template <ScanRole R>
Status run_planned_tf32_sweep(const Sweep& sweep, const ChunkArgs& p, const ScanFeatures& feat, const char* what) {
  if (sweep.inner == 64)
    return sweep.padded ? run_wgmma_tf32_sweep<R, 64, true>(sweep, p, feat, what)
                        : run_wgmma_tf32_sweep<R, 64, false>(sweep, p, feat, what);
  return sweep.padded ? run_wgmma_tf32_sweep<R, 128, true>(sweep, p, feat, what)
                      : run_wgmma_tf32_sweep<R, 128, false>(sweep, p, feat, what);
}

// An fp32 sweep: on TF32 wgmma where the plan says, else on mma.sync with TF32 operands where the call
// allows them, else 3xTF32.
template <ScanRole R>
Status run_fp32_sweep(const Sweep& sweep, const ChunkArgs& p, const ScanFeatures& feat, const char* what) {
  if (sweep.kernel == SweepKernel::kWgmmaTf32) return run_planned_tf32_sweep<R>(sweep, p, feat, what);
  if (sweep.kernel != SweepKernel::kMma)
    return fail(Status::kInvalidArgument, "%s: fp32 runs on mma.sync or TF32 wgmma only", what);
  return p.allow_tf32 ? run_planned_mma_sweep<float, R, false>(sweep, p, feat, what)
                      : run_planned_mma_sweep<float, R, true>(sweep, p, feat, what);
}

// The sweep of role R (not the fused dk + dv) on the kernel and inner dim its plan names.
template <class T, ScanRole R, bool WithNormalizer>
Status run_planned_sweep(const Sweep& sweep, const ChunkArgs& p, const ScanFeatures& feat, const char* what) {
  if constexpr (std::is_same_v<T, float>) {
    return run_fp32_sweep<R>(sweep, p, feat, what);
  } else {
    switch (sweep.kernel) {
      case SweepKernel::kMma:
        return run_planned_mma_sweep<T, R>(sweep, p, feat, what);
      case SweepKernel::kWgmma:
        if (sweep.padded)
          return sweep.inner == 64    ? run_padded_wgmma_sweep<T, R, 64, WithNormalizer>(sweep, p, feat, what)
                 : sweep.inner == 128 ? run_padded_wgmma_sweep<T, R, 128, WithNormalizer>(sweep, p, feat, what)
                 : sweep.inner == 192 ? run_padded_wgmma_sweep<T, R, 192, WithNormalizer>(sweep, p, feat, what)
                                      : run_padded_wgmma_sweep<T, R, 256, WithNormalizer>(sweep, p, feat, what);
        return sweep.inner == 64 ? run_wgmma_sweep<T, R, 64, WithNormalizer>(sweep, p, feat, what)
                                 : run_wgmma_sweep<T, R, 128, WithNormalizer>(sweep, p, feat, what);
      case SweepKernel::kWgmmaPair:
        return run_wgmma_pair_sweep<T, R, WithNormalizer>(sweep, p, feat, what);
    }
    return fail(Status::kInvalidArgument, "%s: no such sweep kernel", what);
  }
}

}  // namespace attnrnn::cuda
