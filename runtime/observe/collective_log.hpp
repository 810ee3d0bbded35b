// The sequence of collectives a rank issued. Ranks must agree on it (Note [Ordered asynchronous
// collectives]); tests record it under random arrival orders and compare it across ranks.
#pragma once

#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "runtime/observe/timeline.hpp"
#include "shardflow/communicator.hpp"

namespace shardflow {

class CollectiveLog {
 public:
  void record(const CollectiveOp& op) {
    std::string line = std::string(collective_name(op.kind)) + " " + op.tag + " " + std::to_string(op.count) +
                       " " + dtype_name(op.dtype);
    std::lock_guard lock(mu_);
    lines_.push_back(std::move(line));
    if (lines_.size() > kKeep) lines_.pop_front();  // long trainings keep the recent past only
  }
  // Each collective also becomes a span on the rank's timeline (Note [Timeline]) and counts in its
  // figures: completed() from its done callback, with the time it went out.
  void set_timeline(std::shared_ptr<Timeline> t) { timeline_ = std::move(t); }
  bool tracing() const { return timeline_ && timeline_->tracing(); }
  // `op`: the collective's description (its buffers are not read; the tag only when tracing).
  // `ready`: when it could have gone out, its turn in the schedule aside (-1: unknown).
  void completed(const CollectiveOp& op, int world, const char* cat, std::int64_t bucket, std::int64_t iteration,
                 Timeline::Time begin, Timeline::Time ready = -1) const {
    if (!timeline_) return;
    timeline_->collective([&] { return std::string(collective_name(op.kind)) + " " + op.tag; }, cat, int(op.kind),
                          collective_bytes(op, world), wire_bytes(op, world), begin, Timeline::now(),
                          SpanArgs{bucket, -1, dtype_name(op.dtype), iteration, -1, ready});
  }
  std::vector<std::string> lines() const {
    std::lock_guard lock(mu_);
    return {lines_.begin(), lines_.end()};
  }

 private:
  mutable std::mutex mu_;
  static constexpr std::size_t kKeep = 1 << 16;
  std::deque<std::string> lines_;
  std::shared_ptr<Timeline> timeline_;
};

}  // namespace shardflow
