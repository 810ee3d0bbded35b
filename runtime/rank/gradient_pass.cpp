// One synchronised pass as the trainer's threads drive it: where a gradient goes, the bucket's
// readiness (Note [One count per bucket]: one message per bucket), backpressure, and waiting for
// the iteration (or failing it with the first error heard).
#include "runtime/rank/runtime_impl.hpp"

#include "actors/messages.hpp"

namespace shardflow {

std::byte* Runtime::Impl::grad_ptr(std::uint32_t p) {
  if (!cfg.buckets.gradient_as_bucket_view) return static_cast<std::byte*>(registry.params()[p].grad);
  const auto loc = plan.where[p];
  const auto& b = plan.buckets[loc.bucket];
  return bucket_grad(loc.bucket).get() + b.entries[loc.entry].offset * dtype_size(b.dtype);
}

std::shared_ptr<std::byte> Runtime::Impl::bucket_grad(std::uint32_t b) {
  if (prefetching()) {
    await_bucket(b, "wait for bucket (last iteration)", [&] { return "bucket " + std::to_string(b) + " of the last iteration"; });
    if (shard) shard->join_bucket(b);  // zeroed on the shard's stream (Note [Shard streams])
  }
  const bool limit = bufs->pooled() && require_sync.load(std::memory_order_relaxed);
  if (!limit) return bufs->grad(b, 0, cfg.timeouts.collective);
  // Only a bucket's first gradient can wait for a buffer: the others find it held, and skip the
  // two clock reads of a timed wait (a tenth of stage 2's per-bucket cost with 10 gradients a
  // bucket on bench_overhead).
  if (auto held = bufs->held_grad(b)) return held;
  auto buf = blocked("backpressure (buckets in flight)", b, [&] { return bufs->grad(b, caps.grads_in_flight, cfg.timeouts.collective, backpressure_refill(caps.grads_in_flight)); });
  // Note [A failure ends the wait for a buffer]: the iteration failed while this one waited.
  if (!buf) check_outcome(IterationSignal::Outcome::failed, passes_handed, "bucket " + std::to_string(b) + "'s gradient buffer");
  return buf;
}

void Runtime::Impl::send_to_bucket(std::uint32_t p, bool zero) {
  const auto loc = plan.where[p];
  const auto& b = plan.buckets[loc.bucket];
  const auto& e = b.entries[loc.entry];
  const std::size_t es = dtype_size(b.dtype);
  std::byte* slot = bucket_grad(loc.bucket).get() + e.offset * es;
  if (zero)
    mem->zero(slot, e.numel * es);
  else if (!cfg.buckets.gradient_as_bucket_view && e.numel)
    mem->copy(slot, registry.params()[p].grad, e.numel * es);
  // The bucket's last gradient (Note [One count per bucket]) records its event on the compute
  // stream: every gradient of the bucket was enqueued there before this point (each grad_ready
  // comes after its kernels). Pooled buffers are marked reducing before the message goes out, so
  // the release (after the reduction) always follows it.
  if (readiness->gradient_in(loc.bucket)) {
    readiness->ready_at(loc.bucket, Timeline::now());
    events->record(loc.bucket);
    if (bufs->pooled()) {
      const auto [from, to] = readiness->extend_ready_run(loc.bucket);
      for (auto r = from; r < to; ++r) bufs->mark_reducing(r);
    }
    caf::anon_send(bucket_actors[loc.bucket], msg::grad_ready_atom::value, readiness->size(loc.bucket));
  }
}

// Note [A window of another schedule]
// With forward prefetch a wait() returns before this pass's syncs land, so an iteration's window
// holds the previous pass's syncs (landed in its forward): one pass's worth, as every steady window.
// Where the waits change kind, a window holds none or two: the first wait that returns early,
// after the first iterations' full ones, and the wait whose syncs the runtime awaits before it
// chooses again on the settled fifth iteration (Note [Choosing on a settled iteration]) with the
// one after it. Their bounds counted the link not at all or twice (the GPT at world 2 on a
// simulated 1 Gbit/s link: a window of 361 ms against a bound of 730). Those windows get no bound,
// as one with nothing measured.
void Runtime::Impl::end_iteration() {
  const auto t = Timeline::now();
  auto& st = timeline->stats();
  const bool one_schedule = wait_prefetching == last_wait_prefetching && !syncs_awaited && !syncs_awaited_last;
  last_wait_prefetching = wait_prefetching;
  syncs_awaited_last = syncs_awaited;
  syncs_awaited = false;
  st.end_iteration(t, iterations, plan.buckets.size(), done_in_backward, readiness->ready_times(), one_schedule);
  if (timeline->tracing()) {
    const auto& last = st.last();
    timeline->span("iteration " + std::to_string(iterations), "iteration", Lane::iteration,
                   t - Timeline::Time(last.iteration_ms * 1e3), t, SpanArgs{-1, -1, nullptr, std::int64_t(iterations), -1});
  }
}

void Runtime::Impl::reset_pass() {
  for (std::size_t i = 0; i < registry.size(); ++i) marked[i].store(0, std::memory_order_relaxed);
  order_pos.store(0, std::memory_order_relaxed);
}

void Runtime::Impl::await_iterations(std::uint64_t target) {
  // The backend enforces Config::timeouts.collective on every collective and names the missing ranks; this
  // deadline is a backstop for an actor or backend that never answers at all.
  const auto deadline = std::chrono::steady_clock::now() + cfg.timeouts.collective + std::chrono::seconds(5);
  check_outcome(signal->wait_all(target, deadline), target, "iteration " + std::to_string(iterations));
}

void Runtime::Impl::hand_over(ScheduledCollective::Kind kind, CollectiveIssue issue) {
  caf::anon_send(comm_actor_h, msg::handed_over_atom::value, std::uint8_t(kind), std::move(issue));
}

std::uint32_t Runtime::Impl::signal_index(ScheduledCollective::Kind kind) const {
  const auto buckets = std::uint32_t(plan.buckets.size());
  if (kind == ScheduledCollective::unused) return finds_unused() ? buckets : ~0u;
  if (kind == ScheduledCollective::buffers) return syncs_buffers() ? buckets + (finds_unused() ? 1 : 0) : ~0u;
  return ~0u;
}

void Runtime::Impl::await_handed(std::uint64_t target) {
  const auto deadline = std::chrono::steady_clock::now() + cfg.timeouts.collective + std::chrono::seconds(5);
  for (auto kind : {ScheduledCollective::unused, ScheduledCollective::buffers})
    if (const auto i = signal_index(kind); i != ~0u)
      check_outcome(signal->wait_bucket(i, target, deadline), target, "iteration " + std::to_string(iterations));
}

bool Runtime::Impl::pass_complete(std::uint64_t target, bool prefetching_wait) {
  if (signal->failure()) check_outcome(IterationSignal::Outcome::failed, prefetching_wait ? target - 1 : target, "");
  IterationSignal::Watch left;
  return !watch_pass(left, target, prefetching_wait);
}

bool Runtime::Impl::watch_pass(IterationSignal::Watch& w, std::uint64_t target, bool prefetching_wait) const {
  const std::uint64_t need = prefetching_wait ? target - 1 : target;
  if (!signal->all_done(need)) {
    w.all = w.all ? std::min(w.all, need) : need;
    return true;
  }
  bool left = false;
  if (prefetching_wait)
    for (auto kind : {ScheduledCollective::unused, ScheduledCollective::buffers})
      if (const auto i = signal_index(kind); i != ~0u && !signal->done(i, target)) {
        w.slots.emplace_back(i, target);
        left = true;
      }
  return left;
}

void Runtime::Impl::pass_timed_out(std::uint64_t target, const std::string& what) {
  check_outcome(IterationSignal::Outcome::timed_out, target, what);
  throw TimeoutError(what);  // not reached: check_outcome throws
}

void Runtime::Impl::check_outcome(IterationSignal::Outcome outcome, std::uint64_t target, const std::string& what) {
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
      for (auto b : signal->pending(target))
        pending += (pending.empty() ? "" : ", ") + (b < plan.buckets.size()                        ? std::to_string(b)
                                                    : b == signal_index(ScheduledCollective::unused) ? std::string("the used counts' exchange")
                                                                                                    : std::string("the buffers' broadcast"));
      fail(TimeoutError("rank " + std::to_string(rank) + ": " + what + " did not complete within " +
                        std::to_string(cfg.timeouts.collective.count()) + " ms; bucket(s) still pending: " + pending));
    }
  }
}

}  // namespace shardflow
