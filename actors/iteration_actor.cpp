#include "actors/iteration_actor.hpp"

#include <caf/all.hpp>

#include "actors/messages.hpp"

namespace shardflow {

caf::behavior iteration_actor(caf::stateful_actor<IterationState>* self, std::shared_ptr<IterationSignal> signal) {
  self->state.signal = std::move(signal);
  return {
      [=](msg::bucket_done_atom, std::uint32_t b, const msg::Failure& failure) {
        self->state.signal->bucket_done(b, failure);
      },
  };
}

}  // namespace shardflow
