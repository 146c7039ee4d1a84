// Does a fourth warpgroup per SM raise the chunk sweep's rate? (docs/design.md item 8: the tensor
// cores run at their peak from one warpgroup and are busy ~37% of a step; a third 64-token block per
// SM at DI = 128 gained ~1.3x over its own cost, but lost more to spills and a single stage.)
// This probe times the causal linear attention forward o_t = scale q_t S_t, S_t = sum_{s <= t} k_s^T
// v_s, bf16 [B, T, H, 128] inputs, identity map, no normalizer, T % 64 == 0, with a block per
// (batch, head, 64 or 128 value columns) walking its chunks of 64 tokens. The block's warpgroups
// share its stages (Q and K loaded once per block) and own NCOL columns each; every warpgroup
// computes P = Q K^T. Layouts wgW-nN (W warpgroups of N columns):
//   wg1-n64  S [128][64] fp32 is 64 registers per thread; two blocks of 64 columns per SM
//            (112 KiB of shared memory each): the library's 64-token sweep
//   wg2-n32  32 columns each on m64n32k16 products (A S, P V, the update): S is 32 registers per
//            thread, so two blocks of 64 columns per SM make four warpgroups within 128 registers
//   wg2-n64  one block of 128 columns per SM (160 KiB): two warpgroups, Q and K loaded once per head
//   wg4-n32  one block of 128 columns per SM: four warpgroups, Q and K loaded once per head
// A step per warpgroup (P [64 x 64], its O [64 x NCOL]):
//   P = mask(Q K^T)               8 x m64n64k16
//   O = Q S_hi + Q S_lo + P V     16 + 4 products of n = NCOL (S as 16-bit hi + lo tiles in shared memory)
//   S += K^T V                    8 products of n = NCOL, after the output's products
// The NCOL = 32 operands start 64 bytes into a swizzled tile's 128-byte rows (column 32): the
// swizzle is a function of the address, as for the K-major 32-byte steps along a row.
// Checks o against a float64 recurrence on a few (batch, head) pairs and times each layout. The
// check sees wrong tiles, columns or masks (errors of 1e-2 and up); o's bf16 rounding (~2e-3) hides
// what S_lo adds, which the library's tests cover.
// "lib" runs the library's own 64-token forward (chunk_wg_kernel) on the same inputs, for comparison.
//   nvcc -std=c++17 -gencode arch=compute_90a,code=sm_90a -O3 --expt-relaxed-constexpr -DATTNRNN_WITH_CUDA -DATTNRNN_WGMMA \
//     -I include -I csrc -I csrc/core -o /tmp/cols scripts/wgmma_columns_probe.cu
//   /tmp/cols [B T H [LAYOUT]]      (default: B4-T8192-H16 and B8-T8192-H16, every layout and lib)
// B8-T8192-H16 fills every SM in each layout (256 blocks of 64 columns, 128 of 128); at B4-T8192-H16
// the 64-column layouts run one block per SM and the 128-column ones leave half the SMs idle.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "../csrc/cuda/chunk_wg.cuh"  // the library's sweep, timed beside the layouts as "lib"
#include "../csrc/cuda/wgmma.cuh"
#include "probe_timing.cuh"

using namespace attnrnn;
using namespace attnrnn::cuda;

constexpr int kC = 64, kDI = 128, kStages = 2;  // chunk, inner dim (= V), stages

// A block of WGS warpgroups owning NCOL value columns each: VT tiles of 64 columns.
template <int WGS, int NCOL>
struct Layout {
  static constexpr int cols = WGS * NCOL, VT = cols / 64, blocks_per_head = kDI / cols;
  static constexpr int stage = (4 + VT) * kWgTileBytes;  // Q [2 dim tiles], K [2], V [VT]: 40 / 48 KiB
  // kStages stages, then S_hi and S_lo [2 dim tiles][VT column tiles] each: 112 / 160 KiB
  static constexpr int smem = kStages * stage + 4 * VT * kWgTileBytes;
  static constexpr int min_blocks = VT == 1 ? 2 : 1;
  static_assert(cols == 64 || cols == 128, "a block owns 64 or 128 value columns");
};

