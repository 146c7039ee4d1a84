// The wgmma sweep's (scan_wgmma.cuh) shared memory and the moves of its tiles: the block's layout,
// chunk rows into swizzled tiles, rows scaled by w in place (with dk's dd / w), the state published as 16-bit hi / lo
// tiles, and accumulator rows out to global memory. Thread tid of the 128 copies piece tid % 8 (16
// bytes) of rows tid / 8 + 16 j of each 64-column tile; accumulators are in wgmma.cuh's layout.
#pragma once

#include <type_traits>

#include "scan_roles.cuh"
#include "../common/mma.cuh"
#include "../common/wgmma.cuh"

namespace attnrnn::cuda {

template <int DI, bool kFourTiles = false>
struct WgmmaLayout {
  static constexpr int KT = DI / 64;  // 64-dim tiles of A, B and S
  static constexpr int stages = WgmmaTiles<DI, kFourTiles>::stages;
  // A, B tiles, the Cv tile, and the fused dk + dv sweep's V tile
  static constexpr int stage = (2 * KT + 1 + (kFourTiles ? 1 : 0)) * kWgTileBytes;
  // shared memory: 65 / 113 KiB per block (81 KiB with four tiles, and registers for two outputs)
  static constexpr int min_blocks = WgmmaTiles<DI, kFourTiles>::blocks_per_sm;
  static constexpr int z_floats = DI > 64 ? DI : 64;         // z on the inner dims or the 64 columns
  // floats after the tiles: the dk sweep's dd [stages][64] (or the forward's split z, one word per
  // dim), then z; the base is 1024-byte aligned (no slack: at DI = 128 the block uses exactly half an
  // SM's shared memory)
  static constexpr int dd = 0, z = stages * kChunk > DI ? stages * kChunk : DI, floats = z + z_floats;
  static constexpr int64_t smem_bytes = int64_t(stages) * stage + 2 * KT * kWgTileBytes + floats * 4;
  static constexpr int64_t partial_floats = WgmmaTiles<DI>::partial_floats;  // S [DI][64], then z
  static_assert(partial_floats == DI * 64 + z_floats, "the partial holds S, then z");
  static_assert(DI % 64 == 0 && DI <= 256, "inner dim 64, 128, 192 or 256");
  static_assert(!kFourTiles || DI == 64, "the fused dk + dv sweep is for K = V = 64");
  // 228 KiB per SM on sm_90, and 1 KiB of each block's is reserved by the system
  static_assert(min_blocks * (smem_bytes + 1024) <= 228 * 1024, "min_blocks blocks must fit on an SM");
};

template <ScanRole R, int DI>
using WgmmaLayoutOf = WgmmaLayout<DI, R == ScanRole::kGradKV>;

// The steps of a sweep's segment: (chunk, query head) pairs, chunk-major, of the chunks [ci0, ci1)
// of one sequence and the G query heads of kv head g, walked without a division per step; reverse
// sweeps take the chunks from the last.
struct WgStep {
  int64_t t0, h;  // the chunk's first token, the query head
  int cl;         // the chunk's valid tokens
  bool first, last;  // the group's first / last query head
};
struct WgSteps {
  Seq seq;
  int64_t g, G;
  int heads, chunk, nc, ci0, ci1;
  __device__ __forceinline__ WgSteps(const Seq& s, int64_t kv_head, int64_t group, int chunk_len, const SegmentSplit& split,
                                     int seg)
      : seq(s), g(kv_head), G(group), heads(static_cast<int>(group)), chunk(chunk_len),
        nc(static_cast<int>((s.len + chunk_len - 1) / chunk_len)) {
    ci0 = min(nc, seg * split.seg_chunks);
    ci1 = min(nc, ci0 + split.seg_chunks);
  }
  __device__ __forceinline__ int count() const { return (ci1 - ci0) * heads; }
  struct Walk {
    int ci, hi;
  };
  __device__ __forceinline__ Walk start() const { return Walk{ci0, 0}; }
  template <bool kReverse>
  __device__ __forceinline__ WgStep at(const Walk& w) const {
    const int c = kReverse ? nc - 1 - w.ci : w.ci;
    const int64_t off = int64_t(c) * chunk;
    return WgStep{seq.t0 + off, g * G + w.hi, static_cast<int>(seq.len - off < chunk ? seq.len - off : chunk), w.hi == 0,
                  w.hi == heads - 1};
  }
  __device__ __forceinline__ void advance(Walk& w) const {
    if (++w.hi == heads) w.hi = 0, ++w.ci;
  }
};

// A tile source: this thread's 16-byte piece of row 0 of one sequence at token 0, head 0, and the
// strides to move from there; hoisted so that a step costs one address per source.
template <class T>
struct WgSource {
  const T* base;
  int64_t stride_t, stride_h;
  int cols;  // padded sweeps: the view's columns from this thread's piece on (its piece of tile d0 is real
             // where d0 < cols); unused otherwise
};
// The source of view v's columns col0 + [0, 64) in sequence seq (128 threads to a row's 8 pieces), of
// `dim` real columns.
template <class T>
__device__ __forceinline__ WgSource<T> wg_source(const ConstView& v, const Seq& seq, int col0, int tid, int dim = 0) {
  return WgSource<T>{static_cast<const T*>(v.data) + seq.b * v.stride_b + col0 + (tid % 8) * 8, v.stride_t, v.stride_h,
                     dim - col0 - (tid % 8) * 8};
}

// `width` columns of a chunk's rows (from token t0, cl of them valid) into 64-column tiles at dst;
// rows past the chunk's end arrive as zeros, and so do columns past src.cols where kPadded.
template <class T, bool kPadded = false>
__device__ __forceinline__ void wg_load_tiles(unsigned char* dst, const WgSource<T>& src, int64_t head, int width,
                                              int64_t t0, int cl, int tid) {
  const T* chunk = src.base + t0 * src.stride_t + head * src.stride_h;
  const int piece = tid % 8;
  if (cl == kChunk) {  // a whole chunk (every one but a sequence's last): rows 16 apart, one add each
    const T* row0 = chunk + (tid / 8) * src.stride_t;
    const int64_t rows16 = 16 * src.stride_t;
#pragma unroll
    for (int j = 0; j < kChunk / 16; ++j)
#pragma unroll
      for (int d0 = 0; d0 < width; d0 += 64) {
        if constexpr (kPadded) {
          const bool real = d0 < src.cols;
          cp_async16(dst + wg_at(tid / 8 + 16 * j, d0 + piece * 8), real ? row0 + j * rows16 + d0 : src.base, real);
        } else {
          cp_async16(dst + wg_at(tid / 8 + 16 * j, d0 + piece * 8), row0 + j * rows16 + d0, true);
        }
      }
    return;
  }
#pragma unroll
  for (int j = 0; j < kChunk / 16; ++j) {
    const int r = tid / 8 + 16 * j;
    const bool valid = r < cl;
    const T* from = valid ? chunk + r * src.stride_t : src.base;
#pragma unroll
    for (int d0 = 0; d0 < width; d0 += 64) {
      if constexpr (kPadded) {
        const bool real = valid && d0 < src.cols;
        cp_async16(dst + wg_at(r, d0 + piece * 8), real ? from + d0 : src.base, real);
      } else {
        cp_async16(dst + wg_at(r, d0 + piece * 8), from + (valid ? d0 : 0), valid);
      }
    }
  }
}

// The same for a 128-token chunk and 256 threads: rows tid / 8 + 32 j, those of j = 0, 1 into row
// block 0 and of j = 2, 3 into row block 1 of dst ([row block][width / 64 tiles]). (A separate
// function: one loader for both sizes changed the code ptxas makes for the 64-token sweeps.)
template <class T>
__device__ __forceinline__ void wg_load_pair_tiles(unsigned char* dst, const WgSource<T>& src, int64_t head, int width,
                                                   int64_t t0, int cl, int tid) {
  const T* chunk = src.base + t0 * src.stride_t + head * src.stride_h;
  const int piece = tid % 8;
  if (cl == 2 * kChunk) {  // a whole chunk: rows 32 apart, one add each
    const T* row0 = chunk + (tid / 8) * src.stride_t;
    const int64_t rows32 = 32 * src.stride_t;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      unsigned char* block = dst + (j / 2) * (width / 64) * kWgTileBytes;
#pragma unroll
      for (int d0 = 0; d0 < width; d0 += 64)
        cp_async16(block + wg_at(tid / 8 + 32 * (j % 2), d0 + piece * 8), row0 + j * rows32 + d0, true);
    }
    return;
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int r = tid / 8 + 32 * j, local = tid / 8 + 32 * (j % 2);
    unsigned char* block = dst + (j / 2) * (width / 64) * kWgTileBytes;
    const bool valid = r < cl;
    const T* from = valid ? chunk + r * src.stride_t : src.base;
#pragma unroll
    for (int d0 = 0; d0 < width; d0 += 64) cp_async16(block + wg_at(local, d0 + piece * 8), from + (valid ? d0 : 0), valid);
  }
}

