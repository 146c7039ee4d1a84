// The kernel time of a standalone probe's launch (scripts/wgmma_*_probe.cu), by CUDA events.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <vector>

// Median in microseconds of `reps` launches, each timed alone between two events.
template <class Launch>
double median_launch_us(Launch launch, int reps = 21) {
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0), cudaEventCreate(&e1);
  std::vector<float> ms(reps);
  for (float& m : ms) {
    cudaEventRecord(e0);
    launch();
    cudaEventRecord(e1);
    cudaEventSynchronize(e1);
    cudaEventElapsedTime(&m, e0, e1);
  }
  cudaEventDestroy(e0), cudaEventDestroy(e1);
  std::sort(ms.begin(), ms.end());
  return ms[reps / 2] * 1e3;
}
