// Chunkwise forward on tensor cores (mma.sync m16n8k16, bf16 operands, fp32 accumulators) for
// bf16 inputs with K in {64, 128}, V a multiple of 64, chunks of 64 tokens.
//
// One block (4 warps) owns sequence n, key/value head g and 64 value columns. Warp w owns tokens
// [16w, 16w + 16) of each chunk for the outputs and state rows [w K/4, (w + 1) K/4) for the update;
// the fp32 state slice lives in the warps' registers for the whole sequence. Per chunk:
//   intra-chunk  P = causal(Q' K'^T)                      (fp32 accumulators -> bf16 A operand)
//   inter-chunk  o = (P V + Q' S_hi + Q' S_lo) / den,     den = Q' z + rowsum(P) + eps
//   state        S += K'^T V (registers),  z += colsum(K');  S is split into bf16 hi + lo parts in
//                shared memory for the next chunk's Q' S, so the state keeps ~16 bits of mantissa.
#pragma once

#include "common.cuh"

namespace attnrnn::cuda {

constexpr int kTcThreads = 128;
constexpr int kTcChunk = 64;
constexpr int kTcBV = 64;

// Shared memory of one block, in bf16 elements (+ fp32 z and q'.z at the end). Row pads of 8
// elements make the fragment loads (8 rows x 4 word columns per warp) bank-conflict free.
struct TcSmem {
  int K;
  __host__ __device__ int qk_row() const { return K + 8; }
  __host__ __device__ int t_row() const { return kTcChunk + 8; }
  __host__ __device__ int64_t Qs() const { return 0; }                                  // [64][K+8]  q'
  __host__ __device__ int64_t Ks() const { return Qs() + int64_t(kTcChunk) * qk_row(); }  // [64][K+8]  k'
  __host__ __device__ int64_t Kt() const { return Ks() + int64_t(kTcChunk) * qk_row(); }  // [K][72]    k'^T
  __host__ __device__ int64_t Vt() const { return Kt() + int64_t(K) * t_row(); }          // [64][72]   v^T
  __host__ __device__ int64_t Sh() const { return Vt() + int64_t(kTcBV) * t_row(); }      // [64][K+8]  S^T hi
  __host__ __device__ int64_t Sl() const { return Sh() + int64_t(kTcBV) * qk_row(); }     // [64][K+8]  S^T lo
  __host__ __device__ int64_t bf16_elems() const { return Sl() + int64_t(kTcBV) * qk_row(); }
  __host__ __device__ int64_t bytes() const { return bf16_elems() * 2 + (K + kTcChunk) * 4; }
};

__device__ __forceinline__ void mma_bf16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

__device__ __forceinline__ uint32_t ld32(const __nv_bfloat16* p) { return *reinterpret_cast<const uint32_t*>(p); }

// A operand (16 x 16, row-major) at rows [r0, r0+16), columns [c0, c0+16) of X (row stride ld).
struct FragA {
  uint32_t x[4];
  __device__ __forceinline__ void load(const __nv_bfloat16* X, int ld, int r0, int c0, int lane) {
    const int g = lane >> 2, t2 = (lane & 3) * 2;
    x[0] = ld32(X + (r0 + g) * ld + c0 + t2);
    x[1] = ld32(X + (r0 + g + 8) * ld + c0 + t2);
    x[2] = ld32(X + (r0 + g) * ld + c0 + t2 + 8);
    x[3] = ld32(X + (r0 + g + 8) * ld + c0 + t2 + 8);
  }
};

// B operand (16 x 8, "col"): element (k, n) read from Bt[n][k] (row stride ld), n in [n0, n0+8).
__device__ __forceinline__ void load_b(const __nv_bfloat16* Bt, int ld, int n0, int k0, int lane, uint32_t& b0,
                                       uint32_t& b1) {
  const int g = lane >> 2, t2 = (lane & 3) * 2;
  b0 = ld32(Bt + (n0 + g) * ld + k0 + t2);
  b1 = ld32(Bt + (n0 + g) * ld + k0 + t2 + 8);
}

// K = 64 or 128: each warp updates K/4 state rows, i.e. KT = K/64 m-tiles of 16.
template <int K>
__global__ void __launch_bounds__(kTcThreads) chunk_fwd_tc_kernel(const LinearAttnParams p) {
  constexpr int KT = K / 64, QK = K + 8, TR = kTcChunk + 8, C = kTcChunk;
  extern __shared__ __align__(16) unsigned char smem_bytes[];
  const TcSmem lay{K};
  __nv_bfloat16* smem = reinterpret_cast<__nv_bfloat16*>(smem_bytes);
  __nv_bfloat16* Qs = smem + lay.Qs();
  __nv_bfloat16* Ks = smem + lay.Ks();
  __nv_bfloat16* Kt = smem + lay.Kt();
  __nv_bfloat16* Vt = smem + lay.Vt();
  __nv_bfloat16* Sh = smem + lay.Sh();
  __nv_bfloat16* Sl = smem + lay.Sl();
  float* z = reinterpret_cast<float*>(smem + lay.bf16_elems());
  float* qz = z + K;

  const int V = static_cast<int>(p.head_dim_v);
  const int64_t Hkv = p.num_kv_heads, G = p.num_heads / p.num_kv_heads;
  const int64_t n = blockIdx.x, g = blockIdx.z;
  const int v0 = blockIdx.y * kTcBV;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, gr = lane >> 2, t2 = (lane & 3) * 2;
  const Seq seq = sequence(p, n);
  const float scale = static_cast<float>(p.scale), eps = static_cast<float>(p.eps);
  const int64_t state_row = n * Hkv + g;

  // State rows of this warp in registers: S[d][v], d = warp*K/4 + mi*16 + gr (+8), v = ni*8 + t2 (+1).
  float S[KT][8][4];
  const float* S0 = static_cast<const float*>(p.initial_S);
#pragma unroll
  for (int mi = 0; mi < KT; ++mi)
#pragma unroll
    for (int ni = 0; ni < 8; ++ni)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int d = warp * (K / 4) + mi * 16 + gr + (e >= 2 ? 8 : 0), v = ni * 8 + t2 + (e & 1);
        S[mi][ni][e] = S0 != nullptr ? S0[(state_row * K + d) * V + v0 + v] : 0.f;
      }
  const float* z0 = static_cast<const float*>(p.initial_z);
  for (int d = tid; d < K; d += kTcThreads) z[d] = z0 != nullptr ? z0[state_row * K + d] : 0.f;

