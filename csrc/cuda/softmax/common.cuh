// Pieces shared by the softmax-attention CUDA kernels: sequence geometry with the bottom-right
// causal alignment, the block -> (sequence, head, block start) map (varlen without a host sync),
// tensor-core fragments (ldmatrix, mma.sync m16n8k16 bf16/fp16), cp.async and warp reductions.
//
// Fragment layout of mma.m16n8k16 (g = lane / 4, t2 = 2 * (lane % 4)):
//   A (16 x 16, row-major): a0 = (g, t2..t2+1), a1 = (g+8, t2..), a2 = (g, t2+8..), a3 = (g+8, t2+8..)
//   B (16 x 8, "col"):      b0 = (k = t2..t2+1, n = g), b1 = (k = t2+8.., n = g)
//   C (16 x 8, fp32):       c0, c1 = (g, t2), (g, t2+1);  c2, c3 = (g+8, t2), (g+8, t2+1)
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>

#include "../common/device.cuh"
#include "../common/mma.cuh"
#include "feature_maps.h"  // exp_of

namespace attnrnn::cuda::sm {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// ---- geometry -----------------------------------------------------------------------------------
// Sequence n: queries [q0, q0 + Lq) and keys [k0, k0 + Lk) of batch entry b.
struct Seq {
  int64_t b, q0, Lq, k0, Lk;
  bool causal;
  // Keys visible to query i (0-based): [0, key_end(i)); query i sees key j iff j <= i + Lk - Lq.
  __device__ __forceinline__ int64_t key_end(int64_t i) const {
    if (!causal) return Lk;
    const int64_t e = i + Lk - Lq + 1;
    return e < 0 ? 0 : (e > Lk ? Lk : e);
  }
  // First query that sees key j (Lq when none does).
  __device__ __forceinline__ int64_t first_query(int64_t j) const {
    if (!causal) return 0;
    const int64_t i = j - (Lk - Lq);
    return i < 0 ? 0 : (i > Lq ? Lq : i);
  }
};

__device__ __forceinline__ int64_t cu_at(const SoftmaxAttnParams& p, int64_t n) {
  const int64_t v = p.cu_seqlens_int64 ? static_cast<const int64_t*>(p.cu_seqlens)[n]
                                       : int64_t(static_cast<const int32_t*>(p.cu_seqlens)[n]);
  // Values are not validated on the device (a host sync): clamping keeps bad offsets in bounds.
  return v < 0 ? 0 : (v > p.seqlen_q ? p.seqlen_q : v);
}

__device__ __forceinline__ Seq sequence(const SoftmaxAttnParams& p, int64_t n) {
  if (p.cu_seqlens == nullptr) return Seq{n, 0, p.seqlen_q, 0, p.seqlen_k, p.causal};
  const int64_t begin = cu_at(p, n), end_raw = cu_at(p, n + 1);
  const int64_t end = end_raw < begin ? begin : end_raw;
  return Seq{0, begin, end - begin, begin, end - begin, p.causal};
}

// Blocks of `blk` rows (queries, or keys when keys = true) per (sequence, head). Without varlen
// there are ceil(T / blk) per (batch, head). With varlen, sequence n's blocks are numbered from
// s(n) = floor(cu[n] / blk) + n: s is increasing and leaves room for ceil(L_n / blk) blocks, so
// floor(T / blk) + N numbers per head cover all sequences and a block finds its sequence by a
// binary search over cu_seqlens (no host sync, at most N idle blocks).
inline int64_t blocks_per_head(const SoftmaxAttnParams& p, int64_t T, int blk) {
  if (p.cu_seqlens != nullptr) return T / blk + p.num_seqs;
  return (T + blk - 1) / blk;
}

struct BlockPos {
  Seq s;
  int64_t n;            // the sequence: batch entry, or packed sequence with cu_seqlens
  int64_t head, start;  // start: first query (or key) of the block within the sequence
};

// Block u of the flattened grid [batch][heads][per_head]. reverse: the last block of a sequence
// first (causal query blocks with the most keys start earliest). False for an idle block.
__device__ __forceinline__ bool locate_block(const SoftmaxAttnParams& p, int64_t u, int64_t per_head, int blk,
                                             int64_t heads, bool keys, bool reverse, BlockPos& out) {
  const int64_t r = u % per_head, bh = u / per_head;
  out.head = bh % heads;
  int64_t n = bh / heads, j = r;
  if (p.cu_seqlens != nullptr && p.num_seqs == 0) return false;
  if (p.cu_seqlens != nullptr) {
    int64_t lo = 0, hi = p.num_seqs - 1;  // largest n with s(n) <= r
    while (lo < hi) {
      const int64_t mid = (lo + hi + 1) / 2;
      if (cu_at(p, mid) / blk + mid <= r) lo = mid;
      else hi = mid - 1;
    }
    n = lo;
    j = r - (cu_at(p, n) / blk + n);
  }
  out.n = n;
  out.s = sequence(p, n);
  const int64_t len = keys ? out.s.Lk : out.s.Lq;
  const int64_t nb = (len + blk - 1) / blk;
  if (j < 0 || j >= nb) return false;  // j < 0: r below s(0) (cu[0] > 0) or bad offsets
  out.start = (reverse ? nb - 1 - j : j) * blk;
  return true;
}

// Keys of a block of n a row sees, from its key_end minus the block start, clamped to [0, n].
__device__ __forceinline__ int block_limit(int64_t e, int n) {
  return e < 0 ? 0 : (e > n ? n : static_cast<int>(e));
}

// lse / D element of query i (within the sequence) of head h: [B, H, Tq] layout.
__device__ __forceinline__ int64_t row_index(const SoftmaxAttnParams& p, const Seq& s, int64_t h, int64_t i) {
  return (s.b * p.num_heads + h) * p.seqlen_q + s.q0 + i;
}

// ---- non-finite values in the tensor-core kernels ------------------------------------------------
// The tensor-core kernels set a masked score's P to 0 and then multiply the whole block's rows by
// it, so a NaN or Inf in a later key's k or v (0 * NaN = NaN), or in an earlier query's q or o in
// the dk/dv kernel, would reach rows that do not depend on it. The generic kernels are causal by
// construction: each row sums only over the rows it sees (a compare per row, not a multiply by
// 0). A row so reached is not finite, so each tensor-core kernel notes a unit whose rows it wrote
// are not finite (stage_acc's check, one FFMA per element) in flags cleared on the call's stream
// first; the generic kernels then run for the same call and write every output of a flagged unit
// again, exactly, and return at once for every other. The unit is a (sequence, query head) in the
// forward (o, lse) and a (sequence, kv head) in the backward, whose dk, dv sum over the group's
// query heads: the generic kernels overwrite dq of each of its heads and dk, dv of the kv head
// (no atomics, nothing accumulates into memory). Flags: plan::{fwd,bwd}_flag_count.
__device__ __forceinline__ void note_nonfinite(unsigned* flags, int64_t unit, bool bad) {
  if (bad) atomicOr(flags + unit, 1u);
}
// Whether a generic kernel's block has work: always in a generic call (no flags), only for a
// flagged unit when it repairs a tensor-core call.
__device__ __forceinline__ bool generic_block_runs(const unsigned* flags, int64_t unit) {
  return flags == nullptr || flags[unit] != 0u;
}

// ---- warp reductions ----------------------------------------------------------------------------
template <class A>
__device__ __forceinline__ A warp_sum(A x) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}
template <class A>
__device__ __forceinline__ A warp_max(A x) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) x = fmax(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

template <class A>
__device__ __forceinline__ A neg_inf() {
  return -INFINITY;
}

// 2^x on the SFU (ex2.approx, ~2 ulp); 2^-inf = 0.
__device__ __forceinline__ float exp2_fast(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// ---- tokens no sequence covers -------------------------------------------------------------------
// cu_seqlens stays on the device (reading it back would be a host sync), so a launcher cannot know
// which tokens bad offsets leave out. This kernel runs before the attention kernels and writes the
// result of a query with no key (o = 0, lse = -inf) or the zero gradient (dq, dk, dv) to every token
// that may be left out: [0, cu[0]) and [cu[N], T) with the clamped offsets, or all T tokens when
// they decrease somewhere (then blocks may miss parts of sequences and sequences may overlap). The
// attention kernels overwrite what their blocks cover afterwards (stream order), so every element
// is written. Well-formed offsets (cu[0] = 0, non-decreasing, cu[N] = T) write nothing: each
// block reads cu_seqlens once and returns. B == 1 with cu_seqlens.
constexpr int kFillThreads = 256, kFillMaxBlocks = 256;

template <class T>
__device__ __forceinline__ void fill_rows(const MutView& v, int64_t heads, int64_t cols, int64_t lo, int64_t hi,
                                          int64_t T_len, T value) {
  const int64_t n = (lo + T_len - hi) * heads * cols, stride = int64_t(gridDim.x) * kFillThreads;
  for (int64_t e = int64_t(blockIdx.x) * kFillThreads + threadIdx.x; e < n; e += stride) {
    const int64_t c = e % cols, h = (e / cols) % heads, u = e / (cols * heads);
    row<T>(v, 0, u < lo ? u : hi + (u - lo), h)[c] = value;
  }
}

// bwd = false: o and lse (forward); bwd = true: dq, dk and dv.
template <class T>
__global__ void __launch_bounds__(kFillThreads) fill_uncovered_kernel(const SoftmaxAttnParams p, bool bwd) {
  using A = typename AccOf<T>::type;
  const int64_t T_len = p.seqlen_q;
  bool bad = false;
  for (int64_t n = threadIdx.x; n < p.num_seqs; n += kFillThreads) bad |= cu_at(p, n + 1) < cu_at(p, n);
  bad = __syncthreads_or(bad);
  const int64_t lo = bad ? T_len : cu_at(p, 0), hi = bad ? T_len : cu_at(p, p.num_seqs);
  if (lo == 0 && hi == T_len) return;
  const T zero = from_acc<T, A>(A(0));
  if (!bwd) {
    fill_rows<T>(p.o, p.num_heads, p.head_dim_v, lo, hi, T_len, zero);
    const MutView lse{p.lse, 0, 1, T_len};  // [1, H, T]: token stride 1, head stride T
    fill_rows<A>(lse, p.num_heads, 1, lo, hi, T_len, neg_inf<A>());
  } else {
    fill_rows<T>(p.dq, p.num_heads, p.head_dim, lo, hi, T_len, zero);
    fill_rows<T>(p.dk, p.num_kv_heads, p.head_dim, lo, hi, T_len, zero);
    fill_rows<T>(p.dv, p.num_kv_heads, p.head_dim_v, lo, hi, T_len, zero);
  }
}

// ---- tile copies (cp.async helpers in mma.cuh) ----------------------------------------------------
// rows x D tile of a [B, T, H, D] view (token t0 + r, head h) into shared memory (row pitch P
// elements); rows >= valid are zero-filled. D % 8 == 0 and 16-byte aligned rows. THREADS divides
// the chunk count, so every loop below has a compile-time trip count (fully unrolled).
template <int ROWS, int D, int P, int THREADS, class T>
__device__ __forceinline__ void load_tile_async(T* dst, const ConstView& v, int64_t b, int64_t t0, int64_t h,
                                                int64_t valid, int tid) {
  constexpr int kChunks = D / 8, kPer = ROWS * kChunks / THREADS;
  static_assert(ROWS * kChunks % THREADS == 0, "threads must divide the tile's 16-byte chunks");
  const int col = (tid % kChunks) * 8, r0 = tid / kChunks;
  const T* base = static_cast<const T*>(v.data) + b * v.stride_b + (t0 + r0) * v.stride_t + h * v.stride_h + col;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int r = r0 + i * (THREADS / kChunks);
    const bool ok = r < valid;
    cp_async16(dst + r * P + col, ok ? base + int64_t(i) * (THREADS / kChunks) * v.stride_t : static_cast<const T*>(v.data), ok);
  }
}

// Stores rows [0, valid) of a ROWS x D shared tile (pitch P) to a view with 16-byte vectors.
template <int ROWS, int D, int P, int THREADS, class T>
__device__ __forceinline__ void store_tile(const T* src, const MutView& v, int64_t b, int64_t t0, int64_t h,
                                           int64_t valid, int tid) {
  constexpr int kChunks = D / 8, kPer = ROWS * kChunks / THREADS;
  static_assert(ROWS * kChunks % THREADS == 0, "threads must divide the tile's 16-byte chunks");
  const int col = (tid % kChunks) * 8, r0 = tid / kChunks;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int r = r0 + i * (THREADS / kChunks);
    if (r < valid)
      *reinterpret_cast<uint4*>(row<T>(v, b, t0 + r, h) + col) = *reinterpret_cast<const uint4*>(src + r * P + col);
  }
}

