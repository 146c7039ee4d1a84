// The host side of the linear-attention ops on CUDA: make_forward_plan and make_backward_plan
// (plan.h), the rules of tiles.h applied to one call, and the entry points (attnrnn.h's cuda::
// functions), which make the call's plan once, check the buffers it needs, place the saved w, clear
// the non-finite flags of a tensor-core plan (args.cuh), and run the plan through the launcher of its
// dtype (launchers.h).
#include <algorithm>

#include "attnrnn/testing.h"
#include "generic_backward.cuh"
#include "generic_forward.cuh"
#include "launchers.h"
#include "plan.h"
#include "tiles.h"

namespace attnrnn::cuda {

DeviceInfo current_device_info() {
  DeviceInfo d;
  d.sm_count = sm_count();
  d.max_smem = max_dynamic_smem();
  // wgmma needs both the build's sm_90a code (CMake defines ATTNRNN_WGMMA when the architectures
  // include 90a) and a compute capability 9.x device: every other build and device (sm_8x, Blackwell)
  // runs the mma.sync kernels, whose wgmma kernels are empty bodies there.
#if defined(ATTNRNN_WGMMA)
  d.wgmma = wgmma_device();
#endif
  return d;
}

namespace {

constexpr int64_t round256(int64_t bytes) { return (bytes + 255) / 256 * 256; }

bool aligned16(const ConstView& x) {
  return reinterpret_cast<uintptr_t>(x.data) % 16 == 0 && x.stride_b % 8 == 0 && x.stride_t % 8 == 0 &&
         x.stride_h % 8 == 0;
}
// Pairs of elements of `elem` bytes that start aligned to their size (one 4- or 8-byte store).
bool aligned_pairs(const void* data, int64_t stride_b, int64_t stride_t, int64_t stride_h, int64_t elem) {
  return reinterpret_cast<uintptr_t>(data) % (2 * elem) == 0 && stride_b % 2 == 0 && stride_t % 2 == 0 &&
         stride_h % 2 == 0;
}
bool aligned_pairs(const MutView& x, int64_t elem) {
  return aligned_pairs(x.data, x.stride_b, x.stride_t, x.stride_h, elem);
}
bool aligned_pairs(const ConstView& x, int64_t elem) {
  return aligned_pairs(x.data, x.stride_b, x.stride_t, x.stride_h, elem);
}
int64_t element_bytes(const LinearAttnFwdParams& p) { return p.dtype == DType::kFloat32 ? 4 : 2; }

bool dim_64_or_128(int64_t d) { return d == 64 || d == 128; }

// The head dims every tensor-core sweep takes as they are: K in {64, 128}; V % 64 == 0 in the
// forward, V in {64, 128} in the backward.
bool exact_dims(const LinearAttnFwdParams& p, bool backward) {
  return dim_64_or_128(p.head_dim_k) && (backward ? dim_64_or_128(p.head_dim_v) : p.head_dim_v % 64 == 0);
}
// ... and those the padded 64-token sweeps take, on wgmma or on mma.sync (tiles.h).
bool padded_dims(const LinearAttnFwdParams& p, bool backward, bool wgmma) {
  return cuda::padded_dims(p.head_dim_k, p.head_dim_v, backward, wgmma);
}

bool fp32(const LinearAttnFwdParams& p) { return p.dtype == DType::kFloat32; }

// The shapes the tensor-core sweeps take (bf16/fp16/fp32, 64-token chunks, exact dims everywhere;
// padded ones up to 256 where wgmma runs, which `wgmma` (Rules::wgmma_device) says, never for fp32,
// else up to 128 on the mma.sync sweeps; fp32 on the mma.sync sweeps: TF32 products where the call
// allows them, else 3xTF32, MmaStep<float> in common/mma.cuh), pointers aside: what the saved layout
// depends on.
bool tensor_core_shape(const LinearAttnFwdParams& p, bool recurrent, bool backward, bool wgmma) {
  const bool dtype = p.dtype == DType::kBFloat16 || p.dtype == DType::kFloat16 || fp32(p);
  const bool chunk = !recurrent && (p.chunk_size == 0 || p.chunk_size == kChunk);
  const bool dims = exact_dims(p, backward) || padded_dims(p, backward, wgmma);
  return dtype && chunk && dims;
}
// ... and their rows: 16-byte aligned inputs (cp.async), outputs in pairs aligned to their size.
bool tensor_core_rows(const LinearAttnFwdParams& p) {
  return aligned16(p.q) && aligned16(p.k) && aligned16(p.v) && aligned_pairs(p.o, element_bytes(p));
}
bool tensor_core_rows(const LinearAttnBwdParams& p) {
  const int64_t e = element_bytes(p);
  return aligned16(p.q) && aligned16(p.k) && aligned16(p.v) && aligned16(p.dout) && aligned_pairs(p.dq, e) &&
         aligned_pairs(p.dk, e) && aligned_pairs(p.dv, e) && (!p.normalize || aligned_pairs(p.out, e));
}

// The roles' output columns and the blocks of their sweeps, (sequence, output tile, kv head).
enum class Role { kForward, kGradQ, kGradK, kGradV };
int64_t output_dim(const LinearAttnFwdParams& p, Role r) {
  return r == Role::kGradQ || r == Role::kGradK ? p.head_dim_k : p.head_dim_v;
}
int64_t inner_dim(const LinearAttnFwdParams& p, Role r) {
  return r == Role::kForward || r == Role::kGradV ? p.head_dim_k : p.head_dim_v;
}

struct Rules {
  const LinearAttnFwdParams& p;
  const DeviceInfo& device;
  const testing::PlanOverride& forced;

