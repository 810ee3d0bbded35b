// Runtime::Impl: one rank's roles behind the trainer-facing Runtime (ARCHITECTURE.md draws them).
// Each role is a class of its own, holding only its state:
//   RankContext     core/rank_context.hpp      who the rank is: settings, communicator, parameters,
//                                              logs, the sticky failure
//   PassState       core/pass_state.hpp        the gradient pass in progress and its phase
//   InstalledPlan   rank/installed_plan.hpp    the buckets, buffers, shard and actors running now
//   RankClient      rank/rank_client.hpp       the rank actor's handle and the blocking calls' asker
//   semantics, overlap, persistence            each feature folder's state, through a pointer to a
//                                              struct only that folder's files open
// Impl holds them and carries the calls that need several at once; their bodies are spread by
// topic:
//   rank/        runtime_plan.cpp (finalize, install and rebuild plans, state migration, the
//                actors, the control collectives), gradient_pass.cpp (a gradient into its bucket,
//                backpressure, awaiting iterations), runtime.cpp (the facade)
//   semantics/   semantics_state, join, static_graph, unused_params, trainable, param_groups,
//                state_sync, flat_buffers, comm_hook_use
//   overlap/     overlap_state, forward_prefetch, lag_choice, iteration_schedule
//   checkpoint/  background_save, checkpoint, sharded_checkpoint, snapshots
// A feature's file works on its own struct and the other roles; what the core or another feature
// needs of a feature is one of the named calls declared below under the feature's name.
#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <utility>

#include "runtime/core/pass_state.hpp"
#include "runtime/core/rank_context.hpp"
#include "runtime/plans/collective_schedule.hpp"
#include "runtime/rank/installed_plan.hpp"
#include "runtime/rank/rank_client.hpp"
#include "shardflow/shardflow.hpp"

namespace shardflow {

// The features' states, opened only by the features' own files (see make_semantics_state below).
struct SemanticsState;
struct OverlapState;
struct PersistenceState;
struct PieceExchange;
struct Span;
using Spans = std::vector<Span>;

struct Runtime::Impl : RankContext, PassState, InstalledPlan {
  RankClient client{*this};
  Runtime* facade = nullptr;  // the Runtime holding this: what the rank actor's halves call back into

  // ---- The halves of the waits (Note [The rank actor]): the rank actor runs them ---------------
  bool begin_wait();  // the pass handed over; false for an accumulation pass (nothing to await)
  void end_wait();    // after the completion: the bookkeeping before the next iteration
  void wait_on_rank_thread();  // wait() on the rank actor's own thread (a RankCall), which may block
  std::uint32_t param_bucket_to_await(Param p);  // ~0u: p holds its update (forward's use noted)

  // A wait on the runtime that began at t0 and ends now: exposed time (stats) and a span on the
  // compute lane (nothing when it did not block).
  void blocked_since(const char* what, std::int64_t bucket, Timeline::Time t0) const {
    const auto t1 = Timeline::now();
    if (t1 - t0 < 5) return;  // did not block
    timeline->stats().blocked(t0, t1);
    timeline->span(what, "wait", Lane::compute, t0, t1, SpanArgs{bucket, -1, nullptr, std::int64_t(iterations), -1});
  }
  template <class F>
  auto blocked(const char* what, std::int64_t bucket, F&& f) {
    struct Done {
      const Impl& I;
      const char* what;
      std::int64_t bucket;
      Timeline::Time t0;
      ~Done() { I.blocked_since(what, bucket, t0); }
    } done{*this, what, bucket, Timeline::now()};
    return f();
  }

  // Without blocking: has the signal counted what the pass handed over for `target` needs (the
  // previous iteration and the handed entries when prefetching)? Throws the run's failure.
  bool pass_complete(std::uint64_t target, bool prefetching_wait);
  // Adds to `w` what the pass waits for first (Note [Watched completions]); false when nothing
  // is left: the pass is complete (pass_complete asks this), or became so since the last look.
  bool watch_pass(IterationSignal::Watch& w, std::uint64_t target, bool prefetching_wait) const;
  // A wait's deadline passed: the TimeoutError naming what is still pending.
  [[noreturn]] void pass_timed_out(std::uint64_t target, const std::string& what);
  // Runtime::collective's work, `on_done` told on the comm stream's thread.
  void trainer_collective(CollectiveOp op, CollectiveDone on_done);
  // What the signal of a plan starting at `first_iteration` does on each completion: the
  // subscribers' events and a word to the rank actor.
  IterationSignal::OnDone signal_listener(std::uint64_t first_iteration) const;

