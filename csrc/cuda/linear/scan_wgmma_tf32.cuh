// Chunkwise causal linear attention with fp32 operands on TF32 warpgroup MMA (sm_90a), without the
// normalizer: the forward and the dq, dk, dv sweeps of scan_roles.cuh where the call allows TF32
// (PyTorch's "high" or "medium" float32 matmul precision) and the role's inner dim is at most 128
// (DI = 64 or 128, padded).
// One warpgroup (128 threads) per (sequence [x segment], 32 output columns, kv head); a step is one
// (chunk of 64 tokens, query head) pair, in sweep order, as in scan_wgmma.cuh. TF32 wgmma reads both
// shared operands K-major only, so every product is laid out with its inner index along the rows:
//   P = mask(A B^T)     A, B [64 tokens][DI dims]                        shared x shared
//   O = A S             B = S^T [32 columns][DI dims], published rounded   shared x shared
//   O += P Cv           P as register A, B = Cv^T [32 columns][64 tokens]  registers x shared
//   S += B^T Cv         B^T as register A, gathered from the B tile        registers x shared
//                       (per 64-dim block of S)
// The register operands hold the tokens of each 8-token group in the order (0, 2, 4, 6, 1, 3, 5, 7):
// the order in which P's accumulator holds them, so that P feeds its product as it is; Cv^T is
// written in that order, and the gather from B takes it too.
// Each thread rounds the tile pieces it copied to TF32 (cvt.rna) once they land, and writes its pieces
// of Cv, rounded, into Cv^T: both before the step's barrier, which then publishes them to the
// products. Without the normalizer w_t = s (the scale) for every token: the forward's and dq's rows
// take s in the epilogue (their initial state's term has it too: o = s phi(q) S); dk and dv take it
// in their dout tile (B and Cv, before the rounding), since the final state's gradient they start
// from has none (tiles.h, WgmmaTf32Tiles, for the sizes and their reason).
#pragma once

#include "scan_roles.cuh"
#include "wgmma_tiles.cuh"
#include "../common/mma.cuh"
#include "../common/wgmma.cuh"

