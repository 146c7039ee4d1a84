// Softmax attention backward on the GPU, by recomputation from q, k, v, lse (no Tq x Tk tensor).
//
// With P = exp(scale Q Kᵀ - lse) (masked), D_i = dout_i . o_i:
//   dV = Pᵀ dO,   dP = dO Vᵀ,   dS = P ∘ (dP - D),   dK = scale dSᵀ Q,   dQ = scale dS K.
// Three kernels, each output element with exactly one writer (no atomics: bitwise reproducible):
//   1. dot:   D_i for every (batch, head, query) into the workspace (lse's layout)
//   2. dq:    per block of queries, over the key blocks it sees          (like the forward)
//   3. dk/dv: per block of keys, over the G query heads of its kv head and the query blocks
//             that see it; dK, dV stay in registers for the whole loop
// P is recomputed in 2 and 3 (FlashAttention-2 recomputes it once but sums dq with atomics).
// Rows with lse = -inf (no key) and rows past the end get lse = +inf in log2 units: P = 0.
//
// Tensor-core kernels (bf16/fp16, D = Dv in {64, 128}); the generic ones are in
// generic_backward.cuh, and write again the (sequence, kv head)s whose dq, dk or dv the
// tensor-core kernels wrote not finite (common.cuh, non-finite values).
#pragma once

#include "common.cuh"

