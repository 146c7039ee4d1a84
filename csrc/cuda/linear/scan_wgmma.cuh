// Chunkwise causal linear attention on warpgroup MMA (wgmma, sm_90a): the forward and the dq, dk, dv
// sweeps of the backward (the roles of scan_roles.cuh), bf16/fp16, inner
// dim DI in {64, 128} (padded head dims also 192 and 256). One warpgroup (128 threads) per (sequence [x segment], 64 output columns, kv
// head). A step is one (chunk of 64 tokens, query head) pair, in sweep order. With the role's row
// operand A and column operand B as DI / 64 swizzled 64 x 64 tiles each (wgmma.cuh; tile h holds dims
// [64h, 64h + 64)), Cv the block's 64 output columns of the value operand as one tile, and the state
// S [DI x 64] in fp32 registers (DI / 64 accumulators of 64 rows):
//   P = mask(A B^T)              s <= t on forward sweeps, s >= t on reverse ones (dk, dv)
//   O = A S_hi + A S_lo + P Cv   S as two 16-bit tiles the block writes after each update
//   S += B^T Cv                  after a chunk's last head (forward, dq); every head (dk, dv)
// Role by role (RoleInfo; dO'' = w dout with w_t = s / den_t, or s without normalize):
//   forward  o  = s O / den       den = s (A z + rowsum P) + eps (normalize), z += colsum B
//   dq       dq = O phi'(q)       normalize: P += dd_t, O += dd_t z, z += colsum Cv
//   dk       dk = sum_h O phi'(k) normalize: P += dd_s, O += dz,     dz += sum_t dd_t Cv_t
//   dv       dv = sum_h O
//   dk + dv  (kGradKV, DI = 64) the dv sweep, plus V as a fourth tile: dk's P' = mask(V dout^T) and
//            O' = V S^T_hi + V S^T_lo + P' Q (the state tiles read transposed), so one state serves both
// w enters where it costs least: dv scales its dout tile (Cv) in shared memory; dk at DI = 128 moves w
// from dout (B, DI columns) to phi(q) (Cv, 64 columns), so P takes dd_s / w_s and dz sums dd_t / w_t
// times w_t phi(q_t); dq keeps dout as loaded (its state moves with V and K alone): its scores take
// dd_t / w_t, and w_t scales its output rows at the end.
// dk and dv sum over the query heads of a group: A S enters once per chunk (A is the kv head's), the
// state moves with every head. The segment split (SegmentSplit) works as in mma_scan_kernel with this
// kernel's tiles and partial size (WgmmaLayout); the workspace is sized for whichever sweep runs.
// kPadded: the real inner dim may be less than DI and the output dim any multiple of 8; the tiles load
// zeros past the real columns, so every product over them adds nothing, and only real columns of S, z
// and the outputs are read or written (tiles.h, padded head dims).
#pragma once

#include "scan_roles.cuh"
#include "wgmma_tiles.cuh"
#include "../common/mma.cuh"
#include "../common/wgmma.cuh"
#include "wgmma_normalizer.cuh"

namespace attnrnn::cuda {

template <class T, ScanRole R, int DI, bool WithNormalizer, bool kPadded = false>
__global__ void __launch_bounds__(kScanThreads, WgmmaLayoutOf<R, DI>::min_blocks)
    wgmma_scan_kernel(const ChunkArgs p, const SegmentSplit split, const ScanFeatures feat) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  static_assert(R != ScanRole::kGradKV || DI == 64, "the fused dk + dv sweep is for K = V = 64");
  static_assert(!kPadded || R != ScanRole::kGradKV, "the fused dk + dv sweep is for K = V = 64 exactly");
  using Info = RoleInfo<R>;
  using L = WgmmaLayoutOf<R, DI>;
  constexpr bool kFwd = R == ScanRole::kForward, kDq = R == ScanRole::kGradQ, kDk = R == ScanRole::kGradK;
  constexpr bool kDkv = R == ScanRole::kGradKV;  // kDk below is the separate dk sweep only
  constexpr bool kDkScalesCv = wg_dk_scales_cv<T, R, DI>;  // dk weighs phi(q), not dout
  constexpr int C = kChunk, D = 64, NS = L::stages, KT = L::KT;
  extern __shared__ __align__(1024) unsigned char smem[];
  if (smem_addr(smem) % 1024 != 0) __trap();  // the swizzle and the descriptors assume it
  unsigned char* Sh = smem + NS * L::stage;  // KT tiles [64 dims][64 cols]
  unsigned char* Sl = Sh + KT * kWgTileBytes;
  float* fl = reinterpret_cast<float*>(Sl + KT * kWgTileBytes);
  float* z = fl + L::z;

