// The sequence of collectives a rank issued. Ranks must agree on it (Note [Ordered asynchronous
// collectives]); tests record it under random arrival orders and compare it across ranks.
#pragma once

#include <deque>
#include <mutex>
#include <string>
#include <vector>

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
  std::vector<std::string> lines() const {
    std::lock_guard lock(mu_);
    return {lines_.begin(), lines_.end()};
  }

 private:
  mutable std::mutex mu_;
  static constexpr std::size_t kKeep = 1 << 16;
  std::deque<std::string> lines_;
};

}  // namespace shardflow
