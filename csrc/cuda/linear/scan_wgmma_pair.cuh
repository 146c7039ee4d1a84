// The sweeps with inner dim 128 on 128-token chunks and a pair of warpgroups (wgmma, sm_90a): the
// forward at K = 128 and the backward's dq, dk, dv at inner dim 128 (dq, dk: V; dv: K). Half the
// steps of scan_wgmma.cuh's sweeps for ~1.3x the products per step, so the chain of copies, waits and
// barriers that sets a step's time is paid once per 128 tokens (docs/design.md, "What would get
// there", item 4). One block of 256 threads per (sequence [x segment], 64 output columns, kv head);
// a step is one (chunk of 128 tokens, query head) pair, in sweep order. With the role's operands A,
// B, Cv as in scan_wgmma.cuh (RoleInfo), warpgroup w owns the chunk's rows [64 w, 64 w + 64) of A and
// the state's dims [64 w, 64 w + 64) (S_w, 64 x 64 fp32 in registers):
//   P_wb = mask(A_w B_b^T)   over the row blocks b of B that can see rows w of A: b <= w on forward
//                            sweeps (s <= t), b >= w on reverse ones (s >= t); block w is the diagonal
//   O_w  = A_w S_hi + A_w S_lo + sum_b P_wb Cv_b    S_hi / S_lo: both halves, published as tiles
//   S_w += B[:, dims of w]^T Cv   over the chunk's 128 tokens: after a chunk's last head (forward,
//                                 dq), after every head (dk, dv: they sum over a group's heads)
// The role's extra terms are those of scan_wgmma.cuh (its header). The two warpgroups meet at the
// state: each publishes its half, and both read all of it in the next step's A S (two block barriers
// per step, as scan_wgmma.cuh has per 64 tokens).
#pragma once

#include <type_traits>

#include "scan_roles.cuh"
#include "wgmma_tiles.cuh"
#include "../common/mma.cuh"
#include "../common/wgmma.cuh"
#include "wgmma_normalizer.cuh"

