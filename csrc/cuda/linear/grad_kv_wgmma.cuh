// dk and dv of the backward in one reverse sweep at K = V = 128 without the normalizer (wgmma,
// sm_90a). Both read the same reverse state dS = sum_{s > chunk} phi(q_s)^T dout''_s [K x V]
// (dout'' = scale * dout, summed over a group's query heads):
//   dv_t = phi(k_t) dS + sum_{s >= t in the chunk} (phi(k_t) . phi(q_s)) dout''_s
//   dk_t = (v_t dS^T   + sum_{s >= t in the chunk} (v_t . dout''_s) phi(q_s)) * phi'(k_t)
// scan_wgmma.cuh's separate dv and dk sweeps each read four tensors and write one; this one reads q, k,
// v and dout once and writes dk and dv: six tensors of traffic for eight.
// One block of two warpgroups per (sequence [x segment], kv head): warpgroup 0 makes dv, warpgroup 1
// dk, each all 128 of its columns (two accumulators of 64), so that each step's scores are made
// once. The state is split by columns: warpgroup w keeps S_w = dS[:, 64 w .. 64 w + 64) ([128
// dims][64 columns] fp32 in registers, what scan_wgmma.cuh's dv block of output tile w holds) and
// publishes it as 16-bit hi + lo tiles, from which both read all of dS. A step is one (chunk of 64
// tokens, query head) pair, in reverse sweep order:
//   warpgroup 0  P  = mask(K Q^T)                  s >= t, inner dim K
//                Odv_c = K dS_c,hi + K dS_c,lo + P dout''_c      columns c = [64 c, 64 c + 64)
//   warpgroup 1  P' = mask(V dout''^T)             inner dim V
//                Odk_c = V dS^T_c,hi + V dS^T_c,lo + P' Q_c      dS^T_c: dS's rows [64 c, 64 c + 64)
//   both         S_w += Q^T dout''_w               every head
// K dS and V dS^T enter once per chunk (its first head), the scores' products every head. dv's
// products, their order and its state are those of scan_wgmma.cuh's dv sweep at DI = 128, so dv is
// bitwise the same; dk sums the same terms in another order. With one query head per kv head
// (kOneHead) every step is a chunk's first and last head: the state products are issued right
// behind the scores' and run while the scores are masked, and the outputs are written while the
// state moves. A split's pass 1 is dv's state pass (its partials, in dv's layout: output tile w of
// two), launched by backward.cuh's run_grad_kv_128.
#pragma once

#include <type_traits>

#include "scan_roles.cuh"
#include "wgmma_tiles.cuh"
#include "../common/mma.cuh"
#include "../common/wgmma.cuh"

namespace attnrnn::cuda {

struct WgmmaGradKvLayout {
  static constexpr int threads = WgmmaGradKvTiles::threads, stages = 2;
  // a stage: K, Q, dout, V as two 64-column tiles each (8 KiB a tile): 64 KiB
  static constexpr int k = 0, q = 2 * kWgTileBytes, dout = 4 * kWgTileBytes, v = 6 * kWgTileBytes;
  static constexpr int stage = 8 * kWgTileBytes;
  // after the stages: S_hi, S_lo [warpgroup][dim tile] (32 KiB each), then one tile per warpgroup
  // that no product reads, through which its outputs are staged to global memory
  static constexpr int state_hi = stages * stage, state_lo = state_hi + 4 * kWgTileBytes;
  static constexpr int scratch = state_lo + 4 * kWgTileBytes;
  static constexpr int64_t smem_bytes = scratch + 2 * kWgTileBytes;  // 208 KiB: one block per SM
  static constexpr int64_t partial_floats = WgmmaLayout<128>::partial_floats;  // dv's: S [128][64], then z
  static_assert(smem_bytes + 1024 <= 228 * 1024, "one block must fit on an SM");
};

template <class T, bool kOneHead>
__global__ void __launch_bounds__(WgmmaGradKvLayout::threads, 1)
    wgmma_grad_kv_kernel(const ChunkArgs p, const SegmentSplit split, const ScanFeatures feat) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using L = WgmmaGradKvLayout;
  constexpr int C = kChunk, D = 64, NS = L::stages, KT = 2;
  extern __shared__ __align__(1024) unsigned char smem[];
  if (smem_addr(smem) % 1024 != 0) __trap();  // the swizzle and the descriptors assume it
  const int tid = threadIdx.x, w = tid / 128, t = tid % 128;  // warpgroup, thread in it
  unsigned char* Sh = smem + L::state_hi;  // [warpgroup][dim tile]
  unsigned char* Sl = smem + L::state_lo;
  unsigned char* Sh_w = Sh + w * KT * kWgTileBytes;
  unsigned char* Sl_w = Sl + w * KT * kWgTileBytes;
  unsigned char* scratch = smem + L::scratch + w * kWgTileBytes;  // staging of this warpgroup's outputs