struct Args {
  const __nv_bfloat16 *q, *k, *v;
  __nv_bfloat16* o;
  int T, H;
  float scale;
  int group;  // variant kBranchUpdate: S moves after steps c with c % group == group - 1 (1: every step)
};

#define PROBE_ACC16(d)                                                                                  \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),      \
      "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
#define PROBE_D16 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"

// d (+)= A B on m64n32k16, bf16, both operands in shared memory.
template <int TransA, int TransB>
__device__ __forceinline__ void mma_n32_ss(float (&d)[16], uint64_t a, uint64_t b, int accumulate) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 " PROBE_D16 ", %16, %17, p, 1, 1, %19, %20;\n}\n"
               : PROBE_ACC16(d)
               : "l"(a), "l"(b), "r"(accumulate), "n"(TransA), "n"(TransB));
}
// d += A B on m64n32k16, bf16, A from registers.
template <int TransB>
__device__ __forceinline__ void mma_n32_rs(float (&d)[16], const uint32_t (&a)[4], uint64_t b) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 " PROBE_D16
               ", {%16, %17, %18, %19}, %20, p, 1, 1, %21;\n}\n"
               : PROBE_ACC16(d)
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(TransB));
}
// The same products at n = 64 (wgmma.cuh) and n = 32 behind one name.
template <int N, int TransA, int TransB>
__device__ __forceinline__ void mma_ss(float (&d)[N / 2], uint64_t a, uint64_t b, int accumulate) {
  if constexpr (N == 64) wg_mma_ss<__nv_bfloat16, TransA, TransB>(d, a, b, accumulate);
  else mma_n32_ss<TransA, TransB>(d, a, b, accumulate);
}
template <int N, int TransB>
__device__ __forceinline__ void mma_rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t b) {
  if constexpr (N == 64) wg_mma_rs<__nv_bfloat16, TransB>(d, a, b, 1);
  else mma_n32_rs<TransB>(d, a, b);
}