  int64_t kv_blocks() const { return num_states(p) * p.num_kv_heads; }
  // a sweep's (sequence, output tile of `columns`, kv head) blocks, a partly written last tile included
  int64_t tiled_blocks(Role r, int64_t columns) const {
    return kv_blocks() * ((output_dim(p, r) + columns - 1) / columns);
  }
  int64_t tf32_blocks(Role r) const { return tiled_blocks(r, WgmmaTf32Block::columns); }
  int segments(int64_t blocks, int per_sm, bool sparse_slots = false) const {
    return split_segments(blocks, per_sm, p.seqlen, device.sm_count, forced.segments, sparse_slots);
  }
  // the device runs wgmma and the test override leaves it (the dims it takes: tensor_core_shape);
  // not for fp32, whose TF32 wgmma reads only K-major tiles, which scan_wgmma.cuh's products do not all
  // have: fp32 runs on mma.sync, or on its own wgmma sweep (tf32_wgmma)
  bool wgmma_device() const { return device.wgmma && !forced.mma_sync && !fp32(p); }
  // fp32 on scan_wgmma_tf32.cuh: the call allows TF32, no normalizer, and the role's inner dim fits
  bool tf32_wgmma(Role r) const {
    return fp32(p) && p.allow_tf32 && !p.normalize && device.wgmma && !forced.mma_sync &&
           inner_dim(p, r) <= WgmmaTf32Tiles<128>::inner;
  }
  bool wgmma(bool backward) const {
    return wgmma_device() && (exact_dims(p, backward) || padded_dims(p, backward, true));
  }
  // a sweep of role r pads its tiles: its inner dim is not 64 or 128, or its output dim not a multiple of 64
  bool padded(Role r) const { return !dim_64_or_128(inner_dim(p, r)) || output_dim(p, r) % 64 != 0; }
  int padded_inner(Role r) const { return padded_inner_dim(inner_dim(p, r)); }
  // the 64-token wgmma tiles of (padded) inner dim `inner` (tiles.h): blocks per SM, partial floats
  struct WgmmaTile {
    int per_sm;
    int64_t partial_floats;
  };
  template <int DI>
  static WgmmaTile wgmma_tile_of() {
    return WgmmaTile{WgmmaTiles<DI>::blocks_per_sm, WgmmaTiles<DI>::partial_floats};
  }
  static WgmmaTile wgmma_tile(int inner) {
    switch (inner) {
      case 64: return wgmma_tile_of<64>();
      case 128: return wgmma_tile_of<128>();
      case 192: return wgmma_tile_of<192>();
      default: return wgmma_tile_of<256>();
    }
  }
  int64_t wgmma_blocks(Role r) const { return tiled_blocks(r, WgmmaTiles<64>::columns); }
  int wgmma_segments(Role r) const {
    const int per_sm = wgmma_tile(padded_inner(r)).per_sm;
    // split_segments' sparse_slots: three blocks per SM, and tiles that are at least half padding
    return segments(wgmma_blocks(r), per_sm, per_sm >= 3 && inner_dim(p, r) <= 32);
  }
  int pair_segments(Role r) const { return segments(wgmma_blocks(r), WgmmaPairTiles::blocks_per_sm); }
  bool pairs(Role r) const {
    const bool forward = r == Role::kForward;
    if (inner_dim(p, r) != 128 || padded(r) || p.chunk_size != 0 || !wgmma(!forward)) return false;
    if (forced.pairing != testing::Pairing::kAuto) return forced.pairing == testing::Pairing::kAlways;
    return pairs_sweep(forward, p.normalize, p.dtype == DType::kBFloat16, wgmma_blocks(r), wgmma_segments(r),
                       device.sm_count);
  }
  // the mma.sync tiles of inner dim `inner` (tiles.h): columns per block, blocks per SM, partial floats
  struct MmaTile {
    int64_t columns, per_sm, partial_floats;
  };
  template <int DI>
  static MmaTile mma_tile_of(bool fp32_operands) {
    return fp32_operands ? MmaTile{MmaTiles<DI, true>::columns, MmaTiles<DI, true>::blocks_per_sm,
                                   MmaTiles<DI, true>::partial_floats}
                         : MmaTile{MmaTiles<DI>::columns, MmaTiles<DI>::blocks_per_sm, MmaTiles<DI>::partial_floats};
  }
  MmaTile mma_tile(int64_t inner) const { return inner == 64 ? mma_tile_of<64>(fp32(p)) : mma_tile_of<128>(fp32(p)); }
  // an mma.sync sweep's blocks (partly written output tiles included); its inner dim DI is
  // padded_inner (the exact 64 and 128 map to themselves)
  int64_t mma_blocks(Role r) const { return tiled_blocks(r, mma_tile(padded_inner(r)).columns); }
  int mma_segments(Role r) const {
    // fp32: split_segments' sparse_slots (tiles.h, split_segments)
    return segments(mma_blocks(r), static_cast<int>(mma_tile(padded_inner(r)).per_sm), fp32(p));
  }

