// The forward-order sweeps with inner dim 128 on 128-token chunks and a pair of warpgroups (wgmma,
// sm_90a): the forward at K = 128 and the backward's dq at V = 128. Half the steps of chunk_wg.cuh's
// sweeps for ~1.3x the products per step, so the chain of copies, waits and barriers that sets a
// step's time is paid once per 128 tokens (docs/design.md, "What would get there", item 4). One
// block of 256 threads per (sequence [x segment], 64 output columns, kv head); a step is one (chunk
// of 128 tokens, query head) pair. With the role's operands A, B, Cv as in chunk_wg.cuh (forward:
// Q, K, V; dq: w dout, V, K), warpgroup w owns the chunk's rows [64 w, 64 w + 64) of A and the
// state's dims [64 w, 64 w + 64) (S_w, 64 x 64 fp32 in registers):
//   P_wb = mask(A_w B_b^T)        b <= w: warpgroup 0 scores rows 0-63 of B, warpgroup 1 rows 0-127
//   O_w  = A_w S_hi + A_w S_lo + sum_b P_wb Cv_b    S_hi / S_lo: both halves, published as tiles
//   S_w += B[:, dims of w]^T Cv   over the chunk's 128 tokens, after its last query head
//   forward  o  = s O / den,  den = s (A_w z + rowsum P_w) + eps (normalize), z += colsum B
//   dq       dq = O phi'(q);  normalize: P += dd_t, O += dd_t z, z += colsum Cv (output columns)
// The two warpgroups meet at the state: each publishes its half, and both read all of it in the
// next step's A S (two block barriers per step, as chunk_wg.cuh has per 64 tokens).
#pragma once

#include <type_traits>

#include "chunk_tc_plan.cuh"
#include "chunk_wg_tiles.cuh"
#include "mma.cuh"
#include "wgmma.cuh"
#include "wgmma_sums.cuh"

namespace attnrnn::cuda {

struct WgPairLayout {
  static constexpr int KT = 2;            // 64-dim tiles of A and B (inner dim 128)
  static constexpr int RB = 2;            // 64-row blocks of a 128-token chunk
  static constexpr int chunk = 64 * RB, threads = 256, stages = 2;
  // a stage: A and B [row block][dim tile], Cv [row block], each tile 64 x 64 (8 KiB): 80 KiB
  static constexpr int a = 0, b = RB * KT * kWgTileBytes, c = 2 * RB * KT * kWgTileBytes;
  static constexpr int stage = c + RB * kWgTileBytes;
  static constexpr int z_floats = 64 * KT;
  // two stages, S_hi and S_lo [dim tile], z: 192.5 KiB, one block per SM
  static constexpr int64_t smem_bytes = int64_t(stages) * stage + 2 * KT * kWgTileBytes + z_floats * 4;
  static constexpr int64_t partial_floats = WgLayout<128>::partial_floats;  // S [128][64], then z
  static_assert(smem_bytes + 1024 <= 228 * 1024, "one block must fit on an SM");
};

template <class T, TcRole R>
__global__ void __launch_bounds__(WgPairLayout::threads, 1)
    chunk_wg_pair_kernel(const LinearAttnParams p, const TcSplit split, const TcFeatures feat) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  static_assert(R == TcRole::kForward || R == TcRole::kGradQ, "the forward-order sweeps with one output per head");
  using L = WgPairLayout;
  using Info = TcRoleInfo<R>;
  constexpr bool kFwd = R == TcRole::kForward, kDq = R == TcRole::kGradQ;
  constexpr int C = L::chunk, D = 64, DI = 64 * L::KT, NS = L::stages, KT = L::KT;
  extern __shared__ __align__(1024) unsigned char smem[];
  if (smem_addr(smem) % 1024 != 0) __trap();  // the swizzle and the descriptors assume it
  unsigned char* Sh = smem + NS * L::stage;    // KT tiles [64 dims][64 cols]
  unsigned char* Sl = Sh + KT * kWgTileBytes;
  float* z = reinterpret_cast<float*>(Sl + KT * kWgTileBytes);  // key sums: inner dims or output columns
  const int tid = threadIdx.x, w = tid / 128, t = tid % 128;     // warpgroup, thread in it

