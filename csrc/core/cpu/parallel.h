// Parallel loops of the CPU kernels over an executor (the caller's, or the library's threads).
#pragma once

#include <cstdint>
#include <utility>

#include "attnrnn/attnrnn.h"

namespace attnrnn::cpu {

// Runs the executor's parallel_for, or the default one when it has none.
void run_parallel(const CpuExecutor& executor, int64_t n, int64_t grain, CpuExecutor::Body body,
                  void* body_ctx);

// Threads the default executor would use; 0 when a custom parallel_for decides.
int executor_threads(const CpuExecutor& executor);

// parallel_for(executor, n, grain, [&](int64_t begin, int64_t end) { ... });
template <class F>
void parallel_for(const CpuExecutor& executor, int64_t n, int64_t grain, F&& f) {
  if (n <= 0) return;
  auto trampoline = [](void* ctx, int64_t begin, int64_t end) { (*static_cast<F*>(ctx))(begin, end); };
  run_parallel(executor, n, grain, trampoline, &f);
}

}  // namespace attnrnn::cpu
