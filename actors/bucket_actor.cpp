#include "actors/bucket_actor.hpp"

#include <caf/all.hpp>

namespace shardflow {

msg::bucket_actor_t::behavior_type bucket_actor(msg::bucket_actor_t::stateful_pointer<BucketState> self, std::uint32_t index,
                                                std::uint32_t nparams, msg::comm_stream_actor_t comm_stream,
                                                msg::shard_actor_t shard, msg::iteration_actor_t iteration) {
  auto& st = self->state;
  st.index = index;
  st.expected = nparams;
  st.pending = nparams;
  auto hand_over = [=](std::uint32_t b, msg::Failure failure) {
    if (shard)
      self->send(shard, msg::reduced_atom::value, b, std::move(failure));
    else
      self->send(iteration, msg::bucket_done_atom::value, b, std::move(failure));
  };
  return {
      [=](msg::grad_ready_atom, std::uint32_t count) {
        auto& s = self->state;
        if (s.in_flight || count > s.pending) {
          hand_over(s.index, {msg::Failure::usage,
                              std::to_string(count) + " gradient(s) arrived while bucket " + std::to_string(s.index) + " is being reduced"});
          return;
        }
        s.pending -= count;
        if (s.pending == 0) {
          s.in_flight = true;
          self->send(comm_stream, msg::bucket_ready_atom::value, s.index, caf::actor_cast<msg::bucket_actor_t>(self));
        }
      },
      [=](msg::reduced_atom, std::uint32_t b, msg::Failure& failure) {
        auto& s = self->state;
        s.in_flight = false;  // the collective released the buffer
        s.pending = s.expected;
        hand_over(b, std::move(failure));
      },
  };
}

}  // namespace shardflow
