// The fused feature maps phi and their derivatives, one definition for the CPU kernels and the
// CUDA kernels (host and device functions under nvcc, plain inline functions elsewhere).
#pragma once

#include <math.h>

#include "attnrnn/attnrnn.h"
#include "host_device.h"

namespace attnrnn {

template <class A>
ATTNRNN_HOST_DEVICE A exp_of(A x);
template <>
ATTNRNN_HOST_DEVICE float exp_of<float>(float x) { return expf(x); }
template <>
ATTNRNN_HOST_DEVICE double exp_of<double>(double x) { return exp(x); }

// phi(x): elu(x) + 1, relu(x) (as torch.relu: NaN stays NaN, -0 stays -0), or x itself.
template <class A>
ATTNRNN_HOST_DEVICE A phi(FeatureMap fm, A x) {
  switch (fm) {
    case FeatureMap::kElu1: return x > A(0) ? x + A(1) : exp_of(x);
    case FeatureMap::kRelu: return x < A(0) ? A(0) : x;
    default: return x;
  }
}

// phi'(x).
template <class A>
ATTNRNN_HOST_DEVICE A dphi(FeatureMap fm, A x) {
  switch (fm) {
    case FeatureMap::kElu1: return x > A(0) ? A(1) : exp_of(x);
    case FeatureMap::kRelu: return x > A(0) ? A(1) : A(0);
    default: return A(1);
  }
}

// phi'(x) from y = phi(x), without elu1's exp: elu1's is y itself where x <= 0 (y = exp(x) <= 1)
// and 1 where x > 0 (y = x + 1, rounded to 1 at the smallest x); relu's is 1 exactly where y > 0,
// as where x > 0. A NaN gives NaN (elu1) or 0 (relu), as dphi of a NaN x does.
template <class A>
ATTNRNN_HOST_DEVICE A dphi_of_phi(FeatureMap fm, A y) {
  switch (fm) {
    case FeatureMap::kElu1: return y > A(1) ? A(1) : y;
    case FeatureMap::kRelu: return y > A(0) ? A(1) : A(0);
    default: return A(1);
  }
}

}  // namespace attnrnn
