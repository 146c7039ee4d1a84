// Checks, on an sm_90a GPU, the normalizer's m64n8k16 products of the 128-token forward
// (wgmma_sums.cuh, chunk_wg_pair.cuh) against float64 sums on the host, through the helpers the kernel
// calls, for one warpgroup and one 64-token block:
//   Z  += K^T ones   A = K tile read M-major (the state update's operand), B = a tile of ones [8][64]
//                    (wg_add_key_sums, twice: the accumulator keeps summing)
//   QZ  = Q z_split  A = Q tile, K-major; B = z's split tile [8][64], hi parts in the even rows and lo
//                    parts in the odd ones (wg_publish_z from Z, then wg_dot_z_products)
// Z must hold the column sums of K (twice) in every column; QZ[2c] + QZ[2c + 1] must be q_r . z for
// every row r and c, to the ~16 bits of the hi/lo split.
//   nvcc -std=c++17 -gencode arch=compute_90a,code=sm_90a -O3 -I csrc -o /tmp/wgmma_n8_probe scripts/wgmma_n8_probe.cu && /tmp/wgmma_n8_probe
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

#include "../csrc/cuda/wgmma_sums.cuh"

using namespace attnrnn::cuda;

constexpr int kN = 64;  // tile rows and columns

// in: q, k as row-major 64 x 64 bf16; out: Z [64][8], QZ [64][8], as float.
__global__ void __launch_bounds__(128) probe_kernel(const __nv_bfloat16* in, float* out) {
  __shared__ __align__(1024) unsigned char tiles[2 * kWgTileBytes + 2 * 1024];  // Q, K, ones, z_split
  unsigned char *Q = tiles, *K = tiles + kWgTileBytes, *ones = tiles + 2 * kWgTileBytes, *zsplit = ones + 1024;
  const int t = threadIdx.x;
  for (int e = t; e < 2 * kN * kN; e += 128) {
    const int tile = e / (kN * kN), r = (e / kN) % kN, c = e % kN;
    *reinterpret_cast<__nv_bfloat16*>(tiles + tile * kWgTileBytes + wg_swizzled(r, c)) = in[e];
  }
  wg_fill_ones<__nv_bfloat16>(ones, t, 128);
  wg_fence_shared();
  __syncthreads();

  float Z[4] = {0.f, 0.f, 0.f, 0.f}, QZ[4] = {0.f, 0.f, 0.f, 0.f};
  for (int pass = 0; pass < 2; ++pass) {
    wg_fence();
    wg_add_key_sums<__nv_bfloat16, 1>(Z, K, 0, 0, ones);
    wg_commit();
    wg_wait_all();
    wg_hold(Z);
  }
  wg_publish_z<__nv_bfloat16>(Z, zsplit, nullptr, 0, t);
  wg_fence_shared();
  __syncthreads();
  wg_fence();
  wg_dot_z_products<__nv_bfloat16, 64>(QZ, Q, zsplit);
  wg_commit();
  wg_wait_all();
  wg_hold(QZ);
  for (int i = 0; i < 4; ++i) {
    out[wg_acc_row(t, i) * 8 + wg_acc_col(t, i)] = Z[i];
    out[kN * 8 + wg_acc_row(t, i) * 8 + wg_acc_col(t, i)] = QZ[i];
  }
}

int main() {
  std::mt19937 gen(0);
  std::normal_distribution<float> normal;
  std::vector<__nv_bfloat16> in(2 * kN * kN);
  std::vector<double> x(in.size());  // the bf16 values, exactly
  for (size_t e = 0; e < in.size(); ++e) {
    in[e] = __float2bfloat16(e < size_t(kN * kN) ? normal(gen) : std::fabs(normal(gen)) + 0.1f);  // k > 0: z grows
    x[e] = static_cast<double>(__bfloat162float(in[e]));
  }
  __nv_bfloat16* d_in = nullptr;
  float* d_out = nullptr;
  if (cudaMalloc(&d_in, in.size() * sizeof(in[0])) != cudaSuccess || cudaMalloc(&d_out, 2 * kN * 8 * sizeof(float)) != cudaSuccess) {
    std::printf("cudaMalloc failed\n");
    return 2;
  }
  cudaMemcpy(d_in, in.data(), in.size() * sizeof(in[0]), cudaMemcpyHostToDevice);
  cudaMemset(d_out, 0xff, 2 * kN * 8 * sizeof(float));  // NaN: an element never written fails
  probe_kernel<<<1, 128>>>(d_in, d_out);
  const cudaError_t err = cudaDeviceSynchronize();
  if (err != cudaSuccess) {
    std::printf("kernel failed: %s\n", cudaGetErrorString(err));
    return 2;
  }
  std::vector<float> out(2 * kN * 8);
  cudaMemcpy(out.data(), d_out, out.size() * sizeof(float), cudaMemcpyDeviceToHost);

  auto X = [&](int tile, int r, int c) { return x[tile * kN * kN + r * kN + c]; };
  std::vector<double> z(kN, 0.0);
  for (int d = 0; d < kN; ++d)
    for (int tok = 0; tok < kN; ++tok) z[d] += 2 * X(1, tok, d);
  double worst_z = 0, worst_qz = 0, scale_z = 0, scale_qz = 0;
  bool finite = true;
  for (int r = 0; r < kN; ++r) {
    for (int c = 0; c < 8; ++c) {
      const double got = out[r * 8 + c];
      finite = finite && std::isfinite(got);
      worst_z = std::fmax(worst_z, std::fabs(got - z[r]));
      scale_z = std::fmax(scale_z, std::fabs(z[r]));
    }
    double qz = 0;
    for (int d = 0; d < kN; ++d) qz += X(0, r, d) * z[d];
    for (int c = 0; c < 4; ++c) {
      const double got = double(out[kN * 8 + r * 8 + 2 * c]) + double(out[kN * 8 + r * 8 + 2 * c + 1]);
      finite = finite && std::isfinite(got);
      worst_qz = std::fmax(worst_qz, std::fabs(got - qz));
      scale_qz = std::fmax(scale_qz, std::fabs(qz));
    }
  }
  const bool z_ok = finite && worst_z <= 2e-5 * scale_z, qz_ok = finite && worst_qz <= 1e-4 * scale_qz;
  std::printf("Z  += K^T ones (M-major A, ones B)    max |error| %.3g (max |ref| %.3g)  %s\n", worst_z, scale_z,
              z_ok ? "ok" : "WRONG");
  std::printf("QZ  = Q z_split (K-major A, split B)  max |error| %.3g (max |ref| %.3g)  %s\n", worst_qz, scale_qz,
              qz_ok ? "ok" : "WRONG");
  return z_ok && qz_ok ? 0 : 1;
}
