// Chunkwise causal linear attention forward on warpgroup MMA (wgmma, sm_90a), K = DI in {64, 128},
// bf16/fp16. One warpgroup (128 threads) per (sequence [x segment], 64 value columns, kv head). A step
// is one (chunk of 64 tokens, query head) pair, as in chunk_tc_kernel. With Q = phi(q), K = phi(k) as
// DI / 64 swizzled 64 x 64 tiles each (wgmma.cuh; tile h holds dims [64h, 64h + 64)), V the block's
// value columns as one tile, and the state S [DI x 64] in fp32 registers (DI / 64 accumulators of
// 64 rows):
//   P = mask(Q K^T)               key s <= query t
//   O = Q S_hi + Q S_lo + P V     S as two 16-bit tiles the block writes after each chunk
//   o = s O / den                 den = s (Q z + rowsum P) + eps with normalize; den = 1 without
//   S += K^T V, z += colsum K     after the chunk's last query head
// The segment split (TcSplit) works as in chunk_tc_kernel, with this kernel's tiles and partial size
// (WgLayout); the workspace is sized for whichever forward runs (partial_bytes, wgmma_planned).
#pragma once

#include "chunk_tc_plan.cuh"
#include "mma.cuh"
#include "wgmma.cuh"

namespace attnrnn::cuda {

template <int DI>
struct WgLayout {
  static constexpr int KT = DI / 64;                         // 64-dim tiles of Q, K and S
  static constexpr int stages = 2;
  static constexpr int stage = (2 * KT + 1) * kWgTileBytes;  // Q, K tiles and the V tile
  static constexpr int min_blocks = DI == 64 ? 3 : 2;        // shared memory: 65 / 113 KiB per block
  // stages, S_hi and S_lo tiles, z [DI] floats; the base is 1024-byte aligned (no slack: at DI = 128
  // one more KiB would leave room for only one block per SM)
  static constexpr int64_t smem_bytes = int64_t(stages) * stage + 2 * KT * kWgTileBytes + DI * 4;
  static constexpr int64_t partial_floats = DI * 64 + DI;    // S [DI][64], then z [DI]
  static_assert(DI == 64 || DI == 128, "K = 64 or 128");
  // 228 KiB per SM on sm_90, and 1 KiB of each block's is reserved by the system
  static_assert(min_blocks * (smem_bytes + 1024) <= 228 * 1024, "min_blocks blocks must fit on an SM");
};

template <class T, int DI>
__global__ void __launch_bounds__(kTcThreads, WgLayout<DI>::min_blocks)
    chunk_wg_fwd_kernel(const LinearAttnParams p, const TcSplit split, const TcFeatures feat) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using L = WgLayout<DI>;
  constexpr int C = kTcChunk, D = 64, NS = L::stages, KT = L::KT;
  extern __shared__ __align__(1024) unsigned char smem[];
  if (smem_addr(smem) % 1024 != 0) __trap();  // the swizzle and the descriptors assume it
  unsigned char* Sh = smem + NS * L::stage;  // KT tiles [64 dims][64 cols]
  unsigned char* Sl = Sh + KT * kWgTileBytes;
  float* z = reinterpret_cast<float*>(Sl + KT * kWgTileBytes);
  // Byte offset of element (r, d) in a group of 64-column tiles (Q and K tiles hold dims d, S_hi and
  // S_lo tiles value columns; a state row r = 64 h + r' of S tile h is at(64 h + r', c), since
  // 64 rows are exactly one tile and the swizzle depends on r mod 8 only).
  auto at = [](int r, int d) { return (d / 64) * kWgTileBytes + wg_swizzled(r, d % 64); };

  const int64_t Hkv = p.num_kv_heads, G = p.num_heads / p.num_kv_heads, V = p.head_dim_v;
  const int tiles = static_cast<int>(V / D), tile = blockIdx.x % tiles;
  const int64_t n = blockIdx.x / tiles / split.segments, g = blockIdx.y;
  const int seg = (blockIdx.x / tiles) % split.segments;
  const int c0 = tile * D;
  const int tid = threadIdx.x, t2 = (tid & 3) * 2;
  const Seq seq = sequence(p, n);
  const float scale = static_cast<float>(p.scale), eps = static_cast<float>(p.eps);
  const int64_t state_row = n * Hkv + g;
  auto state_index = [&](int d, int c) { return (state_row * DI + d) * V + c0 + c; };
  auto partial_at = [&](int j) {
    const int64_t N = gridDim.x / tiles / split.segments;
    return split.partial + (((int64_t(j) * N + n) * Hkv + g) * tiles + tile) * L::partial_floats;
  };
  // f(x, d, c) for each state element x = S[d][c] of this thread.
  float S[KT][32];
  auto for_each_state = [&](auto&& f) {
#pragma unroll
    for (int h = 0; h < KT; ++h)
#pragma unroll
      for (int i = 0; i < 32; ++i) f(S[h][i], 64 * h + wg_acc_row(tid, i), wg_acc_col(tid, i));
  };
  auto hold_state = [&]() {
#pragma unroll
    for (int h = 0; h < KT; ++h) wg_hold(S[h]);
  };
  const int earlier = split.state_only ? 0 : seg;  // partials of the segments before this one

