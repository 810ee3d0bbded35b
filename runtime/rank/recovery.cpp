// Note [Recovering in place]
// A lost rank used to cost every rank its process: the launcher stopped them all and started them
// again, each paying its start-up (a CUDA context, NCCL's and the trainer's own initialisation)
// before resuming from the newest snapshot. Under `shardflow run --recovery in-place` only the
// lost rank's process starts again; the survivors keep theirs and call Runtime::recover() with a
// communicator of the job's next round (rejoin_process_group, bootstrap/process_group.cpp). Under
// `--recovery shrink` no process starts: the survivors go on at once at the smaller world,
// numbered afresh, which takes the replacement's start-up off the way to the next step (the
// launcher's word for the round gives each survivor its new rank and the world).
//
// What the survivors must reach is exactly where the replacement process arrives by running the
// trainer's start-up code and resumed_step(): every rank then issues the same collectives, and the
// job goes on as an uninterrupted one would (bit for bit over one backend at the same world, within
// float rounding at a smaller one: the recovery scenarios of test_launch check both). So recover() does not patch the old Runtime's many parts (its buckets,
// shard, actors, pass, overlap choices, snapshots in flight, a failure half recorded): it retires the
// old Impl as the destructor would and builds a fresh one on the new communicator, then replays the
// set-up calls the trainer made (Impl::recipe: register_param, register_flat, register_buffer,
// register_comm_hook, set_requires_grad, finalize, configure_optimizer, add_param_group, in their
// order, recorded until training started), then loads the newest complete snapshot through
// resumed_step() (rank 0 chooses it for everyone). The step that failed is discarded everywhere: no
// rank keeps a half-applied update, since every rank reloads the same snapshot.
//
// What stays from the old Runtime: the parameter handles (the owner id is kept, and the replayed
// registration gives the same indices), the trainer's memory the parameters live in (overwritten
// by the load), the timeline (the trace file goes on, unless the rank changed), the actor API's
// subscribers, and the CUDA stream. What does not, as after a restart: hyper-parameters set after
// training started (set_lr: the trainer's schedule sets them again at the step it resumes from).
// With no complete snapshot yet there is nothing every rank can go back to alike once the
// survivors' parameters moved: recover() then refuses by name (the rank exits, and the launcher
// starts it again), rather than redo the first steps from moved parameters.
// Changes a replay cannot make alike are refused by name rather than half replayed: a
// refresh_trainable() or add_param_group() after training started (the replacement would not have
// them), and recovery without Config::snapshot.dir (there would be nothing consistent to go back to).
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <caf/actor_cast.hpp>
#include <caf/scoped_actor.hpp>

#include "runtime/bootstrap/snapshot_env.hpp"
#include "runtime/checkpoint/background_save.hpp"
#include "runtime/rank/rank_actor.hpp"
#include "runtime/rank/runtime_impl.hpp"
#include "runtime/zero/shard.hpp"
#include "shardflow/actor.hpp"

