// Runtime::Impl: one rank's state behind the trainer-facing Runtime (ARCHITECTURE.md draws the whole).
// Its fields are the core's: the parameters, the plan with its buffers, shard and actors, the pass
// in progress, the failure. Each feature keeps its own state in a struct of its own, a member here:
//   core/        runtime_plan.cpp (finalize, install and rebuild plans, state migration, the actors),
//                gradient_pass.cpp (a gradient into its bucket, backpressure, awaiting iterations)
//   semantics/   join, static_graph, unused_params, trainable, param_groups, state_sync,
//                flat_buffers, comm_hook_use                         (semantics_state.hpp)
//   overlap/     forward_prefetch, interleave_lag, schedule            (overlap_state.hpp)
//   checkpoint/  checkpoint, sharded_checkpoint, snapshots             (background_save.hpp)
// runtime.cpp, the facade, holds the public calls and the iteration's phases as the trainer sees
// them. A feature's file works on its own struct and the core's fields; what the core or another
// feature needs of a feature is one of the named calls declared beside its struct below.
#pragma once

#include <caf/all.hpp>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <thread>

#include "actors/messages.hpp"
#include "runtime/checkpoint/background_save.hpp"
#include "runtime/core/rank_failure.hpp"
#include "runtime/core/bucket_buffers.hpp"
#include "runtime/plans/bucket_plan.hpp"
#include "runtime/core/bucket_readiness.hpp"
#include "runtime/plans/collective_schedule.hpp"
#include "runtime/plans/run_plan.hpp"
#include "runtime/observe/collective_log.hpp"
#include "runtime/core/device_memory.hpp"
#include "runtime/process/process_actor_system.hpp"
#include "runtime/core/iteration_signal.hpp"
#include "runtime/observe/logging.hpp"
#include "runtime/core/param_registry.hpp"
#include "runtime/core/rank_events.hpp"
#include "runtime/zero/shard.hpp"
#include "runtime/plans/shard_plan.hpp"
#include "runtime/observe/timeline.hpp"
#include "runtime/overlap/overlap_state.hpp"
#include "runtime/semantics/semantics_state.hpp"
#include "shardflow/shardflow.hpp"

namespace shardflow {

struct Runtime::Impl {
  Config cfg;
  std::shared_ptr<Communicator> comm;
  // Bucket memory from the backend (Communicator::allocate): shared memory for shm, so that its
  // collectives read the peers' buckets in place.
  // Weak: buffers (and the shard holding them) may be released last on a backend thread, which
  // must never be the one to destroy the communicator that owns the thread.
  BucketBuffers::Allocate allocator() const {
    return [w = std::weak_ptr<Communicator>(comm)](std::size_t n) {
      const auto c = w.lock();
      if (!c) throw CommError("bucket memory requested after the communicator was destroyed");
      return c->allocate(n);
    };
  }
  // Where the buckets live: the parameters' device (all of a Runtime's parameters share one), and
  // for CUDA the trainer's compute stream that bucket copies, zeroing and events go on.
  std::shared_ptr<MemoryOps> mem = std::make_shared<MemoryOps>();  // shared with the zeroer and events
  bool device_bound = false;  // set by the first registered parameter
  std::shared_ptr<BucketEvents> events;  // per bucket of the current plan (no-ops on the CPU)
  BucketBuffers::Zero zeroer() const {
    return [m = mem](std::byte* p, std::size_t n) { m->zero(p, n); };
  }
  int rank = 0, world = 1;
  std::uint32_t owner = 0;
  std::shared_ptr<spdlog::logger> log;
  std::shared_ptr<ProcessActorSystem> actors;  // the process's CAF actor system, shared by its Runtimes
  ParamRegistry registry;