namespace attnrnn::cuda {

// Byte offset of element (r, c) of a K-major fp32 atom of 32 columns (128-byte rows, 128-byte swizzle).
__host__ __device__ __forceinline__ int tf32_swizzled(int r, int c) {
  return r * 128 + (((c >> 2) ^ (r & 7)) << 4) + (c & 3) * 4;
}

// A K-major fp32 atom of a chunk's rows: [64 tokens][32 floats], 8 KiB.
constexpr int kTf32Atom = kChunk * 128;

// A block's shared memory at inner dim DI (byte offsets): the stages, then Cv^T and S^T.
template <int DI>
struct WgmmaTf32Layout {
  using Tiles = WgmmaTf32Tiles<DI>;
  static constexpr int NC = Tiles::columns, NS = Tiles::stages, KT = DI / 64;
  static constexpr int atom = kTf32Atom;         // [64 tokens][32 floats]: 8 KiB
  static constexpr int tile = (DI / 32) * atom;  // A or B: [64 tokens][DI dims], 16 or 32 KiB
  static constexpr int cv = kChunk * NC * 4;     // Cv as it lands: [64 tokens][32 columns], row-major, 8 KiB
  static constexpr int stage = 2 * tile + cv;    // 40 or 72 KiB
  static constexpr int column_atom = NC * 128;   // [32 columns][32 floats]: 4 KiB
  static constexpr int cvt = NS * stage;         // Cv^T [32 columns][64 token positions]: 8 KiB
  static constexpr int st = cvt + 2 * column_atom;  // S^T [32 columns][DI dims]: 8 or 16 KiB
  static constexpr int64_t smem_bytes = st + (DI / 32) * column_atom;  // 96 KiB (DI = 64: 2 stages, 128: 1)
  static constexpr int64_t partial_floats = Tiles::partial_floats;  // S [DI][32]
  static_assert(Tiles::blocks_per_sm * (smem_bytes + 1024) <= 228 * 1024, "blocks_per_sm blocks must fit on an SM");
};

// The position of token t of a chunk in the register operands' order (its 8-token group's
// (0, 2, 4, 6, 1, 3, 5, 7)).
__device__ __forceinline__ int tf32_position(int t) { return (t & ~7) | ((t & 1) << 2) | ((t & 7) >> 1); }

// A tile source: row 0 of one sequence at token 0, head 0, from column col0, and the strides.
struct Tf32Source {
  const float* base;
  int64_t stride_t, stride_h;
  int cols;  // real columns from col0 on
};

// `width` (128, 64 or 32) columns of a chunk's rows (from token t0, cl of them valid) of `head`: tid copies
// 16-byte pieces tid + 128 j, row piece / (width / 4); rows past the chunk's end and columns past
// src.cols (kPadded) arrive as zeros. K-major atoms (A, B) or row-major rows (Cv).
template <int kWidth, bool kPadded, bool kKMajor>
__device__ __forceinline__ void tf32_load(unsigned char* dst, const Tf32Source& src, int64_t head, int64_t t0, int cl,
                                          int tid) {
  constexpr int per_row = kWidth / 4, rows_apart = kScanThreads / per_row;
  const int r0 = tid / per_row, c = (tid % per_row) * 4;
  const float* chunk = src.base + t0 * src.stride_t + head * src.stride_h + c;
  const bool real = !kPadded || c < src.cols;
#pragma unroll
  for (int j = 0; j < kChunk / rows_apart; ++j) {
    const int r = r0 + rows_apart * j;
    const bool valid = r < cl && real;
    const int at = kKMajor ? (c / 32) * kTf32Atom + tf32_swizzled(r, c % 32) : (r * kWidth + c) * 4;
    cp_async16(dst + at, valid ? chunk + r * src.stride_t : src.base, valid);
  }
}

// This thread's pieces of a K-major swizzled tile of DI columns (tf32_load's), times w and rounded to
// TF32 in place (scan_mma_steps.cuh's tf32_round_own_pieces rounds the mma.sync sweeps' row-major
// tiles).
template <int DI, bool kScaled = false>
__device__ __forceinline__ void tf32_round_own_swizzled_pieces(unsigned char* tile, int tid, float w = 1.f) {
  constexpr int per_row = DI / 4, rows_apart = kScanThreads / per_row;
  const int r0 = tid / per_row, c = (tid % per_row) * 4;
#pragma unroll
  for (int j = 0; j < kChunk / rows_apart; ++j) {
    float4* x = reinterpret_cast<float4*>(tile + (c / 32) * kTf32Atom + tf32_swizzled(r0 + rows_apart * j, c % 32));
    float4 v = *x;
    if constexpr (kScaled) v = make_float4(w * v.x, w * v.y, w * v.z, w * v.w);
    *x = tf32_rounded(v);
  }
}

// This thread's pieces of the landed Cv rows, times w and rounded, into Cv^T at their tokens' positions.
template <bool kScaled = false>
__device__ __forceinline__ void tf32_transpose_own_pieces(const unsigned char* cv, unsigned char* cvt, int tid,
                                                          float w = 1.f) {
  constexpr int NC = WgmmaTf32Block::columns;
  const int r0 = tid / (NC / 4), c = (tid % (NC / 4)) * 4;
#pragma unroll
  for (int j = 0; j < kChunk / (kScanThreads / (NC / 4)); ++j) {
    const int r = r0 + (kScanThreads / (NC / 4)) * j, pos = tf32_position(r);
    const float4 v = *reinterpret_cast<const float4*>(cv + (r * NC + c) * 4);
    unsigned char* to = cvt + (pos / 32) * (NC * 128);
    float x[4] = {v.x, v.y, v.z, v.w};
    if constexpr (kScaled)
#pragma unroll
      for (int e = 0; e < 4; ++e) x[e] *= w;
#pragma unroll
    for (int e = 0; e < 4; ++e) *reinterpret_cast<uint32_t*>(to + tf32_swizzled(c + e, pos % 32)) = to_tf32(x[e]);
  }
}

// k8 slice j of a K-major operand of two atoms of `atom` bytes (dims or tokens [0, 32) and [32, 64)).
__device__ __forceinline__ uint64_t tf32_slice(const unsigned char* base, int atom, int j) {
  return wg_descriptor(base, (j / 4) * atom + 32 * (j % 4));
}

template <ScanRole R, int DI, bool kPadded = false>
__global__ void __launch_bounds__(kScanThreads, WgmmaTf32Tiles<DI>::blocks_per_sm)
    wgmma_tf32_scan_kernel(const ChunkArgs p, const SegmentSplit split, const ScanFeatures feat) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  static_assert(R != ScanRole::kGradKV, "dk and dv run as two sweeps");
  using Info = RoleInfo<R>;
  using L = WgmmaTf32Layout<DI>;
  constexpr bool kFwd = R == ScanRole::kForward, kDk = R == ScanRole::kGradK;
  constexpr int NC = L::NC, NS = L::NS, KT = L::KT;
  extern __shared__ __align__(1024) unsigned char smem[];
  if (smem_addr(smem) % 1024 != 0) __trap();  // the swizzle and the descriptors assume it
  unsigned char* Cvt = smem + L::cvt;
  unsigned char* St = smem + L::st;

