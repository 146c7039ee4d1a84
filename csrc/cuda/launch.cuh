// Host side of the CUDA kernels: tile choices, shared-memory limits and launches. Each
// (op, dtype) pair is instantiated in its own small .cu file (instantiations/).
//
// Tensor-core path (chunk_tc.cuh), bf16 and fp16, chunk 64 (the default or asked for), 16-byte
// aligned rows of q, k, v (and dout):
//   forward   K in {64, 128}, V % 64 == 0; one block per (sequence, output column tile, kv head)
//   backward  K, V in {64, 128}; den (normalize only), dq, dk, dv sweeps in that order
//   tiles     TcLayout (chunk_tc_plan.cuh): 2 stages, 64 output columns and 3 blocks/SM at inner
//             dim 64, 32 columns and 2 blocks/SM at 128; measured reasons in docs/design.md §5
//   features  with a feature map, phi(q) and phi(k) first go to the workspace (compute_features)
//   wgmma     on sm_90a builds and devices the forward and the dq, dk, dv sweeps run chunk_wg.cuh
//             instead (one warpgroup per (sequence, 64 output columns, kv head), the same steps and
//             segment split; WgLayout); the sweeps with inner dim 128 (the forward's and dv's K,
//             dq's and dk's V) with the default chunk size run chunk_wg_pair.cuh (two warpgroups on
//             128-token chunks; WgPairLayout)
//   den       with normalize, the backward's w and dd come from the forward's saved w when it is
//             given (chunk_dd.cuh, one pass over dout and o), else from the den sweep
//   overlap   with ATTNRNN_BWD_CONCURRENT=1 the backward's dq, dk and dv sweeps run at once (dk
//             and dv on two side streams forked from and joined into the call's stream), each with
//             its own pass-1 partials (BwdPartials); by default they follow each other in the
//             call's stream, which measured faster once dk+dv fused and the 128-token sweeps came
//
// Tile table of the generic path (256 threads per block, CUDA-core FMAs):
//   forward   BV = min(64, V) value columns per block; chunk C = the largest power of two <= the
//             requested chunk (default 64) whose shared memory fits (C = 32 at K = 256 in fp32)
//   backward  BK = min(32, K) key rows per dq/dk block, BV = min(64, V) for dv; one C for all three
//   step      one block per (batch entry, kv head, value tile: step_value_tiles); float4 columns
//             when V % 4 == 0; GT = heads per register pass (1, 2, 4 or 8); 4 state rows per thread
//             and batch (kStepBatchRows)
// Reasons: a block must hold its state slice and one chunk of q, k, v in shared memory; 64-column
// tiles keep 256 threads busy on the output and state phases for K, V >= 64.
#pragma once

#include <algorithm>
#include <cstdlib>
#include <type_traits>

#include "chunk_bwd.cuh"
#include "chunk_dd.cuh"
#include "chunk_fwd.cuh"
#include "chunk_tc.cuh"
#include "chunk_wg.cuh"
#include "chunk_wg_pair.cuh"
#include "common.cuh"
#include "step.cuh"

