// The InProcessWorld both in-process backends (CPU threads, one GPU) hand out: one shared world
// object, and each rank's communicator made on first request and kept, so that every thread asking
// for rank r gets the same one.
#pragma once

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "shardflow/communicator.hpp"
#include "shardflow/errors.hpp"

namespace shardflow {

template <class World, class Comm>
class RankWorld final : public InProcessWorld {
 public:
  explicit RankWorld(std::shared_ptr<World> world) : world_(std::move(world)), comms_(std::size_t(world_->size())) {}
  int world_size() const override { return world_->size(); }
  std::shared_ptr<Communicator> communicator(int rank) override {
    if (rank < 0 || rank >= world_->size())
      throw UsageError("InProcessWorld::communicator: rank " + std::to_string(rank) + " is outside world size " +
                       std::to_string(world_->size()));
    std::lock_guard lock(mu_);
    auto& c = comms_[std::size_t(rank)];
    if (!c) c = std::make_shared<Comm>(world_, rank);
    return c;
  }

 private:
  std::shared_ptr<World> world_;
  std::mutex mu_;
  std::vector<std::shared_ptr<Communicator>> comms_;
};

}  // namespace shardflow
