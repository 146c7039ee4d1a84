// Chunkwise backward of causal linear attention, the generic CUDA path.
//
// With n_t = q'_t S_t and d_t = q'_t . z_t + eps (1 without normalize), o_t = n_t / d_t:
//   dn_t = do_t / d_t,   dd_t = -(do_t . o_t) / d_t      (0 without normalize)
//   dq'_t = dn_t S_t^T + dd_t z_t
//   dk'_s = dS~_s v_s + dz~_s,   dv_s = k'_s dS~_s,
// where dS~_s = dS_final + sum_{t>=s} q'_t^T dn_t and dz~_s = dz_final + sum_{t>=s} dd_t q'_t run
// backwards over the sequence. Three kernels, each recomputing what it needs chunk by chunk:
//   dq  forward sweep, one block per (n, K tile, g): S[tile, :] and z on chip; writes d_t and
//       dd_t of every (token, query head) to the workspace (2 x B*T*H accumulators)
//   dk  reverse sweep, one block per (n, K tile, g): dS~[tile, :], dz~[tile] on chip
//   dv  reverse sweep, one block per (n, V tile, g): dS~[:, tile] on chip
// Nothing of size T x K x V is stored: the only scratch is the two per-token scalars.
#pragma once

#include "generic_dot.cuh"