  const int64_t Hkv = p.num_kv_heads, G = p.num_heads / p.num_kv_heads, K = p.head_dim_k, V = p.head_dim_v;
  const int64_t n = blockIdx.x / split.segments, g = blockIdx.y;
  const int seg = blockIdx.x % split.segments;
  const int c0 = w * D;  // this warpgroup's columns of dS
  const Seq seq = sequence(p, n);
  const float scale = static_cast<float>(p.scale);
  const int64_t state_row = n * Hkv + g;
  auto mat_index = [&](int d, int c) { return (state_row * K + d) * V + c0 + c; };
  // Segment j's partial of this warpgroup's columns, in dv's layout (run_sweep's grid with two
  // output tiles: segment_state_kernel wrote it)
  auto partial_at = [&](int j) {
    const int64_t N = gridDim.x / split.segments;
    return split.partial + (((int64_t(j) * N + n) * Hkv + g) * KT + w) * L::partial_floats;
  };
  float S[KT][32];  // S[h][i]: dS[64 h + row][c0 + col] of accumulator element i
  auto for_each_state = [&](auto&& f) {
#pragma unroll
    for (int h = 0; h < KT; ++h)
#pragma unroll
      for (int i = 0; i < 32; ++i) f(S[h][i], 64 * h + wg_acc_row(t, i), wg_acc_col(t, i));
  };
  auto hold_state = [&]() {
#pragma unroll
    for (int h = 0; h < KT; ++h) wg_hold(S[h]);
  };

  // ---- initial state: dS of the tokens after this segment -----------------------------------------
  load_initial_state(for_each_state, static_cast<const float*>(p.d_final_S), mat_index, partial_at, seg, D);
  auto publish_state = [&]() { wg_publish_state<T, KT>(S, Sh_w, Sl_w, t); };
  publish_state();