  // A sweep of role r on the kernel the rules give it; first_pass and partials are filled by the caller.
  Sweep sweep(Role r, bool on_wgmma) const {
    Sweep s;
    s.inner = static_cast<int>(inner_dim(p, r));
    if (tf32_wgmma(r)) {
      s.kernel = SweepKernel::kWgmmaTf32;
      s.inner = tf32_inner_dim(inner_dim(p, r));
      s.padded = inner_dim(p, r) != s.inner || output_dim(p, r) % WgmmaTf32Block::columns != 0;
      s.segments = segments(tf32_blocks(r), WgmmaTf32Block::blocks_per_sm);
    } else if (on_wgmma && padded(r)) {  // the 64-token sweep, its tiles padded
      s.kernel = SweepKernel::kWgmma;
      s.inner = padded_inner(r);
      s.padded = true;
      s.segments = wgmma_segments(r);
    } else if (!on_wgmma) {
      s.kernel = SweepKernel::kMma;
      s.inner = padded_inner(r);
      s.padded = padded(r);
      s.segments = mma_segments(r);
    } else if (pairs(r)) {
      s.kernel = SweepKernel::kWgmmaPair;
      s.segments = pair_segments(r);
    } else {
      s.kernel = SweepKernel::kWgmma;
      s.segments = wgmma_segments(r);
    }
    return s;
  }
  // Floats of a sweep's pass-1 partials.
  int64_t partial_floats(Role r, const Sweep& s) const {
    if (s.segments <= 1) return 0;
    if (s.kernel == SweepKernel::kMma) return s.segments * mma_blocks(r) * mma_tile(s.inner).partial_floats;
    if (s.kernel == SweepKernel::kWgmmaTf32)
      return s.segments * tf32_blocks(r) *
             (s.inner == 64 ? WgmmaTf32Tiles<64>::partial_floats : WgmmaTf32Tiles<128>::partial_floats);
    return s.segments * wgmma_blocks(r) * wgmma_tile(s.inner).partial_floats;
  }

