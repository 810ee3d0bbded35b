#include "runtime/plans/interleave_lag.hpp"

#include <algorithm>
#include <cmath>

namespace shardflow {

std::size_t choose_interleave_lag(const std::vector<std::int64_t>& gradient_us, double reduce_ms, double sync_ms,
                                  const std::vector<double>& step_chain_ms, std::size_t max_lag) {
  std::vector<std::int64_t> ready;
  for (const auto t : gradient_us)
    if (t >= 0) ready.push_back(t);
  std::vector<double> chain;
  for (const auto c : step_chain_ms)
    if (c >= 0) chain.push_back(c);
  if (ready.size() < 2 || chain.empty() || max_lag == 0) return 0;
  std::sort(ready.begin(), ready.end());
  std::nth_element(chain.begin(), chain.begin() + std::ptrdiff_t(chain.size() / 2), chain.end());
  const double c = chain[chain.size() / 2];
  const double interval = double(ready.back() - ready.front()) / 1e3 / double(ready.size() - 1);
  const double r = std::max(0.0, reduce_ms), s = std::max(0.0, sync_ms);
  const bool link_bound = r + s > interval;
  if (r + c <= interval && !link_bound) return 0;  // the chain is done before the next bucket's gradients
  const double unbounded = double(max_lag) + 1;
  const double for_gradients = interval > 0 ? (r + c) / interval - 1 : unbounded;
  const double for_link = link_bound ? c / (r + s) : 0;
  const double lag = std::ceil(std::max(for_gradients, for_link));
  return std::clamp<std::size_t>(lag >= unbounded ? max_lag : std::size_t(std::max(1.0, lag)), 1, max_lag);
}

}  // namespace shardflow
