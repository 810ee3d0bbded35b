// The subscribers of one rank's events (shardflow/actor.hpp: params_ready, step_done,
// checkpoint_done, failed). Published from wherever the event happens (a bucket's completion on
// the actor that finished it, a checkpoint on the thread that completed it) without a hop through
// the rank actor: sending to an actor is safe from any thread, so only the list needs a lock.
#pragma once

#include <caf/actor.hpp>
#include <caf/error.hpp>

#include <cstdint>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace shardflow {

class RankEvents {
 public:
  void subscribe(caf::actor who, std::uint8_t mask);
  void unsubscribe(const caf::actor& who);

  void params_ready(std::uint32_t bucket, std::uint64_t iteration);
  void step_done(std::uint64_t iteration);
  void checkpoint_done(const std::string& dir, std::uint64_t step);
  // Once: later failures are consequences of the first.
  void failed(const caf::error& e);

 private:
  std::vector<caf::actor> to(std::uint8_t event);
  std::mutex mu_;
  std::vector<std::pair<caf::actor, std::uint8_t>> subscribers_;
  bool failed_ = false;
};

}  // namespace shardflow
