#pragma once

#include <caf/stateful_actor.hpp>

#include <cstdint>
#include <string>

#include "actors/messages.hpp"
#include "runtime/core/iteration_signal.hpp"

namespace shardflow {

struct BucketState {
  std::uint32_t index = 0;
  std::uint32_t size = 0;   // gradients per synchronised pass
  bool in_flight = false;   // the bucket's buffer is inside a collective
  std::shared_ptr<const BucketCollectives> collectives;  // what the bucket puts on the link
  static inline const char* name = "bucket";
};

// One bucket from "all its gradients are in" (grad_ready(n), sent once per pass by the trainer
// side, which holds the one count: Note [One count per bucket]) until it is handed over: asks the
// comm stream for its slot with the collectives it needs (its reduction and cast now, its sync
// once stepped: BucketCollectives), owns the buffer while the collective has it (a second
// grad_ready then is a protocol violation, reported, never written), and passes the reduced bucket on.
// A reduced bucket goes to the shard actor (reduced(b)) when the runtime runs the optimizer, else
// straight to the rank's IterationSignal (the bucket is done).
msg::bucket_actor_t::behavior_type bucket_actor(msg::bucket_actor_t::stateful_pointer<BucketState> self,
                                                std::shared_ptr<const BucketCollectives> collectives, std::uint32_t size,
                                                msg::comm_stream_actor_t comm_stream, msg::shard_actor_t shard,
                                                std::shared_ptr<IterationSignal> iteration);

}  // namespace shardflow