  const int64_t Hkv = p.num_kv_heads, G = p.num_heads / p.num_kv_heads, K = p.head_dim_k, V = p.head_dim_v;
  const int tiles = static_cast<int>((kFwd ? V : K) / D), tile = blockIdx.x % tiles;
  const int64_t n = blockIdx.x / tiles / split.segments, g = blockIdx.y;
  const int seg = (blockIdx.x / tiles) % split.segments;
  const int c0 = tile * D;
  const Seq seq = sequence(p, n);
  const float scale = static_cast<float>(p.scale), eps = static_cast<float>(p.eps);
  const int64_t state_row = n * Hkv + g;
  const float* ws_w = kFwd ? nullptr : BwdWorkspace::den<float>(p);  // w_t = s / den_t (normalize)
  const float* ws_dd = kFwd ? nullptr : BwdWorkspace::dd<float>(p);
  // The state's element (d, c) in a [K][V] matrix: dq holds S^T.
  auto mat_index = [&](int d, int c) {
    return Info::transposed ? (state_row * K + c0 + c) * V + d : (state_row * K + d) * V + c0 + c;
  };
  auto partial_at = [&](int j) {
    const int64_t N = gridDim.x / tiles / split.segments;
    return split.partial + (((int64_t(j) * N + n) * Hkv + g) * tiles + tile) * L::partial_floats;
  };
  // This warpgroup's half of the state: S[0][i] is S[64 w + row][col] of accumulator element i.
  float S[1][32];
  auto state_dim = [&](int i) { return 64 * w + wg_acc_row(t, i); };
  const int earlier = split.state_only ? 0 : seg;  // partials of the segments before this one

