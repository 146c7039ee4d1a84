// Launches of the chunk scans (forward and backward of chunk_linear_attn and its recurrent form).
// What runs where, with which split and workspace, is decided in launch_plan.cuh; the decode step's
// launch is in step_launch.cuh. Each (op, dtype) pair is instantiated in its own small .cu file
// (instantiations/).
//
// Tensor-core path (chunk_tc.cuh), bf16 and fp16, chunk 64 (the default or asked for), 16-byte
// aligned rows of q, k, v (and dout):
//   forward   K in {64, 128}, V % 64 == 0; one block per (sequence, output column tile, kv head)
//   backward  K, V in {64, 128}; den (normalize only), dq, dk, dv sweeps in that order
//   tiles     TcLayout (chunk_tc_plan.cuh): 2 stages, 64 output columns and 3 blocks/SM at inner
//             dim 64, 32 columns and 2 blocks/SM at 128; measured reasons in docs/design.md §5
//   features  with a feature map, the wgmma sweeps apply relu to their own tiles (TcFeatures::relu_in_sweep);
//             elsewhere phi(q) and phi(k) first go to the workspace (compute_features)
//   wgmma     on sm_90a builds and devices the forward and the dq, dk, dv sweeps run chunk_wg.cuh
//             instead (one warpgroup per (sequence, 64 output columns, kv head), the same steps and
//             segment split; WgLayout); the sweeps with inner dim 128 (the forward's and dv's K,
//             dq's and dk's V) with the default chunk size run chunk_wg_pair.cuh (two warpgroups on
//             128-token chunks; WgPairLayout); dk and dv at K = V = 128 without the normalizer,
//             where a split sweep's blocks leave SMs idle, run chunk_wg_dkv.cuh (two warpgroups and
//             all 128 columns of dS per (sequence, kv head), one block per SM; WgDkvLayout: two
//             64-KiB stages of q, k, v, dout, the state's hi/lo tiles, two staging tiles: 208 KiB)
//   pass 1    a split wgmma sweep sums its segments' states on chunk_wg_state.cuh (B and Cv only, in
//             as many stages as fit; the fused dk + dv sweep's with the normalizer, and every one
//             with ATTNRNN_WG_STATE_PASS=0, runs on the sweep's kernel); without the normalizer at
//             K = V = 128 dv's pass also writes dk's partials (their states are transposes), and dk
//             runs no pass 1 (shared_dkv_state_pass); there, and wherever their (sequence, kv
//             head) blocks fill at most half the SMs, dk and dv run as one sweep (chunk_wg_dkv.cuh,
//             fused_dkv128: two warpgroups hold all of dS) from dv's state pass
//   den       with normalize, the backward's w and dd come from the forward's saved w when it is
//             given (chunk_dd.cuh, one pass over dout and o), else from the den sweep
//   overlap   with ATTNRNN_BWD_CONCURRENT=1 the backward's dq, dk and dv sweeps run at once (dk
//             and dv on two side streams forked from and joined into the call's stream, on one when
//             they share a state pass), each with its own pass-1 partials (BwdPartials); by
//             default they follow each other in the call's stream, which measured faster once
//             dk+dv fused and the 128-token sweeps came
//
// Tile table of the generic path (256 threads per block, CUDA-core FMAs):
//   forward   BV = min(64, V) value columns per block; chunk C = the largest power of two <= the
//             requested chunk (default 64) whose shared memory fits (C = 32 at K = 256 in fp32)
//   backward  BK = min(32, K) key rows per dq/dk block, BV = min(64, V) for dv; one C for all three
// Reasons: a block must hold its state slice and one chunk of q, k, v in shared memory; 64-column
// tiles keep 256 threads busy on the output and state phases for K, V >= 64.

#pragma once

#include <algorithm>
#include <cstdlib>
#include <type_traits>

#include "chunk_bwd.cuh"
#include "chunk_dd.cuh"
#include "chunk_fwd.cuh"
#include "chunk_wg_dkv.cuh"
#include "chunk_wg_state.cuh"
#include "launch_plan.cuh"

