// The bridge from the actors back to trainer threads: the bucket actor (DDP) or the shard actor
// (ZeRO) counts each bucket's completion here, directly (it only takes a lock and notifies: a
// separate actor in between cost one message hop per bucket and did nothing else); Runtime::wait()
// and wait_param() block on it (a trainer thread may block; a CAF scheduler thread never).
//
// Counts only grow (one per bucket per synchronised iteration), so a waiter for iteration k is
// never confused by completions of iteration k+1, which forward prefetch lets start early.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "runtime/core/failure.hpp"

namespace shardflow {

class IterationSignal {
 public:
  explicit IterationSignal(std::size_t nbuckets) : done_(nbuckets, 0) {}

  void bucket_done(std::uint32_t b, const BucketFailure& f) {
    {
      std::lock_guard lock(mu_);
      if (f) {
        if (!failure_) failure_ = f;  // the first failure wins; later ones are consequences
      } else if (b < done_.size()) {
        ++done_[b];
      }
    }
    cv_.notify_all();
  }

  enum class Outcome { complete, failed, timed_out };

  // Until every bucket completed `target` iterations.
  Outcome wait_all(std::uint64_t target, std::chrono::steady_clock::time_point deadline) {
    std::unique_lock lock(mu_);
    auto all = [&] {
      for (auto d : done_)
        if (d < target) return false;
      return true;
    };
    if (!cv_.wait_until(lock, deadline, [&] { return failure_ || all(); })) return Outcome::timed_out;
    return failure_ ? Outcome::failed : Outcome::complete;
  }

  // Until bucket b completed `target` iterations.
  Outcome wait_bucket(std::uint32_t b, std::uint64_t target, std::chrono::steady_clock::time_point deadline) {
    std::unique_lock lock(mu_);
    if (!cv_.wait_until(lock, deadline, [&] { return failure_ || done_[b] >= target; })) return Outcome::timed_out;
    return failure_ ? Outcome::failed : Outcome::complete;
  }

  BucketFailure failure() const {
    std::lock_guard lock(mu_);
    return failure_;
  }

  std::vector<std::uint32_t> pending(std::uint64_t target) const {
    std::lock_guard lock(mu_);
    std::vector<std::uint32_t> out;
    for (std::uint32_t b = 0; b < done_.size(); ++b)
      if (done_[b] < target) out.push_back(b);
    return out;
  }

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::uint64_t> done_;
  BucketFailure failure_;
};

}  // namespace shardflow
