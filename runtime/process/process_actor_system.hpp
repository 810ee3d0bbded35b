// The process-wide CAF actor system. Every Runtime of the process (one per rank for the
// in-process backend) shares it; it lives while any Runtime does.
#pragma once

#include <caf/actor_system.hpp>
#include <caf/actor_system_config.hpp>

#include <memory>

namespace shardflow {

class ProcessActorSystem {
 public:
  // `threads` (0: min(2, hardware threads)) only matters for the call that creates the system.
  static std::shared_ptr<ProcessActorSystem> acquire(unsigned threads);
  caf::actor_system& system() { return *system_; }
  ~ProcessActorSystem();

 private:
  explicit ProcessActorSystem(unsigned threads);
  caf::actor_system_config config_;
  std::unique_ptr<caf::actor_system> system_;
};

}  // namespace shardflow
