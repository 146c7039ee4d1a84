// One decode token per sequence over a KV cache (flash-decoding), bandwidth bound.
//
// Phases:
//   append:  the block whose split holds row len = cache_seqlens[b] writes k_new, v_new there; every
//            block reads that row from k_new, v_new (nobody reads it from the cache: no race)
//   partial: block (b, split, kv head [, pass of GT query heads]) streams the split's keys once
//            for the G query heads of its kv head: scores in log2 units (q pre-scaled by
//            scale log2 e), a running (m, l, acc) per head, merged across lanes and warps in a
//            fixed order -> o directly when there is one split, else (m, l, acc[Dv]) per
//            (b, head, split) into the workspace
//   combine: per (b, head): M = max m_s, o = Σ acc_s 2^(m_s - M) / Σ l_s 2^(m_s - M)
// A length out of range (< 0, or no room for k_new) cannot be reported without a host sync: its
// outputs are NaN and nothing is written.
//
// Fast kernel (bf16/fp16/fp32, D = Dv in {64, 128}, 16-byte aligned rows): a key row is read by
// D / VEC lanes with 16-byte loads (VEC = 16 / sizeof(T) elements each), 32 / (D / VEC) keys per
// warp and load, U loads in flight per lane; each group of lanes keeps its own online softmax.
// Generic kernel (any dtype and head dims): one query head per block, one key per warp at a time,
// lanes over the head dims.
#pragma once

#include "common.cuh"

