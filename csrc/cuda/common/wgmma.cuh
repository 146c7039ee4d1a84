// Warpgroup MMA building blocks (sm_90a): m64n64k16 products (and m64n8k16 for the normalizer's
// sums) with fp32 accumulators and bf16 or fp16 operands, A from shared memory or registers, B from shared memory, on 64 x 64 tiles of
// 128-byte rows stored with the 128-byte swizzle on a 1024-byte boundary. One descriptor form
// serves every operand; K-major vs M/N-major is the transpose flag, and the step per k16 slice is
// 32 bytes along a row (K-major) or 2048 bytes = 16 rows (M/N-major). Verified on the H200 by
// scripts/wgmma_probe.cu (docs/design.md, "Plan for the wgmma scan").
//
// Accumulator layout (128 threads, register i of thread t): row 16 (t / 32) + (t % 32) / 4 +
// 8 ((i >> 1) & 1), column 8 (i >> 2) + 2 (t % 4) + (i & 1). The register-A operand of k16 slice j
// is registers 8j .. 8j + 7 of an accumulator, packed in pairs: no shuffles between P = Q K^T and P V.
//
// sm_90a only: ptxas rejects these instructions for every other target (sm_8x, sm_90, sm_100a), so
// the kernels that use them put their bodies inside #if defined(__CUDA_ARCH_FEAT_SM90_ALL) (the
// other targets compile a trap) and the plan picks them only on a 9.x device (plan.cu).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "mma.cuh"  // smem_addr

namespace attnrnn::cuda {

constexpr int kWgTileBytes = 64 * 128;  // one 64 x 64 tile of 16-bit elements

// Byte offset of element (r, c) of a swizzled tile: the 16-byte chunk index XOR row mod 8.
__host__ __device__ __forceinline__ int wg_swizzled(int r, int c) {
  return r * 128 + (((c >> 3) ^ (r & 7)) << 4) + (c & 7) * 2;
}

// Byte offset of element (r, c) in a row of 64-column tiles (column c in tile c / 64).
__host__ __device__ __forceinline__ int wg_at(int r, int c) { return (c / 64) * kWgTileBytes + wg_swizzled(r, c % 64); }

// Four 8 x 8 matrices of 16-bit pairs to shared memory (sm_90): register m of every lane goes to
// matrix m, whose eight row addresses (16 bytes each) lanes 8m .. 8m + 7 give; lane l holds row
// l / 4, columns 2 (l % 4) and + 1 of each, the layout of an accumulator's pairs.
__device__ __forceinline__ void stsm_x4(void* row_address, const uint32_t (&r)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(smem_addr(row_address)),
               "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3])
               : "memory");
}

// Descriptor of the tile at `smem` + byte_offset: start address >> 4 (bits 0-13), LBO 16 B (unused
// with this swizzle), SBO 1024 B (eight rows), layout type 1 (128-byte swizzle). Tiles and offsets
// are multiples of 16 bytes and shared addresses stay below 2^18, so the offset and the LBO field
// add to the shifted base: one uniform add per product on a base shifted once per tile, where
// adding, masking, shifting and or-ing per product took four.
__device__ __forceinline__ uint64_t wg_descriptor(const void* smem, int byte_offset) {
  const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(smem)) >> 4;
  const uint32_t lo = base + ((static_cast<uint32_t>(byte_offset) >> 4) + (1u << 16));
  return (uint64_t(64u | (1u << 30)) << 32) | lo;
}

__device__ __forceinline__ int wg_acc_row(int t, int i) { return 16 * (t / 32) + (t % 32) / 4 + 8 * ((i >> 1) & 1); }
__device__ __forceinline__ int wg_acc_col(int t, int i) { return 8 * (i >> 2) + 2 * (t % 4) + (i & 1); }

#define ATTNRNN_WG_ACC(d)                                                                                \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),       \
      "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),           \
      "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]),         \
      "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]),         \
      "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define ATTNRNN_WG_D                                                                                     \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, " \
  "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define ATTNRNN_WG_MMA(ty) "wgmma.mma_async.sync.aligned.m64n64k16.f32." ty "." ty " "

// d (+)= A B with A and B in shared memory; accumulate == 0 overwrites d.
template <class T, int TransA, int TransB>
__device__ __forceinline__ void wg_mma_ss(float (&d)[32], uint64_t a, uint64_t b, int accumulate) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n" ATTNRNN_WG_MMA("bf16") ATTNRNN_WG_D
                 ", %32, %33, p, 1, 1, %35, %36;\n}\n"
                 : ATTNRNN_WG_ACC(d)
                 : "l"(a), "l"(b), "r"(accumulate), "n"(TransA), "n"(TransB));
  } else {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n" ATTNRNN_WG_MMA("f16") ATTNRNN_WG_D
                 ", %32, %33, p, 1, 1, %35, %36;\n}\n"
                 : ATTNRNN_WG_ACC(d)
                 : "l"(a), "l"(b), "r"(accumulate), "n"(TransA), "n"(TransB));
  }
}

