// Chunkwise scans on tensor cores (mma.sync m16n8k16, bf16/fp16 operands, fp32 accumulators and
// state). The forward and the three backward sweeps of causal linear attention are one kernel with
// different operands ("roles"). Per chunk of 64 tokens, with a row operand A [64 x DI], a column
// operand B [64 x DI], a value operand Cv [64 x NC] (one tile of NC output columns) and a state
// S [DI x NC] kept in fp32 registers:
//   scores  P  = mask(A B^T)        mask: s <= t on forward sweeps, s >= t on reverse sweeps
//   output  O  = P Cv + A S         S enters as bf16 hi + lo parts (~16 mantissa bits)
//   state   S += B^T Cv
// With phi the feature map, s the scale, den_t = s (phi(q_t) . z_t) + eps (normalize) and
// dO'' = w dout, w_t = s / den_t (s without normalize), dd_t = -s (dout_t . o_t) / den_t:
//   role     A        B        Cv       sweep    output                    state   extra (normalize)
//   forward  phi(q)   phi(k)   v        forward  o  = s O / den            S       z += colsum(B)
//   den      phi(q)   phi(k)   -        forward  w, dd per (token, head)   -       z += colsum(B)
//   dq       dout     v        phi(k)   forward  dq = w O phi'(q)          S^T     P += dd_t / w_t, O += (dd_t / w_t) z
//            (fp32: dO'', dq = O phi'(q), P += dd_t, O += dd_t z)
//   dk       v        dO''     phi(q)   reverse  dk = sum_h O phi'(k)      dS^T    P += dd_s, O += dz
//   dv       phi(k)   phi(q)   dO''     reverse  dv = sum_h O              dS      -
// (dq's z and dk's dz = dz_final + sum over later tokens of dd_s phi(q_s) live on the NC output
// columns.) Nothing larger than two floats per (token, head) is stored between the sweeps.
//
// Work split: one block of 4 warps per (sequence, output tile, kv head). Warp w computes output
// rows [16w, 16w+16) and owns state rows [w DI/4, (w+1) DI/4). Tiles of the next steps stream in
// with cp.async while the current one is computed (NS stages; with one, the SM's other blocks run
// while a block waits for its tiles). A step is one (chunk, query head)
// pair; operands of the kv head are simply loaded again for each query head (GQA, served by L2).
// kPadded: the real inner dim may be less than DI and the output dim any multiple of 8 (tiles.h,
// padded head dims): the tiles load zeros past the real columns, so every product over them adds
// nothing, and only real columns of S, z and the outputs are read or written.
// dq of bf16/fp16 keeps dout as loaded: its state moves with v and phi(k) alone, so w scales dq's fp32
// output rows (and the scores and z terms take dd_t / w_t), as in the wgmma dq sweep. w dout rounded
// to fp16 in the tile put dq past the numerics bound (relative RMS 2.1e-3 against 2e-3,
// B1-T3000-H2-K64-V128 fp16 with normalize, on an H100). fp32 tiles are rounded to TF32 once either
// way, and keep dO'' (the registers of two more floats per row made the 3xTF32 dq sweep spill).
// fp32 on TF32 mma alone (kTf32: fp32 without kTf32x3): the tiles are rounded to TF32 once, as they
// land (tf32_round_own_pieces, tc_transform_tile), and so is the published state, so that the
// products read TF32 operands as they are. The normalizer's column sums are taken in fp32 before
// their tile is rounded (tf32_sum_and_round_column): z is a sum, not a product, and stays exact.
#pragma once

#include "scan_roles.cuh"
#include "scan_mma_steps.cuh"
#include "../common/mma.cuh"