  // ---- initial state: S in registers, z in shared memory ---------------------------------------
  {
    const float* S0 = static_cast<const float*>(p.initial_S);
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      const int d = state_dim(i), c = wg_acc_col(t, i);
      float x = (S0 != nullptr && !split.state_only) ? S0[mat_index(d, c)] : 0.f;
      for (int j = 0; j < earlier; ++j) x += partial_at(j)[d * D + c];
      S[0][i] = x;
    }
  }
  constexpr int z_width = kFwd ? DI : D;  // the forward's z on the inner dims, dq's on the output columns
  if (p.normalize && tid < z_width) {
    const float* z0 = static_cast<const float*>(p.initial_z);
    float x = (z0 != nullptr && !split.state_only) ? z0[state_row * K + (kFwd ? 0 : c0) + tid] : 0.f;
    for (int j = 0; j < earlier; ++j) x += partial_at(j)[DI * D + tid];
    z[tid] = x;
  }
  auto publish_state = [&]() { wg_publish_state<T, 1>(S, Sh + w * kWgTileBytes, Sl + w * kWgTileBytes, t); };
  if (!split.state_only) publish_state();

  // ---- the steps: (chunk, query head) pairs of this segment, chunk-major ------------------------
  const WgSteps walk(seq, g, G, C, split, seg);
  const int steps = walk.count();
  using Step = WgStep;
  using Walk = WgSteps::Walk;
  auto step_of = [&](const Walk& wk) { return walk.at<false>(wk); };
  auto advance = [&](Walk& wk) { walk.advance(wk); };
  auto source = [&](const ConstView& v, int col0) {
    return WgSource<T>{static_cast<const T*>(v.data) + seq.b * v.stride_b + col0 + (tid % 8) * 8, v.stride_t, v.stride_h};
  };
  const WgSource<T> a_src = source(tc_view(p, feat, Info::a), 0), b_src = source(tc_view(p, feat, Info::b), 0),
                    c_src = source(tc_view(p, feat, Info::c), c0);
  auto head_of = [&](TcSrc src, const Step& s) { return per_query_head(src) ? s.h : g; };
  // dq's per-token weights of a step, loaded before its tiles are waited for: w of the rows this
  // thread copies (it scales its own pieces of the dout tile) and dd of its two accumulator rows.
  struct Weights {
    float w[4], dd[2];
  };
  auto weights_of = [&](const Step& s) {
    Weights wt{};
    if (kDq && !split.state_only) {
      auto weight = [&](const float* ws, int r, float otherwise) {
        return p.normalize && r < s.cl ? ws[token_index(p, seq, s.t0 + r, s.h)] : otherwise;
      };
#pragma unroll
      for (int j = 0; j < 4; ++j) wt.w[j] = weight(ws_w, tid / 8 + 32 * j, scale);
      wt.dd[0] = weight(ws_dd, 64 * w + wg_acc_row(t, 0), 0.f);
      wt.dd[1] = weight(ws_dd, 64 * w + wg_acc_row(t, 0) + 8, 0.f);
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
  };
  // k16 slice j of the 128 dims: tile j / 4, 32 bytes (along rows) or 2048 bytes (down rows) per slice
  auto along = [](int j) { return (j / 4) * kWgTileBytes + 32 * (j % 4); };
  auto down = [](int j) { return (j / 4) * kWgTileBytes + 2048 * (j % 4); };

  // One step of warpgroup W (a compile-time 0 or 1, so that every wgmma stage lies inside one side
  // of the branch on w: a branch inside a stage makes ptxas serialize the products, C7515).
  auto step_of_warpgroup = [&](auto W_, const Step& s, const unsigned char* st, const Weights& wt) {
    constexpr int W = decltype(W_)::value;
    const unsigned char* Bt = st + L::b;
    const unsigned char* Ct = st + L::c;
    const bool update = s.last;  // S moves after the chunk's last query head
    auto update_state = [&]() {  // S_W += B[:, dims of W]^T Cv over the chunk's 128 tokens
#pragma unroll
      for (int b = 0; b < L::RB; ++b)
#pragma unroll
        for (int j = 0; j < 4; ++j)
          wg_mma_ss<T, 1, 1>(S[0], wg_descriptor(Bt, (b * KT + W) * kWgTileBytes + 2048 * j),
                             wg_descriptor(Ct, b * kWgTileBytes + 2048 * j), 1);
    };
    if (split.state_only) {  // ---- pass 1 of a split: only the state moves ------------------------
      if (update) {
        wg_hold(S[0]);
        wg_fence();
        update_state();
        wg_commit();
        wg_wait_all();
        wg_hold(S[0]);
      }
      return;
    }
    const unsigned char* Aw = st + L::a + W * KT * kWgTileBytes;  // this warpgroup's 64 rows of A
    const int row0 = 64 * W, cl = s.cl - row0;                   // its rows of the chunk, cl valid
    // ---- P_b = A_W B_b^T for the row blocks b <= W of B ----------------------------------------
    float P[W + 1][32];
    wg_hold(S[0]);
    wg_fence();
#pragma unroll
    for (int b = 0; b <= W; ++b)
#pragma unroll
      for (int j = 0; j < DI / 16; ++j)
        wg_mma_ss<T, 0, 0>(P[b], wg_descriptor(Aw, along(j)), wg_descriptor(Bt + b * KT * kWgTileBytes, along(j)), j > 0);
    wg_commit();
    wg_wait_all();
#pragma unroll
    for (int b = 0; b <= W; ++b) wg_hold(P[b]);
    // ---- O = A_W S_hi + A_W S_lo, running while P is masked -----------------------------------
    float O[32];
    wg_fence();
#pragma unroll
    for (int j = 0; j < DI / 16; ++j) wg_mma_ss<T, 0, 1>(O, wg_descriptor(Aw, along(j)), wg_descriptor(Sh, down(j)), j > 0);
#pragma unroll
    for (int j = 0; j < DI / 16; ++j) wg_mma_ss<T, 0, 1>(O, wg_descriptor(Aw, along(j)), wg_descriptor(Sl, down(j)), 1);
    wg_commit();
    // ---- mask (with dq's dd_t): block W is the diagonal one (col <= row); earlier blocks are whole --
    float rowsum[2] = {0.f, 0.f};
    uint32_t pa[W + 1][4][4];
#pragma unroll
    for (int b = 0; b <= W; ++b)
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const int e = 8 * j + 2 * q, r = wg_acc_row(t, e), col = wg_acc_col(t, e);
          float x0 = P[b][e], x1 = P[b][e + 1];
          if (kDq && p.normalize) x0 += wt.dd[q & 1], x1 += wt.dd[q & 1];
          if (b == W) {
            x0 = col <= r ? x0 : 0.f;
            x1 = col + 1 <= r ? x1 : 0.f;
          }
          rowsum[q & 1] += x0 + x1;
          pa[b][j][q] = pack2<T>(x0, x1);
        }
    wg_wait_all();  // A S
    wg_hold(O);
    if constexpr (kDq) {
      if (p.normalize) {  // O += dd_t z on the output columns
#pragma unroll
        for (int e = 0; e < 32; ++e) O[e] += wt.dd[(e >> 1) & 1] * z[wg_acc_col(t, e)];
      }
    }
    // ---- O += P_b Cv_b --------------------------------------------------------------------------
    wg_hold(S[0]);
#pragma unroll
    for (int b = 0; b <= W; ++b) wg_hold(pa[b]);
    wg_fence();
#pragma unroll
    for (int b = 0; b <= W; ++b)
#pragma unroll
      for (int j = 0; j < 4; ++j) wg_mma_rs<T, 1>(O, pa[b][j], wg_descriptor(Ct + b * kWgTileBytes, 2048 * j), 1);
    wg_commit();
    wg_wait_all();
    wg_hold(O);
    // ---- epilogue: o = s O / den or dq = O phi'(q) for this warpgroup's rows ---------------------
    auto epilogue = [&]() {
      if constexpr (kFwd) {
        float inv[2] = {scale, scale};
        if (p.normalize) {
          wg_forward_scale<T, DI>(rowsum, Aw, z, t, scale, eps, inv);
          if (p.den_out != nullptr && tile == 0) {
            const int r0 = wg_acc_row(t, 0);
            store_den(p, seq, s.t0 + row0 + r0, s.h, cl - r0, inv, t % 32);
          }
        }
        wg_write_rows<T>(p.o, O, inv, p.feature_map, false, p.q, seq.b, s.t0 + row0, cl, s.h, c0, t);
      } else {
        const float one[2] = {1.f, 1.f};
        wg_write_rows<T>(p.dq, O, one, p.feature_map, p.feature_map != FeatureMap::kIdentity, p.q, seq.b,
                         s.t0 + row0, cl, s.h, c0, t);
      }
    };
    // The epilogue after the update, not while it runs: in its shadow the bf16 kernel spilled 40 B
    // (255 registers); the other warpgroup's products fill the gap instead.
    if (update) {
      wg_fence();
      update_state();
      wg_commit();
      wg_wait_all();
      wg_hold(S[0]);
    }
    epilogue();
  };

  for (int i = 0; i < NS - 1; ++i) {
    if (i < steps) issue(i);
    cp_async_commit();
  }
  Walk current = walk.start();
  for (int i = 0; i < steps; ++i) {
    const Step s = step_of(current);
    advance(current);
    const Weights wt = weights_of(s);
    cp_async_wait<NS - 2>();  // this step's tiles
    unsigned char* st = stage(i);
    // dq: dout rows times w, in place: this thread's own pieces, which the wait made visible to it
    if (kDq && !split.state_only) wg_scale_pair_rows<T>(st + L::a, DI, s.cl, wt.w, tid);
    wg_fence_shared();  // cp.async and st.shared writes before the products read them
    // Every warp has the step's tiles, the last step's state tiles and z, and is done with the last
    // step's stage, which the next load may now refill.
    __syncthreads();
    if (i + NS - 1 < steps) issue(i + NS - 1);
    cp_async_commit();
    if (w == 0)
      step_of_warpgroup(std::integral_constant<int, 0>{}, s, st, wt);
    else
      step_of_warpgroup(std::integral_constant<int, 1>{}, s, st, wt);
    __syncthreads();  // both warpgroups are done with this stage, S_hi / S_lo and z
    if (s.last && p.normalize) {
      if constexpr (kFwd) {  // z += colsum B: warpgroup w sums its 64 dims over both row blocks
#pragma unroll
        for (int b = 0; b < L::RB; ++b)
          wg_add_column_sums<T, 1>(st + L::b + (b * KT + w) * kWgTileBytes, nullptr, z + 64 * w, t);
      } else if (w == 0) {  // z += colsum Cv on the output columns (one writer per column)
#pragma unroll
        for (int b = 0; b < L::RB; ++b) wg_add_column_sums<T, 1>(st + L::c + b * kWgTileBytes, nullptr, z, t);
      }
    }
    if (s.last) {
      if (!split.state_only) publish_state();
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // the last step's z (its column sums ran after the step's last barrier)

  // ---- pass 1: this segment's partial; otherwise the final state, from the last segment ---------
  if (split.state_only) {
    float* part = partial_at(seg);
#pragma unroll
    for (int i = 0; i < 32; ++i) part[state_dim(i) * D + wg_acc_col(t, i)] = S[0][i];
    if (tid < L::z_floats) part[DI * D + tid] = p.normalize && tid < z_width ? z[tid] : 0.f;
    return;
  }
  if (seg != split.segments - 1) return;
  if constexpr (kFwd) {
    float* final_S = static_cast<float*>(p.final_S);
    if (final_S != nullptr) {
#pragma unroll
      for (int i = 0; i < 32; ++i) final_S[mat_index(state_dim(i), wg_acc_col(t, i))] = S[0][i];
    }
    if (p.final_z != nullptr && tile == 0 && tid < DI) static_cast<float*>(p.final_z)[state_row * K + tid] = z[tid];
  }
#elif defined(__CUDA_ARCH__)
  __trap();  // launched from an image without sm_90a code: fail loudly rather than leave outputs unwritten
#endif
}

}  // namespace attnrnn::cuda