  // Where the forward keeps its segment states for the backward's dq sweep: without the normalizer,
  // dq's segment sums S^T = sum_t v_t^T phi(k_t) [V][K] are the transposes of the forward's
  // S = sum_t phi(k_t)^T v_t [K][V] over the same tokens. At K = V = 128, where both run the
  // 64-token wgmma sweep split into the same segments, the forward's state pass writes them
  // transposed in dq's layout, and dq runs no pass 1 (~130 us at B1-T65536-H16-D128: k and v read
  // once less). Floats, 0 where not kept. Shapes, options and device only (not the pointers).
  int64_t forward_states_for_dq(bool recurrent) const {
    if (p.normalize || p.head_dim_k != 128 || p.head_dim_v != 128 ||
        !tensor_core_shape(p, recurrent, true, wgmma_device()) ||
        !wgmma(false) || pairs(Role::kForward) || pairs(Role::kGradQ))
      return 0;
    const int forward = wgmma_segments(Role::kForward), dq = wgmma_segments(Role::kGradQ);
    return forward > 1 && forward == dq ? forward * wgmma_blocks(Role::kGradQ) * WgmmaTiles<128>::partial_floats : 0;
  }

  // The saved buffer's layout: the same for the forward and its backward.
  void saved_layout(ChunkPlan& plan, bool recurrent) const {
    int64_t at = 0;
    if (p.normalize && tensor_core_shape(p, recurrent, true, wgmma_device())) {
      plan.saved_den = at;
      at += round256(p.batch * p.seqlen * p.num_heads * int64_t(sizeof(float)));
    }
    if (const int64_t floats = forward_states_for_dq(recurrent)) {
      plan.saved_states = at;
      at += round256(floats * int64_t(sizeof(float)));
    }
    plan.saved_bytes = at;
  }