  // ---- initial state: S in registers, z in shared memory ---------------------------------------
  {
    const float* S0 = static_cast<const float*>(p.initial_S);
    for_each_state([&](float& x, int d, int c) {
      x = (S0 != nullptr && !split.state_only) ? S0[state_index(d, c)] : 0.f;
      for (int j = 0; j < earlier; ++j) x += partial_at(j)[d * D + c];
    });
  }
  if (p.normalize && tid < DI) {
    const float* z0 = static_cast<const float*>(p.initial_z);
    float x = (z0 != nullptr && !split.state_only) ? z0[state_row * DI + tid] : 0.f;
    for (int j = 0; j < earlier; ++j) x += partial_at(j)[DI * D + tid];
    z[tid] = x;
  }
  // S as 16-bit hi + lo tiles [d][c] for the products Q S.
  auto publish_state = [&]() {
#pragma unroll
    for (int h = 0; h < KT; ++h)
#pragma unroll
      for (int i = 0; i < 32; i += 2) {
        const int off = at(64 * h + wg_acc_row(tid, i), wg_acc_col(tid, i));
        const uint32_t hi = pack2<T>(S[h][i], S[h][i + 1]);
        const float2 back = unpack2<T>(hi);
        *reinterpret_cast<uint32_t*>(Sh + off) = hi;
        *reinterpret_cast<uint32_t*>(Sl + off) = pack2<T>(S[h][i] - back.x, S[h][i + 1] - back.y);
      }
  };
  if (!split.state_only) publish_state();

  // ---- the steps: (chunk, query head) pairs of this segment ------------------------------------
  const int nc = static_cast<int>((seq.len + C - 1) / C), heads = static_cast<int>(G);
  const int ci0 = min(nc, seg * split.seg_chunks), ci1 = min(nc, ci0 + split.seg_chunks);
  const int steps = (ci1 - ci0) * heads;
  struct Step {
    int64_t t0, h;
    int cl;
    bool last;
  };
  // Walks the steps in order (chunk-major), without a division per step.
  struct Walk {
    int ci, hi;
  };
  auto step_of = [&](const Walk& w) {
    const int64_t off = int64_t(w.ci) * C;
    return Step{seq.t0 + off, g * G + w.hi, static_cast<int>(seq.len - off < C ? seq.len - off : C), w.hi == heads - 1};
  };
  auto advance = [&](Walk& w) {
    if (++w.hi == heads) w.hi = 0, ++w.ci;
  };
  // A tile source: this thread's 16-byte piece of row 0 of sequence seq.b at token 0, head 0, and the
  // strides to move from there; hoisted so that a step costs one address per source.
  struct Source {
    const T* base;
    int64_t stride_t, stride_h;
  };
  const int piece = tid % 8;
  auto source = [&](const ConstView& v, int col0) {
    return Source{static_cast<const T*>(v.data) + seq.b * v.stride_b + col0 + piece * 8, v.stride_t, v.stride_h};
  };
  const Source q_src = source(tc_view(p, feat, TcSrc::kQ), 0), k_src = source(tc_view(p, feat, TcSrc::kK), 0),
               v_src = source(p.v, c0);
  // `width` columns of the chunk's rows into 64-column tiles; rows past the chunk's end arrive as
  // zeros. Thread tid copies piece tid % 8 of each 64-column tile of rows tid / 8 + 16 j.
  auto load_tiles = [&](unsigned char* dst, const Source& src, int64_t head, int width, const Step& s) {
    const T* chunk = src.base + s.t0 * src.stride_t + head * src.stride_h;
#pragma unroll
    for (int j = 0; j < C / 16; ++j) {
      const int r = tid / 8 + 16 * j;
      const bool valid = r < s.cl;
      const T* from = valid ? chunk + r * src.stride_t : src.base;
#pragma unroll
      for (int d0 = 0; d0 < width; d0 += 64) cp_async16(dst + at(r, d0 + piece * 8), from + (valid ? d0 : 0), valid);
    }
  };
  auto stage = [&](int i) { return smem + (i % NS) * L::stage; };
  Walk next{ci0, 0};  // the next step to load
  auto issue = [&](int i) {
    const Step s = step_of(next);
    advance(next);
    unsigned char* st = stage(i);
    if (!split.state_only) load_tiles(st, q_src, s.h, DI, s);
    load_tiles(st + KT * kWgTileBytes, k_src, g, DI, s);
    load_tiles(st + 2 * KT * kWgTileBytes, v_src, g, D, s);
  };