namespace attnrnn::cuda {

template <class T, ScanRole R, int DI, bool kTf32x3 = false, bool kPadded = false>
__global__ void __launch_bounds__(kScanThreads, MmaLayout<T, DI>::min_blocks)
    mma_scan_kernel(const ChunkArgs p, const SegmentSplit split, const ScanFeatures feat) {
  using Info = RoleInfo<R>;
  using L = MmaLayout<T, DI>;
  using M = MmaStep<T, kTf32x3>;
  constexpr int NS = L::NS, KT = DI / 64, C = kChunk, NC = L::NC, NT = NC / 8, NP = NC / 16;
  constexpr bool kTf32 = sizeof(T) == 4 && !kTf32x3;
  // dq of 16-bit T: A is dout as loaded, w scales the output rows (fp32 tiles round w dout once either way)
  constexpr bool kDq = R == ScanRole::kGradQ && sizeof(T) == 2;
  extern __shared__ __align__(16) unsigned char smem_bytes[];
  T* st = reinterpret_cast<T*>(smem_bytes);
  float* fl = reinterpret_cast<float*>(smem_bytes + int64_t(L::t_elems) * sizeof(T));
  T* Sh = st + L::Sh;
  T* Sl = st + L::Sl;  // 16-bit T only
  float* z = fl + L::z;

  const int64_t Hkv = p.num_kv_heads, G = p.num_heads / p.num_kv_heads, K = p.head_dim_k, V = p.head_dim_v;
  const int64_t out_cols = sweep_output_dim<R>(p), inner = sweep_inner_dim<R>(p);  // inner: DI where not kPadded
  const int tiles = tc_tiles<T, R, DI, kPadded>(p);
  const SweepBlock block = sweep_block(tiles, split.segments);
  const int tile = block.tile, seg = block.seg;
  const int64_t n = block.n, g = block.g;
  const int c0 = tile * NC;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, gr = lane >> 2, t2 = (lane & 3) * 2;
  const int r0 = warp * 16;
  const Seq seq = sequence(p, n);
  const float scale = static_cast<float>(p.scale), eps = static_cast<float>(p.eps);
  const int64_t state_row = n * Hkv + g;
  float* ws_w = BwdWorkspace::den<float>(p);  // holds w_t = s / den_t on this path
  float* ws_dd = ws_w == nullptr ? nullptr : BwdWorkspace::dd<float>(p);

  // ---- initial state (registers) and z ---------------------------------------------------------
  auto mat_index = [&](int d, int c) {
    return Info::transposed ? (state_row * K + c0 + c) * V + d : (state_row * K + d) * V + c0 + c;
  };
  // Pass-1 partial of segment j of this block's (sequence, tile, kv head): S as [d][c], then z.
  auto partial_at = [&](int j) { return split.partial_at(j, n, g, Hkv, tiles, tile, tc_partial_floats<T, DI>()); };
  const int earlier = split.state_only ? 0 : seg;  // partials that precede this segment
  // f(x, d, c) for every state element x = S[d][c] this thread holds.
  float S[KT][NT][4];
  auto for_each_state = [&](auto&& f) {
#pragma unroll
    for (int mi = 0; mi < KT; ++mi)
#pragma unroll
      for (int ni = 0; ni < NT; ++ni)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          f(S[mi][ni][e], warp * (DI / 4) + mi * 16 + gr + (e >= 2 ? 8 : 0), ni * 8 + t2 + (e & 1));
  };
  // ... on the real elements only (kPadded: d < inner, c0 + c < out_cols)
  auto for_each_real_state = [&](auto&& f) {
    for_each_state([&](float& x, int d, int c) {
      if (!kPadded || (d < inner && c0 + c < out_cols)) f(x, d, c);
    });
  };
  {
    const float* S0 = static_cast<const float*>(Info::reverse ? p.d_final_S : p.initial_S);
    if constexpr (kPadded) for_each_state([](float& x, int, int) { x = 0.f; });
    load_initial_state(for_each_real_state, !split.state_only ? S0 : nullptr, mat_index, partial_at,
                       earlier, NC);
  }
  if (p.normalize) {
    constexpr bool inner_z = R == ScanRole::kForward;
    constexpr bool col_z = R == ScanRole::kGradQ || R == ScanRole::kGradK;
    if constexpr (inner_z || col_z) {
      const float* z0 = static_cast<const float*>(R == ScanRole::kGradK ? p.d_final_z : p.initial_z);
      const int zc0 = inner_z ? 0 : c0, width = inner_z ? DI : NC;
      for (int d = tid; d < width; d += kScanThreads) {
        if (kPadded && zc0 + d >= K) {  // padded dims: z stays 0 there
          z[d] = 0.f;
          continue;
        }
        float x = (z0 != nullptr && !split.state_only) ? z0[state_row * K + zc0 + d] : 0.f;
        for (int j = 0; j < earlier; ++j) x += partial_at(j)[DI * NC + d];
        z[d] = x;
      }
    }
  }

  // S row-major [d][c] for the tensor-core product A S: hi + lo parts of a 16-bit T, else whole.
  auto publish_state = [&]() {
#pragma unroll
    for (int mi = 0; mi < KT; ++mi)
#pragma unroll
      for (int ni = 0; ni < NT; ++ni)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int d = warp * (DI / 4) + mi * 16 + gr + 8 * h, c = ni * 8 + t2;
          const float x0 = S[mi][ni][2 * h], x1 = S[mi][ni][2 * h + 1];
          if constexpr (L::state_parts == 2) {
            const uint32_t hi = pack2<T>(x0, x1);
            const float2 back = unpack2<T>(hi);
            *reinterpret_cast<uint32_t*>(Sh + d * L::LS + c) = hi;
            *reinterpret_cast<uint32_t*>(Sl + d * L::LS + c) = pack2<T>(x0 - back.x, x1 - back.y);
          } else {  // fp32, transposed: [c][d]
            Sh[c * L::LS + d] = kTf32 ? tf32_rounded(x0) : x0;
            Sh[(c + 1) * L::LS + d] = kTf32 ? tf32_rounded(x1) : x1;
          }
        }
  };
  publish_state();

