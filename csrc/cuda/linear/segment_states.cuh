// Pass 1 of a split wgmma sweep: the change of the state over one segment,
//   S_seg [DI x 64] = sum_t B_t^T Cv_t     forward: B = phi(k), Cv = v;   dq: B = v, Cv = phi(k)
//                                          dk: B = dout, Cv = phi(q);     dv: B = phi(q), Cv = dout
//   z_seg           = sum_t colsum         normalize: the forward's over B's DI dims, dq's over Cv's
//                                          64 columns
// written where pass 2 reads it (wgmma_scan_kernel or wgmma_pair_scan_kernel with the same grid and the
// same partial layout). As its own pass 1, the sweep's kernel kept its two-stage pipeline and its
// shared memory for A and the state tiles: one stage of loads in flight per step, ~73% of the copy
// rate at B1-T65536-H16-D128. This kernel reads only B and Cv, through SegmentStateLayout's stages. H200
// there (docs/design.md, "What would get there" item 7): 131 us (4.1 TB/s of DRAM), 134 with z on
// m64n8 wgmmas (160 with mma.sync column sums after the products); the forward 650 -> 606 us, 719 ->
// 669 with normalize. dk and dv (reverse sweeps, summing over a group's query heads, rows times w as
// their sweeps weigh them): 132-134 us each, the sweeps 714 -> 642 and 712 -> 641 us there; with the
// normalizer 204 (dk, with dz) and 162 us (dv), the sweeps 948-956 -> 862 and 818-822 -> 713 us.
#pragma once

#include "scan_roles.cuh"
#include "wgmma_tiles.cuh"
#include "../common/wgmma.cuh"
#include "wgmma_normalizer.cuh"