// Eight 16-bit values (one 16-byte piece of a tile row) times w, in place.
template <class T>
__device__ __forceinline__ void wg_scale_piece(unsigned char* piece, float w) {
  uint4* x = reinterpret_cast<uint4*>(piece);
  uint4 v = *x;
  uint32_t* u = reinterpret_cast<uint32_t*>(&v);
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const float2 f = unpack2<T>(u[e]);
    u[e] = pack2<T>(f.x * w, f.y * w);
  }
  *x = v;
}

// dq's weights of its accumulator rows r0 and r0 + 8, from weight(ws, row, otherwise) (a step's
// per-token value): w and dd as loaded. dq_dd_over_w divides them later in the step, where the loads
// have landed: dividing here waited on them at the step's start (ncu: ~14% of the 128-token dq
// sweep's stall samples, long_sb).
template <class Weight>
__device__ __forceinline__ void dq_row_weights(Weight&& weight, const float* ws_w, const float* ws_dd, int r0,
                                               float scale, float (&w)[2], float (&dd)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    w[r] = weight(ws_w, r0 + 8 * r, scale);
    dd[r] = weight(ws_dd, r0 + 8 * r, 0.f);
  }
}
// dd / w in place, 0 where w is 0 (scale = 0: the rows' gradient is 0 then).
__device__ __forceinline__ void dq_dd_over_w(const float (&w)[2], float (&dd)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) dd[r] = w[r] != 0.f ? dd[r] / w[r] : 0.f;
}