// Variants of wg1-n64 toward the library's kernel (chunk_wg.cuh), bits of VAR, to find what costs it
// ~20% against this probe on the same layout (docs/design.md item 8):
//   kSerial       the library's order of a step's product groups: P waited for before A S is issued,
//                 P V waited for before the update (otherwise each pair is in flight together)
//   kLibPublish   S_hi / S_lo published by the library's wg_publish_state (stmatrix)
//   kBranchUpdate the update and the epilogue under a runtime flag (the library's GQA: S moves after a
//                 chunk's last head), the epilogue in both branches; with kSerial's order
//   kLibWriter    o written by the library's wg_write_rows (row bounds, strides, feature-map switch)
constexpr int kSerial = 1, kLibPublish = 2, kBranchUpdate = 4, kLibWriter = 8;
template <int WGS, int NCOL, int VAR = 0>
__global__ void __launch_bounds__(128 * WGS, Layout<WGS, NCOL>::min_blocks) forward_kernel(const Args a) {
  using L = Layout<WGS, NCOL>;
  constexpr int NACC = NCOL / 2, VT = L::VT;
  extern __shared__ __align__(1024) unsigned char smem[];
  unsigned char* Sh = smem + kStages * L::stage;  // [dim tile d][column tile] at (d VT + column tile) tiles
  unsigned char* Sl = Sh + 2 * VT * kWgTileBytes;
  const int tid = threadIdx.x, t = tid % 128, col0 = (tid / 128) * NCOL;  // this warpgroup's columns
  const int blk = blockIdx.x, c0 = (blk % L::blocks_per_head) * L::cols;
  const int h = (blk / L::blocks_per_head) % a.H, b = blk / L::blocks_per_head / a.H;
  const int64_t row_stride = int64_t(a.H) * kDI;
  const int64_t base = (int64_t(b) * a.T * a.H + h) * kDI;

  // Each thread's 16-byte piece of a row, hoisted as in the library's loader (chunk_wg_tiles.cuh):
  // 8 threads to a row's 64 columns, rows tid / 8 + 16 WGS j, one cp.async per 64-column tile.
  constexpr int rows_per_pass = 16 * WGS;
  const int piece = tid % 8;
  const __nv_bfloat16* q0 = a.q + base + (tid / 8) * row_stride + piece * 8;
  const __nv_bfloat16* k0 = a.k + base + (tid / 8) * row_stride + piece * 8;
  const __nv_bfloat16* v0 = a.v + base + (tid / 8) * row_stride + c0 + piece * 8;
  auto issue = [&](int chunk) {
    unsigned char* st = smem + (chunk % kStages) * L::stage;
    const int64_t at = int64_t(chunk) * kC * row_stride;
#pragma unroll
    for (int j = 0; j < kC / rows_per_pass; ++j) {
      const int r = tid / 8 + rows_per_pass * j;
      const int64_t off = at + int64_t(rows_per_pass * j) * row_stride;
      const int in_tile = wg_at(r, piece * 8);
#pragma unroll
      for (int d = 0; d < 2; ++d) cp_async16(st + d * kWgTileBytes + in_tile, q0 + off + 64 * d, true);
#pragma unroll
      for (int d = 0; d < 2; ++d) cp_async16(st + (2 + d) * kWgTileBytes + in_tile, k0 + off + 64 * d, true);
#pragma unroll
      for (int d = 0; d < VT; ++d) cp_async16(st + (4 + d) * kWgTileBytes + in_tile, v0 + off + 64 * d, true);
    }
  };

  float S[2][NACC], O[NACC], P[32];
  for (int d = 0; d < 2; ++d)
    for (int i = 0; i < NACC; ++i) S[d][i] = 0.f;
  auto publish_state = [&]() {  // this warpgroup's columns of S_hi, S_lo [dims][cols]
    if constexpr ((VAR & kLibPublish) != 0) {
      static_assert(WGS == 1 && NCOL == 64, "the library's publish is for one warpgroup of 64 columns");
      wg_publish_state<__nv_bfloat16, 2>(S, Sh, Sl, t);
    } else {
#pragma unroll
      for (int d = 0; d < 2; ++d)
#pragma unroll
        for (int i = 0; i < NACC; i += 2) {
          const int off = d * VT * kWgTileBytes + wg_at(wg_acc_row(t, i), col0 + wg_acc_col(t, i));
          const __nv_bfloat162 hi = __floats2bfloat162_rn(S[d][i], S[d][i + 1]);
          const float2 back = __bfloat1622float2(hi);
          *reinterpret_cast<__nv_bfloat162*>(Sh + off) = hi;
          *reinterpret_cast<__nv_bfloat162*>(Sl + off) = __floats2bfloat162_rn(S[d][i] - back.x, S[d][i + 1] - back.y);
        }
    }
  };
  publish_state();

  auto along = [](int j) { return (j / 4) * kWgTileBytes + 32 * (j % 4); };  // k16 slice j of Q's or K's dims
  auto down = [](int j) { return (j / 4) * VT * kWgTileBytes + 2048 * (j % 4); };  // of S's dims
  // this warpgroup's columns in a row of 64-column tiles: its tile, then 0 or 64 bytes into the rows
  const int chunks = a.T / kC, col_bytes = (col0 / 64) * kWgTileBytes + 2 * (col0 % 64);
  issue(0);
  cp_async_commit();
  for (int c = 0; c < chunks; ++c) {
    cp_async_wait<0>();
    wg_fence_shared();  // cp.async and st.shared writes, then wgmma reads
    __syncthreads();    // the stage and the state tiles are complete; the other stage is free
    if (c + 1 < chunks) issue(c + 1);
    cp_async_commit();
    const unsigned char* Q = smem + (c % kStages) * L::stage;
    const unsigned char* K = Q + 2 * kWgTileBytes;
    const unsigned char* V = K + 2 * kWgTileBytes;

    // ---- P = Q K^T, then O = Q S_hi + Q S_lo while P is masked ----
    wg_hold(S[0]);
    wg_hold(S[1]);
    wg_fence();
#pragma unroll
    for (int j = 0; j < kDI / 16; ++j) wg_mma_ss<__nv_bfloat16, 0, 0>(P, wg_descriptor(Q, along(j)), wg_descriptor(K, along(j)), j > 0);
    wg_commit();
    if constexpr ((VAR & (kSerial | kBranchUpdate)) != 0) {
      wg_wait_all();
      wg_hold(P);
      wg_fence();
    }
#pragma unroll
    for (int j = 0; j < kDI / 16; ++j) mma_ss<NCOL, 0, 1>(O, wg_descriptor(Q, along(j)), wg_descriptor(Sh, down(j) + col_bytes), j > 0);
#pragma unroll
    for (int j = 0; j < kDI / 16; ++j) mma_ss<NCOL, 0, 1>(O, wg_descriptor(Q, along(j)), wg_descriptor(Sl, down(j) + col_bytes), 1);
    wg_commit();
    wg_wait<1>();
    wg_hold(P);
    uint32_t pa[4][4];
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int i = 8 * j + 2 * q, r = wg_acc_row(t, i), col = wg_acc_col(t, i);
        pa[j][q] = pack2<__nv_bfloat16>(col <= r ? P[i] : 0.f, col + 1 <= r ? P[i + 1] : 0.f);
      }
    wg_wait_all();
    wg_hold(O);
    wg_hold(pa);

    // ---- O += P V; S += K^T V ----
    wg_fence();
#pragma unroll
    for (int j = 0; j < 4; ++j) mma_rs<NCOL, 1>(O, pa[j], wg_descriptor(V, 2048 * j + col_bytes));
    wg_commit();
    if constexpr ((VAR & (kSerial | kBranchUpdate)) != 0) {
      wg_wait_all();
      wg_hold(O);
      wg_fence();
    }
    auto update_state = [&]() {
#pragma unroll
      for (int d = 0; d < 2; ++d)
#pragma unroll
        for (int j = 0; j < 4; ++j)
          mma_ss<NCOL, 1, 1>(S[d], wg_descriptor(K, d * kWgTileBytes + 2048 * j), wg_descriptor(V, 2048 * j + col_bytes), 1);
    };
    // ---- o of this chunk, written while the update runs ----
    auto epilogue = [&]() {
      if constexpr ((VAR & kLibWriter) != 0) {
        const float inv[2] = {a.scale, a.scale};
        const MutView out{a.o, int64_t(a.T) * row_stride, row_stride, kDI};
        wg_write_rows<__nv_bfloat16>(out, O, inv, FeatureMap::kIdentity, false, ConstView{}, b, int64_t(c) * kC, kC, h,
                                     c0 + col0, t);
      } else {
#pragma unroll
        for (int i = 0; i < NACC; i += 2) {
          const int r = wg_acc_row(t, i), col = col0 + wg_acc_col(t, i);
          *reinterpret_cast<__nv_bfloat162*>(a.o + base + (int64_t(c) * kC + r) * row_stride + c0 + col) =
              __floats2bfloat162_rn(a.scale * O[i], a.scale * O[i + 1]);
        }
      }
    };
    if constexpr ((VAR & kBranchUpdate) != 0) {
      if (c % a.group == a.group - 1) {
        wg_hold(S[0]);
        wg_hold(S[1]);
        wg_fence();
        update_state();
        wg_commit();
        epilogue();
        wg_wait_all();
        wg_hold(S[0]);
        wg_hold(S[1]);
      } else {
        epilogue();
      }
    } else {
      update_state();
      wg_commit();
      wg_wait<1>();
      wg_hold(O);
      epilogue();
      wg_wait_all();
      wg_hold(S[0]);
      wg_hold(S[1]);
    }
    __syncthreads();  // every warpgroup's products are done with S_hi, S_lo and the stage
    publish_state();
  }
}