  // ---- the step sequence: (chunk, query head) pairs in sweep order --------------------------------
  const int nc = static_cast<int>((seq.len + C - 1) / C);
  const int ci0 = min(nc, seg * split.seg_chunks), ci1 = min(nc, ci0 + split.seg_chunks);
  const int steps = (ci1 - ci0) * static_cast<int>(G);
  struct Step {
    int64_t t0, h;
    int cl;
    bool first, last;
  };
  auto step_at = [&](int i) {
    const int ci = ci0 + i / static_cast<int>(G), hi = i % static_cast<int>(G);
    const int c = Info::reverse ? nc - 1 - ci : ci;
    const int64_t off = int64_t(c) * C;
    return Step{seq.t0 + off, g * G + hi, static_cast<int>(seq.len - off < C ? seq.len - off : C), hi == 0,
                hi == G - 1};
  };

  // A thread copies the same column piece e of every (128 / pieces)-th row: one row address per tile
  // (kPadded: zeros where the piece lies past the source's real columns).
  auto load_tile = [&](T* dst, int ld, Operand src, int width, int col0, const Step& s) {
    const ConstView& view = tc_view(p, feat, src);
    const int pieces = width / kPieceElems<T>, rows_per_pass = kScanThreads / pieces;
    const int t_first = tid / pieces, e = (tid % pieces) * kPieceElems<T>;
    const bool real = !kPadded || col0 + e < operand_dim(src, K, V);
    const T* from = row<T>(view, seq.b, s.t0 + t_first, per_query_head(src) ? s.h : g) + col0 + e;
    const int64_t jump = rows_per_pass * view.stride_t;
    const T* fallback = static_cast<const T*>(view.data);
#pragma unroll
    for (int t = t_first; t < C; t += rows_per_pass, from += jump)
      cp_async16(dst + t * ld + e, real && t < s.cl ? from : fallback, real && t < s.cl);
  };
  auto issue = [&](int i) {
    const Step s = step_at(i);
    T* base = st + (i % NS) * L::stage;
    if (!split.state_only) load_tile(base + L::A, L::LI, Info::a, DI, 0, s);
    load_tile(base + L::B, L::LI, Info::b, DI, 0, s);
    if constexpr (Info::c != Operand::kNone) load_tile(base + L::C, L::LC, Info::c, NC, c0, s);
    if constexpr (R != ScanRole::kForward) {
      if (p.normalize && tid < 2 * C) {
        const int t = tid % C;
        const bool valid = t < s.cl;
        const int64_t idx = valid ? token_index(p, seq, s.t0 + t, s.h) : 0;
        float* f = fl + (i % NS) * L::f_stage + (tid < C ? L::w : L::dd);
        cp_async4(f + t, (tid < C ? ws_w : ws_dd) + idx, valid);
      }
    }
  };