// Whether the dk sweep with inner dim DI scales phi(q) (64 columns) by w instead of dout (DI
// columns): in bf16 at DI = 128 only. At DI = 64 the two are as wide (and the old way spills less:
// fp16 16 B against 56), and fp16's w phi(q) would be subnormal where dz sums it (its column sums
// weigh dd in fp32 instead).
template <class T, ScanRole R, int DI>
constexpr bool wg_dk_scales_cv = R == ScanRole::kGradK && DI > 64 && std::is_same_v<T, __nv_bfloat16>;

// dk's weights: its dout stays as loaded and Cv = phi(q) takes w (64 columns instead of K's), so
// the scores take dd / w per column. The copy rows' owners (tid % 8 == 0: rows tid / 8 + rows_apart j)
// load dd of their rows (wg_load_row_dd) and divide it in place after their wait (wg_dd_over_w; 0
// where w is 0, as where dd is).
template <int J>
__device__ __forceinline__ void wg_load_row_dd(float* dd, const float* ws_dd, int rows_apart, int cl, int tid,
                                               const ChunkArgs& p, const Seq& seq, int64_t t0, int64_t h) {
  if (tid % 8 != 0) return;
#pragma unroll
  for (int j = 0; j < J; ++j) {
    const int r = tid / 8 + rows_apart * j;
    const bool valid = r < cl;
    cp_async4(dd + r, ws_dd + (valid ? token_index(p, seq, t0 + r, h) : 0), valid);
  }
}
template <int J>
__device__ __forceinline__ void wg_dd_over_w(float* dd, const float (&w)[J], int rows_apart, int tid) {
  if (tid % 8 != 0) return;
#pragma unroll
  for (int j = 0; j < J; ++j) {
    float& x = dd[tid / 8 + rows_apart * j];
    x = w[j] != 0.f ? __fdividef(x, w[j]) : 0.f;  // rounded to 16 bits in the scores anyway
  }
}

