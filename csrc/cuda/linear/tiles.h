// The tile table of the linear-attention chunk kernels, and the shape rules the plan (plan.cu)
// applies with it: every size a kernel is built with and every rule that picks a kernel or a split,
// each with the measurement that chose it (kernel times of one call on an H200, bf16, unless named).
// A new head dim or dtype is a new entry here and a template argument of the kernels.
#pragma once

#include <algorithm>
#include <cstdint>

namespace attnrnn::cuda {

// ---- every tensor-core scan ------------------------------------------------------------------------
// 64 tokens per chunk: the masked intra-chunk product P = mask(A B^T) is one m64 wgmma (four m16
// mma.sync row blocks); one warpgroup per block.
constexpr int kChunk = 64;
constexpr int kScanThreads = 128;

// mma.sync scan (scan_mma.cuh), inner dim DI, the state slice [DI][columns] in fp32 registers:
// - 32 columns at DI = 128 halve the state and output registers (~250 -> ~170), so 2 blocks fit per
//   SM: forward at B4-T8192-H16-D128 677 -> 562 us;
// - 3 blocks per SM at DI = 64 (73 KB, <= 168 registers), 2 at 128: ncu finds the scan latency bound
//   (stall_wait on the mma chains 31-45%), and more resident warps hide it;
// - 2 cp.async stages: 3 cost the third block per SM;
// - every layout takes at most 99,840 bytes (bf16/fp16 at DI = 128), within the 101,376 a block may
//   take on sm_86 and sm_89 (MmaLayout keeps the state's hi and lo parts in one padded row for it).
// kFp32 (fp32 operands on TF32 mma): tiles of 4-byte elements, 32 columns at both inner dims, so that
// two blocks fit per SM: at DI = 64 with 2 stages (96 KiB each), at DI = 128 with 1 (93 KiB; 2 stages
// take 174 KiB and leave one block of 4 warps per SM, one warp per scheduler to carry every latency).
// Together with rounding the tiles to TF32 once, where they land, instead of at every fragment load:
// forward+backward at B4-T8192-H16-K128 unnormalized on an H100, 8.77 -> 5.22 ms at "high" and
// 27.5 -> 18.0 at "highest".
// TF32 alone at DI = 64 fits three blocks per SM with 1 stage (~53 KiB, 149-164 registers), but lost
// to two blocks of 2 stages: forward+backward at "high", B4-T8192 on an H100, K = V = 64 (H16)
// 2.43 -> 2.86 ms unnormalized and 2.95 -> 3.37 normalized, K = V = 32 (H32) 2.50 -> 2.79.
template <int DI, bool kFp32 = false>
struct MmaTiles {
  static constexpr int columns = DI == 128 || kFp32 ? 32 : 64;
  static constexpr int blocks_per_sm = kFp32 || DI == 128 ? 2 : 3;
  static constexpr int stages = kFp32 && DI == 128 ? 1 : 2;
  // a block's pass-1 partial: S [DI][columns], then z on max(DI, columns)
  static constexpr int64_t partial_floats = DI * columns + (DI > columns ? DI : columns);
};

// wgmma scan on 64-token chunks (scan_wgmma.cuh), inner dim DI:
// - 64 output columns: the products are m64n64, and q and k are read once per 64 columns;
// - 3 blocks per SM at DI = 64 (65 KiB, <= 170 registers), 2 at DI = 128 (113 KiB, no slack: one
//   more KiB would leave one block) and for the fused dk + dv sweep at K = V = 64 (81 KiB); 1 at
//   DI = 192 and 256 (the padded inner dims past 128: 162 and 210 KiB, the state alone 96 and 128
//   registers);
// - 2 cp.async stages: the prototype measured 2, 3 and 4 equal.
template <int DI, bool kGradKv = false>
struct WgmmaTiles {
  static constexpr int columns = 64;
  static constexpr int blocks_per_sm = DI == 64 && !kGradKv ? 3 : DI > 128 ? 1 : 2;
  static constexpr int stages = 2;
  // a block's pass-1 partial: S [DI][64], then z on max(DI, 64); the pair and fused sweeps' too
  static constexpr int64_t partial_floats = DI * 64 + (DI > 64 ? DI : 64);
};

// TF32 wgmma scan (scan_wgmma_tf32.cuh): fp32 operands where the call allows TF32, without the
// normalizer, inner dims up to 128 (padded to 64 or 128). 32 output columns per block, so that two
// blocks fit per SM. A prototype of its forward at B4-T8192-H16-K64 on an H100 took 0.362 ms with 32
// columns against 0.502 with 64 (one block of 130 KiB per SM), where the mma.sync sweep took 0.495
// and fla's chunk 0.514 in the same process; truncating the operands instead of rounding them
// (cvt.rna) saved 18% and quadrupled the error (relative RMS 1.8e-4 -> 7.2e-4 against fp64).
// - inner dim 64: 2 cp.async stages, 96 KiB (A, B 16 KiB and Cv 8 KiB per stage, Cv^T and S^T 8 KiB
//   each). At "high" unnormalized K = V = 64 (same shape, one process): forward 0.329 ms (fla 0.480),
//   forward+backward 1.468 (fla 1.733; the mma.sync sweeps took 2.434 against fla's 1.632 in
//   another run).
// - inner dim 128 (K or V from 72 to 128): 1 stage, 96 KiB (A and B 32 KiB, S^T 16 KiB), as the fp32
//   mma.sync sweeps do at DI = 128: the other block runs while one waits for its tiles (2 stages
//   would leave one block per SM). Forward+backward at B4-T8192-H16, one process: K = V = 128 3.770
//   ms, 96 3.560, where the mma.sync sweeps took 4.070 and 3.928 and fla 4.174 and 3.747.
// With the normalizer fp32 stays on mma.sync, which beats fla there (its z sums and the rows' weights
// would need their own TF32 layouts here). Segments: split_segments' half-the-SMs rule.
struct WgmmaTf32Block {  // at both inner dims
  static constexpr int columns = 32, blocks_per_sm = 2;
};
template <int DI>
struct WgmmaTf32Tiles : WgmmaTf32Block {
  static_assert(DI == 64 || DI == 128, "inner dim 64 or 128");
  static constexpr int inner = DI, stages = DI == 64 ? 2 : 1;
  static constexpr int64_t partial_floats = DI * columns;  // a block's pass-1 partial: S [DI][32]
};
// The inner dim of the TF32 wgmma sweeps for a real inner dim (<= 128).
inline int tf32_inner_dim(int64_t inner) { return inner <= 64 ? 64 : 128; }

// wgmma scan on 128-token chunks with two warpgroups (scan_wgmma_pair.cuh), inner dim 128: half the
// steps for ~1.3x the products per step; one block (195.5 KiB) per SM.
struct WgmmaPairTiles {
  static constexpr int chunk = 128, threads = 256, blocks_per_sm = 1;
};

// dk and dv in one sweep at K = V = 128 (grad_kv_wgmma.cuh): two warpgroups hold all of dS; one block
// (208 KiB) per SM.
struct WgmmaGradKvTiles {
  static constexpr int threads = 256, blocks_per_sm = 1;
};

// The generic CUDA-core kernels (generic_forward.cuh, generic_backward.cuh): 256 threads; 64 value
// columns and 32 key rows per block keep them busy for K, V >= 64; the chunk is the largest power of
// two <= the requested one (64 by default) whose tiles fit in shared memory (32 at K = 256 in fp32).
//
// The recurrent form runs them on 16-token chunks (recurrent_chunk), forward and backward: bf16, H16, on an H100
// (bench/recurrent.py), forward+backward at B32-T64-D128 2.65 ms, B4-T1024-D128 8.2, B4-T8192-D128 66,
// where 64-token chunks measured 7.97, 16.6 and 133 (--quick, 3 timings per median). 8 and 32 against
// 16 in one process (times with the host's): 32's forward is 6-9% faster at B4 and 16-21% slower at
// B32, its forward+backward 20-70% slower everywhere; 8's forward+backward is 4-11% faster at B32-T64
// and B4-T16 unnormalized, 4-23% slower elsewhere.
struct GenericTiles {
  static constexpr int threads = 256, value_columns = 64, key_rows = 32, default_chunk = 64;
  static constexpr int recurrent_chunk = 16;
};

// ---- shape rules ----------------------------------------------------------------------------------
// The segment split of a tensor-core sweep of `blocks` (sequence, output tile, kv head) blocks, of
// which `per_sm` fit on an SM: pass 1 sums each segment's state change, pass 2 runs every segment
// from the sums before it. Pass 1 re-reads two operands, so it pays only where few blocks run: a
// split only where the blocks fill at most half the SMs (mma.sync forward at B1-T65536-H16-D128
// 2978 -> 1445 us; at B8-T2048-H16-D64, above the rule, 119 -> 152). Then as many segments as fill
// every block slot once, with at least 16 chunks each: on wgmma, forced 2 to 6 segments were slower
// at every shape, and at B1-T65536 the rule's 8 (641 us) beat 4 or 6 (783-791). The padded DI = 256
// sweeps (one block per SM) too: K = V = 192 (then padded to 256) and 256 at B4-T8192-H8 (96 and 128
// blocks), forced 2 to 8 segments took 3.87-7.62 ms forward+backward unnormalized against 3.44-3.54 unsplit on an H100;
// normalized, all were slower but K = 192's 4, which tied (5.22 against 5.24). The wgmma sweeps of
// three blocks per SM (DI = 64) whose real inner dim is at most 32 split also where their blocks take
// at most one slot of each SM (sparse_slots): half their tiles are zeros, so a step moves half the
// bytes for the same products and more blocks hide its latency. On an H100, forward+backward at
// B4-T8192-H32 (128 blocks, 3 segments against none): K = V = 32 0.917 -> 0.762 ms unnormalized and
// 1.201 -> 1.041 normalized (4 and 6 segments, two waves, were slower); the same split made K = V =
// 64 slower, 0.789 -> 0.883 and 1.050 -> 1.150 (B8-T2048-H16, 2 segments: 0.247 -> 0.266), so the
// exact dims keep the half-the-SMs rule. fp32's mma.sync sweeps (two blocks of 4-byte tiles per SM)
// take the one-slot rule at every dim: unsplit, 128 blocks on an H100's 132 SMs leave each SM one
// block of four warps to hide its steps' latency. Forward+backward at B4-T8192 on an H100 (2
// segments against none, one process): "high" with the normalizer K = V = 64 (H16, 128 blocks)
// 2.940 -> 2.497 ms and K = V = 32 (H32) 2.999 -> 2.526; "highest" K = V = 64 3.695 -> 3.430
// unnormalized and 4.114 -> 3.892 normalized. 3 segments were slower than none (3.260, 4.123 and
// 4.694 ms).
// `forced` > 0 replaces the slot count (testing::PlanOverride).
inline int split_segments(int64_t blocks, int per_sm, int64_t seqlen, int sm_count, int forced,
                          bool sparse_slots = false) {
  const int64_t slots = int64_t(sm_count) * per_sm;
  const int64_t chunks = (seqlen + kChunk - 1) / kChunk;
  const bool few = 2 * blocks <= sm_count || (sparse_slots && blocks <= sm_count);
  int64_t want = forced > 0 ? forced : (few ? slots / std::max<int64_t>(blocks, 1) : 1);
  want = std::min<int64_t>(want, std::max<int64_t>(1, chunks / 16));
  const int64_t seg_chunks = (chunks + want - 1) / std::max<int64_t>(want, 1);
  return static_cast<int>(seg_chunks > 0 ? (chunks + seg_chunks - 1) / seg_chunks : 1);
}

// Whether a wgmma sweep with inner dim 128 runs on 128-token chunks (WgmmaPairTiles) rather than 64:
// where the 64-token sweep would run one wave of one warpgroup per SM without a split. There (B3-T16384
// and B4-T8192, H16, D128: 96 and 128 blocks) the pair takes 18-24% less time; at 32-64 blocks (split,
// two 64-token blocks per SM) and at 192-512 blocks 6-16% more. The normalized bf16 forward pairs
// inside a split too: its normalizer costs the 64-token kernel ~145 us at B1-T65536-H16-D128 and the
// pair's ~60 (an m64n8 wgmma), so the pair takes 796 -> 719 us there, 775 -> 708 at B2-T32768-H16 and
// 835 -> 725 at B1-T131072-H8. Unnormalized it stays on the rule (paired 651 -> 658, 628 -> 652,
// 688 -> 659 us), and so does fp16, whose pair forward takes a . z in fp32 FMAs (845 -> 843 and
// 826 -> 839 us with normalize).
inline bool pairs_sweep(bool forward, bool normalize, bool bf16, int64_t blocks, int segments_64, int sm_count) {
  const bool one_wave = blocks <= sm_count;
  if (forward && normalize && bf16) return one_wave;
  return one_wave && segments_64 == 1;
}

// Head dims other than K in {64, 128} (and V in {64, 128} in the backward, V % 64 == 0 in the forward)
// run on the 64-token tensor-core sweeps with their tiles padded: zeros loaded past the real columns
// (DI: the least of 64, 128, 192 and 256 that holds the inner dim; output dims in 64-column tiles on
// wgmma, 32 or 64 on mma.sync (MmaTiles::columns), the last one partly written). The zeros add
// nothing to any product, so the sums are those of the real dims. K any multiple of 8 (cp.async's
// 16-byte pieces) up to the largest inner dim of the sweeps, 256 on wgmma and 128 on mma.sync (every
// GPU, and fp32 on sm_90a too); V the same in the backward and any multiple of 8 in the forward, whose
// output tiles are independent. Past that, the generic kernels.
// Forward+backward at B4-T8192 on an H100 against fla's chunk: K = V = 32 (H32) and 96 (H16) 1.7-3.3x
// fla at 23-35% of the memory floor. DI = 192 exists for the state's registers: K = V = 192 (H8, 96
// blocks of one warpgroup per SM) padded to 256 took 3.78 / 5.52 ms unnormalized / normalized, its
// sweeps at 255 registers spilling 300-700 bytes; on DI = 192 (0-124 bytes) 1.47 / 2.17 ms
// (bench/results/head_dims_h100.json).
inline bool padded_dims(int64_t K, int64_t V, bool backward, bool wgmma) {
  const int64_t largest = wgmma ? 256 : 128;
  const bool k = K > 0 && K <= largest && K % 8 == 0;
  const bool v = V > 0 && V % 8 == 0 && (!backward || V <= largest);
  return k && v;
}
// The padded sweeps' inner dim DI for a real inner dim.
inline int padded_inner_dim(int64_t inner) { return inner <= 64 ? 64 : inner <= 128 ? 128 : inner <= 192 ? 192 : 256; }

// dk and dv at K = V = 128 without the normalizer as one sweep of two warpgroups (WgmmaGradKvTiles)
// that reads q, k, v and dout once for both (six tensors of traffic for eight): where its (sequence,
// kv head) blocks split, i.e. fill at most half the SMs.
inline bool fuses_grad_kv_128(int segments) { return segments > 1; }

}  // namespace attnrnn::cuda
