// How shardflow's actors talk. Per rank:
//
//   trainer thread --grad_ready(n)--> bucket actor b        (all n of b's gradients are in: sent once,
//                                                            by the last; Note [One count per bucket])
//   bucket actor b --bucket_ready(b, its collectives, self)--> comm stream actor
//                                                           (what b puts on the link: reduction, cast,
//                                                            sync; runtime/zero/bucket_collectives.hpp)
//   comm stream    --submit in schedule order--> Communicator    (same order on every rank)
//   Communicator completion --reduced(b, failure)--> bucket actor b   (buffer released)
//   bucket actor b --bucket_done(b, failure)--> IterationSignal  (a call, not a message: wait()
//                                                            returns when every bucket is done)
//
// With the runtime's optimizer (ZeRO stage 0/1/2) the completion tells the rank's shard actor too,
// right after the bucket actor (Note [Reduced, straight to the shard]); the bucket actor then
// passes nothing on, and the iteration goes on:
//
//   Communicator completion --reduced(b, failure)--> shard actor
//   shard actor --(steps bucket b's owned pieces when Config::zero.overlap allows)
//   shard actor --step_done(b)--> comm stream     (stage >= 1: parameters packed for the sync)
//   comm stream --bucket b's sync collective(s), in schedule order--> Communicator
//   Communicator --broadcast_done(b)--> shard actor --bucket_done(b)--> IterationSignal
//   (small buckets whose syncs follow each other: one all-gather for the group, Note [Fused syncs])
//   Communicator --group_synced(g)--> shard actor --bucket_done(each member)--> IterationSignal
//   comm stream --all_issued--> shard actor      (the last reduction went out: after_backward)
//   shard actor --norm_ready(exchange)--> comm stream --norm_done--> shard actor   (clipping)
//
// Between iterations, a collective of the trainer's own (a loss):
//   trainer thread --trainer_op(before, op, done)--> comm stream  (out after the last iteration's
//                                                            entries, before the next one's)
//
// The trainer's side (shardflow/actor.hpp; Note [The rank actor], runtime/rank/rank_actor.cpp): a trainer
// actor, or Runtime's blocking calls from a scoped actor, asks the rank actor; it answers waits from
// IterationSignal's completions:
//   trainer --iteration / params_ready / grad ...--> rank actor --(Runtime's calls)--> the flow above
//   IterationSignal --poke (on_done, Note [Watched completions])--> rank actor --step_done / params_ready / error--> trainer
//
// When backward ends, the trainer's own entries (Note [Rank 0's state everywhere], Note [Unused
// parameters]):
//   trainer thread --handed_over(buffers | unused, ops)--> comm stream --completion--> IterationSignal
//   comm stream --unused_known--> shard actor     (the used counts are in: the steps may go)
#pragma once

#include <caf/allowed_unsafe_message_type.hpp>
#include <caf/atom.hpp>
#include <caf/replies_to.hpp>
#include <caf/typed_actor.hpp>

#include <cstdint>
#include <memory>
#include <string>

#include "runtime/zero/bucket_collectives.hpp"
#include "runtime/core/failure.hpp"
#include "shardflow/actor.hpp"  // the trainer-facing messages; CollectiveOp as a message type

namespace shardflow {
struct OptimizerGroups;
}
// Process-local payloads, never serialised: an immutable snapshot shared between the runtime and
// the shard actor, a bucket's collectives (buffers it owns), the norm exchange's ops.
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(std::shared_ptr<const shardflow::OptimizerGroups>)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(std::shared_ptr<const shardflow::BucketCollectives>)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(shardflow::CollectiveIssue)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(shardflow::CollectiveDone)

