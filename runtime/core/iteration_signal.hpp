// The bridge from the actors back to the trainer: the bucket actor (DDP) or the shard actor (ZeRO)
// counts each bucket's completion here, directly (it only takes a lock and notifies: a separate
// actor in between cost one message hop per bucket and did nothing else). `on_done` then tells the
// rank actor, which answers the requests waiting on it (Note [The rank actor]); the runtime's
// own waits between iterations (checkpoints, the end of a run) block here on a rank's thread, never
// on a CAF scheduler thread.
//
// Counts only grow (one per bucket per synchronised iteration), so a waiter for iteration k is
// never confused by completions of iteration k+1, which forward prefetch lets start early.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "runtime/core/failure.hpp"

namespace shardflow {

class IterationSignal {
 public:
  // Called after each count (or failure) with the bucket, its new count and the failure, on the
  // thread that reported it.
  using OnDone = std::function<void(std::uint32_t bucket, std::uint64_t count, const BucketFailure& f)>;
  explicit IterationSignal(std::size_t nbuckets, OnDone on_done = {}) : done_(nbuckets, 0), on_done_(std::move(on_done)) {}

  void bucket_done(std::uint32_t b, const BucketFailure& f) {
    std::uint64_t count = 0;
    {
      std::lock_guard lock(mu_);
      if (f) {
        if (!failure_) failure_ = f;  // the first failure wins; later ones are consequences
      } else if (b < done_.size()) {
        count = ++done_[b];
      }
    }
    cv_.notify_all();
    if (on_done_) on_done_(b, count, f);
  }

  // Without waiting: whether bucket b completed `target` iterations.
  bool done(std::uint32_t b, std::uint64_t target) const {
    std::lock_guard lock(mu_);
    return done_[b] >= target;
  }

  enum class Outcome { complete, failed, timed_out };

  // Until every bucket completed `target` iterations.
  Outcome wait_all(std::uint64_t target, std::chrono::steady_clock::time_point deadline) {
    std::unique_lock lock(mu_);
    if (!cv_.wait_until(lock, deadline, [&] { return failure_ || all_at(target); })) return Outcome::timed_out;
    return failure_ ? Outcome::failed : Outcome::complete;
  }

  // Without waiting: whether every bucket completed `target` iterations.
  bool all_done(std::uint64_t target) const {
    std::lock_guard lock(mu_);
    return all_at(target);
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
  bool all_at(std::uint64_t target) const {  // under mu_
    for (auto d : done_)
      if (d < target) return false;
    return true;
  }

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::uint64_t> done_;
  BucketFailure failure_;
  const OnDone on_done_;
};

}  // namespace shardflow