  const int64_t Hkv = p.num_kv_heads, G = p.num_heads / p.num_kv_heads, K = p.head_dim_k, V = p.head_dim_v;
  const int64_t out_cols = sweep_output_dim<R>(p), inner = sweep_inner_dim<R>(p);  // inner: DI where not kPadded
  const int tiles = sweep_tiles<kPadded>(out_cols, NC);
  const SweepBlock block = sweep_block(tiles, split.segments);
  const int tile = block.tile, seg = block.seg;
  const int64_t n = block.n, g = block.g;
  const int c0 = tile * NC, tid = threadIdx.x;
  const Seq seq = sequence(p, n);
  const float scale = static_cast<float>(p.scale);
  const int64_t state_row = n * Hkv + g;
  auto mat_index = [&](int d, int c) {
    return Info::transposed ? (state_row * K + c0 + c) * V + d : (state_row * K + d) * V + c0 + c;
  };
  auto partial_at = [&](int j) { return split.partial_at(j, n, g, Hkv, tiles, tile, L::partial_floats); };

  // ---- the state S [DI dims][32 columns] in fp32 registers (KT accumulators of 64 dims), and S^T
  // rounded for A S
  float S[KT][NC / 2];
  auto for_each_state = [&](auto&& f) {
#pragma unroll
    for (int h = 0; h < KT; ++h)
#pragma unroll
      for (int i = 0; i < NC / 2; ++i) f(S[h][i], 64 * h + wg_acc_row(tid, i), wg_acc_col(tid, i));
  };
  auto hold_state = [&]() {
#pragma unroll
    for (int h = 0; h < KT; ++h) wg_hold(S[h]);
  };
  auto for_each_real_state = [&](auto&& f) {
    for_each_state([&](float& x, int d, int c) {
      if (!kPadded || (d < inner && c0 + c < out_cols)) f(x, d, c);
    });
  };
  const int earlier = split.state_only ? 0 : seg;
  {
    const float* S0 = static_cast<const float*>(Info::reverse ? p.d_final_S : p.initial_S);
    if constexpr (kPadded) for_each_state([](float& x, int, int) { x = 0.f; });
    load_initial_state(for_each_real_state, split.state_only ? nullptr : S0, mat_index, partial_at, earlier, NC);
  }
  auto publish_state = [&]() {
    for_each_state([&](float& x, int d, int c) {
      *reinterpret_cast<uint32_t*>(St + (d / 32) * L::column_atom + tf32_swizzled(c, d % 32)) = to_tf32(x);
    });
    wg_fence_shared();
  };
  if (!split.state_only) publish_state();

  // ---- the steps: (chunk, query head) pairs of this segment, in sweep order --------------------------
  const WgSteps walk(seq, g, G, kChunk, split, seg);
  const int steps = walk.count();
  auto source = [&](Operand o, int col0) {
    const ConstView v = tc_view(p, feat, o);
    return Tf32Source{static_cast<const float*>(v.data) + seq.b * v.stride_b + col0, v.stride_t, v.stride_h,
                      operand_dim(o, K, V) - col0};
  };
  const Tf32Source a_src = source(Info::a, 0), b_src = source(Info::b, 0), c_src = source(Info::c, c0);
  auto head_of = [&](Operand src, const WgStep& s) { return per_query_head(src) ? s.h : g; };
  auto stage = [&](int i) { return smem + (i % NS) * L::stage; };
  WgSteps::Walk issued = walk.start();
  auto issue = [&](int i) {
    const WgStep s = walk.at<Info::reverse>(issued);
    walk.advance(issued);
    unsigned char* st = stage(i);
    if (!split.state_only) tf32_load<DI, kPadded, true>(st, a_src, head_of(Info::a, s), s.t0, s.cl, tid);
    tf32_load<DI, kPadded, true>(st + L::tile, b_src, head_of(Info::b, s), s.t0, s.cl, tid);
    tf32_load<NC, kPadded, false>(st + 2 * L::tile, c_src, head_of(Info::c, s), s.t0, s.cl, tid);
  };
  for (int i = 0; i < NS - 1; ++i) {
    if (i < steps) issue(i);
    cp_async_commit();
  }

