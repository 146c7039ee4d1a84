// Softmax attention backward on CUDA cores: every dtype and head dim (1..256, D != Dv), any
// alignment. The same phases as softmax_bwd.cuh (dot, then dq per query block, dk/dv per key
// block over the G query heads of its kv head), with accumulators in A = float/double.
//
// Layout: 8 warps; dq: warp w owns query rows w + 8 i (i < RQ), lane = key of a 32-key block for
// the scores and lane = column for dS K; dk/dv: warp w owns key rows w + 8 i (i < RK), lane =
// query of a 32-query block for the scores and lane = column for Pᵀ dO and dSᵀ Q. Each block's
// product is summed first and then added to the running sum (short fp32 summation chains).
//
// Causal by construction: a masked P or dS is selected as 0 (not P times a difference that may
// not be finite), and each row's sums read only the rows it sees: dq the keys up to its last, dk
// and dv the queries from the first that sees the key. With flags (a tensor-core call's repair,
// common.cuh) a block runs only for a flagged (sequence, kv head).
#pragma once

#include "forward.cuh"

namespace attnrnn::cuda::sm {

// Shared memory of the generic dq kernel, in accumulator elements.
struct DqGenSmem {
  int64_t D, Dv, Bq;
  __host__ __device__ int64_t q() const { return 0; }                        // Q  [Bq][D]
  __host__ __device__ int64_t o() const { return q() + Bq * D; }             // dO [Bq][Dv]
  __host__ __device__ int64_t k() const { return o() + Bq * Dv; }            // K  [32][D+1]
  __host__ __device__ int64_t v() const { return k() + kGenBk * (D + 1); }   // V  [32][Dv+1]
  __host__ __device__ int64_t ds() const { return v() + kGenBk * (Dv + 1); }  // dS [Bq][32]
  __host__ __device__ int64_t total() const { return ds() + Bq * kGenBk; }
};

// Shared memory of the generic dk/dv kernel, in accumulator elements.
struct DkvGenSmem {
  int64_t D, Dv, Bk;
  __host__ __device__ int64_t k() const { return 0; }                        // K    [Bk][D]
  __host__ __device__ int64_t v() const { return k() + Bk * D; }             // V    [Bk][Dv]
  __host__ __device__ int64_t q() const { return v() + Bk * Dv; }            // Q    [32][D+1]
  __host__ __device__ int64_t o() const { return q() + kGenBk * (D + 1); }   // dO   [32][Dv+1]
  __host__ __device__ int64_t pr() const { return o() + kGenBk * (Dv + 1); }  // P    [Bk][32]
  __host__ __device__ int64_t ds() const { return pr() + Bk * kGenBk; }       // dS   [Bk][32]
  __host__ __device__ int64_t lse() const { return ds() + Bk * kGenBk; }      // lse  [32]
  __host__ __device__ int64_t dd() const { return lse() + kGenBk; }           // D    [32]
  __host__ __device__ int64_t total() const { return dd() + kGenBk; }
};

template <class T, int RQ>
__global__ void __launch_bounds__(kGenThreads) bwd_dq_generic_kernel(const SoftmaxAttnParams p, int64_t per_head,
                                                                     const unsigned* nonfinite) {
  using A = typename AccOf<T>::type;
  constexpr int Bq = kGenWarps * RQ;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int D = static_cast<int>(p.head_dim), Dv = static_cast<int>(p.head_dim_v);
  const DqGenSmem lay{D, Dv, Bq};
  A* smem = reinterpret_cast<A*>(smem_raw);
  A *Qs = smem + lay.q(), *dOs = smem + lay.o(), *Ks = smem + lay.k(), *Vs = smem + lay.v(), *dSs = smem + lay.ds();

  BlockPos pos;
  if (!locate_block(p, blockIdx.x, per_head, Bq, p.num_heads, false, true, pos)) return;
  const Seq& s = pos.s;
  const int64_t h = pos.head, kvh = h / (p.num_heads / p.num_kv_heads), i0 = pos.start;
  if (!generic_block_runs(nonfinite, pos.n * p.num_kv_heads + kvh)) return;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t rows = s.Lq - i0 < Bq ? s.Lq - i0 : Bq;
  const int64_t kend = s.key_end(i0 + rows - 1);
  const A scale = static_cast<A>(p.scale);
  const A* lse = static_cast<const A*>(p.lse);
  const A* Dws = static_cast<const A*>(p.workspace);

  for (int e = tid; e < Bq * D; e += kGenThreads) {
    const int r = e / D;
    Qs[e] = r < rows ? to_acc<A>(row<T>(p.q, s.b, s.q0 + i0 + r, h)[e % D]) : A(0);
  }
  for (int e = tid; e < Bq * Dv; e += kGenThreads) {
    const int r = e / Dv;
    dOs[e] = r < rows ? to_acc<A>(row<T>(p.dout, s.b, s.q0 + i0 + r, h)[e % Dv]) : A(0);
  }
  int64_t lim[RQ];
  A lse_r[RQ], D_r[RQ], dq[RQ][kGenCols];
#pragma unroll
  for (int i = 0; i < RQ; ++i) {
    const int64_t q = i0 + warp + kGenWarps * i;
    const bool live = q < s.Lq && lse[row_index(p, s, h, q)] != neg_inf<A>();
    lim[i] = live ? s.key_end(q) : 0;  // a row with no key (or past the end) gets P = 0
    lse_r[i] = live ? lse[row_index(p, s, h, q)] : A(0);
    D_r[i] = live ? Dws[row_index(p, s, h, q)] : A(0);
#pragma unroll
    for (int jj = 0; jj < kGenCols; ++jj) dq[i][jj] = A(0);
  }

  for (int64_t j0 = 0; j0 < kend; j0 += kGenBk) {
    const int nk = static_cast<int>(kend - j0 < kGenBk ? kend - j0 : kGenBk);
    __syncthreads();  // the previous key block is consumed (and Q, dO are loaded)
    for (int e = tid; e < kGenBk * D; e += kGenThreads) {
      const int r = e / D, d = e % D;
      Ks[r * (D + 1) + d] = r < nk ? to_acc<A>(row<T>(p.k, s.b, s.k0 + j0 + r, kvh)[d]) : A(0);
    }
    for (int e = tid; e < kGenBk * Dv; e += kGenThreads) {
      const int r = e / Dv, d = e % Dv;
      Vs[r * (Dv + 1) + d] = r < nk ? to_acc<A>(row<T>(p.v, s.b, s.k0 + j0 + r, kvh)[d]) : A(0);
    }
    __syncthreads();

    // Recompute P and dP for key j0 + lane; dS = P ∘ (dP - D). Written out rather than two
    // row_dots calls: those reorder this kernel's address set-up and ptxas then schedules the
    // RQ = 4 kernel differently (same registers, different SASS).
    A sc[RQ], dp[RQ];
#pragma unroll
    for (int i = 0; i < RQ; ++i) sc[i] = dp[i] = A(0);
    for (int d = 0; d < D; ++d) {
      const A kv = Ks[lane * (D + 1) + d];
#pragma unroll
      for (int i = 0; i < RQ; ++i) sc[i] += Qs[(warp + kGenWarps * i) * D + d] * kv;
    }
    for (int d = 0; d < Dv; ++d) {
      const A vv = Vs[lane * (Dv + 1) + d];
#pragma unroll
      for (int i = 0; i < RQ; ++i) dp[i] += dOs[(warp + kGenWarps * i) * Dv + d] * vv;
    }
    int seen[RQ];  // keys of the block each row sees
#pragma unroll
    for (int i = 0; i < RQ; ++i) {
      seen[i] = block_limit(lim[i] - j0, nk);
      dSs[(warp + kGenWarps * i) * kGenBk + lane] =
          lane < seen[i] ? exp_of<A>(sc[i] * scale - lse_r[i]) * (dp[i] - D_r[i]) : A(0);
    }
    __syncwarp();

    // dQ += dS K over the keys each row sees, block by block.
    accumulate_block(dq, dSs + warp * kGenBk, Ks, D + 1, D, seen, lane);
  }

#pragma unroll
  for (int i = 0; i < RQ; ++i) {
    const int64_t q = i0 + warp + kGenWarps * i;
    if (q >= s.Lq) continue;
    store_row(row<T>(p.dq, s.b, s.q0 + q, h), dq[i], scale, D, lane);
  }
}

template <class T, int RK>
__global__ void __launch_bounds__(kGenThreads) bwd_dkv_generic_kernel(const SoftmaxAttnParams p, int64_t per_head,
                                                                      const unsigned* nonfinite) {
  using A = typename AccOf<T>::type;
  constexpr int Bk = kGenWarps * RK;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int D = static_cast<int>(p.head_dim), Dv = static_cast<int>(p.head_dim_v);
  const DkvGenSmem lay{D, Dv, Bk};
  A* smem = reinterpret_cast<A*>(smem_raw);
  A *Ks = smem + lay.k(), *Vs = smem + lay.v(), *Qs = smem + lay.q(), *dOs = smem + lay.o();
  A *Ps = smem + lay.pr(), *dSs = smem + lay.ds(), *lse_s = smem + lay.lse(), *D_s = smem + lay.dd();

  BlockPos pos;
  if (!locate_block(p, blockIdx.x, per_head, Bk, p.num_kv_heads, true, false, pos)) return;
  if (!generic_block_runs(nonfinite, pos.n * p.num_kv_heads + pos.head)) return;
  const Seq& s = pos.s;
  const int64_t kvh = pos.head, G = p.num_heads / p.num_kv_heads, j0 = pos.start;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t nkeys = s.Lk - j0 < Bk ? s.Lk - j0 : Bk;
  const int64_t i_first = s.first_query(j0);
  const A scale = static_cast<A>(p.scale);
  const A* lse = static_cast<const A*>(p.lse);
  const A* Dws = static_cast<const A*>(p.workspace);

  for (int e = tid; e < Bk * D; e += kGenThreads) {
    const int r = e / D;
    Ks[e] = r < nkeys ? to_acc<A>(row<T>(p.k, s.b, s.k0 + j0 + r, kvh)[e % D]) : A(0);
  }
  for (int e = tid; e < Bk * Dv; e += kGenThreads) {
    const int r = e / Dv;
    Vs[e] = r < nkeys ? to_acc<A>(row<T>(p.v, s.b, s.k0 + j0 + r, kvh)[e % Dv]) : A(0);
  }
  A dk[RK][kGenCols], dv[RK][kGenCols];
  int64_t first[RK];  // the first query that sees each of the warp's keys
#pragma unroll
  for (int i = 0; i < RK; ++i) {
    first[i] = s.first_query(j0 + warp + kGenWarps * i);
#pragma unroll
    for (int jj = 0; jj < kGenCols; ++jj) dk[i][jj] = dv[i][jj] = A(0);
  }

  for (int64_t h = kvh * G; h < (kvh + 1) * G; ++h) {
    for (int64_t i0 = i_first; i0 < s.Lq; i0 += kGenBk) {
      const int nq = static_cast<int>(s.Lq - i0 < kGenBk ? s.Lq - i0 : kGenBk);
      __syncthreads();  // the previous query block is consumed (and K, V are loaded)
      for (int e = tid; e < kGenBk * D; e += kGenThreads) {
        const int r = e / D, d = e % D;
        Qs[r * (D + 1) + d] = r < nq ? to_acc<A>(row<T>(p.q, s.b, s.q0 + i0 + r, h)[d]) : A(0);
      }
      for (int e = tid; e < kGenBk * Dv; e += kGenThreads) {
        const int r = e / Dv, d = e % Dv;
        dOs[r * (Dv + 1) + d] = r < nq ? to_acc<A>(row<T>(p.dout, s.b, s.q0 + i0 + r, h)[d]) : A(0);
      }
      if (tid < kGenBk) {
        lse_s[tid] = tid < nq ? lse[row_index(p, s, h, i0 + tid)] : neg_inf<A>();
        D_s[tid] = tid < nq ? Dws[row_index(p, s, h, i0 + tid)] : A(0);
      }
      __syncthreads();

      // Recompute Pᵀ and dPᵀ of query i0 + lane against the warp's keys; dSᵀ = Pᵀ ∘ (dPᵀ - D).
      A sc[RK], dp[RK];
      row_dots(sc, Ks + warp * D, Qs + lane * (D + 1), D);
      row_dots(dp, Vs + warp * Dv, dOs + lane * (Dv + 1), Dv);
      const A lq = lse_s[lane], dq = D_s[lane];
      const int64_t kvis = s.key_end(i0 + lane);  // keys query i0 + lane sees
#pragma unroll
      for (int i = 0; i < RK; ++i) {
        const int kr = warp + kGenWarps * i;
        const bool live = lane < nq && lq != neg_inf<A>() && j0 + kr < kvis;
        const A pr = live ? exp_of<A>(sc[i] * scale - lq) : A(0);
        Ps[kr * kGenBk + lane] = pr;
        dSs[kr * kGenBk + lane] = live ? pr * (dp[i] - dq) : A(0);
      }
      __syncwarp();

      // dV += Pᵀ dO, dK += dSᵀ Q over the queries of the block that see each key (from[i] on; those
      // every key sees without the compare), block by block.
      int from[RK], any = nq, all = 0;
#pragma unroll
      for (int i = 0; i < RK; ++i) {
        from[i] = block_limit(first[i] - i0, nq);
        any = min(any, from[i]);
        all = max(all, from[i]);
      }
#pragma unroll
      for (int jj = 0; jj < kGenCols; ++jj) {
        const int col = lane + 32 * jj;
        if (col >= Dv && col >= D) continue;
        A pv[RK], pk[RK];
#pragma unroll
        for (int i = 0; i < RK; ++i) pv[i] = pk[i] = A(0);
        auto add = [&](int q, bool seen_by_all) {
          const A ov = col < Dv ? dOs[q * (Dv + 1) + col] : A(0);
          const A qv = col < D ? Qs[q * (D + 1) + col] : A(0);
#pragma unroll
          for (int i = 0; i < RK; ++i) {
            const int kr = warp + kGenWarps * i;
            if (!seen_by_all && q < from[i]) continue;
            pv[i] += Ps[kr * kGenBk + q] * ov;
            pk[i] += dSs[kr * kGenBk + q] * qv;
          }
        };
        for (int q = any; q < all; ++q) add(q, false);
        for (int q = all; q < nq; ++q) add(q, true);
#pragma unroll
        for (int i = 0; i < RK; ++i) {
          dv[i][jj] += pv[i];
          dk[i][jj] += pk[i];
        }
      }
    }
  }

#pragma unroll
  for (int i = 0; i < RK; ++i) {
    const int kr = warp + kGenWarps * i;
    if (kr >= nkeys) continue;
    T* ok = row<T>(p.dk, s.b, s.k0 + j0 + kr, kvh);
    T* ov = row<T>(p.dv, s.b, s.k0 + j0 + kr, kvh);
#pragma unroll
    for (int jj = 0; jj < kGenCols; ++jj) {
      const int col = lane + 32 * jj;
      if (col < D) ok[col] = from_acc<T, A>(dk[i][jj] * scale);
      if (col < Dv) ov[col] = from_acc<T, A>(dv[i][jj]);
    }
  }
}

}  // namespace attnrnn::cuda::sm
