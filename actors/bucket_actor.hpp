#pragma once

#include <caf/fwd.hpp>
#include <caf/stateful_actor.hpp>

#include <cstdint>
#include <string>

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
// `downstream` receives reduced(b) when it is the shard actor, bucket_done(b) when it is the
// iteration actor (`to_shard` says which).
caf::behavior bucket_actor(caf::stateful_actor<BucketState>* self, std::uint32_t index, std::uint32_t nparams,
                           caf::actor comm_stream, caf::actor downstream, bool to_shard);

}  // namespace shardflow