namespace attnrnn::cuda {

// Shared memory of the state pass: per stage the B tiles [KT][64 tokens][64] and the Cv tile, then
// the tile of ones [8][64] (z's column sums are products with it). With RowWeights (dk and dv with the
// normalizer) also per stage each thread's w of the 4 rows it copies [128][4] (cp.async with the
// tiles: read from global memory inside the step, they made dv's state pass 266 us against 133
// without the normalizer at B1-T65536-H16-D128) and dk's dd [64], then dk's dz [64].
// BlocksPerSm: the blocks per SM that pass 2's segment split assumes (the 64-token pass 2: its
// min_blocks; the 128-token pass 2: one), which this kernel runs too; it takes as many stages as fit
// beside them: 4 at DI = 128 and 64 (two and three blocks per SM), 9 at DI = 128 with one block (8
// with RowWeights).
template <int DI, int BlocksPerSm, bool RowWeights = false>
struct SegmentStateLayout {
  static constexpr int KT = DI / 64;
  static constexpr int stage = (KT + 1) * kWgTileBytes;  // 24 KiB at DI = 128, 16 KiB at DI = 64
  static constexpr int z_floats = WgmmaLayout<DI>::z_floats;
  static constexpr int min_blocks = BlocksPerSm;
  static constexpr int ones_bytes = 1024;
  static constexpr int w_floats = RowWeights ? kScanThreads * 4 : 0, dd_floats = RowWeights ? kChunk : 0;
  static constexpr int dz_bytes = RowWeights ? 64 * 4 : 0;
  static constexpr int stage_extra = (w_floats + dd_floats) * 4;  // floats of a stage, after the ones
  static constexpr int stages =
      static_cast<int>((228 * 1024 / BlocksPerSm - 1024 - ones_bytes - dz_bytes) / (stage + stage_extra));
  static constexpr int w = 0, dd = stages * w_floats, dz = dd + stages * dd_floats;  // floats after the ones
  // 97 / 217 / 65 KiB (106 / 211 / 74 with RowWeights)
  static constexpr int64_t smem_bytes = int64_t(stages) * (stage + stage_extra) + ones_bytes + dz_bytes;
  static_assert(stages >= 3, "two stages of loads in flight while one is summed");
  static_assert(min_blocks * (smem_bytes + 1024) <= 228 * 1024, "min_blocks blocks must fit on an SM");
  static_assert(smem_bytes <= 227 * 1024, "a block's shared memory limit");
  static_assert(stage % 1024 == 0, "the tile of ones after the stages, 1024-byte aligned as the descriptors assume");
  static_assert(WgmmaLayout<DI>::partial_floats == DI * 64 + z_floats, "pass 2 reads S [DI][64], then z");
};
template <ScanRole R, int DI, int BlocksPerSm, bool WithNormalizer>
using SegmentStateLayoutOf = SegmentStateLayout<DI, BlocksPerSm, RoleInfo<R>::group_sum && WithNormalizer>;

// The roles whose pass 1 runs here: all but the fused dk + dv sweep's with the normalizer (its dz sums
// weigh its Q tile).
template <ScanRole R, bool WithNormalizer>
constexpr bool kHasSegmentStateKernel = R == ScanRole::kForward || R == ScanRole::kGradQ || R == ScanRole::kGradK ||
                                 R == ScanRole::kGradV || (R == ScanRole::kGradKV && !WithNormalizer);

// Grid as run_sweep's: (sequences x segments x output tiles, kv heads); chunk: the tokens per
// chunk of pass 2 (64, or 128 for wgmma_pair_scan_kernel), in which split.seg_chunks counts;
// BlocksPerSm as SegmentStateLayout's; kPadded as wgmma_scan_kernel's (tiles zero past the real columns).
template <class T, ScanRole R, int DI, int BlocksPerSm, bool WithNormalizer, bool kPadded = false>
__global__ void __launch_bounds__(kScanThreads, BlocksPerSm)
    segment_state_kernel(const ChunkArgs p, const SegmentSplit split, const ScanFeatures feat, int chunk) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  static_assert(kHasSegmentStateKernel<R, WithNormalizer>, "the fused dk + dv sweep's pass 1 with the normalizer runs on its own kernel");
  using Info = RoleInfo<R>;
  using L = SegmentStateLayoutOf<R, DI, BlocksPerSm, WithNormalizer>;
  constexpr bool kFwd = R == ScanRole::kForward, kDk = R == ScanRole::kGradK;
  // dk and dv: rows times w as their sweeps weigh them (dk's phi(q) in bf16 at DI = 128, else its
  // dout; dv's dout), in place before the products, so that the sums agree bit for bit; w = scale
  // without the normalizer, else w_t = s / den_t, which comes with the tiles (kRowWeights)
  constexpr bool kWeighs = Info::group_sum;
  constexpr bool kWeighsCv = Info::dv_like || wg_dk_scales_cv<T, R, DI>;
  constexpr bool kRowWeights = kWeighs && WithNormalizer;
  // dk with the normalizer: dz += sum_t dd_t phi(q_t) on its output columns, as its sweep sums it (dd
  // / w against the scaled phi(q) where phi(q) takes w)
  constexpr bool kSumsDz = kDk && WithNormalizer;
  constexpr int C = kChunk, D = 64, NS = L::stages, KT = L::KT;
  static_assert(C / 16 == 4, "wg_scale_rows: four rows per thread");
  extern __shared__ __align__(1024) unsigned char smem[];
  if (smem_addr(smem) % 1024 != 0) __trap();  // the swizzle and the descriptors assume it
  unsigned char* ones = smem + NS * L::stage;
  float* fl = reinterpret_cast<float*>(ones + L::ones_bytes);  // L::w, L::dd, L::dz (kRowWeights)

  const int64_t Hkv = p.num_kv_heads, G = p.num_heads / p.num_kv_heads;
  const int64_t out_cols = sweep_output_dim<R>(p);
  const int tiles = sweep_tiles<kPadded>(out_cols, D);
  const SweepBlock block = sweep_block(tiles, split.segments);
  const int tile = block.tile, seg = block.seg;
  const int64_t n = block.n, g = block.g;
  const int tid = threadIdx.x;
  const Seq seq = sequence(p, n);
  const float scale = static_cast<float>(p.scale);
  const float* ws_w = kRowWeights ? BwdWorkspace::den<float>(p) : nullptr;  // w_t = s / den_t
  const float* ws_dd = kSumsDz ? BwdWorkspace::dd<float>(p) : nullptr;

