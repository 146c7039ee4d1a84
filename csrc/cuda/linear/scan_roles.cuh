// What the tensor-core chunk scans (scan_mma.cuh, scan_wgmma.cuh, scan_wgmma_pair.cuh) share: the
// operands of each role, the mma.sync scan's shared-memory layout, how phi reaches the sweeps, and
// the segment split of the two-pass scan.
#pragma once

#include "args.cuh"
#include "tiles.h"

namespace attnrnn::cuda {

// kGradKV: dk and dv in one reverse sweep (scan_wgmma.cuh only; its state is dv's, dk reads it
// transposed)
enum class ScanRole : int { kForward, kGradQ, kGradK, kGradV, kGradKV };
enum class Operand : int { kQ, kK, kV, kDout, kNone };

// normalize as a wgmma kernel sees it: false in the sweeps compiled without the normalizer
// (WithNormalizer: forward.cuh and backward.cuh launch one of each); read from p at each use,
// since as one register it would stay live through the steps.
template <bool WithNormalizer>
__device__ __forceinline__ bool normalizes(const ChunkArgs& p) {
  return WithNormalizer && p.normalize;
}

template <ScanRole R>
struct RoleInfo {
  static constexpr bool dv_like = R == ScanRole::kGradV || R == ScanRole::kGradKV;  // A = K, B = Q, Cv = dout
  static constexpr Operand a = R == ScanRole::kGradQ ? Operand::kDout : R == ScanRole::kGradK ? Operand::kV
                             : dv_like ? Operand::kK : Operand::kQ;
  static constexpr Operand b = R == ScanRole::kGradQ ? Operand::kV : R == ScanRole::kGradK ? Operand::kDout
                             : dv_like ? Operand::kQ : Operand::kK;
  static constexpr Operand c = R == ScanRole::kForward ? Operand::kV : R == ScanRole::kGradQ ? Operand::kK
                             : R == ScanRole::kGradK ? Operand::kQ : dv_like ? Operand::kDout : Operand::kNone;
  static constexpr bool reverse = R == ScanRole::kGradK || dv_like;
  // Transposed roles hold S^T / dS^T: state element (d, c) is matrix element (c, d) of [K][V].
  static constexpr bool transposed = R == ScanRole::kGradQ || R == ScanRole::kGradK;
  // dk and dv sum over the query heads of a group; the others write one output per query head.
  static constexpr bool group_sum = reverse;
};

// Shared memory of one block of the mma.sync scan with operands of type T (element offsets into the
// T region, then floats).
template <class T, int DI>
struct MmaLayout {
  static constexpr bool fp32 = sizeof(T) == 4;
  using Tiles = MmaTiles<DI, fp32>;
  static constexpr int NS = Tiles::stages;             // pipeline stages
  static constexpr int min_blocks = Tiles::blocks_per_sm;
  static constexpr int NC = Tiles::columns;            // output columns per block
  // Row strides, for conflict-free shared reads. 16-bit: +8 keeps ldmatrix conflict free. fp32:
  // ldmatrix of 16-byte row pieces (A, B, the transposed state) wants a stride of 4 words mod 32, and
  // so do the word-per-lane reads of rows 2t and 2t + 1 of B and Cv (MmaStep<float>: 8t + g).
  static constexpr int LI = fp32 ? DI + 4 : DI + 8, LC = fp32 ? NC + 4 : NC + 8;
  // The state as the product A S reads it: bf16/fp16 row-major in hi + lo parts (~16 mantissa bits),
  // the two side by side in each row ([DI][LS], hi in columns [0, NC), lo in [NC, 2 NC)), so that
  // one row pad serves both: 2 KiB less than two padded arrays, which brings DI = 128 under the
  // 99 KiB a block may take on sm_86 and sm_89; fp32 whole and transposed, [NC][LI], for ldmatrix
  // (TF32 alone: rounded to TF32 as it is published; 3xTF32: split by MmaStep as it is read).
  static constexpr int state_parts = fp32 ? 1 : 2;
  static constexpr bool state_transposed = fp32;
  static constexpr int LS = fp32 ? LI : 2 * NC + 8;        // the state's row stride
  static constexpr int A = 0;                         // [64][LI]  row operand
  static constexpr int B = A + kChunk * LI;         // [64][LI]  column operand
  static constexpr int C = B + kChunk * LI;         // [64][LC]  value operand
  static constexpr int stage = C + kChunk * LC;     // one pipeline stage (T elements)
  static constexpr int Sh = NS * stage;               // [DI][LS] state (hi), fp32 [NC][LI]
  static constexpr int Sl = Sh + NC;                  // state lo, beside hi in each row (16-bit T only)
  static constexpr int t_elems = Sh + (fp32 ? NC * LI : DI * LS);
  // floats after the T region: per stage w[64], dd[64]; then z[max(DI, 64)]
  static constexpr int w = 0, dd = kChunk, f_stage = 2 * kChunk, z = NS * f_stage;
  static constexpr int f_elems = z + (DI > NC ? DI : NC);
  static constexpr int64_t bytes = int64_t(t_elems) * sizeof(T) + int64_t(f_elems) * 4;
};

// A feature map's phi(q) and phi(k), in one of two ways (neither with the identity map; plan.h's
// Features):
// - q, k: written once per call into the workspace by the feature pass (features.cuh; views with
//   null data otherwise) and read by the sweeps as their q and k.
// - relu_in_sweep: with relu, the wgmma sweeps read raw q and k and apply it in place to the pieces
//   of their tiles that each thread copied itself, after its cp.async wait and before the step's one
//   barrier (wg_relu_rows): no pass over the tensors and no barrier of its own. elu1 keeps the pass:
//   its exp there, on the step's chain, made the sweeps slower than the pass (features.cuh).
//   mma_scan_kernel can still transform its tiles itself (tc_transform_tile, q.data null), which no
//   plan asks of it.
struct ScanFeatures {
  ConstView q, k;
  bool relu_in_sweep = false;
};

// The rows the backward's epilogues take phi' from (wg_write_rows, mma_scan_kernel's): phi(x) where
// the feature pass wrote it, which a feature map other than relu in the wgmma sweeps always has
// there, else the raw input x (relu applied in the sweeps, whose phi' reads alike from either).
__device__ __forceinline__ ConstView dphi_rows(const ConstView phi, const ConstView raw) {
  return phi.data != nullptr ? phi : raw;
}

// Whether a wgmma sweep applies relu to its tiles of source s itself.
__device__ __forceinline__ bool relu_in_sweep(const ScanFeatures& f, Operand s) {
  return (s == Operand::kQ || s == Operand::kK) && f.relu_in_sweep;
}

// By value: a reference into the kernel parameters would make the compiler copy them to memory.
__device__ __forceinline__ ConstView tc_view(const ChunkArgs& p, const ScanFeatures& f, Operand s) {
  if (s == Operand::kQ) return f.q.data != nullptr ? f.q : p.q;
  if (s == Operand::kK) return f.k.data != nullptr ? f.k : p.k;
  return s == Operand::kV ? p.v : p.dout;
}
__device__ __forceinline__ bool per_query_head(Operand s) { return s == Operand::kQ || s == Operand::kDout; }
// The columns of source s's rows: K for q and k, V for v and dout.
__device__ __forceinline__ int operand_dim(Operand s, int64_t K, int64_t V) {
  return static_cast<int>(s == Operand::kQ || s == Operand::kK ? K : V);
}

// Two-pass scan over segments of the sequences, for shapes whose (sequence, tile, kv head) blocks do
// not fill the GPU: pass 1 (state_only) sums each segment's change of the state (and z) into
// `partial`; pass 2 starts every segment from the initial state plus the partials of the segments
// before it in sweep order. segments == 1 is the plain one-pass sweep.
struct SegmentSplit {
  int segments = 1;
  int seg_chunks = 1 << 30;  // chunks per segment, in sweep order
  bool state_only = false;
  float* partial = nullptr;  // [segments][N][Hkv][tiles][tc_partial_floats] (wgmma: WgmmaLayout's)
  // dv's pass 1 on segment_state_kernel (unnormalized, K = V = 128) also writes its states
  // transposed here, in the same layout: dk's partials, whose own pass 1 is then skipped
  // (GradKv::kSharedFirstPass). The forward's writes dq's into the saved buffer (plan.h).
  float* partial_t = nullptr;

