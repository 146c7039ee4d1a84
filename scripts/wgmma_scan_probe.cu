// Prototype of the wgmma chunk scan (docs/design.md, "Plan for the wgmma scan"): the causal linear
// attention forward o_t = scale * q_t S_t with S_t = sum_{s <= t} k_s^T v_s, bf16 [B, T, H, 64] inputs,
// identity feature map, no normalization, T % 64 == 0. One warpgroup (128 threads) per (batch, head)
// walks the chunks of 64 tokens:
//   P = mask(Q K^T)            wgmma, Q and K tiles from shared memory
//   O = Q S_hi + Q S_lo + P V  S as two bf16 tiles written by the block, P from registers
//   S += K^T V                 fp32 accumulators in registers
// q/k/v tiles arrive with cp.async (NS stages: NS - 1 chunks in flight) in the 128-byte-swizzled
// layout the descriptors expect. It checks the output against a float64 recurrence on the host and times the kernel.
//   nvcc -std=c++17 -gencode arch=compute_90a,code=sm_90a -O3 -o /tmp/scan scripts/wgmma_scan_probe.cu
//   /tmp/scan B T H NS     (default 8 2048 16 2; NS in 2..4)
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "../csrc/cuda/wgmma.cuh"
#include "probe_timing.cuh"

using namespace attnrnn::cuda;

__device__ inline uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

constexpr int kC = 64, kD = 64;
constexpr int kTile = kC * 128;  // bytes of one 64 x 64 bf16 tile

struct ScanArgs {
  const __nv_bfloat16 *q, *k, *v;
  __nv_bfloat16* o;
  int T, H;
  float scale;
};

__device__ inline void cp_async16(void* smem, const void* gmem) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}

template <int NS>
__global__ void __launch_bounds__(128) scan_kernel(const ScanArgs a) {
  // stage s: Q, K, V tiles at s * 3 * kTile; then S_hi, S_lo   (NS * 3 + 2) * 8 KiB
  extern __shared__ __align__(1024) unsigned char smem[];
  unsigned char* Sh = smem + NS * 3 * kTile;
  unsigned char* Sl = Sh + kTile;
  const int t = threadIdx.x, b = blockIdx.x / a.H, h = blockIdx.x % a.H;
  const int64_t row_stride = int64_t(a.H) * kD;  // elements between consecutive tokens
  const int64_t base = (int64_t(b) * a.T * a.H + h) * kD;

  auto issue = [&](int chunk) {
    unsigned char* st = smem + (chunk % NS) * 3 * kTile;
    const __nv_bfloat16* src[3] = {a.q, a.k, a.v};
    for (int e = t; e < 3 * kC * 8; e += 128) {  // 16-byte pieces: tile, row, piece
      const int tile = e / (kC * 8), r = (e / 8) % kC, piece = e % 8;
      const __nv_bfloat16* g = src[tile] + base + (int64_t(chunk) * kC + r) * row_stride + piece * 8;
      cp_async16(st + tile * kTile + wg_swizzled(r, piece * 8), g);
    }
  };

  float S[32], O[32], P[32];
  for (int i = 0; i < 32; ++i) S[i] = 0.f;
  auto publish_state = [&]() {  // S as bf16 hi + lo tiles [dims][cols]
    for (int i = 0; i < 32; i += 2) {
      const int r = wg_acc_row(t, i), c = wg_acc_col(t, i);
      const __nv_bfloat162 hi = __floats2bfloat162_rn(S[i], S[i + 1]);
      const float2 back = __bfloat1622float2(hi);
      const __nv_bfloat162 lo = __floats2bfloat162_rn(S[i] - back.x, S[i + 1] - back.y);
      *reinterpret_cast<__nv_bfloat162*>(Sh + wg_swizzled(r, c)) = hi;
      *reinterpret_cast<__nv_bfloat162*>(Sl + wg_swizzled(r, c)) = lo;
    }
  };
  publish_state();

  const int chunks = a.T / kC;
  for (int c = 0; c < NS - 1; ++c) {
    if (c < chunks) issue(c);
    asm volatile("cp.async.commit_group;\n" ::: "memory");
  }
  for (int c = 0; c < chunks; ++c) {
    if (c + NS - 1 < chunks) issue(c + NS - 1);
    asm volatile("cp.async.commit_group;\n" ::: "memory");
    asm volatile("cp.async.wait_group %0;\n" ::"n"(NS - 1) : "memory");
    wg_fence_shared();  // cp.async and st.shared writes, then wgmma reads
    __syncthreads();
    const unsigned char* Q = smem + (c % NS) * 3 * kTile;
    const unsigned char* K = Q + kTile;
    const unsigned char* V = K + kTile;

    // ---- P = Q K^T and O = Q S_hi + Q S_lo ----
    wg_fence();
    for (int j = 0; j < 4; ++j) wg_mma_ss<__nv_bfloat16, 0, 0>(P, wg_descriptor(Q, 32 * j), wg_descriptor(K, 32 * j), j > 0);
    for (int j = 0; j < 4; ++j) wg_mma_ss<__nv_bfloat16, 0, 1>(O, wg_descriptor(Q, 32 * j), wg_descriptor(Sh, 2048 * j), j > 0);
    for (int j = 0; j < 4; ++j) wg_mma_ss<__nv_bfloat16, 0, 1>(O, wg_descriptor(Q, 32 * j), wg_descriptor(Sl, 2048 * j), 1);
    wg_commit();
    wg_wait_all();

    // ---- mask P (key s <= query t), to bf16 A fragments; O += P V; S += K^T V ----
    uint32_t pa[4][4];
    for (int j = 0; j < 4; ++j)
      for (int q = 0; q < 4; ++q) {
        const int i = 8 * j + 2 * q, r = wg_acc_row(t, i), col = wg_acc_col(t, i);
        pa[j][q] = pack_bf16(col <= r ? P[i] : 0.f, col + 1 <= r ? P[i + 1] : 0.f);
      }
    wg_fence();
    for (int j = 0; j < 4; ++j) wg_mma_rs<__nv_bfloat16, 1>(O, pa[j], wg_descriptor(V, 2048 * j), 1);
    for (int j = 0; j < 4; ++j) wg_mma_ss<__nv_bfloat16, 1, 1>(S, wg_descriptor(K, 2048 * j), wg_descriptor(V, 2048 * j), 1);
    wg_commit();
    wg_wait_all();

    // ---- o of this chunk; the state for the next one ----
    for (int i = 0; i < 32; i += 2) {
      const int r = wg_acc_row(t, i), col = wg_acc_col(t, i);
      *reinterpret_cast<__nv_bfloat162*>(a.o + base + (int64_t(c) * kC + r) * row_stride + col) =
          __floats2bfloat162_rn(a.scale * O[i], a.scale * O[i + 1]);
    }
    __syncthreads();  // every warp's products of this chunk are done with S_hi, S_lo and the stage
    publish_state();
  }
}