namespace attnrnn::cuda::sm {

constexpr int kStepWarps = 4, kStepThreads = 32 * kStepWarps;

struct StepPlan {
  int64_t split, splits;
  int passes;  // query-head passes per kv head (fast kernel)
};

// Cache length this step attends over, or -1 when cache_seqlens[b] is out of range.
__device__ __forceinline__ int64_t step_length(const SoftmaxAttnStepParams& p, int64_t b) {
  const int64_t len = p.cache_seqlens[b], extra = p.k_new.data != nullptr ? 1 : 0;
  return len < 0 || len + extra > p.max_seqlen ? -1 : len + extra;
}

// Row t of the keys (values): k_new (v_new) for the appended row t == tnew, else the cache.
template <class T>
__device__ __forceinline__ const T* step_key(const SoftmaxAttnStepParams& p, int64_t b, int64_t t, int64_t tnew,
                                            int64_t kvh, bool value) {
  const ConstView& nv = value ? p.v_new : p.k_new;
  const MutView& cv = value ? p.v_cache : p.k_cache;
  if (t == tnew) return static_cast<const T*>(nv.data) + b * nv.stride_b + kvh * nv.stride_h;
  return static_cast<const T*>(cv.data) + b * cv.stride_b + t * cv.stride_t + kvh * cv.stride_h;
}

// Append phase: row cache_seqlens[b] of both caches, by the block of split `sp` when it holds it.
template <class T>
__device__ __forceinline__ void step_append(const SoftmaxAttnStepParams& p, int64_t b, int64_t kvh, int64_t sp,
                                            int64_t split, int tid) {
  const int64_t t = p.cache_seqlens[b];
  if (p.k_new.data == nullptr || t / split != sp) return;
  for (int64_t d = tid; d < p.head_dim; d += kStepThreads)
    row<T>(p.k_cache, b, t, kvh)[d] = static_cast<const T*>(p.k_new.data)[b * p.k_new.stride_b + kvh * p.k_new.stride_h + d];
  for (int64_t d = tid; d < p.head_dim_v; d += kStepThreads)
    row<T>(p.v_cache, b, t, kvh)[d] = static_cast<const T*>(p.v_new.data)[b * p.v_new.stride_b + kvh * p.v_new.stride_h + d];
}

// Merges (m2, l2, a2) into (m, l, a): log2 units.
template <class A>
__device__ __forceinline__ void merge_scale(A m, A m2, A& f1, A& f2) {
  const A M = fmax(m, m2), Mu = M == neg_inf<A>() ? A(0) : M;
  f1 = exp2(m - Mu);
  f2 = exp2(m2 - Mu);
}

// Final phase of a partial block: W warps' (m, l, acc[n]) in shared memory -> o or a partial row.
template <class T, class A>
__device__ __forceinline__ void step_finish(const SoftmaxAttnStepParams& p, const StepPlan& pl, int64_t b, int64_t h,
                                            int64_t sp, const A* wm, const A* wl, const A* wa, int stride, int n,
                                            int d) {
  A M = neg_inf<A>();
  for (int w = 0; w < kStepWarps; ++w) M = fmax(M, wm[w * stride]);
  const A Mu = M == neg_inf<A>() ? A(0) : M;
  A l = A(0), a = A(0);
  for (int w = 0; w < kStepWarps; ++w) {
    const A f = exp2(wm[w * stride] - Mu);
    l += f * wl[w * stride];
    a += f * wa[w * stride * n];
  }
  if (pl.splits == 1) {
    static_cast<T*>(p.o.data)[b * p.o.stride_b + h * p.o.stride_h + d] = from_acc<T, A>(l <= A(0) ? A(0) : a / l);  // NaN l (NaN scores): NaN
  } else {
    A* ws = static_cast<A*>(p.workspace) + ((b * p.num_heads + h) * pl.splits + sp) * (p.head_dim_v + 2);
    if (d == 0) ws[0] = M, ws[1] = l;
    ws[2 + d] = a;
  }
}

template <class T>
__device__ __forceinline__ void step_fill(const SoftmaxAttnStepParams& p, int64_t b, int64_t h, int64_t nh, float v,
                                          int tid) {
  for (int64_t e = tid; e < nh * p.head_dim_v; e += kStepThreads)
    static_cast<T*>(p.o.data)[b * p.o.stride_b + (h + e / p.head_dim_v) * p.o.stride_h + e % p.head_dim_v] =
        from_acc<T, typename AccOf<T>::type>(static_cast<typename AccOf<T>::type>(v));
}

template <class T, int VEC>
__device__ __forceinline__ void unpack(const uint4& r, float (&f)[VEC]) {
  if constexpr (sizeof(T) == 4) {
    f[0] = __uint_as_float(r.x), f[1] = __uint_as_float(r.y), f[2] = __uint_as_float(r.z), f[3] = __uint_as_float(r.w);
  } else {
    const T* x = reinterpret_cast<const T*>(&r);
#pragma unroll
    for (int e = 0; e < VEC; ++e) f[e] = to_acc<float>(x[e]);
  }
}

template <class T, int D, int GT, int U>
__global__ void __launch_bounds__(kStepThreads) step_fast_kernel(const SoftmaxAttnStepParams p, const StepPlan pl) {
  constexpr int VEC = 16 / sizeof(T), LPK = D / VEC, KPW = 32 / LPK;
  __shared__ float red_m[kStepWarps][GT], red_l[kStepWarps][GT];  // per warp, per head
  __shared__ float red_a[kStepWarps][GT][D];                       // per warp, per head, per column
  const int64_t b = blockIdx.x / pl.splits, sp = blockIdx.x % pl.splits;
  const int64_t kvh = blockIdx.y / pl.passes, G = p.num_heads / p.num_kv_heads;
  const int64_t h0 = kvh * G + (blockIdx.y % pl.passes) * GT;
  const int nh = static_cast<int>(kvh * G + G - h0 < GT ? kvh * G + G - h0 : GT);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, slot = lane / LPK, ch = lane % LPK;
  const int64_t len = step_length(p, b), s0 = sp * pl.split;
  if (len < 0) {
    if (pl.splits == 1) step_fill<T>(p, b, h0, nh, NAN, tid);
    return;
  }
  if (blockIdx.y % pl.passes == 0) step_append<T>(p, b, kvh, sp, pl.split, tid);
  if (s0 >= len) {
    if (pl.splits == 1) step_fill<T>(p, b, h0, nh, 0.f, tid);
    return;
  }
  const int64_t s1 = len - s0 < pl.split ? len : s0 + pl.split;
  const int64_t tnew = p.k_new.data != nullptr ? p.cache_seqlens[b] : -1;

  // This lane's columns [ch VEC, ch VEC + VEC) of q for each head, times scale log2 e.
  const float c = static_cast<float>(p.scale) * kLog2e;
  float qf[GT][VEC], m[GT], l[GT], acc[GT][VEC];
#pragma unroll
  for (int j = 0; j < GT; ++j) {
    const T* q = static_cast<const T*>(p.q.data) + b * p.q.stride_b + (h0 + (j < nh ? j : 0)) * p.q.stride_h;
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      qf[j][e] = j < nh ? to_acc<float>(q[ch * VEC + e]) * c : 0.f;
      acc[j][e] = 0.f;
    }
    m[j] = -INFINITY;
    l[j] = 0.f;
  }