namespace attnrnn::cuda {

struct WgmmaPairLayout {
  static constexpr int KT = 2;            // 64-dim tiles of A and B (inner dim 128)
  static constexpr int RB = 2;            // 64-row blocks of a 128-token chunk
  static constexpr int chunk = WgmmaPairTiles::chunk, threads = WgmmaPairTiles::threads, stages = 2;
  static_assert(chunk == 64 * RB, "two 64-row blocks per chunk");
  // a stage: A and B [row block][dim tile], Cv [row block], each tile 64 x 64 (8 KiB): 80 KiB
  static constexpr int a = 0, b = RB * KT * kWgTileBytes, c = 2 * RB * KT * kWgTileBytes;
  static constexpr int stage = c + RB * kWgTileBytes;
  static constexpr int z_floats = 64 * KT;
  // floats after the state tiles: dk's dd (or dd / w) [stages][128], then dq's / dk's z on the output
  // columns. The forward has there a tile of ones [8][64] and z's split tile [8][128], the B operands
  // of its column sums and of a . z (wgmma_normalizer.cuh; 1 KiB-aligned like every tile), then z in fp32
  // (fp16's a . z).
  static constexpr int dd = 0, z = stages * chunk;
  static constexpr int ones = 0, zsplit = ones + 256, z_fp32 = zsplit + KT * 256, floats = z_fp32 + z_floats;
  static_assert(z + 64 <= floats, "dq's / dk's z on the 64 output columns fits after dd");
  static_assert((stages * stage + 2 * KT * kWgTileBytes + 4 * ones) % 1024 == 0 && (4 * zsplit) % 1024 == 0,
                "the forward's operand tiles start on swizzle atoms");
  // two stages, S_hi and S_lo [dim tile], the floats: 195.5 KiB, one block per SM
  static constexpr int64_t smem_bytes = int64_t(stages) * stage + 2 * KT * kWgTileBytes + floats * 4;
  static constexpr int64_t partial_floats = WgmmaLayout<128>::partial_floats;  // S [128][64], then z
  static_assert(smem_bytes + 1024 <= 228 * 1024, "one block must fit on an SM");
};

template <class T, ScanRole R, bool WithNormalizer>
__global__ void __launch_bounds__(WgmmaPairLayout::threads, 1)
    wgmma_pair_scan_kernel(const ChunkArgs p, const SegmentSplit split, const ScanFeatures feat) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  static_assert(R != ScanRole::kGradKV, "the fused dk + dv sweep is not paired");
  using L = WgmmaPairLayout;
  using Info = RoleInfo<R>;
  constexpr bool kFwd = R == ScanRole::kForward, kDq = R == ScanRole::kGradQ, kDk = R == ScanRole::kGradK;
  constexpr bool kDkScalesCv = wg_dk_scales_cv<T, R, 64 * L::KT>;  // dk weighs phi(q), not dout
  constexpr int C = L::chunk, D = 64, DI = 64 * L::KT, NS = L::stages, KT = L::KT;
  extern __shared__ __align__(1024) unsigned char smem[];
  if (smem_addr(smem) % 1024 != 0) __trap();  // the swizzle and the descriptors assume it
  unsigned char* Sh = smem + NS * L::stage;    // KT tiles [64 dims][64 cols]
  unsigned char* Sl = Sh + KT * kWgTileBytes;
  float* fl = reinterpret_cast<float*>(Sl + KT * kWgTileBytes);
  float* z = fl + L::z;  // dq's key sums, dk's dz on the output columns
  // The forward's z of this warpgroup's dims [64 w, 64 w + 64): an m64n8 accumulator beside S (every
  // column alike), published with S as z's split tile (bf16: a . z on the tensor cores) or in fp32.
  float Z[4] = {0.f, 0.f, 0.f, 0.f};
  unsigned char* ones = reinterpret_cast<unsigned char*>(fl + L::ones);
  unsigned char* zsplit = reinterpret_cast<unsigned char*>(fl + L::zsplit);
  float* z_fp32 = fl + L::z_fp32;
  // The forward runs with WithNormalizer == p.normalize (sweep.cuh, check_normalize_mode): its
  // normalizer's products are chosen at compile time, since a branch inside a product group
  // serializes it (C7519, C7515).
  constexpr bool kFwdNorm = kFwd && WithNormalizer, kSplitZ = kFwdNorm && std::is_same_v<T, __nv_bfloat16>;
  const int tid = threadIdx.x, w = tid / 128, t = tid % 128;  // warpgroup, thread in it

  const int64_t Hkv = p.num_kv_heads, G = p.num_heads / p.num_kv_heads, K = p.head_dim_k, V = p.head_dim_v;
  const int tiles = sweep_tiles<false>(sweep_output_dim<R>(p), D);
  const SweepBlock block = sweep_block(tiles, split.segments);
  const int tile = block.tile, seg = block.seg;
  const int64_t n = block.n, g = block.g;
  const int c0 = tile * D;
  const Seq seq = sequence(p, n);
  const float scale = static_cast<float>(p.scale), eps = static_cast<float>(p.eps);
  const int64_t state_row = n * Hkv + g;
  const float* ws_w = kFwd ? nullptr : BwdWorkspace::den<float>(p);  // w_t = s / den_t (normalize)
  const float* ws_dd = kFwd ? nullptr : BwdWorkspace::dd<float>(p);
  // The state's element (d, c) in a [K][V] matrix: transposed roles hold S^T / dS^T.
  auto mat_index = [&](int d, int c) {
    return Info::transposed ? (state_row * K + c0 + c) * V + d : (state_row * K + d) * V + c0 + c;
  };
  auto partial_at = [&](int j) { return split.partial_at(j, n, g, Hkv, tiles, tile, L::partial_floats); };
  // This warpgroup's half of the state: S[0][i] is S[64 w + row][col] of accumulator element i.
  float S[1][32];
  auto state_dim = [&](int i) { return 64 * w + wg_acc_row(t, i); };
  const int earlier = split.state_only ? 0 : seg;  // partials of the segments before this one