  // den_t = s (A_t . z + rowsum P_t) + eps for the lane's row r (its 4 lanes split the dot product).
  auto denominator = [&](const T* As, float rowsum, int r) {
    const T* arow = As + (r0 + gr + 8 * r) * L::LI;
    float acc = rowsum;
    for (int d = t2; d < DI; d += 8) {
      const float2 a2 = load2<T>(arow + d);
      acc += a2.x * z[d] + a2.y * z[d + 1];
    }
    acc += __shfl_xor_sync(0xffffffffu, acc, 1);
    acc += __shfl_xor_sync(0xffffffffu, acc, 2);
    return scale * acc + eps;
  };

  for (int i = 0; i < NS - 1; ++i) {
    if (i < steps) issue(i);
    cp_async_commit();
  }
  // kTf32 with the normalizer: the tile whose column sums it adds (forward: B into z; dq, dk: Cv into
  // the column vector) is rounded after they are taken, in fp32 from the tile as it landed
  const bool sums_tile =
      kTf32 && p.normalize && (R == ScanRole::kForward || R == ScanRole::kGradQ || R == ScanRole::kGradK);
  constexpr bool summed_b = R == ScanRole::kForward;
  const bool sums_b = sums_tile && summed_b, sums_c = sums_tile && !summed_b;  // rounded after the sums
  bool nonfinite = false;  // a row this thread wrote was not finite (note_nonfinite, after the steps)
  float O[NT][4];
  for (int i = 0; i < steps; ++i) {
    if (i + NS - 1 < steps) issue(i + NS - 1);
    cp_async_commit();
    cp_async_wait<NS - 1>();
    T* As = st + (i % NS) * L::stage + L::A;
    T* Bs = st + (i % NS) * L::stage + L::B;
    T* Cs = st + (i % NS) * L::stage + L::C;
    if constexpr (kTf32) {  // tiles that tc_transform_tile rewrites are rounded there, once
      if (!split.state_only && !tc_transforms(Info::a, p, feat)) tf32_round_own_pieces(As, L::LI, DI, tid);
      if (!sums_b && !tc_transforms(Info::b, p, feat)) tf32_round_own_pieces(Bs, L::LI, DI, tid);
      if constexpr (Info::c != Operand::kNone)
        if (!sums_c && !tc_transforms(Info::c, p, feat)) tf32_round_own_pieces(Cs, L::LC, NC, tid);
    }
    __syncthreads();  // step i has landed for every thread

    const Step s = step_at(i);
    const float* w_s = fl + (i % NS) * L::f_stage + L::w;
    float* dd_s = fl + (i % NS) * L::f_stage + L::dd;
    bool changed = !kDq && !split.state_only &&
                   tc_transform_tile<T>(As, L::LI, Info::a, DI, s.cl, w_s, p, feat, scale, tid, kTf32);
    if constexpr (kDq) {
      if (p.normalize && !split.state_only) {  // dd / w in place (0 where w is 0: scale = 0, dd 0 too)
        if (tid < C) dd_s[tid] = w_s[tid] != 0.f ? dd_s[tid] / w_s[tid] : 0.f;
        changed = true;
      }
    }
    const bool b_changed =
        tc_transform_tile<T>(Bs, L::LI, Info::b, DI, s.cl, w_s, p, feat, scale, tid, kTf32 && !sums_b);
    bool c_changed = false;
    if constexpr (Info::c != Operand::kNone)
      c_changed = tc_transform_tile<T>(Cs, L::LC, Info::c, NC, s.cl, w_s, p, feat, scale, tid, kTf32 && !sums_c);
    changed |= b_changed || c_changed;
    float column_sum = 0.f;  // kTf32 with the normalizer: column tid of the summed tile, before rounding
    if constexpr (kTf32) {
      if (sums_tile) {
        if (summed_b ? b_changed : c_changed) __syncthreads();
        column_sum = summed_b ? tf32_sum_and_round_column<R>(Bs, L::LI, DI, dd_s, tid)
                              : tf32_sum_and_round_column<R>(Cs, L::LC, NC, dd_s, tid);
        changed = true;
      }
    }
    if (changed) __syncthreads();

    // ---- outputs of the step (pass 1 of a split scan only moves the state) ------------------------
    auto needed = [&](int blk) { return Info::reverse ? blk >= warp : blk <= warp; };
    if (!split.state_only) {
      // ---- scores P = mask(A B^T) of rows [r0, r0+16); 16-column blocks past the diagonal skipped ----
      float P[8][4];
#pragma unroll
      for (int ni = 0; ni < 8; ++ni)
#pragma unroll
        for (int e = 0; e < 4; ++e) P[ni][e] = 0.f;
#pragma unroll
      for (int kk = 0; kk < DI; kk += 16) {
        typename M::A a;
        M::a_rows(a, As, L::LI, r0, kk, lane);
#pragma unroll
        for (int pr = 0; pr < 4; ++pr) {
          if (!needed(pr)) continue;
          typename M::B b;
          M::b_nk(b, Bs, L::LI, 16 * pr, kk, lane);
          M::mma(P[2 * pr], a, b, 0);
          M::mma(P[2 * pr + 1], a, b, 1);
        }
      }
      // Only the diagonal 16 x 16 block (n-tiles 2 warp, 2 warp + 1) is cut by the mask; the
      // blocks on its far side were skipped above and stay 0.
      constexpr bool extra_row = R == ScanRole::kGradQ, extra_col = R == ScanRole::kGradK;
      const bool with_dd = (extra_row || extra_col) && p.normalize;
#pragma unroll
      for (int ni = 0; ni < 8; ++ni) {
        const bool diagonal = (ni >> 1) == warp;
        if (!diagonal && !(with_dd && needed(ni >> 1))) continue;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int t = r0 + gr + (e >= 2 ? 8 : 0), sc = ni * 8 + t2 + (e & 1);
          float x = P[ni][e];
          if (with_dd) x += extra_row ? dd_s[t] : dd_s[sc];
          P[ni][e] = (!diagonal || (Info::reverse ? sc >= t : sc <= t)) ? x : 0.f;
        }
      }
      float rowsum[2] = {0.f, 0.f};
      if (R == ScanRole::kForward && p.normalize) {
#pragma unroll
        for (int ni = 0; ni < 8; ++ni)
#pragma unroll
          for (int e = 0; e < 4; ++e) rowsum[e >> 1] += P[ni][e];
      }

      if (!Info::group_sum || s.first) {
#pragma unroll
        for (int ni = 0; ni < NT; ++ni)
#pragma unroll
          for (int e = 0; e < 4; ++e) O[ni][e] = 0.f;
      }

      // ---- O += A S (once per chunk for group sums: A is the kv head's) and the z terms -----------
      if (!Info::group_sum || s.first) {
#pragma unroll
        for (int kk = 0; kk < DI; kk += 16) {
          typename M::A a;
          M::a_rows(a, As, L::LI, r0, kk, lane);
#pragma unroll
          for (int part = 0; part < L::state_parts; ++part)  // hi, then lo
#pragma unroll
            for (int pr = 0; pr < NP; ++pr) {
              typename M::B b;
              if constexpr (L::state_transposed)
                M::b_nk(b, Sh, L::LS, 16 * pr, kk, lane);
              else
                M::b_kn(b, part == 0 ? Sh : Sl, L::LS, 16 * pr, kk, lane);
              M::mma(O[2 * pr], a, b, 0);
              M::mma(O[2 * pr + 1], a, b, 1);
            }
        }
        if constexpr (R == ScanRole::kGradQ || R == ScanRole::kGradK) {
          if (p.normalize) {
#pragma unroll
            for (int ni = 0; ni < NT; ++ni)
#pragma unroll
              for (int e = 0; e < 4; ++e) {
                const int t = r0 + gr + (e >= 2 ? 8 : 0), c = ni * 8 + t2 + (e & 1);
                O[ni][e] += (R == ScanRole::kGradQ ? dd_s[t] : 1.f) * z[c];
              }
          }
        }
      }
      // ---- O += P Cv: P re-packed as A fragments, 16 key rows at a time ----------------------------
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        if (!needed(j)) continue;
        typename M::A a;
        M::a_from_c(a, P[2 * j], P[2 * j + 1]);
#pragma unroll
        for (int pr = 0; pr < NP; ++pr) {
          typename M::B b;
          M::b_kn(b, Cs, L::LC, 16 * pr, 16 * j, lane);
          M::mma(O[2 * pr], a, b, 0);
          M::mma(O[2 * pr + 1], a, b, 1);
        }
      }