// Relative RMS error of o against a float64 recurrence on three (batch, head) pairs.
double check(const std::vector<__nv_bfloat16>& q, const std::vector<__nv_bfloat16>& k,
             const std::vector<__nv_bfloat16>& v, const std::vector<__nv_bfloat16>& o, int B, int T, int H, float scale) {
  double err2 = 0, ref2 = 0;
  const int pairs[3][2] = {{0, 0}, {B - 1, H - 1}, {B / 2, H / 2}};
  std::vector<double> S(kDI * kDI);
  for (const auto& bh : pairs) {
    std::fill(S.begin(), S.end(), 0.0);
    for (int tt = 0; tt < T; ++tt) {
      const size_t row = ((size_t(bh[0]) * T + tt) * H + bh[1]) * kDI;
      for (int d = 0; d < kDI; ++d) {
        const double kd = __bfloat162float(k[row + d]);
        for (int c = 0; c < kDI; ++c) S[d * kDI + c] += kd * double(__bfloat162float(v[row + c]));
      }
      for (int c = 0; c < kDI; ++c) {
        double ref = 0;
        for (int d = 0; d < kDI; ++d) ref += double(__bfloat162float(q[row + d])) * S[d * kDI + c];
        ref *= scale;
        const double got = __bfloat162float(o[row + c]);
        err2 += (got - ref) * (got - ref);
        ref2 += ref * ref;
      }
    }
  }
  return std::sqrt(err2 / ref2);
}