  // ---- initial state: S in registers; z beside it (the forward) or in shared memory ------------
  {
    const float* S0 = static_cast<const float*>(Info::reverse ? p.d_final_S : p.initial_S);
    auto for_each_state = [&](auto&& f) {
#pragma unroll
      for (int i = 0; i < 32; ++i) f(S[0][i], state_dim(i), wg_acc_col(t, i));
    };
    load_initial_state(for_each_state, split.state_only ? nullptr : S0, mat_index, partial_at, earlier, D);
  }
  constexpr int z_width = (kDq || kDk) ? D : 0;  // the forward keeps its z in Z (kFwdNorm)
  auto z_initial = [&](int i) {
    const float* z0 = static_cast<const float*>(kDk ? p.d_final_z : p.initial_z);
    float x = (z0 != nullptr && !split.state_only) ? z0[state_row * K + (kFwd ? 0 : c0) + i] : 0.f;
    for (int j = 0; j < earlier; ++j) x += partial_at(j)[DI * D + i];
    return x;
  };
  if constexpr (kFwdNorm) {
    Z[0] = Z[1] = z_initial(64 * w + wg_acc_row(t, 0));  // registers 0, 1: row r0; 2, 3: row r0 + 8
    Z[2] = Z[3] = z_initial(64 * w + wg_acc_row(t, 2));
    wg_fill_ones<T>(ones, tid, L::threads);
  } else if (z_width > 0 && normalizes<WithNormalizer>(p) && tid < z_width) {
    z[tid] = z_initial(tid);
  }
  auto publish_state = [&]() {
    wg_publish_state<T, 1>(S, Sh + w * kWgTileBytes, Sl + w * kWgTileBytes, t);
    if constexpr (kFwdNorm) wg_publish_z<T>(Z, zsplit, z_fp32, 64 * w, t);
  };
  if (!split.state_only) publish_state();

  // ---- the steps: (chunk, query head) pairs of this segment, in sweep order ---------------------
  const WgSteps walk(seq, g, G, C, split, seg);
  const int steps = walk.count();
  using Step = WgStep;
  using Walk = WgSteps::Walk;
  auto step_of = [&](const Walk& wk) { return walk.at<Info::reverse>(wk); };
  auto advance = [&](Walk& wk) { walk.advance(wk); };
  auto source = [&](const ConstView& v, int col0) { return wg_source<T>(v, seq, col0, tid); };
  const WgSource<T> a_src = source(tc_view(p, feat, Info::a), 0), b_src = source(tc_view(p, feat, Info::b), 0),
                    c_src = source(tc_view(p, feat, Info::c), c0);
  auto head_of = [&](Operand src, const Step& s) { return per_query_head(src) ? s.h : g; };
  // The backward's per-token weights of a step, loaded before its tiles are waited for: w of the rows
  // this thread copies (dv scales its pieces of the dout tile, dk those of dout or phi(q)), dq's w and
  // dd of its two accumulator rows, divided after the scores' product (as in scan_wgmma.cuh: dq's dout
  // stays as loaded); dk's dd (one per score column) comes with the tiles into shared memory.
  struct Weights {
    float w[4], dd[2], wr[2];
  };
  auto weights_of = [&](const Step& s) {
    Weights wt{};
    if (!kFwd && !(kDq && split.state_only)) {  // dq's dout is the A tile, not loaded in pass 1
      auto weight = [&](const float* ws, int r, float otherwise) {
        return normalizes<WithNormalizer>(p) && r < s.cl ? ws[token_index(p, seq, s.t0 + r, s.h)] : otherwise;
      };
      if constexpr (kDq) {
        dq_row_weights(weight, ws_w, ws_dd, 64 * w + wg_acc_row(t, 0), scale, wt.wr, wt.dd);
      } else {
#pragma unroll
        for (int j = 0; j < 4; ++j) wt.w[j] = weight(ws_w, tid / 8 + 32 * j, scale);
      }
    }
    return wt;
  };
  auto stage = [&](int i) { return smem + (i % NS) * L::stage; };
  Walk issued = walk.start();
  auto issue = [&](int i) {
    const Step s = step_of(issued);
    advance(issued);
    unsigned char* st = stage(i);
    if (!split.state_only) wg_load_pair_tiles<T>(st + L::a, a_src, head_of(Info::a, s), DI, s.t0, s.cl, tid);
    wg_load_pair_tiles<T>(st + L::b, b_src, head_of(Info::b, s), DI, s.t0, s.cl, tid);
    wg_load_pair_tiles<T>(st + L::c, c_src, head_of(Info::c, s), D, s.t0, s.cl, tid);
    if (kDkScalesCv && normalizes<WithNormalizer>(p))
      wg_load_row_dd<4>(fl + L::dd + (i % NS) * C, ws_dd, 32, s.cl, tid, p, seq, s.t0, s.h);
    if (kDk && !kDkScalesCv && normalizes<WithNormalizer>(p) && tid < C) {
      const bool valid = tid < s.cl;
      cp_async4(fl + L::dd + (i % NS) * C + tid, ws_dd + (valid ? token_index(p, seq, s.t0 + tid, s.h) : 0), valid);
    }
  };
  // k16 slice j of the 128 dims: tile j / 4, 32 bytes (along rows) or 2048 bytes (down rows) per slice
  auto along = [](int j) { return (j / 4) * kWgTileBytes + 32 * (j % 4); };
  float O[32];  // the step's output; dk and dv keep summing it over a group's heads