// relu of the valid rows among this thread's own pieces of a tile (ScanFeatures::relu_in_sweep), which
// its cp.async wait has made visible to it, in place: relu2 on the packed pairs, exactly as
// feature_pass_kernel rounds relu (one compare and one mask per pair on the step's chain). Copied row j
// is token token(j) of the chunk, and its piece of 64-column tile d0 / 64 lies at offset(j, d0): the
// rows of wg_load_tiles or wg_load_pair_tiles.
template <class T, int kRows, class Token, class Offset>
__device__ __forceinline__ void wg_relu_own_rows(unsigned char* tile, int width, int cl, Token token, Offset offset) {
#pragma unroll
  for (int j = 0; j < kRows; ++j) {
    if (token(j) >= cl) continue;
    for (int d0 = 0; d0 < width; d0 += 64) {
      uint4* x = reinterpret_cast<uint4*>(tile + offset(j, d0));
      const uint4 v = *x;
      *x = make_uint4(relu2<T>(v.x), relu2<T>(v.y), relu2<T>(v.z), relu2<T>(v.w));
    }
  }
}
// wg_load_tiles' rows: tid / 8 + 16 j (128 threads)
template <class T>
__device__ __forceinline__ void wg_relu_rows(unsigned char* tile, int width, int cl, int tid) {
  const int r = tid / 8, col = (tid % 8) * 8;
  wg_relu_own_rows<T, kChunk / 16>(
      tile, width, cl, [&](int j) { return r + 16 * j; }, [&](int j, int d0) { return wg_at(r + 16 * j, d0 + col); });
}
// wg_load_pair_tiles' rows: tid / 8 + 32 j (256 threads), j = 0, 1 in row block 0 and j = 2, 3 in row block 1
template <class T>
__device__ __forceinline__ void wg_relu_pair_rows(unsigned char* tile, int width, int cl, int tid) {
  const int r = tid / 8, col = (tid % 8) * 8;
  wg_relu_own_rows<T, 4>(
      tile, width, cl, [&](int j) { return r + 32 * j; },
      [&](int j, int d0) { return (j / 2) * (width / 64) * kWgTileBytes + wg_at(r + 32 * (j % 2), d0 + col); });
}

// wg_scale_rows for wg_load_pair_tiles' rows (w[j] for row tid / 8 + 32 j, 256 threads).
template <class T>
__device__ __forceinline__ void wg_scale_pair_rows(unsigned char* tile, int width, int cl, const float (&w)[4], int tid) {
  const int piece = tid % 8;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    if (tid / 8 + 32 * j >= cl) continue;
    unsigned char* block = tile + (j / 2) * (width / 64) * kWgTileBytes;
    for (int d0 = 0; d0 < width; d0 += 64) wg_scale_piece<T>(block + wg_at(tid / 8 + 32 * (j % 2), d0 + piece * 8), w[j]);
  }
}

// Rows times w (w[j] for row tid / 8 + 16 j), in place: this thread's own pieces, which its
// cp.async wait has made visible to it.
template <class T>
__device__ __forceinline__ void wg_scale_rows(unsigned char* tile, int width, int cl, const float (&w)[kChunk / 16],
                                              int tid) {
  const int piece = tid % 8;
#pragma unroll
  for (int j = 0; j < kChunk / 16; ++j) {
    const int r = tid / 8 + 16 * j;
    if (r >= cl) continue;
    for (int d0 = 0; d0 < width; d0 += 64) wg_scale_piece<T>(tile + wg_at(r, d0 + piece * 8), w[j]);
  }
}

