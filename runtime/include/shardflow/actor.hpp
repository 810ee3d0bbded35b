// shardflow/actor.hpp: driving a rank from actors (CAF 0.17). A CAF application talks to each
// rank's Runtime through a typed actor instead of blocking a thread on it:
//
//   shardflow::Runtime rt(comm, cfg);                      // registration as usual
//   auto rank = shardflow::rank_actor_of(rt);              // lives as long as rt
//   auto& sys = shardflow::actor_system_of(rt);            // spawn the trainer's actors here
//   self->request(rank, caf::infinite, rank_api::call_atom::value,
//                 rank_api::RankCall{[](Runtime& r) { r.finalize(); }})          // setup, off the scheduler
//   per step:
//     send(rank, zero_grad_atom)
//     forward: request(rank, params_ready_atom, p) before p is read (forward prefetch); or first
//              rt.params_ready({p}), which answers the usual case (landed) with no message
//     backward: request(rank, grad_atom, p) -> GradSlot (where p's gradient goes; answered once the
//               bucket may be written: stage 2's backpressure never blocks a scheduler thread),
//               write it, send(rank, grad_ready_atom, p)
//     request(rank, iteration_atom) -> (step_done_atom, iteration): this iteration's gradients are
//               reduced and stepped (with forward prefetch: handed over, as Runtime::wait())
//
// Runtime's blocking calls (wait(), wait_param(), wait_all_params(), wait_checkpoint()) are this
// interface asked from a scoped actor: one path (Note [The rank actor], runtime/rank/rank_actor.cpp).
//
// The rank actor is detached: it runs on a thread of its own, so the collectives a rank runs
// between iterations (the bucket rebuild, snapshots, a call's finalize) never hold a scheduler
// thread, and a scheduler of one worker thread is enough for any number of ranks.
//
// Errors. A request that fails is answered with a caf::error of category "shardflow" whose code is
// an errc and whose context is the message (what(), rethrow()). A bad grad_ready (unknown or frozen
// parameter, reported twice) fails the rank, as a failed collective does: the rank's pending and
// later requests are answered with that error, and subscribers get (failed_atom, error) once.
#pragma once

#include <caf/actor.hpp>
#include <caf/actor_system.hpp>
#include <caf/allowed_unsafe_message_type.hpp>
#include <caf/atom.hpp>
#include <caf/error.hpp>
#include <caf/meta/type_name.hpp>
#include <caf/replies_to.hpp>
#include <caf/typed_actor.hpp>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "shardflow/shardflow.hpp"

namespace shardflow {

// Where parameter `param`'s gradient goes this backward pass (Runtime::grad): write (or
// accumulate) it there, then send grad_ready. Valid until the iteration's reply.
struct GradSlot {
  Param param;
  void* data = nullptr;
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, Param& x) {
  return f(caf::meta::type_name("shardflow.Param"), x.index, x.owner);
}

}  // namespace shardflow

// Process-local payloads (pointers into the trainer's memory), never serialised.
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(shardflow::GradSlot)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(std::vector<shardflow::GradSlot>)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(shardflow::CollectiveOp)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(std::function<void(shardflow::Runtime&)>)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(std::function<std::shared_ptr<shardflow::Communicator>()>)