// The inputs of one shape on the host and the device, made once for both layouts.
struct Inputs {
  int B, T, H;
  std::vector<__nv_bfloat16> q, k, v;
  __nv_bfloat16 *dq, *dk, *dv, *dout;
  size_t n;
};

Inputs make_inputs(int B, int T, int H) {
  Inputs in{B, T, H};
  in.n = size_t(B) * T * H * kDI;
  std::mt19937 gen(1234 + B);
  std::uniform_real_distribution<float> uni(0.f, 1.f);
  std::normal_distribution<float> normal;
  in.q.resize(in.n), in.k.resize(in.n), in.v.resize(in.n);
  for (size_t e = 0; e < in.n; ++e) {  // positive q, k as after a feature map
    in.q[e] = __float2bfloat16(uni(gen));
    in.k[e] = __float2bfloat16(uni(gen));
    in.v[e] = __float2bfloat16(0.5f * normal(gen));
  }
  const size_t bytes = in.n * 2;
  cudaMalloc(&in.dq, bytes), cudaMalloc(&in.dk, bytes), cudaMalloc(&in.dv, bytes), cudaMalloc(&in.dout, bytes);
  cudaMemcpy(in.dq, in.q.data(), bytes, cudaMemcpyHostToDevice);
  cudaMemcpy(in.dk, in.k.data(), bytes, cudaMemcpyHostToDevice);
  cudaMemcpy(in.dv, in.v.data(), bytes, cudaMemcpyHostToDevice);
  return in;
}

// Checks, times and reports one kernel; launch() runs it once over the inputs into in.dout.
// tiles: 64-column tiles per block.
template <class Launch>
int measure(const std::string& name, const Inputs& in, int sms, int per_sm, int blocks, int tiles, float scale,
            Launch launch) {
  const int B = in.B, T = in.T, H = in.H;
  per_sm = std::min(per_sm, (blocks + sms - 1) / sms);  // blocks an SM holds, or fewer where the grid is small
  cudaMemset(in.dout, 0xff, in.n * 2);  // NaN: a row the kernel misses fails the check
  launch();
  cudaError_t err = cudaDeviceSynchronize();
  if (err != cudaSuccess) {
    std::printf("%s: kernel failed: %s\n", name.c_str(), cudaGetErrorString(err));
    return 2;
  }
  std::vector<__nv_bfloat16> ho(in.n);
  cudaMemcpy(ho.data(), in.dout, in.n * 2, cudaMemcpyDeviceToHost);
  const double rel = check(in.q, in.k, in.v, ho, B, T, H, scale);

  const double us = median_launch_us(launch);
  if ((err = cudaGetLastError()) != cudaSuccess) {
    std::printf("%s: a timed launch failed: %s\n", name.c_str(), cudaGetErrorString(err));
    return 2;
  }
  // tokens of one head's 64 columns per microsecond per busy SM (the unit of design.md item 8)
  const int busy = std::min(sms, blocks);
  const double rate = double(blocks) * tiles * T / us / busy;
  std::printf("%s B%d-T%d-H%d-D128: %3d blocks, %d per SM on %3d SMs, kernel %7.1f us, %5.1f tokens/us per SM, "
              "rel RMS vs float64 %.2e (%s)\n",
              name.c_str(), B, T, H, blocks, per_sm, busy, us, rate, rel, rel < 8e-3 ? "ok" : "WRONG");
  return rel < 8e-3 ? 0 : 1;
}

