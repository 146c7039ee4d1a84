// Softmax attention forward on the GPU: the online-softmax recurrence over key blocks.
//
// Tensor-core kernel (bf16/fp16, D = Dv in {64, 128}, 16-byte aligned rows), FlashAttention-2
// style. One block (8 warps) owns 128 queries of one (sequence, head); warp w owns rows
// [16w, 16w + 16). Per block of 64 keys (K, V double-buffered by cp.async, zero-filled past the
// end):
//   scores   S = Q Kᵀ                          mma.sync m16n8k16, fp32 accumulators
//   update   x = S * scale * log2(e) (masked: -inf), m' = max(m, rowmax x),
//            P = 2^(x - m'), l = l 2^(m - m') + rowsum P, O = O 2^(m - m')      (registers)
//   values   O += P V                          P re-packed from the accumulators as the A operand
//   finish   o = O / l, lse = (m + log2 l) ln 2; o = 0 and lse = -inf for a query with no key
// Causal: only key blocks that some row sees are visited; only those past the keys every row
// sees are masked. Q is re-read from shared memory per key block (ldmatrix) to stay under 128
// registers, 2 blocks per SM. A (sequence, head) with an o that is not finite is written again by
// the generic kernel (common.cuh, non-finite values).
//
// Generic kernel (every dtype and head dim, CUDA cores): 8 warps x RQ query rows, key blocks of
// 32 (lane = key for the scores, lane = value column for P V), accumulators in A = float/double.
// Each row reads only the keys it sees; with flags it runs for the flagged (sequence, head)s only.
#pragma once

#include "common.cuh"
#include "generic_tiles.cuh"