  std::mutex finalize_mu;
  std::atomic<bool> finalized{false};
  BucketPlan plan;
  BucketCaps caps;  // the plan's bucket caps and stage 2's in-flight limits (Note [Memory at the ZeRO formula])
  std::shared_ptr<BucketBuffers> bufs;  // the buckets' flat buffers (Note [Pooled buckets (ZeRO-2)])
  // Each bucket's gradients still to come in this synchronised pass (Note [One count per bucket]).
  std::unique_ptr<BucketReadiness> readiness;

  // Actors of the current plan (replaced once if the buckets are rebuilt).
  msg::comm_stream_actor_t comm_actor_h;
  msg::shard_actor_t shard_actor_h;  // none without the runtime's optimizer
  // The runtime's optimizer (configure_optimizer): the groups' hyper-parameters and this rank's shard.
  std::shared_ptr<OptimizerGroups> groups;
  std::shared_ptr<Shard> shard;
  std::vector<msg::bucket_actor_t> bucket_actors;
  std::shared_ptr<IterationSignal> signal;
  std::uint64_t passes_handed = 0;  // synchronised iterations handed to the current actors

  std::shared_ptr<CollectiveLog> collectives = std::make_shared<CollectiveLog>();
  // Spans of this rank's work and the figures of stats() (Note [Timeline]); a file with trace_path.
  std::shared_ptr<Timeline> timeline;
  std::size_t done_in_backward = 0;  // buckets complete when finish_backward ran (stats)

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

  // ---- Note [The rank actor] (actors/rank_actor.cpp) ------------------------------------------
  rank_api::actor rank_actor_h;  // spawned with the Runtime, stopped first when it goes
  std::shared_ptr<RankEvents> subscribers = std::make_shared<RankEvents>();
  std::atomic<std::thread::id> rank_thread{};  // the rank actor's own thread
  bool wait_prefetching = false;  // how the pending wait() started (begin_wait)
  std::mutex asker_mu;
  std::unique_ptr<caf::scoped_actor> asker;  // the blocking calls' (ask)
  // A blocking call: the request a trainer actor would send, asked from a scoped actor on the
  // calling thread; the answer's error rethrown as the exception it stands for.
  template <class... Reply, class... Ts>
  void ask(const char* what, Ts&&... xs) {
    // The public waits block directly on the rank actor's own thread (on_rank_thread): asking
    // itself from there would wait for ever.
    if (on_rank_thread())
      throw std::logic_error(std::string("Runtime::") + what + " asked the rank actor from its own thread (rank " + std::to_string(rank) + ")");
    // A scoped actor costs a registration in the actor system: the trainer's thread keeps one; a
    // second thread asking at the same time makes its own.
    std::unique_lock lock(asker_mu, std::try_to_lock);
    std::optional<caf::scoped_actor> own;
    caf::scoped_actor* self;
    if (lock.owns_lock()) {
      if (!asker) asker = std::make_unique<caf::scoped_actor>(actors->system());
      self = asker.get();
    } else {
      self = &own.emplace(actors->system());
    }
    bool answered = false;
    caf::error error;
    (*self)->request(rank_actor_h, caf::infinite, std::forward<Ts>(xs)...)
        .receive([&](Reply...) { answered = true; }, [&](caf::error& e) { error = std::move(e); });
    if (!answered) rethrow(error);
  }
  // A RankCall runs here: the rank's own thread, which may block (never a scheduler thread).
  bool on_rank_thread() const { return std::this_thread::get_id() == rank_thread.load(std::memory_order_relaxed); }
  [[noreturn]] void rethrow(const caf::error& e) {
    throw_if_failed();  // the failure as it was thrown, its type kept
    shardflow::rethrow(e);
  }
  // Without blocking: has the signal counted what the pass handed over for `target` needs (the
  // previous iteration and the handed entries when prefetching)? Throws the run's failure.
  bool pass_complete(std::uint64_t target, bool prefetching_wait);
  // A wait's deadline passed: the TimeoutError naming what is still pending.
  [[noreturn]] void pass_timed_out(std::uint64_t target, const std::string& what);
  // Runtime::collective's work, `on_done` told on the comm stream's thread.
  void trainer_collective(CollectiveOp op, CollectiveDone on_done);
  // What the signal of a plan starting at `first_iteration` does on each completion: the
  // subscribers' events and a word to the rank actor.
  IterationSignal::OnDone signal_listener(std::uint64_t first_iteration) const;

