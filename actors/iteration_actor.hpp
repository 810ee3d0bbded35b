#pragma once

#include <caf/stateful_actor.hpp>

#include <memory>

#include "actors/messages.hpp"
#include "runtime/iteration_signal.hpp"

namespace shardflow {

struct IterationState {
  std::shared_ptr<IterationSignal> signal;
  static inline const char* name = "iteration";
};

// Collects bucket_done from every bucket of the rank and hands the outcome to the waiting trainer.
msg::iteration_actor_t::behavior_type iteration_actor(msg::iteration_actor_t::stateful_pointer<IterationState> self,
                                                      std::shared_ptr<IterationSignal> signal);

}  // namespace shardflow
