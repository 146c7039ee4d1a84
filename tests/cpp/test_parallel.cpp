// The CPU thread pool behind every kernel: each index runs exactly once, an exception thrown by one
// range reaches the caller (and the pool keeps working), and a loop nested inside a loop runs.
#include <atomic>
#include <cstdio>
#include <stdexcept>
#include <vector>

#include "cpu/parallel.h"

using attnrnn::CpuExecutor;
using attnrnn::cpu::parallel_for;

namespace {

int failures = 0;

void expect(bool ok, const char* what) {
  if (!ok) {
    std::printf("FAILED: %s\n", what);
    ++failures;
  }
}

void each_index_runs_once(int threads) {
  CpuExecutor ex;
  ex.num_threads = threads;
  for (int64_t n : {1, 2, 3, 7, 64, 1001}) {
    std::vector<std::atomic<int>> hits(n);
    parallel_for(ex, n, 1, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) hits[i]++;
    });
    bool ok = true;
    for (auto& h : hits) ok = ok && h.load() == 1;
    expect(ok, "every index runs exactly once");
  }
}

void exception_reaches_the_caller() {
  CpuExecutor ex;
  ex.num_threads = 4;
  bool caught = false;
  try {
    parallel_for(ex, 8, 1, [&](int64_t b, int64_t) {
      if (b >= 4) throw std::runtime_error("range failed");
    });
  } catch (const std::runtime_error&) {
    caught = true;
  }
  expect(caught, "an exception thrown by a range is rethrown to the caller");
  std::atomic<int64_t> sum{0};
  parallel_for(ex, 100, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) sum += i;
  });
  expect(sum.load() == 4950, "the pool works after an exception");
}

void nested_loops_run() {
  CpuExecutor ex;
  ex.num_threads = 3;
  std::atomic<int64_t> count{0};
  parallel_for(ex, 6, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i)
      parallel_for(ex, 10, 1, [&](int64_t b2, int64_t e2) { count += e2 - b2; });
  });
  expect(count.load() == 60, "a nested loop covers its range");
}

}  // namespace

int main() {
  for (int threads : {1, 2, 4}) each_index_runs_once(threads);
  exception_reaches_the_caller();
  nested_loops_run();
  std::printf("test_parallel: %s\n", failures == 0 ? "ok" : "FAILED");
  return failures == 0 ? 0 : 1;
}
