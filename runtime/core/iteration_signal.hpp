// The bridge from the actors back to the trainer: the bucket actor (DDP) or the shard actor (ZeRO)
// counts each bucket's completion here, directly (it only takes a lock and notifies: a separate
// actor in between cost one message hop per bucket and did nothing else). `on_done` then tells the
// rank actor, which answers the requests waiting on it (Note [The rank actor]); the runtime's
// own waits between iterations (checkpoints, the end of a run) block here on a rank's thread, never
// on a CAF scheduler thread.
//
// Counts only grow (one per bucket per synchronised iteration), so a waiter for iteration k is
// never confused by completions of iteration k+1, which forward prefetch lets start early.
//
// Note [Watched completions]
// The rank actor has a thread of its own, and waking it for every bucket's completion was a
// third of the context switches of a ZeRO-1 iteration of small buckets (bench_overhead): most of
// those wake-ups found nothing to answer. So the rank actor says what it waits for next (watch():
// every slot at a count, or given slots at theirs), and a completion asks for it (on_done's
// `wake`) only when it meets that, or fails. A new signal, and one whose watch was just met, wakes
// on every completion until the actor watches again: nobody misses a completion it was not told
// about. watch() answers true when what it is given is met already (a completion came between
// the actor's look and its watch): the actor then looks again instead of sleeping. With no wait
// left the actor watches nothing (an empty Watch): only a failure wakes it then (Note [Idle
// between waits], rank_actor.cpp).
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
  // thread that reported it; `wake`: the watcher should look (Note [Watched completions]).
  using OnDone = std::function<void(std::uint32_t bucket, std::uint64_t count, const BucketFailure& f, bool wake)>;
  explicit IterationSignal(std::size_t nbuckets, OnDone on_done = {})
      : done_(nbuckets, 0), slot_watch_(nbuckets, 0), on_done_(std::move(on_done)) {}

  void bucket_done(std::uint32_t b, const BucketFailure& f) {
    std::uint64_t count = 0;
    bool wake = true;
    {
      std::lock_guard lock(mu_);
      if (f) {
        if (!failure_) failure_ = f;  // the first failure wins; later ones are consequences
      } else if (b < done_.size()) {
        count = ++done_[b];
        wake = meets_watch(b, count);
      }
    }
    cv_.notify_all();
    if (on_done_) on_done_(b, count, f, wake);
  }

  // What the watcher waits for next: every slot at `all` (0: not that), and each listed slot at
  // its count. True when some of it is met already: look again instead of waiting.
  struct Watch {
    std::uint64_t all = 0;
    std::vector<std::pair<std::uint32_t, std::uint64_t>> slots;
  };
  bool watch(const Watch& w) {
    std::lock_guard lock(mu_);
    clear_watch();
    watching_ = true;
    watch_all_ = w.all;
    if (w.all) {
      for (auto d : done_) at_all_ += d >= w.all ? 1 : 0;
      if (at_all_ == done_.size()) return unwatch();
    }
    for (const auto& [slot, target] : w.slots) {
      if (slot >= done_.size()) continue;
      if (done_[slot] >= target) return unwatch();
      if (!slot_watch_[slot]) watched_.push_back(slot);
      if (!slot_watch_[slot] || target < slot_watch_[slot]) slot_watch_[slot] = target;
    }
    return false;
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

  // Under mu_: whether count, b's new count, meets the watch; a met watch is dropped.
  bool meets_watch(std::uint32_t b, std::uint64_t count) {
    if (!watching_) return true;
    if (watch_all_ && count == watch_all_ && ++at_all_ == done_.size()) return unwatch();
    if (slot_watch_[b] && count >= slot_watch_[b]) return unwatch();
    return false;
  }
  void clear_watch() {
    for (auto slot : watched_) slot_watch_[slot] = 0;
    watched_.clear();
    watch_all_ = 0;
    at_all_ = 0;
  }
  bool unwatch() {  // every completion wakes until the next watch
    clear_watch();
    watching_ = false;
    return true;
  }

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::uint64_t> done_;
  // Note [Watched completions]: the watch, under mu_.
  bool watching_ = false;
  std::uint64_t watch_all_ = 0;
  std::size_t at_all_ = 0;                // slots at watch_all_ or beyond
  std::vector<std::uint64_t> slot_watch_;  // by slot; 0: not watched
  std::vector<std::uint32_t> watched_;     // the slots with a count in slot_watch_
  BucketFailure failure_;
  const OnDone on_done_;
};

}  // namespace shardflow