// d (+)= A B with A in registers (four packed pairs per thread) and B in shared memory.
template <class T, int TransB>
__device__ __forceinline__ void wg_mma_rs(float (&d)[32], const uint32_t (&a)[4], uint64_t b, int accumulate) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n" ATTNRNN_WG_MMA("bf16") ATTNRNN_WG_D
                 ", {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"
                 : ATTNRNN_WG_ACC(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate), "n"(TransB));
  } else {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n" ATTNRNN_WG_MMA("f16") ATTNRNN_WG_D
                 ", {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"
                 : ATTNRNN_WG_ACC(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate), "n"(TransB));
  }
}

// d (+)= A B on an m64n8k16 product (B [k16 x 8]), both operands in shared memory: the normalizer's
// sums (wgmma_normalizer.cuh). d holds rows wg_acc_row(t, i), columns wg_acc_col(t, i) for i < 4.
template <class T, int TransA, int TransB>
__device__ __forceinline__ void wg_mma_n8_ss(float (&d)[4], uint64_t a, uint64_t b, int accumulate) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %6, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0, %1, %2, %3}, %4, %5, p, 1, 1, %7, %8;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "l"(a), "l"(b), "r"(accumulate), "n"(TransA), "n"(TransB));
  } else {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %6, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n8k16.f32.f16.f16 {%0, %1, %2, %3}, %4, %5, p, 1, 1, %7, %8;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "l"(a), "l"(b), "r"(accumulate), "n"(TransA), "n"(TransB));
  }
}

// ---- fp32 operands on TF32 (scan_wgmma_tf32.cuh) ----------------------------------------------------
// m64nNk8 products, N = 64 (the scores) or 32 (a block's output columns), both operands K-major
// (TF32 wgmma has no transposed form): a tile row is 32 floats (128 bytes) of one k run, and the step
// per k8 slice is 32 bytes along it. Register A of k8 slice j (per thread, rows as an accumulator's):
// (r, j8 + t), (r + 8, j8 + t), (r, j8 + t + 4), (r + 8, j8 + t + 4), r = wg_acc_row(tid, 0), t = tid % 4.
#define ATTNRNN_WG_ACC16(d)                                                                              \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),       \
      "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
#define ATTNRNN_WG_D16 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"

// d (+)= A B^T, A [64 x 8] and B [N x 8] in shared memory; accumulate == 0 overwrites d.
template <int N>
__device__ __forceinline__ void wg_tf32_ss(float (&d)[N / 2], uint64_t a, uint64_t b, int accumulate) {
  static_assert(N == 64 || N == 32, "m64n64k8 or m64n32k8");
  if constexpr (N == 64) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k8.f32.tf32.tf32 " ATTNRNN_WG_D ", %32, %33, p, 1, 1;\n}\n"
                 : ATTNRNN_WG_ACC(d)
                 : "l"(a), "l"(b), "r"(accumulate));
  } else {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n32k8.f32.tf32.tf32 " ATTNRNN_WG_D16 ", %16, %17, p, 1, 1;\n}\n"
                 : ATTNRNN_WG_ACC16(d)
                 : "l"(a), "l"(b), "r"(accumulate));
  }
}
// d += A B^T, A in registers (TF32 bits, the layout above) and B [32 x 8] in shared memory.
__device__ __forceinline__ void wg_tf32_rs32(float (&d)[16], const uint32_t (&a)[4], uint64_t b) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n32k8.f32.tf32.tf32 " ATTNRNN_WG_D16
               ", {%16, %17, %18, %19}, %20, p, 1, 1;\n}\n"
               : ATTNRNN_WG_ACC16(d)
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}

#undef ATTNRNN_WG_ACC16
#undef ATTNRNN_WG_D16
#undef ATTNRNN_WG_ACC
#undef ATTNRNN_WG_D
#undef ATTNRNN_WG_MMA

// Before the first product and whenever registers feeding a product changed.
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
// Waits until at most N of the committed groups, the latest ones, are still running.
template <int N>
__device__ __forceinline__ void wg_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
// Ties registers to this point, so the compiler cannot move their reads above a wait or their writes
// below a fence (neither has register operands of its own): after wg_wait_all for the accumulators,
// before wg_fence for the registers feeding the next products.
template <int N>
__device__ __forceinline__ void wg_hold(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
template <int J>
__device__ __forceinline__ void wg_hold(uint32_t (&a)[J][4]) {
#pragma unroll
  for (int j = 0; j < J; ++j)
#pragma unroll
    for (int q = 0; q < 4; ++q) asm volatile("" : "+r"(a[j][q])::"memory");
}
// Orders this thread's generic-proxy shared-memory writes (st.shared, cp.async) before later
// wgmma reads of them (the async proxy).
__device__ __forceinline__ void wg_fence_shared() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

}  // namespace attnrnn::cuda