  // ---- the steps: (chunk, query head) pairs of this segment, the last chunk first -----------------
  const WgSteps walk(seq, g, G, C, split, seg);
  const int steps = walk.count();
  // Loads: warpgroup 0 copies K and Q, warpgroup 1 dout and V (four tiles each). The sources are
  // made at each issue from the parameters: held across the loop they cost registers the outputs need.
  auto source = [&](Operand src) { return wg_source<T>(tc_view(p, feat, src), seq, 0, t); };
  auto stage = [&](int i) { return smem + (i % NS) * L::stage; };
  WgSteps::Walk issued = walk.start();
  auto issue = [&](int i) {
    const WgStep s = walk.at<true>(issued);
    walk.advance(issued);
    unsigned char* st = stage(i) + (w == 0 ? L::k : L::dout);  // K, Q or dout, V
    static_assert(L::q - L::k == L::v - L::dout, "each warpgroup's second tiles follow its first");
    wg_load_tiles<T>(st, source(w == 0 ? Operand::kK : Operand::kDout), w == 0 ? g : s.h, 2 * D, s.t0, s.cl, t);
    wg_load_tiles<T>(st + (L::q - L::k), source(w == 0 ? Operand::kQ : Operand::kV), w == 0 ? s.h : g, 2 * D, s.t0,
                     s.cl, t);
  };
  float O[2][32];  // warpgroup 0: dv's columns [0, 64) and [64, 128); warpgroup 1: dk's
  float P[32];     // the scores: K Q^T (warpgroup 0), V dout''^T (warpgroup 1)
  uint32_t pa[4][4];  // masked scores as the A operand
  auto mask_scores = [&]() {  // s >= t
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int e = 8 * j + 2 * q, r = wg_acc_row(t, e), col = wg_acc_col(t, e);
        pa[j][q] = pack2<T>(col >= r ? P[e] : 0.f, col + 1 >= r ? P[e + 1] : 0.f);
      }
  };
  auto hold_outputs = [&]() {
    wg_hold(O[0]);
    wg_hold(O[1]);
  };
  bool nonfinite = false;  // a row this thread wrote was not finite (note_nonfinite, after the steps)
  // One step's products and outputs in warpgroup W (a compile-time 0 or 1: the operands' offsets are
  // constants, so that the descriptors stay uniform)
  auto step_of_warpgroup = [&](auto W_, const WgStep& s, unsigned char* st) {
    constexpr int W = decltype(W_)::value;
    constexpr bool kDv = W == 0;
    const unsigned char* Kt = st + L::k;
    const unsigned char* Qt = st + L::q;
    const unsigned char* Dt = st + L::dout;
    const unsigned char* Vt = st + L::v;
    const unsigned char* At = kDv ? Kt : Vt;  // the output's rows (tokens t)
    const unsigned char* Bt = kDv ? Qt : Dt;  // the scores' columns (tokens s)
    const unsigned char* Xt = kDv ? Dt : Qt;  // the scores' values: dout'' (dv), phi(q) (dk)
    // k16 slice j of the state product for output columns c: dv's B = dS[:, c] (M/N-major: dim tile
    // j / 4 of warpgroup c's tiles), dk's B = dS[rows c, :]^T (K-major: dim tile c of warpgroup j / 4's)
    auto state_at = [](int c, int j) {
      return kDv ? (c * KT + j / 4) * kWgTileBytes + 2048 * (j % 4) : ((j / 4) * KT + c) * kWgTileBytes + 32 * (j % 4);
    };
    auto state_products = [&]() {
#pragma unroll
      for (int c = 0; c < 2; ++c) {
#pragma unroll
        for (int j = 0; j < 8; ++j)
          wg_mma_ss<T, 0, kDv ? 1 : 0>(O[c], wg_descriptor(At, wg_slice_along(j)), wg_descriptor(Sh, state_at(c, j)), j > 0);
#pragma unroll
        for (int j = 0; j < 8; ++j)
          wg_mma_ss<T, 0, kDv ? 1 : 0>(O[c], wg_descriptor(At, wg_slice_along(j)), wg_descriptor(Sl, state_at(c, j)), 1);
      }
    };

    // ---- P = A B^T; O_c = A dS (dv) or A dS^T (dk) once per chunk ---------------------------------
    hold_state();
    hold_outputs();
    wg_fence();
    wg_scores<T, 128>(P, At, Bt);
    wg_commit();
    if constexpr (kOneHead) {  // every step is a chunk's first head: no branch around the products
      state_products();
      wg_commit();
      wg_wait<1>();  // the scores
      wg_hold(P);
    } else {
      wg_wait_all();  // no group in flight across the branch (ptxas would serialize the products)
      wg_hold(P);
      if (s.first) {
        wg_fence();
        state_products();
        wg_commit();
      }
    }
    mask_scores();  // while the state products run
    wg_wait_all();
    hold_outputs();

    // ---- O_c += P X_c; S_w += Q^T dout''_w -----------------------------------------------------------
    hold_state();
    wg_hold(pa);
    wg_fence();
#pragma unroll
    for (int c = 0; c < 2; ++c) wg_scores_times<T>(O[c], pa, Xt, c * kWgTileBytes);
    wg_commit();
    wg_update_state<T, KT>(S, Qt, Dt, W * kWgTileBytes);
    wg_commit();
    wg_wait<1>();  // the outputs (the state's update runs on)
    hold_outputs();

    // ---- the group's output after its last head, written while the state moves -------------------
    if (kOneHead || s.last) {
      const float ones[2] = {1.f, 1.f};
      const bool dphi_of = !kDv && p.feature_map != FeatureMap::kIdentity;
#pragma unroll
      for (int c = 0; c < 2; ++c)
        nonfinite |= wg_write_rows<T>(kDv ? p.dv : p.dk, O[c], ones, p.feature_map, dphi_of, dphi_rows(feat.k, p.k),
                                      seq.b, s.t0, s.cl, g, 64 * c, t, scratch);
    }
    wg_wait_all();
    hold_state();
  };

  for (int i = 0; i < NS - 1; ++i) {
    if (i < steps) issue(i);
    cp_async_commit();
  }
  WgSteps::Walk current = walk.start();
  const float dout_weights[C / 16] = {scale, scale, scale, scale};  // dout'' = scale * dout
  static_assert(C / 16 == 4, "four copied rows per thread");
  for (int i = 0; i < steps; ++i) {
    const WgStep s = walk.at<true>(current);
    walk.advance(current);
    cp_async_wait<NS - 2>();  // this step's tiles
    unsigned char* st = stage(i);
    if (w == 1) wg_scale_rows<T>(st + L::dout, 2 * D, s.cl, dout_weights, t);  // its own pieces of dout
    if (w == 0 && feat.relu_in_sweep) {  // relu on its own pieces of K and Q (relu_in_sweep)
      wg_relu_rows<T>(st + L::k, 2 * D, s.cl, t);
      wg_relu_rows<T>(st + L::q, 2 * D, s.cl, t);
    }
    wg_fence_shared();  // cp.async and st.shared writes before the products read them
    __syncthreads();    // every tile, the last step's state tiles; the last step's stage is free
    if (i + NS - 1 < steps) issue(i + NS - 1);
    cp_async_commit();
    if (w == 0)
      step_of_warpgroup(std::integral_constant<int, 0>{}, s, st);
    else
      step_of_warpgroup(std::integral_constant<int, 1>{}, s, st);
    __syncthreads();  // every warp is done with this stage and the state tiles
    publish_state();
  }
  cp_async_wait<0>();
  note_nonfinite(p, state_row, nonfinite);

  // ---- the gradient of the initial state, from the first segment (the sweep's last) ----------------
  if (seg != split.segments - 1 || p.d_initial_S == nullptr) return;
  float* dS0 = static_cast<float*>(p.d_initial_S);
  for_each_state([&](float& x, int d, int c) { dS0[mat_index(d, c)] = x; });
#elif defined(__CUDA_ARCH__)
  __trap();  // launched from an image without sm_90a code: fail loudly rather than leave outputs unwritten
#endif
}

}  // namespace attnrnn::cuda
