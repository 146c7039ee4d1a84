// Warpgroup MMA pieces shared by scripts/wgmma_probe.cu and scripts/wgmma_scan_probe.cu (sm_90a):
// the 128-byte-swizzled 64 x 64 bf16 tile, its shared-memory descriptor, m64n64k16 products with
// A from shared memory or registers, fences, and the accumulator layout.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

// Byte offset of element (r, c) of a 64 x 64 bf16 tile under the 128-byte swizzle: the 16-byte
// chunk index of a row is XORed with the row index mod 8.
__host__ __device__ inline int swizzled(int r, int c) { return r * 128 + (((c >> 3) ^ (r & 7)) << 4) + (c & 7) * 2; }

// Shared-memory matrix descriptor: start address >> 4, LBO 16 B (unused with this swizzle),
// SBO 1024 B (eight 128-byte rows), layout type 1 = 128-byte swizzle.
__device__ inline uint64_t descriptor(const void* smem, int byte_offset) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem)) + byte_offset;
  return uint64_t((addr & 0x3FFFF) >> 4) | (uint64_t(1) << 16) | (uint64_t(64) << 32) | (uint64_t(1) << 62);
}

#define ACC32(d)                                                                                         \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),       \
      "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),           \
      "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]),         \
      "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]),         \
      "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define DREGS                                                                                            \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, " \
  "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"

// D (+)= A B, A and B from shared memory; accumulate = 0 overwrites D.
template <int TransA, int TransB>
__device__ inline void wgmma_ss(float (&d)[32], uint64_t a, uint64_t b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " DREGS ", %32, %33, p, 1, 1, %35, %36;\n}\n"
      : ACC32(d)
      : "l"(a), "l"(b), "r"(accumulate), "n"(TransA), "n"(TransB));
}

// D (+)= A B, A from registers (four bf16 pairs per thread, the accumulator's layout), B from shared memory.
template <int TransB>
__device__ inline void wgmma_rs(float (&d)[32], const uint32_t (&a)[4], uint64_t b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " DREGS ", {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"
      : ACC32(d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate), "n"(TransB));
}

__device__ inline void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ inline void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ inline void wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
__device__ inline void fence_async_shared() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Accumulator register i of thread t holds element (row, col) of the 64 x 64 result.
__host__ __device__ inline int acc_row(int t, int i) { return 16 * (t / 32) + (t % 32) / 4 + 8 * ((i >> 1) & 1); }
__host__ __device__ inline int acc_col(int t, int i) { return 8 * (i >> 2) + 2 * (t % 4) + (i & 1); }

__device__ inline uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}