  // S^T split into bf16 hi + lo for the tensor-core product Q' S.
  auto publish_state = [&]() {
#pragma unroll
    for (int mi = 0; mi < KT; ++mi)
#pragma unroll
      for (int ni = 0; ni < 8; ++ni)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int d = warp * (K / 4) + mi * 16 + gr + (e >= 2 ? 8 : 0), v = ni * 8 + t2 + (e & 1);
          const __nv_bfloat16 hi = __float2bfloat16_rn(S[mi][ni][e]);
          Sh[v * QK + d] = hi;
          Sl[v * QK + d] = __float2bfloat16_rn(S[mi][ni][e] - __bfloat162float(hi));
        }
  };
  publish_state();

  for (int64_t c0 = 0; c0 < seq.len; c0 += C) {
    const int cl = static_cast<int>(seq.len - c0 < C ? seq.len - c0 : C);
    const int64_t t0 = seq.t0 + c0;
    __syncthreads();  // the previous chunk is done with Ks, Kt, Vt; Sh/Sl/z are published

    // Load: k' = phi(k) row-major and transposed, v tile transposed (8 elements per 16-byte load).
    for (int i = tid; i < C * (K / 8); i += kTcThreads) {
      const int t = i / (K / 8), d0 = (i % (K / 8)) * 8;
      alignas(16) __nv_bfloat16 x[8];
      if (t < cl) {
        *reinterpret_cast<uint4*>(x) = *reinterpret_cast<const uint4*>(row<__nv_bfloat16>(p.k, seq.b, t0 + t, g) + d0);
#pragma unroll
        for (int j = 0; j < 8; ++j) x[j] = __float2bfloat16_rn(phi(p.feature_map, __bfloat162float(x[j])));
      } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) x[j] = __float2bfloat16_rn(0.f);
      }
      *reinterpret_cast<uint4*>(Ks + t * QK + d0) = *reinterpret_cast<const uint4*>(x);