namespace attnrnn::cuda {

constexpr int kBwdThreads = 256;

// ---- dq: forward sweep ----------------------------------------------------------------------------
inline int64_t dq_smem(int64_t K, int64_t V, int64_t C, int64_t BK) {
  return BK * (V + 1)    // S   [BK][V+1]  state rows of the K tile
         + K             // z   [K]
         + C * (K + 1)   // Ks  [C][K+1]   phi(k)
         + C * (K + 1)   // Qs  [C][K+1]   scale * phi(q), one head
         + C * V         // Vs  [C][V]
         + C * V         // dN  [C][V]     do / d
         + C * (C + 1)   // dA  [C][C+1]   scores, then their gradient
         + 2 * C;        // den, dd [C]
}

template <class T>
__global__ void __launch_bounds__(kBwdThreads) generic_grad_q_kernel(const ChunkArgs p, int C, int BK) {
  using A = typename AccOf<T>::type;
  extern __shared__ __align__(16) unsigned char smem_bytes[];
  const int K = static_cast<int>(p.head_dim_k), V = static_cast<int>(p.head_dim_v);
  const int64_t Hkv = p.num_kv_heads, G = p.num_heads / p.num_kv_heads;
  const int64_t n = blockIdx.x, g = blockIdx.z;
  if (!generic_block_runs(p, n, g)) return;
  const int k0 = blockIdx.y * BK, bk = min(BK, K - k0);
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, KP = K + 1, CP = C + 1, VP = V + 1;
  const Seq seq = sequence(p, n);
  const A scale = static_cast<A>(p.scale), eps = static_cast<A>(p.eps);

  A* S = reinterpret_cast<A*>(smem_bytes);
  A* z = S + BK * VP;
  A* Ks = z + K;
  A* Qs = Ks + C * KP;
  A* Vs = Qs + C * KP;
  A* dN = Vs + C * V;
  A* dA = dN + C * V;
  A* den = dA + C * CP;
  A* dd = den + C;

  const int64_t state_row = n * Hkv + g;
  const A* S0 = static_cast<const A*>(p.initial_S);
  const A* z0 = static_cast<const A*>(p.initial_z);
  for (int i = tid; i < BK * V; i += kBwdThreads) {
    const int kk = i / V, v = i % V;
    S[kk * VP + v] = (S0 != nullptr && kk < bk) ? S0[(state_row * K + k0 + kk) * V + v] : A(0);
  }
  for (int k = tid; k < K; k += kBwdThreads) z[k] = z0 != nullptr ? z0[state_row * K + k] : A(0);
  __syncthreads();

  for (int64_t c0 = 0; c0 < seq.len; c0 += C) {
    const int cl = static_cast<int>(seq.len - c0 < C ? seq.len - c0 : C);
    const int64_t t0 = seq.t0 + c0;
    // Load: phi(k) and v of the chunk (zero rows past the end).
    for (int i = tid; i < C * K; i += kBwdThreads) {
      const int t = i / K, k = i % K;
      Ks[t * KP + k] = t < cl ? phi(p.feature_map, to_acc<A>(row<T>(p.k, seq.b, t0 + t, g)[k])) : A(0);
    }
    for (int i = tid; i < C * V; i += kBwdThreads) {
      const int t = i / V;
      Vs[i] = t < cl ? to_acc<A>(row<T>(p.v, seq.b, t0 + t, g)[i % V]) : A(0);
    }

    for (int64_t h = g * G; h < (g + 1) * G; ++h) {
      __syncthreads();  // Ks/Vs are loaded; the previous head is done with Qs, dN, dA, den, dd
      for (int i = tid; i < C * K; i += kBwdThreads) {
        const int t = i / K, k = i % K;
        Qs[t * KP + k] = t < cl ? scale * phi(p.feature_map, to_acc<A>(row<T>(p.q, seq.b, t0 + t, h)[k])) : A(0);
      }
      __syncthreads();

      // Denominators, recomputed as in the forward (scores held in dA for now).
      if (p.normalize) {
        for (int i = tid; i < C * C; i += kBwdThreads) {
          const int t = i / C, j = i % C;
          A a = 0;
          if (j <= t) a = dot(a, Qs + t * KP, 1, Ks + j * KP, 1, K);
          dA[t * CP + j] = a;
        }
        __syncthreads();
        for (int t = tid; t < C; t += kBwdThreads) {
          const A d = dot(eps, Qs + t * KP, 1, z, 1, K);  // q'_t . z + eps
          den[t] = sum(d, dA + t * CP, 1, t + 1);            // + the chunk's scores up to t
        }
        __syncthreads();
      } else {
        for (int t = tid; t < C; t += kBwdThreads) den[t] = A(1);
        __syncthreads();
      }

      // dn = do / d and dd = -(do . o) / d, one warp per token.
      for (int t = warp; t < C; t += kBwdThreads / 32) {
        A dot = 0;
        for (int v = lane; v < V; v += 32) {
          const A dov = t < cl ? to_acc<A>(row<T>(p.dout, seq.b, t0 + t, h)[v]) : A(0);
          dN[t * V + v] = t < cl ? dov / den[t] : A(0);
          if (p.normalize && t < cl) dot += dov * to_acc<A>(row<T>(p.out, seq.b, t0 + t, h)[v]);
        }
        for (int off = 16; off > 0; off /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, off);
        if (lane == 0) {
          dd[t] = (p.normalize && t < cl) ? -dot / den[t] : A(0);
          if (blockIdx.y == 0 && t < cl) {
            BwdWorkspace::den<A>(p)[token_index(p, seq, t0 + t, h)] = den[t];
            BwdWorkspace::dd<A>(p)[token_index(p, seq, t0 + t, h)] = dd[t];
          }
        }
      }
      __syncthreads();

      // dA[t][j] = dn_t . v_j + dd_t for j <= t.
      for (int i = tid; i < C * C; i += kBwdThreads) {
        const int t = i / C, j = i % C;
        A a = 0;
        if (j <= t) {
          a = dd[t];
          a = dot(a, dN + t * V, 1, Vs + j * V, 1, V);
        }
        dA[t * CP + j] = a;
      }
      __syncthreads();

      // dq'_t = dn_t S^T + dd_t z + sum_{j<=t} dA[t][j] k'_j, then dq = scale phi'(q) dq'.
      for (int i = tid; i < C * BK; i += kBwdThreads) {
        const int t = i / BK, kk = i % BK, k = k0 + kk;
        if (t >= cl || kk >= bk) continue;
        A acc = dd[t] * z[k];
        acc = dot(acc, dN + t * V, 1, S + kk * VP, 1, V);
        acc = dot(acc, dA + t * CP, 1, Ks + k, KP, t + 1);
        const A qraw = to_acc<A>(row<T>(p.q, seq.b, t0 + t, h)[k]);
        row<T>(p.dq, seq.b, t0 + t, h)[k] = from_acc<T, A>(scale * dphi(p.feature_map, qraw) * acc);
      }
    }
    __syncthreads();

    // State update of the K tile and of the full key sum.
    for (int i = tid; i < BK * V; i += kBwdThreads) {
      const int kk = i / V, v = i % V;
      if (kk >= bk) continue;
      A acc = S[kk * VP + v];
      // written out: see generic_dot.cuh
      for (int j = 0; j < cl; ++j) acc += Ks[j * KP + k0 + kk] * Vs[j * V + v];
      S[kk * VP + v] = acc;
    }
    for (int k = tid; k < K; k += kBwdThreads) z[k] = sum(z[k], Ks + k, KP, cl);
    __syncthreads();
  }
}

// ---- dk: reverse sweep ----------------------------------------------------------------------------
inline int64_t dk_smem(int64_t V, int64_t C, int64_t BK) {
  return BK * (V + 1)    // dS  [BK][V+1]  dS~ rows of the K tile
         + BK            // dz  [BK]
         + C * (BK + 1)  // Qs  [C][BK+1]  scale * phi(q) on the K tile, one head
         + C * V         // Vs  [C][V]
         + C * V         // dN  [C][V]     do / d, one head
         + C * (C + 1)   // dA  [C][C+1]
         + C * BK        // dK  [C][BK]    dk' accumulator of the chunk
         + C;            // dd  [C]
}

template <class T>
__global__ void __launch_bounds__(kBwdThreads) generic_grad_k_kernel(const ChunkArgs p, int C, int BK) {
  using A = typename AccOf<T>::type;
  extern __shared__ __align__(16) unsigned char smem_bytes[];
  const int K = static_cast<int>(p.head_dim_k), V = static_cast<int>(p.head_dim_v);
  const int64_t Hkv = p.num_kv_heads, G = p.num_heads / p.num_kv_heads;
  const int64_t n = blockIdx.x, g = blockIdx.z;
  if (!generic_block_runs(p, n, g)) return;
  const int k0 = blockIdx.y * BK, bk = min(BK, K - k0);
  const int tid = threadIdx.x, CP = C + 1, VP = V + 1, QP = BK + 1;
  const Seq seq = sequence(p, n);
  const A scale = static_cast<A>(p.scale);
  const A* ws_den = BwdWorkspace::den<A>(p);
  const A* ws_dd = BwdWorkspace::dd<A>(p);

  A* dS = reinterpret_cast<A*>(smem_bytes);
  A* dz = dS + BK * VP;
  A* Qs = dz + BK;
  A* Vs = Qs + C * QP;
  A* dN = Vs + C * V;
  A* dA = dN + C * V;
  A* dK = dA + C * CP;
  A* dd = dK + C * BK;

  const int64_t state_row = n * Hkv + g;
  const A* dS1 = static_cast<const A*>(p.d_final_S);
  const A* dz1 = static_cast<const A*>(p.d_final_z);
  for (int i = tid; i < BK * V; i += kBwdThreads) {
    const int kk = i / V, v = i % V;
    dS[kk * VP + v] = (dS1 != nullptr && kk < bk) ? dS1[(state_row * K + k0 + kk) * V + v] : A(0);
  }
  for (int kk = tid; kk < BK; kk += kBwdThreads) dz[kk] = (dz1 != nullptr && kk < bk) ? dz1[state_row * K + k0 + kk] : A(0);
  __syncthreads();

  const int64_t num_chunks = (seq.len + C - 1) / C;
  for (int64_t c = num_chunks - 1; c >= 0; --c) {
    const int64_t c0 = c * C;
    const int cl = static_cast<int>(seq.len - c0 < C ? seq.len - c0 : C);
    const int64_t t0 = seq.t0 + c0;
    // Load: v of the chunk.
    for (int i = tid; i < C * V; i += kBwdThreads) {
      const int t = i / V;
      Vs[i] = t < cl ? to_acc<A>(row<T>(p.v, seq.b, t0 + t, g)[i % V]) : A(0);
    }
    __syncthreads();
    // Inter-chunk part first, with dS~ and dz~ of the chunks after this one.
    for (int i = tid; i < C * BK; i += kBwdThreads) {
      const int s = i / BK, kk = i % BK;
      A acc = dz[kk];
      for (int v = 0; v < V; ++v) acc += dS[kk * VP + v] * Vs[s * V + v];  // written out: see generic_dot.cuh
      dK[i] = acc;
    }
    for (int64_t h = g * G; h < (g + 1) * G; ++h) {
      __syncthreads();  // the previous head is done with Qs, dN, dA, dd
      // Per head: phi(q) on the K tile, dd and dn = do / d of the chunk (d, dd from the dq kernel).
      for (int i = tid; i < C * BK; i += kBwdThreads) {
        const int t = i / BK, kk = i % BK;
        Qs[t * QP + kk] = (t < cl && kk < bk)
                              ? scale * phi(p.feature_map, to_acc<A>(row<T>(p.q, seq.b, t0 + t, h)[k0 + kk]))
                              : A(0);
      }
      for (int t = tid; t < C; t += kBwdThreads)
        dd[t] = t < cl ? ws_dd[token_index(p, seq, t0 + t, h)] : A(0);
      for (int i = tid; i < C * V; i += kBwdThreads) {
        const int t = i / V;
        dN[i] = t < cl ? to_acc<A>(row<T>(p.dout, seq.b, t0 + t, h)[i % V]) / ws_den[token_index(p, seq, t0 + t, h)]
                       : A(0);
      }
      __syncthreads();
      // dA[t][j] = dn_t . v_j + dd_t for j <= t, as in the dq kernel.
      for (int i = tid; i < C * C; i += kBwdThreads) {
        const int t = i / C, j = i % C;
        A a = 0;
        if (j <= t) {
          a = dd[t];
          for (int v = 0; v < V; ++v) a += dN[t * V + v] * Vs[j * V + v];  // written out: see generic_dot.cuh
        }
        dA[t * CP + j] = a;
      }
      __syncthreads();
      // Intra-chunk: dk'_s += sum_{t>=s} dA[t][s] q'_t.
      for (int i = tid; i < C * BK; i += kBwdThreads) {
        const int s = i / BK, kk = i % BK;
        dK[i] = dot(dK[i], dA + s, CP, Qs + kk, QP, s, cl);
      }
      // dS~ += Q'^T dN, dz~ += Q'^T dd (this head's share of the chunk).
      for (int i = tid; i < BK * V; i += kBwdThreads) {
        const int kk = i / V, v = i % V;
        dS[kk * VP + v] = dot(dS[kk * VP + v], Qs + kk, QP, dN + v, V, cl);
      }
      for (int kk = tid; kk < BK; kk += kBwdThreads) {
        A acc = dz[kk];
        for (int t = 0; t < cl; ++t) acc += Qs[t * QP + kk] * dd[t];  // written out: see generic_dot.cuh
        dz[kk] = acc;
      }
    }
    __syncthreads();
    // dk = phi'(k) dk' on the K tile.
    for (int i = tid; i < C * BK; i += kBwdThreads) {
      const int s = i / BK, kk = i % BK;
      if (s >= cl || kk >= bk) continue;
      const A kraw = to_acc<A>(row<T>(p.k, seq.b, t0 + s, g)[k0 + kk]);
      row<T>(p.dk, seq.b, t0 + s, g)[k0 + kk] = from_acc<T, A>(dphi(p.feature_map, kraw) * dK[i]);
    }
    __syncthreads();
  }
  if (p.d_initial_z != nullptr) {
    A* out = static_cast<A*>(p.d_initial_z);
    for (int kk = tid; kk < bk; kk += kBwdThreads) out[state_row * K + k0 + kk] = dz[kk];
  }
}

// ---- dv: reverse sweep ----------------------------------------------------------------------------
inline int64_t dv_smem(int64_t K, int64_t C, int64_t BV) {
  return K * BV          // dS  [K][BV]    dS~ columns of the V tile
         + C * (K + 1)   // Ks  [C][K+1]   phi(k)
         + C * (K + 1)   // Qs  [C][K+1]   scale * phi(q), one head
         + C * BV        // dN  [C][BV]    do / d on the V tile, one head
         + C * (C + 1)   // As  [C][C+1]   causal scores
         + C * BV;       // dV  [C][BV]    dv accumulator of the chunk
}

template <class T>
__global__ void __launch_bounds__(kBwdThreads) generic_grad_v_kernel(const ChunkArgs p, int C, int BV) {
  using A = typename AccOf<T>::type;
  extern __shared__ __align__(16) unsigned char smem_bytes[];
  const int K = static_cast<int>(p.head_dim_k), V = static_cast<int>(p.head_dim_v);
  const int64_t Hkv = p.num_kv_heads, G = p.num_heads / p.num_kv_heads;
  const int64_t n = blockIdx.x, g = blockIdx.z;
  if (!generic_block_runs(p, n, g)) return;
  const int v0 = blockIdx.y * BV, bv = min(BV, V - v0);
  const int tid = threadIdx.x, KP = K + 1, CP = C + 1;
  const Seq seq = sequence(p, n);
  const A scale = static_cast<A>(p.scale);
  const A* ws_den = BwdWorkspace::den<A>(p);

  A* dS = reinterpret_cast<A*>(smem_bytes);
  A* Ks = dS + K * BV;
  A* Qs = Ks + C * KP;
  A* dN = Qs + C * KP;
  A* As = dN + C * BV;
  A* dV = As + C * CP;

  const int64_t state_row = n * Hkv + g;
  const A* dS1 = static_cast<const A*>(p.d_final_S);
  for (int i = tid; i < K * BV; i += kBwdThreads) {
    const int k = i / BV, v = i % BV;
    dS[i] = (dS1 != nullptr && v < bv) ? dS1[(state_row * K + k) * V + v0 + v] : A(0);
  }
  __syncthreads();

  const int64_t num_chunks = (seq.len + C - 1) / C;
  for (int64_t c = num_chunks - 1; c >= 0; --c) {
    const int64_t c0 = c * C;
    const int cl = static_cast<int>(seq.len - c0 < C ? seq.len - c0 : C);
    const int64_t t0 = seq.t0 + c0;
    // Load: phi(k) of the chunk.
    for (int i = tid; i < C * K; i += kBwdThreads) {
      const int t = i / K, k = i % K;
      Ks[t * KP + k] = t < cl ? phi(p.feature_map, to_acc<A>(row<T>(p.k, seq.b, t0 + t, g)[k])) : A(0);
    }
    __syncthreads();
    // Inter-chunk part: dv_s = k'_s dS~ of the chunks after this one.
    for (int i = tid; i < C * BV; i += kBwdThreads) {
      const int s = i / BV, v = i % BV;
      A acc = 0;
      for (int k = 0; k < K; ++k) acc += Ks[s * KP + k] * dS[k * BV + v];  // written out: see generic_dot.cuh
      dV[i] = acc;
    }
    for (int64_t h = g * G; h < (g + 1) * G; ++h) {
      __syncthreads();  // the previous head is done with Qs, dN, As
      // Per head: phi(q) and dn = do / d on the V tile (d from the dq kernel).
      for (int i = tid; i < C * K; i += kBwdThreads) {
        const int t = i / K, k = i % K;
        Qs[t * KP + k] = t < cl ? scale * phi(p.feature_map, to_acc<A>(row<T>(p.q, seq.b, t0 + t, h)[k])) : A(0);
      }
      for (int i = tid; i < C * BV; i += kBwdThreads) {
        const int t = i / BV, v = i % BV;
        dN[i] = (t < cl && v < bv)
                    ? to_acc<A>(row<T>(p.dout, seq.b, t0 + t, h)[v0 + v]) / ws_den[token_index(p, seq, t0 + t, h)]
                    : A(0);
      }
      __syncthreads();
      // Causal scores A[t][j] = q'_t . k'_j for j <= t, as in the forward.
      for (int i = tid; i < C * C; i += kBwdThreads) {
        const int t = i / C, j = i % C;
        A a = 0;
        if (j <= t) a = dot(a, Qs + t * KP, 1, Ks + j * KP, 1, K);
        As[t * CP + j] = a;
      }
      __syncthreads();
      // Intra-chunk: dv_s += sum_{t>=s} A[t][s] dn_t; then dS~ += Q'^T dN.
      for (int i = tid; i < C * BV; i += kBwdThreads) {
        const int s = i / BV, v = i % BV;
        dV[i] = dot(dV[i], As + s, CP, dN + v, BV, s, cl);
      }
      for (int i = tid; i < K * BV; i += kBwdThreads) {
        const int k = i / BV, v = i % BV;
        dS[i] = dot(dS[i], Qs + k, KP, dN + v, BV, cl);
      }
    }
    __syncthreads();
    // dv of the chunk on the V tile.
    for (int i = tid; i < C * BV; i += kBwdThreads) {
      const int s = i / BV, v = i % BV;
      if (s < cl && v < bv) row<T>(p.dv, seq.b, t0 + s, g)[v0 + v] = from_acc<T, A>(dV[i]);
    }
    __syncthreads();
  }
  if (p.d_initial_S != nullptr) {
    A* out = static_cast<A*>(p.d_initial_S);
    for (int i = tid; i < K * BV; i += kBwdThreads) {
      const int k = i / BV, v = i % BV;
      if (v < bv) out[(state_row * K + k) * V + v0 + v] = dS[i];
    }
  }
}

}  // namespace attnrnn::cuda