  // q_t . z for the thread's two rows (r0 = wg_acc_row(tid, 0) and r0 + 8), on all 4 lanes of a row.
  // bf16: one m16n8k16 product per 16 dims, the warp's 16 rows of Q times z as a [DI x 8] operand whose
  // column 0 is z's bf16 high part and column 1 its low part (the rest zero). fp16 cannot hold z
  // (it grows with T past fp16's range), so fp16 sums in fp32 on the CUDA cores.
  const int lane = tid % 32, m0 = 16 * (tid / 32);
  auto q_dot_z = [&](const unsigned char* Qt, float (&qz)[2]) {
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      float c[4] = {0.f, 0.f, 0.f, 0.f};
      const int n = lane / 4;  // this lane's column of the z operand
#pragma unroll
      for (int j = 0; j < DI / 16; ++j) {
        uint32_t a[4];
        ldsm_x4(a, Qt + at(m0 + (lane & 7) + ((lane >> 3) & 1) * 8, 16 * j + (lane >> 4) * 8));
        const int k = 16 * j + 2 * (lane % 4);
        uint32_t b[2] = {0u, 0u};
        if (n < 2) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const float2 zz = *reinterpret_cast<const float2*>(z + k + 8 * h);
            const uint32_t hi = pack2<T>(zz.x, zz.y);
            const float2 back = unpack2<T>(hi);
            b[h] = n == 0 ? hi : pack2<T>(zz.x - back.x, zz.y - back.y);
          }
        }
        mma16816<T>(c, a, b[0], b[1]);
      }
      qz[0] = __shfl_sync(0xffffffffu, c[0] + c[1], lane & ~3);  // columns 0 + 1, on the row's lane 0
      qz[1] = __shfl_sync(0xffffffffu, c[2] + c[3], lane & ~3);
    } else {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float acc = 0.f;
        for (int d = t2; d < DI; d += 8) {
          const float2 q2 = unpack2<T>(*reinterpret_cast<const uint32_t*>(Qt + at(m0 + lane / 4 + 8 * r, d)));
          acc += q2.x * z[d] + q2.y * z[d + 1];
        }
        acc += __shfl_xor_sync(0xffffffffu, acc, 1);
        qz[r] = acc + __shfl_xor_sync(0xffffffffu, acc, 2);
      }
    }
  };
  // z += colsum K: K^T (dims x tokens, read transposed) times a ones operand, one m16n8k16 product per
  // 16 tokens; warp w owns dims 16 w (+ 64 h). Every column of the result is the sum; each dim has
  // one writer (a lane with lane % 4 == 0).
  auto add_key_sums = [&](const unsigned char* Kt) {
    const uint32_t ones = pack2<T>(1.f, 1.f);
    const int mat = lane >> 3;
#pragma unroll
    for (int h = 0; h < KT; ++h) {
      const int d0 = 64 * h + m0;
      float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int j = 0; j < C / 16; ++j) {
        uint32_t a[4];
        ldsm_x4_trans(a, Kt + at(16 * j + (mat >> 1) * 8 + (lane & 7), d0 + (mat & 1) * 8));
        mma16816<T>(c, a, ones, ones);
      }
      if (lane % 4 == 0) {
        z[d0 + lane / 4] += c[0];
        z[d0 + lane / 4 + 8] += c[2];
      }
    }
  };

  auto update_state = [&](const unsigned char* Kt, const unsigned char* Vt) {  // S += K^T V, per 64 dims
#pragma unroll
    for (int h = 0; h < KT; ++h)
#pragma unroll
      for (int j = 0; j < 4; ++j)
        wg_mma_ss<T, 1, 1>(S[h], wg_descriptor(Kt, h * kWgTileBytes + 2048 * j), wg_descriptor(Vt, 2048 * j), 1);
  };

  for (int i = 0; i < NS - 1; ++i) {
    if (i < steps) issue(i);
    cp_async_commit();
  }
  Walk current{ci0, 0};
  for (int i = 0; i < steps; ++i) {
    if (i + NS - 1 < steps) issue(i + NS - 1);
    cp_async_commit();
    cp_async_wait<NS - 1>();
    wg_fence_shared();  // cp.async and st.shared writes before the products read them
    __syncthreads();

    const Step s = step_of(current);
    advance(current);
    const unsigned char* Qt = stage(i);
    const unsigned char* Kt = Qt + KT * kWgTileBytes;
    const unsigned char* Vt = Kt + KT * kWgTileBytes;
    float O[32];
    if (!split.state_only) {
      // ---- P = Q K^T and O = Q S_hi + Q S_lo -------------------------------------------------------
      // k16 slice j of the inner dim: tile j / 4, 32 bytes (along rows) or 2048 bytes (down rows) per slice.
      auto along = [](int j) { return (j / 4) * kWgTileBytes + 32 * (j % 4); };
      auto down = [](int j) { return (j / 4) * kWgTileBytes + 2048 * (j % 4); };
      float P[32];
      hold_state();
      wg_fence();
#pragma unroll
      for (int j = 0; j < DI / 16; ++j)
        wg_mma_ss<T, 0, 0>(P, wg_descriptor(Qt, along(j)), wg_descriptor(Kt, along(j)), j > 0);
#pragma unroll
      for (int j = 0; j < DI / 16; ++j)
        wg_mma_ss<T, 0, 1>(O, wg_descriptor(Qt, along(j)), wg_descriptor(Sh, down(j)), j > 0);
#pragma unroll
      for (int j = 0; j < DI / 16; ++j) wg_mma_ss<T, 0, 1>(O, wg_descriptor(Qt, along(j)), wg_descriptor(Sl, down(j)), 1);
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
      hold_state();
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
      hold_state();

      // ---- epilogue: o rows of this chunk ----------------------------------------------------------
      float inv[2] = {scale, scale};
      if (p.normalize) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          rowsum[r] += __shfl_xor_sync(0xffffffffu, rowsum[r], 1);
          rowsum[r] += __shfl_xor_sync(0xffffffffu, rowsum[r], 2);
        }
        float qz[2];
        q_dot_z(Qt, qz);
#pragma unroll
        for (int r = 0; r < 2; ++r) inv[r] = scale / (scale * (qz[r] + rowsum[r]) + eps);
      }
      // the thread's two rows of o: r0 and r0 + 8
      const int r0 = wg_acc_row(tid, 0);
      T* const o0 = row<T>(p.o, seq.b, s.t0 + r0, s.h) + c0 + wg_acc_col(tid, 0);
      T* const orow[2] = {o0, o0 + 8 * p.o.stride_t};