// The state S [64 KT rows][64 columns] (KT accumulators) as 16-bit hi + lo tiles [d][c] for the
// products A S. Pair p = i / 2 of an accumulator is the 8 x 8 matrix (rows 16 w + 8 (p % 2) + [0, 8),
// columns 8 (p / 2) + [0, 8)) of warp w, in stmatrix's layout: four pairs per stsm_x4, each lane giving
// the row address of matrix lane / 8 (a 16-byte piece of a swizzled row).
template <class T, int KT>
__device__ __forceinline__ void wg_publish_state(const float (&S)[KT][32], unsigned char* Sh, unsigned char* Sl,
                                                 int tid) {
  const int lane = tid % 32;
#pragma unroll
  for (int h = 0; h < KT; ++h)
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      uint32_t hi[4], lo[4];
#pragma unroll
      for (int m = 0; m < 4; ++m) {
        const int i = 2 * (4 * q + m);
        hi[m] = pack2<T>(S[h][i], S[h][i + 1]);
        const float2 back = unpack2<T>(hi[m]);
        lo[m] = pack2<T>(S[h][i] - back.x, S[h][i + 1] - back.y);
      }
      const int p = 4 * q + lane / 8, off = wg_at(64 * h + 16 * (tid / 32) + 8 * (p % 2) + lane % 8, 8 * (p / 2));
      stsm_x4(Sh + off, hi);
      stsm_x4(Sl + off, lo);
    }
}

// ---- the chunk's products, as the kernels' bodies name them ----------------------------------------
// k16 slice j of a group of 64-dim tiles: its byte offset along the rows (a K-major operand: 16
// elements, 32 bytes) or down them (an M/N-major one: 16 rows, 2048 bytes).
__device__ __forceinline__ int wg_slice_along(int j) { return (j / 4) * kWgTileBytes + 32 * (j % 4); }
__device__ __forceinline__ int wg_slice_down(int j) { return (j / 4) * kWgTileBytes + 2048 * (j % 4); }

// P = A B^T: the scores of a chunk's rows of A against its rows of B, over an inner dim of DI.
template <class T, int DI>
__device__ __forceinline__ void wg_scores(float (&P)[32], const unsigned char* At, const unsigned char* Bt) {
#pragma unroll
  for (int j = 0; j < DI / 16; ++j)
    wg_mma_ss<T, 0, 0>(P, wg_descriptor(At, wg_slice_along(j)), wg_descriptor(Bt, wg_slice_along(j)), j > 0);
}

// O = A S_hi + A S_lo: the chunk's rows of A against the state before it, held as two 16-bit tiles
// [d][c] (wg_publish_state); Transposed: A S^T, the tiles read K-major (their rows are O's columns).
template <class T, int DI, bool Transposed = false>
__device__ __forceinline__ void wg_state_product(float (&O)[32], const unsigned char* At, const unsigned char* Sh,
                                                 const unsigned char* Sl) {
  constexpr int kTransB = Transposed ? 0 : 1;
  auto slice = [](int j) { return Transposed ? wg_slice_along(j) : wg_slice_down(j); };
#pragma unroll
  for (int j = 0; j < DI / 16; ++j)
    wg_mma_ss<T, 0, kTransB>(O, wg_descriptor(At, wg_slice_along(j)), wg_descriptor(Sh, slice(j)), j > 0);
#pragma unroll
  for (int j = 0; j < DI / 16; ++j)
    wg_mma_ss<T, 0, kTransB>(O, wg_descriptor(At, wg_slice_along(j)), wg_descriptor(Sl, slice(j)), 1);
}

// O += P C: the masked scores (the register operand, packed by the kernel) times the chunk's 64 rows
// of C, 64 columns from byte c_offset of Ct.
template <class T>
__device__ __forceinline__ void wg_scores_times(float (&O)[32], const uint32_t (&pa)[4][4], const unsigned char* Ct,
                                                int c_offset = 0) {
#pragma unroll
  for (int j = 0; j < 4; ++j) wg_mma_rs<T, 1>(O, pa[j], wg_descriptor(Ct, c_offset + 2048 * j), 1);
}

// S += B^T C: the state's update by a chunk of 64 tokens, per 64-dim tile h of B; C's 64 columns from
// byte c_offset of Ct.
template <class T, int KT>
__device__ __forceinline__ void wg_update_state(float (&S)[KT][32], const unsigned char* Bt, const unsigned char* Ct,
                                                int c_offset = 0) {
#pragma unroll
  for (int h = 0; h < KT; ++h)
#pragma unroll
    for (int j = 0; j < 4; ++j)
      wg_mma_ss<T, 1, 1>(S[h], wg_descriptor(Bt, h * kWgTileBytes + 2048 * j), wg_descriptor(Ct, c_offset + 2048 * j),
                         1);
}