  // ---- this segment's 64-token tiles, in the order of pass 2's own pass 1 -------------------------
  // forward, dq: pass 2's chunks [ci0, ci1) front to back, 64 tokens a tile (B and Cv are the kv
  // head's). dk, dv: WgSteps' (chunk, query head) pairs, the last chunk first, each chunk's 64-token
  // tiles front to back, as the 128-token pass 1 sums them.
  const int64_t nc = (seq.len + chunk - 1) / chunk;
  const int64_t ci0 = min(nc, int64_t(seg) * split.seg_chunks), ci1 = min(nc, ci0 + split.seg_chunks);
  const int64_t first = ci0 * chunk, end = min(seq.len, ci1 * chunk);
  const WgSteps walk(seq, g, G, chunk, split, seg);
  const int tiles_per_chunk = chunk / C;
  // Pass 2 starts segment j from the partials of the segments before it (load_initial_state), so the
  // last segment's sums are never read: its blocks load and sum nothing and write zeros, which keeps
  // the buffers free of stale floats. H200: the forward's pass
  // 132 -> 118 us at B1-T65536-H16-D128 (8 segments), 134 -> 103 at B2-T32768 (4); the row-weighted
  // dk and dv passes, not bandwidth bound, keep their time.
  const bool read_later = seg < split.segments - 1;
  const int steps = !read_later ? 0
                    : kWeighs   ? walk.count() * tiles_per_chunk
                                : end > first ? static_cast<int>((end - first + C - 1) / C) : 0;
  struct Cursor {
    WgSteps::Walk chunk_head;
    int sub;  // the tile within the chunk
  };
  auto advance = [&](Cursor& c) {
    if (++c.sub == tiles_per_chunk) c.sub = 0, walk.advance(c.chunk_head);
  };
  auto tile_at = [&](const Cursor& c) {  // t0: the tile's first token; cl: its valid rows (<= 0: none)
    WgStep s = walk.at<Info::reverse>(c.chunk_head);
    s.t0 += int64_t(C) * c.sub;
    s.cl -= C * c.sub;
    return s;
  };
  const int64_t K = p.head_dim_k, V = p.head_dim_v;
  const WgSource<T> b_src = wg_source<T>(tc_view(p, feat, Info::b), seq, 0, tid, operand_dim(Info::b, K, V));
  const WgSource<T> c_src = wg_source<T>(tc_view(p, feat, Info::c), seq, tile * D, tid, operand_dim(Info::c, K, V));
  auto stage = [&](int i) { return smem + (i % NS) * L::stage; };
  Cursor issued{walk.start(), 0}, current{walk.start(), 0};
  auto issue = [&](int i) {  // step i's B and Cv tiles (rows past the segment's end as zeros)
    if constexpr (kWeighs) {
      const WgStep s = tile_at(issued);
      advance(issued);
      wg_load_tiles<T, kPadded>(stage(i), b_src, s.h, DI, s.t0, s.cl, tid);
      wg_load_tiles<T, kPadded>(stage(i) + KT * kWgTileBytes, c_src, s.h, D, s.t0, s.cl, tid);
      if constexpr (kRowWeights) {  // w of this thread's rows, into its own slot (0 past the end)
        float* slot = fl + L::w + (i % NS) * L::w_floats + 4 * tid;
#pragma unroll
        for (int j = 0; j < C / 16; ++j) {
          const int r = tid / 8 + 16 * j;
          const bool valid = r < s.cl;
          cp_async4(slot + j, ws_w + (valid ? token_index(p, seq, s.t0 + r, s.h) : 0), valid);
        }
      }
      if constexpr (kSumsDz) {  // dd of the tile's tokens, loaded as dk's sweep loads it
        float* dd = fl + L::dd + (i % NS) * C;
        if constexpr (kWeighsCv) {
          wg_load_row_dd<C / 16>(dd, ws_dd, 16, s.cl, tid, p, seq, s.t0, s.h);
        } else if (tid < C) {
          const bool valid = tid < s.cl;
          cp_async4(dd + tid, ws_dd + (valid ? token_index(p, seq, s.t0 + tid, s.h) : 0), valid);
        }
      }
    } else {
      const int64_t t = first + int64_t(i) * C;
      const int cl = static_cast<int>(end - t < C ? end - t : C);
      wg_load_tiles<T, kPadded>(stage(i), b_src, g, DI, seq.t0 + t, cl, tid);
      wg_load_tiles<T, kPadded>(stage(i) + KT * kWgTileBytes, c_src, g, D, seq.t0 + t, cl, tid);
    }
  };