  // The one "between iterations" rule, one message: `call` is refused while a synchronised
  // backward pass is open (its first gradient reported, wait() not yet returned), saying `advice`.
  void require_between_iterations(const std::string& call, const std::string& advice) const;
  void check_settings_used() {
    if (settings_checked.load(std::memory_order_relaxed)) return;
    if (!groups) cfg.check_needs_optimizer();
    if (!groups && cfg.precision.comm_dtype != DType::f32 && mem->on_gpu() && !has_trainer_hook())
      throw UsageError(cfg.name_of("precision.comm_dtype") + " = " + dtype_name(cfg.precision.comm_dtype) +
                       " on GPU buckets needs the runtime's optimizer (configure_optimizer): its fp32 masters cast on the device");
    check_resumed();
    settings_checked.store(true, std::memory_order_relaxed);
  }

  // ---- Recovering in place (rank/recovery.cpp, Note [Recovering in place]) --------------------
  // The set-up calls the trainer made, in order, each as the public call that makes it again:
  // recover() replays them on a fresh Impl, so that a survivor is set up exactly as the process
  // that replaces a lost rank is by the trainer's own start-up code.
  std::vector<std::function<void(Runtime&)>> recipe;
  int recipe_paused = 0;         // inside a recorded call that makes other public calls (register_flat)
  std::string recipe_broken;     // a change after training started that a replay cannot make alike: recover() names it
  template <class F>
  void remember(F&& call) {
    if (!recipe_paused) recipe.emplace_back(std::forward<F>(call));
  }
  // The trainer changed the set-up after training started: recover() refuses, naming `what`.
  void remember_change(const std::string& what) {
    if (recipe_broken.empty() && (iterations > 0 || in_pass())) recipe_broken = what;
  }
  // The Runtime's start on `comm` (its constructor's work; recover()'s for the new Impl), and its end
  // (the destructor's: the rank actor first, a save in flight finished, the actors stopped).
  void begin(Runtime& rt, std::shared_ptr<Communicator> c, std::shared_ptr<Timeline> kept);
  void retire();

  // ---------------------------------------------------------------------------------------------
  void ensure_finalized();

  // The bucket plan for gradients expected in `order`, with the caps the settings give (stage 2's
  // memory budget among them: runtime/plans/run_plan.hpp, as `shardflow plan` computes it). Sets `caps`.
  BucketPlan make_plan(const std::vector<std::uint32_t>& order);

  // Allocates the buckets of `next`, moves the current gradients into them (a rebuild happens
  // after a reduction, whose results the trainer is about to use) and starts its actors. The
  // optimizer state moves to the new shard too, unless `state` says a load is about to replace it.
  enum class StateOnRebuild { migrate, loaded_next };
  void install_plan(BucketPlan next, std::uint64_t first_iteration, StateOnRebuild state = StateOnRebuild::migrate);

  // Where p's gradient lives now: inside its bucket's buffer (taking one from the pool when the
  // bucket has none this iteration), or the trainer's own storage without the bucket view.
  std::byte* grad_ptr(std::uint32_t p);

  // Accumulation passes keep every bucket until the synchronised pass: no backpressure there.
  // With forward prefetch the bucket may still be busy with the last iteration (stepping, or its
  // buffer carrying the sync): gradients are written only once it is done.
  std::shared_ptr<std::byte> bucket_grad(std::uint32_t b);

  // Note [State migration] (runtime_plan.cpp).
  void migrate_state(Shard& from, Shard& to);
  // Elements [begin, begin + window.size()) of state slot `slot` in parameter coordinates, whole
  // on every rank (the owners' pieces summed across ranks when sharded); `discard`: the exported
  // pages go at once (a migration). Bucket rebuilds and checkpoints stream state through this, in
  // windows of kStateWindow elements (16 MiB of fp32).
  static constexpr std::size_t kStateWindow = std::size_t{4} << 20;
  void state_window(Shard& from, std::size_t slot, std::size_t begin, std::vector<float>& window, const char* what, bool discard);
  // A small collective of the runtime's own between iterations (a choice rank `root` made, a
  // verdict every rank hears), issued and waited for on the calling thread, recorded like the
  // rest. `words`: 32-bit words, summed as f32 by an all-reduce, copied as they are by a
  // broadcast. Nothing at world 1.
  void control_collective(CollectiveKind kind, void* words, std::size_t count, const std::string& tag, int root = 0);
  // The op of a control word (f32 words, in place): control_collective runs it at once; the
  // snapshot's written word queues it on the comm stream (Note [The written word behind the syncs]).
  static CollectiveOp control_op(CollectiveKind kind, void* words, std::size_t count, const std::string& tag, int root = 0);
  // A collective of the runtime's own issued on the calling thread, recorded. The trainer's
  // collectives (Runtime::collective) still on the comm stream complete first: the two paths
  // would otherwise reach the backend in a different order on different ranks.
  void run_now(const CollectiveOp& op);
  // The same in two halves (comm->wait(started, cfg.timeouts.collective) ends it), for several in
  // flight at once: the restore's windows (Note [Windows in flight], twin_restore.cpp).
  Communicator::Started start_now(const CollectiveOp& op);
  struct TrainerOps {
    std::mutex mu;
    std::condition_variable cv;
    int outstanding = 0;  // handed to the comm stream, not yet completed
  };
  std::shared_ptr<TrainerOps> trainer_ops = std::make_shared<TrainerOps>();

