// The test override of the CUDA chunk plan (attnrnn/testing.h): one process-wide value, read by
// every chunk call's plan.
#include "attnrnn/testing.h"

#include <mutex>

namespace attnrnn::testing {

namespace {
std::mutex override_mutex;
PlanOverride current;
}  // namespace

void set_plan_override(const PlanOverride& override_) {
  std::lock_guard<std::mutex> lock(override_mutex);
  current = override_;
}

PlanOverride plan_override() {
  std::lock_guard<std::mutex> lock(override_mutex);
  return current;
}

}  // namespace attnrnn::testing