// ---- tensor-core fragments ----------------------------------------------------------------------
// ldmatrix x4 at shared-space byte addresses: each lane supplies one row address of one of the
// four 8 x 8 matrices (lanes 8i..8i+7: matrix i). Callers add a per-lane offset once
// (lane_off_a / lane_off_b, in elements) to the tile's shared address, then compile-time
// offsets, so the instructions use immediate offsets instead of one register per address.
//
// lane_off_a, for a tile stored [row][col] (pitch P):
//   ldsm   -> the A operand at rows [r0, r0+16), columns [c0, c0+16): a0..a3
//   ldsm_t -> the B operands of n-tiles [n0, n0+8), [n0+8, n0+16) over k in [k0, k0+16) from a
//             tile stored [k][n] (e.g. V rows for O = P V): r0, r1 for n0; r2, r3 for n0+8
// lane_off_b, for a tile stored [n][k] (row n holds B's column n, e.g. K rows for S = Q Kᵀ):
//   ldsm   -> the same B operands: r0, r1 for n-tile n0; r2, r3 for n0+8
__device__ __forceinline__ int lane_off_a(int lane, int P) {
  return ((lane & 7) + ((lane >> 3) & 1) * 8) * P + (lane >> 4) * 8;
}
__device__ __forceinline__ int lane_off_b(int lane, int P) {
  return ((lane & 7) + (lane >> 4) * 8) * P + ((lane >> 3) & 1) * 8;
}