  const int64_t Hkv = p.num_kv_heads, G = p.num_heads / p.num_kv_heads, K = p.head_dim_k, V = p.head_dim_v;
  const int64_t out_cols = sweep_output_dim<R>(p), inner = sweep_inner_dim<R>(p);  // inner: DI where not kPadded
  const int tiles = sweep_tiles<kPadded>(out_cols, D);
  const SweepBlock block = sweep_block(tiles, split.segments);
  const int tile = block.tile, seg = block.seg;
  const int64_t n = block.n, g = block.g;
  const int c0 = tile * D;
  const int tid = threadIdx.x;
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
  // f(x, d, c) for each state element x = S[d][c] of this thread.
  float S[KT][32];
  auto for_each_state = [&](auto&& f) {
#pragma unroll
    for (int h = 0; h < KT; ++h)
#pragma unroll
      for (int i = 0; i < 32; ++i) f(S[h][i], 64 * h + wg_acc_row(tid, i), wg_acc_col(tid, i));
  };
  // ... on the real elements only (kPadded: d < inner, c0 + c < out_cols)
  auto for_each_real_state = [&](auto&& f) {
    for_each_state([&](float& x, int d, int c) {
      if (!kPadded || (d < inner && c0 + c < out_cols)) f(x, d, c);
    });
  };
  auto hold_state = [&]() {
#pragma unroll
    for (int h = 0; h < KT; ++h) wg_hold(S[h]);
  };
  const int earlier = split.state_only ? 0 : seg;  // partials of the segments before this one

  // ---- initial state: S in registers, z in shared memory ---------------------------------------
  {
    const float* S0 = static_cast<const float*>(Info::reverse ? p.d_final_S : p.initial_S);
    if constexpr (kPadded) for_each_state([](float& x, int, int) { x = 0.f; });
    load_initial_state(for_each_real_state, split.state_only ? nullptr : S0, mat_index, partial_at, earlier, D);
  }
  // z: the forward's key sums on the inner dims; dq's key sums and dk's dz on the output columns
  constexpr int z_width = kFwd ? DI : (kDq || kDk || kDkv) ? D : 0;
  auto z_initial = [&](int i) {
    const float* z0 = static_cast<const float*>(kDk || kDkv ? p.d_final_z : p.initial_z);
    const int64_t zi = state_row * K + (kFwd ? 0 : c0) + i;
    if (kPadded && (kFwd ? 0 : c0) + i >= K) return 0.f;
    float x = (z0 != nullptr && !split.state_only) ? z0[zi] : 0.f;
    for (int j = 0; j < earlier; ++j) x += partial_at(j)[DI * D + i];
    return x;
  };
  if (z_width > 0 && normalizes<WithNormalizer>(p)) {
    if constexpr (z_width > kScanThreads) {
      for (int i = tid; i < z_width; i += kScanThreads) z[i] = z_initial(i);
    } else if (tid < z_width) {
      z[tid] = z_initial(tid);
    }
  }
  // The forward's z split for the bf16 sums (wg_split_operand), in dd's place, renewed with z
  constexpr bool kSplitZ = kFwd && std::is_same_v<T, __nv_bfloat16>;
  static_assert(L::z - L::dd >= DI, "the forward's split z (one word per dim) fits in dd's place");
  uint32_t* zs = reinterpret_cast<uint32_t*>(fl + L::dd);
  if (kSplitZ && normalizes<WithNormalizer>(p)) split_vector<T>(z_initial, DI, zs, tid);
  // S as 16-bit hi + lo tiles [d][c] for the products A S
  auto publish_state = [&]() { wg_publish_state<T, KT>(S, Sh, Sl, tid); };
  if (!split.state_only) publish_state();

