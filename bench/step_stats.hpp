// Step-time statistics shared by the MLP benchmarks: the first steps (page faults, thread start,
// the one-time bucket rebuild) are left out; median and p90 of the rest.
#pragma once

#include <algorithm>
#include <vector>

namespace shardflow::bench {

struct StepStats {
  double median = 0, p90 = 0;
};

inline StepStats step_stats(const std::vector<double>& step_ms, std::ptrdiff_t warmup = 5) {
  if (step_ms.empty()) return {};
  std::vector<double> t(step_ms.begin() + std::min(warmup, std::ptrdiff_t(step_ms.size()) - 1), step_ms.end());
  std::sort(t.begin(), t.end());
  return {t[t.size() / 2], t[t.size() * 9 / 10]};
}

}  // namespace shardflow::bench