namespace attnrnn::cuda {

// Pass 1 run by the sweep's own kernel with split.state_only set.
struct OwnStatePass {};

// One sweep of a chunk-scan kernel (chunk_tc_kernel, chunk_wg_kernel, chunk_wg_pair_kernel) as one
// pass or two: grid (sequences x segments x tiles, kv heads) of `threads`; `segments` is the sweep's
// split (1 without a workspace), over chunks of `chunk` tokens. Pass 1 runs the sweep's kernel, or
// state_pass(split, grid, stream) when one is given (launch_wg_state_pass).
template <class Kernel, class StatePass = OwnStatePass>
Status launch_sweep(Kernel kernel, int64_t bytes, const LinearAttnParams& p, float* partial, int segments,
                    int64_t tiles, const TcFeatures& feat, const char* what, int threads = kTcThreads,
                    int chunk = kTcChunk, StatePass state_pass = {}) {
  Status s = allow_smem(kernel, bytes, what);
  if (s != Status::kSuccess) return s;
  TcSplit split;
  split.segments = partial != nullptr ? segments : 1;
  const dim3 grid(static_cast<unsigned>(num_states(p) * split.segments * tiles), static_cast<unsigned>(p.num_kv_heads));
  cudaStream_t stream = static_cast<cudaStream_t>(p.stream);
  if (split.segments > 1) {
    const int64_t chunks = (p.seqlen + chunk - 1) / chunk;
    split.seg_chunks = static_cast<int>((chunks + split.segments - 1) / split.segments);
    split.partial = partial;
    split.state_only = true;
    if constexpr (std::is_same_v<StatePass, OwnStatePass>) {
      kernel<<<grid, threads, bytes, stream>>>(p, split, feat);
    } else {
      s = state_pass(split, grid, stream);
      if (s != Status::kSuccess) return s;
    }
    s = check_launch(what);
    if (s != Status::kSuccess) return s;
    split.state_only = false;
  }
  kernel<<<grid, threads, bytes, stream>>>(p, split, feat);
  return check_launch(what);
}

// dk's and dv's pass 1 as one (TcSplit::partial_t): dv's also writes dk's partials, and dk's own is
// skipped. Without the normalizer, at K = V = 128, where both sweeps split alike; dv then dk on one
// stream (the first side stream when the sweeps overlap, so that the results do not depend on it).
// At B1-T65536-H16-D128 that is one state pass less (~130 us: q and dout read once).
// ATTNRNN_BWD_SHARED_STATE_PASS=0 gives each its own (for measuring).
struct Pass1Share {
  float* transposed_to = nullptr;  // dv: dk's partials
  bool done = false;               // dk: written by dv's pass 1
};
inline bool shared_dkv_state_pass(const LinearAttnParams& p, bool wg) {
  static const bool enabled = [] {
    const char* env = std::getenv("ATTNRNN_BWD_SHARED_STATE_PASS");
    return env == nullptr || std::atoi(env) != 0;
  }();
  if (!enabled || !wg || p.normalize || p.workspace == nullptr || p.head_dim_k != 128 ||
      p.head_dim_v != 128 || !wg_state_pass_enabled())
    return false;
  const bool pair = wgmma_pair<TcRole::kGradK>(p);
  if (pair != wgmma_pair<TcRole::kGradV>(p)) return false;
  const int dk = pair ? wg_pair_segments<TcRole::kGradK>(p) : wg_segments<TcRole::kGradK, 128>(p);
  const int dv = pair ? wg_pair_segments<TcRole::kGradV>(p) : wg_segments<TcRole::kGradV, 128>(p);
  return dk > 1 && dk == dv;
}

// The forward's segment states for dq (params.segment_states_out / _in): without the normalizer dq's
// segment sums S^T = sum_t v_t^T phi(k_t) [V][K] are the transposes of the forward's S = sum_t
// phi(k_t)^T v_t [K][V] over the same tokens. At K = V = 128, where both run the 64-token sweep
// split into the same segments, the forward's state pass also writes its sums transposed in dq's
// partial layout, and dq's pass 2 reads them instead of running its own state pass (~130 us at
// B1-T65536-H16-D128: k and v read once less). Floats of dq's partials, 0 where this does not apply.
// A condition on q, k, v (shapes, dtype, alignment), the options and the device only, so that the
// forward and the backward agree. ATTNRNN_FWD_STATES_FOR_DQ=0 turns it off (for measuring).
inline int64_t fwd_states_for_dq_floats(const LinearAttnParams& p) {
  static const bool enabled = [] {
    const char* env = std::getenv("ATTNRNN_FWD_STATES_FOR_DQ");
    return env == nullptr || std::atoi(env) != 0;
  }();
  if (!enabled || p.normalize || p.head_dim_k != 128 || p.head_dim_v != 128 || !tensor_core_dtype(p, false) ||
      !wgmma_planned(p, false) || !wgmma_planned(p, true) || !wg_state_pass_enabled())
    return 0;
  if (wgmma_pair<TcRole::kForward>(p) || wgmma_pair<TcRole::kGradQ>(p)) return 0;
  const int fwd = wg_segments<TcRole::kForward, 128>(p), dq = wg_segments<TcRole::kGradQ, 128>(p);
  return fwd > 1 && fwd == dq ? wg_partial_floats<TcRole::kGradQ, 128>(p) : 0;
}

// Pass 1 of a split wgmma sweep of role R on chunk_wg_state_kernel; chunk: pass 2's chunk length,
// BlocksPerSm: the blocks per SM its split assumes.
template <class T, TcRole R, int DI, int BlocksPerSm, bool WithNormalizer>
Status launch_wg_state_pass(const LinearAttnParams& p, const TcFeatures& feat, int chunk, const TcSplit& split,
                            dim3 grid, cudaStream_t stream, const char* what) {
  auto kernel = chunk_wg_state_kernel<T, R, DI, BlocksPerSm, WithNormalizer>;
  constexpr int64_t bytes = WgStateLayoutOf<R, DI, BlocksPerSm, WithNormalizer>::smem_bytes;
  const Status s = allow_smem(kernel, bytes, what);
  if (s != Status::kSuccess) return s;
  kernel<<<grid, kTcThreads, bytes, stream>>>(p, split, feat, chunk);
  return Status::kSuccess;
}

// launch_sweep for the wgmma kernels: with the state pass where the role has one and it is enabled
// (BlocksPerSm: the blocks per SM of the sweep's split), shared between dk and dv as `share` says.
template <class T, TcRole R, int DI, int BlocksPerSm, bool WithNormalizer, class Kernel>
Status launch_wg_sweep(Kernel kernel, int64_t bytes, const LinearAttnParams& p, float* partial, int segments,
                       int64_t tiles, const TcFeatures& feat, const char* what, int threads, int chunk,
                       Pass1Share share = {}) {
  if constexpr (kHasWgStatePass<R, WithNormalizer>) {
    if (wg_state_pass_enabled()) {
      auto state_pass = [&](const TcSplit& split, dim3 grid, cudaStream_t stream) {
        if (share.done) return Status::kSuccess;
        TcSplit with = split;
        with.partial_t = share.transposed_to;
        return launch_wg_state_pass<T, R, DI, BlocksPerSm, WithNormalizer>(p, feat, chunk, with, grid, stream, what);
      };
      return launch_sweep(kernel, bytes, p, partial, segments, tiles, feat, what, threads, chunk, state_pass);
    }
  }
  return launch_sweep(kernel, bytes, p, partial, segments, tiles, feat, what, threads, chunk);
}

template <class T, TcRole R, int DI>
Status launch_tc_role(const LinearAttnParams& p, float* partial, const TcFeatures& feat, const char* what) {
  return launch_sweep(chunk_tc_kernel<T, R, DI>, TcLayout<DI>::bytes(sizeof(T)), p, partial,
                      tc_role_segments<R, DI>(p), tc_tiles<R, DI>(p), feat, what);
}

template <class T, TcRole R>
Status launch_tc(const LinearAttnParams& p, int64_t inner, float* partial, const TcFeatures& feat, const char* what) {
  return inner == 64 ? launch_tc_role<T, R, 64>(p, partial, feat, what)
                     : launch_tc_role<T, R, 128>(p, partial, feat, what);
}

// Two side streams of the current device, forked from `main` by an event and joined back into it
// (linear_attn.cu). The fork reaches no side stream (sides == 0) unless ATTNRNN_BWD_CONCURRENT=1,
// inside a stream capture, or where side streams cannot be made: the sweeps then all run on main.
struct SweepFork {
  int sides = 0;  // side streams that wait for main: side[0, sides)
  cudaStream_t side[2] = {nullptr, nullptr};
};
Status fork_sweeps(void* main, SweepFork& fork);
Status join_sweeps(void* main, const SweepFork& fork);

// kernel(view, B, T, heads, K, feature map, out) over q into fq [B, T, H, K], then over k into fk
// [B, T, Hkv, K]: grid-stride loops of `per_thread` elements per thread, at most 8 blocks per SM.
template <class T, class Kernel>
Status launch_over_q_and_k(Kernel kernel, const LinearAttnParams& p, int per_thread, T* fq, T* fk, const char* what) {
  const int threads = 256;
  const int64_t blocks_cap = int64_t(sm_count()) * 8;
  for (int which = 0; which < 2; ++which) {
    const int64_t H = which == 0 ? p.num_heads : p.num_kv_heads;
    const int64_t work = feature_elems(p, H) / per_thread;
    if (work == 0) continue;
    const unsigned blocks = static_cast<unsigned>(std::min(blocks_cap, (work + threads - 1) / threads));
    kernel<<<blocks, threads, 0, static_cast<cudaStream_t>(p.stream)>>>(
        which == 0 ? p.q : p.k, p.batch, p.seqlen, H, p.head_dim_k, p.feature_map, which == 0 ? fq : fk);
    const Status s = check_launch(what);
    if (s != Status::kSuccess) return s;
  }
  return Status::kSuccess;
}

// phi(q) and phi(k) into contiguous rows fq and fk, 8 elements per thread (feature_map_kernel:
// K % 8 == 0, 16-byte aligned rows, bf16 or fp16). The feature pass of the tensor-core sweeps, and
// linear_attn_features where those requirements hold.
template <class T>
Status launch_feature_pass(const LinearAttnParams& p, T* fq, T* fk) {
  return launch_over_q_and_k(feature_map_kernel<T>, p, 8, fq, fk, "chunk_linear_attn feature map");
}

// phi(q) and phi(k) into the workspace (TcFeatures), or the map for the wgmma sweeps to apply
// themselves (relu_in_sweep); neither without a feature map, and no pass without a workspace.
// With p.phi_given (the backward of a forward whose autograd saved phi(q), phi(k)) q and k are
// those rows already: the sweeps read them as the pass's, no pass.
template <class T>
Status compute_features(const LinearAttnParams& p, bool backward, TcFeatures& feat) {
  feat = TcFeatures{};
  if (p.phi_given && p.feature_map != FeatureMap::kIdentity) {
    feat.q = p.q;
    feat.k = p.k;
    return Status::kSuccess;
  }
  if (relu_in_sweep_planned(p, backward)) {
    feat.relu_in_sweep = true;
    return Status::kSuccess;
  }
  if (p.workspace == nullptr || feature_bytes(p, backward) == 0) return Status::kSuccess;
  char* base = static_cast<char*>(p.workspace) + token_scalar_bytes(p, backward) + round256(partial_bytes(p, backward));
  const int64_t K = p.head_dim_k, T_ = p.seqlen;
  T* fq = reinterpret_cast<T*>(base);
  T* fk = reinterpret_cast<T*>(base + round256(feature_elems(p, p.num_heads) * int64_t(sizeof(T))));
  const Status s = launch_feature_pass<T>(p, fq, fk);
  if (s != Status::kSuccess) return s;
  feat.q = ConstView{fq, T_ * p.num_heads * K, p.num_heads * K, K};
  feat.k = ConstView{fk, T_ * p.num_kv_heads * K, p.num_kv_heads * K, K};
  return Status::kSuccess;
}

// Each wgmma kernel is compiled for one normalize mode: the forward takes its normalizer's products
// from WithNormalizer at compile time, the sweeps compiled without it skip the normalizer's terms.
// launch_wg_forward and launch_chunk_bwd_tc pass p.normalize; this check refuses any other pairing.
template <bool WithNormalizer>
Status check_normalize_mode(const LinearAttnParams& p, const char* what) {
  if (WithNormalizer == p.normalize) return Status::kSuccess;
  return fail(Status::kInvalidArgument, "%s: a kernel compiled for normalize=%d launched with normalize=%d", what,
              int(WithNormalizer), int(p.normalize));
}

template <class T, TcRole R, int DI, bool WithNormalizer>
Status launch_wg_role(const LinearAttnParams& p, float* partial, const TcFeatures& feat, const char* what,
                      Pass1Share share = {}) {
  if (const Status s = check_normalize_mode<WithNormalizer>(p, what); s != Status::kSuccess) return s;
  using L = WgLayoutOf<R, DI>;
  return launch_wg_sweep<T, R, DI, L::min_blocks, WithNormalizer>(chunk_wg_kernel<T, R, DI, WithNormalizer>,
                                                                   L::smem_bytes, p, partial, wg_segments<R, DI>(p),
                                                                   wg_tiles<R>(p), feat, what, kTcThreads, kTcChunk,
                                                                   share);
}
template <class T, TcRole R, bool WithNormalizer>
Status launch_wg_pair(const LinearAttnParams& p, float* partial, const TcFeatures& feat, const char* what,
                      Pass1Share share = {}) {
  if (const Status s = check_normalize_mode<WithNormalizer>(p, what); s != Status::kSuccess) return s;
  // one block per SM, as wg_pair_segments splits
  return launch_wg_sweep<T, R, 64 * WgPairLayout::KT, 1, WithNormalizer>(
      chunk_wg_pair_kernel<T, R, WithNormalizer>, WgPairLayout::smem_bytes, p, partial, wg_pair_segments<R>(p),
      wg_tiles<R>(p), feat, what, WgPairLayout::threads, WgPairLayout::chunk, share);
}
template <class T, TcRole R, bool WithNormalizer>
Status launch_wg(const LinearAttnParams& p, int64_t inner, float* partial, const TcFeatures& feat, const char* what,
                 Pass1Share share = {}) {
  return inner == 64 ? launch_wg_role<T, R, 64, WithNormalizer>(p, partial, feat, what, share)
                     : launch_wg_role<T, R, 128, WithNormalizer>(p, partial, feat, what, share);
}
// The wgmma forward. Without normalize it runs kernels compiled without the normalizer, whose
// registers and branches would otherwise cost the unnormalized steps (H200: 249.5 -> 255.7 us at
// B4-T8192-H16-D128 when the normalizer's z split came in). WithNormalizer == p.normalize
// (check_normalize_mode).
template <class T, bool WithNormalizer>
Status launch_wg_forward(const LinearAttnParams& p, int64_t K, float* partial, const TcFeatures& feat) {
  if (wgmma_pair<TcRole::kForward>(p))
    return launch_wg_pair<T, TcRole::kForward, WithNormalizer>(p, partial, feat,
                                                              "chunk_linear_attn forward (wgmma, 128-token chunks)");
  return launch_wg<T, TcRole::kForward, WithNormalizer>(p, K, partial, feat, "chunk_linear_attn forward (wgmma)",
                                                       Pass1Share{p.segment_states_out, false});
}

// dk and dv in one sweep (fused_dkv128), after dv's state pass into dv's partials when it splits.
template <class T, bool WithNormalizer>
Status launch_wg_dkv128(const LinearAttnParams& p, float* dv_partial, const TcFeatures& feat) {
  const char* what = "chunk_linear_attn backward (dk and dv, K = V = 128)";
  if constexpr (WithNormalizer) {
    return fail(Status::kInvalidArgument, "%s: the fused sweep has no normalizer", what);
  } else {
    if (const Status s = check_normalize_mode<false>(p, what); s != Status::kSuccess) return s;
    auto dv_state_pass = [&](const TcSplit& split, dim3 grid, cudaStream_t stream) {
      // dv's grid: two output tiles where this sweep's block has both; as many blocks per SM as
      // dv's 64-token sweep (the state pass's stages)
      return launch_wg_state_pass<T, TcRole::kGradV, 128, WgLayout<128>::min_blocks, false>(
          p, feat, kTcChunk, split, dim3(grid.x * 2, grid.y), stream, what);
    };
    // with one query head per kv head every step is a chunk's first and last (chunk_wg_dkv.cuh)
    auto kernel = p.num_heads == p.num_kv_heads ? chunk_wg_dkv_kernel<T, true> : chunk_wg_dkv_kernel<T, false>;
    return launch_sweep(kernel, WgDkvLayout::smem_bytes, p, dv_partial, fused_dkv128_segments(p), 1, feat, what,
                        WgDkvLayout::threads, kTcChunk, dv_state_pass);
  }
}

// w and dd from the forward's saved w (chunk_dd.cuh): a grid of at most 8 blocks per SM (fewer fit
// at once; the grid-stride loop takes the rest), fewer when there are fewer rows.
template <class T>
Status launch_dd(const LinearAttnParams& p) {
  const int64_t V = p.head_dim_v, rows = p.batch * p.seqlen * p.num_heads;
  if (V != 64 && V != 128) return fail(Status::kInvalidArgument, "chunk_dd: V must be 64 or 128, got %lld", (long long)V);
  const int64_t rows_per_block = (kDdThreads / 32) * (32 / (V / 8)) * kDdUnroll;
  const int64_t blocks = std::min<int64_t>((rows + rows_per_block - 1) / rows_per_block, int64_t(sm_count()) * 8);
  if (blocks == 0) return Status::kSuccess;
  const bool out16 = aligned16(p.out);
  auto kernel = V == 64 ? (out16 ? chunk_dd_kernel<T, 64, true> : chunk_dd_kernel<T, 64, false>)
                        : (out16 ? chunk_dd_kernel<T, 128, true> : chunk_dd_kernel<T, 128, false>);
  kernel<<<static_cast<unsigned>(blocks), kDdThreads, 0, static_cast<cudaStream_t>(p.stream)>>>(p);
  return check_launch("chunk_linear_attn backward (denominators from the forward)");
}

// The backward's tensor-core sweeps, compiled once per normalize mode as the forward is (without
// normalize, kernels free of the normalizer's registers and branches). The unnormalized half is
// instantiated in its own files (instantiations/chunk_bwd_unnorm_*.cu), so that the two sets of
// wgmma sweeps build in parallel rather than in one file; the mma.sync sweeps they share are
// instantiated once (ATTNRNN_BWD_TC_SWEEPS below).
template <class T, bool WithNormalizer>
Status launch_chunk_bwd_tc(const LinearAttnParams& p) {
  const int64_t K = p.head_dim_k, V = p.head_dim_v;
  float* partial = partial_ptr(p, true);
  TcFeatures feat;
  Status s = compute_features<T>(p, true, feat);
  if constexpr (WithNormalizer) {
    if (s == Status::kSuccess && p.normalize)
      s = p.den_in != nullptr ? launch_dd<T>(p)
                              : launch_tc<T, TcRole::kDen>(p, K, partial, feat, "chunk_linear_attn backward (denominators)");
  }
  if (s != Status::kSuccess) return s;
  // dq, dk and dv read the same inputs and write disjoint outputs (each its own partials). With
  // ATTNRNN_BWD_CONCURRENT=1 dk and dv run on two side streams forked from p.stream and joined back
  // into it, so that their step chains overlap dq's; by default the fork reaches no side stream and
  // they follow dq on p.stream. At K = V = 64 one sweep makes both (wgmma_fused_dkv), on the first
  // side stream when there is one.
  const BwdPartials r = bwd_partials(p);
  char* base = reinterpret_cast<char*>(partial);
  LinearAttnParams on_side[2] = {p, p};
  SweepFork fork;
  s = fork_sweeps(p.stream, fork);
  if (s == Status::kSuccess && fork.sides == 2) {
    on_side[0].stream = fork.side[0];
    on_side[1].stream = fork.side[1];
  }
  float* dk_partial = reinterpret_cast<float*>(base + r.dk_offset);
  float* dv_partial = reinterpret_cast<float*>(base + r.dv_offset);
  const bool wg = wgmma_sweeps(p, true, feat);
  auto sweep = [&](auto role, const LinearAttnParams& on, int64_t inner, float* part, const char* what,
                   Pass1Share share = {}) {
    constexpr TcRole R = decltype(role)::value;
    if (wg && wgmma_pair<R>(on)) return launch_wg_pair<T, R, WithNormalizer>(on, part, feat, what, share);
    return wg ? launch_wg<T, R, WithNormalizer>(on, inner, part, feat, what, share)
              : launch_tc<T, R>(on, inner, part, feat, what);
  };
  using GradQ = std::integral_constant<TcRole, TcRole::kGradQ>;
  using GradK = std::integral_constant<TcRole, TcRole::kGradK>;
  using GradV = std::integral_constant<TcRole, TcRole::kGradV>;
  // dq's partials from the forward (fwd_states_for_dq_floats) where it saved them and dq runs the
  // 64-token wgmma sweep it split alike.
  const bool dq_from_forward = wg && p.segment_states_in != nullptr && !wgmma_pair<TcRole::kGradQ>(p) &&
                               fwd_states_for_dq_floats(p) > 0;
  if (s == Status::kSuccess)
    s = dq_from_forward ? launch_wg<T, TcRole::kGradQ, WithNormalizer>(p, V, const_cast<float*>(p.segment_states_in),
                                                                       feat, "chunk_linear_attn backward (dq)",
                                                                       Pass1Share{nullptr, true})
                        : sweep(GradQ{}, p, V, partial, "chunk_linear_attn backward (dq)");
  if (wg && wgmma_fused_dkv(p)) {  // dk and dv from one state: one sweep in the dk region
    if (s == Status::kSuccess)
      s = launch_wg_role<T, TcRole::kGradKV, 64, WithNormalizer>(on_side[0], dk_partial, feat,
                                                                 "chunk_linear_attn backward (dk, dv)");
  } else if (wg && fused_dkv128(p) && p.workspace != nullptr) {  // dk and dv from one state at K = V = 128
    if (s == Status::kSuccess) s = launch_wg_dkv128<T, WithNormalizer>(on_side[0], dv_partial, feat);
  } else if (shared_dkv_state_pass(p, wg)) {  // dv first: its pass 1 is dk's too
    if (s == Status::kSuccess)
      s = sweep(GradV{}, on_side[0], K, dv_partial, "chunk_linear_attn backward (dv)", Pass1Share{dk_partial, false});
    if (s == Status::kSuccess)
      s = sweep(GradK{}, on_side[0], V, dk_partial, "chunk_linear_attn backward (dk)", Pass1Share{nullptr, true});
  } else {
    if (s == Status::kSuccess) s = sweep(GradK{}, on_side[0], V, dk_partial, "chunk_linear_attn backward (dk)");
    if (s == Status::kSuccess) s = sweep(GradV{}, on_side[1], K, dv_partial, "chunk_linear_attn backward (dv)");
  }
  const Status joined = join_sweeps(p.stream, fork);  // always: a capture must not end with a fork open
  return s != Status::kSuccess ? s : joined;
}

extern template Status launch_chunk_bwd_tc<__nv_bfloat16, false>(const LinearAttnParams&);
extern template Status launch_chunk_bwd_tc<__half, false>(const LinearAttnParams&);
// The mma.sync sweeps of the backward (no normalizer template) are instantiated once, in
// chunk_bwd_{bf16,fp16}.cu, for both halves of launch_chunk_bwd_tc.
#define ATTNRNN_BWD_TC_SWEEPS(PREFIX, T)                                                                        \
  PREFIX template Status launch_tc<T, TcRole::kGradQ>(const LinearAttnParams&, int64_t, float*, const TcFeatures&, \
                                                      const char*);                                             \
  PREFIX template Status launch_tc<T, TcRole::kGradK>(const LinearAttnParams&, int64_t, float*, const TcFeatures&, \
                                                      const char*);                                             \
  PREFIX template Status launch_tc<T, TcRole::kGradV>(const LinearAttnParams&, int64_t, float*, const TcFeatures&, \
                                                      const char*);
ATTNRNN_BWD_TC_SWEEPS(extern, __nv_bfloat16)
ATTNRNN_BWD_TC_SWEEPS(extern, __half)

template <class T>
Status launch_chunk_fwd(const LinearAttnParams& p, bool recurrent) {
  using A = typename AccOf<T>::type;
  const int64_t N = num_states(p), K = p.head_dim_k, V = p.head_dim_v;
  if (p.segment_states_out != nullptr && (recurrent || !tensor_core_forward(p, recurrent)))
    return fail(Status::kInvalidArgument, "chunk_linear_attn forward: segment_states_out is set where the forward "
                                          "writes none (only the chunked tensor-core forward writes it)");
  if (N == 0) return Status::kSuccess;
  if constexpr (std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>) {
    if (tensor_core_forward(p, recurrent)) {
      TcFeatures feat;
      const Status s = compute_features<T>(p, false, feat);
      if (s != Status::kSuccess) return s;
      float* partial = p.workspace == nullptr ? nullptr : partial_ptr(p, false);
      if (p.segment_states_out != nullptr &&
          (partial == nullptr || !wgmma_sweeps(p, false, feat) || fwd_states_for_dq_floats(p) == 0))
        return fail(Status::kInvalidArgument, "chunk_linear_attn forward: segment_states_out is set where the forward "
                                              "writes none (linear_attn_chunk_fwd_segment_state_floats() == 0, or no workspace)");
      if (wgmma_sweeps(p, false, feat))
        return p.normalize ? launch_wg_forward<T, true>(p, K, partial, feat)
                           : launch_wg_forward<T, false>(p, K, partial, feat);
      return launch_tc<T, TcRole::kForward>(p, K, partial, feat, "chunk_linear_attn forward (tensor cores)");
    }
  }
  const int BV = static_cast<int>(V < 64 ? V : 64);
  const int64_t limit = max_dynamic_smem();
  const int C = pick_chunk(requested_chunk(p, recurrent),
                           [&](int c) { return fwd_smem(K, c, BV).total() * int64_t(sizeof(A)) <= limit; });
  const int64_t bytes = fwd_smem(K, C, BV).total() * int64_t(sizeof(A));
  Status s = allow_smem(chunk_fwd_kernel<T>, bytes, "chunk_linear_attn forward");
  if (s != Status::kSuccess) return s;
  const dim3 grid(static_cast<unsigned>(N), static_cast<unsigned>((V + BV - 1) / BV),
                  static_cast<unsigned>(p.num_kv_heads));
  chunk_fwd_kernel<T><<<grid, kFwdThreads, bytes, static_cast<cudaStream_t>(p.stream)>>>(p, C, BV);
  return check_launch("chunk_linear_attn forward");
}

template <class T>
Status launch_chunk_bwd(const LinearAttnParams& p, bool recurrent) {
  using A = typename AccOf<T>::type;
  const int64_t N = num_states(p), K = p.head_dim_k, V = p.head_dim_v;
  cudaStream_t stream = static_cast<cudaStream_t>(p.stream);
  const int64_t elems = p.batch * p.seqlen * p.num_heads;
  if (elems > 0 && p.workspace == nullptr)
    return fail(Status::kInvalidArgument, "workspace must hold linear_attn_workspace_bytes() bytes");
  if (N == 0) return Status::kSuccess;
  if constexpr (std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>) {
    if (tensor_core_backward(p, recurrent))
      return p.normalize ? launch_chunk_bwd_tc<T, true>(p) : launch_chunk_bwd_tc<T, false>(p);
  }
  const int BK = static_cast<int>(K < 32 ? K : 32), BV = static_cast<int>(V < 64 ? V : 64);
  const int64_t limit = max_dynamic_smem(), a = sizeof(A);
  const int C = pick_chunk(requested_chunk(p, recurrent), [&](int c) {
    return dq_smem(K, V, c, BK) * a <= limit && dk_smem(V, c, BK) * a <= limit && dv_smem(K, c, BV) * a <= limit;
  });
  const int64_t dq_bytes = dq_smem(K, V, C, BK) * a, dk_bytes = dk_smem(V, C, BK) * a,
                dv_bytes = dv_smem(K, C, BV) * a;
  Status s = allow_smem(chunk_bwd_dq_kernel<T>, dq_bytes, "chunk_linear_attn backward (dq)");
  if (s == Status::kSuccess) s = allow_smem(chunk_bwd_dk_kernel<T>, dk_bytes, "chunk_linear_attn backward (dk)");
  if (s == Status::kSuccess) s = allow_smem(chunk_bwd_dv_kernel<T>, dv_bytes, "chunk_linear_attn backward (dv)");
  if (s != Status::kSuccess) return s;
  const unsigned n = static_cast<unsigned>(N), g = static_cast<unsigned>(p.num_kv_heads);
  const unsigned k_tiles = static_cast<unsigned>((K + BK - 1) / BK), v_tiles = static_cast<unsigned>((V + BV - 1) / BV);
  chunk_bwd_dq_kernel<T><<<dim3(n, k_tiles, g), kBwdThreads, dq_bytes, stream>>>(p, C, BK);
  s = check_launch("chunk_linear_attn backward (dq)");
  if (s != Status::kSuccess) return s;
  chunk_bwd_dk_kernel<T><<<dim3(n, k_tiles, g), kBwdThreads, dk_bytes, stream>>>(p, C, BK);
  s = check_launch("chunk_linear_attn backward (dk)");
  if (s != Status::kSuccess) return s;
  chunk_bwd_dv_kernel<T><<<dim3(n, v_tiles, g), kBwdThreads, dv_bytes, stream>>>(p, C, BV);
  return check_launch("chunk_linear_attn backward (dv)");
}

}  // namespace attnrnn::cuda
