// The rank's own failure: sticky once any of its collectives, requests or steps failed. The first
// failure is kept as it was thrown (its type too), every later call rethrows it, and the peers are
// told at once (Communicator::abort) instead of waiting for their timeout. Runtime::Impl::fail and
// the rank actor's unanswered messages both end here.
#pragma once

#include <atomic>
#include <exception>
#include <mutex>

namespace shardflow {

class RankFailure {
 public:
  bool failed() const { return failed_.load(std::memory_order_acquire); }
  // Keeps `e` when it is the first failure; marks the rank failed either way.
  void record(std::exception_ptr e) {
    {
      std::lock_guard lock(mu_);
      if (!first_) first_ = std::move(e);
    }
    failed_.store(true, std::memory_order_release);
  }
  void rethrow_if_failed() const {
    if (!failed()) return;
    std::lock_guard lock(mu_);
    std::rethrow_exception(first_);
  }

 private:
  mutable std::mutex mu_;
  std::exception_ptr first_;
  std::atomic<bool> failed_{false};
};

}  // namespace shardflow
