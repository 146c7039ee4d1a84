// Host-side plan of the chunk scans: which kernel runs a sweep (generic, mma.sync, wgmma on 64- or
// 128-token chunks), its segment split, and the workspace it needs (pass-1 partials, phi(q), phi(k)).
// No launches here: launch.cuh launches what this decides, and workspace_bytes (linear_attn.cu) sizes
// the workspace from it before any launch.
#pragma once

#include <algorithm>
#include <cstdlib>

#include "chunk_tc.cuh"
#include "chunk_wg.cuh"
#include "chunk_wg_pair.cuh"
#include "common.cuh"

namespace attnrnn::cuda {

int sm_count();
bool wgmma_device();

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

// The wgmma sweeps (chunk_wg.cuh) take the tensor-core forward's K = 64 and K = 128 shapes and the
// backward's dq, dk and dv sweeps (K, V in {64, 128}; the den sweep stays on mma.sync) on sm_90a
// builds and devices, applying relu to their own q and k tiles (relu_in_sweep_planned), or with
// phi(q), phi(k) from the workspace where that pass runs instead (without a workspace, the
// mma.sync scan applies phi itself). ATTNRNN_TC_WGMMA is a mask (bit 0 the forward,
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
// relu inside the wgmma sweeps (TcFeatures::relu_in_sweep) rather than by a pass into the workspace:
// wherever they run, but for the backward at K = V = 64 with normalize, whose fused dk + dv sweep
// leaves it out (chunk_wg.cuh), and unless ATTNRNN_PHI_IN_SWEEP=0 (the pass, for measuring). elu1
// keeps the pass: applied in the sweeps as well, its exp on each step's chain made the kernels of a
// forward+backward 2615 -> 3632 us (H200, bf16, B1-T65536-H16-D128; the two passes it saves take 552).
inline bool relu_in_sweep_planned(const LinearAttnParams& p, bool backward) {
  static const bool enabled = [] {
    const char* env = std::getenv("ATTNRNN_PHI_IN_SWEEP");
    return env == nullptr || std::atoi(env) != 0;
  }();
  const bool fused_dkv64_normalized = backward && p.normalize && p.head_dim_k == 64 && p.head_dim_v == 64;
  return enabled && p.feature_map == FeatureMap::kRelu && !fused_dkv64_normalized && wgmma_planned(p, backward);
}
// With elu1 only on phi(q), phi(k) from the workspace: the sweeps' epilogues take elu1's phi' from
// them (dphi_rows).
inline bool wgmma_sweeps(const LinearAttnParams& p, bool backward, const TcFeatures& feat) {
  return wgmma_planned(p, backward) &&
         (p.feature_map == FeatureMap::kIdentity || feat.q.data != nullptr || feat.relu_in_sweep);
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
// segments, two blocks per SM) and at 192-512 blocks (two blocks per SM) 6-16% more. The normalize
// forward in bf16 pairs in a segment split too: its normalizer costs the 64-token kernel ~145 us at
// B1-T65536-H16-D128 and the pair's ~60 (m64n8 wgmma), so the pair takes 796 -> 719 us there,
// 775 -> 708 at B2-T32768-H16 and 835 -> 725 at B1-T131072-H8. The unnormalized forward keeps the
// rule: paired it took 651 -> 658, 628 -> 652 and 688 -> 659 (two of three slower), and so does fp16,
// whose pair forward takes a . z in fp32 FMAs, not on wgmma: with normalize 845 -> 843 us at
// B1-T65536-H16-D128 and 826 -> 839 at B2-T32768-H16 (bench/results/raw/h200_fwd_pair_rule_fp16.txt).
// Bit 6 of ATTNRNN_TC_WGMMA pairs them at every shape (tests, measurements).
template <TcRole R>
bool wgmma_pair(const LinearAttnParams& p) {
  static_assert(R != TcRole::kDen && R != TcRole::kGradKV, "the den and fused dk + dv sweeps are not paired");
  constexpr bool fwd = R == TcRole::kForward;
  constexpr int bit = fwd ? 8 : R == TcRole::kGradQ ? 16 : 32;
  const int64_t inner = (fwd || TcRoleInfo<R>::dv_like) ? p.head_dim_k : p.head_dim_v;
  if ((wgmma_mask() & bit) == 0 || inner != 128 || p.chunk_size != 0 || !wgmma_planned(p, !fwd)) return false;
  if ((wgmma_mask() & 64) != 0) return true;
  const bool one_wave = wg_blocks<R>(p) <= sm_count();
  if (fwd && p.normalize && p.dtype == DType::kBFloat16) return one_wave;
  return one_wave && wg_segments<R, 128>(p) == 1;
}

// Whether split wgmma sweeps take pass 1 from chunk_wg_state_kernel (default; kHasWgStatePass) or from
// their own kernel (ATTNRNN_WG_STATE_PASS=0, for measuring one against the other).
inline bool wg_state_pass_enabled() {
  static const bool enabled = [] {
    const char* env = std::getenv("ATTNRNN_WG_STATE_PASS");
    return env == nullptr || std::atoi(env) != 0;
  }();
  return enabled;
}

// dk and dv in one sweep at K = V = 128 without the normalizer (chunk_wg_dkv.cuh): q, k, v and dout
// read once for both (six tensors of traffic for eight). A block holds all of dS (two warpgroups,
// one block per SM), one per (sequence, kv head), so the sweep runs where those blocks fill at most
// half the SMs, split into segments by the tensor-core rule; pass 1 is dv's state pass, into dv's
// partial layout (two output tiles per block). At B1-T65536 and B2-T32768 (H16) that is dv's own
// split; where dv's 64-token blocks fill the GPU without one (B4-T8192-H16: 128 blocks), it replaces
// the paired dk and dv sweeps. Bit 6 of ATTNRNN_TC_WGMMA (every sweep paired) and
// ATTNRNN_BWD_FUSED_DKV128=0 run the two sweeps (for measuring).
inline int fused_dkv128_segments(const LinearAttnParams& p) {
  return tc_segments(p, num_states(p) * p.num_kv_heads, 1);
}
inline bool fused_dkv128(const LinearAttnParams& p) {
  static const bool enabled = [] {
    const char* env = std::getenv("ATTNRNN_BWD_FUSED_DKV128");
    return env == nullptr || std::atoi(env) != 0;
  }();
  return enabled && (wgmma_mask() & 64) == 0 && !p.normalize && p.head_dim_k == 128 && p.head_dim_v == 128 &&
         wgmma_planned(p, true) && wg_state_pass_enabled() && fused_dkv128_segments(p) > 1;
}
inline int64_t fused_dkv128_partial_floats(const LinearAttnParams& p) {
  if (!fused_dkv128(p)) return 0;
  return fused_dkv128_segments(p) * num_states(p) * p.num_kv_heads * 2 * WgLayout<128>::partial_floats;
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
  // the dv region also holds the fused dk + dv sweep's (dv's state pass on that sweep's split)
  const int64_t dv = std::max(sweep_partial_floats<TcRole::kGradV>(p, wg, K), fused_dkv128_partial_floats(p));
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
  if (p.feature_map == FeatureMap::kIdentity || p.phi_given || !tensor_core_sweep(p, backward) ||
      relu_in_sweep_planned(p, backward))
    return 0;
  const int64_t elem = 2;  // bf16/fp16: the tensor-core dtypes
  return round256(feature_elems(p, p.num_heads) * elem) + round256(feature_elems(p, p.num_kv_heads) * elem);
}
inline int64_t workspace_bytes_for(const LinearAttnParams& p, bool backward) {
  return token_scalar_bytes(p, backward) + round256(partial_bytes(p, backward)) + feature_bytes(p, backward);
}
inline float* partial_ptr(const LinearAttnParams& p, bool backward) {
  return reinterpret_cast<float*>(static_cast<char*>(p.workspace) + token_scalar_bytes(p, backward));
}

}  // namespace attnrnn::cuda