#pragma unroll
      for (int j = 0; j < 8; ++j) Kt[(d0 + j) * TR + t] = x[j];
    }
    for (int i = tid; i < C * (kTcBV / 8); i += kTcThreads) {
      const int t = i / (kTcBV / 8), e0 = (i % (kTcBV / 8)) * 8;
      alignas(16) __nv_bfloat16 x[8];
      if (t < cl) {
        *reinterpret_cast<uint4*>(x) =
            *reinterpret_cast<const uint4*>(row<__nv_bfloat16>(p.v, seq.b, t0 + t, g) + v0 + e0);
      } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) x[j] = __float2bfloat16_rn(0.f);
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) Vt[(e0 + j) * TR + t] = x[j];
    }

    for (int64_t h = g * G; h < (g + 1) * G; ++h) {
      __syncthreads();  // Ks/Kt/Vt loaded; the previous head is done with Qs and qz
      for (int i = tid; i < C * (K / 8); i += kTcThreads) {
        const int t = i / (K / 8), d0 = (i % (K / 8)) * 8;
        alignas(16) __nv_bfloat16 x[8];
        float dot = 0.f;
        if (t < cl) {
          *reinterpret_cast<uint4*>(x) =
              *reinterpret_cast<const uint4*>(row<__nv_bfloat16>(p.q, seq.b, t0 + t, h) + d0);
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            const float qv = scale * phi(p.feature_map, __bfloat162float(x[j]));
            x[j] = __float2bfloat16_rn(qv);
            dot += __bfloat162float(x[j]) * z[d0 + j];
          }
        } else {
#pragma unroll
          for (int j = 0; j < 8; ++j) x[j] = __float2bfloat16_rn(0.f);
        }
        *reinterpret_cast<uint4*>(Qs + t * QK + d0) = *reinterpret_cast<const uint4*>(x);
        // The K/8 threads of row t are consecutive and K/8 divides 32: reduce q'.z within them.
#pragma unroll
        for (int off = K / 16; off > 0; off /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, off);
        if (i % (K / 8) == 0) qz[t] = dot;
      }
      __syncthreads();

      // Intra-chunk scores of warp rows [16w, 16w+16): n-tiles past the diagonal are all masked.
      const int r0 = warp * 16;
      const int n_tiles = 2 * warp + 2;
      float P[8][4];
#pragma unroll
      for (int ni = 0; ni < 8; ++ni)
#pragma unroll
        for (int e = 0; e < 4; ++e) P[ni][e] = 0.f;
#pragma unroll
      for (int kk = 0; kk < K; kk += 16) {
        FragA a;
        a.load(Qs, QK, r0, kk, lane);
#pragma unroll
        for (int ni = 0; ni < 8; ++ni) {
          if (ni < n_tiles) {
            uint32_t b0, b1;
            load_b(Ks, QK, ni * 8, kk, lane, b0, b1);
            mma_bf16(P[ni], a.x[0], a.x[1], a.x[2], a.x[3], b0, b1);
          }
        }
      }
      float rowsum[2] = {0.f, 0.f};
#pragma unroll
      for (int ni = 0; ni < 8; ++ni)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int t = r0 + gr + (e >= 2 ? 8 : 0), s = ni * 8 + t2 + (e & 1);
          if (s > t) P[ni][e] = 0.f;
          rowsum[e >> 1] += P[ni][e];
        }

      // o = P V + Q' S_hi + Q' S_lo on 64 value columns.
      float O[8][4];
#pragma unroll
      for (int ni = 0; ni < 8; ++ni)
#pragma unroll
        for (int e = 0; e < 4; ++e) O[ni][e] = 0.f;
