// Chunkwise forward of causal linear attention, the generic CUDA path (any K, V <= 256, any dtype,
// CUDA-core FMAs in the accumulator type).
//
// One block owns sequence n, key/value head g and a tile of BV value columns; it walks the chunks
// of the sequence in order with the state slice S[:, tile] and z in shared memory:
//   intra-chunk  A = Q' K'^T (causal, diagonal included), per query head of the group
//   inter-chunk  o = (Q' S + A V) / (Q' z + rowsum(A) + eps)
//   state        S += K'^T V,  z += colsum(K')
#pragma once

#include "generic_dot.cuh"

namespace attnrnn::cuda {

constexpr int kFwdThreads = 256;

// Shared memory of one block, in accumulator elements.
struct FwdSmem {
  int64_t S, z, Ks, Qs, Vs, A, den;
  __host__ __device__ int64_t total() const { return S + z + Ks + Qs + Vs + A + den; }
};

__host__ __device__ inline FwdSmem fwd_smem(int64_t K, int64_t C, int64_t BV) {
  return FwdSmem{K * BV,       // S   [K][BV]    state slice
                 K,            // z   [K]        key sum
                 C * (K + 1),  // Ks  [C][K+1]   phi(k) of the chunk (+1: conflict-free column reads)
                 C * (K + 1),  // Qs  [C][K+1]   scale * phi(q) of one query head
                 C * BV,       // Vs  [C][BV]    value tile of the chunk
                 C * (C + 1),  // A   [C][C+1]   causal scores
                 C};           // den [C]        denominators
}

template <class T>
__global__ void __launch_bounds__(kFwdThreads) generic_forward_kernel(const ChunkArgs p, int C, int BV) {
  using A = typename AccOf<T>::type;
  extern __shared__ __align__(16) unsigned char smem_bytes[];
  const int K = static_cast<int>(p.head_dim_k), V = static_cast<int>(p.head_dim_v);
  const int64_t Hkv = p.num_kv_heads, G = p.num_heads / p.num_kv_heads;
  const int64_t n = blockIdx.x, g = blockIdx.z;
  if (!generic_block_runs(p, n, g)) return;
  const int v0 = blockIdx.y * BV, bv = min(BV, V - v0);
  const int tid = threadIdx.x, KP = K + 1, CP = C + 1;
  const Seq seq = sequence(p, n);
  const A scale = static_cast<A>(p.scale), eps = static_cast<A>(p.eps);

  const FwdSmem sz = fwd_smem(K, C, BV);
  A* S = reinterpret_cast<A*>(smem_bytes);
  A* z = S + sz.S;
  A* Ks = z + sz.z;
  A* Qs = Ks + sz.Ks;
  A* Vs = Qs + sz.Qs;
  A* As = Vs + sz.Vs;
  A* den = As + sz.A;

  const int64_t state_row = n * Hkv + g;
  const A* S0 = static_cast<const A*>(p.initial_S);
  const A* z0 = static_cast<const A*>(p.initial_z);
  for (int i = tid; i < K * BV; i += kFwdThreads) {
    const int k = i / BV, v = i % BV;
    S[i] = (S0 != nullptr && v < bv) ? S0[(state_row * K + k) * V + v0 + v] : A(0);
  }
  for (int k = tid; k < K; k += kFwdThreads) z[k] = z0 != nullptr ? z0[state_row * K + k] : A(0);
  __syncthreads();

  for (int64_t c0 = 0; c0 < seq.len; c0 += C) {
    const int cl = static_cast<int>(seq.len - c0 < C ? seq.len - c0 : C);
    const int64_t t0 = seq.t0 + c0;

    // Load: phi(k) and the value tile of the chunk (zero rows past the end).
    for (int i = tid; i < C * K; i += kFwdThreads) {
      const int t = i / K, k = i % K;
      Ks[t * KP + k] = t < cl ? phi(p.feature_map, to_acc<A>(row<T>(p.k, seq.b, t0 + t, g)[k])) : A(0);
    }
    for (int i = tid; i < C * BV; i += kFwdThreads) {
      const int t = i / BV, v = i % BV;
      Vs[i] = (t < cl && v < bv) ? to_acc<A>(row<T>(p.v, seq.b, t0 + t, g)[v0 + v]) : A(0);
    }

    for (int64_t h = g * G; h < (g + 1) * G; ++h) {
      __syncthreads();  // Ks/Vs are loaded; the previous head is done with Qs, As, den
      for (int i = tid; i < C * K; i += kFwdThreads) {
        const int t = i / K, k = i % K;
        Qs[t * KP + k] = t < cl ? scale * phi(p.feature_map, to_acc<A>(row<T>(p.q, seq.b, t0 + t, h)[k])) : A(0);
      }
      __syncthreads();

      // Intra-chunk scores A[t][j] = q'_t . k'_j for j <= t.
      for (int i = tid; i < C * C; i += kFwdThreads) {
        const int t = i / C, j = i % C;
        A a = 0;
        if (j <= t) a = dot(a, Qs + t * KP, 1, Ks + j * KP, 1, K);
        As[t * CP + j] = a;
      }
      __syncthreads();

      // Denominators q'_t . z_t + eps, with z_t = z + the chunk's keys up to t.
      if (p.normalize) {
        for (int t = tid; t < C; t += kFwdThreads) {
          A d = eps;
          for (int k = 0; k < K; ++k) d += Qs[t * KP + k] * z[k];  // written out: see generic_dot.cuh
          d = sum(d, As + t * CP, 1, t + 1);
          den[t] = d;
          if (p.den_out != nullptr && blockIdx.y == 0 && t < cl)  // w for the backward (den_out)
            static_cast<float*>(p.den_out)[token_index(p, seq, t0 + t, h)] = static_cast<float>(scale / d);
        }
        __syncthreads();
      }

      // Output o_t = (q'_t S + sum_{j<=t} A[t][j] v_j) / den_t.
      for (int i = tid; i < C * BV; i += kFwdThreads) {
        const int t = i / BV, v = i % BV;
        if (t >= cl || v >= bv) continue;
        A acc = dot(A(0), Qs + t * KP, 1, S + v, BV, K);
        acc = dot(acc, As + t * CP, 1, Vs + v, BV, t + 1);
        if (p.normalize) acc /= den[t];
        row<T>(p.o, seq.b, t0 + t, h)[v0 + v] = from_acc<T, A>(acc);
      }
    }
    __syncthreads();

    // State update: S += K'^T V, z += colsum(K').
    for (int i = tid; i < K * BV; i += kFwdThreads) {
      const int k = i / BV, v = i % BV;
      S[i] = dot(S[i], Ks + k, KP, Vs + v, BV, cl);
    }
    for (int k = tid; k < K; k += kFwdThreads) z[k] = sum(z[k], Ks + k, KP, cl);
    __syncthreads();
  }

  if (p.final_S != nullptr) {
    A* out = static_cast<A*>(p.final_S);
    for (int i = tid; i < K * BV; i += kFwdThreads) {
      const int k = i / BV, v = i % BV;
      if (v < bv) out[(state_row * K + k) * V + v0 + v] = S[i];
    }
  }
  if (p.final_z != nullptr && blockIdx.y == 0) {
    A* out = static_cast<A*>(p.final_z);
    for (int k = tid; k < K; k += kFwdThreads) out[state_row * K + k] = z[k];
  }
}

}  // namespace attnrnn::cuda
