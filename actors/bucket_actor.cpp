#include "actors/bucket_actor.hpp"

#include <caf/all.hpp>

namespace shardflow {

msg::bucket_actor_t::behavior_type bucket_actor(msg::bucket_actor_t::stateful_pointer<BucketState> self,
                                                std::shared_ptr<const BucketCollectives> collectives, std::uint32_t size,
                                                msg::comm_stream_actor_t comm_stream, msg::shard_actor_t shard,
                                                std::shared_ptr<IterationSignal> iteration) {
  auto& st = self->state;
  st.index = collectives->bucket();
  st.size = size;
  st.collectives = std::move(collectives);
  // The reduced bucket goes on to the shard, which steps it; without one it is done.
  auto pass_on = [=](std::uint32_t b, msg::Failure failure) {
    if (shard)
      self->send(shard, msg::reduced_atom::value, b, std::move(failure));
    else
      iteration->bucket_done(b, failure);
  };
  return {
      [=](msg::grad_ready_atom, std::uint32_t count) {
        auto& s = self->state;
        if (s.in_flight || count != s.size) {
          pass_on(s.index, {msg::Failure::usage, std::to_string(count) + " of bucket " + std::to_string(s.index) + "'s " +
                                                       std::to_string(s.size) + " gradient(s) reported" +
                                                       (s.in_flight ? " while it is being reduced" : " as the whole bucket")});
          return;
        }
        s.in_flight = true;
        self->send(comm_stream, msg::bucket_ready_atom::value, s.index, s.collectives, caf::actor_cast<msg::bucket_actor_t>(self));
      },
      [=](msg::reduced_atom, std::uint32_t b, msg::Failure& failure) {
        auto& s = self->state;
        s.in_flight = false;  // the collective released the buffer
        // With a shard, the completion told it too (Note [Reduced, straight to the shard]).
        if (!shard) iteration->bucket_done(b, failure);
      },
  };
}

}  // namespace shardflow
