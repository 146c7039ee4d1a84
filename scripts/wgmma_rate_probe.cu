// Measures, on an sm_90a GPU, what one SM's tensor cores give the chunk sweeps' product shapes
// (docs/design.md item 8: is a step bound by the products' rate or by the chain's latency?):
//   latency    one warpgroup: fence, G products m64n64k16 (A, B in shared memory), commit, wait;
//              cycles per group, for G = 1, 2, 4, 8, 16
//   rate       W warpgroups per block (one block per SM), each keeping two groups of 8 in flight:
//              cycles per product per SM and bf16 FLOP per cycle per SM, for
//              ss64  m64n64k16,  A and B from shared memory (every product of the sweeps but P Cv)
//              rs64  m64n64k16,  A from registers (P Cv)
//              ss128 m64n128k16, A and B from shared memory (two 64-column products in one)
// The operands are 64-row tiles of 128-byte rows with the 128-byte swizzle (wgmma.cuh); their
// values do not matter here, only that every descriptor points into the block's shared memory.
//   nvcc -std=c++17 -gencode arch=compute_90a,code=sm_90a -O3 -o /tmp/rate scripts/wgmma_rate_probe.cu && /tmp/rate
#include <cstdint>
#include <cstdio>

#include "../csrc/cuda/wgmma.cuh"

using namespace attnrnn::cuda;

constexpr int kTiles = 4;  // A, then B as two 64-row tiles (128 rows for ss128), one spare
constexpr int kIters = 512;
constexpr int kRateGroups = 1 + 2 * (kIters / 2);  // groups of 8 per warpgroup in rate_kernel

// d (+)= A B^T for a 128-row K-major B (two tiles stacked): 64 accumulators per thread.
__device__ __forceinline__ void mma_ss128(float (&d)[64], uint64_t a, uint64_t b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, "
      "%23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, "
      "%44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "%64, %65, p, 1, 1, 0, 0;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),
        "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),
        "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]),
        "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]),
        "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]),
        "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(a), "l"(b));
}

enum class Kind { kSs64, kRs64, kSs128 };

// Accumulator floats per thread of a kind's product.
template <Kind K>
constexpr int kAcc = K == Kind::kSs128 ? 64 : 32;

// Warpgroups per block measured: register-A products keep their operands live while in flight
// (ptxas serializes them within 170 registers, C7512), so those stop at 2.
template <Kind K>
constexpr int kMaxWarpgroups = K == Kind::kRs64 ? 2 : 3;

// One group of 8 products of the kind on the accumulators acc.
template <Kind K>
__device__ __forceinline__ void group_of_8(float (&acc)[kAcc<K>], const unsigned char* tiles, const uint32_t (&a)[4]) {
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const uint64_t da = wg_descriptor(tiles, 32 * (j % 4)), db = wg_descriptor(tiles + kWgTileBytes, 32 * (j % 4));
    if constexpr (K == Kind::kSs64) wg_mma_ss<__nv_bfloat16, 0, 0>(acc, da, db, 1);
    if constexpr (K == Kind::kRs64) wg_mma_rs<__nv_bfloat16, 1>(acc, a, wg_descriptor(tiles + kWgTileBytes, 2048 * (j % 4)), 1);
    if constexpr (K == Kind::kSs128) mma_ss128(acc, da, db);
  }
}

// The block's tiles filled with words alternating between even_word and odd_word, made visible to
// the tensor cores.
__device__ __forceinline__ void fill_tiles(unsigned char* tiles, uint32_t even_word, uint32_t odd_word) {
  for (int e = threadIdx.x; e < kTiles * kWgTileBytes / 4; e += blockDim.x)
    reinterpret_cast<uint32_t*>(tiles)[e] = (e & 1) ? odd_word : even_word;
  wg_fence_shared();
  __syncthreads();
}

// W warpgroups, each kRateGroups groups of 8 with two in flight; thread 0 of each warpgroup writes its cycles.
template <Kind K>
__global__ void __launch_bounds__(128 * kMaxWarpgroups<K>, 1) rate_kernel(long long* cycles, float* sink) {
  __shared__ __align__(1024) unsigned char tiles[kTiles * kWgTileBytes];
  fill_tiles(tiles, 0u, 0x3c003c00u);  // small bf16 values: no infinities
  constexpr int N = kAcc<K>;
  float acc0[N], acc1[N];  // the two groups in flight accumulate into different registers
#pragma unroll
  for (int i = 0; i < N; ++i) acc0[i] = acc1[i] = 0.f;
  uint32_t a[4] = {0x3c003c00u, 0u, 0x3c003c00u, 0u};
  wg_hold(acc0);
  wg_hold(acc1);
  asm volatile("" : "+r"(a[0]), "+r"(a[1]), "+r"(a[2]), "+r"(a[3])::"memory");
  const long long start = clock64();
  wg_fence();
  group_of_8<K>(acc0, tiles, a);
  wg_commit();
  for (int i = 1; i < kIters; i += 2) {
    wg_hold(acc1);
    wg_fence();
    group_of_8<K>(acc1, tiles, a);
    wg_commit();
    wg_wait<1>();
    wg_hold(acc0);
    wg_fence();
    group_of_8<K>(acc0, tiles, a);
    wg_commit();
    wg_wait<1>();
  }
  wg_wait_all();
  wg_hold(acc0);
  wg_hold(acc1);
  const long long stop = clock64();
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < N; ++i) s += acc0[i] + acc1[i];
  if (s == 12345.f) sink[threadIdx.x] = s;  // keeps the products
  if (threadIdx.x % 128 == 0) cycles[blockIdx.x * 4 + threadIdx.x / 128] = stop - start;
}

