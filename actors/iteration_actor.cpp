#include "actors/iteration_actor.hpp"

#include <caf/all.hpp>


namespace shardflow {

msg::iteration_actor_t::behavior_type iteration_actor(msg::iteration_actor_t::stateful_pointer<IterationState> self,
                                                      std::shared_ptr<IterationSignal> signal) {
  self->state.signal = std::move(signal);
  return {
      [=](msg::bucket_done_atom, std::uint32_t b, const msg::Failure& failure) {
        self->state.signal->bucket_done(b, failure);
      },
  };
}

}  // namespace shardflow
