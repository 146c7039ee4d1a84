// Chunkwise causal linear attention forward on warpgroup MMA (wgmma, sm_90a), K = 64, bf16/fp16.
// One warpgroup (128 threads) per (sequence [x segment], 64 value columns, kv head). A step is one
// (chunk of 64 tokens, query head) pair, as in chunk_tc_kernel. With Q = phi(q), K = phi(k) and V
// the block's value columns as swizzled 64 x 64 tiles (wgmma.cuh) and the state S [64 x 64] in fp32
// registers:
//   P = mask(Q K^T)               key s <= query t
//   O = Q S_hi + Q S_lo + P V     S as two 16-bit tiles the block writes after each chunk
//   o = s O / den                 den = s (Q z + rowsum P) + eps with normalize; den = 1 without
//   S += K^T V, z += colsum K     after the chunk's last query head
// The segment split (TcSplit) and its partials are chunk_tc_kernel's, so the workspace is the same.
#pragma once

#include "chunk_tc_plan.cuh"
#include "mma.cuh"
#include "wgmma.cuh"

namespace attnrnn::cuda {

constexpr int kWgStages = 2;
constexpr int kWgMinBlocks = 3;  // 3 x 65 KiB of shared memory per SM; <= 170 registers
// stages x {Q, K, V} tiles, S_hi, S_lo (8 KiB each), z [64] floats, and 1 KiB to align the tiles.
constexpr int64_t kWgSmemBytes = (kWgStages * 3 + 2) * kWgTileBytes + 64 * 4 + 1024;
// The segment rule (tc_segments) and the workspace's partials count blocks per SM from TcLayout.
static_assert(kWgMinBlocks == TcLayout<64>::min_blocks, "chunk_wg and TcLayout<64> must agree on blocks per SM");

template <class T>
__global__ void __launch_bounds__(kTcThreads, kWgMinBlocks)
    chunk_wg_fwd_kernel(const LinearAttnParams p, const TcSplit split, const TcFeatures feat) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int C = kTcChunk, D = 64, NS = kWgStages;
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  unsigned char* Sh = smem + NS * 3 * kWgTileBytes;
  unsigned char* Sl = Sh + kWgTileBytes;
  float* z = reinterpret_cast<float*>(Sl + kWgTileBytes);

  const int64_t Hkv = p.num_kv_heads, G = p.num_heads / p.num_kv_heads, V = p.head_dim_v;
  const int tiles = static_cast<int>(V / D), tile = blockIdx.x % tiles;
  const int64_t n = blockIdx.x / tiles / split.segments, g = blockIdx.y;
  const int seg = (blockIdx.x / tiles) % split.segments;
  const int c0 = tile * D;
  const int tid = threadIdx.x, t2 = (tid & 3) * 2;
  const Seq seq = sequence(p, n);
  const float scale = static_cast<float>(p.scale), eps = static_cast<float>(p.eps);
  const int64_t state_row = n * Hkv + g;
  auto state_index = [&](int d, int c) { return (state_row * D + d) * V + c0 + c; };
  auto partial_at = [&](int j) {
    const int64_t N = gridDim.x / tiles / split.segments;
    return split.partial + (((int64_t(j) * N + n) * Hkv + g) * tiles + tile) * tc_partial_floats<D>();
  };
  const int earlier = split.state_only ? 0 : seg;  // partials of the segments before this one