  float S[KT][32];
#pragma unroll
  for (int h = 0; h < KT; ++h)
#pragma unroll
    for (int i = 0; i < 32; ++i) S[h][i] = 0.f;
  auto hold_state = [&]() {
#pragma unroll
    for (int h = 0; h < KT; ++h) wg_hold(S[h]);
  };
  // z's column sums: the forward's over B's KT tiles of 64 dims, dq's over Cv's 64 columns, each an
  // m64n8 accumulator (every column the same sum) of X^T times the tile of ones, in S's product group
  constexpr int ZT = kFwd ? KT : 1;
  float Z[ZT][4];
#pragma unroll
  for (int h = 0; h < ZT; ++h) Z[h][0] = Z[h][1] = Z[h][2] = Z[h][3] = 0.f;
  // at compile time (WithNormalizer == p.normalize: sweep.cuh's check_normalize_mode), so that the
  // Z products are not guarded by a branch between the fence and the commit
  constexpr bool kSumsZ = WithNormalizer && !kWeighs;
  if constexpr (kSumsZ) wg_fill_ones<T>(ones, tid, kScanThreads);  // read after the first step's barrier
  float* dz = fl + L::dz;
  if constexpr (kSumsDz) {
    if (tid < D) dz[tid] = 0.f;  // read by its column's writer after the first step's barrier
  }
  auto hold_z = [&]() {
#pragma unroll
    for (int h = 0; h < ZT; ++h) wg_hold(Z[h]);
  };

  // ---- the steps: S += B^T Cv (and Z += X^T ones) -------------------------------------------------
  for (int i = 0; i < NS - 1; ++i) {
    if (i < steps) issue(i);
    cp_async_commit();
  }
  for (int i = 0; i < steps; ++i) {
    unsigned char* Bt = stage(i);
    unsigned char* Ct = Bt + KT * kWgTileBytes;
    int cl;  // the tile's valid rows (<= 0: none)
    if constexpr (kWeighs) {
      cl = tile_at(current).cl;
      advance(current);
    } else {
      const int64_t t = first + int64_t(i) * C;
      cl = static_cast<int>(end - t < C ? end - t : C);
    }
    cp_async_wait<NS - 2>();  // step i's tiles (the NS - 2 steps after it may still be in flight)
    [[maybe_unused]] float* dd = fl + L::dd + (i % NS) * C;
    // relu on this thread's own pieces of the q and k tiles (ScanFeatures::relu_in_sweep), before w scales them
    if (relu_in_sweep(feat, Info::b)) wg_relu_rows<T>(Bt, DI, cl, tid);
    if (relu_in_sweep(feat, Info::c)) wg_relu_rows<T>(Ct, D, cl, tid);
    if constexpr (kWeighs) {  // this thread's own pieces (and weights), which the wait made visible to it
      const float* slot = fl + L::w + (i % NS) * L::w_floats + 4 * tid;
      const float w[C / 16] = {kRowWeights ? slot[0] : scale, kRowWeights ? slot[1] : scale,
                               kRowWeights ? slot[2] : scale, kRowWeights ? slot[3] : scale};
      wg_scale_rows<T>(kWeighsCv ? Ct : Bt, kWeighsCv ? D : DI, cl, w, tid);
      if constexpr (kSumsDz && kWeighsCv) wg_dd_over_w(dd, w, 16, tid);  // dd / w against w phi(q)
    }
    wg_fence_shared();        // cp.async and st.shared writes before the products read them
    // Every thread's copies of step i are in, and every thread is done with step i - 1's stage
    // (its products waited for), which the loads below refill.
    __syncthreads();
    hold_state();
    hold_z();
    wg_fence();
    wg_update_state<T, KT>(S, Bt, Ct);
    if constexpr (kSumsZ) {
#pragma unroll
      for (int h = 0; h < ZT; ++h)  // Z += colsum phi(k): the forward's inner dims, dq's output columns
        wg_add_key_sums<T, 1>(Z[h], kFwd ? Bt : Ct, h * kWgTileBytes, 0, ones);
    }
    wg_commit();
    // the next loads, while the products run
    if (i + NS - 1 < steps) issue(i + NS - 1);
    cp_async_commit();
    wg_wait_all();
    hold_state();
    hold_z();
    if constexpr (kSumsDz) wg_add_column_sums<T, 1>(Ct, dd, dz, tid);  // one writer per column
  }
  cp_async_wait<0>();
  if constexpr (kSumsDz) __syncthreads();  // dz's writers before the partial's