  // Segment j's partial of the block of sequence n, kv head g and output tile `tile` of `tiles`, in
  // run_sweep's grid (sequences x segments x tiles, kv heads): where pass 1 writes it and pass 2
  // reads it. partial_in: the same place in another buffer of this layout (partial_t).
  __device__ __forceinline__ float* partial_in(float* base, int j, int64_t n, int64_t g, int64_t Hkv, int tiles,
                                               int tile, int64_t floats) const {
    const int64_t N = gridDim.x / tiles / segments;
    return base + (((int64_t(j) * N + n) * Hkv + g) * tiles + tile) * floats;
  }
  __device__ __forceinline__ float* partial_at(int j, int64_t n, int64_t g, int64_t Hkv, int tiles, int tile,
                                               int64_t floats) const {
    return partial_in(partial, j, n, g, Hkv, tiles, tile, floats);
  }
};

// A sweep's output dim (the columns its blocks tile) and inner dim (the state's rows): the forward
// and dv (and the fused dk + dv) write V columns over K, dq and dk K columns over V.
template <ScanRole R>
__host__ __device__ inline int64_t sweep_output_dim(const LinearAttnFwdParams& p) {
  return R == ScanRole::kGradQ || R == ScanRole::kGradK ? p.head_dim_k : p.head_dim_v;
}
template <ScanRole R>
__host__ __device__ inline int64_t sweep_inner_dim(const LinearAttnFwdParams& p) {
  return R == ScanRole::kGradQ || R == ScanRole::kGradK ? p.head_dim_v : p.head_dim_k;
}
// Output tiles of `columns` columns over `out_cols` (kPadded: the last one partly written).
template <bool kPadded>
__host__ __device__ inline int sweep_tiles(int64_t out_cols, int columns) {
  return static_cast<int>(kPadded ? (out_cols + columns - 1) / columns : out_cols / columns);
}

// A block's place in run_sweep's grid (sequences x segments x tiles, kv heads): blockIdx.x =
// (n * segments + seg) * tiles + tile, so the tiles of one (sequence, segment) are neighbours and the
// rows they all read come from L2 after the first; blockIdx.y = g.
struct SweepBlock {
  int tile, seg;  // output tile, segment
  int64_t n, g;   // sequence, kv head
};
__device__ __forceinline__ SweepBlock sweep_block(int tiles, int segments) {
  SweepBlock b;
  b.tile = blockIdx.x % tiles;
  b.n = blockIdx.x / tiles / segments;
  b.g = blockIdx.y;
  b.seg = (blockIdx.x / tiles) % segments;
  return b;
}

// Output column tiles of a sweep of the mma.sync scan.
template <class T, ScanRole R, int DI, bool kPadded = false>
__host__ __device__ inline int tc_tiles(const LinearAttnFwdParams& p) {
  return sweep_tiles<kPadded>(sweep_output_dim<R>(p), MmaLayout<T, DI>::NC);
}

template <class T, int DI>
constexpr int64_t tc_partial_floats() {
  return MmaLayout<T, DI>::Tiles::partial_floats;
}

// The state a sweep block starts from: S0 (or zeros; S0 is null in pass 1 of a split), plus the pass-1
// partials of the segments before this one ([d][c] rows of `cols` floats). for_each_state(f) calls
// f(x, d, c) on each state element the thread holds, unrolled; the loop over segments stays outside
// it: a runtime loop inside every unrolled element spread the prologue over ~200 KB of code, and its
// instruction-cache misses cost the 64-token forward ~5% (ncu's no_inst stalls).
template <class ForEachState, class MatIndex, class PartialAt>
__device__ __forceinline__ void load_initial_state(const ForEachState& for_each_state, const float* S0,
                                                   const MatIndex& mat_index, const PartialAt& partial_at,
                                                   int earlier, int cols) {
  if (S0 != nullptr) {
    for_each_state([&](float& x, int d, int c) { x = S0[mat_index(d, c)]; });
  } else {
    for_each_state([](float& x, int, int) { x = 0.f; });
  }
  for (int j = 0; j < earlier; ++j) {
    const float* part = partial_at(j);
    for_each_state([&](float& x, int d, int c) { x += part[d * cols + c]; });
  }
}

}  // namespace attnrnn::cuda