  const int r0 = wg_acc_row(tid, 0), quad = tid % 4;
  WgSteps::Walk current = walk.start();
  bool nonfinite = false;
  float O[NC / 2];  // the step's output; dk and dv keep summing it over a group's heads
  for (int i = 0; i < steps; ++i) {
    const WgStep s = walk.at<Info::reverse>(current);
    walk.advance(current);
    if constexpr (NS == 1) {  // one stage: the last step's products are done with it (its last barrier)
      issue(i);
      cp_async_commit();
    }
    cp_async_wait<NS == 1 ? 0 : NS - 2>();  // this step's pieces, as this thread copied them
    unsigned char* At = stage(i);
    unsigned char* Bt = At + L::tile;
    if (!split.state_only) tf32_round_own_swizzled_pieces<DI>(At, tid);
    tf32_round_own_swizzled_pieces<DI, kDk>(Bt, tid, scale);  // dk's B is dout: times s
    // dv's Cv is dout: times s; Cv^T is free, the last step ended in a barrier
    tf32_transpose_own_pieces<Info::dv_like>(Bt + L::tile, Cvt, tid, scale);
    wg_fence_shared();
    __syncthreads();  // every piece of the step's operands is in place; the last step's stage is free
    if constexpr (NS > 1) {
      if (i + NS - 1 < steps) issue(i + NS - 1);
      cp_async_commit();
    }

    const bool update = Info::group_sum || s.last;  // S moves after this step
    // B^T as register A of S += B^T Cv, one 64-dim block h at a time (at DI = 128 both blocks' 64
    // registers at once spilled ~250 bytes): dims 64 h + r0 (+ 8), tokens in operand order
    uint32_t ka[8][4];
    auto gather_b = [&](int h) {
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int t = 8 * j + 2 * quad, d = 64 * h + r0;
        auto at = [&](int token, int dim) {
          return *reinterpret_cast<const uint32_t*>(Bt + (dim / 32) * L::atom + tf32_swizzled(token, dim % 32));
        };
        ka[j][0] = at(t, d);
        ka[j][1] = at(t, d + 8);
        ka[j][2] = at(t + 1, d);
        ka[j][3] = at(t + 1, d + 8);
      }
    };
    auto update_state = [&](int h) {
#pragma unroll
      for (int j = 0; j < 8; ++j) wg_tf32_rs32(S[h], ka[j], tf32_slice(Cvt, L::column_atom, j));
    };
    // S += B^T Cv for the blocks h >= h0, each in its own group
    auto update_state_from = [&](int h0) {
#pragma unroll
      for (int h = h0; h < KT; ++h) {
        gather_b(h);
        wg_hold(ka);
        hold_state();
        wg_fence();
        update_state(h);
        wg_commit();
        wg_wait_all();
        hold_state();
      }
    };
    static_assert(NC == 32, "the state's 16 registers per 64 dims hold 32 columns");
    if (!split.state_only) {
      // ---- P = A B^T, and O = A S once per output ---------------------------------------------------
      float P[32];
      const bool fresh_output = !Info::group_sum || s.first;
      hold_state();
      if constexpr (Info::group_sum) wg_hold(O);
      wg_fence();
#pragma unroll
      for (int j = 0; j < DI / 8; ++j)
        wg_tf32_ss<64>(P, tf32_slice(At, L::atom, j), tf32_slice(Bt, L::atom, j), j > 0);
      if (fresh_output) {  // (the group ends in each branch, as below)
#pragma unroll
        for (int j = 0; j < DI / 8; ++j)
          wg_tf32_ss<NC>(O, tf32_slice(At, L::atom, j), tf32_slice(St, L::column_atom, j), j > 0);
        wg_commit();
        if (update) gather_b(0);  // while the products run
        wg_wait_all();
        wg_hold(O);
      } else {
        wg_commit();
        if (update) gather_b(0);
        wg_wait_all();
      }
      wg_hold(P);

      // ---- mask P into register A (tokens 8j + 2 quad (+ 1) at positions quad (+ 4)) ----------------
      uint32_t pa[8][4];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int col = 8 * j + 2 * quad;
        auto kept = [&](int t, int x, float v) { return (Info::reverse ? x >= t : x <= t) ? to_tf32(v) : 0u; };
        pa[j][0] = kept(r0, col, P[4 * j]);
        pa[j][1] = kept(r0 + 8, col, P[4 * j + 2]);
        pa[j][2] = kept(r0, col + 1, P[4 * j + 1]);
        pa[j][3] = kept(r0 + 8, col + 1, P[4 * j + 3]);
      }