#pragma unroll
      for (int e = 0; e < 32; e += 2) {
        const int half = (e >> 1) & 1;
        if (r0 + 8 * half >= s.cl) continue;
        const float f = inv[half];
        *reinterpret_cast<uint32_t*>(orow[half] + 8 * (e >> 2)) = pack2<T>(O[e] * f, O[e + 1] * f);
      }
    } else if (s.last) {
      // ---- pass 1 of a split: only the state moves ------------------------------------------------
      hold_state();
      wg_fence();
      update_state(Kt, Vt);
      wg_commit();
      wg_wait_all();
      hold_state();
    }

    __syncthreads();  // every warp is done with this stage, S_hi / S_lo and z
    if (s.last) {
      if (p.normalize) add_key_sums(Kt);
      if (!split.state_only) publish_state();
    }
    __syncthreads();  // z and the state tiles are written; the stage may be refilled
  }
  cp_async_wait<0>();

  // ---- pass 1: this segment's partial; otherwise the final state, from the last segment ---------
  if (split.state_only) {
    float* part = partial_at(seg);
    for_each_state([&](float& x, int d, int c) { part[d * D + c] = x; });
    if (tid < DI) part[DI * D + tid] = p.normalize ? z[tid] : 0.f;
    return;
  }
  if (seg != split.segments - 1) return;
  if (p.final_S != nullptr)
    for_each_state([&](float& x, int d, int c) { static_cast<float*>(p.final_S)[state_index(d, c)] = x; });
  if (p.final_z != nullptr && tile == 0 && tid < DI) static_cast<float*>(p.final_z)[state_row * DI + tid] = z[tid];
#elif defined(__CUDA_ARCH__)
  __trap();  // launched from an image without sm_90a code: fail loudly rather than leave o unwritten
#endif
}

}  // namespace attnrnn::cuda
