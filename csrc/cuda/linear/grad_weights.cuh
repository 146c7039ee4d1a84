// The backward's per-token weights from the forward's saved w (ChunkArgs::den_in), for every
// (token, query head) row,
//   w_t  = scale / den_t             (as the forward saved it)
//   dd_t = -(dout_t . o_t) w_t       the denominator's gradient, scaled as the sweeps expect
// into the workspace arrays the dq, dk and dv sweeps read (BwdWorkspace). Rows are independent, so
// this is one pass over dout and o, bound by memory: a warp takes kDdUnroll x 32 / kLanes
// consecutive rows at a time (across tokens when H is small), kLanes lanes per row with 16 bytes
// each (8 bf16/fp16 or 4 fp32 elements), every load of the pass (and its w) issued before any sum,
// so that enough bytes are in flight per SM to cover DRAM latency (a warp per row with 4-byte loads
// left it latency bound).
#pragma once

#include "args.cuh"
#include "../common/mma.cuh"

namespace attnrnn::cuda {

constexpr int kDdThreads = 256, kDdUnroll = 4;

// Lanes per row of V elements: one 16-byte piece each.
template <class T, int V>
constexpr int grad_weights_lanes() {
  return V / kPieceElems<T>;
}

// A 16-byte piece of a row: one 16-byte load, or four 4-byte ones where the row is only aligned to
// its pairs (o may be a view; dout is 16-byte aligned on the tensor-core backward).
template <class T, bool kAligned16>
__device__ __forceinline__ void load_piece(const T* from, uint32_t (&u)[4]) {
  if constexpr (kAligned16) {
    const uint4 v = __ldg(reinterpret_cast<const uint4*>(from));
    u[0] = v.x, u[1] = v.y, u[2] = v.z, u[3] = v.w;
  } else {
#pragma unroll
    for (int e = 0; e < 4; ++e) u[e] = __ldg(reinterpret_cast<const uint32_t*>(from) + e);
  }
}

// V in {64, 128} (the tensor-core backward's value dims; 256 padded only); kOut16: o's rows are
// 16-byte aligned. kPadded: the real value dim is p.head_dim_v <= V (a multiple of 8); lanes past it
// add zeros.
template <class T, int V, bool kOut16, bool kPadded = false>
__global__ void __launch_bounds__(kDdThreads) grad_weights_kernel(const ChunkArgs p) {
  constexpr int kLanes = grad_weights_lanes<T, V>(), kRowsPerPass = 32 / kLanes * kDdUnroll;  // per row; per pass
  const int lane = threadIdx.x % 32, sub = lane / kLanes, col = (lane % kLanes) * kPieceElems<T>;
  const int64_t len = p.seqlen, H = p.num_heads, rows = p.batch * len * H;  // token_index order: (b, t, h)
  const int64_t warps = int64_t(gridDim.x) * (kDdThreads / 32);
  // Packed sequences cover the tokens [begin, end) contiguously; the forward wrote no w outside.
  int64_t begin = 0, end = len;
  if (p.cu_seqlens != nullptr) {
    const Seq first = sequence(p, 0), last = sequence(p, p.num_seqs - 1);
    begin = first.t0;
    end = last.t0 + last.len;
  }
  const float* __restrict__ w_saved = static_cast<const float*>(p.den_in);
  float* __restrict__ ws_w = BwdWorkspace::den<float>(p);
  float* __restrict__ ws_dd = BwdWorkspace::dd<float>(p);
  for (int64_t r0 = (int64_t(blockIdx.x) * (kDdThreads / 32) + threadIdx.x / 32) * kRowsPerPass; r0 < rows;
       r0 += warps * kRowsPerPass) {
    // The pass's first row as (b0, t0, h0); each later row steps through heads, then tokens.
    const int64_t bt0 = r0 / H, b0 = bt0 / len, t0 = bt0 % len;
    const int h0 = static_cast<int>(r0 - bt0 * H);
    // ---- loads: this lane group's kDdUnroll rows, all issued before the sums ---------------------
    uint32_t d[kDdUnroll][4], o[kDdUnroll][4];
    float w[kDdUnroll];
    bool valid[kDdUnroll];
#pragma unroll
    for (int u = 0; u < kDdUnroll; ++u) {
      const int k = u * (32 / kLanes) + sub, hk = h0 + k;
      int64_t b = b0, t = t0 + hk / static_cast<int>(H);
      while (t >= len) t -= len, ++b;  // only when the sequence is shorter than a pass
      const int64_t h = hk % static_cast<int>(H);
      valid[u] = r0 + k < rows && t >= begin && t < end;
      w[u] = 0.f;
      if (valid[u] && (!kPadded || col < p.head_dim_v)) {
        load_piece<T, true>(row<T>(p.dout, b, t, h) + col, d[u]);
        load_piece<T, kOut16>(row<T>(p.out, b, t, h) + col, o[u]);
        if (col == 0) w[u] = __ldg(w_saved + r0 + k);
      } else {
#pragma unroll
        for (int e = 0; e < 4; ++e) d[u][e] = o[u][e] = 0u;
      }
    }
    // ---- dout . o per row: a piece's products per lane, then across the row's kLanes lanes --------
#pragma unroll
    for (int u = 0; u < kDdUnroll; ++u) {
      float dot = 0.f;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if constexpr (sizeof(T) == 4) {
          dot += __uint_as_float(d[u][e]) * __uint_as_float(o[u][e]);
        } else {
          const float2 dd2 = unpack2<T>(d[u][e]), o2 = unpack2<T>(o[u][e]);
          dot += dd2.x * o2.x + dd2.y * o2.y;
        }
      }
#pragma unroll
      for (int offset = kLanes / 2; offset > 0; offset /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, offset);
      if (col == 0 && valid[u]) {
        const int64_t r = r0 + u * (32 / kLanes) + sub;
        ws_w[r] = w[u];
        ws_dd[r] = -dot * w[u];
      }
    }
  }
}

}  // namespace attnrnn::cuda
