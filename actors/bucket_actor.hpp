#pragma once

#include <caf/stateful_actor.hpp>

#include <cstdint>
#include <string>

#include "actors/messages.hpp"

namespace shardflow {

struct BucketState {
  std::uint32_t index = 0;
  std::uint32_t expected = 0;  // gradients per iteration
  std::uint32_t pending = 0;   // still to come this iteration
  bool in_flight = false;      // the bucket's buffer is inside a collective
  static inline const char* name = "bucket";
};

// Counts its gradients in; when the last one arrives the bucket is ready and goes to the comm
// stream. Owns the buffer's lifetime: between bucket_ready and reduced the buffer belongs to the
// collective, and a gradient for it then is a protocol violation, reported, never written.
// A reduced bucket goes to the shard actor (reduced(b)) when the runtime runs the optimizer, else
// straight to the iteration actor (bucket_done(b)).
msg::bucket_actor_t::behavior_type bucket_actor(msg::bucket_actor_t::stateful_pointer<BucketState> self, std::uint32_t index,
                                                std::uint32_t nparams, msg::comm_stream_actor_t comm_stream,
                                                msg::shard_actor_t shard, msg::iteration_actor_t iteration);

}  // namespace shardflow