  // ---- the steps: (chunk, query head) pairs of this segment, in sweep order ---------------------
  const WgSteps walk(seq, g, G, C, split, seg);
  const int steps = walk.count();
  using Step = WgStep;
  using Walk = WgSteps::Walk;
  auto step_of = [&](const Walk& w) { return walk.at<Info::reverse>(w); };
  auto advance = [&](Walk& w) { walk.advance(w); };
  // the operands' tile sources, hoisted (WgSource); tiles are laid out by wg_at (wgmma.cuh)
  auto source = [&](Operand o, int col0) {
    return wg_source<T>(tc_view(p, feat, o), seq, col0, tid, operand_dim(o, K, V));
  };
  const WgSource<T> a_src = source(Info::a, 0), b_src = source(Info::b, 0), c_src = source(Info::c, c0),
                    v_src = source(Operand::kV, 0);
  auto head_of = [&](Operand src, const Step& s) { return per_query_head(src) ? s.h : g; };
  auto load_tiles = [&](unsigned char* dst, const WgSource<T>& src, int64_t head, int width, const Step& s) {
    wg_load_tiles<T, kPadded>(dst, src, head, width, s.t0, s.cl, tid);
  };
  // The backward's per-token weights of a step, loaded before its tiles are waited for: w of the rows
  // this thread copies (dv scales its pieces of the dout tile with them, dk those of dout or of
  // phi(q): kDkScalesCv), and dq's w and dd of its two accumulator rows: dq keeps dout as loaded (its
  // state moves with V and K alone), so w scales its output rows in the epilogue and dd enters the
  // scores as dd / w (divided after the scores' product). dk's dd (one per score column) comes with
  // the tiles into shared memory.
  struct Weights {
    float w[C / 16], dd[2], wr[2];
  };
  auto weights_of = [&](const Step& s) {
    Weights wt{};
    if constexpr (!kFwd) {
      auto weight = [&](const float* ws, int r, float otherwise) {
        return normalizes<WithNormalizer>(p) && r < s.cl ? ws[token_index(p, seq, s.t0 + r, s.h)] : otherwise;
      };
      if constexpr (kDq) {
        if (!split.state_only)  // pass 1 of a split only moves dq's state (V, phi(k))
          dq_row_weights(weight, ws_w, ws_dd, wg_acc_row(tid, 0), scale, wt.wr, wt.dd);
      } else {
#pragma unroll
        for (int j = 0; j < C / 16; ++j) wt.w[j] = weight(ws_w, tid / 8 + 16 * j, scale);
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
    if (!split.state_only) load_tiles(st, a_src, head_of(Info::a, s), DI, s);
    load_tiles(st + KT * kWgTileBytes, b_src, head_of(Info::b, s), DI, s);
    load_tiles(st + 2 * KT * kWgTileBytes, c_src, head_of(Info::c, s), D, s);
    if (kDkv && !split.state_only) load_tiles(st + 3 * kWgTileBytes, v_src, g, D, s);
    if (kDkScalesCv && normalizes<WithNormalizer>(p))
      wg_load_row_dd<C / 16>(fl + L::dd + (i % NS) * C, ws_dd, 16, s.cl, tid, p, seq, s.t0, s.h);
    if (((kDk && !kDkScalesCv) || kDkv) && normalizes<WithNormalizer>(p) && tid < C) {
      const bool valid = tid < s.cl;
      cp_async4(fl + L::dd + (i % NS) * C + tid, ws_dd + (valid ? token_index(p, seq, s.t0 + tid, s.h) : 0), valid);
    }
  };
  // rows times w, in place: dv's dout; dk's phi(q) (kDkScalesCv, with wg_dd_over_w) or dout
  auto scale_rows = [&](unsigned char* tile, int width, const Step& s, const Weights& wt) {
    wg_scale_rows<T>(tile, width, s.cl, wt.w, tid);
  };


  for (int i = 0; i < NS - 1; ++i) {
    if (i < steps) issue(i);
    cp_async_commit();
  }
  Walk current = walk.start();
  bool nonfinite = false;  // a row this thread wrote was not finite (note_nonfinite, after the steps)
  float O[32];  // the step's output; dk and dv keep summing it over a group's heads
  float O2[32];  // the fused sweep's dk sum (its O is dv's)
  // The backward's weights a step ahead: loaded at their own step's start, the tiles' scaling and
  // dq's division waited on them (ncu: 4-6% of dk's stall samples); now a whole step hides them.
  Weights next_wt = steps > 0 ? weights_of(step_of(current)) : Weights{};
  for (int i = 0; i < steps; ++i) {
    const Step s = step_of(current);
    advance(current);
    const Weights wt = next_wt;
    if (i + 1 < steps) next_wt = weights_of(step_of(current));
    cp_async_wait<NS - 2>();  // this step's tiles (the groups of the NS - 2 steps after it may run on)
    unsigned char* At = stage(i);
    unsigned char* Bt = At + KT * kWgTileBytes;
    unsigned char* Ct = Bt + KT * kWgTileBytes;
    unsigned char* Vt = Ct + kWgTileBytes;  // the fused sweep's fourth tile
    float* dd_cols = fl + L::dd + (i % NS) * C;  // dk: dd (/ w when it scales phi(q)) of the step's tokens
    // relu on this thread's own pieces of the q and k tiles (ScanFeatures::relu_in_sweep), before w scales them.
    // Not in the fused dk + dv sweep with the normalizer (the plan's Features::kPass): there it made ptxas
    // load a spilled register in every step.
    if constexpr (!(kDkv && WithNormalizer)) {
      if (!split.state_only && relu_in_sweep(feat, Info::a)) wg_relu_rows<T>(At, DI, s.cl, tid);
      if (relu_in_sweep(feat, Info::b)) wg_relu_rows<T>(Bt, DI, s.cl, tid);
      if (relu_in_sweep(feat, Info::c)) wg_relu_rows<T>(Ct, D, s.cl, tid);
    }
    if constexpr (kDkScalesCv) {
      scale_rows(Ct, D, s, wt);
      if (normalizes<WithNormalizer>(p)) wg_dd_over_w(dd_cols, wt.w, 16, tid);
    } else if constexpr (kDk) {
      scale_rows(Bt, DI, s, wt);
    } else if constexpr (Info::dv_like) {
      scale_rows(Ct, D, s, wt);
    }
    wg_fence_shared();  // cp.async and st.shared writes before the products read them
    // Every warp has its tiles, the last step's state tiles and z, and is done with the last step's
    // stage, which the next load may now refill (one barrier where the step used to end in a second).
    __syncthreads();
    if (i + NS - 1 < steps) issue(i + NS - 1);
    cp_async_commit();

    const bool update = Info::group_sum || s.last;  // S moves after this step
    if (!split.state_only) {
      // ---- P = A B^T, and O = A S_hi + A S_lo once per output --------------------------------------
      float P[32];
      const bool fresh_output = !Info::group_sum || s.first;
      hold_state();
      if constexpr (Info::group_sum) wg_hold(O);  // O carries the group's sum from earlier heads
      if constexpr (kDkv) wg_hold(O2);
      // Stages: P; A S (fresh outputs), running while P is masked; P Cv; the state's update, running
      // while the epilogue writes O (DI >= 128). No stage's accumulators are touched while it runs,
      // and the update's stage ends inside its branch: otherwise ptxas serializes the products
      // (C7515, seen when that stage ended after the branch). kSpillOrder: at DI = 256 the state alone
      // takes 128 registers, and A S running beside P and its packed copy spilled 300-700 bytes in
      // every sweep; there the forward and dq run A S in P Cv's stage, after the mask, and the
      // epilogue after the update (forward spills 312 -> 108 bytes, 692 -> 384 with the normalizer,
      // dq's 296 -> 136 and 496 -> 256; K = V = 256 at B4-T8192-H8 on an H100: 0.770 -> 0.602 ms
      // unnormalized, 1.473 -> 1.414 normalized). dk's and dv's spills stayed or grew that way
      // (376 -> 364, 420 -> 632 bytes), so they keep the order of the other dims.
      constexpr bool kSpillOrder = DI > 192 && (kFwd || kDq);  // the forward and dq at DI = 256
      constexpr bool kStateProductFirst = !kSpillOrder;
      wg_fence();
      wg_scores<T, DI>(P, At, Bt);
      wg_commit();
      wg_wait_all();
      wg_hold(P);
      if (kStateProductFirst && fresh_output) {
        wg_fence();
        wg_state_product<T, DI>(O, At, Sh, Sl);
        if constexpr (kDkv) wg_state_product<T, D, true>(O2, Vt, Sh, Sl);  // dk's V S^T
        wg_commit();
      }

      // ---- mask P (with dq's / dk's dd terms), its row sums (forward), P as the A operand of P Cv ---
      float dq_dd[2] = {wt.dd[0], wt.dd[1]};  // dq's dd / w: dq_row_weights' loads have landed by now
      if (kDq && normalizes<WithNormalizer>(p)) dq_dd_over_w(wt.wr, dq_dd);
      float rowsum[2] = {0.f, 0.f};
      uint32_t pa[4][4];
      auto mask_scores = [&](bool dd_col_terms) {
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            const int e = 8 * j + 2 * q, r = wg_acc_row(tid, e), col = wg_acc_col(tid, e);
            float x0 = P[e], x1 = P[e + 1];
            if (kDq && normalizes<WithNormalizer>(p)) x0 += dq_dd[q & 1], x1 += dq_dd[q & 1];
            if (dd_col_terms && normalizes<WithNormalizer>(p)) x0 += dd_cols[col], x1 += dd_cols[col + 1];
            x0 = (Info::reverse ? col >= r : col <= r) ? x0 : 0.f;
            x1 = (Info::reverse ? col + 1 >= r : col + 1 <= r) ? x1 : 0.f;
            rowsum[q & 1] += x0 + x1;
            pa[j][q] = pack2<T>(x0, x1);
          }
      };
      mask_scores(kDk);
      // O += (dd_t / w_t) z (dq) or dz (dk), output columns, once A S is in
      auto add_z_terms = [&]() {
        if constexpr (kDq || kDk || kDkv) {
          if (normalizes<WithNormalizer>(p) && fresh_output) {
            float(&dz_target)[32] = kDkv ? O2 : O;
#pragma unroll
            for (int e = 0; e < 32; ++e) dz_target[e] += (kDq ? dq_dd[(e >> 1) & 1] : 1.f) * z[wg_acc_col(tid, e)];
          }
        }
      };
      if constexpr (kStateProductFirst) {
        wg_wait_all();  // A S
        wg_hold(O);
        if constexpr (kDkv) wg_hold(O2);
        add_z_terms();
      }
      // P Cv (after A S where that waited: kStateProductFirst); in the fused sweep, dk's scores
      // P = V dout^T join its stage (P is free, pa still read)
      auto pv = [&]() {
        if constexpr (!kStateProductFirst) {
          if (fresh_output) wg_state_product<T, DI>(O, At, Sh, Sl);
        }
        wg_scores_times<T>(O, pa, Ct);
        if constexpr (kDkv) wg_scores<T, D>(P, Vt, Ct);
      };
      wg_hold(O);
      if constexpr (kDkv) wg_hold(O2);
      hold_state();
      wg_hold(pa);
      wg_fence();
      pv();
      wg_commit();
      wg_wait_all();
      wg_hold(O);
      if constexpr (!kStateProductFirst) add_z_terms();
      if constexpr (kDkv) {  // ---- dk: mask P (+ dd_t), O' += P Q --------------------------------
        wg_hold(P);
        mask_scores(true);
        wg_hold(O2);
        wg_hold(pa);
        wg_fence();
        wg_scores_times<T>(O2, pa, Bt);
        wg_commit();
        wg_wait_all();
        wg_hold(O2);
      }

      // ---- epilogue: one output per query head, or the group's sum after its last head -------------
      auto epilogue = [&]() {
        if (Info::group_sum && !s.last) return;
        float inv[2] = {1.f, 1.f};
        if constexpr (kDq) inv[0] = wt.wr[0], inv[1] = wt.wr[1];
        if constexpr (kFwd) {
          inv[0] = inv[1] = scale;
          if (normalizes<WithNormalizer>(p)) {
            float qz[2];
            wg_row_dot_z<T, DI>(At, z, zs, tid, qz);
            wg_forward_scale(rowsum, qz, scale, eps, inv);
            if (p.den_out != nullptr && tile == 0) {
              const int r0 = wg_acc_row(tid, 0);
              store_den(p, seq, s.t0 + r0, s.h, s.cl - r0, inv, tid % 32);
            }
          }
        }
        const int64_t out_head = Info::group_sum ? g : s.h;
        const bool phi_used = p.feature_map != FeatureMap::kIdentity;
        // staged through the A tile: every product that reads it is done (the update reads B and Cv).
        // Not where staging spills under the 3-blocks-per-SM register budget of DI = 64 with the
        // normalizer: the forward (16 bytes; 251 us against 200 at B8-T4096-H32-D64) and fp16's dk (24).
        constexpr bool kStaged =
            !(DI == 64 && WithNormalizer && (kFwd || (kDk && std::is_same_v<T, __half>)));
        auto write_rows = [&](const MutView out, const float(&acc)[32], bool dphi_of, const ConstView phi_rows) {
          nonfinite |= wg_write_rows<T, 16, kPadded>(out, acc, inv, p.feature_map, dphi_of, phi_rows, seq.b, s.t0,
                                                     s.cl, out_head, c0, tid, kStaged ? At : nullptr,
                                                     static_cast<int>(out_cols - c0));
        };
        if constexpr (kFwd) write_rows(p.o, O, false, p.q);
        if constexpr (kDq) write_rows(p.dq, O, phi_used, dphi_rows(feat.q, p.q));
        if constexpr (kDk) write_rows(p.dk, O, phi_used, dphi_rows(feat.k, p.k));
        if constexpr (Info::dv_like) write_rows(p.dv, O, false, p.k);
        if constexpr (kDkv) write_rows(p.dk, O2, phi_used, dphi_rows(feat.k, p.k));
      };
      // At DI >= 128 the epilogue runs while S += B^T Cv does (but the forward's and dq's at DI = 256:
      // kSpillOrder's note); at DI = 64 its second copy (one per branch) made the forward spill
      // 64 bytes instead of 8 under the 3-blocks-per-SM budget.
      constexpr bool kEpilogueInShadow = DI >= 128 && !kSpillOrder;
      if (update) {
        wg_fence();
        wg_update_state<T, KT>(S, Bt, Ct);
        wg_commit();
        if constexpr (kEpilogueInShadow) epilogue();
        wg_wait_all();
        hold_state();
      }
      if (!kEpilogueInShadow || !update) epilogue();
    } else if (update) {
      // ---- pass 1 of a split: only the state moves ------------------------------------------------
      hold_state();
      wg_fence();
      wg_update_state<T, KT>(S, Bt, Ct);
      wg_commit();
      wg_wait_all();
      hold_state();
    }

    __syncthreads();  // every warp is done with this stage, S_hi / S_lo and z
    if (update) {
      if (normalizes<WithNormalizer>(p)) {
        if constexpr (kFwd)  // z += colsum phi(k), and its split
          wg_sum_columns<T, KT>(Bt, nullptr, z, kSplitZ ? zs : nullptr, tid);
        if constexpr (kDq) wg_add_column_sums<T, 1>(Ct, nullptr, z, tid);   // z += colsum phi(k), columns
        if constexpr (kDk) wg_add_column_sums<T, 1>(Ct, dd_cols, z, tid);   // dz += sum_t dd_t phi(q_t)
        if constexpr (kDkv) wg_add_column_sums<T, 1>(Bt, dd_cols, z, tid);  // the same: Q is the B tile here
      }
      if (!split.state_only) publish_state();
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // the last step's z (its column sums ran after the step's last barrier)
  note_nonfinite(p, state_row, nonfinite);

  // ---- pass 1: this segment's partial; otherwise the final state, from the last segment ---------
  if (split.state_only) {
    float* part = partial_at(seg);
    for_each_state([&](float& x, int d, int c) { part[d * D + c] = x; });
    if constexpr (L::z_floats > kScanThreads) {
      for (int i = tid; i < L::z_floats; i += kScanThreads)
        part[DI * D + i] = normalizes<WithNormalizer>(p) && i < z_width ? z[i] : 0.f;
    } else if (tid < L::z_floats) {
      part[DI * D + tid] = normalizes<WithNormalizer>(p) && tid < z_width ? z[tid] : 0.f;
    }
    return;
  }
  if (seg != split.segments - 1) return;
  if constexpr (kFwd || Info::dv_like) {
    float* final_S = static_cast<float*>(kFwd ? p.final_S : p.d_initial_S);
    if (final_S != nullptr) for_each_real_state([&](float& x, int d, int c) { final_S[mat_index(d, c)] = x; });
  }
  if constexpr (kFwd) {
    if constexpr (DI > kScanThreads) {
      if (p.final_z != nullptr && tile == 0)
        for (int i = tid; i < K; i += kScanThreads) static_cast<float*>(p.final_z)[state_row * K + i] = z[i];
    } else if (p.final_z != nullptr && tile == 0 && tid < (kPadded ? K : DI)) {
      static_cast<float*>(p.final_z)[state_row * K + tid] = z[tid];
    }
  }
  if constexpr (kDk || kDkv) {
    if (normalizes<WithNormalizer>(p) && p.d_initial_z != nullptr && tid < D && (!kPadded || c0 + tid < K))
      static_cast<float*>(p.d_initial_z)[state_row * K + c0 + tid] = z[tid];
  }
#elif defined(__CUDA_ARCH__)
  __trap();  // launched from an image without sm_90a code: fail loudly rather than leave outputs unwritten
#endif
}

}  // namespace attnrnn::cuda