namespace attnrnn::cuda::sm {

// ---- 1. D_i = dout_i . o_i ------------------------------------------------------------------------
constexpr int kDotThreads = 256;

template <class T>
__global__ void __launch_bounds__(kDotThreads) bwd_dot_kernel(const SoftmaxAttnParams p) {
  using A = typename AccOf<T>::type;
  const int64_t w = (int64_t(blockIdx.x) * kDotThreads + threadIdx.x) / 32;
  const int lane = threadIdx.x & 31;
  const int64_t H = p.num_heads, Tq = p.seqlen_q;
  if (w >= p.batch * Tq * H) return;
  const int64_t h = w % H, t = (w / H) % Tq, b = w / (H * Tq);
  const T* dout = row<T>(p.dout, b, t, h);
  const T* out = row<T>(p.out, b, t, h);
  A acc = A(0);
  for (int64_t c = lane; c < p.head_dim_v; c += 32) acc += to_acc<A>(dout[c]) * to_acc<A>(out[c]);
  acc = warp_sum(acc);
  if (lane == 0) static_cast<A*>(p.workspace)[(b * H + h) * Tq + t] = acc;
}

// lse in log2 units, +inf where P must vanish (no key, or a row past the end).
__device__ __forceinline__ float lse_log2(const SoftmaxAttnParams& p, const Seq& s, int64_t h, int64_t i) {
  if (i >= s.Lq) return INFINITY;
  const float v = static_cast<const float*>(p.lse)[row_index(p, s, h, i)];
  return v == -INFINITY ? INFINITY : v * kLog2e;
}

// ---- 2. dq (tensor cores) -------------------------------------------------------------------------
constexpr int kDqBc = 64;

// Shared memory of the dq kernel with W warps (16 W queries), in elements of T.
template <int D, int W>
struct DqSmem {
  static constexpr int P = D + 8, Br = 16 * W;
  static constexpr int kQ = 0;                     // Q  [Br][P]     queries; a warp's rows then stage its dq
  static constexpr int kO = kQ + Br * P;           // dO [Br][P]     output gradient
  static constexpr int kK = kO + Br * P;           // K  [2][64][P]  key blocks, double-buffered
  static constexpr int kV = kK + 2 * kDqBc * P;    // V  [2][64][P]  value blocks, double-buffered
  static constexpr int kBytes = (kV + 2 * kDqBc * P) * 2;
};

template <class T, int D, int W>
__global__ void __launch_bounds__(32 * W) bwd_dq_tc_kernel(const SoftmaxAttnParams p, int64_t per_head,
                                                            unsigned* nonfinite) {
  using L = DqSmem<D, W>;
  constexpr int P = L::P, Br = L::Br, Bc = kDqBc, NT = Bc / 8, DT = D / 8, THREADS = 32 * W;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* Qs = reinterpret_cast<T*>(smem_raw) + L::kQ;
  T* dOs = reinterpret_cast<T*>(smem_raw) + L::kO;
  T* Ks = reinterpret_cast<T*>(smem_raw) + L::kK;
  T* Vs = reinterpret_cast<T*>(smem_raw) + L::kV;

  BlockPos pos;
  if (!locate_block(p, blockIdx.x, per_head, Br, p.num_heads, false, true, pos)) return;
  const Seq& s = pos.s;
  const int64_t h = pos.head, kvh = h / (p.num_heads / p.num_kv_heads), i0 = pos.start;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t2 = (lane & 3) * 2;
  const int64_t rows = s.Lq - i0 < Br ? s.Lq - i0 : Br;
  const int64_t kend = s.key_end(i0 + rows - 1), kfull = s.key_end(i0);
  const int n_tiles = static_cast<int>((kend + Bc - 1) / Bc);
  const float c = static_cast<float>(p.scale) * kLog2e;
  auto tile_rows = [&](int j) { return kend - int64_t(j) * Bc < Bc ? kend - int64_t(j) * Bc : int64_t(Bc); };

  // Load: Q, dO and the first key/value blocks (one group per key block).
  load_tile_async<Br, D, P, THREADS>(Qs, p.q, s.b, s.q0 + i0, h, rows, tid);
  load_tile_async<Br, D, P, THREADS>(dOs, p.dout, s.b, s.q0 + i0, h, rows, tid);
  if (n_tiles > 0) {
    load_tile_async<Bc, D, P, THREADS>(Ks, p.k, s.b, s.k0, kvh, tile_rows(0), tid);
    load_tile_async<Bc, D, P, THREADS>(Vs, p.v, s.b, s.k0, kvh, tile_rows(0), tid);
  }
  cp_async_commit();

  const int r0 = warp * 16;
  const float* Dws = static_cast<const float*>(p.workspace);
  float lse2[2], Drow[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t i = i0 + r0 + g + 8 * r;
    lse2[r] = lse_log2(p, s, h, i);
    Drow[r] = i < s.Lq ? Dws[row_index(p, s, h, i)] : 0.f;
  }
  float dQ[DT][4];
  zero(dQ);
  const uint32_t q_at = smem_addr(Qs) + 2u * (lane_off_a(lane, P) + r0 * P);
  const uint32_t o_at = smem_addr(dOs) + 2u * (lane_off_a(lane, P) + r0 * P);
  const uint32_t kb_at = smem_addr(Ks) + 2u * lane_off_b(lane, P), kt_at = smem_addr(Ks) + 2u * lane_off_a(lane, P);
  const uint32_t v_at = smem_addr(Vs) + 2u * lane_off_b(lane, P);

  for (int j = 0; j < n_tiles; ++j) {
    const int st = j & 1;
    const int64_t j0 = int64_t(j) * Bc;
    cp_async_wait<0>();
    __syncthreads();  // key block j has landed; every warp is done with block j - 1
    if (j + 1 < n_tiles) {
      load_tile_async<Bc, D, P, THREADS>(Ks + (st ^ 1) * Bc * P, p.k, s.b, s.k0 + j0 + Bc, kvh, tile_rows(j + 1), tid);
      load_tile_async<Bc, D, P, THREADS>(Vs + (st ^ 1) * Bc * P, p.v, s.b, s.k0 + j0 + Bc, kvh, tile_rows(j + 1), tid);
      cp_async_commit();
    }
    const uint32_t kb = kb_at + st * at2(Bc, 0, P), kt = kt_at + st * at2(Bc, 0, P), vb = v_at + st * at2(Bc, 0, P);

    // Recompute: S = Q Kᵀ and dP = dO Vᵀ for this warp's 16 rows.
    float S[NT][4], dP[NT][4];
    mma_xyt2<T, D, Bc, P>(S, q_at, kb, dP, o_at, vb);

    // dS = P ∘ (dP - D), P = 2^(S c - lse2) (0 where masked: blocks past the keys every row sees).
    int lim[2] = {Bc, Bc};
    if (j0 + Bc > kfull) {
#pragma unroll
      for (int r = 0; r < 2; ++r) lim[r] = block_limit(s.key_end(i0 + r0 + g + 8 * r) - j0, Bc);
    }
#pragma unroll
    for (int ni = 0; ni < NT; ++ni)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e >> 1;
        const float pr = ni * 8 + t2 + (e & 1) >= lim[r] ? 0.f : exp2_fast(S[ni][e] * c - lse2[r]);
        S[ni][e] = pr * (dP[ni][e] - Drow[r]);
      }

    // dQ += dS K.
    mma_cy<T, Bc, D, P>(dQ, S, kt);
  }

