// dk and dv of the backward in one reverse sweep at K = V = 128 without the normalizer (wgmma,
// sm_90a). Both read the same reverse state dS = sum_{s > chunk} phi(q_s)^T dout''_s [K x V]
// (dout'' = scale * dout, summed over a group's query heads):
//   dv_t = phi(k_t) dS + sum_{s >= t in the chunk} (phi(k_t) . phi(q_s)) dout''_s
//   dk_t = (v_t dS^T   + sum_{s >= t in the chunk} (v_t . dout''_s) phi(q_s)) * phi'(k_t)
// chunk_wg.cuh's separate dv and dk sweeps each read four tensors and write one; this one reads q, k,
// v and dout once and writes dk and dv: six tensors of traffic for eight.
// One block of two warpgroups per (sequence [x segment], kv head). Warpgroup w owns dS's columns
// [64 w, 64 w + 64) (S_w [128 dims][64 columns], fp32 in registers: what chunk_wg.cuh's dv block of
// output tile w holds), dv's columns [64 w, 64 w + 64) and dk's columns [64 w, 64 w + 64). A step
// is one (chunk of 64 tokens, query head) pair, in reverse sweep order:
//   P   = mask(K Q^T)                          s >= t, inner dim K (both warpgroups alike)
//   Odv = K S_w,hi + K S_w,lo + P dout''_w     K dS once per chunk (its first head), P dout'' per head
//   P'  = mask(V dout''^T)                     inner dim V
//   Odk = V dS_w^T,hi + V dS_w^T,lo + P' Q_w   dS_w^T: dS's rows [64 w, 64 w + 64), from both
//                                              warpgroups' published tiles
//   S_w += Q^T dout''_w                        every head
// dv's products, their order and its state are those of chunk_wg.cuh's dv sweep at DI = 128, so dv
// is bitwise the same; dk sums the same terms in another order. The two warpgroups meet at the state:
// each publishes S_w as 16-bit hi + lo tiles, and both read all of it in the next step's V dS^T (the
// two block barriers per step of chunk_wg.cuh). A split's pass 1 is dv's state pass (its partials, in
// dv's layout: output tile w of two), launched by launch_wg_dkv128.
#pragma once

#include <type_traits>

#include "chunk_tc_plan.cuh"
#include "chunk_wg_tiles.cuh"
#include "mma.cuh"
#include "wgmma.cuh"

namespace attnrnn::cuda {

struct WgDkvLayout {
  static constexpr int threads = 256, stages = 2;
  // a stage: K, Q, dout, V as two 64-column tiles each (8 KiB a tile): 64 KiB
  static constexpr int k = 0, q = 2 * kWgTileBytes, dout = 4 * kWgTileBytes, v = 6 * kWgTileBytes;
  static constexpr int stage = 8 * kWgTileBytes;
  // after the stages: S_hi, S_lo [warpgroup][dim tile] (32 KiB each), then one tile per warpgroup
  // that no product reads, through which its outputs are staged to global memory
  static constexpr int state_hi = stages * stage, state_lo = state_hi + 4 * kWgTileBytes;
  static constexpr int scratch = state_lo + 4 * kWgTileBytes;
  static constexpr int64_t smem_bytes = scratch + 2 * kWgTileBytes;  // 208 KiB: one block per SM
  static constexpr int64_t partial_floats = WgLayout<128>::partial_floats;  // dv's: S [128][64], then z
  static_assert(smem_bytes + 1024 <= 228 * 1024, "one block must fit on an SM");
};

template <class T>
__global__ void __launch_bounds__(WgDkvLayout::threads, 1)
    chunk_wg_dkv_kernel(const LinearAttnParams p, const TcSplit split, const TcFeatures feat) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using L = WgDkvLayout;
  constexpr int C = kTcChunk, D = 64, NS = L::stages, KT = 2;
  extern __shared__ __align__(1024) unsigned char smem[];
  if (smem_addr(smem) % 1024 != 0) __trap();  // the swizzle and the descriptors assume it
  const int tid = threadIdx.x, w = tid / 128, t = tid % 128;  // warpgroup, thread in it
  unsigned char* Sh = smem + L::state_hi;  // [warpgroup][dim tile]
  unsigned char* Sl = smem + L::state_lo;
  unsigned char* Sh_w = Sh + w * KT * kWgTileBytes;
  unsigned char* Sl_w = Sl + w * KT * kWgTileBytes;
  unsigned char* scratch = smem + L::scratch + w * kWgTileBytes;