namespace attnrnn::cuda {

inline int64_t requested_chunk(const LinearAttnParams& p, bool recurrent) {
  if (recurrent) return 1;
  return p.chunk_size > 0 ? p.chunk_size : 64;
}

// The largest power of two <= want for which fits(C) holds (at least 1).
template <class Fits>
int pick_chunk(int64_t want, Fits fits) {
  int C = 1;
  while (C * 2 <= want && C * 2 <= 64) C *= 2;
  while (C > 1 && !fits(C)) C /= 2;
  return C;
}

inline bool aligned16(const ConstView& x) {
  return reinterpret_cast<uintptr_t>(x.data) % 16 == 0 && x.stride_b % 8 == 0 && x.stride_t % 8 == 0 &&
         x.stride_h % 8 == 0;
}

inline bool aligned4_pairs(const MutView& x) {
  return reinterpret_cast<uintptr_t>(x.data) % 4 == 0 && x.stride_b % 2 == 0 && x.stride_t % 2 == 0 &&
         x.stride_h % 2 == 0;
}
inline bool aligned4_pairs(const ConstView& x) {
  return aligned4_pairs(MutView{const_cast<void*>(x.data), x.stride_b, x.stride_t, x.stride_h});
}

inline bool tensor_core_dtype(const LinearAttnParams& p, bool recurrent) {
  return (p.dtype == DType::kBFloat16 || p.dtype == DType::kFloat16) && !recurrent &&
         (p.chunk_size == 0 || p.chunk_size == kTcChunk) && aligned16(p.q) && aligned16(p.k) && aligned16(p.v);
}

inline bool tensor_core_forward(const LinearAttnParams& p, bool recurrent) {
  return tensor_core_dtype(p, recurrent) && (p.head_dim_k == 64 || p.head_dim_k == 128) &&
         p.head_dim_v % 64 == 0 && aligned4_pairs(p.o);
}

inline bool tensor_core_backward(const LinearAttnParams& p, bool recurrent) {
  const bool dims = (p.head_dim_k == 64 || p.head_dim_k == 128) && (p.head_dim_v == 64 || p.head_dim_v == 128);
  return tensor_core_dtype(p, recurrent) && dims && aligned16(p.dout) && aligned4_pairs(p.dq) &&
         aligned4_pairs(p.dk) && aligned4_pairs(p.dv) && (!p.normalize || aligned4_pairs(p.out));
}

int sm_count();

// Segments of the two-pass scan (chunk_tc.cuh, TcSplit) of a sweep of `blocks` (sequence, tile,
// kv head) blocks when `per_sm` of them fit on an SM: a split only when there are at most half as
// many blocks as SMs, into as many segments as fill every block slot once; at least 16 chunks
// per segment.
// ATTNRNN_TC_SEGMENTS=n forces n (for measuring the tile table).
inline int tc_segments(const LinearAttnParams& p, int64_t blocks, int per_sm) {
  static const int forced = [] {
    const char* env = std::getenv("ATTNRNN_TC_SEGMENTS");
    return env != nullptr ? std::atoi(env) : 0;
  }();
  const int64_t sms = sm_count(), slots = sms * per_sm;
  const int64_t chunks = (p.seqlen + kTcChunk - 1) / kTcChunk;
  const bool few = 2 * blocks <= sms;  // measured: a split costs more than it gains above this
  int64_t want = forced > 0 ? forced : (few ? slots / std::max<int64_t>(blocks, 1) : 1);
  want = std::min<int64_t>(want, std::max<int64_t>(1, chunks / 16));
  const int64_t seg_chunks = (chunks + want - 1) / std::max<int64_t>(want, 1);
  return static_cast<int>(seg_chunks > 0 ? (chunks + seg_chunks - 1) / seg_chunks : 1);
}

template <TcRole R, int DI>
int tc_role_segments(const LinearAttnParams& p) {
  return tc_segments(p, num_states(p) * p.num_kv_heads * tc_tiles<R, DI>(p), TcLayout<DI>::min_blocks);
}

// Floats of pass-1 partials one sweep needs (0 without a split).
template <TcRole R, int DI>
int64_t tc_role_partial_floats(const LinearAttnParams& p) {
  const int64_t segments = tc_role_segments<R, DI>(p);
  if (segments <= 1) return 0;
  return segments * num_states(p) * p.num_kv_heads * tc_tiles<R, DI>(p) * tc_partial_floats<DI>();
}
template <TcRole R>
int64_t tc_partial_floats_of(const LinearAttnParams& p, int64_t inner) {
  return inner == 64 ? tc_role_partial_floats<R, 64>(p) : tc_role_partial_floats<R, 128>(p);
}

// One sweep of a chunk-scan kernel (chunk_tc_kernel, chunk_wg_kernel, chunk_wg_pair_kernel) as one
// pass or two: grid (sequences x segments x tiles, kv heads) of `threads`; `segments` is the sweep's
// split (1 without a workspace), over chunks of `chunk` tokens.
template <class Kernel>
Status launch_sweep(Kernel kernel, int64_t bytes, const LinearAttnParams& p, float* partial, int segments,
                    int64_t tiles, const TcFeatures& feat, const char* what, int threads = kTcThreads,
                    int chunk = kTcChunk) {
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
    kernel<<<grid, threads, bytes, stream>>>(p, split, feat);
    s = check_launch(what);
    if (s != Status::kSuccess) return s;
    split.state_only = false;
  }
  kernel<<<grid, threads, bytes, stream>>>(p, split, feat);
  return check_launch(what);
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

bool wgmma_device();

// Two side streams of the current device, forked from `main` by an event and joined back into it
// (linear_attn.cu). The fork reaches no side stream (sides == 0) unless ATTNRNN_BWD_CONCURRENT=1,
// inside a stream capture, or where side streams cannot be made: the sweeps then all run on main.
struct SweepFork {
  int sides = 0;  // side streams that wait for main: side[0, sides)
  cudaStream_t side[2] = {nullptr, nullptr};
};
Status fork_sweeps(void* main, SweepFork& fork);
Status join_sweeps(void* main, const SweepFork& fork);

// The wgmma sweeps (chunk_wg.cuh) take the tensor-core forward's K = 64 and K = 128 shapes and the
// backward's dq, dk and dv sweeps (K, V in {64, 128}; the den sweep stays on mma.sync) on sm_90a
// builds and devices, with phi(q), phi(k) from the workspace when there is a feature map (without a
// workspace, the mma.sync scan applies phi itself). ATTNRNN_TC_WGMMA is a mask (bit 0 the forward,
// bit 1 the backward, bit 2 dk and dv in one sweep at K = V = 64; on 128-token chunks and two
// warpgroups, bit 3 the forward at K = 128, bit 4 dq at V = 128, bit 5 dk at V = 128 and dv at
// K = 128, each where wgmma_pair's shape rule picks it; bit 6 pairs them at every shape; default 63,
// 0 keeps the mma.sync scans), for measuring one against the other.
// wgmma_planned decides the workspace's partials, so it must not depend on anything but p and the
// device.
inline int wgmma_mask() {
  static const int mask = [] {
    const char* env = std::getenv("ATTNRNN_TC_WGMMA");
    return env == nullptr ? 63 : std::atoi(env);
  }();
  return mask;
}
inline bool wgmma_planned(const LinearAttnParams& p, bool backward) {
#if defined(ATTNRNN_WGMMA)
  auto dim_ok = [](int64_t d) { return d == 64 || d == 128; };
  const bool dims = dim_ok(p.head_dim_k) && (!backward || dim_ok(p.head_dim_v));
  return (wgmma_mask() & (backward ? 2 : 1)) != 0 && dims && wgmma_device();
#else
  (void)p;
  (void)backward;
  return false;
#endif
}
// The backward's dk and dv as one wgmma sweep (chunk_wg.cuh, kGradKV): K = V = 64.
inline bool wgmma_fused_dkv(const LinearAttnParams& p) {
  return (wgmma_mask() & 4) != 0 && p.head_dim_k == 64 && p.head_dim_v == 64 && wgmma_planned(p, true);
}
inline bool wgmma_sweeps(const LinearAttnParams& p, bool backward, const TcFeatures& feat) {
  return wgmma_planned(p, backward) && (p.feature_map == FeatureMap::kIdentity || feat.q.data != nullptr);
}

// Blocks, segments and pass-1 partials of a wgmma sweep: 64 output columns per block (the forward's
// and dv's over V, dq's and dk's over K) and the segment rule of the tensor-core scan.
template <TcRole R>
int64_t wg_tiles(const LinearAttnParams& p) {
  return (R == TcRole::kForward || TcRoleInfo<R>::dv_like ? p.head_dim_v : p.head_dim_k) / 64;
}
// The sweep's blocks: (sequence, output tile, kv head).
template <TcRole R>
int64_t wg_blocks(const LinearAttnParams& p) {
  return num_states(p) * p.num_kv_heads * wg_tiles<R>(p);
}
template <TcRole R, int DI>
int wg_segments(const LinearAttnParams& p) {
  return tc_segments(p, wg_blocks<R>(p), WgLayoutOf<R, DI>::min_blocks);
}
template <TcRole R, int DI>
int64_t wg_partial_floats(const LinearAttnParams& p) {
  const int64_t segments = wg_segments<R, DI>(p);
  if (segments <= 1) return 0;
  return segments * wg_blocks<R>(p) * WgLayoutOf<R, DI>::partial_floats;
}
// The pair sweeps' segments: one block of two warpgroups per SM.
template <TcRole R>
int wg_pair_segments(const LinearAttnParams& p) {
  return tc_segments(p, wg_blocks<R>(p), 1);
}
template <TcRole R>
int64_t wg_pair_partial_floats(const LinearAttnParams& p) {
  const int64_t segments = wg_pair_segments<R>(p);
  if (segments <= 1) return 0;
  return segments * wg_blocks<R>(p) * WgPairLayout::partial_floats;
}
template <TcRole R>
int64_t wg_partial_floats_of(const LinearAttnParams& p, int64_t inner) {
  return inner == 64 ? wg_partial_floats<R, 64>(p) : wg_partial_floats<R, 128>(p);
}
// The sweeps with inner dim 128 (the forward's and dv's K, dq's and dk's V) on 128-token chunks
// (chunk_wg_pair.cuh), with the default chunk size (an explicit chunk_size = 64 keeps chunk_wg.cuh's
// 64-token steps), where the 64-token sweep would leave SMs with one warpgroup: its blocks run in
// one wave without a segment split. Measured (docs/design.md §5): at B3-T16384 and B4-T8192
// (H16, D128: 96 and 128 blocks) the pair sweeps take 18-24% less time, at 32-64 blocks (split into
// segments, two blocks per SM) and at 192-512 blocks (two blocks per SM) 6-16% more. Bit 6 of
// ATTNRNN_TC_WGMMA pairs them at every shape (tests, measurements).
template <TcRole R>
bool wgmma_pair(const LinearAttnParams& p) {
  static_assert(R != TcRole::kDen && R != TcRole::kGradKV, "the den and fused dk + dv sweeps are not paired");
  constexpr bool fwd = R == TcRole::kForward;
  constexpr int bit = fwd ? 8 : R == TcRole::kGradQ ? 16 : 32;
  const int64_t inner = (fwd || TcRoleInfo<R>::dv_like) ? p.head_dim_k : p.head_dim_v;
  if ((wgmma_mask() & bit) == 0 || inner != 128 || p.chunk_size != 0 || !wgmma_planned(p, !fwd)) return false;
  return (wgmma_mask() & 64) != 0 || (wg_blocks<R>(p) <= sm_count() && wg_segments<R, 128>(p) == 1);
}

// Workspace of the CUDA ops: [2 floats per (token, query head) for the backward][pass-1 partials]
// [phi(q), phi(k) when the tensor-core sweeps run with a feature map].
inline int64_t round256(int64_t bytes) { return (bytes + 255) / 256 * 256; }
inline int64_t token_scalar_bytes(const LinearAttnParams& p, bool backward) {
  const int64_t acc = p.dtype == DType::kFloat64 ? 8 : 4;
  return backward ? round256(2 * p.batch * p.seqlen * p.num_heads * acc) : 0;
}
inline bool tensor_core_sweep(const LinearAttnParams& p, bool backward) {
  return backward ? tensor_core_backward(p, false) : tensor_core_forward(p, false);
}
// Pass-1 partials of one backward sweep with inner dim `inner`: the kernel that runs it decides.
template <TcRole R>
int64_t sweep_partial_floats(const LinearAttnParams& p, bool wg, int64_t inner) {
  if (!wg) return tc_partial_floats_of<R>(p, inner);
  return wgmma_pair<R>(p) ? wg_pair_partial_floats<R>(p) : wg_partial_floats_of<R>(p, inner);
}
// The backward's pass-1 partials: one region per sweep, because dq, dk and dv may run at the same
// time (launch_chunk_bwd_tc): [den, then dq][dk][dv] (the den sweep finishes before the others start).
struct BwdPartials {
  int64_t dk_offset, dv_offset, dv_bytes;  // bytes from the partials' start
};
inline BwdPartials bwd_partials(const LinearAttnParams& p) {
  const int64_t K = p.head_dim_k, V = p.head_dim_v;
  const bool wg = wgmma_planned(p, true);
  const int64_t den = p.normalize ? tc_partial_floats_of<TcRole::kDen>(p, K) : 0;
  const int64_t dq = sweep_partial_floats<TcRole::kGradQ>(p, wg, V);
  // the dk region also holds the fused dk + dv sweep's partials where that sweep may run
  const int64_t dk = std::max(sweep_partial_floats<TcRole::kGradK>(p, wg, V),
                              wgmma_fused_dkv(p) ? wg_partial_floats<TcRole::kGradKV, 64>(p) : int64_t(0));
  const int64_t dv = sweep_partial_floats<TcRole::kGradV>(p, wg, K);
  const int64_t dk_offset = round256(4 * std::max(den, dq));
  return BwdPartials{dk_offset, dk_offset + round256(4 * dk), 4 * dv};
}
inline int64_t partial_bytes(const LinearAttnParams& p, bool backward) {
  const int64_t K = p.head_dim_k;
  if (!tensor_core_sweep(p, backward)) return 0;
  if (!backward) {
    if (wgmma_pair<TcRole::kForward>(p)) return wg_pair_partial_floats<TcRole::kForward>(p) * 4;
    if (wgmma_planned(p, false)) return wg_partial_floats_of<TcRole::kForward>(p, K) * 4;
    return tc_partial_floats_of<TcRole::kForward>(p, K) * 4;
  }
  const BwdPartials r = bwd_partials(p);
  return r.dv_offset + r.dv_bytes;
}
inline int64_t feature_elems(const LinearAttnParams& p, int64_t heads) { return p.batch * p.seqlen * heads * p.head_dim_k; }
inline int64_t feature_bytes(const LinearAttnParams& p, bool backward) {
  if (p.feature_map == FeatureMap::kIdentity || !tensor_core_sweep(p, backward)) return 0;
  const int64_t elem = 2;  // bf16/fp16: the tensor-core dtypes
  return round256(feature_elems(p, p.num_heads) * elem) + round256(feature_elems(p, p.num_kv_heads) * elem);
}
inline int64_t workspace_bytes_for(const LinearAttnParams& p, bool backward) {
  return token_scalar_bytes(p, backward) + round256(partial_bytes(p, backward)) + feature_bytes(p, backward);
}
inline float* partial_ptr(const LinearAttnParams& p, bool backward) {
  return reinterpret_cast<float*>(static_cast<char*>(p.workspace) + token_scalar_bytes(p, backward));
}

// phi(q) and phi(k) into the workspace (TcFeatures); none without a feature map or a workspace.
template <class T>
Status compute_features(const LinearAttnParams& p, bool backward, TcFeatures& feat) {
  feat = TcFeatures{};
  if (p.workspace == nullptr || feature_bytes(p, backward) == 0) return Status::kSuccess;
  char* base = static_cast<char*>(p.workspace) + token_scalar_bytes(p, backward) + round256(partial_bytes(p, backward));
  const int64_t K = p.head_dim_k, T_ = p.seqlen;
  T* fq = reinterpret_cast<T*>(base);
  T* fk = reinterpret_cast<T*>(base + round256(feature_elems(p, p.num_heads) * int64_t(sizeof(T))));
  cudaStream_t stream = static_cast<cudaStream_t>(p.stream);
  const int threads = 256;
  const int64_t blocks_cap = int64_t(sm_count()) * 8;
  for (int which = 0; which < 2; ++which) {
    const int64_t H = which == 0 ? p.num_heads : p.num_kv_heads;
    const int64_t pieces = feature_elems(p, H) / 8;
    if (pieces == 0) continue;
    const unsigned blocks = static_cast<unsigned>(std::min(blocks_cap, (pieces + threads - 1) / threads));
    feature_map_kernel<T><<<blocks, threads, 0, stream>>>(which == 0 ? p.q : p.k, p.batch, T_, H, K, p.feature_map,
                                                          which == 0 ? fq : fk);
    const Status s = check_launch("chunk_linear_attn feature map");
    if (s != Status::kSuccess) return s;
  }
  feat.q = ConstView{fq, T_ * p.num_heads * K, p.num_heads * K, K};
  feat.k = ConstView{fk, T_ * p.num_kv_heads * K, p.num_kv_heads * K, K};
  return Status::kSuccess;
}

template <class T, TcRole R, int DI, bool WithNormalizer = true>
Status launch_wg_role(const LinearAttnParams& p, float* partial, const TcFeatures& feat, const char* what) {
  return launch_sweep(chunk_wg_kernel<T, R, DI, WithNormalizer>, WgLayoutOf<R, DI>::smem_bytes, p, partial, wg_segments<R, DI>(p),
                      wg_tiles<R>(p), feat, what);
}
template <class T, TcRole R, bool WithNormalizer = true>
Status launch_wg_pair(const LinearAttnParams& p, float* partial, const TcFeatures& feat, const char* what) {
  return launch_sweep(chunk_wg_pair_kernel<T, R, WithNormalizer>, WgPairLayout::smem_bytes, p, partial, wg_pair_segments<R>(p),
                      wg_tiles<R>(p), feat, what, WgPairLayout::threads, WgPairLayout::chunk);
}
template <class T, TcRole R, bool WithNormalizer = true>
Status launch_wg(const LinearAttnParams& p, int64_t inner, float* partial, const TcFeatures& feat, const char* what) {
  return inner == 64 ? launch_wg_role<T, R, 64, WithNormalizer>(p, partial, feat, what)
                     : launch_wg_role<T, R, 128, WithNormalizer>(p, partial, feat, what);
}
// The wgmma forward. Without normalize it runs kernels compiled without the normalizer, whose
// registers and branches would otherwise cost the unnormalized steps (H200: 249.5 -> 255.7 us at
// B4-T8192-H16-D128 when the normalizer's z split came in).
template <class T, bool WithNormalizer>
Status launch_wg_forward(const LinearAttnParams& p, int64_t K, float* partial, const TcFeatures& feat) {
  if (wgmma_pair<TcRole::kForward>(p))
    return launch_wg_pair<T, TcRole::kForward, WithNormalizer>(p, partial, feat,
                                                              "chunk_linear_attn forward (wgmma, 128-token chunks)");
  return launch_wg<T, TcRole::kForward, WithNormalizer>(p, K, partial, feat, "chunk_linear_attn forward (wgmma)");
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

template <class T>
Status launch_chunk_bwd_tc(const LinearAttnParams& p) {
  const int64_t K = p.head_dim_k, V = p.head_dim_v;
  float* partial = partial_ptr(p, true);
  TcFeatures feat;
  Status s = compute_features<T>(p, true, feat);
  if (s == Status::kSuccess && p.normalize)
    s = p.den_in != nullptr ? launch_dd<T>(p)
                            : launch_tc<T, TcRole::kDen>(p, K, partial, feat, "chunk_linear_attn backward (denominators)");
  if (s != Status::kSuccess) return s;
  // dq, dk and dv read the same inputs and write disjoint outputs (each its own partials): dk and dv
  // run on two side streams forked from p.stream and joined back into it, so that at shapes whose
  // blocks leave SMs idle the sweeps' step chains overlap instead of following each other. At
  // K = V = 64 one sweep makes both (wgmma_fused_dkv), on the first side stream.
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
  auto sweep = [&](auto role, const LinearAttnParams& on, int64_t inner, float* part, const char* what) {
    constexpr TcRole R = decltype(role)::value;
    if (wg && wgmma_pair<R>(on)) return launch_wg_pair<T, R>(on, part, feat, what);
    return wg ? launch_wg<T, R>(on, inner, part, feat, what) : launch_tc<T, R>(on, inner, part, feat, what);
  };
  using GradQ = std::integral_constant<TcRole, TcRole::kGradQ>;
  using GradK = std::integral_constant<TcRole, TcRole::kGradK>;
  using GradV = std::integral_constant<TcRole, TcRole::kGradV>;
  if (s == Status::kSuccess) s = sweep(GradQ{}, p, V, partial, "chunk_linear_attn backward (dq)");
  if (wg && wgmma_fused_dkv(p)) {  // dk and dv from one state: one sweep in the dk region
    if (s == Status::kSuccess)
      s = launch_wg_role<T, TcRole::kGradKV, 64>(on_side[0], dk_partial, feat, "chunk_linear_attn backward (dk, dv)");
  } else {
    if (s == Status::kSuccess) s = sweep(GradK{}, on_side[0], V, dk_partial, "chunk_linear_attn backward (dk)");
    if (s == Status::kSuccess) s = sweep(GradV{}, on_side[1], K, dv_partial, "chunk_linear_attn backward (dv)");
  }
  const Status joined = join_sweeps(p.stream, fork);  // always: a capture must not end with a fork open
  return s != Status::kSuccess ? s : joined;
}

template <class T>
Status launch_chunk_fwd(const LinearAttnParams& p, bool recurrent) {
  using A = typename AccOf<T>::type;
  const int64_t N = num_states(p), K = p.head_dim_k, V = p.head_dim_v;
  if (N == 0) return Status::kSuccess;
  if constexpr (std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>) {
    if (tensor_core_forward(p, recurrent)) {
      TcFeatures feat;
      const Status s = compute_features<T>(p, false, feat);
      if (s != Status::kSuccess) return s;
      float* partial = p.workspace == nullptr ? nullptr : partial_ptr(p, false);
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
    if (tensor_core_backward(p, recurrent)) return launch_chunk_bwd_tc<T>(p);
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

// Value-column tiles per (batch entry, kv head) of the decode step: V is split (into tiles of at least
// 8 vectors) only while the grid stays within one block per SM. Measured kernel times at H32 D128
// (scripts/decode_probe.py): B1 5.2 / 4.1 / 3.6 us with 1 / 2 / 4 tiles, but B8 8.2 / 10.0 / 10.3 and
// B64 75 / 79 / 104 us. Normalize keeps one block per state row (it alone updates the key sum).
// ATTNRNN_STEP_TILES=n forces n (for measuring).
inline int step_value_tiles(const LinearAttnStepParams& p, int W) {
  static const int forced = std::getenv("ATTNRNN_STEP_TILES") ? std::atoi(std::getenv("ATTNRNN_STEP_TILES")) : 0;
  if (p.normalize) return 1;
  const int64_t blocks = p.batch * p.num_kv_heads, min_tile = int64_t(W) * 8;
  auto fits = [&](int tiles) { return p.head_dim_v % (tiles * min_tile) == 0; };
  if (forced > 0) {
    int tiles = forced;
    while (tiles > 1 && !fits(tiles)) tiles /= 2;
    return tiles;
  }
  int tiles = 1;
  while (tiles < 4 && blocks * tiles * 2 <= sm_count() && fits(tiles * 2)) tiles *= 2;
  return tiles;
}

template <class T, int GT, int W>
Status launch_step_with(const LinearAttnStepParams& p) {
  using A = typename AccOf<T>::type;
  const int64_t K = p.head_dim_k, V = p.head_dim_v, G = p.num_heads / p.num_kv_heads;
  const int tiles = step_value_tiles(p, W);
  const int BV = static_cast<int>(V / tiles);
  const int cols = BV / W;
  const int row_sets = cols >= kStepThreads ? 1 : kStepThreads / cols;
  const int64_t bytes = step_smem(K, BV, G, GT, row_sets) * int64_t(sizeof(A));
  Status s = allow_smem(step_kernel<T, GT, W>, bytes, "linear_attn_step");
  if (s != Status::kSuccess) return s;
  const dim3 grid(static_cast<unsigned>(p.batch), static_cast<unsigned>(p.num_kv_heads), tiles);
  step_kernel<T, GT, W><<<grid, kStepThreads, bytes, static_cast<cudaStream_t>(p.stream)>>>(p, BV, row_sets);
  return check_launch("linear_attn_step");
}

template <class T, int W>
Status launch_step_width(const LinearAttnStepParams& p) {
  const int64_t G = p.num_heads / p.num_kv_heads;
  if (G <= 1) return launch_step_with<T, 1, W>(p);
  if (G <= 2) return launch_step_with<T, 2, W>(p);
  if (G <= 4) return launch_step_with<T, 4, W>(p);
  return launch_step_with<T, 8, W>(p);
}

template <class T>
Status launch_step(const LinearAttnStepParams& p) {
  if (p.batch == 0) return Status::kSuccess;
  const bool vec4 = p.head_dim_v % 4 == 0 && reinterpret_cast<uintptr_t>(p.S) % 16 == 0;
  return vec4 ? launch_step_width<T, 4>(p) : launch_step_width<T, 1>(p);
}

}  // namespace attnrnn::cuda
