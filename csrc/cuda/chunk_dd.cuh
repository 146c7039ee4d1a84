// The backward's per-token weights from the forward's saved w (LinearAttnParams::den_in), in place
// of the den sweep of chunk_tc.cuh: for every (token, query head) row,
//   w_t  = scale / den_t             (as the forward saved it)
//   dd_t = -(dout_t . o_t) w_t       the denominator's gradient, scaled as the sweeps expect
// into the workspace arrays the dq, dk and dv sweeps read (BwdWorkspace). Rows are independent: one
// warp per row, each lane a pair of V columns at a time; a pass over dout and o instead of a scan
// over the sequence with its key sums and scores.
#pragma once

#include "common.cuh"
#include "mma.cuh"

namespace attnrnn::cuda {

constexpr int kDdThreads = 256;

template <class T>
__global__ void __launch_bounds__(kDdThreads) chunk_dd_kernel(const LinearAttnParams p) {
  const int64_t rows = p.batch * p.seqlen * p.num_heads;  // token_index order: (b, t, h)
  const int64_t warps = int64_t(gridDim.x) * (kDdThreads / 32);
  const int lane = threadIdx.x % 32;
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
  for (int64_t r = int64_t(blockIdx.x) * (kDdThreads / 32) + threadIdx.x / 32; r < rows; r += warps) {
    const int64_t h = r % p.num_heads, bt = r / p.num_heads, t = bt % p.seqlen, b = bt / p.seqlen;
    if (t < begin || t >= end) continue;
    const T* d_row = row<T>(p.dout, b, t, h);
    const T* o_row = row<T>(p.out, b, t, h);
    float dot = 0.f;
    for (int64_t v = 2 * lane; v < p.head_dim_v; v += 64) {  // V is even on the tensor-core backward
      const float2 d2 = unpack2<T>(*reinterpret_cast<const uint32_t*>(d_row + v));
      const float2 o2 = unpack2<T>(*reinterpret_cast<const uint32_t*>(o_row + v));
      dot += d2.x * o2.x + d2.y * o2.y;
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, offset);
    if (lane == 0) {
      const float w = w_saved[r];
      ws_w[r] = w;
      ws_dd[r] = -dot * w;
    }
  }
}

}  // namespace attnrnn::cuda