  bool nonfinite = false;  // a row this thread wrote was not finite (note_nonfinite, after the steps)
  // One step of warpgroup W (a compile-time 0 or 1, so that every wgmma stage lies inside one side
  // of the branch on w: a branch inside a stage makes ptxas serialize the products, C7515).
  auto step_of_warpgroup = [&](auto W_, auto update_, const Step& s, unsigned char* st, const Weights& wt,
                               const float* dd_cols) {
    constexpr int W = decltype(W_)::value;
    // S moves after this step: compile-time in the backward's sweeps (their epilogue runs while the
    // update does, and a product group issued on one side of a runtime branch while another is in
    // flight makes ptxas serialize the products, C7520), a runtime flag in the forward
    const bool update = update_;
    constexpr bool kEpilogueUnderUpdate = !kFwd && std::is_same_v<decltype(update_), std::true_type>;
    constexpr int b0 = Info::reverse ? W : 0, nb = Info::reverse ? L::RB - W : W + 1;  // blocks b0 .. b0 + nb - 1
    const unsigned char* Bt = st + L::b;
    const unsigned char* Ct = st + L::c;
    // S_W += B[:, dims of W]^T Cv over the chunk's 128 tokens; the forward's z of the dims of W
    // += B[:, dims of W]^T ones (its column sums)
    auto update_state = [&]() {
      if constexpr (kFwdNorm) wg_hold(Z);
      wg_fence();
#pragma unroll
      for (int b = 0; b < L::RB; ++b)
#pragma unroll
        for (int j = 0; j < 4; ++j)
          wg_mma_ss<T, 1, 1>(S[0], wg_descriptor(Bt, (b * KT + W) * kWgTileBytes + 2048 * j),
                             wg_descriptor(Ct, b * kWgTileBytes + 2048 * j), 1);
      if constexpr (kFwdNorm) wg_add_key_sums<T, L::RB>(Z, Bt, W * kWgTileBytes, KT * kWgTileBytes, ones);
      wg_commit();
    };
    auto update_done = [&]() {
      wg_wait_all();
      wg_hold(S[0]);
      if constexpr (kFwdNorm) wg_hold(Z);
    };
    if (split.state_only) {  // ---- pass 1 of a split: only the state moves ------------------------
      if (update) {
        wg_hold(S[0]);
        update_state();
        update_done();
      }
      return;
    }
    unsigned char* Aw = st + L::a + W * KT * kWgTileBytes;  // this warpgroup's 64 rows of A
    const int row0 = 64 * W, cl = s.cl - row0;                   // its rows of the chunk, cl valid
    const bool fresh_output = !Info::group_sum || s.first;
    // ---- P_b = A_W B_b^T for the row blocks b of B that rows W of A see -------------------------
    float P[nb][32];
    wg_hold(S[0]);
    if constexpr (Info::group_sum) wg_hold(O);  // O carries the group's sum from earlier heads
    wg_fence();
#pragma unroll
    for (int i = 0; i < nb; ++i)
#pragma unroll
      for (int j = 0; j < DI / 16; ++j)
        wg_mma_ss<T, 0, 0>(P[i], wg_descriptor(Aw, along(j)), wg_descriptor(Bt + (b0 + i) * KT * kWgTileBytes, along(j)),
                           j > 0);
    wg_commit();
    wg_wait_all();
#pragma unroll
    for (int i = 0; i < nb; ++i) wg_hold(P[i]);
    // ---- O = A_W S_hi + A_W S_lo once per output, running while P is masked; the bf16 forward's
    // a_t . z (normalize) in the same group: columns 2c, 2c + 1 of QZ are a_t . z_hi and a_t . z_lo
    [[maybe_unused]] float QZ[4] = {0.f, 0.f, 0.f, 0.f};
    if (fresh_output) {
      wg_fence();
      wg_state_product<T, DI>(O, Aw, Sh, Sl);
      if constexpr (kSplitZ) wg_dot_z_products<T, DI>(QZ, Aw, zsplit);
      wg_commit();
    }
    // ---- mask (with dq's / dk's dd terms): block W is the diagonal one; the others are whole -------
    float dq_dd[2] = {wt.dd[0], wt.dd[1]};  // dq's dd / w: dq_row_weights' loads have landed by now
    if (kDq && normalizes<WithNormalizer>(p)) dq_dd_over_w(wt.wr, dq_dd);
    float rowsum[2] = {0.f, 0.f};
    uint32_t pa[nb][4][4];
#pragma unroll
    for (int i = 0; i < nb; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const int e = 8 * j + 2 * q, r = wg_acc_row(t, e), col = wg_acc_col(t, e);
          float x0 = P[i][e], x1 = P[i][e + 1];
          if (kDq && normalizes<WithNormalizer>(p)) x0 += dq_dd[q & 1], x1 += dq_dd[q & 1];
          if (kDk && normalizes<WithNormalizer>(p)) x0 += dd_cols[64 * (b0 + i) + col], x1 += dd_cols[64 * (b0 + i) + col + 1];
          if (b0 + i == W) {
            x0 = (Info::reverse ? col >= r : col <= r) ? x0 : 0.f;
            x1 = (Info::reverse ? col + 1 >= r : col + 1 <= r) ? x1 : 0.f;
          }
          rowsum[q & 1] += x0 + x1;
          pa[i][j][q] = pack2<T>(x0, x1);
        }
    wg_wait_all();  // A S
    wg_hold(O);
    [[maybe_unused]] float qz[2] = {0.f, 0.f};  // the forward's a_t . z (normalize)
    if constexpr (kSplitZ) {
      wg_hold(QZ);
      qz[0] = QZ[0] + QZ[1];
      qz[1] = QZ[2] + QZ[3];
    }
    if constexpr (kDq || kDk) {
      if (normalizes<WithNormalizer>(p) && fresh_output) {  // O += (dd_t / w_t) z (dq) or dz (dk), output columns
#pragma unroll
        for (int e = 0; e < 32; ++e) O[e] += (kDq ? dq_dd[(e >> 1) & 1] : 1.f) * z[wg_acc_col(t, e)];
      }
    }
    // ---- O += P_b Cv_b --------------------------------------------------------------------------
    wg_hold(O);
    wg_hold(S[0]);
#pragma unroll
    for (int i = 0; i < nb; ++i) wg_hold(pa[i]);
    wg_fence();
#pragma unroll
    for (int i = 0; i < nb; ++i) wg_scores_times<T>(O, pa[i], Ct + (b0 + i) * kWgTileBytes);
    wg_commit();
    // The backward's sweeps write their epilogue while the update runs (B4-T8192-H16-D128: dq, dk, dv
    // 1.5-3.5% faster); the forward after it (7% slower in its shadow).
    if constexpr (kEpilogueUnderUpdate) update_state();
    wg_wait<kEpilogueUnderUpdate ? 1 : 0>();  // P Cv
    wg_hold(O);
    // ---- epilogue: one output per query head, or the group's sum after its last head --------------
    auto epilogue = [&]() {
      if (Info::group_sum && !s.last) return;
      const int64_t out_head = Info::group_sum ? g : s.h;
      // staged through this warpgroup's first A tile: every product that reads it is done
      auto write = [&](const MutView out, bool dphi_of, const ConstView phi_rows, const float(&inv)[2]) {
        nonfinite |= wg_write_rows<T, WithNormalizer ? 8 : 16>(out, O, inv, p.feature_map, dphi_of, phi_rows, seq.b,
                                                               s.t0 + row0, cl, out_head, c0, t, Aw);
      };
      if constexpr (kFwd) {
        float inv[2] = {scale, scale};
        if (normalizes<WithNormalizer>(p)) {
          wg_forward_scale(rowsum, qz, scale, eps, inv);
          if (p.den_out != nullptr && tile == 0) {
            const int r0 = wg_acc_row(t, 0);
            store_den(p, seq, s.t0 + row0 + r0, s.h, cl - r0, inv, t % 32);
          }
        }
        write(p.o, false, p.q, inv);
      } else {
        [[maybe_unused]] const float one[2] = {1.f, 1.f};  // dk's and dv's rows
        [[maybe_unused]] const bool phi_used = p.feature_map != FeatureMap::kIdentity;  // dq, dk times phi'
        if constexpr (kDq) write(p.dq, phi_used, dphi_rows(feat.q, p.q), wt.wr);
        if constexpr (kDk) write(p.dk, phi_used, dphi_rows(feat.k, p.k), one);
        if constexpr (Info::dv_like) write(p.dv, false, p.k, one);
      }
    };
    if constexpr (kEpilogueUnderUpdate) {
      epilogue();
      update_done();
    } else {
      // the forward: the update, with fp16's a_t . z (fp32 sums, normalize) in its shadow, then the epilogue
      auto dot_z = [&]() {
        if constexpr (kFwdNorm && !kSplitZ) wg_row_dot_z<T, DI>(Aw, z_fp32, nullptr, t, qz);
      };
      if (update) {
        update_state();
        dot_z();
        update_done();
      } else {
        dot_z();
      }
      epilogue();
    }
  };