  // Partial: U loads of K and V rows in flight per lane, then scores and the online update.
  for (int64_t base = s0; base < s1; base += U * kStepWarps * KPW) {
    uint4 kr[U], vr[U];
    bool valid[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t t = base + (u * kStepWarps + warp) * KPW + slot;
      valid[u] = t < s1;
      kr[u] = vr[u] = make_uint4(0, 0, 0, 0);
      if (valid[u]) {
        kr[u] = *reinterpret_cast<const uint4*>(step_key<T>(p, b, t, tnew, kvh, false) + ch * VEC);
        vr[u] = *reinterpret_cast<const uint4*>(step_key<T>(p, b, t, tnew, kvh, true) + ch * VEC);
      }
    }
    float sc[U][GT];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float kf[VEC];
      unpack<T, VEC>(kr[u], kf);
#pragma unroll
      for (int j = 0; j < GT; ++j) {
        float dot = 0.f;
#pragma unroll
        for (int e = 0; e < VEC; ++e) dot += qf[j][e] * kf[e];
#pragma unroll
        for (int o = LPK / 2; o > 0; o /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, o);
        sc[u][j] = valid[u] ? dot : -INFINITY;
      }
    }
#pragma unroll
    for (int j = 0; j < GT; ++j) {
      float mx = m[j];
#pragma unroll
      for (int u = 0; u < U; ++u) mx = fmaxf(mx, sc[u][j]);
      const float m_use = mx == -INFINITY ? 0.f : mx;
      const float alpha = exp2_fast(m[j] - m_use);
      m[j] = mx;
      l[j] *= alpha;
#pragma unroll
      for (int e = 0; e < VEC; ++e) acc[j][e] *= alpha;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        float vf[VEC];
        unpack<T, VEC>(vr[u], vf);
        const float pr = exp2_fast(sc[u][j] - m_use);
        l[j] += pr;
#pragma unroll
        for (int e = 0; e < VEC; ++e) acc[j][e] += pr * vf[e];
      }
    }
  }

  // Merge the key groups of the warp (lanes ch, ch + LPK, ...), then publish per warp.
#pragma unroll
  for (int o = LPK; o < 32; o *= 2)
#pragma unroll
    for (int j = 0; j < GT; ++j) {
      const float m2 = __shfl_xor_sync(0xffffffffu, m[j], o), l2 = __shfl_xor_sync(0xffffffffu, l[j], o);
      float f1, f2;
      merge_scale(m[j], m2, f1, f2);
      m[j] = fmaxf(m[j], m2);
      l[j] = l[j] * f1 + l2 * f2;
#pragma unroll
      for (int e = 0; e < VEC; ++e) acc[j][e] = acc[j][e] * f1 + __shfl_xor_sync(0xffffffffu, acc[j][e], o) * f2;
    }
  if (lane < LPK) {
#pragma unroll
    for (int j = 0; j < GT; ++j) {
#pragma unroll
      for (int e = 0; e < VEC; ++e) red_a[warp][j][ch * VEC + e] = acc[j][e];
      if (lane == 0) red_m[warp][j] = m[j], red_l[warp][j] = l[j];
    }
  }
  __syncthreads();
  for (int e = tid; e < nh * D; e += kStepThreads) {
    const int j = e / D, d = e % D;
    step_finish<T, float>(p, pl, b, h0 + j, sp, &red_m[0][j], &red_l[0][j], &red_a[0][j][d], GT, D, d);
  }
}