  // Per backward pass. grad_ready may run on several threads at once: flags are atomic and the
  // observed order is appended through an atomic cursor.
  std::unique_ptr<std::atomic<std::uint8_t>[]> marked;
  std::vector<std::uint8_t> touched;  // got a gradient in a no_sync pass since the last sync
  std::vector<std::uint32_t> order;
  std::atomic<std::uint32_t> order_pos{0};
  std::atomic<bool> require_sync{true};
  // Note [Iteration phases]
  // Where this rank's synchronised pass stands, as the trainer's calls see it; every entry point
  // checks it. idle: between wait() and the first grad_ready of a synchronised pass (zero_grad,
  // set_lr, configure_optimizer, set_stream and no_sync are allowed only here). backward:
  // gradients arriving (grad_ready may run on several threads; the first moves idle -> backward).
  // reducing: finish_backward handed the pass over (no more grad_ready); wait() collects it and
  // returns to idle. Accumulation (no_sync) passes stay idle: nothing is reduced.
  enum class Phase : std::uint8_t { idle, backward, reducing };
  std::atomic<Phase> phase{Phase::idle};
  bool in_pass() const { return phase.load(std::memory_order_acquire) != Phase::idle; }
  // The one "between iterations" rule, one message: `call` is refused while a synchronised
  // backward pass is open (its first gradient reported, wait() not yet returned), saying `advice`.
  void require_between_iterations(const std::string& call, const std::string& advice) const;
  bool rebuilt = false;
  std::uint64_t iterations = 0;

  RankFailure failure;  // sticky: once a collective failed, this rank's run is over

  // Once, at the first backward: settings that need the runtime's optimizer must have one.
  std::atomic<bool> settings_checked{false};
  void check_settings_used() {
    if (settings_checked.load(std::memory_order_relaxed)) return;
    if (!groups) cfg.check_needs_optimizer();
    if (!groups && cfg.precision.comm_dtype != DType::f32 && mem->on_gpu() && !hook.hook)
      throw UsageError(cfg.name_of("precision.comm_dtype") + " = " + dtype_name(cfg.precision.comm_dtype) +
                       " on GPU buckets needs the runtime's optimizer (configure_optimizer): its fp32 masters cast on the device");
    check_resumed();
    settings_checked.store(true, std::memory_order_relaxed);
  }

  // ---------------------------------------------------------------------------------------------
  void throw_if_failed() const { failure.rethrow_if_failed(); }

  // Records the failure (the first one stays), tells the peers (they fail promptly instead of
  // waiting for the timeout).
  void record_failure(std::exception_ptr e, const char* what) {
    log->error("{}", what);
    failure.record(std::move(e));
    comm->abort(what);
  }
  // The same, then throws it.
  template <class E>
  [[noreturn]] void fail(E error) {
    record_failure(std::make_exception_ptr(error), error.what());
    throw error;
  }

  std::uint32_t check_handle(Param p, const char* where) const {
    if (p.owner != owner)
      throw UsageError(std::string(where) + ": parameter handle #" + std::to_string(p.index) +
                       (p.owner == 0 ? " was never registered" : " belongs to another Runtime"));
    if (p.index >= registry.size())
      throw UsageError(std::string(where) + ": unknown parameter handle #" + std::to_string(p.index) + " (rank " +
                       std::to_string(rank) + " has " + std::to_string(registry.size()) + " parameters)");
    return p.index;
  }

  // A frozen parameter (ParamSpec::requires_grad false) has no gradient to ask for or report.
  std::uint32_t check_trainable(Param p, const char* where) const {
    const auto i = check_handle(p, where);
    if (!registry.params()[i].requires_grad)
      throw UsageError(std::string(where) + ": parameter '" + name_of(i) + "' is frozen (requires_grad = false) and gets no gradient; "
                       "set_requires_grad(p, true) and refresh_trainable() to train it");
    return i;
  }