  for (int i = 0; i < NS - 1; ++i) {
    if (i < steps) issue(i);
    cp_async_commit();
  }
  Walk current = walk.start();
  // The backward's weights a step ahead: loaded at their own step's start, the tiles' scaling and
  // dq's division waited on them (ncu: 4-6% of dk's stall samples); now a whole step hides them.
  Weights next_wt = steps > 0 ? weights_of(step_of(current)) : Weights{};
  for (int i = 0; i < steps; ++i) {
    const Step s = step_of(current);
    advance(current);
    const Weights wt = next_wt;
    if (i + 1 < steps) next_wt = weights_of(step_of(current));
    cp_async_wait<NS - 2>();  // this step's tiles
    unsigned char* st = stage(i);
    float* dd_cols = fl + L::dd + (i % NS) * C;  // dk: dd (/ w when it scales phi(q)) of the step's tokens
    // relu on this thread's own pieces of the q and k tiles (ScanFeatures::relu_in_sweep), before w scales them
    if (!split.state_only && relu_in_sweep(feat, Info::a)) wg_relu_pair_rows<T>(st + L::a, DI, s.cl, tid);
    if (relu_in_sweep(feat, Info::b)) wg_relu_pair_rows<T>(st + L::b, DI, s.cl, tid);
    if (relu_in_sweep(feat, Info::c)) wg_relu_pair_rows<T>(st + L::c, D, s.cl, tid);
    // rows times w, in place (dv's dout, dk's phi(q) with dd / w or its dout): this thread's own
    // pieces, which the wait made visible
    if constexpr (kDkScalesCv) {
      wg_scale_pair_rows<T>(st + L::c, D, s.cl, wt.w, tid);
      if (normalizes<WithNormalizer>(p)) wg_dd_over_w(dd_cols, wt.w, 32, tid);
    } else if constexpr (kDk) {
      wg_scale_pair_rows<T>(st + L::b, DI, s.cl, wt.w, tid);
    } else if constexpr (Info::dv_like) {
      wg_scale_pair_rows<T>(st + L::c, D, s.cl, wt.w, tid);
    }
    wg_fence_shared();  // cp.async and st.shared writes before the products read them
    // Every warp has the step's tiles, the last step's state tiles and z, and is done with the last
    // step's stage, which the next load may now refill.
    __syncthreads();
    if (i + NS - 1 < steps) issue(i + NS - 1);
    cp_async_commit();
    // The forward and dq move the state after a chunk's last head, dk and dv after every head
    // (step_of_warpgroup says why that is compile-time in the backward's sweeps).
    const bool update = Info::group_sum || s.last;
    auto step_as = [&](auto W_) {
      if constexpr (kFwd)
        step_of_warpgroup(W_, update, s, st, wt, dd_cols);
      else if (update)
        step_of_warpgroup(W_, std::true_type{}, s, st, wt, dd_cols);
      else if constexpr (!Info::group_sum)
        step_of_warpgroup(W_, std::false_type{}, s, st, wt, dd_cols);
    };
    if (w == 0)
      step_as(std::integral_constant<int, 0>{});
    else
      step_as(std::integral_constant<int, 1>{});
    __syncthreads();  // both warpgroups are done with this stage, S_hi / S_lo and z
    if (update && normalizes<WithNormalizer>(p)) {
      if constexpr (kDq || kDk) {
        // dq: z += colsum Cv; dk: dz += sum_t dd_t Cv_t; on the output columns, one writer per column
        if (w == 0) {
#pragma unroll
          for (int b = 0; b < L::RB; ++b)
            wg_add_column_sums<T, 1>(st + L::c + b * kWgTileBytes, kDk ? dd_cols + 64 * b : nullptr, z, t);
        }
      }
    }
    if (update && !split.state_only) publish_state();
  }
  cp_async_wait<0>();
  __syncthreads();  // the last step's z (dq's and dk's column sums ran after the step's last barrier)
  note_nonfinite(p, state_row, nonfinite);

