#pragma once

#include <caf/fwd.hpp>
#include <caf/stateful_actor.hpp>

#include <memory>

#include "runtime/iteration_signal.hpp"

namespace shardflow {

struct IterationState {
  std::shared_ptr<IterationSignal> signal;
  static inline const char* name = "iteration";
};

// Collects bucket_done from every bucket of the rank and hands the outcome to the waiting trainer.
caf::behavior iteration_actor(caf::stateful_actor<IterationState>* self, std::shared_ptr<IterationSignal> signal);

}  // namespace shardflow
