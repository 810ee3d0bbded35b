#pragma once

#include <caf/stateful_actor.hpp>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <vector>

#include "actors/messages.hpp"
#include "runtime/observe/collective_log.hpp"
#include "runtime/plans/collective_schedule.hpp"
#include "runtime/observe/logging.hpp"
#include "runtime/zero/shard.hpp"
#include "shardflow/communicator.hpp"

namespace shardflow {

struct CommStreamState {
  std::shared_ptr<Communicator> comm;
  std::vector<ScheduledCollective> entries;  // the iteration's order (collective_order)
  std::vector<char> ready;
  std::vector<Timeline::Time> ready_at;  // when each entry was marked ready (Note [The step chain, its turn aside])
  // What each bucket puts on the link, given with its readiness; the norm exchange's ops with norm_ready.
  std::vector<std::shared_ptr<const BucketCollectives>> collectives;
  CollectiveIssue norm;
  // The trainer's entries (buffers, unused), by kind, with handed_over; told when one completed or
  // failed (a call on the backend's thread: it only counts in the IterationSignal, as the bucket
  // and shard actors do).
  std::map<ScheduledCollective::Kind, CollectiveIssue> handed;
  std::map<ScheduledCollective::Kind, std::uint32_t> handed_entry;
  std::function<void(ScheduledCollective::Kind, const msg::Failure&)> handed_done;
  std::vector<std::uint32_t> reduce_entry, sync_entry, gather_entry;  // by bucket
  // Note [Syncs from the twin, two levels]: the syncs are shifts to the twins, each followed by its
  // gather inside the hosts (the schedule has gather entries).
  bool twin_gathers = false;
  std::uint32_t norm_entry = ~0u, last_reduce_entry = 0;
  std::vector<msg::bucket_actor_t> owners;  // the bucket actor to tell when its reduction completes
  msg::shard_actor_t shard;                 // the shard actor, when the runtime runs the optimizer
  // Note [Fused syncs]: the groups whose members' sync entries go out as one all-gather (null:
  // none), and per group the member whose step_done came last (its pack event covers the others').
  std::shared_ptr<const FusedSyncs> fused;
  std::vector<std::uint32_t> last_packed;
  std::uint32_t next = 0;          // the next entry to issue
  bool blocked = false;            // a comm hook's reduction is between phases (Note [Comm hooks])
  std::uint64_t iteration = 0;     // the runtime's synchronised iteration being issued (timeline)
  // Collectives of the trainer's own waiting for the schedule of the iterations before `before`
  // to be out (Runtime::collective); failed if the actor goes first.
  struct TrainerOp {
    std::uint64_t before;
    CollectiveOp op;
    CollectiveDone done;
  };
  std::vector<TrainerOp> trainer_ops;
  ~CommStreamState();
  std::shared_ptr<CollectiveLog> log;
  std::shared_ptr<spdlog::logger> logger;
  static inline const char* name = "comm_stream";
};

// Owns the order of collectives on one rank: entry i is issued only after entries 0..i-1, so every
// rank issues the same sequence whatever order gradients, steps and messages arrive in. What an
// entry issues comes from its bucket (or, for the norm exchange, the shard).
msg::comm_stream_actor_t::behavior_type comm_stream_actor(msg::comm_stream_actor_t::stateful_pointer<CommStreamState> self,
                                                          std::shared_ptr<Communicator> comm,
                                                          std::vector<ScheduledCollective> entries,
                                                          std::shared_ptr<CollectiveLog> log, std::uint64_t first_iteration,
                                                          std::function<void(ScheduledCollective::Kind, const msg::Failure&)> handed_done,
                                                          std::shared_ptr<const FusedSyncs> fused);

}  // namespace shardflow