  // ---- pass 1: this segment's partial; otherwise the final state, from the last segment ---------
  if (split.state_only) {
    float* part = partial_at(seg);
#pragma unroll
    for (int i = 0; i < 32; ++i) part[state_dim(i) * D + wg_acc_col(t, i)] = S[0][i];
    if constexpr (kFwd) {
      wg_store_z(Z, part + DI * D + 64 * w, t);  // Z is 0 without normalize
    } else if (tid < L::z_floats) {
      part[DI * D + tid] = normalizes<WithNormalizer>(p) && tid < z_width ? z[tid] : 0.f;
    }
    return;
  }
  if (seg != split.segments - 1) return;
  if constexpr (kFwd || Info::dv_like) {
    float* final_S = static_cast<float*>(kFwd ? p.final_S : p.d_initial_S);
    if (final_S != nullptr) {
#pragma unroll
      for (int i = 0; i < 32; ++i) final_S[mat_index(state_dim(i), wg_acc_col(t, i))] = S[0][i];
    }
  }
  if constexpr (kFwd) {
    if (p.final_z != nullptr && tile == 0) wg_store_z(Z, static_cast<float*>(p.final_z) + state_row * K + 64 * w, t);
  }
  if constexpr (kDk) {
    if (normalizes<WithNormalizer>(p) && p.d_initial_z != nullptr && tid < D) static_cast<float*>(p.d_initial_z)[state_row * K + c0 + tid] = z[tid];
  }
#elif defined(__CUDA_ARCH__)
  __trap();  // launched from an image without sm_90a code: fail loudly rather than leave outputs unwritten
#endif
}

}  // namespace attnrnn::cuda