__device__ __forceinline__ void ldsm(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldsm_t(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// Byte offset of element (row, col) in a 2-byte tile of pitch P.
__host__ __device__ constexpr uint32_t at2(int row, int col, int P) { return 2u * static_cast<uint32_t>(row * P + col); }

// c = 0 for N accumulator tiles.
template <int N>
__device__ __forceinline__ void zero(float (&c)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) c[i][e] = 0.f;
}

// ---- warp products on tensor cores ---------------------------------------------------------------
// The products of one warp's 16 rows, shared by the forward and both backward kernels. Tiles have
// pitch P; addresses are shared-space bytes with the lane offset (lane_off_a / lane_off_b) already
// added, so every ldmatrix below uses an immediate offset. The helpers issue the same instructions
// in the same order as the loops they replaced (same SASS).

// c0, c1 += a * the two n-tiles of one 16 x 16 block of B: ldmatrix at b (lane_off_b, B stored
// [n][k]) or, with TRANS, ldmatrix.trans (lane_off_a, B stored [k][n]).
template <class T, bool TRANS>
__device__ __forceinline__ void mma_block16(float (&c0)[4], float (&c1)[4], const uint32_t (&a)[4], uint32_t b) {
  uint32_t r[4];
  if constexpr (TRANS) ldsm_t(r, b);
  else ldsm(r, b);
  mma16816<T>(c0, a, r[0], r[1]);
  mma16816<T>(c1, a, r[2], r[3]);
}

// S = X Yᵀ: X a 16 x K tile at x (lane_off_a), Y an N x K tile stored [n][k] at y (lane_off_b).
// The forward's score block Q Kᵀ.
template <class T, int K, int N, int P>
__device__ __forceinline__ void mma_xyt(float (&s)[N / 8][4], uint32_t x, uint32_t y) {
  zero(s);
#pragma unroll
  for (int kk = 0; kk < K / 16; ++kk) {
    uint32_t a[4];
    ldsm(a, x + at2(0, kk * 16, P));
#pragma unroll
    for (int nn = 0; nn < N / 16; ++nn)
      mma_block16<T, false>(s[2 * nn], s[2 * nn + 1], a, y + at2(nn * 16, kk * 16, P));
  }
}

// Two such products in one k loop, 16 columns of each in turn: S = X1 Y1ᵀ and dP = X2 Y2ᵀ, as both
// backward kernels recompute S = Q Kᵀ with dP = dO Vᵀ (the dk/dv kernel their transposes).
template <class T, int K, int N, int P>
__device__ __forceinline__ void mma_xyt2(float (&s)[N / 8][4], uint32_t x1, uint32_t y1, float (&dp)[N / 8][4],
                                         uint32_t x2, uint32_t y2) {
  zero(s);
  zero(dp);
#pragma unroll
  for (int kk = 0; kk < K / 16; ++kk) {
    uint32_t a1[4], a2[4];
    ldsm(a1, x1 + at2(0, kk * 16, P));
    ldsm(a2, x2 + at2(0, kk * 16, P));
#pragma unroll
    for (int nn = 0; nn < N / 16; ++nn) {
      mma_block16<T, false>(s[2 * nn], s[2 * nn + 1], a1, y1 + at2(nn * 16, kk * 16, P));
      mma_block16<T, false>(dp[2 * nn], dp[2 * nn + 1], a2, y2 + at2(nn * 16, kk * 16, P));
    }
  }
}

// C += X Y: X the accumulators of a 16 x N product (re-packed as A operands: one mma's result
// feeds the next without shared memory), Y an N x M tile stored [n][m] at y (lane_off_a). The
// forward's O += P V and the dq kernel's dQ += dS K.
template <class T, int N, int M, int P>
__device__ __forceinline__ void mma_cy(float (&c)[M / 8][4], const float (&x)[N / 8][4], uint32_t y) {
#pragma unroll
  for (int kj = 0; kj < N / 16; ++kj) {
    uint32_t a[4];
    c_to_a<T>(a, x[2 * kj], x[2 * kj + 1]);
#pragma unroll
    for (int dn = 0; dn < M / 16; ++dn)
      mma_block16<T, true>(c[2 * dn], c[2 * dn + 1], a, y + at2(kj * 16, dn * 16, P));
  }
}

// Writes accumulators c[N/8][4] of a warp's 16 rows (scaled by f[row half]) into a shared tile
// at rows [r0, r0+16) as T (pitch P), for a coalesced store_tile afterwards. Returns whether a
// value of the warp's rows [0, valid) (the rows stored) is not finite (note_nonfinite): x * 0 is 0
// for a finite x and NaN otherwise, one FFMA per element into a sum per row.
template <class T, int N>
__device__ __forceinline__ bool stage_acc(T* tile, int P, int r0, const float (&c)[N / 8][4], const float (&f)[2],
                                          int lane, int64_t valid) {
  const int g = lane >> 2, t2 = (lane & 3) * 2;
  float finite[2] = {0.f, 0.f};  // rows g and g + 8: 0 while every value is finite
#pragma unroll
  for (int ni = 0; ni < N / 8; ++ni)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float x0 = c[ni][2 * h] * f[h], x1 = c[ni][2 * h + 1] * f[h];
      finite[h] = fmaf(x1, 0.f, fmaf(x0, 0.f, finite[h]));
      *reinterpret_cast<uint32_t*>(tile + (r0 + g + 8 * h) * P + ni * 8 + t2) = pack2<T>(x0, x1);
    }
  return (g < valid && finite[0] != 0.f) || (g + 8 < valid && finite[1] != 0.f);
}

// 16-byte alignment of every row of a view of 2-byte elements (cp.async / vector stores).
template <class View>
inline bool rows16(const View& x, int elem_bytes) {
  const int64_t per = 16 / elem_bytes;
  return reinterpret_cast<uintptr_t>(x.data) % 16 == 0 && x.stride_b % per == 0 && x.stride_t % per == 0 &&
         x.stride_h % per == 0;
}

}  // namespace attnrnn::cuda::sm
