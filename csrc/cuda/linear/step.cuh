// One decoding step of causal linear attention: for every batch entry b with pool row r,
//   S_r += k'^T v,  z_r += k',  o_h = q'_h S_r / (q'_h . z_r + eps)   for the G query heads of a group.
// Bandwidth bound: the fp32 state is read once and written once. One block per (b, kv head g, BV value
// columns: V split in tiles when few blocks would leave the tail of the grid to a handful of SMs; never
// with normalize, whose key-sum update belongs to one block); its threads split the tile into W-wide
// column vectors (W = 4: float4) and interleaved row sets, keep the
// partial q'_h S products of GT heads in registers, and reduce them across row sets in shared memory.
// A thread's state rows are loaded kStepBatchRows at a time and the next batch is in flight while the
// current one is updated and stored; the first batch is issued before the q/k/v preamble.
// Pool rows named by several batch entries (the CPU rejects them; CUDA cannot without a host sync):
// every entry sharing a row outputs NaN, and the row is updated once, by the first entry (lowest b)
// that names it, as if it alone named the row; the later ones write no state.
#pragma once

#include "args.cuh"

namespace attnrnn::cuda {

constexpr int kStepThreads = 256;
// State rows per thread and batch (two batches in flight). With one row in flight per thread (load,
// update, store, next) the step ran at 53-71% of the copy rate: 256 x 16 bytes in flight per block
// cannot cover DRAM latency. Kernel alone at B64 / B256, H32, D128: 75 / 286 us with 4 rows
// (80 registers, 3 blocks per SM), 76 / 288 us with 8 (128 registers, 2 blocks per SM), 82 / 319 us
// with 4 rows forced to 4 blocks per SM (64 registers). bench/results/decode_probe_h200.txt.
constexpr int kStepBatchRows = 4;

// Shared memory of one block, in accumulator elements.
inline int64_t step_smem(int64_t K, int64_t BV, int64_t G, int GT, int row_sets) {
  return 1                               // poisoned (an int): a later batch entry names this pool row
         + K                             // kf  [K]      phi(k)
         + G * K                         // qf  [G][K]   scale * phi(q)
         + BV                            // vf  [BV]     this block's value columns
         + K                             // zf  [K]      updated key sum
         + G                             // den [G]
         + int64_t(row_sets) * GT * BV;  // red [row_sets][GT][BV] partial outputs
}

template <class A, int W>
struct Vec {
  A x[W];
};

template <class A, int W>
__device__ __forceinline__ Vec<A, W> load_vec(const A* p) {
  Vec<A, W> r;
  if constexpr (W == 4 && sizeof(A) == 4) {
    const float4 f = *reinterpret_cast<const float4*>(p);
    r.x[0] = f.x, r.x[1] = f.y, r.x[2] = f.z, r.x[3] = f.w;
  } else {
#pragma unroll
    for (int i = 0; i < W; ++i) r.x[i] = p[i];
  }
  return r;
}

template <class A, int W>
__device__ __forceinline__ void store_vec(A* p, const Vec<A, W>& r) {
  if constexpr (W == 4 && sizeof(A) == 4) {
    *reinterpret_cast<float4*>(p) = make_float4(r.x[0], r.x[1], r.x[2], r.x[3]);
  } else {
#pragma unroll
    for (int i = 0; i < W; ++i) p[i] = r.x[i];
  }
}

__device__ __forceinline__ int64_t load_index(const LinearAttnStepParams& p, int64_t b) {
  if (p.state_indices == nullptr) return b;
  return p.state_indices_int64 ? static_cast<const int64_t*>(p.state_indices)[b]
                               : static_cast<const int32_t*>(p.state_indices)[b];
}

template <class T>
__device__ __forceinline__ const T* step_row(const ConstView& v, int64_t b, int64_t h) {
  return static_cast<const T*>(v.data) + b * v.stride_b + h * v.stride_h;
}

// GT query heads are accumulated per pass; W columns per vector. V % W == 0.
template <class T, int GT, int W>
__global__ void __launch_bounds__(kStepThreads) step_kernel(const LinearAttnStepParams p, int BV, int row_sets) {
  using A = typename AccOf<T>::type;
  extern __shared__ __align__(16) unsigned char smem_bytes[];
  const int K = static_cast<int>(p.head_dim_k), V = static_cast<int>(p.head_dim_v);
  const int G = static_cast<int>(p.num_heads / p.num_kv_heads);
  const int64_t b = blockIdx.x, g = blockIdx.y;
  const int c0 = blockIdx.z * BV;  // first value column of this block
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int cols = BV / W, col = tid % cols, set = tid / cols;
  const A scale = static_cast<A>(p.scale), eps = static_cast<A>(p.eps);
  const int64_t r = load_index(p, b);

  T* out = static_cast<T*>(p.o.data);
  auto fill_out = [&](A value) {
    for (int i = tid; i < G * BV; i += kStepThreads)
      out[b * p.o.stride_b + (g * G + i / BV) * p.o.stride_h + c0 + i % BV] = from_acc<T, A>(value);
  };
  if (r < 0 || r >= p.pool_size) {
    // A negative index is padding (zeros); an index past the pool cannot be reported without a
    // device sync, so its outputs are NaN and no state row changes.
    fill_out(r < 0 ? A(0) : A(NAN));
    return;
  }

  // ---- phase 0: the first batch of this thread's state rows, in flight during the preamble ----
  const int64_t state_row = r * p.num_kv_heads + g;
  A* S = static_cast<A*>(p.S) + state_row * K * V + c0;
  const bool active = set < row_sets;
  constexpr int R = kStepBatchRows;
  const int batch_stride = R * row_sets;  // rows between a thread's consecutive batches
  auto load_batch = [&](Vec<A, W>(&rows)[R], int k0) {
#pragma unroll
    for (int j = 0; j < R; ++j) {
      const int k = k0 + j * row_sets;
      if (active && k < K) rows[j] = load_vec<A, W>(S + int64_t(k) * V + col * W);
    }
  };
  Vec<A, W> batch[R];
  load_batch(batch, set);

  // ---- the duplicate scan: other batch entries naming row r, while the first batch is in flight ----
  // Each block compares its index with all B of them, the same B ints for every block (L2-resident):
  // at most one load per thread for B <= 256, B * 4 bytes (int64: 8) against the 2 * K * BV * 4
  // bytes of fp32 state the block reads and writes in DRAM (1 KiB against 128 KiB at B = 256,
  // K = V = 128). Its block-wide OR rides on phase 1's barrier, which the kernel has anyway; the
  // verdict "a later entry names r too" waits in shared memory (at offset 0: no address to keep),
  // because a flag kept in a register through phase 2 spilled at GT = 2. A separate detection
  // kernel would add a launch, about the whole step's time at small B (B1 H32 D128: 3.6 us), and a
  // scratch array to clear per call. A later entry's block may load rows of r in phase 0 while the
  // first entry's block writes them: it returns without using them.
  constexpr int kEarlier = 1, kLater = 2;  // an entry before b names row r / one after b does
  int shared_with = 0;
  if (p.state_indices != nullptr)
    for (int64_t i = tid; i < p.batch; i += kStepThreads)
      if (i != b && load_index(p, i) == r) shared_with |= i < b ? kEarlier : kLater;

  // ---- phase 1: phi(k), scale * phi(q), v and the updated key sum into shared memory ----
  int& poisoned = *reinterpret_cast<int*>(smem_bytes);  // this entry's outputs are NaN
  A* kf = reinterpret_cast<A*>(smem_bytes) + 1;
  A* qf = kf + K;
  A* vf = qf + G * K;
  A* zf = vf + BV;
  A* den = zf + K;
  A* red = den + G;
  if (tid == 0) poisoned = 0;

  for (int k = tid; k < K; k += kStepThreads) kf[k] = phi(p.feature_map, to_acc<A>(step_row<T>(p.k, b, g)[k]));
  for (int i = tid; i < G * K; i += kStepThreads)
    qf[i] = scale * phi(p.feature_map, to_acc<A>(step_row<T>(p.q, b, g * G + i / K)[i % K]));
  for (int v = tid; v < BV; v += kStepThreads) vf[v] = to_acc<A>(step_row<T>(p.v, b, g)[c0 + v]);
  if (__syncthreads_or(shared_with & kEarlier)) {  // row r belongs to an earlier entry: no state write
    fill_out(A(NAN));
    return;
  }
  if (shared_with & kLater) poisoned = 1;  // read after the barrier before the output reduction

  if (p.normalize) {
    A* z = static_cast<A*>(p.z) + state_row * K;
    for (int k = tid; k < K; k += kStepThreads) {
      const A zn = z[k] + kf[k];
      z[k] = zn;
      zf[k] = zn;
    }
    __syncthreads();
    for (int h = warp; h < G; h += kStepThreads / 32) {
      A d = 0;
      for (int k = lane; k < K; k += 32) d += qf[h * K + k] * zf[k];
      for (int off = 16; off > 0; off /= 2) d += __shfl_xor_sync(0xffffffffu, d, off);
      if (lane == 0) den[h] = d + eps;
    }
  }

  // ---- phase 2: S += k'^T v (first pass) and the partial outputs q'_h S of GT heads per pass ----
  for (int h0 = 0; h0 < G; h0 += GT) {
    Vec<A, W> acc[GT];
#pragma unroll
    for (int j = 0; j < GT; ++j)
#pragma unroll
      for (int i = 0; i < W; ++i) acc[j].x[i] = A(0);
    if (active) {
      Vec<A, W> vv;
#pragma unroll
      for (int i = 0; i < W; ++i) vv.x[i] = vf[col * W + i];
      if (h0 > 0) load_batch(batch, set);  // later passes read the rows the first pass updated
      for (int k0 = set; k0 < K; k0 += batch_stride) {
        const bool more = k0 + batch_stride < K;
        Vec<A, W> next[R];
        if (more) load_batch(next, k0 + batch_stride);
#pragma unroll
        for (int j = 0; j < R; ++j) {
          const int k = k0 + j * row_sets;
          if (k >= K) break;
          Vec<A, W>& s = batch[j];
          if (h0 == 0) {
#pragma unroll
            for (int i = 0; i < W; ++i) s.x[i] += kf[k] * vv.x[i];
            store_vec<A, W>(S + int64_t(k) * V + col * W, s);
          }
#pragma unroll
          for (int hj = 0; hj < GT; ++hj) {
            const A qk = h0 + hj < G ? qf[(h0 + hj) * K + k] : A(0);
#pragma unroll
            for (int i = 0; i < W; ++i) acc[hj].x[i] += qk * s.x[i];
          }
        }
        if (more) {
#pragma unroll
          for (int j = 0; j < R; ++j) batch[j] = next[j];
        }
      }
#pragma unroll
      for (int j = 0; j < GT; ++j)
#pragma unroll
        for (int i = 0; i < W; ++i) red[(set * GT + j) * BV + col * W + i] = acc[j].x[i];
    }
    __syncthreads();
    for (int i = tid; i < GT * BV; i += kStepThreads) {
      const int j = i / BV, v = i % BV, h = h0 + j;
      if (h >= G) continue;
      A o = 0;
      for (int s = 0; s < row_sets; ++s) o += red[(s * GT + j) * BV + v];
      if (p.normalize) o /= den[h];
      out[b * p.o.stride_b + (g * G + h) * p.o.stride_h + c0 + v] = from_acc<T, A>(poisoned ? A(NAN) : o);
    }
    __syncthreads();
  }
}

}  // namespace attnrnn::cuda
