// The backward's per-token weights from the forward's saved w (LinearAttnParams::den_in), in place
// of the den sweep of chunk_tc.cuh: for every (token, query head) row,
//   w_t  = scale / den_t             (as the forward saved it)
//   dd_t = -(dout_t . o_t) w_t       the denominator's gradient, scaled as the sweeps expect
// into the workspace arrays the dq, dk and dv sweeps read (BwdWorkspace). Rows are independent, so
// this is one pass over dout and o, bound by memory: a warp takes one token at a time and walks its
// query heads, V / 8 lanes per row (8 elements, 16 bytes, each), kDdUnroll row groups loaded before
// any is summed, so that enough bytes are in flight per SM to cover DRAM latency (a warp per row and
// 4 bytes per lane left it latency bound).
#pragma once

#include "common.cuh"
#include "mma.cuh"

namespace attnrnn::cuda {

constexpr int kDdThreads = 256, kDdUnroll = 4;

// 8 consecutive elements of a row as floats: one 16-byte load, or four 4-byte ones where the row is
// only 4-byte aligned (o may be a view; dout is 16-byte aligned on the tensor-core backward).
template <class T, bool kAligned16>
__device__ __forceinline__ void load8(const T* from, float (&x)[8]) {
  uint32_t u[4];
  if constexpr (kAligned16) {
    const uint4 v = __ldg(reinterpret_cast<const uint4*>(from));
    u[0] = v.x, u[1] = v.y, u[2] = v.z, u[3] = v.w;
  } else {
#pragma unroll
    for (int e = 0; e < 4; ++e) u[e] = __ldg(reinterpret_cast<const uint32_t*>(from) + e);
  }
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const float2 f = unpack2<T>(u[e]);
    x[2 * e] = f.x, x[2 * e + 1] = f.y;
  }
}

// V in {64, 128} (the tensor-core backward's value dims); kOut16: o's rows are 16-byte aligned.
template <class T, int V, bool kOut16>
__global__ void __launch_bounds__(kDdThreads) chunk_dd_kernel(const LinearAttnParams p) {
  constexpr int kLanes = V / 8, kRowsPerPass = 32 / kLanes;  // lanes per row; rows a warp holds at once
  const int lane = threadIdx.x % 32, sub = lane / kLanes, col = (lane % kLanes) * 8;
  const int64_t tokens = p.batch * p.seqlen, H = p.num_heads;
  const int64_t warps = int64_t(gridDim.x) * (kDdThreads / 32);
  // Packed sequences cover the tokens [begin, end) contiguously; the forward wrote no w outside.
  int64_t begin = 0, end = p.seqlen;
  if (p.cu_seqlens != nullptr) {
    const Seq first = sequence(p, 0), last = sequence(p, p.num_seqs - 1);
    begin = first.t0;
    end = last.t0 + last.len;
  }
  const float* w_saved = static_cast<const float*>(p.den_in);
  float* ws_w = BwdWorkspace::den<float>(p);
  float* ws_dd = BwdWorkspace::dd<float>(p);
  for (int64_t bt = int64_t(blockIdx.x) * (kDdThreads / 32) + threadIdx.x / 32; bt < tokens; bt += warps) {
    const int64_t b = bt / p.seqlen, t = bt % p.seqlen;
    if (t < begin || t >= end) continue;  // the same for the whole warp
    for (int64_t h0 = 0; h0 < H; h0 += kRowsPerPass * kDdUnroll) {
      // ---- loads: kDdUnroll rows per lane group, all issued before the sums ------------------------
      float d[kDdUnroll][8], o[kDdUnroll][8];
#pragma unroll
      for (int u = 0; u < kDdUnroll; ++u) {
        const int64_t h = h0 + u * kRowsPerPass + sub;
        if (h < H) {
          load8<T, true>(row<T>(p.dout, b, t, h) + col, d[u]);
          load8<T, kOut16>(row<T>(p.out, b, t, h) + col, o[u]);
        } else {
#pragma unroll
          for (int e = 0; e < 8; ++e) d[u][e] = o[u][e] = 0.f;
        }
      }
      // ---- dout . o per row: 8 products per lane, then across the row's kLanes lanes ---------------
#pragma unroll
      for (int u = 0; u < kDdUnroll; ++u) {
        float dot = 0.f;
#pragma unroll
        for (int e = 0; e < 8; ++e) dot += d[u][e] * o[u][e];
#pragma unroll
        for (int offset = kLanes / 2; offset > 0; offset /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, offset);
        const int64_t h = h0 + u * kRowsPerPass + sub;
        if (col == 0 && h < H) {
          const int64_t r = bt * H + h;  // token_index order: (b, t, h)
          const float w = w_saved[r];
          ws_w[r] = w;
          ws_dd[r] = -dot * w;
        }
      }
    }
  }
}

}  // namespace attnrnn::cuda