  const int64_t Hkv = p.num_kv_heads, G = p.num_heads / p.num_kv_heads, K = p.head_dim_k, V = p.head_dim_v;
  const int64_t n = blockIdx.x / split.segments, g = blockIdx.y;
  const int seg = blockIdx.x % split.segments;
  const int c0 = w * D;  // this warpgroup's columns of dS, dv and dk
  const Seq seq = sequence(p, n);
  const float scale = static_cast<float>(p.scale);
  const int64_t state_row = n * Hkv + g;
  auto mat_index = [&](int d, int c) { return (state_row * K + d) * V + c0 + c; };
  // Segment j's partial of this warpgroup's columns, in dv's layout (launch_sweep's grid with two
  // output tiles: chunk_wg_state_kernel wrote it)
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
  auto source = [&](TcSrc src) { return wg_source<T>(tc_view(p, feat, src), seq, 0, t); };
  auto stage = [&](int i) { return smem + (i % NS) * L::stage; };
  WgSteps::Walk issued = walk.start();
  auto issue = [&](int i) {
    const WgStep s = walk.at<true>(issued);
    walk.advance(issued);
    unsigned char* st = stage(i) + (w == 0 ? L::k : L::dout);  // K, Q or dout, V
    static_assert(L::q - L::k == L::v - L::dout, "each warpgroup's second tiles follow its first");
    wg_load_tiles<T>(st, source(w == 0 ? TcSrc::kK : TcSrc::kDout), w == 0 ? g : s.h, 2 * D, s.t0, s.cl, t);
    wg_load_tiles<T>(st + (L::q - L::k), source(w == 0 ? TcSrc::kQ : TcSrc::kV), w == 0 ? s.h : g, 2 * D, s.t0,
                     s.cl, t);
  };
  // k16 slice j of a 128-wide inner dim: tile j / 4, 32 bytes (along rows) or 2048 bytes (down rows)
  auto along = [](int j) { return (j / 4) * kWgTileBytes + 32 * (j % 4); };
  auto down = [](int j) { return (j / 4) * kWgTileBytes + 2048 * (j % 4); };
  float Odv[32], Odk[32], P[32];  // dv's and dk's outputs (summed over a group's heads), the scores
  uint32_t pa[4][4];              // masked scores as the A operand
  auto mask_scores = [&]() {     // s >= t
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int e = 8 * j + 2 * q, r = wg_acc_row(t, e), col = wg_acc_col(t, e);
        pa[j][q] = pack2<T>(col >= r ? P[e] : 0.f, col + 1 >= r ? P[e + 1] : 0.f);
      }
  };
  // One step's products and outputs in warpgroup W (a compile-time 0 or 1: the operands' offsets are
  // constants, so that the descriptors stay uniform)
  auto step_of_warpgroup = [&](auto W_, const WgStep& s, unsigned char* st) {
    constexpr int W = decltype(W_)::value;
    const unsigned char* Kt = st + L::k;
    const unsigned char* Qt = st + L::q;
    const unsigned char* Dt = st + L::dout;
    const unsigned char* Vt = st + L::v;
    const unsigned char* Dt_w = Dt + W * kWgTileBytes;  // dout'' on this warpgroup's columns
    const unsigned char* Qt_w = Qt + W * kWgTileBytes;  // phi(q) on this warpgroup's columns of dk
    const unsigned char* Sh_W = Sh + W * KT * kWgTileBytes;
    const unsigned char* Sl_W = Sl + W * KT * kWgTileBytes;
    // k16 slice j of dS's columns in dS_w^T, dk's B operand (K-major: its rows are dk's columns): dim
    // tile W of warpgroup j / 4's published state
    auto rows_of_w = [](int j) { return ((j / 4) * KT + W) * kWgTileBytes + 32 * (j % 4); };

    // ---- P = K Q^T; Odv = K S_w and Odk = V dS_w^T once per chunk -----------------------------------
    hold_state();
    wg_hold(Odv);
    wg_hold(Odk);
    wg_fence();
#pragma unroll
    for (int j = 0; j < 8; ++j) wg_mma_ss<T, 0, 0>(P, wg_descriptor(Kt, along(j)), wg_descriptor(Qt, along(j)), j > 0);
    wg_commit();
    wg_wait_all();
    wg_hold(P);
    if (s.first) {
      wg_fence();
#pragma unroll
      for (int j = 0; j < 8; ++j) wg_mma_ss<T, 0, 1>(Odv, wg_descriptor(Kt, along(j)), wg_descriptor(Sh_W, down(j)), j > 0);
#pragma unroll
      for (int j = 0; j < 8; ++j) wg_mma_ss<T, 0, 1>(Odv, wg_descriptor(Kt, along(j)), wg_descriptor(Sl_W, down(j)), 1);
#pragma unroll
      for (int j = 0; j < 8; ++j) wg_mma_ss<T, 0, 0>(Odk, wg_descriptor(Vt, along(j)), wg_descriptor(Sh, rows_of_w(j)), j > 0);
#pragma unroll
      for (int j = 0; j < 8; ++j) wg_mma_ss<T, 0, 0>(Odk, wg_descriptor(Vt, along(j)), wg_descriptor(Sl, rows_of_w(j)), 1);
      wg_commit();
    }
    mask_scores();  // while K S_w and V dS_w^T run
    wg_wait_all();
    wg_hold(Odv);
    wg_hold(Odk);

    // ---- Odv += P dout''_w; P' = V dout''^T (P is free once masked) -----------------------------------
    hold_state();
    wg_hold(pa);
    wg_fence();
#pragma unroll
    for (int j = 0; j < 4; ++j) wg_mma_rs<T, 1>(Odv, pa[j], wg_descriptor(Dt_w, 2048 * j), 1);
#pragma unroll
    for (int j = 0; j < 8; ++j) wg_mma_ss<T, 0, 0>(P, wg_descriptor(Vt, along(j)), wg_descriptor(Dt, along(j)), j > 0);
    wg_commit();
    wg_wait_all();
    wg_hold(Odv);
    wg_hold(P);

    // ---- Odk += mask(P') Q_w -----------------------------------------------------------------------------
    mask_scores();
    wg_hold(Odk);
    wg_hold(pa);
    wg_fence();
#pragma unroll
    for (int j = 0; j < 4; ++j) wg_mma_rs<T, 1>(Odk, pa[j], wg_descriptor(Qt_w, 2048 * j), 1);
    wg_commit();
    wg_wait_all();
    wg_hold(Odk);

    // ---- S_w += Q^T dout''_w, the group's outputs written meanwhile after its last head ---------------
    hold_state();
    wg_fence();
#pragma unroll
    for (int h = 0; h < KT; ++h)
#pragma unroll
      for (int j = 0; j < 4; ++j)
        wg_mma_ss<T, 1, 1>(S[h], wg_descriptor(Qt, h * kWgTileBytes + 2048 * j), wg_descriptor(Dt_w, 2048 * j), 1);
    wg_commit();
    if (s.last) {
      const float ones[2] = {1.f, 1.f};
      wg_write_rows<T>(p.dv, Odv, ones, p.feature_map, false, p.k, seq.b, s.t0, s.cl, g, c0, t, scratch);
      wg_write_rows<T>(p.dk, Odk, ones, p.feature_map, p.feature_map != FeatureMap::kIdentity, p.k, seq.b, s.t0,
                       s.cl, g, c0, t, scratch);
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

  // ---- the gradient of the initial state, from the first segment (the sweep's last) ----------------
  if (seg != split.segments - 1 || p.d_initial_S == nullptr) return;
  float* dS0 = static_cast<float*>(p.d_initial_S);
  for_each_state([&](float& x, int d, int c) { dS0[mat_index(d, c)] = x; });
#elif defined(__CUDA_ARCH__)
  __trap();  // launched from an image without sm_90a code: fail loudly rather than leave outputs unwritten
#endif
}

}  // namespace attnrnn::cuda