namespace shardflow {

// The codes of a caf::error of category "shardflow": which exception the blocking API throws.
enum class errc : std::uint8_t { error = 1, usage = 2, mismatch = 3, timeout = 4, comm = 5 };
std::string to_string(errc code);
caf::error make_error(errc code, std::string what);
// The error of an exception (its type kept as the code).
caf::error to_error(const std::exception& e);
// The message of a "shardflow" error; CAF's own rendering for the others (an actor gone, ...).
std::string what(const caf::error& e);
// Throws the exception an error stands for: UsageError, MismatchError, TimeoutError, CommError,
// else Error.
[[noreturn]] void rethrow(const caf::error& e);

namespace rank_api {

// Requests (answered), in the order a step uses them.
using call_atom = caf::atom_constant<caf::atom("sf_call")>;        // run f(runtime) on the rank's thread
using grad_atom = caf::atom_constant<caf::atom("sf_grad")>;        // -> GradSlot
using params_ready_atom = caf::atom_constant<caf::atom("sf_params")>;  // p holds its update
using iteration_atom = caf::atom_constant<caf::atom("sf_iter")>;   // -> (step_done_atom, iteration)
using all_params_atom = caf::atom_constant<caf::atom("sf_allpar")>;  // every update landed
using collective_atom = caf::atom_constant<caf::atom("sf_coll")>;  // the trainer's own collective done
using save_atom = caf::atom_constant<caf::atom("sf_save")>;        // sharded checkpoint staged
using checkpoint_atom = caf::atom_constant<caf::atom("sf_ckpt")>;  // -> (checkpoint_done_atom, dir, step)
using recover_atom = caf::atom_constant<caf::atom("sf_recover")>;  // Runtime::recover, off the scheduler
// Messages (not answered).
using grad_ready_atom = caf::atom_constant<caf::atom("sf_gready")>;
using grads_ready_atom = caf::atom_constant<caf::atom("sf_granges")>;  // flat buffers: offset, count
using zero_grad_atom = caf::atom_constant<caf::atom("sf_zero")>;
using require_sync_atom = caf::atom_constant<caf::atom("sf_sync")>;  // false: accumulate (no_sync)
using subscribe_atom = caf::atom_constant<caf::atom("sf_sub")>;
using unsubscribe_atom = caf::atom_constant<caf::atom("sf_unsub")>;
// Replies and events.
using step_done_atom = caf::atom_constant<caf::atom("sf_stepped")>;
using checkpoint_done_atom = caf::atom_constant<caf::atom("sf_ckdone")>;
using failed_atom = caf::atom_constant<caf::atom("sf_failed")>;
using recovered_atom = caf::atom_constant<caf::atom("sf_recov")>;

// What a blocking call would do with the Runtime, run on the rank actor's own thread (setup's
// collectives: finalize, configure_optimizer, resumed_step, load_checkpoint; between iterations
// refresh_trainable, set_lr, save_checkpoint, state_dict; join at the end). That thread may block:
// the waits such calls make block it (never a scheduler thread), and the rank's other requests
// wait for the call.
using RankCall = std::function<void(Runtime&)>;

// Recovering in place from actors (Note [Recovering in place], runtime/rank/recovery.cpp): after a
// lost peer (the iteration's error, or a `failed` event) under `shardflow run --recovery
// in-place | shrink`, request(rank, caf::infinite, recover_atom, next) where `next` makes the
// communicator of the job's next round (rejoin_process_group(env, options)). Both that and
// Runtime::recover() block (the launcher's word, the snapshot's load), so they run on a thread of
// their own, never on a scheduler thread nor the rank actor's (which recover() stops). The answer
// (recovered_atom, step, rank, world): training goes on after `step` as rank `rank` of `world`
// (shard the data by them); rank_actor_of(rt) is the rank's new actor (subscribers are told it in
// the `recovered` event); the old one is gone. Until the answer no actor of the trainer may use
// the Runtime or the old rank actor: stop the step's work first (the example trainer stops its
// layer actors and spawns new ones, examples/actor_trainer/rank_trainer.cpp). A failure is the
// answer's error, as recover() would throw it; a newer round's `next` may be tried again.
using NextRound = std::function<std::shared_ptr<Communicator>()>;

// Events a subscriber (any actor, subscribe_atom with a mask of these) is sent:
//   params_ready  (params_ready_atom, std::uint32_t bucket, std::uint64_t iteration): the bucket's
//                 parameters hold the update of the iteration-th synchronised iteration (with the
//                 runtime's optimizer; forward prefetch may start on that bucket's layers)
//   step_done     (step_done_atom, std::uint64_t iteration): that many synchronised iterations done
//   checkpoint_done (checkpoint_done_atom, std::string dir, std::uint64_t step): a sharded
//                 checkpoint or a snapshot in dir is complete and loadable
//   failed        (failed_atom, caf::error): the rank failed; once (until it recovers)
//   recovered     (recovered_atom, rank_api::actor, std::uint64_t step, std::int32_t rank,
//                 std::int32_t world): Runtime::recover() went on in place (Note [Recovering in
//                 place]): the rank's new actor (the old one is gone: send it what went to the old),
//                 the step training goes on from, the rank and world of the new round. A later
//                 failure is announced again.
enum Event : std::uint8_t { params_ready = 1, step_done = 2, checkpoint_done = 4, failed = 8, recovered = 16, all_events = 31 };

using actor = caf::typed_actor<
    caf::replies_to<call_atom, RankCall>::with<call_atom>,
    caf::replies_to<grad_atom, Param>::with<GradSlot>,
    // Several at once (a layer's weight and bias): one round trip to the rank's thread, not one each.
    caf::replies_to<grad_atom, std::vector<Param>>::with<std::vector<GradSlot>>,
    caf::reacts_to<grad_ready_atom, Param>,
    caf::reacts_to<grad_ready_atom, std::vector<Param>>,  // in this order
    caf::reacts_to<grads_ready_atom, std::uint64_t, std::uint64_t>,
    caf::reacts_to<zero_grad_atom>,
    caf::reacts_to<require_sync_atom, bool>,
    caf::replies_to<iteration_atom>::with<step_done_atom, std::uint64_t>,
    caf::replies_to<params_ready_atom, Param>::with<params_ready_atom, Param>,
    caf::replies_to<params_ready_atom, std::vector<Param>>::with<params_ready_atom, std::vector<Param>>,  // all of them
    caf::replies_to<all_params_atom>::with<all_params_atom>,
    // Runtime::collective: queued in the runtime's order, answered with the op's tag once done.
    caf::replies_to<collective_atom, CollectiveOp>::with<collective_atom, std::string>,
    // Runtime::save_sharded_checkpoint_async(dir): answered once staged (files written behind).
    caf::replies_to<save_atom, std::string>::with<save_atom, std::string>,
    // Runtime::wait_checkpoint(): answered when the pending save is on disk (dir empty: none was).
    caf::replies_to<checkpoint_atom>::with<checkpoint_done_atom, std::string, std::uint64_t>,
    // Runtime::recover(next()) on a thread of its own (NextRound above).
    caf::replies_to<recover_atom, NextRound>::with<recovered_atom, std::uint64_t, std::int32_t, std::int32_t>,
    caf::reacts_to<subscribe_atom, caf::actor, std::uint8_t>,
    caf::reacts_to<unsubscribe_atom, caf::actor>>;

}  // namespace rank_api

// The rank actor of `rt`: spawned with it, stopped when it is destroyed.
rank_api::actor rank_actor_of(Runtime& rt);
// The process's actor system the runtime's actors run on: spawn the trainer's actors here.
caf::actor_system& actor_system_of(Runtime& rt);

}  // namespace shardflow