  // The schedule's entries the trainer hands over when backward ends (buffers, unused) count in
  // the IterationSignal after the buckets; wait() with forward prefetch waits for them too.
  void hand_over(ScheduledCollective::Kind kind, CollectiveIssue issue);
  std::uint32_t signal_index(ScheduledCollective::Kind kind) const;  // ~0u: not in this schedule
  void await_handed(std::uint64_t target);

  void spawn_actors(std::uint64_t first_iteration);
  std::shared_ptr<const FusedSyncs> fuse_small_syncs(const std::vector<ScheduledCollective>& schedule);
  void stop_actors(bool await_exit = true);  // Note [Old actors gone before the next]

  // Hands p's gradient to its bucket actor. In copy mode the gradient goes into the bucket here,
  // on the caller's (backward) thread, not on a scheduler thread.
  void send_to_bucket(std::uint32_t p, bool zero);

  // A synchronised iteration ended: its figures, and its span on the iteration lane.
  void end_iteration();

  void reset_pass();

  // Blocks until every bucket completed `target` synchronised iterations; fails the run otherwise.
  void await_iterations(std::uint64_t target);

  void check_outcome(IterationSignal::Outcome outcome, std::uint64_t target, const std::string& what);
  // Blocks until bucket b of the last handed pass is done (the collective timeout + 5 s), a span
  // `span` on the compute lane; a failure or the deadline throws, naming describe() (built only
  // then: bucket_grad waits here for every gradient under forward prefetch).
  template <class Describe>
  void await_bucket(std::uint32_t b, const char* span, const Describe& describe) {
    const auto deadline = std::chrono::steady_clock::now() + cfg.timeouts.collective + std::chrono::seconds(5);
    const auto outcome = blocked(span, b, [&] { return signal->wait_bucket(b, passes_handed, deadline); });
    if (outcome != IterationSignal::Outcome::complete) check_outcome(outcome, passes_handed, describe());
  }
  // Under forward prefetch, waits until the last handed pass settled what the trainer reads of it:
  // its gradient norm, or the whole step (Note [What the last step left, under prefetch]).
  enum class LastStep { norm, whole };
  void settle_last_step(LastStep what);

  void rebuild_from_observed_order();
  // A run resumed from a snapshot takes the buckets its saved run had rebuilt (`order`: the
  // trainable parameters, bucket by bucket) instead of rebuilding after its own first iteration.
  // Where a bucket's elements lie decides the order in which a ring adds them up: at world 3 and
  // more over Gloo a layout that differs for one iteration already changes the last bits.
  // Between iterations; false (nothing changed) when `order` is not one of this run's trainable
  // parameters, each once. Only before a load (resumed_step): the state is not moved over.
  bool adopt_bucket_order(const std::vector<std::uint32_t>& order);

  // =============================================================================================
  // The features. Each folder's state is one struct, made and opened only by that folder's files
  // (the factories below), so this header includes none of them: the rank and the other features
  // reach a feature through the calls declared under its name, each defined in the feature's own
  // file. trainable and flat_buffers need none (their work starts from a public call).
  std::shared_ptr<SemanticsState> semantics = make_semantics_state();  // semantics/semantics_state.hpp
  std::shared_ptr<OverlapState> overlap;  // overlap/overlap_state.hpp, made with the Config
  std::shared_ptr<PersistenceState> persistence = make_persistence_state();  // checkpoint/background_save.hpp
  static std::shared_ptr<SemanticsState> make_semantics_state();            // semantics/semantics_state.cpp
  static std::shared_ptr<OverlapState> make_overlap_state(const Config& cfg);  // overlap/overlap_state.cpp
  static std::shared_ptr<PersistenceState> make_persistence_state();        // checkpoint/background_save.cpp
  // A new set of parameters (finalize): the counts of unused_params and static_graph sized to it.
  void size_param_counts(std::size_t params);  // semantics/semantics_state.cpp