#pragma unroll
      for (int j = 0; j < 4; ++j) {  // P as A operand: tokens [16j, 16j + 16)
        if (j <= warp) {
          const uint32_t a0 = pack_bf16(P[2 * j][0], P[2 * j][1]), a1 = pack_bf16(P[2 * j][2], P[2 * j][3]);
          const uint32_t a2 = pack_bf16(P[2 * j + 1][0], P[2 * j + 1][1]),
                         a3 = pack_bf16(P[2 * j + 1][2], P[2 * j + 1][3]);
#pragma unroll
          for (int ni = 0; ni < 8; ++ni) {
            uint32_t b0, b1;
            load_b(Vt, TR, ni * 8, 16 * j, lane, b0, b1);
            mma_bf16(O[ni], a0, a1, a2, a3, b0, b1);
          }
        }
      }
#pragma unroll
      for (int kk = 0; kk < K; kk += 16) {
        FragA a;
        a.load(Qs, QK, r0, kk, lane);
#pragma unroll
        for (int ni = 0; ni < 8; ++ni) {
          uint32_t b0, b1;
          load_b(Sh, QK, ni * 8, kk, lane, b0, b1);
          mma_bf16(O[ni], a.x[0], a.x[1], a.x[2], a.x[3], b0, b1);
          load_b(Sl, QK, ni * 8, kk, lane, b0, b1);
          mma_bf16(O[ni], a.x[0], a.x[1], a.x[2], a.x[3], b0, b1);
        }
      }

      // Denominators of the lane's two rows (the 4 lanes of a row hold its partial sums).
      float inv[2] = {1.f, 1.f};
      if (p.normalize) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          float s = rowsum[r];
          s += __shfl_xor_sync(0xffffffffu, s, 1);
          s += __shfl_xor_sync(0xffffffffu, s, 2);
          inv[r] = 1.f / (qz[r0 + gr + 8 * r] + s + eps);
        }
      }
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int t = r0 + gr + 8 * r;
        if (t >= cl) continue;
        __nv_bfloat16* out = row<__nv_bfloat16>(p.o, seq.b, t0 + t, h) + v0;
#pragma unroll
        for (int ni = 0; ni < 8; ++ni)
          *reinterpret_cast<uint32_t*>(out + ni * 8 + t2) = pack_bf16(O[ni][2 * r] * inv[r], O[ni][2 * r + 1] * inv[r]);
      }
    }
    __syncthreads();  // every warp is done reading Sh/Sl and z of this chunk

    // State update S += K'^T V on this warp's rows; z += colsum(K').
#pragma unroll
    for (int mi = 0; mi < KT; ++mi) {
      const int d0 = warp * (K / 4) + mi * 16;
#pragma unroll
      for (int kk = 0; kk < C; kk += 16) {
        FragA a;
        a.load(Kt, TR, d0, kk, lane);
#pragma unroll
        for (int ni = 0; ni < 8; ++ni) {
          uint32_t b0, b1;
          load_b(Vt, TR, ni * 8, kk, lane, b0, b1);
          mma_bf16(S[mi][ni], a.x[0], a.x[1], a.x[2], a.x[3], b0, b1);
        }
      }
    }
    for (int d = tid; d < K; d += kTcThreads) {
      float acc = z[d];
      for (int t = 0; t < cl; ++t) acc += __bfloat162float(Kt[d * TR + t]);
      z[d] = acc;
    }
    publish_state();
  }

  if (p.final_S != nullptr) {
    float* out = static_cast<float*>(p.final_S);
#pragma unroll
    for (int mi = 0; mi < KT; ++mi)
#pragma unroll
      for (int ni = 0; ni < 8; ++ni)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int d = warp * (K / 4) + mi * 16 + gr + (e >= 2 ? 8 : 0), v = ni * 8 + t2 + (e & 1);
          out[(state_row * K + d) * V + v0 + v] = S[mi][ni][e];
        }
  }
  if (p.final_z != nullptr && blockIdx.y == 0) {
    __syncthreads();
    float* out = static_cast<float*>(p.final_z);
    for (int d = tid; d < K; d += kTcThreads) out[state_row * K + d] = z[d];
  }
}

}  // namespace attnrnn::cuda
