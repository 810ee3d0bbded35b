// Runtime: the trainer-facing side of one rank. It owns the parameters' registration, the bucket
// buffers and the per-iteration bookkeeping; the reduction itself is message flow between the
// actors (actors/messages.hpp), which this file only spawns and feeds.
#include <caf/all.hpp>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "actors/bucket_actor.hpp"
#include "actors/comm_stream_actor.hpp"
#include "actors/iteration_actor.hpp"
#include "actors/messages.hpp"
#include "actors/shard_actor.hpp"
#include "kernels/cpu/elementwise.hpp"
#include "runtime/bucket_buffers.hpp"
#include "runtime/bucket_plan.hpp"
#include "runtime/collective_log.hpp"
#include "runtime/device_memory.hpp"
#include "runtime/engine.hpp"
#include "runtime/iteration_signal.hpp"
#include "runtime/logging.hpp"
#include "runtime/param_registry.hpp"
#include "runtime/shard.hpp"
#include "runtime/shard_plan.hpp"
#include "runtime/timeline.hpp"
#include "shardflow/launch.hpp"
#include "shardflow/shardflow.hpp"

namespace shardflow {
namespace {

std::atomic<std::uint32_t> next_owner_id{1};

bool same_layout(const BucketPlan& a, const BucketPlan& b) {
  if (a.buckets.size() != b.buckets.size()) return false;
  for (std::size_t i = 0; i < a.buckets.size(); ++i) {
    const auto &x = a.buckets[i].entries, &y = b.buckets[i].entries;
    if (x.size() != y.size()) return false;
    for (std::size_t e = 0; e < x.size(); ++e)
      if (x[e].param != y[e].param) return false;
  }
  return true;
}

}  // namespace

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
  std::shared_ptr<Engine> engine;
  ParamRegistry registry;

  std::mutex finalize_mu;
  std::atomic<bool> finalized{false};
  BucketPlan plan;
  std::shared_ptr<BucketBuffers> bufs;  // the buckets' flat buffers (Note [Pooled buckets (ZeRO-2)])
  // Gradients still to come per bucket in this synchronised pass: the trainer-side twin of the
  // bucket actor's count, so a pooled bucket is marked "reducing" before its message goes out
  // (Note [Pooled buckets (ZeRO-2)], backpressure).
  std::unique_ptr<std::atomic<std::uint32_t>[]> bucket_pending;
  // Buckets 0..ready_prefix-1 are complete; the comm stream issues their reductions without any
  // further trainer action (it goes in bucket order), so only their buffers are sure to come back.
  std::mutex prefix_mu;
  std::vector<char> bucket_complete;
  std::size_t ready_prefix = 0;

  // Actors of the current plan (replaced once if the buckets are rebuilt).
  caf::actor iteration_actor_h, comm_actor_h, shard_actor_h;
  // The runtime's optimizer (configure_optimizer): the groups' hyper-parameters and this rank's shard.
  std::shared_ptr<OptimizerGroups> groups;
  std::shared_ptr<Shard> shard;
  std::vector<caf::actor> bucket_actors;
  std::shared_ptr<IterationSignal> signal;
  std::uint64_t signal_target = 0;  // synchronised iterations handed to the current actors

  // Forward prefetch (Note [Forward prefetch]).
  std::mutex forward_mu;
  bool observing_forward = false;       // recording the first-use order of buckets in forward
  std::vector<char> forward_seen;
  std::vector<std::uint32_t> forward_order, sync_order;  // sync_order: S entries, empty = bucket order
  std::size_t prefetch_early = 0;  // with prefetch: syncs interleaved into backward (the first of sync_order)
  bool prefetch_active = false;
  std::shared_ptr<CollectiveLog> collectives = std::make_shared<CollectiveLog>();
  // Spans of this rank's work and the figures of stats() (Note [Timeline]); a file with trace_path.
  std::shared_ptr<Timeline> timeline;
  bool closing_iteration = false;  // inside wait(), after the iteration completed: actors spawned now start the next one
  std::size_t done_in_backward = 0;  // buckets complete when finish_backward ran (stats)

  // A trainer-thread wait on the runtime: exposed time (stats) and a span on the compute lane.
  template <class F>
  auto blocked(const char* what, std::int64_t bucket, F&& f) {
    const auto t0 = Timeline::now();
    struct Done {
      Timeline& tl;
      const char* what;
      std::int64_t bucket;
      Timeline::Time t0;
      std::uint64_t it;
      ~Done() {
        const auto t1 = Timeline::now();
        if (t1 - t0 < 5) return;  // did not block
        tl.stats().blocked(t0, t1);
        tl.span(what, "wait", Lane::compute, t0, t1, SpanArgs{bucket, -1, nullptr, std::int64_t(it), -1});
      }
    } done{*timeline, what, bucket, t0, iterations};
    return f();
  }

  // Per backward pass. grad_ready may run on several threads at once: flags are atomic and the
  // observed order is appended through an atomic cursor.
  std::unique_ptr<std::atomic<std::uint8_t>[]> marked;
  std::vector<std::uint8_t> touched;  // got a gradient in a no_sync pass since the last sync
  std::vector<std::uint32_t> order;
  std::atomic<std::uint32_t> order_pos{0};
  std::atomic<bool> backward_finished{false};
  std::atomic<bool> require_sync{true};
  std::atomic<bool> sync_pass_started{false};  // set by grad_ready of a synchronised pass (any thread)
  bool rebuilt = false;
  std::uint64_t iterations = 0;

  std::mutex fail_mu;
  std::exception_ptr failure;  // sticky: once a collective failed, this rank's run is over
  std::atomic<bool> failed{false};

  // Once, at the first backward: settings that need the runtime's optimizer must have one.
  std::atomic<bool> settings_checked{false};
  void check_settings_used() {
    if (settings_checked.load(std::memory_order_relaxed)) return;
    if (!groups) cfg.check_needs_optimizer();
    settings_checked.store(true, std::memory_order_relaxed);
  }

  // ---------------------------------------------------------------------------------------------
  void throw_if_failed() {
    if (!failed.load(std::memory_order_acquire)) return;
    std::lock_guard lock(fail_mu);
    std::rethrow_exception(failure);
  }