  const std::string& name_of(std::uint32_t i) const { return registry.params()[i].name; }

  // ---------------------------------------------------------------------------------------------
  void ensure_finalized();

  // The bucket plan for gradients expected in `order`, with the caps the settings give (stage 2's
  // memory budget among them: runtime/plans/run_plan.hpp, as `shardflow plan` computes it). Sets `caps`.
  BucketPlan make_plan(const std::vector<std::uint32_t>& order);

  // Allocates the buckets of `next`, moves the current gradients into them (a rebuild happens
  // after a reduction, whose results the trainer is about to use) and starts its actors.
  void install_plan(BucketPlan next, std::uint64_t first_iteration);



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
  // A collective of the runtime's own issued on the calling thread, recorded. The trainer's
  // collectives (Runtime::collective) still on the comm stream complete first: the two paths
  // would otherwise reach the backend in a different order on different ranks.
  void run_now(const CollectiveOp& op);
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
  void stop_actors();

  // Hands p's gradient to its bucket actor. In copy mode the gradient goes into the bucket here,
  // on the caller's (backward) thread, not on a scheduler thread.
  void send_to_bucket(std::uint32_t p, bool zero);

  // A synchronised iteration ended: its figures, and its span on the iteration lane.
  void end_iteration();

  void reset_pass();

  // Blocks until every bucket completed `target` synchronised iterations; fails the run otherwise.
  void await_iterations(std::uint64_t target);

  void check_outcome(IterationSignal::Outcome outcome, std::uint64_t target, const std::string& what);

  void rebuild_from_observed_order();
  // A run resumed from a snapshot takes the buckets its saved run had rebuilt (`order`: the
  // trainable parameters, bucket by bucket) instead of rebuilding after its own first iteration.
  // Where a bucket's elements lie decides the order in which a ring adds them up: at world 3 and
  // more over Gloo a layout that differs for one iteration already changes the last bits.
  // Between iterations; false (nothing changed) when `order` is not one of this run's trainable
  // parameters, each once.
  bool adopt_bucket_order(const std::vector<std::uint32_t>& order);

  // =============================================================================================
  // The features: each one's state, and the calls through which the core and the other features
  // reach it. Each is defined in the feature's own file.

  // ---- semantics/state_sync.cpp: Note [Rank 0's state everywhere] -----------------------------
  // The start-up broadcast of parameters and buffers (in finalize, before the buckets exist), and
  // the buffers' broadcast each iteration.
  StateSyncState state_sync;
  void sync_initial_state();
  void broadcast_params(int root, const char* what);  // every parameter from `root`, on this thread
  bool syncs_buffers() const;  // Config::sync.buffers, buffers registered, more than one rank
  void send_buffers();         // this iteration's broadcasts to the comm stream (finish_backward)

  // ---- semantics/unused_params.cpp: Note [Unused parameters] ----------------------------------
  UnusedParamsState unused;
  bool finds_unused() const { return cfg.buckets.static_graph ? !graph.learnt : cfg.buckets.find_unused_parameters; }
  void send_used_counts();
  // The counts the shard reads (a parameter no rank used sits the step out); null when not counted.
  std::shared_ptr<std::vector<float>> used_counts_for_shard() const { return finds_unused() ? unused.used_counts : nullptr; }
  // Per parameter, the ranks that used it in the last synchronised iteration (0: unused everywhere).
  const std::vector<float>& used_counts() const { return *unused.used_counts; }

  // ---- semantics/join.cpp: Note [Uneven inputs] -----------------------------------------------
  JoinState join;
  void count_training_ranks();
  bool has_joined() const { return join.joined; }
  // What the bucket actors divide by; null without Config::join.uneven_inputs.
  std::shared_ptr<std::atomic<float>> join_divisor() const { return cfg.join.uneven_inputs ? join.divisor : nullptr; }

