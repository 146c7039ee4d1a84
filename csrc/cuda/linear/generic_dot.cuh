// The inner sums shared by the generic (CUDA-core) chunk kernels, generic_forward.cuh and
// generic_backward.cuh.
//
// Each element those kernels compute (a score, a denominator, an output, a state entry, or their
// gradients) is a dot product of a row or a column of one shared-memory tile with a row or a
// column of another. x and y point at the first element; sx and sy are the steps between
// elements: 1 along a row, the tile's pitch down a column. E.g. row t of Qs against column v of
// S is dot(acc, Qs + t * KP, 1, S + v, BV, K). The sums start from acc and run in order of k,
// with the same FMAs as the loops they replace, so the numerics are those of the loops.
//
// What stays in the kernels, on purpose (checked against the SASS of all four dtypes):
// - the block-strided loops over a tile and the index arithmetic into the tiles: in a helper,
//   nvcc hoists less out of the chunk loop (other registers, spills in fp64);
// - a few sums that are written out although they are dot()s (marked "written out" there):
//   through dot() they shift ptxas's schedule of the 16-bit kernels or their register count.
#pragma once

#include "args.cuh"

namespace attnrnn::cuda {

// acc + sum over begin <= k < end of x[k sx] y[k sy].
template <class A>
__device__ __forceinline__ A dot(A acc, const A* x, int sx, const A* y, int sy, int begin, int end) {
  for (int k = begin; k < end; ++k) acc += x[k * sx] * y[k * sy];
  return acc;
}

// acc + sum over k < n of x[k sx] y[k sy].
template <class A>
__device__ __forceinline__ A dot(A acc, const A* x, int sx, const A* y, int sy, int n) {
  return dot(acc, x, sx, y, sy, 0, n);
}

// acc + sum over k < n of x[k sx].
template <class A>
__device__ __forceinline__ A sum(A acc, const A* x, int sx, int n) {
  for (int k = 0; k < n; ++k) acc += x[k * sx];
  return acc;
}

}  // namespace attnrnn::cuda
