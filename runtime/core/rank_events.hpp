// The subscribers of one rank's events (shardflow/actor.hpp: params_ready, step_done,
// checkpoint_done, failed, recovered). Published from wherever the event happens (a bucket's completion on
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
  // Once: later failures are consequences of the first (until recovered()). `round`: the
  // recovery round the reporter belongs to (round()); a retired runtime's late reports (its
  // buckets failing one by one after the trainer recovered) are not the new round's failure.
  void failed(const caf::error& e);
  void failed(const caf::error& e, std::uint64_t round);
  std::uint64_t round();
  // Runtime::recover() went on in place: `rank_actor` is the new rank actor (a rank_api::actor,
  // held untyped here so that this header stays free of the API's); failures count afresh.
  void recovered(const caf::actor& rank_actor, std::uint64_t step, int rank, int world);

 private:
  std::vector<caf::actor> to(std::uint8_t event);
  std::mutex mu_;
  std::vector<std::pair<caf::actor, std::uint8_t>> subscribers_;
  bool failed_ = false;
  std::uint64_t round_ = 0;  // recovered() calls so far
};

}  // namespace shardflow