  // phi(q), phi(k) of the feature pass at the workspace's end, from `at`.
  void feature_rows(ChunkPlan& plan, int64_t at) const {
    const int64_t elem = element_bytes(p);
    const int64_t rows = p.batch * p.seqlen * p.head_dim_k;
    plan.phi_q = at;
    plan.phi_k = at + round256(rows * p.num_heads * elem);
    plan.workspace_bytes = plan.phi_k + round256(rows * p.num_kv_heads * elem);
  }
};

// The generic kernels' chunk: the largest power of two <= the requested chunk and
// <= GenericTiles::default_chunk for which fits(C) holds. The recurrent form asks for
// GenericTiles::recurrent_chunk, or the sequence where it is shorter (the kernels' loops run over whole
// chunks): they compute in fp32 (fp64) throughout whatever the chunk.
template <class Fits>
int generic_chunk(const LinearAttnFwdParams& p, bool recurrent, Fits fits) {
  const int64_t requested = recurrent              ? std::min<int64_t>(GenericTiles::recurrent_chunk, p.seqlen)
                            : p.chunk_size > 0     ? p.chunk_size
                                                   : GenericTiles::default_chunk;
  int C = 1;
  while (C * 2 <= requested && C * 2 <= GenericTiles::default_chunk) C *= 2;
  while (C > 1 && !fits(C)) C /= 2;
  return C;
}

int forward_generic_chunk(const LinearAttnFwdParams& p, bool recurrent, const DeviceInfo& device) {
  const int64_t K = p.head_dim_k, BV = std::min<int64_t>(GenericTiles::value_columns, p.head_dim_v);
  const int64_t acc = p.dtype == DType::kFloat64 ? 8 : 4;
  return generic_chunk(p, recurrent, [&](int64_t c) { return fwd_smem(K, c, BV).total() * acc <= device.max_smem; });
}

int backward_generic_chunk(const LinearAttnFwdParams& p, bool recurrent, const DeviceInfo& device) {
  const int64_t K = p.head_dim_k, V = p.head_dim_v, acc = p.dtype == DType::kFloat64 ? 8 : 4;
  const int64_t BK = std::min<int64_t>(GenericTiles::key_rows, K), BV = std::min<int64_t>(GenericTiles::value_columns, V);
  return generic_chunk(p, recurrent, [&](int64_t c) {
    return dq_smem(K, V, c, BK) * acc <= device.max_smem && dk_smem(V, c, BK) * acc <= device.max_smem &&
           dv_smem(K, c, BV) * acc <= device.max_smem;
  });
}

// A tensor-core plan's flags of the (sequence, kv head)s whose rows were not finite, at the
// workspace's end.
void place_nonfinite_flags(const LinearAttnFwdParams& p, ChunkPlan& plan) {
  plan.nonfinite_flags = plan.workspace_bytes;
  plan.workspace_bytes += round256(num_states(p) * p.num_kv_heads * int64_t(sizeof(unsigned)));
}

Features features_of(const LinearAttnFwdParams& p, bool relu_in_sweep) {
  if (p.feature_map == FeatureMap::kIdentity) return Features::kNone;
  return p.feature_map == FeatureMap::kRelu && relu_in_sweep ? Features::kInSweep : Features::kPass;
}

}  // namespace

ChunkPlan make_forward_plan(const LinearAttnFwdParams& p, bool recurrent, const DeviceInfo& device,
                            const testing::PlanOverride& forced) {
  const Rules rules{p, device, forced};
  ChunkPlan plan;
  rules.saved_layout(plan, recurrent);
  plan.tensor_cores = tensor_core_shape(p, recurrent, false, rules.wgmma_device()) && tensor_core_rows(p);
  plan.generic_chunk = forward_generic_chunk(p, recurrent, device);
  if (!plan.tensor_cores) return plan;
  const bool wgmma = rules.wgmma(false);
  plan.features = features_of(p, wgmma);
  plan.forward = rules.sweep(Role::kForward, wgmma);
  Sweep& f = plan.forward;
  if (f.segments > 1) {
    f.partials = Region{0, false};
    f.first_pass = wgmma ? FirstPass::kStateKernel : FirstPass::kOwnKernel;
    if (plan.saved_states >= 0 && p.saved != nullptr && f.kernel == SweepKernel::kWgmma) {
      f.transposed_partials = Region{plan.saved_states, true};
    }
  }
  const int64_t partials = round256(rules.partial_floats(Role::kForward, f) * int64_t(sizeof(float)));
  plan.workspace_bytes = partials;
  if (plan.features == Features::kPass) rules.feature_rows(plan, partials);
  place_nonfinite_flags(p, plan);
  return plan;
}

ChunkPlan make_backward_plan(const LinearAttnBwdParams& p, bool recurrent, const DeviceInfo& device,
                             const testing::PlanOverride& forced) {
  const Rules rules{p, device, forced};
  ChunkPlan plan;
  rules.saved_layout(plan, recurrent);
  const int64_t acc = p.dtype == DType::kFloat64 ? 8 : 4;
  const int64_t token_scalars = round256(2 * p.batch * p.seqlen * p.num_heads * acc);  // w, dd (or den, dd)
  plan.workspace_bytes = token_scalars;
  plan.tensor_cores = tensor_core_shape(p, recurrent, true, rules.wgmma_device()) && tensor_core_rows(p);
  plan.generic_chunk = backward_generic_chunk(p, recurrent, device);
  if (!plan.tensor_cores) return plan;
  const bool wgmma = rules.wgmma(true);
  const int64_t K = p.head_dim_k, V = p.head_dim_v;
  plan.out_rows_aligned16 = aligned16(p.out);
  // relu in the sweeps, but for the fused dk + dv sweep at K = V = 64 with the normalizer: there it
  // made ptxas load a spilled register in every step.
  plan.features = features_of(p, wgmma && !(p.normalize && K == 64 && V == 64));

  // dk and dv: one sweep, dv's pass 1 for both, or two sweeps.
  GradKv grad_kv = GradKv::kSeparate;
  const int fused128_segments = rules.segments(rules.kv_blocks(), WgmmaGradKvTiles::blocks_per_sm);
  if (wgmma && !forced.separate_grad_kv && K == 64 && V == 64) {
    grad_kv = GradKv::kFused64;
  } else if (wgmma && !forced.separate_grad_kv && forced.pairing != testing::Pairing::kAlways && !p.normalize &&
             K == 128 && V == 128 && fuses_grad_kv_128(fused128_segments)) {
    grad_kv = GradKv::kFused128;
  }
  plan.dq = rules.sweep(Role::kGradQ, wgmma);
  plan.dk = rules.sweep(Role::kGradK, wgmma);
  plan.dv = rules.sweep(Role::kGradV, wgmma);
  if (grad_kv == GradKv::kFused64) {
    plan.dk.segments = rules.segments(rules.wgmma_blocks(Role::kGradK), WgmmaTiles<64, true>::blocks_per_sm);
  } else if (grad_kv == GradKv::kFused128) {
    plan.dv.segments = fused128_segments;
  } else if (wgmma && !p.normalize && K == 128 && V == 128 && plan.dk.kernel == plan.dv.kernel &&
             plan.dk.segments > 1 && plan.dk.segments == plan.dv.segments) {
    // dk's and dv's states are transposes of each other without the normalizer: dv's pass 1 writes both
    // (~130 us at B1-T65536-H16-D128: q and dout read once)
    grad_kv = GradKv::kSharedFirstPass;
  }
  plan.grad_kv = grad_kv;

  // Pass 1 of each sweep, and the workspace's partials: [dq][dk][dv], each 256-byte aligned.
  const FirstPass split_pass = wgmma ? FirstPass::kStateKernel : FirstPass::kOwnKernel;
  int64_t at = token_scalars;
  auto place = [&](Sweep& s, int64_t floats) {
    if (s.segments <= 1) return;
    s.first_pass = split_pass;
    s.partials = Region{at, false};
    at += round256(floats * int64_t(sizeof(float)));
  };
  // What the forward wrote into saved: its plan, made from its own params (out is its o).
  LinearAttnFwdParams forward_params = p;
  forward_params.o = MutView{const_cast<void*>(p.out.data), p.out.stride_b, p.out.stride_t, p.out.stride_h};
  const ChunkPlan forward = make_forward_plan(forward_params, recurrent, device, forced);
  if (forward.forward.transposed_partials.offset >= 0 && plan.dq.kernel == SweepKernel::kWgmma &&
      plan.dq.segments == forward.forward.segments) {
    plan.dq.first_pass = FirstPass::kDone;  // the forward's segment states
    plan.dq.partials = forward.forward.transposed_partials;
  } else {
    place(plan.dq, rules.partial_floats(Role::kGradQ, plan.dq));
  }
  switch (grad_kv) {
    case GradKv::kFused64:
      // its pass 1 on segment_state_kernel without the normalizer; with it the state kernel would have
      // to weigh its Q tile by dd for dz, so the sweep's own kernel sums
      place(plan.dk, rules.partial_floats(Role::kGradK, plan.dk));
      if (plan.dk.segments > 1 && p.normalize) plan.dk.first_pass = FirstPass::kOwnKernel;
      break;
    case GradKv::kFused128:
      // dv's state pass into dv's layout: two output tiles per (sequence, kv head)
      place(plan.dv, plan.dv.segments * rules.wgmma_blocks(Role::kGradV) * WgmmaTiles<128>::partial_floats);
      break;
    case GradKv::kSharedFirstPass:
      place(plan.dk, rules.partial_floats(Role::kGradK, plan.dk));
      place(plan.dv, rules.partial_floats(Role::kGradV, plan.dv));
      plan.dv.transposed_partials = plan.dk.partials;
      plan.dk.first_pass = FirstPass::kDone;
      break;
    case GradKv::kSeparate:
      place(plan.dk, rules.partial_floats(Role::kGradK, plan.dk));
      place(plan.dv, rules.partial_floats(Role::kGradV, plan.dv));
      break;
  }
  plan.workspace_bytes = at;
  if (plan.features == Features::kPass) rules.feature_rows(plan, at);
  place_nonfinite_flags(p, plan);
  return plan;
}

// ---- entry points -------------------------------------------------------------------------------

namespace {

ChunkPlan forward_plan(const LinearAttnFwdParams& p, bool recurrent) {
  return make_forward_plan(p, recurrent, current_device_info(), testing::plan_override());
}
ChunkPlan backward_plan(const LinearAttnBwdParams& p, bool recurrent) {
  return make_backward_plan(p, recurrent, current_device_info(), testing::plan_override());
}

Status check_workspace(const LinearAttnFwdParams& p, const ChunkPlan& plan, const char* query) {
  if (plan.workspace_bytes > 0 && p.workspace == nullptr)
    return fail(Status::kInvalidArgument, "workspace must hold %s() = %lld bytes", query,
                (long long)plan.workspace_bytes);
  return Status::kSuccess;
}

float* saved_float(const LinearAttnFwdParams& p, int64_t offset) {
  return p.saved == nullptr || offset < 0 ? nullptr : reinterpret_cast<float*>(static_cast<char*>(p.saved) + offset);
}

// The flags of the (sequence, kv head)s whose rows the tensor-core kernels found not finite, cleared
// on the call's stream (args.cuh).
Status clear_nonfinite_flags(const ChunkPlan& plan, ChunkArgs& args, const char* op) {
  if (plan.nonfinite_flags < 0) return Status::kSuccess;
  args.nonfinite = reinterpret_cast<unsigned*>(static_cast<char*>(args.workspace) + plan.nonfinite_flags);
  const size_t bytes = static_cast<size_t>(num_states(args) * args.num_kv_heads) * sizeof(unsigned);
  cudaMemsetAsync(args.nonfinite, 0, bytes, static_cast<cudaStream_t>(args.stream));
  return check_launch(op);
}

Status forward(const LinearAttnFwdParams& p, bool recurrent) {
  const ChunkPlan plan = forward_plan(p, recurrent);
  Status s = check_workspace(p, plan, "chunk_linear_attn_fwd_workspace_bytes");
  if (s != Status::kSuccess) return s;
  ChunkArgs args;
  static_cast<LinearAttnFwdParams&>(args) = p;
  args.den_out = saved_float(p, plan.saved_den);
  s = clear_nonfinite_flags(plan, args, "chunk_linear_attn forward");
  if (s != Status::kSuccess) return s;
  return dispatch_dtype(p.dtype, [&](auto t) { return launch_chunk_fwd<decltype(t)>(plan, args); });
}

Status backward(const LinearAttnBwdParams& p, bool recurrent) {
  const ChunkPlan plan = backward_plan(p, recurrent);
  Status s = check_workspace(p, plan, recurrent ? "recurrent_linear_attn_bwd_workspace_bytes"
                                                : "chunk_linear_attn_bwd_workspace_bytes");
  if (s != Status::kSuccess) return s;
  if (plan.saved_bytes > 0 && p.saved == nullptr)
    return fail(Status::kInvalidArgument,
                "saved must be the forward's saved buffer (chunk_linear_attn_saved_bytes() = %lld bytes)",
                (long long)plan.saved_bytes);
  ChunkArgs args;
  static_cast<LinearAttnBwdParams&>(args) = p;
  args.den_in = saved_float(p, plan.saved_den);
  s = clear_nonfinite_flags(plan, args, "chunk_linear_attn backward");
  if (s != Status::kSuccess) return s;
  return dispatch_dtype(p.dtype, [&](auto t) { return launch_chunk_bwd<decltype(t)>(plan, args); });
}

}  // namespace

Status chunk_fwd(const LinearAttnFwdParams& p) { return forward(p, false); }
Status recurrent_fwd(const LinearAttnFwdParams& p) { return forward(p, true); }
Status chunk_bwd(const LinearAttnBwdParams& p) { return backward(p, false); }
Status recurrent_bwd(const LinearAttnBwdParams& p) { return backward(p, true); }

int64_t chunk_saved_bytes(const LinearAttnFwdParams& p) { return forward_plan(p, false).saved_bytes; }
int64_t chunk_fwd_workspace_bytes(const LinearAttnFwdParams& p) { return forward_plan(p, false).workspace_bytes; }
int64_t chunk_bwd_workspace_bytes(const LinearAttnBwdParams& p) { return backward_plan(p, false).workspace_bytes; }
int64_t recurrent_bwd_workspace_bytes(const LinearAttnBwdParams& p) { return backward_plan(p, true).workspace_bytes; }

Status step(const LinearAttnStepParams& p) {
  return dispatch_dtype(p.dtype, [&](auto t) { return launch_step<decltype(t)>(p); });
}

}  // namespace attnrnn::cuda