namespace shardflow {

std::uint64_t Runtime::recover(std::shared_ptr<Communicator> comm) {
  if (!comm) throw UsageError("recover: communicator is null");
  auto& old = *impl_;
  const std::string who = "recover() on rank " + std::to_string(old.rank);
  if (old.client.on_rank_thread()) throw UsageError(who + ": called on the rank actor's own thread; call it from the trainer's");
  if (old.cfg.snapshot.dir.empty())
    throw UsageError(who + ": " + old.cfg.name_of("snapshot.dir") + " is not set, so there is no snapshot every rank can go back to "
                     "alike; set it (and snapshot.every) to recover in place, or let the launcher restart every rank");
  if (!old.recipe_broken.empty())
    throw UsageError(who + ": " + old.recipe_broken + " changed the set-up after training started, which a recovered rank cannot "
                     "make again alike with the process that replaces the lost one; restart every rank instead (--recovery restart)");
  // Note [A node joins live]: the launcher took a node in after a complete snapshot; nobody was lost.
  const bool regrouping = old.persistence && old.persistence->snapshots.regrouping;
  // The old round's collectives: peers still inside them fail now instead of at their timeout, and
  // nothing below waits for an iteration that can no longer complete.
  old.comm->abort("rank " + std::to_string(old.rank) + " recovers in place");
  old.failure.record(std::make_exception_ptr(CommError(who + ": the old round was abandoned")));
  // The actor API's subscribers hear each round's loss before its recovery, however the trainer
  // learnt of it (a failed bucket announces itself; an error met elsewhere did not): once a round.
  if (!regrouping) old.client.subscribers->failed(make_error(errc::comm, who + ": a peer was lost; the round is abandoned"));
  // How far this rank's parameters moved since the job's start (or the snapshot it resumed from):
  // with no snapshot to go back to, going on would mix them with a replacement's initial ones.
  const std::uint64_t moved = (old.persistence ? old.persistence->snapshots.base : 0) + old.iterations;
  const auto recipe = old.recipe;
  const bool same_rank = comm->rank() == old.rank;
  auto kept = same_rank ? old.timeline : nullptr;
  auto subscribers = old.client.subscribers;
  void* stream = old.mem->stream;
  old.log->warn("{}: rank {} of {} becomes rank {} of {}; the set-up ({} call(s)) is made again and {}",
                regrouping ? "a node joins" : "recovering in place", old.rank, old.world, comm->rank(), comm->world_size(), recipe.size(),
                regrouping || (old.shard && old.shard->mirror()) ? "the state taken up from the ranks' memory (else the newest snapshot)"
                                                                  : "the newest snapshot reloaded");
  // The process's actor system outlives the swap: the trainer's actors run on it (and, asked
  // from actors, the helper running this call: Note [Recovering from actors], rank_actor.cpp),
  // and letting it go here would stop them, or wait for the very thread that waits.
  const auto actors = old.actors;
  // Note [Going on from the twins]: with mirrored shards the old shard is kept (stopped first, so
  // that no step of its actor runs under what the next resumed_step() reads of it); at a join,
  // where nobody was lost, without them too (Note [A join from memory]).
  TwinSalvage salvage;
  if (old.shard && (old.shard->mirror() || regrouping) && old.persistence) {
    if (old.shard_actor_h) {
      caf::scoped_actor self{old.actors->system()};
      self->send_exit(old.shard_actor_h, caf::exit_reason::user_shutdown);
      self->wait_for(old.shard_actor_h);
    }
    salvage = TwinSalvage{old.shard, old.rank, old.persistence->snapshots.step_offset, old.persistence->snapshots.trainer_states};
  }
  auto next = std::make_unique<Impl>();
  next->cfg = old.cfg;
  next->owner = old.owner;  // the trainer's parameter handles stay valid
  next->client.subscribers = std::move(subscribers);
  old.retire();
  if (salvage.shard) salvage.shard->drop_buckets();
  if (!same_rank) old.timeline->close();
  impl_.reset();  // its buffers (in the old communicator's memory) go before the new ones come
  impl_ = std::move(next);
  impl_->begin(*this, std::move(comm), std::move(kept));
  impl_->mem->stream = stream;
  impl_->persistence->snapshots.salvage = std::move(salvage);
  try {
    for (const auto& call : recipe) call(*this);
    const std::uint64_t step = resumed_step();
    if (step == 0 && moved > 0 && !impl_->persistence->snapshots.from_memory) {
      // Note [A round that did not heal]: the launcher counts the round as no restart.
      if (const char* memory = std::getenv(snapshot_env::kMemory); memory && *memory)
        std::ofstream(std::filesystem::path(memory) / snapshot_env::kRefused) << who << "\n";
      throw Error(who + ": no complete snapshot to go back to yet, and this rank's parameters moved through " + std::to_string(moved) +
                  " iteration(s) since the start: going on would redo those steps from moved parameters (and mix them with a "
                  "replacement's, which are the initial ones). Every rank must start again instead (the launcher restarts them when this rank exits); snapshot "
                  "earlier (" + impl_->cfg.name_of("snapshot.every") + ") to recover in place from the first steps on");
    }
    impl_->client.subscribers->recovered(caf::actor_cast<caf::actor>(impl_->client.actor), step, impl_->rank, impl_->world);
    return step;
  } catch (...) {
    // Another failure during the recovery: the trainer may call recover() again with a newer
    // round's communicator, which replays the whole set-up again.
    impl_->recipe = recipe;
    impl_->recipe_paused = 0;
    throw;
  }
}

}  // namespace shardflow