  // ---- initial state: S in registers, z in shared memory ---------------------------------------
  float S[32];
  {
    const float* S0 = static_cast<const float*>(p.initial_S);
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      const int d = wg_acc_row(tid, i), c = wg_acc_col(tid, i);
      float x = (S0 != nullptr && !split.state_only) ? S0[state_index(d, c)] : 0.f;
      for (int j = 0; j < earlier; ++j) x += partial_at(j)[d * D + c];
      S[i] = x;
    }
  }
  if (p.normalize && tid < D) {
    const float* z0 = static_cast<const float*>(p.initial_z);
    float x = (z0 != nullptr && !split.state_only) ? z0[state_row * D + tid] : 0.f;
    for (int j = 0; j < earlier; ++j) x += partial_at(j)[D * D + tid];
    z[tid] = x;
  }
  // S as 16-bit hi + lo tiles [d][c] for the products Q S.
  auto publish_state = [&]() {
#pragma unroll
    for (int i = 0; i < 32; i += 2) {
      const int off = wg_swizzled(wg_acc_row(tid, i), wg_acc_col(tid, i));
      const uint32_t hi = pack2<T>(S[i], S[i + 1]);
      const float2 back = unpack2<T>(hi);
      *reinterpret_cast<uint32_t*>(Sh + off) = hi;
      *reinterpret_cast<uint32_t*>(Sl + off) = pack2<T>(S[i] - back.x, S[i + 1] - back.y);
    }
  };
  if (!split.state_only) publish_state();

  // ---- the steps: (chunk, query head) pairs of this segment ------------------------------------
  const int nc = static_cast<int>((seq.len + C - 1) / C);
  const int ci0 = min(nc, seg * split.seg_chunks), ci1 = min(nc, ci0 + split.seg_chunks);
  const int steps = (ci1 - ci0) * static_cast<int>(G);
  struct Step {
    int64_t t0, h;
    int cl;
    bool last;
  };
  auto step_at = [&](int i) {
    const int ci = ci0 + i / static_cast<int>(G), hi = i % static_cast<int>(G);
    const int64_t off = int64_t(ci) * C;
    return Step{seq.t0 + off, g * G + hi, static_cast<int>(seq.len - off < C ? seq.len - off : C), hi == G - 1};
  };
  // Rows past the chunk's end arrive as zeros; thread tid copies 16-byte piece tid % 8 of every 16th row.
  auto load_tile = [&](unsigned char* dst, const ConstView& view, int64_t head, int col0, const Step& s) {
    const int piece = tid % 8;
    const T* fallback = static_cast<const T*>(view.data);
#pragma unroll
    for (int r = tid / 8; r < C; r += kTcThreads / 8) {
      const bool valid = r < s.cl;
      const T* src = valid ? row<T>(view, seq.b, s.t0 + r, head) + col0 + piece * 8 : fallback;
      cp_async16(dst + wg_swizzled(r, piece * 8), src, valid);
    }
  };
  auto stage = [&](int i) { return smem + (i % NS) * 3 * kWgTileBytes; };
  auto issue = [&](int i) {
    const Step s = step_at(i);
    unsigned char* st = stage(i);
    if (!split.state_only) load_tile(st, tc_view(p, feat, TcSrc::kQ), s.h, 0, s);
    load_tile(st + kWgTileBytes, tc_view(p, feat, TcSrc::kK), g, 0, s);
    load_tile(st + 2 * kWgTileBytes, p.v, g, c0, s);
  };

  // den_t = s (Q_t . z + rowsum P_t) + eps for one of the thread's rows; its 4 lanes split the sum.
  auto denominator = [&](const unsigned char* Qt, float rowsum, int r) {
    float acc = rowsum;
    for (int d = t2; d < D; d += 8) {
      const float2 q2 = unpack2<T>(*reinterpret_cast<const uint32_t*>(Qt + wg_swizzled(r, d)));
      acc += q2.x * z[d] + q2.y * z[d + 1];
    }
    acc += __shfl_xor_sync(0xffffffffu, acc, 1);
    acc += __shfl_xor_sync(0xffffffffu, acc, 2);
    return scale * acc + eps;
  };

  auto update_state = [&](const unsigned char* Kt, const unsigned char* Vt) {  // S += K^T V
#pragma unroll
    for (int j = 0; j < 4; ++j) wg_mma_ss<T, 1, 1>(S, wg_descriptor(Kt, 2048 * j), wg_descriptor(Vt, 2048 * j), 1);
  };

  for (int i = 0; i < NS - 1; ++i) {
    if (i < steps) issue(i);
    cp_async_commit();
  }
  for (int i = 0; i < steps; ++i) {
    if (i + NS - 1 < steps) issue(i + NS - 1);
    cp_async_commit();
    cp_async_wait<NS - 1>();
    wg_fence_shared();  // cp.async and st.shared writes before the products read them
    __syncthreads();

    const Step s = step_at(i);
    const unsigned char* Qt = stage(i);
    const unsigned char* Kt = Qt + kWgTileBytes;
    const unsigned char* Vt = Kt + kWgTileBytes;
    float O[32];
    if (!split.state_only) {
      // ---- P = Q K^T and O = Q S_hi + Q S_lo -------------------------------------------------------
      float P[32];
      wg_hold(S);
      wg_fence();
#pragma unroll
      for (int j = 0; j < 4; ++j) wg_mma_ss<T, 0, 0>(P, wg_descriptor(Qt, 32 * j), wg_descriptor(Kt, 32 * j), j > 0);
#pragma unroll
      for (int j = 0; j < 4; ++j) wg_mma_ss<T, 0, 1>(O, wg_descriptor(Qt, 32 * j), wg_descriptor(Sh, 2048 * j), j > 0);
#pragma unroll
      for (int j = 0; j < 4; ++j) wg_mma_ss<T, 0, 1>(O, wg_descriptor(Qt, 32 * j), wg_descriptor(Sl, 2048 * j), 1);
      wg_commit();
      wg_wait_all();
      wg_hold(P);
      wg_hold(O);

      // ---- mask P, its row sums (normalize), and P as the register operand of P V -----------------
      float rowsum[2] = {0.f, 0.f};
      uint32_t pa[4][4];
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const int e = 8 * j + 2 * q, r = wg_acc_row(tid, e), col = wg_acc_col(tid, e);
          const float x0 = col <= r ? P[e] : 0.f, x1 = col + 1 <= r ? P[e + 1] : 0.f;
          rowsum[q & 1] += x0 + x1;
          pa[j][q] = pack2<T>(x0, x1);
        }
      // O += P V, and S += K^T V after the last head. Each branch is a whole fence-commit-wait
      // stage: a branch inside one makes ptxas serialize the products (C7515).
      auto pv = [&]() {
#pragma unroll
        for (int j = 0; j < 4; ++j) wg_mma_rs<T, 1>(O, pa[j], wg_descriptor(Vt, 2048 * j), 1);
      };
      wg_hold(O);
      wg_hold(S);
      wg_hold(pa);
      if (s.last) {
        wg_fence();
        pv();
        update_state(Kt, Vt);
        wg_commit();
        wg_wait_all();
      } else {
        wg_fence();
        pv();
        wg_commit();
        wg_wait_all();
      }
      wg_hold(O);
      wg_hold(S);

      // ---- epilogue: o rows of this chunk ----------------------------------------------------------
      float inv[2] = {scale, scale};
      if (p.normalize) {
#pragma unroll
        for (int r = 0; r < 2; ++r) inv[r] = scale / denominator(Qt, rowsum[r], wg_acc_row(tid, 2 * r));
      }
#pragma unroll
      for (int e = 0; e < 32; e += 2) {
        const int r = wg_acc_row(tid, e);
        if (r >= s.cl) continue;
        const float f = inv[(e >> 1) & 1];
        T* orow = row<T>(p.o, seq.b, s.t0 + r, s.h) + c0 + wg_acc_col(tid, e);
        *reinterpret_cast<uint32_t*>(orow) = pack2<T>(O[e] * f, O[e + 1] * f);
      }
    } else if (s.last) {
      // ---- pass 1 of a split: only the state moves ------------------------------------------------
      wg_hold(S);
      wg_fence();
      update_state(Kt, Vt);
      wg_commit();
      wg_wait_all();
      wg_hold(S);
    }

    __syncthreads();  // every warp is done with this stage, S_hi / S_lo and z
    if (s.last) {
      if (p.normalize && tid < D) {
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 8
        for (int t = 0; t < C; ++t) {
          const T k = *reinterpret_cast<const T*>(Kt + wg_swizzled(t, tid));
          acc[t & 3] += to_acc<float>(k);
        }
        z[tid] += (acc[0] + acc[1]) + (acc[2] + acc[3]);
      }
      if (!split.state_only) publish_state();
    }
    __syncthreads();  // z and the state tiles are written; the stage may be refilled
  }
  cp_async_wait<0>();

  // ---- pass 1: this segment's partial; otherwise the final state, from the last segment ---------
  if (split.state_only) {
    float* part = partial_at(seg);
#pragma unroll
    for (int i = 0; i < 32; ++i) part[wg_acc_row(tid, i) * D + wg_acc_col(tid, i)] = S[i];
    if (tid < D) part[D * D + tid] = p.normalize ? z[tid] : 0.f;
    return;
  }
  if (seg != split.segments - 1) return;
  if (p.final_S != nullptr) {
#pragma unroll
    for (int i = 0; i < 32; ++i)
      static_cast<float*>(p.final_S)[state_index(wg_acc_row(tid, i), wg_acc_col(tid, i))] = S[i];
  }
  if (p.final_z != nullptr && tile == 0 && tid < D) static_cast<float*>(p.final_z)[state_row * D + tid] = z[tid];
#elif defined(__CUDA_ARCH__)
  __trap();  // launched from an image without sm_90a code: fail loudly rather than leave o unwritten
#endif
}

}  // namespace attnrnn::cuda