// One warpgroup: kIters times fence, G products ss64, commit, wait.
template <int G>
__global__ void latency_kernel(long long* cycles, float* sink) {
  __shared__ __align__(1024) unsigned char tiles[kTiles * kWgTileBytes];
  fill_tiles(tiles, 0u, 0u);
  float acc[32];
#pragma unroll
  for (int i = 0; i < 32; ++i) acc[i] = 0.f;
  wg_hold(acc);
  const long long start = clock64();
  for (int i = 0; i < kIters; ++i) {
    wg_fence();
#pragma unroll
    for (int j = 0; j < G; ++j)
      wg_mma_ss<__nv_bfloat16, 0, 0>(acc, wg_descriptor(tiles, 32 * (j % 4)), wg_descriptor(tiles + kWgTileBytes, 32 * (j % 4)), 1);
    wg_commit();
    wg_wait_all();
    wg_hold(acc);
  }
  const long long stop = clock64();
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 32; ++i) s += acc[i];
  if (s == 12345.f) sink[threadIdx.x] = s;
  if (threadIdx.x == 0) cycles[blockIdx.x] = stop - start;
}

template <Kind K>
static void rate(const char* name, int sms, long long* cycles, float* sink) {
  const int n_out = K == Kind::kSs128 ? 128 : 64;
  for (int w = 1; w <= kMaxWarpgroups<K>; ++w) {
    cudaMemset(cycles, 0, 4 * 256 * sizeof(long long));
    rate_kernel<K><<<sms, 128 * w>>>(cycles, sink);  // warm-up
    rate_kernel<K><<<sms, 128 * w>>>(cycles, sink);
    if (cudaDeviceSynchronize() != cudaSuccess) {
      std::printf("%s: launch failed: %s\n", name, cudaGetErrorString(cudaGetLastError()));
      return;
    }
    long long host[4 * 256];
    cudaMemcpy(host, cycles, sizeof(host), cudaMemcpyDeviceToHost);
    double sum = 0;
    for (int b = 0; b < sms; ++b)
      for (int g = 0; g < w; ++g) sum += double(host[b * 4 + g]);
    const double per_wg = sum / (sms * w);
    const double products = double(kRateGroups) * 8 * w;  // per SM, over the warpgroups' common span
    const double flop = products * 2.0 * 64 * n_out * 16;
    std::printf("rate  %-6s %d warpgroup(s)/SM: %7.1f cycles per product per SM, %6.0f bf16 FLOP/cycle/SM\n", name, w,
                per_wg / products, flop / per_wg);
  }
}

template <int G>
static void latency(long long* cycles, float* sink) {
  latency_kernel<G><<<1, 128>>>(cycles, sink);  // warm-up
  latency_kernel<G><<<1, 128>>>(cycles, sink);
  if (cudaDeviceSynchronize() != cudaSuccess) {
    std::printf("latency, group of %d: launch failed: %s\n", G, cudaGetErrorString(cudaGetLastError()));
    return;
  }
  long long span = 0;
  cudaMemcpy(&span, cycles, sizeof(span), cudaMemcpyDeviceToHost);
  const double per_group = double(span) / kIters;
  std::printf("latency ss64 group of %2d, one warpgroup alone: %7.1f cycles per group (%5.1f per product)\n", G,
              per_group, per_group / G);
}

int main() {
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, 0);
  std::printf("%s, %d SMs\n", prop.name, prop.multiProcessorCount);
  long long* cycles;
  float* sink;
  cudaMalloc(&cycles, 4 * 256 * sizeof(long long));
  cudaMalloc(&sink, 1024 * sizeof(float));
  latency<1>(cycles, sink);
  latency<2>(cycles, sink);
  latency<4>(cycles, sink);
  latency<8>(cycles, sink);
  latency<16>(cycles, sink);
  const int sms = prop.multiProcessorCount;
  rate<Kind::kSs64>("ss64", sms, cycles, sink);
  rate<Kind::kRs64>("rs64", sms, cycles, sink);
  rate<Kind::kSs128>("ss128", sms, cycles, sink);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) std::printf("CUDA error: %s\n", cudaGetErrorString(err));
  return err == cudaSuccess ? 0 : 1;
}