  // ---- semantics/state_sync.cpp: Note [Rank 0's state everywhere] -----------------------------
  // The start-up broadcast of parameters and buffers (in finalize, before the buckets exist), and
  // the buffers' broadcast each iteration.
  void sync_initial_state();
  // resumed_step(), with the ranks' choice made: what finalize() left (nothing when it left
  // nothing). `loaded`: the parameters came from a snapshot, the same on every rank.
  void finish_initial_sync(bool loaded);
  void sync_initial_buffers();
  // Every parameter from `root` (or only the frozen ones: those no shard's step writes), on this thread.
  void broadcast_params(int root, const char* what, bool frozen_only = false);
  bool syncs_buffers() const;  // Config::sync.buffers, buffers registered, more than one rank
  void send_buffers();         // this iteration's broadcasts to the comm stream (finish_backward)

  // ---- semantics/unused_params.cpp: Note [Unused parameters] ----------------------------------
  bool finds_unused() const;
  void send_used_counts();
  // The counts the shard reads (a parameter no rank used sits the step out); null when not counted.
  std::shared_ptr<std::vector<float>> used_counts_for_shard() const;
  // Per parameter, the ranks that used it in the last synchronised iteration (0: unused everywhere).
  const std::vector<float>& used_counts() const;

  // ---- semantics/join.cpp: Note [Uneven inputs] -----------------------------------------------
  void count_training_ranks();
  void recount_training_ranks();  // wait(): the next pass counts them again
  bool has_joined() const;
  // What the bucket actors divide by; null without Config::join.uneven_inputs.
  std::shared_ptr<std::atomic<float>> join_divisor() const;

  // ---- semantics/static_graph.cpp: Note [Static graph] ----------------------------------------
  bool learning_graph() const;
  std::uint32_t reports_allowed(std::uint32_t p) const;  // in one pass
  void count_report(std::uint32_t p, std::uint32_t reports);  // throws when one too many
  void send_learnt_zeros();    // learnt: the parameters this rank never reports, as zeros, when a pass starts
  void finish_learning_pass();  // learning: the pass's gradients into their buckets, in completion order
  void learn_graph();          // in wait() after the learning iteration
  // finish_backward's look at parameter p, reported `reports` times this pass: true when the
  // learnt graph already sent it (as zeros); fails the run when it was reported too few times.
  bool learnt_as_unused(std::uint32_t p, std::uint32_t reports);
  void fix_unused_in(Shard& next);  // learnt: a new shard skips the parameters no rank uses

  // ---- semantics/param_groups.cpp: Note [Changing hyper-parameters] ---------------------------
  // The new groups to the runtime and, as a snapshot, to the shard.
  void publish_groups(std::shared_ptr<OptimizerGroups> next, const char* what);

  // ---- semantics/comm_hook_use.cpp: Note [Comm hooks] -----------------------------------------
  // The trainer's hook, or with a 16-bit Config::precision.comm_dtype and no runtime optimizer the
  // matching compress hook (the shard casts itself when there is one). Null: the runtime's own reduction.
  std::shared_ptr<CommHook> effective_hook() const;
  bool has_trainer_hook() const;  // register_comm_hook ran

  // ---- overlap/lag_choice.cpp: Note [Choosing the interleave lag] -------------------------
  void choose_interleave_lag();  // once, after the first iteration of a plan (unless the Config fixed it)

  // ---- overlap/forward_prefetch.cpp: Note [Forward prefetch] ----------------------------------
  bool prefetching() const;
  bool observing_forward() const;
  // Whether the next forward's first-use order and times are to be observed: before prefetch is
  // active, and once more on a settled iteration (Note [Choosing on a settled iteration]).
  bool wants_forward_observation() const;
  bool early_syncs_measured() const;  // the syncs in backward are chosen from measured times (not fixed, not 0 by mode)
  void start_observing_forward();  // the next forward's first-use order decides the sync order
  void note_forward_use(std::uint32_t bucket);  // wait_param: forward asks for `bucket`
  void establish_sync_order();
  // From when forward first asked for each bucket (wait_param) and this pass's times; rank 0's answer is used.
  std::size_t choose_early_syncs(const std::vector<std::uint32_t>& order, std::vector<std::int64_t> asked) const;
  // The order the shard steps reduced buckets in (Note [Which bucket steps next]): the syncs'.
  const std::vector<std::uint32_t>& sync_order() const;
  // A new trainable set: the prefetch order and the interleave lag are measured again.
  void forget_overlap_choices();  // overlap/overlap_state.cpp
  void complete_prefetched_pass();  // overlap/overlap_state.cpp: before a choice is made again

