// Checks, on an sm_90a GPU, the four warpgroup products the planned wgmma chunk scan needs
// (docs/design.md, "Plan for the wgmma scan"), each against a float64 product on the host:
//   P  = Q K^T   A = Q tile, K-major           B = K tile, K-major            (shared memory)
//   O  = P V     A = P in registers (bf16)     B = V tile, N-major (transposed)
//   O2 = Q S     A = Q tile, K-major           B = S tile [dims][cols], N-major
//   S2 = K^T V   A = K tile read M-major       B = V tile, N-major
// Every tile is 64 rows of 64 bf16 (128 bytes) with the 128-byte swizzle on a 1024-byte boundary,
// so one descriptor form serves all four; only the transpose flags and the step per k16 slice differ.
//   nvcc -std=c++17 -gencode arch=compute_90a,code=sm_90a -O3 -o /tmp/wgmma_probe scripts/wgmma_probe.cu && /tmp/wgmma_probe
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

#include "../csrc/cuda/wgmma.cuh"

using namespace attnrnn::cuda;

__device__ inline uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

constexpr int kN = 64;                // tile rows and columns
constexpr int kTileBytes = kN * 128;  // 8 KiB

// in: q, k, v, s as row-major 64 x 64 bf16; out: p, o, o2, s2 as row-major 64 x 64 float.
__global__ void __launch_bounds__(128) probe_kernel(const __nv_bfloat16* in, float* out) {
  __shared__ __align__(1024) unsigned char tiles[4 * kTileBytes];  // Q, K, V, S
  const int t = threadIdx.x;
  for (int e = t; e < 4 * kN * kN; e += 128) {
    const int tile = e / (kN * kN), r = (e / kN) % kN, c = e % kN;
    *reinterpret_cast<__nv_bfloat16*>(tiles + tile * kTileBytes + wg_swizzled(r, c)) = in[e];
  }
  wg_fence_shared();  // generic-proxy stores, then async-proxy (wgmma) reads
  __syncthreads();
  const unsigned char *Q = tiles, *K = tiles + kTileBytes, *V = tiles + 2 * kTileBytes, *S = tiles + 3 * kTileBytes;

  float p[32], o[32], o2[32], s2[32];
  for (int i = 0; i < 32; ++i) p[i] = o[i] = o2[i] = s2[i] = 0.f;
  wg_fence();
  for (int j = 0; j < 4; ++j)  // P = Q K^T: inner dim = head dims, contiguous in both tiles
    wg_mma_ss<__nv_bfloat16, 0, 0>(p, wg_descriptor(Q, 32 * j), wg_descriptor(K, 32 * j), j > 0);
  for (int j = 0; j < 4; ++j)  // O2 = Q S: S rows are the inner dim
    wg_mma_ss<__nv_bfloat16, 0, 1>(o2, wg_descriptor(Q, 32 * j), wg_descriptor(S, 2048 * j), j > 0);
  for (int j = 0; j < 4; ++j)  // S2 = K^T V: the inner dim is tokens, the rows of both tiles
    wg_mma_ss<__nv_bfloat16, 1, 1>(s2, wg_descriptor(K, 2048 * j), wg_descriptor(V, 2048 * j), j > 0);
  wg_commit();
  wg_wait_all();

  // O = P V with P rounded to bf16 in registers: slice j is accumulator registers 8j .. 8j + 7.
  uint32_t a[4][4];
  for (int j = 0; j < 4; ++j)
    for (int q = 0; q < 4; ++q) a[j][q] = pack_bf16(p[8 * j + 2 * q], p[8 * j + 2 * q + 1]);
  wg_fence();
  for (int j = 0; j < 4; ++j) wg_mma_rs<__nv_bfloat16, 1>(o, a[j], wg_descriptor(V, 2048 * j), j > 0);
  wg_commit();
  wg_wait_all();

  float* results[4] = {p, o, o2, s2};
  for (int m = 0; m < 4; ++m)
    for (int i = 0; i < 32; ++i) out[m * kN * kN + wg_acc_row(t, i) * kN + wg_acc_col(t, i)] = results[m][i];
}

int main() {
  std::mt19937 gen(0);
  std::normal_distribution<float> normal;
  std::vector<__nv_bfloat16> in(4 * kN * kN);
  std::vector<double> x(4 * kN * kN);  // the bf16 values, exactly
  for (size_t e = 0; e < in.size(); ++e) {
    in[e] = __float2bfloat16(normal(gen));
    x[e] = static_cast<double>(__bfloat162float(in[e]));
  }
  __nv_bfloat16* d_in = nullptr;
  float* d_out = nullptr;
  if (cudaMalloc(&d_in, in.size() * sizeof(in[0])) != cudaSuccess ||
      cudaMalloc(&d_out, 4 * kN * kN * sizeof(float)) != cudaSuccess) {
    std::printf("cudaMalloc failed\n");
    return 2;
  }
  cudaMemcpy(d_in, in.data(), in.size() * sizeof(in[0]), cudaMemcpyHostToDevice);
  cudaMemset(d_out, 0xff, 4 * kN * kN * sizeof(float));  // NaN: an element never written fails
  probe_kernel<<<1, 128>>>(d_in, d_out);
  const cudaError_t err = cudaDeviceSynchronize();
  if (err != cudaSuccess) {
    std::printf("kernel failed: %s\n", cudaGetErrorString(err));
    return 2;
  }
  std::vector<float> out(4 * kN * kN);
  cudaMemcpy(out.data(), d_out, out.size() * sizeof(float), cudaMemcpyDeviceToHost);

  auto X = [&](int tile, int r, int c) { return x[tile * kN * kN + r * kN + c]; };
  auto bf16 = [](double v) { return static_cast<double>(__bfloat162float(__float2bfloat16(static_cast<float>(v)))); };
  const char* names[4] = {"P  = Q K^T (K-major A, K-major B)", "O  = P V   (register A, N-major B)",
                          "O2 = Q S   (K-major A, N-major B)", "S2 = K^T V (M-major A, N-major B)"};
  int failures = 0;
  for (int m = 0; m < 4; ++m) {
    double worst = 0, scale = 0;
    bool finite = true;
    for (int r = 0; r < kN; ++r)
      for (int c = 0; c < kN; ++c) {
        double ref = 0;
        for (int k = 0; k < kN; ++k) {
          if (m == 0) ref += X(0, r, k) * X(1, c, k);
          if (m == 1) ref += bf16(out[r * kN + k]) * X(2, k, c);  // the device's P, rounded as in registers
          if (m == 2) ref += X(0, r, k) * X(3, k, c);
          if (m == 3) ref += X(1, k, r) * X(2, k, c);
        }
        const double got = out[m * kN * kN + r * kN + c];
        finite = finite && std::isfinite(got);
        worst = std::fmax(worst, std::fabs(got - ref));
        scale = std::fmax(scale, std::fabs(ref));
      }
    const bool ok = finite && worst <= 1e-5 * scale;
    failures += !ok;
    std::printf("%-38s max |error| %.3g (max |ref| %.3g)  %s\n", names[m], worst, scale, ok ? "ok" : "WRONG");
  }
  return failures == 0 ? 0 : 1;
}