      // ---- O += P Cv, and S += B^T Cv in the same group -------------------------------------------
      wg_hold(pa);
      wg_hold(ka);
      hold_state();
      wg_hold(O);
      wg_fence();
#pragma unroll
      for (int j = 0; j < 8; ++j) wg_tf32_rs32(O, pa[j], tf32_slice(Cvt, L::column_atom, j));
      // Each branch ends the group it issued: a group that ended after the branches had ptxas serialize
      // the products (C7515; the merge copies the accumulators).
      if (update) {
        update_state(0);
        wg_commit();
        wg_wait_all();
        hold_state();
      } else {
        wg_commit();
        wg_wait_all();
      }
      wg_hold(O);
      if (update) update_state_from(1);  // DI = 128: the second block of dims

      // ---- epilogue: s O (times phi' for dq and dk) into the output rows ------------------------------
      if (!Info::group_sum || s.last) {
        const MutView out = kFwd ? p.o : R == ScanRole::kGradQ ? p.dq : R == ScanRole::kGradK ? p.dk : p.dv;
        const bool dphi = (R == ScanRole::kGradQ || R == ScanRole::kGradK) && p.feature_map != FeatureMap::kIdentity;
        const ConstView phi = R == ScanRole::kGradQ ? dphi_rows(feat.q, p.q) : dphi_rows(feat.k, p.k);
        const int64_t head = Info::group_sum ? g : s.h;
        const float out_scale = Info::group_sum ? 1.f : scale;  // dk and dv took s in their dout
        float finite = 0.f;  // 0 while every written value is finite (note_nonfinite)
#pragma unroll
        for (int e = 0; e < NC / 2; e += 2) {
          const int r = r0 + 8 * ((e >> 1) & 1), c = wg_acc_col(tid, e);
          if (r >= s.cl || (kPadded && c0 + c >= out_cols)) continue;
          float x0 = out_scale * O[e], x1 = out_scale * O[e + 1];
          if (dphi) {
            const float2 y = *reinterpret_cast<const float2*>(row<float>(phi, seq.b, s.t0 + r, head) + c0 + c);
            x0 *= dphi_of_phi(p.feature_map, y.x);
            x1 *= dphi_of_phi(p.feature_map, y.y);
          }
          finite = fmaf(x0, 0.f, fmaf(x1, 0.f, finite));
          *reinterpret_cast<float2*>(row<float>(out, seq.b, s.t0 + r, head) + c0 + c) = make_float2(x0, x1);
        }
        nonfinite |= finite != 0.f;
      }
    } else if (update) {
      // ---- pass 1 of a split: only the state moves --------------------------------------------------
      update_state_from(0);
    }

    __syncthreads();  // every warp is done with this stage, Cv^T and S^T
    if (update && !split.state_only) publish_state();
  }
  cp_async_wait<0>();
  note_nonfinite(p, state_row, nonfinite);

  // ---- pass 1: this segment's partial; otherwise the final state, from the last segment -------------
  if (split.state_only) {
    float* part = partial_at(seg);
    for_each_state([&](float& x, int d, int c) { part[d * NC + c] = x; });
    return;
  }
  if (seg != split.segments - 1) return;
  if constexpr (kFwd || Info::dv_like) {
    float* final_S = static_cast<float*>(kFwd ? p.final_S : p.d_initial_S);
    if (final_S != nullptr) for_each_real_state([&](float& x, int d, int c) { final_S[mat_index(d, c)] = x; });
  }
#elif defined(__CUDA_ARCH__)
  __trap();  // launched from an image without sm_90a code: fail loudly rather than leave outputs unwritten
#endif
}

}  // namespace attnrnn::cuda
