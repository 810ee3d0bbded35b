#include "runtime/core/bucket_readiness.hpp"

namespace shardflow {

BucketReadiness::BucketReadiness(std::vector<std::uint32_t> sizes)
    : sizes_(std::move(sizes)), pending_(new std::atomic<std::uint32_t>[sizes_.size()]), ready_us_(sizes_.size(), -1) {
  reset();
}

void BucketReadiness::reset() {
  for (std::size_t b = 0; b < sizes_.size(); ++b) pending_[b].store(sizes_[b], std::memory_order_relaxed);
  std::lock_guard lock(run_mu_);
  ready_.assign(sizes_.size(), 0);
  run_ = 0;
}

std::pair<std::size_t, std::size_t> BucketReadiness::extend_ready_run(std::uint32_t b) {
  std::lock_guard lock(run_mu_);
  ready_[b] = 1;
  const std::size_t from = run_;
  while (run_ < ready_.size() && ready_[run_]) ++run_;
  return {from, run_};
}

}  // namespace shardflow