template <class T>
__global__ void __launch_bounds__(kStepThreads) step_generic_kernel(const SoftmaxAttnStepParams p, const StepPlan pl) {
  using A = typename AccOf<T>::type;
  constexpr int kCols = 8;  // 8 x 32 lanes >= 256 head dims
  __shared__ A red_m[kStepWarps], red_l[kStepWarps];  // per warp
  __shared__ A red_a[kStepWarps][kCols * 32];           // per warp, per value column
  const int64_t b = blockIdx.x / pl.splits, sp = blockIdx.x % pl.splits, h = blockIdx.y;
  const int64_t kvh = h / (p.num_heads / p.num_kv_heads);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int D = static_cast<int>(p.head_dim), Dv = static_cast<int>(p.head_dim_v);
  const int64_t len = step_length(p, b), s0 = sp * pl.split;
  if (len < 0) {
    if (pl.splits == 1) step_fill<T>(p, b, h, 1, NAN, tid);
    return;
  }
  if (h == kvh * (p.num_heads / p.num_kv_heads)) step_append<T>(p, b, kvh, sp, pl.split, tid);
  if (s0 >= len) {
    if (pl.splits == 1) step_fill<T>(p, b, h, 1, 0.f, tid);
    return;
  }
  const int64_t s1 = len - s0 < pl.split ? len : s0 + pl.split;
  const int64_t tnew = p.k_new.data != nullptr ? p.cache_seqlens[b] : -1;

  const A c = static_cast<A>(p.scale) * static_cast<A>(1.4426950408889634073599);
  const T* q = static_cast<const T*>(p.q.data) + b * p.q.stride_b + h * p.q.stride_h;
  A qf[kCols], acc[kCols], m = neg_inf<A>(), l = A(0);
#pragma unroll
  for (int e = 0; e < kCols; ++e) {
    qf[e] = lane + 32 * e < D ? to_acc<A>(q[lane + 32 * e]) * c : A(0);
    acc[e] = A(0);
  }
  for (int64_t t = s0 + warp; t < s1; t += kStepWarps) {
    const T* kr = step_key<T>(p, b, t, tnew, kvh, false);
    const T* vr = step_key<T>(p, b, t, tnew, kvh, true);
    A dot = A(0);
#pragma unroll
    for (int e = 0; e < kCols; ++e)
      if (lane + 32 * e < D) dot += qf[e] * to_acc<A>(kr[lane + 32 * e]);
    dot = warp_sum(dot);
    const A m_new = fmax(m, dot);
    const A alpha = exp2(m - m_new), pr = exp2(dot - m_new);
    l = l * alpha + pr;
    m = m_new;
#pragma unroll
    for (int e = 0; e < kCols; ++e)
      if (lane + 32 * e < Dv) acc[e] = acc[e] * alpha + pr * to_acc<A>(vr[lane + 32 * e]);
  }
#pragma unroll
  for (int e = 0; e < kCols; ++e) red_a[warp][lane + 32 * e] = acc[e];
  if (lane == 0) red_m[warp] = m, red_l[warp] = l;
  __syncthreads();
  for (int d = tid; d < Dv; d += kStepThreads) step_finish<T, A>(p, pl, b, h, sp, red_m, red_l, &red_a[0][d], 1, kCols * 32, d);
}

// Combine phase: one block per (b, head) over the splits that hold keys.
template <class T>
__global__ void __launch_bounds__(kStepThreads) step_combine_kernel(const SoftmaxAttnStepParams p, const StepPlan pl) {
  using A = typename AccOf<T>::type;
  const int64_t b = blockIdx.x / p.num_heads, h = blockIdx.x % p.num_heads;
  const int64_t len = step_length(p, b), stride = p.head_dim_v + 2;
  T* out = static_cast<T*>(p.o.data) + b * p.o.stride_b + h * p.o.stride_h;
  const int64_t n = len < 0 ? 0 : (len + pl.split - 1) / pl.split;
  const A* ws = static_cast<const A*>(p.workspace) + blockIdx.x * pl.splits * stride;
  A M = neg_inf<A>();
  for (int64_t s = 0; s < n; ++s) M = fmax(M, ws[s * stride]);
  const A Mu = M == neg_inf<A>() ? A(0) : M;
  for (int64_t d = threadIdx.x; d < p.head_dim_v; d += kStepThreads) {
    A l = A(0), a = A(0);
    for (int64_t s = 0; s < n; ++s) {
      const A f = exp2(ws[s * stride] - Mu);
      l += f * ws[s * stride + 1];
      a += f * ws[s * stride + 2 + d];
    }
    // no key: 0; NaN scores leave l NaN (fmax dropped them from M), and the output NaN
    out[d] = from_acc<T, A>(len < 0 ? A(NAN) : (l <= A(0) ? A(0) : a / l));
  }
}

}  // namespace attnrnn::cuda::sm
