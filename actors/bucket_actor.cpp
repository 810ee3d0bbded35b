#include "actors/bucket_actor.hpp"

#include <caf/all.hpp>

#include "actors/messages.hpp"

namespace shardflow {

caf::behavior bucket_actor(caf::stateful_actor<BucketState>* self, std::uint32_t index, std::uint32_t nparams,
                           caf::actor comm_stream, caf::actor downstream, bool to_shard) {
  auto& st = self->state;
  st.index = index;
  st.expected = nparams;
  st.pending = nparams;
  return {
      [=](msg::grad_ready_atom, std::uint32_t count) {
        auto& s = self->state;
        if (s.in_flight || count > s.pending) {
          msg::Failure f{msg::Failure::usage, std::to_string(count) + " gradient(s) arrived while bucket " + std::to_string(s.index) +
                                                  " is being reduced"};
          if (to_shard)
            self->send(downstream, msg::reduced_atom::value, s.index, std::move(f));
          else
            self->send(downstream, msg::bucket_done_atom::value, s.index, std::move(f));
          return;
        }
        s.pending -= count;
        if (s.pending == 0) {
          s.in_flight = true;
          self->send(comm_stream, msg::bucket_ready_atom::value, s.index);
        }
      },
      [=](msg::reduced_atom, std::uint32_t b, msg::Failure& failure) {
        auto& s = self->state;
        s.in_flight = false;  // the collective released the buffer
        s.pending = s.expected;
        if (to_shard)
          self->send(downstream, msg::reduced_atom::value, b, std::move(failure));
        else
          self->send(downstream, msg::bucket_done_atom::value, b, std::move(failure));
      },
  };
}

}  // namespace shardflow