  // ---- the segment's partial, in pass 2's layout ----------------------------------------------------
  float* part = split.partial_at(seg, n, g, Hkv, tiles, tile, WgmmaLayout<DI>::partial_floats);
#pragma unroll
  for (int h = 0; h < KT; ++h)
#pragma unroll
    for (int i = 0; i < 32; ++i) part[(64 * h + wg_acc_row(tid, i)) * D + wg_acc_col(tid, i)] = S[h][i];
  float* z_part = part + DI * D;  // [z_floats]: z's ZT * 64 sums, zeros after them (and without z)
  if constexpr (kSumsZ) {
#pragma unroll
    for (int h = 0; h < ZT; ++h) wg_store_z(Z[h], z_part + 64 * h, tid);
  }
  if constexpr (kSumsDz) {
    if (tid < D) z_part[tid] = dz[tid];
  }
  if constexpr (L::z_floats > kScanThreads) {
    for (int i = tid; i < L::z_floats; i += kScanThreads)
      if (!(kSumsZ || kSumsDz) || i >= ZT * 64) z_part[i] = 0.f;
  } else if (tid < L::z_floats && (!(kSumsZ || kSumsDz) || tid >= ZT * 64)) {
    z_part[tid] = 0.f;
  }

  // ---- the transposed role's partials from the same sums (split.partial_t) -----------------------------
  // dv sums U = sum_t (phi(q_t))^T (w dout_t) [K][V], dk R = sum_t dout_t^T (w phi(q_t)) [V][K] over
  // the same (chunk, query head) steps: R = U^T (in bf16 rounded apart: dk's own pass scales phi(q),
  // wg_dk_scales_cv; in fp16 both scale dout). Likewise the forward's S = sum_t phi(k_t)^T v_t [K][V]
  // and dq's sum_t v_t^T phi(k_t) [V][K] (the forward's go to the saved buffer). This
  // block holds U's (S's) rows [64 h, 64 h + 64) of its value columns [64 tile, 64 tile + 64), which
  // are rows [64 tile, ...) of the transposed role's output tile h.
  if constexpr ((R == ScanRole::kGradV || R == ScanRole::kForward) && !WithNormalizer && DI == 128) {
    if (split.partial_t != nullptr) {
#pragma unroll
      for (int h = 0; h < KT; ++h) {
        float* t_part = split.partial_in(split.partial_t, seg, n, g, Hkv, tiles, h, WgmmaLayout<DI>::partial_floats);
#pragma unroll
        for (int i = 0; i < 32; ++i) t_part[(tile * D + wg_acc_col(tid, i)) * D + wg_acc_row(tid, i)] = S[h][i];
        if (tile == 0 && tid < L::z_floats) t_part[DI * D + tid] = 0.f;  // no z without the normalizer
      }
    }
  }
#elif defined(__CUDA_ARCH__)
  __trap();  // launched from an image without sm_90a code: fail loudly rather than leave partials unwritten
#endif
}

}  // namespace attnrnn::cuda