  // Records the first failure, tells the peers (they fail promptly instead of waiting for the
  // timeout) and throws it.
  template <class E>
  [[noreturn]] void fail(E error) {
    log->error("{}", error.what());
    {
      std::lock_guard lock(fail_mu);
      if (!failure) failure = std::make_exception_ptr(error);
    }
    failed.store(true, std::memory_order_release);
    comm->abort(error.what());
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

  const std::string& name_of(std::uint32_t i) const { return registry.params()[i].name; }

  // ---------------------------------------------------------------------------------------------
  void ensure_finalized() {
    if (finalized.load(std::memory_order_acquire)) return;
    std::lock_guard lock(finalize_mu);
    if (finalized.load(std::memory_order_relaxed)) return;
    throw_if_failed();
    const auto n = registry.size();
    if (n == 0) throw UsageError("rank " + std::to_string(rank) + ": no parameters registered before training started");
    try {
      collectives->record(CollectiveOp{CollectiveKind::allgather, DType::f32, nullptr, nullptr, 4, 0, 1.0f,
                                       "verify parameter lists", {}});
      verify_same_params(*comm, registry.signature(), cfg.timeout);
    } catch (const MismatchError& e) {
      fail(e);
    } catch (const TimeoutError& e) {
      fail(e);
    } catch (const CommError& e) {
      fail(e);
    }
    marked.reset(new std::atomic<std::uint8_t>[n]);
    for (std::size_t i = 0; i < n; ++i) marked[i].store(0, std::memory_order_relaxed);
    touched.assign(n, 0);
    order.assign(n, 0);
    install_plan(make_bucket_plan(registry.params(), reverse_registration_order(n), cfg.first_bucket_cap_bytes,
                                  cfg.bucket_cap_bytes));
    log->info("{} parameters in {} bucket(s) on backend {} (world {})\n{}", n, plan.buckets.size(),
              comm->backend_name(), world, plan.describe());
    finalized.store(true, std::memory_order_release);
  }

  // Allocates the buckets of `next`, moves the current gradients into them (a rebuild happens
  // after a reduction, whose results the trainer is about to use) and starts its actors.
  void install_plan(BucketPlan next) {
    std::shared_ptr<Shard> next_shard;
    std::shared_ptr<BucketBuffers> next_bufs;
    if (groups) {
      auto shard_plan = make_shard_plan(next, registry.params(), cfg.partition, world, rank, cfg.zero_stage >= 1);
      std::vector<std::size_t> bytes;
      for (std::size_t b = 0; b < shard_plan.buckets.size(); ++b)
        bytes.push_back(shard_plan.buckets[b].padded * dtype_size(next.buckets[b].dtype));
      next_bufs = std::make_shared<BucketBuffers>(std::move(bytes), cfg.zero_stage == 2 && shard_plan.sharded, allocator(), zeroer());
      next_shard = std::make_shared<Shard>(cfg.zero_stage, cfg, registry.params(), next, std::move(shard_plan), groups,
                                           next_bufs, mem);
    } else {
      std::vector<std::size_t> bytes;
      for (const auto& b : next.buckets) bytes.push_back(b.bytes());
      next_bufs = std::make_shared<BucketBuffers>(std::move(bytes), false, allocator(), zeroer());
      // Plain DDP: the trainer reads the reduced gradients after wait(); a rebuild moves them along.
      if (bufs && cfg.gradient_as_bucket_view)
        for (const auto& b : next.buckets)
          for (const auto& e : b.entries)
            if (e.numel)
              mem->copy(next_bufs->grad(b.index).get() + e.offset * dtype_size(b.dtype), grad_ptr(e.param),
                       e.numel * dtype_size(b.dtype));
    }
    if (shard && next_shard) migrate_state(*shard, *next_shard);
    stop_actors();
    plan = std::move(next);
    bufs = std::move(next_bufs);
    shard = std::move(next_shard);
    events = std::make_shared<BucketEvents>(mem, plan.buckets.size());
    bucket_pending.reset(new std::atomic<std::uint32_t>[plan.buckets.size()]);
    reset_bucket_pending();
    spawn_actors();
  }

  void reset_bucket_pending() {
    for (std::size_t b = 0; b < plan.buckets.size(); ++b) bucket_pending[b].store(std::uint32_t(plan.buckets[b].entries.size()));
    std::lock_guard lock(prefix_mu);
    bucket_complete.assign(plan.buckets.size(), 0);
    ready_prefix = 0;
  }

  void bucket_completed(std::size_t b) {
    if (!bufs->pooled()) return;
    std::lock_guard lock(prefix_mu);
    bucket_complete[b] = 1;
    while (ready_prefix < bucket_complete.size() && bucket_complete[ready_prefix]) bufs->mark_reducing(ready_prefix++);
  }

  // Where p's gradient lives now: inside its bucket's buffer (taking one from the pool when the
  // bucket has none this iteration), or the trainer's own storage without the bucket view.
  std::byte* grad_ptr(std::uint32_t p) {
    if (!cfg.gradient_as_bucket_view) return static_cast<std::byte*>(registry.params()[p].grad);
    const auto loc = plan.where[p];
    const auto& b = plan.buckets[loc.bucket];
    return bucket_grad(loc.bucket).get() + b.entries[loc.entry].offset * dtype_size(b.dtype);
  }

  // Accumulation passes keep every bucket until the synchronised pass: no backpressure there.
  // With forward prefetch the bucket may still be busy with the last iteration (stepping, or its
  // buffer carrying the sync): gradients are written only once it is done.
  std::shared_ptr<std::byte> bucket_grad(std::uint32_t b) {
    if (prefetch_active) {
      const auto deadline = std::chrono::steady_clock::now() + cfg.timeout + std::chrono::seconds(5);
      const auto outcome = blocked("wait for bucket (last iteration)", b, [&] { return signal->wait_bucket(b, signal_target, deadline); });
      check_outcome(outcome, signal_target, "bucket " + std::to_string(b) + " of the last iteration");
      if (shard) shard->join_bucket(b);  // zeroed on the shard's stream (Note [Shard streams])
    }
    const bool limit = bufs->pooled() && require_sync.load(std::memory_order_relaxed);
    if (!limit) return bufs->grad(b, 0, cfg.timeout);
    return blocked("backpressure (buckets in flight)", b, [&] { return bufs->grad(b, cfg.max_buckets_in_flight, cfg.timeout); });
  }

  // Note [State migration]
  // When the buckets are rebuilt after the first iteration, ownership moves. Each rank exports the
  // state it owns in parameter coordinates (zeros elsewhere); summing the exports over the ranks
  // (x + 0 = x exactly) gives every rank the full state, from which it imports its new pieces. A
  // one-time cost of one all-reduce of the parameter count per state slot.
  void migrate_state(const Shard& from, Shard& to) {
    for (std::size_t slot = 0; slot < from.migrate_slots(); ++slot) {
      auto full = from.export_state(slot);
      if (from.shard_plan().sharded) {
        CollectiveOp op;
        op.kind = CollectiveKind::allreduce;
        op.send = op.recv = full.data();
        op.count = full.size();
        op.tag = "migrate optimizer state " + std::to_string(slot);
        collectives->record(op);
        comm->run(op, cfg.timeout);
      }
      to.import_state(slot, full);
    }
    to.set_steps(from.steps());
  }

  // The iteration's collectives in the order every rank issues them (Note [Collective schedule]).
  std::vector<ScheduleEntry> build_schedule() const {
    const std::size_t B = plan.buckets.size();
    const bool syncs = shard && shard->syncs();
    // Syncs in the observed forward order go after every reduction (they are needed in an order
    // unrelated to the order steps finish in).
    const bool prefetching = !sync_order.empty();
    const bool interleave = cfg.overlap == Overlap::interleaved && (!prefetching || prefetch_early > 0);
    // With prefetch only the first prefetch_early syncs interleave, each after the next bucket's
    // reduction (Note [Forward prefetch]): a reduction never queues behind a step then, and the
    // sync left over for after backward is needed second by forward, which waits for the first.
    const auto shape = schedule_shape(B, syncs, syncs && shard->clips(), interleave, prefetching ? std::max<std::size_t>(1, cfg.interleave_lag) : cfg.interleave_lag,
                                      prefetching ? prefetch_early : B);
    std::vector<ScheduleEntry> entries;
    std::uint32_t rb = 0, sb = 0;
    for (auto kind : shape) {
      ScheduleEntry e;
      e.kind = kind;
      if (kind == ScheduleEntry::reduce) {
        const auto b = rb++;
        e.bucket = b;
        const auto& bk = plan.buckets[b];
        const bool rs = shard && shard->reduce_scatters();
        const std::size_t count = rs ? shard->shard_plan().buckets[b].slice : bk.numel;
        const float scale = 1.0f / float(world);  // the average, fused into the reduction
        // Config::comm_dtype: fp32 gradients travel as 16-bit (cast at issue, back on completion).
        const DType wire = shard ? shard->sync_dtype(b) : bk.dtype;
        e.make_ops = [bufs = bufs, sh = shard, ev = events, b, rs, count, scale, dtype = bk.dtype, wire, tl = timeline] {
          ScheduleEntry::Issue issue;
          CollectiveOp op;
          op.wait_event = ev->get(b);  // GPU buckets: after the backward kernels that wrote them
          op.dtype = wire;
          op.scale = scale;
          op.tag = "bucket " + std::to_string(b);
          auto grad = bufs->grad(b);
          op.count = count;
          std::shared_ptr<std::byte> send = grad, recv = rs ? sh->grad_shard(b) : grad;
          if (wire != dtype) {
            // Cast the whole (padded) bucket; the result comes back into the fp32 buffer it left.
            auto wire_buf = sh->wire_buffer(b);
            const std::size_t n = sh->shard_plan().buckets[b].padded;
            const auto c0 = Timeline::now();
            op.wait_event = sh->to_wire(b, ev->get(b));
            if (tl->tracing())
              tl->span("cast bucket " + std::to_string(b) + " to " + dtype_name(wire), "cast", Lane::cast_to, c0, Timeline::now(),
                       SpanArgs{std::int64_t(b), std::int64_t(n * 4), dtype_name(wire), -1, -1});
            const std::size_t out = rs ? count : n;
            std::byte* out_wire = rs ? wire_buf.get() + n * dtype_size(wire) : wire_buf.get();
            issue.on_complete = [sh, b, out_wire, out, recv, wire_buf, tl, wire] {
              const auto c1 = Timeline::now();
              sh->from_wire(b, reinterpret_cast<float*>(recv.get()), out_wire, out);
              if (tl->tracing())
                tl->span("cast bucket " + std::to_string(b) + " from " + dtype_name(wire), "cast", Lane::cast_from, c1, Timeline::now(),
                         SpanArgs{std::int64_t(b), std::int64_t(out * 4), "fp32", -1, -1});
            };
            send = wire_buf;
            recv = wire_buf;
            op.recv = out_wire;
          } else {
            op.recv = recv.get();
          }
          op.send = send.get();
          op.kind = rs ? CollectiveKind::reduce_scatter : CollectiveKind::allreduce;
          op.keep_alive = std::make_shared<std::pair<std::shared_ptr<std::byte>, std::shared_ptr<std::byte>>>(send, recv);
          issue.ops.push_back(std::move(op));
          return issue;
        };
      } else if (kind == ScheduleEntry::norm) {
        e.make_ops = [sh = shard, r = rank] {
          ScheduleEntry::Issue issue;
          CollectiveOp op;
          op.kind = CollectiveKind::allgather;
          op.send = sh->norm_buffer().get() + r;
          op.recv = sh->norm_buffer().get();
          op.count = 1;
          op.tag = "grad norm";
          op.wait_event = sh->norm_event();
          op.keep_alive = sh->norm_buffer();
          issue.ops.push_back(std::move(op));
          return issue;
        };
      } else {
        const auto b = sync_order.empty() ? sb++ : sync_order[sb++];
        e.bucket = b;
        e.make_ops = [bufs = bufs, sh = shard, bs = shard->shard_plan().buckets[b], b, r = rank, W = world,
                      dtype = shard->sync_dtype(b)] {
          ScheduleEntry::Issue issue;
          auto& ops = issue.ops;
          auto staging_buf = bufs->staging(b);  // taken by the step's pack
          std::byte* staging = staging_buf.get();
          const std::size_t es = dtype_size(dtype);
          if (bs.flat) {
            CollectiveOp op;
            op.kind = CollectiveKind::allgather;
            op.dtype = dtype;
            op.send = staging + std::size_t(r) * bs.slice * es;
            op.recv = staging;
            op.count = bs.slice;
            op.tag = "sync bucket " + std::to_string(b);
            op.wait_event = sh->pack_event(b);
            op.keep_alive = staging_buf;
            ops.push_back(std::move(op));
          } else {
            for (int k = 0; k < W; ++k) {
              if (bs.packed[std::size_t(k)] == 0) continue;
              CollectiveOp op;
              op.kind = CollectiveKind::broadcast;
              op.dtype = dtype;
              op.send = op.recv = staging + bs.packed_start[std::size_t(k)] * es;
              op.count = bs.packed[std::size_t(k)];
              op.root = k;
              op.tag = "sync bucket " + std::to_string(b) + " from rank " + std::to_string(k);
              op.wait_event = sh->pack_event(b);
              op.keep_alive = staging_buf;
              ops.push_back(std::move(op));
            }
          }
          return issue;
        };
      }
      entries.push_back(std::move(e));
    }
    return entries;
  }

  void spawn_actors() {
    auto& sys = engine->system();
    signal = std::make_shared<IterationSignal>(plan.buckets.size());
    signal_target = 0;
    iteration_actor_h = sys.spawn(iteration_actor, signal);
    comm_actor_h = sys.spawn(comm_stream_actor, comm, build_schedule(), collectives, iterations + (closing_iteration ? 1 : 0));
    caf::actor downstream = iteration_actor_h;
    if (shard) {
      // With forward prefetch the trainer's zero_grad() cannot know when a bucket is free again, so
      // the shard zeroes each bucket itself once it is done with it (pooled buckets start zeroed).
      const bool zero_on_done = cfg.forward_prefetch && !bufs->pooled();
      // Steps go in the order the syncs are scheduled: a sync never waits for a step that waits for
      // staging held by a later sync (pooled staging is limited).
      shard_actor_h = sys.spawn(shard_actor, shard, cfg.overlap, comm_actor_h, iteration_actor_h, zero_on_done, sync_order, timeline);
      caf::anon_send(comm_actor_h, msg::set_peer_atom::value, shard_actor_h);
      downstream = shard_actor_h;
    }
    bucket_actors.clear();
    for (const auto& bk : plan.buckets)
      bucket_actors.push_back(sys.spawn(bucket_actor, bk.index, std::uint32_t(bk.entries.size()), comm_actor_h,
                                        downstream, bool(shard)));
  }

  void stop_actors() {
    for (auto& a : bucket_actors) caf::anon_send_exit(a, caf::exit_reason::user_shutdown);
    if (comm_actor_h) caf::anon_send_exit(comm_actor_h, caf::exit_reason::user_shutdown);
    if (iteration_actor_h) caf::anon_send_exit(iteration_actor_h, caf::exit_reason::user_shutdown);
    if (shard_actor_h) caf::anon_send_exit(shard_actor_h, caf::exit_reason::user_shutdown);
    shard_actor_h = nullptr;
    bucket_actors.clear();
    comm_actor_h = nullptr;
    iteration_actor_h = nullptr;
  }

  // ---------------------------------------------------------------------------------------------
  // Hands p's gradient to its bucket actor. In copy mode the gradient goes into the bucket here,
  // on the caller's (backward) thread, not on a scheduler thread.
  void send_to_bucket(std::uint32_t p, bool zero) {
    const auto loc = plan.where[p];
    const auto& b = plan.buckets[loc.bucket];
    const auto& e = b.entries[loc.entry];
    const std::size_t es = dtype_size(b.dtype);
    std::byte* slot = bucket_grad(loc.bucket).get() + e.offset * es;
    if (zero)
      mem->zero(slot, e.numel * es);
    else if (!cfg.gradient_as_bucket_view && e.numel)
      mem->copy(slot, registry.params()[p].grad, e.numel * es);
    // Marked before the message goes out, so the release (after the reduction) always follows it.
    // The bucket's last gradient records its event on the compute stream: every gradient of the
    // bucket was enqueued there before this point (each grad_ready comes after its kernels).
    if (bucket_pending[loc.bucket].fetch_sub(1) == 1) {
      events->record(loc.bucket);
      bucket_completed(loc.bucket);
      // One message per bucket, not per gradient: the count of this pass is already exact here
      // (each parameter is reported once, checked by `marked`), and a message per gradient cost
      // 1 us each in scheduler turns (bench_overhead: 1,000 gradients in 100 buckets).
      caf::anon_send(bucket_actors[loc.bucket], msg::grad_ready_atom::value, std::uint32_t(b.entries.size()));
    }
  }

  // A synchronised iteration ended: its figures, and its span on the iteration lane.
  void end_iteration() {
    const auto t = Timeline::now();
    auto& st = timeline->stats();
    st.end_iteration(t, iterations, plan.buckets.size(), done_in_backward);
    if (timeline->tracing()) {
      const auto& last = st.last();
      timeline->span("iteration " + std::to_string(iterations), "iteration", Lane::iteration,
                     t - Timeline::Time(last.iteration_ms * 1e3), t, SpanArgs{-1, -1, nullptr, std::int64_t(iterations), -1});
    }
  }

  void reset_pass() {
    for (std::size_t i = 0; i < registry.size(); ++i) marked[i].store(0, std::memory_order_relaxed);
    order_pos.store(0, std::memory_order_relaxed);
    backward_finished.store(false, std::memory_order_release);
  }

  // Blocks until every bucket completed `target` synchronised iterations; fails the run otherwise.
  void await_iterations(std::uint64_t target) {
    // The backend enforces Config::timeout on every collective and names the missing ranks; this
    // deadline is a backstop for an actor or backend that never answers at all.
    const auto deadline = std::chrono::steady_clock::now() + cfg.timeout + std::chrono::seconds(5);
    check_outcome(signal->wait_all(target, deadline), target, "iteration " + std::to_string(iterations));
  }

  void check_outcome(IterationSignal::Outcome outcome, std::uint64_t target, const std::string& what) {
    switch (outcome) {
      case IterationSignal::Outcome::complete:
        return;
      case IterationSignal::Outcome::failed: {
        const auto f = signal->failure();
        switch (f.kind) {
          case msg::Failure::timeout: fail(TimeoutError(f.what));
          case msg::Failure::mismatch: fail(MismatchError(f.what));
          case msg::Failure::usage: fail(UsageError(f.what));
          default: fail(CommError(f.what));
        }
      }
      case IterationSignal::Outcome::timed_out: {
        std::string pending;
        for (auto b : signal->pending(target)) pending += (pending.empty() ? "" : ", ") + std::to_string(b);
        fail(TimeoutError("rank " + std::to_string(rank) + ": " + what + " did not complete within " +
                          std::to_string(cfg.timeout.count()) + " ms; bucket(s) still pending: " + pending));
      }
    }
  }

  // Note [Forward prefetch]
  // With Config::forward_prefetch, wait() returns once backward is handed over, and the trainer
  // calls wait_param(p) before its forward uses p. The first iteration waits fully (buckets are
  // rebuilt after it); in the second the runtime records the order in which forward first asks
  // for each bucket; at its end rank 0's order is broadcast and the syncs are issued in it from
  // then on, so the parameters the next forward needs first arrive first.
  // Syncs after backward overlap the next forward; but when backward leaves the link idle between
  // reductions (compute-bound), syncs sent then (interleaved, each after the next bucket's
  // reduction) are free, and fewer are left for the forward to wait on. So the sync order is: K
  // buckets in backward's order, then the rest in forward order. K (Config::
  // prefetch_syncs_in_backward, or chosen here from this iteration, rank 0's) is how many syncs
  // fit in backward's idle link time: backward's length minus its reductions' link time. When the
  // link is the bottleneck that is none, and every sync overlaps the next forward (sending syncs
  // in backward then would only push the forward's first sync further back: measured, 4 ms of
  // idle link per iteration at link/compute 4).
  void establish_sync_order() {
    std::vector<std::uint32_t> order;
    {
      std::lock_guard lock(forward_mu);
      observing_forward = false;
      order = forward_order;
    }
    const std::size_t B = plan.buckets.size();
    std::vector<char> have(B, 0);
    for (auto b : order) have[b] = 1;
    for (std::size_t b = B; b-- > 0;)  // never asked for: forward runs back to front
      if (!have[b]) order.push_back(std::uint32_t(b));
    order.push_back(std::uint32_t(choose_early_syncs()));  // rank 0's choice travels with its order
    if (world > 1) {
      CollectiveOp op;
      op.kind = CollectiveKind::broadcast;
      op.dtype = DType::f32;  // 32-bit words copied as they are
      op.send = op.recv = order.data();
      op.count = order.size();
      op.tag = "forward order";
      collectives->record(op);
      comm->run(op, cfg.timeout);
    }
    prefetch_early = std::min<std::size_t>(order.back(), B);
    order.pop_back();
    // Early syncs in bucket (backward) order, then the rest in forward order.
    std::vector<char> late(B, 0);
    for (std::size_t i = 0; i < B - prefetch_early; ++i) late[order[i]] = 1;
    sync_order.clear();
    for (std::uint32_t b = 0; b < B; ++b)
      if (!late[b]) sync_order.push_back(b);
    for (std::size_t i = 0; i < B - prefetch_early; ++i) sync_order.push_back(order[i]);
    log->info("forward prefetch: {} of {} parameter syncs interleaved with backward, {} overlap the next forward", prefetch_early, B,
              B - prefetch_early);
    prefetch_active = true;
    stop_actors();
    spawn_actors();
  }

  std::size_t choose_early_syncs() const {
    const std::size_t B = plan.buckets.size();
    if (cfg.overlap != Overlap::interleaved || !shard || !shard->syncs()) return 0;
    if (cfg.prefetch_syncs_in_backward >= 0) return std::min<std::size_t>(std::size_t(cfg.prefetch_syncs_in_backward), B);
    const auto open = timeline->stats().open_window();
    std::vector<double> bytes(B);
    double total = 0;
    for (std::size_t b = 0; b < B; ++b) total += bytes[b] = double(shard->shard_plan().buckets[b].padded) * dtype_size(shard->sync_dtype(b));
    if (total <= 0 || open.sync_ms <= 0) return 0;
    const double ms_per_byte = open.sync_ms / total;
    const double idle = open.backward_ms - open.reduce_ms;
    // The syncs forward needs last (backward's first buckets) go first; the one forward needs first
    // cannot go before backward ends anyway.
    std::size_t k = 0;
    double t = 0;
    while (k + 1 < B && (t += bytes[k] * ms_per_byte) <= idle) ++k;
    return k;
  }

  void rebuild_from_observed_order() {
    std::vector<std::uint32_t> observed(order.begin(), order.begin() + registry.size());
    if (world > 1) {
      // Rank 0's order wins, so every rank builds the same buckets.
      CollectiveOp op;
      op.kind = CollectiveKind::broadcast;
      op.dtype = DType::f32;  // 32-bit words copied as they are
      op.send = observed.data();
      op.recv = observed.data();
      op.count = observed.size();
      op.root = 0;
      op.tag = "rebuild buckets: ready order";
      collectives->record(op);
      comm->run(op, cfg.timeout);
    }
    auto next = make_bucket_plan(registry.params(), observed, cfg.first_bucket_cap_bytes, cfg.bucket_cap_bytes);
    rebuilt = true;
    if (same_layout(plan, next)) return;
    install_plan(std::move(next));
    log->info("buckets rebuilt from the observed gradient order:\n{}", plan.describe());
  }
};

// -----------------------------------------------------------------------------------------------

Runtime::Runtime(std::shared_ptr<Communicator> comm, Config config) : impl_(std::make_unique<Impl>()) {
  if (!comm) throw UsageError("Runtime: communicator is null");
  config.validate();
  auto& I = *impl_;
  I.cfg = config;
  I.comm = std::move(comm);
  I.rank = I.comm->rank();
  I.world = I.comm->world_size();
  I.owner = next_owner_id.fetch_add(1);
  I.log = rank_logger(I.rank);
  I.engine = Engine::acquire(config.actor_threads);
  std::string trace_file;
  if (!config.trace_path.empty()) {
    // Ranks that are threads of one process share a file; a rank that is a process of its own
    // writes its own (Note [Timeline]).
    bool own_process = false;
    try {
      const auto env = LaunchEnv::detect();
      own_process = env.launched() && env.world_size > 1;
    } catch (const std::exception&) {
      // a malformed launch environment is the process group's error to report, not the trace's
    }
    trace_file = resolve_trace_path(config.trace_path, I.rank, own_process);
  }
  I.timeline = std::make_shared<Timeline>(I.rank, trace_file);
  I.collectives->set_timeline(I.timeline);
}

Runtime::~Runtime() {
  auto& I = *impl_;
  if (I.prefetch_active && !I.failed.load() && !I.sync_pass_started) {
    // The last iteration may still be updating the trainer's parameters: let it land before the
    // trainer frees them.
    I.signal->wait_all(I.signal_target, std::chrono::steady_clock::now() + I.cfg.timeout);
  }
  if (I.sync_pass_started && !I.failed.load()) {
    // Peers are (or will be) inside this iteration's collectives: let them fail now rather than
    // after the timeout. The buffers stay alive until the backend lets go of them (keep_alive).
    I.comm->abort("rank " + std::to_string(I.rank) + "'s Runtime was destroyed in the middle of iteration " +
                  std::to_string(I.iterations));
  }
  I.stop_actors();
  I.timeline->close();  // the trace file is complete once the last rank's Runtime is gone
}

int Runtime::rank() const { return impl_->rank; }
int Runtime::world_size() const { return impl_->world; }
const Config& Runtime::config() const { return impl_->cfg; }
std::size_t Runtime::num_params() const { return impl_->registry.size(); }
std::uint64_t Runtime::iteration() const { return impl_->iterations; }

Param Runtime::register_param(ParamSpec spec) {
  auto& I = *impl_;
  std::lock_guard lock(I.finalize_mu);
  if (I.finalized.load())
    throw UsageError("register_param('" + spec.name + "'): registration is closed once training has started");
  if (I.device_bound && !(spec.device == I.mem->device) && I.comm->supports(spec.device))
    throw UsageError("register_param('" + spec.name + "'): parameter is on " + spec.device.str() + " but '" +
                     I.name_of(0) + "' is on " + I.mem->device.str() +
                     "; one Runtime reduces the parameters of one device (use one Runtime per device)");
  const Device device = spec.device;
  auto index = Param{I.registry.add(std::move(spec), I.cfg.gradient_as_bucket_view, *I.comm), I.owner};
  I.mem->device = device;
  I.device_bound = true;
  return index;
}

Param Runtime::param(const std::string& name) const {
  auto& I = *impl_;
  auto idx = I.registry.find(name);
  if (!idx) {
    std::string known;
    for (std::size_t i = 0; i < std::min<std::size_t>(I.registry.size(), 5); ++i)
      known += (i ? ", " : "") + I.name_of(std::uint32_t(i));
    if (I.registry.size() > 5) known += ", ...";
    throw UsageError("unknown parameter '" + name + "' on rank " + std::to_string(I.rank) + " (registered: " +
                     (known.empty() ? "none" : known) + ")");
  }
  return Param{*idx, I.owner};
}

void Runtime::finalize() { impl_->ensure_finalized(); }

void Runtime::set_stream(void* cuda_stream) {
  auto& I = *impl_;
  if (I.sync_pass_started)
    throw UsageError("set_stream on rank " + std::to_string(I.rank) + " in the middle of a backward pass: change it between iterations");
  I.mem->stream = cuda_stream;
  if (I.shard) {  // GPU shards: the new stream and the shard's are ordered both ways from here on
    I.shard->follow_compute();
    I.shard->join_compute();
  }
}

void* Runtime::grad(Param p) {
  auto& I = *impl_;
  I.ensure_finalized();
  return I.grad_ptr(I.check_handle(p, "grad"));
}

float* Runtime::grad_f32(Param p) {
  auto& I = *impl_;
  const auto i = I.check_handle(p, "grad_f32");
  if (I.registry.params()[i].dtype != DType::f32)
    throw UsageError("grad_f32: parameter '" + I.name_of(i) + "' is " + dtype_name(I.registry.params()[i].dtype) +
                     ", use grad()");
  return static_cast<float*>(grad(p));
}

void Runtime::zero_grad() {
  auto& I = *impl_;
  I.ensure_finalized();
  I.timeline->stats().touch(Timeline::now());
  if (I.sync_pass_started)
    throw UsageError("zero_grad() on rank " + std::to_string(I.rank) +
                     " while this iteration's reductions are running: call wait() first");
  if (I.cfg.gradient_as_bucket_view) {
    // Pooled buckets (ZeRO-2) hold no buffer between iterations and start zeroed; flat padding is
    // never written, so it stays zero. With forward prefetch the shard zeroes each bucket when it
    // is done with it (it may still be busy now).
    if (!(I.shard && I.cfg.forward_prefetch)) I.bufs->zero_held();
  } else {
    for (std::size_t i = 0; i < I.registry.size(); ++i) {
      const auto& s = I.registry.params()[i];
      if (s.grad) I.mem->zero(s.grad, std::size_t(numel(s.shape)) * dtype_size(s.dtype));
    }
  }
}

void Runtime::grad_ready(const std::string& name) { grad_ready(param(name)); }

RuntimeStats Runtime::stats() const { return impl_->timeline->stats().snapshot(); }
IterationStats Runtime::last_stats() const { return impl_->timeline->stats().last(); }

namespace {
const char* trainer_cat(const char* cat) {
  static const char* const known[] = {"forward", "backward", "step"};
  for (const char* k : known)
    if (cat && std::strcmp(cat, k) == 0) return k;
  throw UsageError(std::string("Runtime::span: category '") + (cat ? cat : "(null)") + "' is not one of forward, backward, step");
}
}  // namespace

Runtime::Span Runtime::span(std::string name, const char* cat) {
  const auto t = Timeline::now();
  impl_->timeline->stats().touch(t);
  return Span(this, std::move(name), trainer_cat(cat), t);
}

Runtime::Span::~Span() {
  if (!rt_) return;
  auto& tl = *rt_->impl_->timeline;
  tl.span(std::move(name_), cat_, Lane::compute, begin_, Timeline::now(), SpanArgs{-1, -1, nullptr, std::int64_t(rt_->impl_->iterations), -1});
}

void Runtime::grad_ready(Param p) {
  auto& I = *impl_;
  I.ensure_finalized();
  I.throw_if_failed();
  I.check_settings_used();
  const auto i = I.check_handle(p, "grad_ready");
  if (I.backward_finished.load(std::memory_order_acquire))
    throw UsageError("grad_ready('" + I.name_of(i) + "') on rank " + std::to_string(I.rank) +
                     " after finish_backward(): call wait() before the next backward pass");
  if (I.marked[i].exchange(1, std::memory_order_acq_rel))
    throw UsageError("parameter '" + I.name_of(i) + "' was marked ready twice in iteration " +
                     std::to_string(I.iterations) + " on rank " + std::to_string(I.rank) +
                     ". Report each gradient once per backward pass; a parameter used several times in forward "
                     "is reported after its gradient is complete.");
  I.order[I.order_pos.fetch_add(1, std::memory_order_relaxed)] = i;
  if (!I.require_sync.load(std::memory_order_relaxed)) {
    I.touched[i] = 1;  // accumulates locally; reduced with the next synchronised pass
    return;
  }
  if (!I.sync_pass_started.load(std::memory_order_relaxed)) I.timeline->stats().backward_started(Timeline::now());
  I.sync_pass_started.store(true, std::memory_order_relaxed);
  if (I.timeline->tracing())
    I.timeline->instant("grad_ready " + I.name_of(i), "backward", Lane::compute,
                        SpanArgs{std::int64_t(I.plan.where[i].bucket), -1, nullptr, std::int64_t(I.iterations), -1});
  I.send_to_bucket(i, false);
}

void Runtime::finish_backward() {
  auto& I = *impl_;
  I.ensure_finalized();
  I.throw_if_failed();
  I.check_settings_used();
  if (I.backward_finished.load()) return;
  const auto n = I.registry.size();
  if (!I.require_sync.load()) {
    I.reset_pass();
    return;  // accumulation pass: nothing to reduce yet; wait() returns at once
  }
  std::vector<std::uint32_t> missing, accumulated;
  for (std::uint32_t i = 0; i < n; ++i) {
    if (I.marked[i].load(std::memory_order_acquire)) continue;
    (I.touched[i] ? accumulated : missing).push_back(i);
  }
  if (!missing.empty() && !I.cfg.find_unused_parameters) {
    std::string names;
    for (std::size_t k = 0; k < missing.size() && k < 10; ++k) names += (k ? ", " : "") + I.name_of(missing[k]);
    if (missing.size() > 10) names += ", ...";
    I.fail(UsageError("finish_backward: " + std::to_string(missing.size()) + " parameter(s) got no gradient in iteration " +
                      std::to_string(I.iterations) + " on rank " + std::to_string(I.rank) + ": " + names +
                      ". Call grad_ready() for each, or set Config::find_unused_parameters = true to reduce "
                      "parameters without a gradient as zeros."));
  }
  // Gradients accumulated in earlier no_sync passes are reduced as they are; parameters that got
  // nothing at all are reduced as zeros (find_unused_parameters).
  for (auto i : accumulated) {
    I.order[I.order_pos.fetch_add(1)] = i;
    I.send_to_bucket(i, false);
  }
  for (auto i : missing) {
    I.order[I.order_pos.fetch_add(1)] = i;
    I.send_to_bucket(i, true);
  }
  I.sync_pass_started.store(true);
  I.timeline->stats().backward_ended(Timeline::now());
  // How many buckets were already reduced, stepped and synced when backward ended (stats()).
  I.done_in_backward = I.plan.buckets.size() - I.signal->pending(I.signal_target + 1).size();
  I.backward_finished.store(true, std::memory_order_release);
}

void Runtime::wait() {
  auto& I = *impl_;
  I.ensure_finalized();
  I.throw_if_failed();
  if (!I.require_sync.load()) {
    finish_backward();  // closes the accumulation pass
    return;
  }
  finish_backward();
  ++I.signal_target;
  const bool prefetching = I.prefetch_active;
  // Prefetching, only the previous iteration must be complete (forward waited for its buckets);
  // this one finishes while the next forward runs (Note [Forward prefetch]).
  I.blocked("wait (iteration)", -1, [&] { I.await_iterations(prefetching ? I.signal_target - 1 : I.signal_target); });
  // GPU shards: what comes next on the compute stream (forward, zero_grad) follows the updates.
  if (I.shard && !prefetching) I.shard->join_compute();
  if (!I.cfg.gradient_as_bucket_view && !I.shard) {
    for (const auto& b : I.plan.buckets) {
      const std::size_t es = dtype_size(b.dtype);
      for (const auto& e : b.entries)
        if (e.numel) I.mem->copy(I.registry.params()[e.param].grad, I.bufs->grad(b.index).get() + e.offset * es, e.numel * es);
    }
  }
  I.reset_bucket_pending();
  I.sync_pass_started.store(false);
  std::fill(I.touched.begin(), I.touched.end(), 0);
  const bool prefetch_wanted = I.cfg.forward_prefetch && I.shard;
  const Shard* stepped_by = I.shard.get();
  I.closing_iteration = true;
  if (!I.rebuilt && !I.cfg.static_graph) {
    const auto r0 = Timeline::now();
    I.rebuild_from_observed_order();
    I.timeline->span("rebuild buckets", "rebuild", Lane::compute, r0, Timeline::now(),
                     SpanArgs{-1, -1, nullptr, std::int64_t(I.iterations), -1});
  } else if (prefetch_wanted && !I.prefetch_active && I.observing_forward) {
    const auto r0 = Timeline::now();
    I.establish_sync_order();
    I.timeline->span("forward order for prefetch", "rebuild", Lane::compute, r0, Timeline::now(),
                     SpanArgs{-1, -1, nullptr, std::int64_t(I.iterations), -1});
  }
  I.closing_iteration = false;
  if (prefetch_wanted && !I.prefetch_active && !I.observing_forward) {
    std::lock_guard lock(I.forward_mu);
    I.observing_forward = true;  // the next forward's first-use order decides the sync order
    I.forward_seen.assign(I.plan.buckets.size(), 0);
    I.forward_order.clear();
  }
  // A rebuilt shard copied its masters and state on its own stream: the compute stream waits for
  // that too, so that wait()'s promise holds for whichever shard the next iteration uses.
  if (I.shard && I.shard.get() != stepped_by && !prefetching) I.shard->join_compute();
  I.reset_pass();
  I.end_iteration();
  ++I.iterations;
}

void Runtime::wait_param(Param p) {
  auto& I = *impl_;
  I.ensure_finalized();
  I.throw_if_failed();
  const auto b = I.plan.where[I.check_handle(p, "wait_param")].bucket;
  if (I.observing_forward) {
    std::lock_guard lock(I.forward_mu);
    if (I.observing_forward && !I.forward_seen[b]) {
      I.forward_seen[b] = 1;
      I.forward_order.push_back(b);
    }
  }
  if (!I.prefetch_active) return;  // wait() waited for everything
  const auto deadline = std::chrono::steady_clock::now() + I.cfg.timeout + std::chrono::seconds(5);
  const auto outcome = I.blocked("wait_param", b, [&] { return I.signal->wait_bucket(b, I.signal_target, deadline); });
  I.check_outcome(outcome, I.signal_target,
                  "the update of parameter '" + I.name_of(p.index) + "' (bucket " + std::to_string(b) + ")");
  if (I.shard) I.shard->join_bucket(b);  // GPU: the compute stream waits for the bucket's update
}

void Runtime::wait_all_params() {
  auto& I = *impl_;
  I.ensure_finalized();
  I.throw_if_failed();
  if (I.prefetch_active) {
    I.blocked("wait_all_params", -1, [&] { I.await_iterations(I.signal_target); });
    if (I.shard) I.shard->join_compute();
  }
}

void Runtime::set_require_sync(bool sync) {
  auto& I = *impl_;
  if (I.sync_pass_started)
    throw UsageError("set_require_sync/no_sync on rank " + std::to_string(I.rank) +
                     " in the middle of a synchronised backward pass: change it between iterations");
  I.require_sync.store(sync);
}

std::vector<BucketInfo> Runtime::buckets() const {
  auto& I = *impl_;
  I.ensure_finalized();
  std::vector<BucketInfo> out;
  for (const auto& b : I.plan.buckets) {
    BucketInfo info{b.index, b.dtype, b.device, b.bytes(), {}};
    for (const auto& e : b.entries) info.params.push_back(I.name_of(e.param));
    out.push_back(std::move(info));
  }
  return out;
}

std::vector<std::string> Runtime::collective_log() const { return impl_->collectives->lines(); }

void Runtime::configure_optimizer(std::vector<ParamGroup> groups) {
  auto& I = *impl_;
  I.ensure_finalized();
  I.throw_if_failed();
  if (I.sync_pass_started || (I.shard && I.shard->steps() > 0))
    throw UsageError("configure_optimizer on rank " + std::to_string(I.rank) + ": call it once, before training starts");
  if (groups.empty()) throw UsageError("configure_optimizer: no parameter groups");
  auto og = std::make_shared<OptimizerGroups>();
  og->group_of.assign(I.registry.size(), ~0u);
  for (std::size_t g = 0; g < groups.size(); ++g) {
    const auto& oc = groups[g].optimizer;
    oc.validate();
    if (oc.kind != groups[0].optimizer.kind)
      throw UsageError("configure_optimizer: group " + std::to_string(g) + " uses another optimizer kind than group 0");
    for (Param p : groups[g].params) {
      const auto i = I.check_handle(p, "configure_optimizer");
      if (og->group_of[i] != ~0u)
        throw UsageError("configure_optimizer: parameter '" + I.name_of(i) + "' is in groups " +
                         std::to_string(og->group_of[i]) + " and " + std::to_string(g));
      og->group_of[i] = std::uint32_t(g);
    }
    og->groups.push_back(oc);
  }
  for (std::size_t i = 0; i < I.registry.size(); ++i)
    if (og->group_of[i] == ~0u) og->group_of[i] = 0;
  I.groups = std::move(og);
  I.shard.reset();
  I.install_plan(BucketPlan(I.plan));
}

void Runtime::set_lr(std::size_t group, float lr) {
  auto& I = *impl_;
  if (!I.groups) throw UsageError("set_lr: no optimizer configured (configure_optimizer)");
  if (group >= I.groups->groups.size())
    throw UsageError("set_lr: group " + std::to_string(group) + " does not exist (" + std::to_string(I.groups->groups.size()) +
                     " group(s))");
  if (I.sync_pass_started) throw UsageError("set_lr: change the learning rate between iterations");
  if (!(lr >= 0.0f)) throw UsageError("set_lr: lr must be >= 0");
  // The runtime's copy changes now; the shard gets an immutable snapshot for the iterations from
  // the next one on (Note [Hyper-parameter snapshots]).
  auto next = std::make_shared<OptimizerGroups>(*I.groups);
  next->groups[group].lr = lr;
  I.groups = next;
  if (I.shard_actor_h)
    caf::anon_send(I.shard_actor_h, msg::set_groups_atom::value, std::uint64_t(I.iterations),
                   std::shared_ptr<const OptimizerGroups>(next));
}

float Runtime::last_grad_norm() const { return impl_->shard ? impl_->shard->last_norm() : 0.0f; }

MemoryReport Runtime::memory_report() const {
  auto& I = *impl_;
  I.ensure_finalized();
  MemoryReport m;
  for (const auto& p : I.registry.params()) m.params += std::size_t(numel(p.shape)) * dtype_size(p.dtype);
  if (I.shard) {
    m.grads = I.shard->grad_bytes();
    m.optimizer_state = I.shard->state_bytes();
    m.comm_buffers = I.shard->comm_bytes();
  } else {
    m.grads = I.bufs->allocated_bytes();
  }
  return m;
}

std::string MemoryReport::str() const {
  auto mib = [](std::size_t b) { return std::to_string(double(b) / 1048576.0).substr(0, 6) + " MiB"; };
  return "params " + mib(params) + ", grads " + mib(grads) + ", optimizer state " + mib(optimizer_state) +
         ", comm buffers " + mib(comm_buffers);
}

}  // namespace shardflow
