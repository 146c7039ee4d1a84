// The feature pass: phi(q) and phi(k) written once per call where the tensor-core sweeps do not
// apply the feature map to their own tiles (elu1; relu on mma.sync). Applying phi to every staged
// tile inside the mma.sync sweep (once per column tile's block, plus a pass over shared memory and
// a barrier per step) made it 2.4-3.8x slower than the identity map; the pass: B1-T65536-H16-D128
// forward with elu1 5.44 -> 1.86 ms, relu 3.47 -> 1.77 (identity 1.45). elu1's exp inside the
// wgmma sweeps (bitwise equal) made a forward+backward's kernels 2615 -> 3632 us there, against the
// 552 us of the passes it saved: the sweeps at B = 1 are latency-bound chains.
#pragma once

#include <algorithm>

#include "args.cuh"
#include "../common/mma.cuh"

namespace attnrnn::cuda {

// phi(x) of a [B, T, H, K] view into a contiguous copy, one 16-byte piece per thread and step (K a
// multiple of the piece, rows 16-byte aligned: the tensor-core path's requirements). Rounding as in
// the sweep's own transform: phi in fp32 of the input element, rounded to nearest.
template <class T>
__global__ void feature_pass_kernel(const ConstView in, int64_t B, int64_t Tn, int64_t H, int64_t K,
                                    FeatureMap fm, T* out) {
  const int64_t pieces = K / kPieceElems<T>, total = B * Tn * H * pieces;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += gridDim.x * int64_t(blockDim.x)) {
    const int64_t r = i / pieces, h = r % H, t = (r / H) % Tn, b = r / H / Tn;
    uint4 x = *reinterpret_cast<const uint4*>(row<T>(in, b, t, h) + (i % pieces) * kPieceElems<T>);
    uint32_t* u = reinterpret_cast<uint32_t*>(&x);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if constexpr (sizeof(T) == 4) {
        u[j] = __float_as_uint(phi(fm, __uint_as_float(u[j])));
      } else {
        const float2 f = unpack2<T>(u[j]);
        u[j] = pack2<T>(phi(fm, f.x), phi(fm, f.y));
      }
    }
    reinterpret_cast<uint4*>(out)[i] = x;
  }
}

// phi(q) into fq [B, T, H, K] and phi(k) into fk [B, T, Hkv, K], contiguous: grid-stride loops of
// one 16-byte piece per thread, at most 8 blocks per SM.
template <class T>
Status launch_feature_pass(const ChunkArgs& p, T* fq, T* fk) {
  const int threads = 256;
  const int64_t blocks_cap = int64_t(sm_count()) * 8;
  for (int which = 0; which < 2; ++which) {
    const int64_t H = which == 0 ? p.num_heads : p.num_kv_heads;
    const int64_t work = p.batch * p.seqlen * H * p.head_dim_k / kPieceElems<T>;
    if (work == 0) continue;
    const unsigned blocks = static_cast<unsigned>(std::min(blocks_cap, (work + threads - 1) / threads));
    feature_pass_kernel<T><<<blocks, threads, 0, static_cast<cudaStream_t>(p.stream)>>>(
        which == 0 ? p.q : p.k, p.batch, p.seqlen, H, p.head_dim_k, p.feature_map, which == 0 ? fq : fk);
    const Status s = check_launch("chunk_linear_attn feature pass");
    if (s != Status::kSuccess) return s;
  }
  return Status::kSuccess;
}

}  // namespace attnrnn::cuda