namespace shardflow::msg {

using grad_ready_atom = caf::atom_constant<caf::atom("grad_ready")>;
using bucket_ready_atom = caf::atom_constant<caf::atom("bkt_ready")>;
using reduced_atom = caf::atom_constant<caf::atom("reduced")>;
using step_done_atom = caf::atom_constant<caf::atom("step_done")>;
using broadcast_done_atom = caf::atom_constant<caf::atom("bcast_done")>;
using group_synced_atom = caf::atom_constant<caf::atom("grp_synced")>;
using all_issued_atom = caf::atom_constant<caf::atom("all_issued")>;
using norm_ready_atom = caf::atom_constant<caf::atom("norm_ready")>;
using norm_done_atom = caf::atom_constant<caf::atom("norm_done")>;
// The trainer's own entries of the schedule (the buffers' broadcast, the used counts), handed over
// when backward ends; unused_known tells the shard the used counts are in.
using handed_over_atom = caf::atom_constant<caf::atom("handed")>;
using unused_known_atom = caf::atom_constant<caf::atom("unused_kn")>;
// A collective of the trainer's own (Runtime::collective): it goes out once every entry of the
// iterations before `before` is out and before any of iteration `before`'s.
using trainer_op_atom = caf::atom_constant<caf::atom("trainer_op")>;
// A comm hook's phase completed (Note [Comm hooks]): the next phase's collectives, or (false) the
// reduction is done and the schedule may go on.
using hook_phase_atom = caf::atom_constant<caf::atom("hook_phase")>;
// Note [Syncs from the twin, two levels]: a bucket's shift to the twin landed (comm stream to
// shard), and the twin's values are in the staging beside the rank's own (shard to comm stream).
using twin_shifted_atom = caf::atom_constant<caf::atom("twin_shftd")>;
using twin_packed_atom = caf::atom_constant<caf::atom("twin_pckd")>;
using step_next_atom = caf::atom_constant<caf::atom("step_next")>;  // shard actor to itself
using set_peer_atom = caf::atom_constant<caf::atom("set_peer")>;
using set_groups_atom = caf::atom_constant<caf::atom("set_groups")>;

using Failure = BucketFailure;  // runtime/core/failure.hpp

// The protocol as types: each actor's handle says which messages it takes, so sending one a
// message it does not handle is a compile error, not a dropped message at run time.
using shard_actor_t = caf::typed_actor<
    caf::reacts_to<set_groups_atom, std::uint64_t, std::shared_ptr<const OptimizerGroups>>,
    caf::reacts_to<reduced_atom, std::uint32_t, Failure>, caf::reacts_to<step_next_atom>, caf::reacts_to<all_issued_atom>,
    caf::reacts_to<norm_done_atom, Failure>, caf::reacts_to<broadcast_done_atom, std::uint32_t, Failure>,
    caf::reacts_to<group_synced_atom, std::uint32_t, Failure>, caf::reacts_to<twin_shifted_atom, std::uint32_t, Failure>,
    caf::reacts_to<unused_known_atom, Failure>>;

using bucket_actor_t =
    caf::typed_actor<caf::reacts_to<grad_ready_atom, std::uint32_t>, caf::reacts_to<reduced_atom, std::uint32_t, Failure>>;

// bucket_ready carries what the bucket puts on the link (its reduction now, its sync after its
// step) and the bucket actor to tell when the reduction completes.
using comm_stream_actor_t = caf::typed_actor<
    caf::reacts_to<set_peer_atom, shard_actor_t>,
    caf::reacts_to<bucket_ready_atom, std::uint32_t, std::shared_ptr<const BucketCollectives>, bucket_actor_t>,
    caf::reacts_to<step_done_atom, std::uint32_t>, caf::reacts_to<twin_packed_atom, std::uint32_t>,
    caf::reacts_to<norm_ready_atom, CollectiveIssue>,
    caf::reacts_to<handed_over_atom, std::uint8_t, CollectiveIssue>,
    caf::reacts_to<trainer_op_atom, std::uint64_t, CollectiveOp, CollectiveDone>,
    caf::reacts_to<hook_phase_atom, std::uint8_t, std::uint32_t, bool, CollectiveIssue>>;

}  // namespace shardflow::msg
