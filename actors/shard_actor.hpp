#pragma once

#include <caf/stateful_actor.hpp>

#include <cstdint>
#include <memory>
#include <vector>

#include "actors/messages.hpp"
#include "runtime/core/iteration_signal.hpp"
#include "runtime/zero/shard.hpp"
#include "runtime/observe/timeline.hpp"

namespace shardflow {

// Where one iteration's stepping stands. Clipping starts in waiting_for_norm (no step before the
// global norm, which needs every reduction); without clipping an iteration starts in stepping.
enum class ShardPhase : std::uint8_t {
  waiting_for_norm,  // clipping: reductions still arriving
  norm_in_flight,    // clipping: every reduction is in, the norm exchange is out
  stepping,          // steps go as the overlap mode, the reductions and the staging allow
  stepped,           // every bucket stepped (the optimizer's step count advanced); syncs finishing
};

struct ShardActorState {
  std::shared_ptr<Shard> shard;
  Overlap overlap = Overlap::none;
  msg::comm_stream_actor_t comm;
  std::shared_ptr<IterationSignal> iteration;  // told when a bucket is done (or failed)
  std::vector<char> reduced, stepped;
  std::size_t nreduced = 0, nstepped = 0, nsynced = 0, staging_in_flight = 0;
  std::size_t first_unstepped = 0;  // position in `order` before which every bucket is stepped
  ShardPhase phase = ShardPhase::stepping;
  bool all_issued = false;  // the comm stream issued the last reduction (after_backward may step)
  // Note [The next iteration's reductions]: buckets of the next iteration reduced while this one's
  // syncs are still landing, taken once this iteration is over.
  std::vector<std::uint32_t> next_reduced;
  ClipCoef clip_coef;
  bool zero_on_done = false;  // forward prefetch: zero the bucket when done with it
  std::vector<std::uint32_t> order;  // the syncs' schedule order: a step goes to the reduced bucket first in it
  std::size_t staging_cap = 0;       // pooled: stepped buckets whose sync has not landed, at most (Note [Staging in flight])
  // [position in `order`] the buckets before it that sync alone (take a staging buffer); fused
  // ones pack into their group's buffer (Note [Fused syncs]). Size B + 1.
  std::vector<std::size_t> staged_before;
  // Note [Hyper-parameter snapshots]: set_lr between iterations k and k+1 sends a snapshot tagged
  // k+1. With forward prefetch iteration k may still be stepping then, so each iteration takes the
  // newest snapshot whose tag is not beyond its own number when it starts stepping.
  std::vector<std::pair<std::uint64_t, std::shared_ptr<const OptimizerGroups>>> snapshots;
  std::shared_ptr<Timeline> timeline;  // steps and unpacks as spans, optimizer time (stats)
  // find_unused_parameters (Note [Unused parameters]): how many ranks used each parameter, filled
  // by the exchange; no step before unused_known.
  std::shared_ptr<const std::vector<float>> used_counts;
  bool unused_known = false;
  static inline const char* name = "shard";
};

// What a shard actor is spawned with: the shard, whom it talks to, and how this plan steps.
struct ShardActorArgs {
  std::shared_ptr<Shard> shard;
  Overlap overlap = Overlap::none;
  msg::comm_stream_actor_t comm;
  std::shared_ptr<IterationSignal> iteration;
  bool zero_on_done = false;           // ShardActorState::zero_on_done
  std::vector<std::uint32_t> order;    // ShardActorState::order
  std::shared_ptr<Timeline> timeline;
  std::shared_ptr<const std::vector<float>> used_counts;  // null without find_unused_parameters
  std::size_t staging_cap = 0;         // ShardActorState::staging_cap (BucketCaps::staging_in_flight)
};

// A rank's optimizer shard. Steps the pieces it owns of each reduced bucket as soon as the overlap
// mode allows, the one its sync needs first first (Note [Which bucket steps next]); with clipping,
// first exchanges its share of the gradient norm.
msg::shard_actor_t::behavior_type shard_actor(msg::shard_actor_t::stateful_pointer<ShardActorState> self, ShardActorArgs args);

}  // namespace shardflow
