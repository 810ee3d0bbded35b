// The bridge from the actors back to the trainer thread: the iteration actor marks buckets done
// here, and Runtime::wait() blocks on it (a trainer thread may block; a CAF scheduler thread never).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "actors/messages.hpp"

namespace shardflow {

class IterationSignal {
 public:
  explicit IterationSignal(std::size_t nbuckets) : done_(nbuckets, 0) {}

  void bucket_done(std::uint32_t b, const msg::Failure& f) {
    {
      std::lock_guard lock(mu_);
      if (b < done_.size() && !done_[b]) {
        done_[b] = 1;
        ++ndone_;
      }
      if (f && !failure_) failure_ = f;  // the first failure wins; later ones are consequences
    }
    cv_.notify_all();
  }

  enum class Outcome { complete, failed, timed_out };

  Outcome wait_until(std::chrono::steady_clock::time_point deadline) {
    std::unique_lock lock(mu_);
    if (!cv_.wait_until(lock, deadline, [&] { return failure_ || ndone_ == done_.size(); }))
      return Outcome::timed_out;
    return failure_ ? Outcome::failed : Outcome::complete;
  }

  msg::Failure failure() const {
    std::lock_guard lock(mu_);
    return failure_;
  }

  std::vector<std::uint32_t> pending() const {
    std::lock_guard lock(mu_);
    std::vector<std::uint32_t> out;
    for (std::uint32_t b = 0; b < done_.size(); ++b)
      if (!done_[b]) out.push_back(b);
    return out;
  }

  void reset() {
    std::lock_guard lock(mu_);
    std::fill(done_.begin(), done_.end(), 0);
    ndone_ = 0;
    failure_ = {};
  }

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<char> done_;
  std::size_t ndone_ = 0;
  msg::Failure failure_;
};

}  // namespace shardflow
