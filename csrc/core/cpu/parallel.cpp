#include "parallel.h"

#include <algorithm>
#include <thread>
#include <vector>

namespace attnrnn::cpu {

namespace {

// The torch-free default: split [0, n) into one contiguous range per thread.
void default_parallel_for(int num_threads, int64_t n, int64_t grain, CpuExecutor::Body body,
                          void* body_ctx) {
  int64_t threads = num_threads > 0 ? num_threads : std::max(1u, std::thread::hardware_concurrency());
  threads = std::min<int64_t>(threads, (n + std::max<int64_t>(grain, 1) - 1) / std::max<int64_t>(grain, 1));
  if (threads <= 1) {
    body(body_ctx, 0, n);
    return;
  }
  const int64_t per = (n + threads - 1) / threads;
  std::vector<std::thread> pool;
  pool.reserve(threads - 1);
  for (int64_t t = 1; t < threads; ++t) {
    const int64_t begin = t * per, end = std::min(n, begin + per);
    if (begin < end) pool.emplace_back(body, body_ctx, begin, end);
  }
  body(body_ctx, 0, std::min(n, per));
  for (auto& th : pool) th.join();
}

}  // namespace

void run_parallel(const CpuExecutor& executor, int64_t n, int64_t grain, CpuExecutor::Body body,
                  void* body_ctx) {
  if (n <= 0) return;
  if (executor.parallel_for != nullptr) {
    executor.parallel_for(executor.self, n, grain, body, body_ctx);
  } else {
    default_parallel_for(executor.num_threads, n, grain, body, body_ctx);
  }
}

}  // namespace attnrnn::cpu