namespace attnrnn::cuda::sm {

constexpr int kFwdWarps = 8, kFwdThreads = 32 * kFwdWarps, kFwdBr = 16 * kFwdWarps, kFwdBc = 64;

// Shared memory of the tensor-core forward, in elements of T (2 bytes).
template <int D>
struct FwdTcSmem {
  static constexpr int P = D + 8;                 // row pitch: +16 bytes keeps ldmatrix conflict-free
  static constexpr int kQ = 0;                    // Q [128][P]    queries; a warp's rows then stage its o
  static constexpr int kK = kQ + kFwdBr * P;      // K [2][64][P]  key blocks, double-buffered
  static constexpr int kV = kK + 2 * kFwdBc * P;  // V [2][64][P]  value blocks, double-buffered
  static constexpr int kBytes = (kV + 2 * kFwdBc * P) * 2;
};

template <class T, int D>
__global__ void __launch_bounds__(kFwdThreads, 2) fwd_tc_kernel(const SoftmaxAttnParams p, int64_t per_head,
                                                                 unsigned* nonfinite) {
  using L = FwdTcSmem<D>;
  constexpr int P = L::P, Bc = kFwdBc, NT = Bc / 8, DT = D / 8;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* Qs = reinterpret_cast<T*>(smem_raw) + L::kQ;
  T* Ks = reinterpret_cast<T*>(smem_raw) + L::kK;
  T* Vs = reinterpret_cast<T*>(smem_raw) + L::kV;

  BlockPos pos;
  if (!locate_block(p, blockIdx.x, per_head, kFwdBr, p.num_heads, false, true, pos)) return;
  const Seq& s = pos.s;
  const int64_t h = pos.head, kvh = h / (p.num_heads / p.num_kv_heads), i0 = pos.start;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t2 = (lane & 3) * 2;
  const int64_t rows = s.Lq - i0 < kFwdBr ? s.Lq - i0 : kFwdBr;
  const int64_t kend = s.key_end(i0 + rows - 1);  // keys the last row sees (the most)
  const int64_t kfull = s.key_end(i0);            // keys every row sees
  const int n_tiles = static_cast<int>((kend + Bc - 1) / Bc);
  const float c = static_cast<float>(p.scale) * kLog2e;
  auto tile_rows = [&](int j) { return kend - int64_t(j) * Bc < Bc ? kend - int64_t(j) * Bc : int64_t(Bc); };

  // Load: Q and the first key/value blocks.
  load_tile_async<kFwdBr, D, P, kFwdThreads>(Qs, p.q, s.b, s.q0 + i0, h, rows, tid);
  if (n_tiles > 0) load_tile_async<Bc, D, P, kFwdThreads>(Ks, p.k, s.b, s.k0, kvh, tile_rows(0), tid);
  cp_async_commit();
  if (n_tiles > 0) load_tile_async<Bc, D, P, kFwdThreads>(Vs, p.v, s.b, s.k0, kvh, tile_rows(0), tid);
  cp_async_commit();

  const int r0 = warp * 16;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  float O[DT][4];
  zero(O);
  const uint32_t q_at = smem_addr(Qs) + 2u * (lane_off_a(lane, P) + r0 * P);
  const uint32_t k_at = smem_addr(Ks) + 2u * lane_off_b(lane, P);
  const uint32_t v_at = smem_addr(Vs) + 2u * lane_off_a(lane, P);

  for (int j = 0; j < n_tiles; ++j) {
    const int st = j & 1;
    const int64_t j0 = int64_t(j) * Bc;
    cp_async_wait<1>();
    __syncthreads();  // K block j has landed; every warp is done with block j - 1 (the other stage)
    if (j + 1 < n_tiles) {
      load_tile_async<Bc, D, P, kFwdThreads>(Ks + (st ^ 1) * Bc * P, p.k, s.b, s.k0 + j0 + Bc, kvh, tile_rows(j + 1), tid);
      cp_async_commit();
      load_tile_async<Bc, D, P, kFwdThreads>(Vs + (st ^ 1) * Bc * P, p.v, s.b, s.k0 + j0 + Bc, kvh, tile_rows(j + 1), tid);
      cp_async_commit();
    }

    // Scores: S = Q Kᵀ for this warp's 16 rows.
    const uint32_t kt = k_at + st * at2(Bc, 0, P), vt = v_at + st * at2(Bc, 0, P);
    float S[NT][4];
    mma_xyt<T, D, Bc, P>(S, q_at, kt);

    // Update: scale to log2 units, mask past each row's last key (only in blocks past the keys
    // every row sees), online softmax.
    if (j0 + Bc > kfull) {
      int lim[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) lim[r] = block_limit(s.key_end(i0 + r0 + g + 8 * r) - j0, Bc);
#pragma unroll
      for (int ni = 0; ni < NT; ++ni)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          S[ni][e] = ni * 8 + t2 + (e & 1) >= lim[e >> 1] ? -INFINITY : S[ni][e] * c;
    } else {
#pragma unroll
      for (int ni = 0; ni < NT; ++ni)
#pragma unroll
        for (int e = 0; e < 4; ++e) S[ni][e] *= c;
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx = -INFINITY;
#pragma unroll
      for (int ni = 0; ni < NT; ++ni) mx = fmaxf(mx, fmaxf(S[ni][2 * r], S[ni][2 * r + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(m[r], mx);
      const float m_use = m_new == -INFINITY ? 0.f : m_new;  // a row with no key yet stays at P = 0
      const float alpha = exp2_fast(m[r] - m_use);
      m[r] = m_new;
      float sum = 0.f;
#pragma unroll
      for (int ni = 0; ni < NT; ++ni) {
        S[ni][2 * r] = exp2_fast(S[ni][2 * r] - m_use);
        S[ni][2 * r + 1] = exp2_fast(S[ni][2 * r + 1] - m_use);
        sum += S[ni][2 * r] + S[ni][2 * r + 1];
      }
      l[r] = l[r] * alpha + sum;
#pragma unroll
      for (int dn = 0; dn < DT; ++dn) {
        O[dn][2 * r] *= alpha;
        O[dn][2 * r + 1] *= alpha;
      }
    }

    if (j + 1 < n_tiles) cp_async_wait<2>();
    else cp_async_wait<0>();
    __syncthreads();  // V block j has landed

    // Values: O += P V.
    mma_cy<T, Bc, D, P>(O, S, vt);
  }

  // Finish: o = O / l through this warp's rows of the Q tile (coalesced stores), lse.
  cp_async_wait<0>();
  __syncthreads();
  float inv[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    inv[r] = l[r] > 0.f ? 1.f / l[r] : 0.f;
  }
  const int64_t warp_rows = rows - r0;
  note_nonfinite(nonfinite, pos.n * p.num_heads + h, stage_acc<T, D>(Qs, P, r0, O, inv, lane, warp_rows));
  __syncwarp();
  store_tile<16, D, P, 32>(Qs + r0 * P, p.o, s.b, s.q0 + i0 + r0, h, warp_rows, lane);
  if ((lane & 3) == 0) {
    float* lse = static_cast<float*>(p.lse);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int64_t i = i0 + r0 + g + 8 * r;
      if (i < s.Lq) lse[row_index(p, s, h, i)] = l[r] > 0.f ? (m[r] + log2f(l[r])) * kLn2 : -INFINITY;
    }
  }
}

// ---- generic path ---------------------------------------------------------------------------------
// Shared memory of the generic forward, in accumulator elements.
struct FwdGenSmem {
  int64_t D, Dv, Bq;
  __host__ __device__ int64_t q() const { return 0; }                    // Q [Bq][D]
  __host__ __device__ int64_t k() const { return q() + Bq * D; }         // K [32][D+1]  (+1: lanes on distinct banks)
  __host__ __device__ int64_t v() const { return k() + kGenBk * (D + 1); }  // V [32][Dv]
  __host__ __device__ int64_t pr() const { return v() + kGenBk * Dv; }    // P [Bq][32]   a warp's rows only
  __host__ __device__ int64_t total() const { return pr() + Bq * kGenBk; }
};

template <class T, int RQ>
__global__ void __launch_bounds__(kGenThreads) fwd_generic_kernel(const SoftmaxAttnParams p, int64_t per_head,
                                                                  const unsigned* nonfinite) {
  using A = typename AccOf<T>::type;
  constexpr int Bq = kGenWarps * RQ;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int D = static_cast<int>(p.head_dim), Dv = static_cast<int>(p.head_dim_v);
  const FwdGenSmem lay{D, Dv, Bq};
  A* smem = reinterpret_cast<A*>(smem_raw);
  A *Qs = smem + lay.q(), *Ks = smem + lay.k(), *Vs = smem + lay.v(), *Ps = smem + lay.pr();

  BlockPos pos;
  if (!locate_block(p, blockIdx.x, per_head, Bq, p.num_heads, false, true, pos)) return;
  if (!generic_block_runs(nonfinite, pos.n * p.num_heads + pos.head)) return;
  const Seq& s = pos.s;
  const int64_t h = pos.head, kvh = h / (p.num_heads / p.num_kv_heads), i0 = pos.start;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t rows = s.Lq - i0 < Bq ? s.Lq - i0 : Bq;
  const int64_t kend = s.key_end(i0 + rows - 1);
  const A scale = static_cast<A>(p.scale);

  for (int e = tid; e < Bq * D; e += kGenThreads) {
    const int r = e / D;
    Qs[e] = r < rows ? to_acc<A>(row<T>(p.q, s.b, s.q0 + i0 + r, h)[e % D]) : A(0);
  }
  int64_t lim[RQ];
  A m[RQ], l[RQ], o[RQ][kGenCols];
#pragma unroll
  for (int i = 0; i < RQ; ++i) {
    lim[i] = s.key_end(i0 + warp + kGenWarps * i);
    m[i] = neg_inf<A>();
    l[i] = A(0);
#pragma unroll
    for (int jj = 0; jj < kGenCols; ++jj) o[i][jj] = A(0);
  }

  for (int64_t j0 = 0; j0 < kend; j0 += kGenBk) {
    const int nk = static_cast<int>(kend - j0 < kGenBk ? kend - j0 : kGenBk);
    __syncthreads();  // the previous key block is consumed (and Q is loaded)
    for (int e = tid; e < kGenBk * D; e += kGenThreads) {
      const int r = e / D, d = e % D;
      Ks[r * (D + 1) + d] = r < nk ? to_acc<A>(row<T>(p.k, s.b, s.k0 + j0 + r, kvh)[d]) : A(0);
    }
    for (int e = tid; e < kGenBk * Dv; e += kGenThreads) {
      const int r = e / Dv;
      Vs[e] = r < nk ? to_acc<A>(row<T>(p.v, s.b, s.k0 + j0 + r, kvh)[e % Dv]) : A(0);
    }
    __syncthreads();

    // Scores of key j0 + lane against the warp's rows; online softmax across the warp.
    A sc[RQ];
    int seen[RQ];  // keys of the block each row sees
    row_dots(sc, Qs + warp * D, Ks + lane * (D + 1), D);
#pragma unroll
    for (int i = 0; i < RQ; ++i) {
      seen[i] = block_limit(lim[i] - j0, nk);
      const A x = lane < seen[i] ? sc[i] * scale : neg_inf<A>();
      const A m_new = fmax(m[i], warp_max(x));
      const A m_use = m_new == neg_inf<A>() ? A(0) : m_new;
      const A alpha = exp_of<A>(m[i] - m_use);
      const A pv = exp_of<A>(x - m_use);
      l[i] = l[i] * alpha + warp_sum(pv);
      m[i] = m_new;
      Ps[(warp + kGenWarps * i) * kGenBk + lane] = pv;
#pragma unroll
      for (int jj = 0; jj < kGenCols; ++jj) o[i][jj] *= alpha;
    }
    __syncwarp();

    // Values: o += P V of the keys each row sees.
    accumulate_block(o, Ps + warp * kGenBk, Vs, Dv, Dv, seen, lane);
  }

  // Finish: o = O / l, lse = m + log l.
#pragma unroll
  for (int i = 0; i < RQ; ++i) {
    const int64_t q = i0 + warp + kGenWarps * i;
    if (q >= s.Lq) continue;
    const A inv = l[i] > A(0) ? A(1) / l[i] : A(0);
    store_row(row<T>(p.o, s.b, s.q0 + q, h), o[i], inv, Dv, lane);
    if (lane == 0) static_cast<A*>(p.lse)[row_index(p, s, h, q)] = l[i] > A(0) ? m[i] + log(l[i]) : neg_inf<A>();
  }
}

}  // namespace attnrnn::cuda::sm