int main(int argc, char** argv) {
  const int B = argc > 1 ? std::atoi(argv[1]) : 8, T = argc > 2 ? std::atoi(argv[2]) : 2048,
            H = argc > 3 ? std::atoi(argv[3]) : 16, NS = argc > 4 ? std::atoi(argv[4]) : 2;
  if (T % kC != 0) {
    std::printf("T must be a multiple of %d\n", kC);
    return 2;
  }
  const size_t n = size_t(B) * T * H * kD;
  std::mt19937 gen(0);
  std::uniform_real_distribution<float> uni(0.f, 1.f);
  std::normal_distribution<float> normal;
  std::vector<__nv_bfloat16> hq(n), hk(n), hv(n), ho(n);
  for (size_t e = 0; e < n; ++e) {  // sigmoid-like positive q, k as in the benchmarks
    hq[e] = __float2bfloat16(uni(gen));
    hk[e] = __float2bfloat16(uni(gen));
    hv[e] = __float2bfloat16(0.5f * normal(gen));
  }
  __nv_bfloat16 *q, *k, *v, *o;
  cudaMalloc(&q, n * 2), cudaMalloc(&k, n * 2), cudaMalloc(&v, n * 2), cudaMalloc(&o, n * 2);
  cudaMemcpy(q, hq.data(), n * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(k, hk.data(), n * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(v, hv.data(), n * 2, cudaMemcpyHostToDevice);
  cudaMemset(o, 0xff, n * 2);
  const ScanArgs args{q, k, v, o, T, H, 0.125f};
  const int smem = (NS * 3 + 2) * kTile;
  auto launch = [&] {
    if (NS == 3) return scan_kernel<3><<<B * H, 128, smem>>>(args);
    if (NS == 4) return scan_kernel<4><<<B * H, 128, smem>>>(args);
    scan_kernel<2><<<B * H, 128, smem>>>(args);
  };
  cudaFuncSetAttribute(scan_kernel<2>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  cudaFuncSetAttribute(scan_kernel<3>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  cudaFuncSetAttribute(scan_kernel<4>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  launch();
  cudaError_t err = cudaDeviceSynchronize();
  if (err != cudaSuccess) {
    std::printf("kernel failed: %s\n", cudaGetErrorString(err));
    return 2;
  }
  cudaMemcpy(ho.data(), o, n * 2, cudaMemcpyDeviceToHost);

  // float64 recurrence on a few (batch, head) pairs: relative RMS error of o
  double err2 = 0, ref2 = 0;
  const int checks[3][2] = {{0, 0}, {B - 1, H - 1}, {B / 2, H / 2}};
  for (const auto& bh : checks) {
    std::vector<double> St(kD * kD, 0.0);
    for (int tt = 0; tt < T; ++tt) {
      const size_t row = ((size_t(bh[0]) * T + tt) * H + bh[1]) * kD;
      for (int d = 0; d < kD; ++d)
        for (int c = 0; c < kD; ++c)
          St[d * kD + c] += double(__bfloat162float(hk[row + d])) * double(__bfloat162float(hv[row + c]));
      for (int c = 0; c < kD; ++c) {
        double ref = 0;
        for (int d = 0; d < kD; ++d) ref += double(__bfloat162float(hq[row + d])) * St[d * kD + c];
        ref *= 0.125;
        const double got = double(__bfloat162float(ho[row + c]));
        err2 += (got - ref) * (got - ref);
        ref2 += ref * ref;
      }
    }
  }
  const double rel_rms = std::sqrt(err2 / ref2);

  const double us = median_launch_us(launch);
  std::printf("B%d-T%d-H%d-D64 bf16, %d stages: relative RMS error of o vs float64 %.2e (%s), kernel %.1f us (median of 21)\n",
              B, T, H, NS, rel_rms, rel_rms < 8e-3 ? "ok" : "WRONG", us);
  return rel_rms < 8e-3 ? 0 : 1;
}