// out's rows 16-byte aligned, for wg_write_rows' staged path (16-bit elements: 8 per 16 bytes).
__device__ __forceinline__ bool wg_aligned16(const MutView& out) {
  return reinterpret_cast<uintptr_t>(out.data) % 16 == 0 && (out.stride_b | out.stride_t | out.stride_h) % 8 == 0;
}

// An accumulator's rows times inv (and, with dphi_of, phi' of the input's rows) into out at
// columns c0 + [0, 64): this thread's rows r0 and r0 + 8 of the chunk from token t0 (cl valid).
// With `scratch`, a 64 x 64 tile of shared memory (wg_at's layout) that no product reads any more
// (the step's A tile), and out 16-byte aligned: staged through this warp's 16 rows of it
// (stmatrix), then four 16-byte stores per thread, each instruction four whole 128-byte rows.
// Sixteen 4-byte stores per thread touch eight rows each: their queue held the warps, which waited
// to reuse the stores' registers (ncu: 10-17% of the backward sweeps' stall samples). Each warp
// overwrites only its own 16 rows after its own wgmma wait: warp w's share of an m64 product reads A
// rows [16w, 16w + 16) (on its own sub-partition's tensor core), which the PTX ISA does not spell out;
// the bitwise A/B against the direct stores is the check. The views come by value (see tc_view).
// phi' multiplies in fp32 before the rounding. It comes from phi_rows (dphi_rows): phi(q) or
// phi(k) in the workspace where the feature pass wrote them, which elu1 always has on these sweeps
// (its phi' is then min(phi, 1), no exp), else the raw input (relu applied in the sweeps, whose
// phi' reads alike from either). Its elements are loaded Batch pairs at a time
// ahead of their stores: loads and stores interleaved kept each load behind the store before it (out
// may alias them as far as the compiler knows), a memory latency per element pair (H200,
// B1-T65536-H16-D128 with relu: the dk + dv sweep 538 -> 1851 us, dq 338 -> 1093 against the
// identity map). All sixteen in one batch by default; eight where sixteen more live registers spill
// (the paired sweeps with the normalizer: their dk 4 -> 20 bytes).
// Returns whether a row it wrote (of the cl valid) has an accumulator element that is not finite
// (note_nonfinite): x * 0 is 0 for a finite x and NaN otherwise, one FFMA per element.
// kPadded: out has `cols` real columns from c0 on (a multiple of 8, possibly fewer than 64); the rest
// of the accumulator (products with the zeros the tiles were padded with) is not written.
template <class T, int Batch = 16, bool kPadded = false>
__device__ __forceinline__ bool wg_write_rows(const MutView out, const float (&acc)[32], const float (&inv)[2],
                                              FeatureMap fm, bool dphi_of, const ConstView phi_rows, int64_t b,
                                              int64_t t0, int cl, int64_t head, int c0, int tid,
                                              unsigned char* scratch = nullptr, int cols = 64) {
  const int r0 = wg_acc_row(tid, 0);
  // Checked before the stores, which then consume acc: one predicate stays live through them.
  float finite = 0.f;  // 0 while every value of this thread's rows < cl is finite
#pragma unroll
  for (int e = 0; e < 32; ++e)
    if (r0 + 8 * ((e >> 1) & 1) < cl) finite = fmaf(acc[e], 0.f, finite);
  const bool nonfinite = finite != 0.f;
  // One body per feature map (kIdentity: no phi'): a branch on dphi_of per element cost every element
  // a test and a reconvergence point, with the identity map too, and phi' with the map a runtime value
  // switched on it for each element.
  auto write = [&](auto map) {
    constexpr FeatureMap kMap = decltype(map)::value;
    constexpr bool kDphi = kMap != FeatureMap::kIdentity;
    constexpr int kBatch = Batch;  // element pairs (e, e + 1) per batch of raw loads
    static_assert(kBatch == 4 || kBatch == 8 || kBatch == 16, "a batch covers whole stmatrix groups");
    uint32_t raw2[kDphi ? kBatch : 1];  // the pair of elements (e, e + 1) of phi_rows at raw2[e / 2 % kBatch]
    const T* const raw0 = kDphi ? row<T>(phi_rows, b, t0 + r0, head) + c0 + wg_acc_col(tid, 0) : nullptr;
    auto load_raw = [&](int e0) {  // pairs e0 / 2 .. e0 / 2 + kBatch - 1
      if constexpr (kDphi) {
#pragma unroll
        for (int i = 0; i < kBatch; ++i) {
          const int e = e0 + 2 * i, half = (e >> 1) & 1;
          const bool real = !kPadded || wg_acc_col(tid, 0) + 8 * (e >> 2) < cols;
          raw2[i] = r0 + 8 * half < cl && real
                        ? *reinterpret_cast<const uint32_t*>(raw0 + 8 * half * phi_rows.stride_t + 8 * (e >> 2))
                        : 0u;
        }
      }
    };
    auto packed = [&](int e) {  // elements e, e + 1 (row r0 + 8 * half), scaled, as two 16-bit values
      const int half = (e >> 1) & 1;
      float x0 = acc[e] * inv[half], x1 = acc[e + 1] * inv[half];
      if constexpr (kDphi) {
        const float2 q2 = unpack2<T>(raw2[e / 2 % kBatch]);
        x0 *= dphi_of_phi(kMap, q2.x);
        x1 *= dphi_of_phi(kMap, q2.y);
      }
      return pack2<T>(x0, x1);
    };
    if constexpr (kBatch == 16) load_raw(0);  // every pair, before either way of storing
    if (scratch != nullptr && wg_aligned16(out)) {
      const int lane = tid % 32, warp = (tid / 32) % 4;
      const int r = 16 * warp + lane / 8, piece = lane % 8;  // this lane's rows r + 4k, 16 bytes each
      // addresses first: computed after the stmatrix, they reused its source registers and waited on it
      T* o = row<T>(out, b, t0 + r, head) + c0 + 8 * piece;
      const int64_t rows4 = 4 * out.stride_t;
      __syncwarp();  // every lane is done reading the rows of an earlier output staged here
#pragma unroll
      for (int q = 0; q < 4; ++q) {  // column groups 2q, 2q + 1 (8 columns each), rows r0 and r0 + 8
        if (kBatch < 16 && 4 * q % kBatch == 0) load_raw(8 * q);
        uint32_t x[4];
#pragma unroll
        for (int m = 0; m < 4; ++m) x[m] = packed(2 * (4 * q + m));
        const int mat = 4 * q + lane / 8;
        stsm_x4(scratch + wg_at(16 * warp + 8 * (mat % 2) + lane % 8, 8 * (mat / 2)), x);
      }
      __syncwarp();
      uint4 v[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) v[k] = *reinterpret_cast<const uint4*>(scratch + wg_at(r + 4 * k, 8 * piece));
      const bool real = !kPadded || 8 * piece < cols;
#pragma unroll
      for (int k = 0; k < 4; ++k, o += rows4)
        if (r + 4 * k < cl && real) *reinterpret_cast<uint4*>(o) = v[k];
      return;
    }
    T* const o0 = row<T>(out, b, t0 + r0, head) + c0 + wg_acc_col(tid, 0);
    T* const orow[2] = {o0, o0 + 8 * out.stride_t};
#pragma unroll
    for (int e = 0; e < 32; e += 2) {
      if (kBatch < 16 && e / 2 % kBatch == 0) load_raw(e);
      const int half = (e >> 1) & 1;
      const bool real = !kPadded || wg_acc_col(tid, 0) + 8 * (e >> 2) < cols;
      if (r0 + 8 * half < cl && real) *reinterpret_cast<uint32_t*>(orow[half] + 8 * (e >> 2)) = packed(e);
    }
  };
  using Identity = std::integral_constant<FeatureMap, FeatureMap::kIdentity>;
  using Elu1 = std::integral_constant<FeatureMap, FeatureMap::kElu1>;
  using Relu = std::integral_constant<FeatureMap, FeatureMap::kRelu>;
  if (!dphi_of || fm == FeatureMap::kIdentity)
    write(Identity{});
  else if (fm == FeatureMap::kElu1)
    write(Elu1{});
  else
    write(Relu{});
  return nonfinite;
}

}  // namespace attnrnn::cuda