template <int WGS, int NCOL, int VAR = 0>
int run(const Inputs& in, int sms) {
  using L = Layout<WGS, NCOL>;
  auto kernel = forward_kernel<WGS, NCOL, VAR>;
  const float scale = 1.f / 128.f;
  const Args args{in.dq, in.dk, in.dv, in.dout, in.T, in.H, scale, 1};
  const int blocks = in.B * in.H * L::blocks_per_head;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, L::smem);
  cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared);
  int per_sm = 0;
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, 128 * WGS, L::smem);
  const std::string name = "wg" + std::to_string(WGS) + "-n" + std::to_string(NCOL) + (VAR ? "-v" + std::to_string(VAR) : "");
  return measure(name, in, sms, per_sm, blocks, L::VT, scale, [&] { kernel<<<blocks, 128 * WGS, L::smem>>>(args); });
}

// The library's 64-token forward sweep (chunk_wg_kernel, the kernel ATTNRNN_TC_WGMMA=7 runs at
// D = 128) on the same inputs, one pass: grid (batch x 2 column tiles, heads), as launch_sweep makes it.
int run_library(const Inputs& in, int sms) {
  using namespace attnrnn;
  using L = cuda::WgLayoutOf<cuda::TcRole::kForward, kDI>;
  auto kernel = cuda::chunk_wg_kernel<__nv_bfloat16, cuda::TcRole::kForward, kDI, false>;
  const float scale = 1.f / 128.f;
  LinearAttnParams p;
  p.device = Device::kCUDA;
  p.dtype = DType::kBFloat16;
  p.batch = in.B, p.seqlen = in.T, p.num_heads = p.num_kv_heads = in.H, p.head_dim_k = p.head_dim_v = kDI;
  const int64_t sb = int64_t(in.T) * in.H * kDI, st = int64_t(in.H) * kDI, sh = kDI;
  p.q = ConstView{in.dq, sb, st, sh};
  p.k = ConstView{in.dk, sb, st, sh};
  p.v = ConstView{in.dv, sb, st, sh};
  p.o = MutView{in.dout, sb, st, sh};
  p.scale = scale;
  const dim3 grid(static_cast<unsigned>(in.B * kDI / 64), static_cast<unsigned>(in.H));
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(L::smem_bytes));
  int per_sm = 0;
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, cuda::kTcThreads, L::smem_bytes);
  return measure("lib", in, sms, per_sm, static_cast<int>(grid.x * grid.y), 1, scale,
                 [&] { kernel<<<grid, cuda::kTcThreads, L::smem_bytes>>>(p, cuda::TcSplit{}, cuda::TcFeatures{}); });
}

int main(int argc, char** argv) {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  std::vector<std::array<int, 3>> shapes = {{4, 8192, 16}, {8, 8192, 16}};
  if (argc > 3) shapes = {{std::atoi(argv[1]), std::atoi(argv[2]), std::atoi(argv[3])}};
  const std::string only = argc > 4 ? argv[4] : "";  // one layout, e.g. for ncu
  auto wanted = [&](const char* layout) { return only.empty() || only == layout; };
  int status = 0;
  for (const auto& s : shapes) {
    if (s[1] <= 0 || s[1] % kC != 0) {
      std::printf("T must be a positive multiple of %d\n", kC);
      return 2;
    }
    Inputs in = make_inputs(s[0], s[1], s[2]);
    if (wanted("lib")) status |= run_library(in, sms);
    if (wanted("wg1-n64")) status |= run<1, 64>(in, sms);
    // the variants toward the library, one bit at a time and all together
    if (wanted("wg1-n64-v1")) status |= run<1, 64, kSerial>(in, sms);
    if (wanted("wg1-n64-v2")) status |= run<1, 64, kLibPublish>(in, sms);
    if (wanted("wg1-n64-v5")) status |= run<1, 64, kSerial | kBranchUpdate>(in, sms);
    if (wanted("wg1-n64-v8")) status |= run<1, 64, kLibWriter>(in, sms);
    if (wanted("wg1-n64-v15")) status |= run<1, 64, kSerial | kLibPublish | kBranchUpdate | kLibWriter>(in, sms);
    if (wanted("wg2-n32")) status |= run<2, 32>(in, sms);
    if (wanted("wg2-n64")) status |= run<2, 64>(in, sms);
    if (wanted("wg4-n32")) status |= run<4, 32>(in, sms);
    cudaFree(in.dq), cudaFree(in.dk), cudaFree(in.dv), cudaFree(in.dout);
  }
  return status;
}