  // ---- semantics/static_graph.cpp: Note [Static graph] ----------------------------------------
  StaticGraphState graph;
  bool learning_graph() const { return cfg.buckets.static_graph && !graph.learnt; }
  std::uint32_t reports_allowed(std::uint32_t p) const;  // in one pass
  void count_report(std::uint32_t p, std::uint32_t reports);  // throws when one too many
  void send_learnt_zeros();    // learnt: the parameters this rank never reports, as zeros, when a pass starts
  void finish_learning_pass();  // learning: the pass's gradients into their buckets, in completion order
  void learn_graph();          // in wait() after the learning iteration
  // finish_backward's look at parameter p, reported `reports` times this pass: true when the
  // learnt graph already sent it (as zeros); fails the run when it was reported too few times.
  bool learnt_as_unused(std::uint32_t p, std::uint32_t reports);
  void fix_unused_in(Shard& next);  // learnt: a new shard skips the parameters no rank uses

  // ---- semantics/trainable.cpp: Note [Changing the trainable set] -----------------------------
  TrainableState trainable;

  // ---- semantics/param_groups.cpp: Note [Changing hyper-parameters] ---------------------------
  ParamGroupsState grouping;
  // The new groups to the runtime and, as a snapshot, to the shard.
  void publish_groups(std::shared_ptr<OptimizerGroups> next, const char* what);

  // ---- semantics/flat_buffers.cpp: Note [Flat buffers] ----------------------------------------
  FlatBuffersState flat;

  // ---- semantics/comm_hook_use.cpp: Note [Comm hooks] -----------------------------------------
  CommHookState hook;
  // The trainer's hook, or with a 16-bit Config::precision.comm_dtype and no runtime optimizer the
  // matching compress hook (the shard casts itself when there is one). Null: the runtime's own reduction.
  std::shared_ptr<CommHook> effective_hook() const;

  // ---- overlap/lag_choice.cpp: Note [Choosing the interleave lag] -------------------------
  InterleaveLagState lag;
  void choose_interleave_lag();  // once, after the first iteration of a plan (unless the Config fixed it)

  // ---- overlap/forward_prefetch.cpp: Note [Forward prefetch] ----------------------------------
  ForwardPrefetchState prefetch;
  bool prefetching() const { return prefetch.active; }
  bool observing_forward() const { return prefetch.observing; }
  void start_observing_forward();  // the next forward's first-use order decides the sync order
  void note_forward_use(std::uint32_t bucket);  // wait_param: forward asks for `bucket`
  void establish_sync_order();
  // From when forward first asked for each bucket (wait_param) and this pass's times; rank 0's answer is used.
  std::size_t choose_early_syncs(const std::vector<std::uint32_t>& order, std::vector<std::int64_t> asked) const;
  // The order the shard steps reduced buckets in (Note [Which bucket steps next]): the syncs'.
  const std::vector<std::uint32_t>& sync_order() const { return prefetch.sync_order; }
  // A new trainable set: the prefetch order and the interleave lag are measured again.
  void forget_overlap_choices() {
    prefetch.forget();
    lag.forget(cfg);
  }

  // ---- overlap/iteration_schedule.cpp: Note [Collective schedule] ---------------------------------------
  // The iteration's collectives in the order every rank issues them, from the overlap choices.
  std::vector<ScheduledCollective> build_schedule() const;

  // ---- checkpoint/sharded_checkpoint.cpp: Note [Sharded checkpoints] --------------------------
  BackgroundSaveState saves;

  // ---- checkpoint/snapshots.cpp: Note [Snapshots] ---------------------------------------------
  SnapshotState snapshots;
  // Before the first backward: with snapshots, resumed_step() must have run (UsageError otherwise).
  void check_resumed() const;
  // Before loading a snapshot: its saved run's buckets, through adopt_bucket_order.
  void adopt_saved_buckets(const std::string& snapshot);
};

}  // namespace shardflow
