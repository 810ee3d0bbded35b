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
  const double unbounded = double(max_lag) + 1;
  double lag = 0;
  if (r + s > interval) {
    // The link is the bottleneck: lag x (r + s) of link work covers the chain. Further lag costs
    // nothing while the syncs that trail the last reduction fit in the work the link still has
    // queued when the last gradient comes; take it, since the link times measured at lag 0
    // include the hand-over to the comm stream that a deeper queue no longer pays.
    const double B = double(ready.size());
    const double backlog = B * (r + s) - (B - 1) * interval - r;
    lag = std::max({1.0, std::ceil(c / (r + s)), s > 0 ? std::floor(backlog / s) - 1 : unbounded});
  }
  else if (r + c + s > interval)  // the next reduction would queue behind the sync that waits for the step
    lag = interval > 0 ? std::ceil((r + c + s) / interval - 1) : unbounded;
  else
    return 0;
  return std::clamp<std::size_t>(lag >= unbounded ? max_lag : std::size_t(std::max(1.0, lag)), 1, max_lag);
}

}  // namespace shardflow