  // ---- overlap/iteration_schedule.cpp: Note [Collective schedule] ---------------------------------------
  // The iteration's collectives in the order every rank issues them, from the overlap choices.
  std::vector<ScheduledCollective> build_schedule() const;

  // ---- checkpoint/sharded_checkpoint.cpp: Note [Sharded checkpoints] --------------------------
  void finish_checkpoint();  // the pending background save onto disk (wait_checkpoint's work)
  void finish_sharded_checkpoint(const std::string& dir, const std::string& index, const std::string& failure, std::size_t slices);
  void load_sharded_checkpoint(const std::string& index_path);  // load_checkpoint's, for an index
  // The save in flight, if any: its directory and step.
  std::optional<std::pair<std::string, std::uint64_t>> pending_checkpoint() const;
  // The runtime ends: a write in flight finishes first (its index is never written without
  // wait_checkpoint(), so the previous checkpoint stays the one the directory names).
  void finish_background_save();

  // ---- checkpoint/snapshots.cpp: Note [Snapshots] ---------------------------------------------
  void snapshot_if_due();  // at the end of a synchronised iteration
  void complete_snapshot();  // the one in flight: every rank's files and its index written
  [[noreturn]] void regroup_at(std::uint64_t step);  // Note [A node joins live]: ends the iteration for the next round
  [[noreturn]] void regroup_with_trainer_state(std::uint64_t step, const std::string& state);  // ... once the trainer's state is in
  // Before the first backward: with snapshots, resumed_step() must have run (UsageError otherwise).
  void check_resumed() const;
  // Before loading a snapshot: its saved run's buckets, through adopt_bucket_order.
  void adopt_saved_buckets(const std::string& snapshot);
  // ---- checkpoint/twin_restore.cpp: Note [Going on from the twins] -----------------------------
  // With mirrored shards: the step every rank goes on from, restored from what the survivors and
  // the twins kept, if that is newer than `snapshot_step` and every lost shard has a twin left;
  // nullopt otherwise (the same answer on every rank), and the snapshot is loaded instead. Without
  // them, where some rank kept its shard at a join (`kept_at_join`, the same on every rank: Note
  // [A join from memory]), from what the ranks of the old round kept, every one of them there.
  std::optional<std::uint64_t> restore_from_memory(std::uint64_t snapshot_step, bool kept_at_join);
  // Who holds which pieces before a restore from the twins, who needs which moments after it:
  // Note [Pieces to their new owners]; in `kept`, the pieces this rank's old twin gives its new
  // one in place, brought to `steps` (Note [Twins kept in place]).
  PieceExchange twin_exchange(Shard* old, int old_rank, const std::vector<int>& twin_gives, std::int64_t steps, Spans& kept);
  // Note [Values the ranks hold already] (held_values.cpp): for every rank, the blocks of what
  // `values` holds that its parameters do not already hold as the restore writes them, from each
  // holder's window of values (`provide`); and that writing, the owners' step's way, of `where`.
  struct HeldValues {
    std::vector<Spans> holds, needs;  // [rank] who gives which values, who takes which
    Spans from_params;                // what this rank gives from its own parameters, not its window
  };
  HeldValues values_to_take(const PieceExchange& values, const std::function<void(std::size_t begin, std::vector<float>& window)>& provide,
                            bool from_params_ok);
  void values_from_params(std::size_t begin, std::vector<float>& window, const Spans& where) const;
  void write_values(std::size_t begin, const std::vector<float>& window, const Spans& where);
  void write_values(std::uint32_t p, const float* v, std::size_t n, std::byte* dst) const;
  // fn(p, offset in p, offset from lo, count) for each trainable parameter in a bucket that
  // overlaps [lo, hi) of parameter coordinates.
  template <class Fn>
  void for_trainable(std::size_t lo, std::size_t hi, Fn fn) const;
  // With mirrored shards and Config::snapshot.trainer_state, the trainer's state after each step
  // is kept in memory too (the last two): the step whose state is still wanted (0: none), and
  // whether set_trainer_state's state was that one (taken).
  std::uint64_t twin_trainer_state_wanted() const;
  bool hold_trainer_state(std::uint64_t step, const std::string& state);
};

}  // namespace shardflow