  // Finish: dq = scale dQ through this warp's rows of the Q tile.
  cp_async_wait<0>();
  __syncthreads();
  const float f[2] = {static_cast<float>(p.scale), static_cast<float>(p.scale)};
  note_nonfinite(nonfinite, pos.n * p.num_kv_heads + kvh, stage_acc<T, D>(Qs, P, r0, dQ, f, lane, rows - r0));
  __syncwarp();
  store_tile<16, D, P, 32>(Qs + r0 * P, p.dq, s.b, s.q0 + i0 + r0, h, rows - r0, lane);
}

// ---- 3. dk, dv (tensor cores) ---------------------------------------------------------------------
constexpr int kDkvWarps = 8, kDkvThreads = 32 * kDkvWarps, kDkvBc = 16 * kDkvWarps, kDkvBr = 64;

// Shared memory of the dk/dv kernel, in bytes.
template <int D>
struct DkvSmem {
  static constexpr int P = D + 8;
  static constexpr int kK = 0;                            // K  [128][P]      keys; a warp's rows then stage dk
  static constexpr int kV = kK + kDkvBc * P;              // V  [128][P]      values; then dv
  static constexpr int kQ = kV + kDkvBc * P;              // Q  [2][64][P]    query blocks, double-buffered
  static constexpr int kO = kQ + 2 * kDkvBr * P;          // dO [2][64][P]    output gradients, double-buffered
  static constexpr int kElems = kO + 2 * kDkvBr * P;
  static constexpr int kLse = kElems * 2;                 // lse2 [2][64] fp32  log2 units, +inf = P 0
  static constexpr int kD = kLse + 2 * kDkvBr * 4;        // D    [2][64] fp32
  static constexpr int kBytes = kD + 2 * kDkvBr * 4;
};

