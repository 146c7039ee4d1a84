#include "parallel.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace attnrnn::cpu {

namespace {

// One parallel loop: [0, n) cut into `tasks` contiguous ranges of `per` items, taken by the
// caller and the pool's workers in any order (each range is computed by one thread, so results do
// not depend on who takes it).
struct Job {
  CpuExecutor::Body body;
  void* ctx;
  int64_t n, per, tasks;
  std::atomic<int64_t> next{0};
  int64_t done = 0;         // guarded by Pool::mutex
  int users = 0;            // workers inside work(); guarded by Pool::mutex
  std::exception_ptr error;  // the first exception a range threw; guarded by Pool::mutex
};

// Set while a thread runs a range of a job: a parallel loop nested inside runs serially.
thread_local bool t_inside_job = false;

// Persistent worker threads: spawning threads per call costs tens of microseconds, as much as a
// whole decode step. One job runs at a time; a call that finds the pool busy (another caller
// thread) or comes from inside a job (a nested loop) runs serially. An exception thrown by a range
// is rethrown to the caller once every worker has left the job.
class Pool {
 public:
  ~Pool() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    for (auto& t : workers_) t.join();
  }

  bool try_run(int threads, int64_t n, CpuExecutor::Body body, void* ctx) {
    std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
    if (!busy.owns_lock()) return false;
    Job job;
    job.body = body;
    job.ctx = ctx;
    job.n = n;
    job.per = (n + threads - 1) / threads;
    job.tasks = (n + job.per - 1) / job.per;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      while (static_cast<int>(workers_.size()) < threads - 1) workers_.emplace_back([this] { worker(); });
      job_ = &job;
      ++generation_;
    }
    wake_.notify_all();
    work(job);
    std::unique_lock<std::mutex> lock(mutex_);
    finished_.wait(lock, [&] { return job.done == job.tasks && job.users == 0; });
    job_ = nullptr;
    if (job.error) std::rethrow_exception(job.error);  // after every worker has left the job
    return true;
  }

 private:
  void work(Job& job) {
    t_inside_job = true;
    for (int64_t t = job.next.fetch_add(1); t < job.tasks; t = job.next.fetch_add(1)) {
      const int64_t begin = t * job.per;
      std::exception_ptr error;
      try {
        job.body(job.ctx, begin, std::min(job.n, begin + job.per));
      } catch (...) {
        error = std::current_exception();
      }
      std::lock_guard<std::mutex> lock(mutex_);
      if (error && !job.error) job.error = error;
      if (++job.done == job.tasks) finished_.notify_all();
    }
    t_inside_job = false;
  }

  void worker() {
    uint64_t seen = 0;
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      wake_.wait(lock, [&] { return stop_ || (job_ != nullptr && generation_ != seen); });
      if (stop_) return;
      seen = generation_;
      Job& job = *job_;
      ++job.users;
      lock.unlock();
      work(job);
      lock.lock();
      if (--job.users == 0) finished_.notify_all();
    }
  }

  std::mutex busy_;   // held by the caller of the job in flight
  std::mutex mutex_;  // guards everything below and the jobs' done/users counters
  std::condition_variable wake_, finished_;
  std::vector<std::thread> workers_;
  Job* job_ = nullptr;
  uint64_t generation_ = 0;
  bool stop_ = false;
};

Pool& pool() {
  static Pool instance;
  return instance;
}

void default_parallel_for(int num_threads, int64_t n, int64_t grain, CpuExecutor::Body body, void* body_ctx) {
  const int64_t g = std::max<int64_t>(grain, 1);
  int64_t threads = num_threads > 0 ? num_threads : std::max(1u, std::thread::hardware_concurrency());
  threads = std::min<int64_t>(threads, (n + g - 1) / g);
  if (threads <= 1 || t_inside_job || !pool().try_run(static_cast<int>(threads), n, body, body_ctx))
    body(body_ctx, 0, n);
}

}  // namespace

int executor_threads(const CpuExecutor& executor) {
  if (executor.parallel_for != nullptr) return 0;
  return executor.num_threads > 0 ? executor.num_threads
                                  : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

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