      if constexpr (kDq) {  // O times w of its rows (scale without the normalizer)
        const float w0 = p.normalize ? w_s[r0 + gr] : scale, w8 = p.normalize ? w_s[r0 + gr + 8] : scale;
#pragma unroll
        for (int ni = 0; ni < NT; ++ni)
#pragma unroll
          for (int e = 0; e < 4; ++e) O[ni][e] *= e >= 2 ? w8 : w0;
      }

      // ---- epilogue: one output per query head, or the group sum after its last head ---------------
      if (!Info::group_sum || s.last) {
        float inv[2] = {scale, scale};
        if constexpr (R == ScanRole::kForward) {
          if (p.normalize) {
#pragma unroll
            for (int r = 0; r < 2; ++r) inv[r] = scale / denominator(As, rowsum[r], r);
            if (p.den_out != nullptr && tile == 0) store_den(p, seq, s.t0 + r0 + gr, s.h, s.cl - r0 - gr, inv, lane);
          }
        }
        const MutView& out = R == ScanRole::kForward ? p.o : R == ScanRole::kGradQ ? p.dq : R == ScanRole::kGradK ? p.dk : p.dv;
        const int64_t out_head = Info::group_sum ? g : s.h;
        const bool dphi_of = (R == ScanRole::kGradQ || R == ScanRole::kGradK) && p.feature_map != FeatureMap::kIdentity;
        float finite = 0.f;  // 0 while every value written is finite (note_nonfinite)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int t = r0 + gr + 8 * r;
          if (t >= s.cl) continue;
          T* orow = row<T>(out, seq.b, s.t0 + t, out_head) + c0;
          // phi' of the row's phi(x) elements (dphi_rows), all loaded before its first store (as
          // in wg_write_rows: a load behind each store cost a memory latency per element pair)
          Packed2<T> raw2[NT];
          if (dphi_of) {
            const ConstView phi_rows = R == ScanRole::kGradQ ? dphi_rows(feat.q, p.q) : dphi_rows(feat.k, p.k);
            const T* raw = row<T>(phi_rows, seq.b, s.t0 + t, out_head) + c0;
#pragma unroll
            for (int ni = 0; ni < NT; ++ni)
              if (!kPadded || c0 + ni * 8 < out_cols) raw2[ni] = load_packed2(raw + ni * 8 + t2);
          }
#pragma unroll
          for (int ni = 0; ni < NT; ++ni) {
            if (kPadded && c0 + ni * 8 >= out_cols) continue;  // out_cols is a multiple of 8
            float x0 = O[ni][2 * r], x1 = O[ni][2 * r + 1];
            if constexpr (R == ScanRole::kForward) {
              x0 *= inv[r];
              x1 *= inv[r];
            }
            if (dphi_of) {
              const float2 q2 = packed2_floats<T>(raw2[ni]);
              x0 *= dphi_of_phi(p.feature_map, q2.x);
              x1 *= dphi_of_phi(p.feature_map, q2.y);
            }
            finite = fmaf(x1, 0.f, fmaf(x0, 0.f, finite));
            store2<T>(orow + ni * 8 + t2, x0, x1);
          }
        }
        nonfinite |= finite != 0.f;
      }
    }

    // ---- state update S += B^T Cv (every head for group sums, else once per chunk) ---------------
    const bool update = Info::group_sum || s.last;
    if (update) {
#pragma unroll
      for (int mi = 0; mi < KT; ++mi) {
        const int m0 = warp * (DI / 4) + mi * 16;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          typename M::A a;
          M::a_columns(a, Bs, L::LI, m0, 16 * j, lane);
#pragma unroll
          for (int pr = 0; pr < NP; ++pr) {
            typename M::B b;
            M::b_kn(b, Cs, L::LC, 16 * pr, 16 * j, lane);
            M::mma(S[mi][2 * pr], a, b, 0);
            M::mma(S[mi][2 * pr + 1], a, b, 1);
          }
        }
      }
    }
    __syncthreads();  // every warp is done reading Sh/Sl and z of this step
    if (update) {
      if constexpr (kTf32) {
        if (sums_tile && tid < (summed_b ? DI : NC)) z[tid] += column_sum;
      } else if (p.normalize) {
        tc_add_column_sums<T, R, DI>(z, Bs, Cs, dd_s, tid);
      }
      if (!split.state_only) publish_state();
    }
    __syncthreads();  // stage i may be overwritten; z and the state copy are published
  }
  cp_async_wait<0>();
  note_nonfinite(p, state_row, nonfinite);

  // ---- pass 1: this segment's partial; otherwise the final state, from the last segment -----------
  if (split.state_only) {
    float* part = partial_at(seg);
    for_each_state([&](float& x, int d, int c) { part[d * NC + c] = x; });
    for (int d = tid; d < (DI > NC ? DI : NC); d += kScanThreads) part[DI * NC + d] = p.normalize ? z[d] : 0.f;
    return;
  }
  if (seg != split.segments - 1) return;
  if constexpr (R == ScanRole::kForward || R == ScanRole::kGradV) {
    float* out = static_cast<float*>(R == ScanRole::kForward ? p.final_S : p.d_initial_S);
    if (out != nullptr) for_each_real_state([&](float& x, int d, int c) { out[mat_index(d, c)] = x; });
  }
  if constexpr (R == ScanRole::kForward) {
    if (p.final_z != nullptr && tile == 0)
      for (int d = tid; d < (kPadded ? K : DI); d += kScanThreads) static_cast<float*>(p.final_z)[state_row * K + d] = z[d];
  }
  if constexpr (R == ScanRole::kGradK) {
    if (p.d_initial_z != nullptr)
      for (int c = tid; c < NC && (!kPadded || c0 + c < K); c += kScanThreads)
        static_cast<float*>(p.d_initial_z)[state_row * K + c0 + c] = z[c];
  }
}

}  // namespace attnrnn::cuda