template <class T, int D>
__global__ void __launch_bounds__(kDkvThreads, 1) bwd_dkv_tc_kernel(const SoftmaxAttnParams p, int64_t per_head,
                                                                    unsigned* nonfinite) {
  using L = DkvSmem<D>;
  constexpr int P = L::P, Bc = kDkvBc, Br = kDkvBr, NT = Br / 8, DT = D / 8;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* Ks = reinterpret_cast<T*>(smem_raw) + L::kK;
  T* Vs = reinterpret_cast<T*>(smem_raw) + L::kV;
  T* Qs = reinterpret_cast<T*>(smem_raw) + L::kQ;
  T* dOs = reinterpret_cast<T*>(smem_raw) + L::kO;
  float* lse_s = reinterpret_cast<float*>(smem_raw + L::kLse);
  float* D_s = reinterpret_cast<float*>(smem_raw + L::kD);

  BlockPos pos;
  if (!locate_block(p, blockIdx.x, per_head, Bc, p.num_kv_heads, true, false, pos)) return;
  const Seq& s = pos.s;
  const int64_t kvh = pos.head, G = p.num_heads / p.num_kv_heads, j0 = pos.start;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t2 = (lane & 3) * 2;
  const int64_t nkeys = s.Lk - j0 < Bc ? s.Lk - j0 : Bc;
  const int64_t it0 = s.first_query(j0) / Br * Br;  // query blocks before it0 see none of these keys
  const int64_t per_h = s.Lq > it0 ? (s.Lq - it0 + Br - 1) / Br : 0;
  const int64_t steps = G * per_h;
  const int64_t off = s.Lk - s.Lq;  // query i sees key j iff j <= i + off (causal)
  const float c = static_cast<float>(p.scale) * kLog2e;
  const float* Dws = static_cast<const float*>(p.workspace);

  // Load the query-side block of step t (head, query block) into buffer t & 1.
  auto load_step = [&](int64_t t) {
    const int64_t h = kvh * G + t / per_h, i = it0 + (t % per_h) * Br, n = s.Lq - i < Br ? s.Lq - i : Br;
    const int buf = static_cast<int>(t & 1);
    load_tile_async<Br, D, P, kDkvThreads>(Qs + buf * Br * P, p.q, s.b, s.q0 + i, h, n, tid);
    load_tile_async<Br, D, P, kDkvThreads>(dOs + buf * Br * P, p.dout, s.b, s.q0 + i, h, n, tid);
    if (tid < Br) {
      lse_s[buf * Br + tid] = lse_log2(p, s, h, i + tid);
      D_s[buf * Br + tid] = i + tid < s.Lq ? Dws[row_index(p, s, h, i + tid)] : 0.f;
    }
  };

  // Load: this block's keys and values, and the first query block.
  load_tile_async<Bc, D, P, kDkvThreads>(Ks, p.k, s.b, s.k0 + j0, kvh, nkeys, tid);
  load_tile_async<Bc, D, P, kDkvThreads>(Vs, p.v, s.b, s.k0 + j0, kvh, nkeys, tid);
  if (steps > 0) load_step(0);
  cp_async_commit();

  const int r0 = warp * 16;
  float dK[DT][4], dV[DT][4];
  zero(dK);
  zero(dV);
  const uint32_t k_at = smem_addr(Ks) + 2u * (lane_off_a(lane, P) + r0 * P);
  const uint32_t v_at = smem_addr(Vs) + 2u * (lane_off_a(lane, P) + r0 * P);
  const uint32_t qb_at = smem_addr(Qs) + 2u * lane_off_b(lane, P), qt_at = smem_addr(Qs) + 2u * lane_off_a(lane, P);
  const uint32_t ob_at = smem_addr(dOs) + 2u * lane_off_b(lane, P), ot_at = smem_addr(dOs) + 2u * lane_off_a(lane, P);

  for (int64_t t = 0; t < steps; ++t) {
    const int buf = static_cast<int>(t & 1);
    const int64_t i = it0 + (t % per_h) * Br;
    cp_async_wait<0>();
    __syncthreads();  // step t's block has landed; every warp is done with step t - 1's buffer
    if (t + 1 < steps) {
      load_step(t + 1);
      cp_async_commit();
    }
    const uint32_t so = buf * at2(Br, 0, P);
    const uint32_t qb = qb_at + so, qt = qt_at + so, ob = ob_at + so, ot = ot_at + so;

    // Recompute, transposed (rows = this warp's 16 keys): Sᵀ = K Qᵀ, dPᵀ = V dOᵀ.
    float S[NT][4], dP[NT][4];
    mma_xyt2<T, D, Br, P>(S, k_at, qb, dP, v_at, ob);

    // Pᵀ = 2^(Sᵀ c - lse2) (0 where masked), dSᵀ = Pᵀ ∘ (dPᵀ - D).
    const bool masked = s.causal && i < j0 + Bc - 1 - off;
    const float* lse_t = lse_s + buf * Br;
    const float* D_t = D_s + buf * Br;
#pragma unroll
    for (int ni = 0; ni < NT; ++ni)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int q = ni * 8 + t2 + (e & 1);
        const int64_t key = j0 + r0 + g + 8 * (e >> 1);
        const bool dead = masked && key > i + q + off;
        S[ni][e] = dead ? 0.f : exp2_fast(S[ni][e] * c - lse_t[q]);
        dP[ni][e] = S[ni][e] * (dP[ni][e] - D_t[q]);
      }

    // dV += Pᵀ dO, dK += dSᵀ Q.
#pragma unroll
    for (int kj = 0; kj < Br / 16; ++kj) {
      uint32_t ap[4], ad[4];
      c_to_a<T>(ap, S[2 * kj], S[2 * kj + 1]);
      c_to_a<T>(ad, dP[2 * kj], dP[2 * kj + 1]);
#pragma unroll
      for (int dn = 0; dn < D / 16; ++dn) {
        mma_block16<T, true>(dV[2 * dn], dV[2 * dn + 1], ap, ot + at2(kj * 16, dn * 16, P));
        mma_block16<T, true>(dK[2 * dn], dK[2 * dn + 1], ad, qt + at2(kj * 16, dn * 16, P));
      }
    }
  }

  // Finish: dk = scale dK, dv = dV through this warp's rows of the K and V tiles.
  cp_async_wait<0>();
  __syncthreads();
  const float fk[2] = {static_cast<float>(p.scale), static_cast<float>(p.scale)}, fv[2] = {1.f, 1.f};
  const bool bad_k = stage_acc<T, D>(Ks, P, r0, dK, fk, lane, nkeys - r0);
  const bool bad_v = stage_acc<T, D>(Vs, P, r0, dV, fv, lane, nkeys - r0);
  note_nonfinite(nonfinite, pos.n * p.num_kv_heads + kvh, bad_k || bad_v);
  __syncwarp();
  store_tile<16, D, P, 32>(Ks + r0 * P, p.dk, s.b, s.k0 + j0 + r0, kvh, nkeys - r0, lane);
  store_tile<16, D, P, 32>(Vs + r0 * P, p.dv, s.b, s.k0 + j0 + r0, kvh, nkeys - r0, lane);
}

}  // namespace attnrnn::cuda::sm
