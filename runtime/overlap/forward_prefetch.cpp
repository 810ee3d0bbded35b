// Note [Forward prefetch]
// With Config::zero.forward_prefetch, wait() returns once backward is handed over, and the trainer
// calls wait_param(p) before its forward uses p. The first iteration waits fully (buckets are
// rebuilt after it); in the second the runtime records the order in which forward first asks
// for each bucket; at its end rank 0's order is broadcast and the syncs are issued in it from
// then on, so the parameters the next forward needs first arrive first.
// Syncs after backward overlap the next forward; but when backward leaves the link idle between
// reductions (compute-bound), syncs sent then (interleaved, each after the next bucket's
// reduction) are free, and fewer are left for the forward to wait on. So the sync order is: K
// buckets in backward's order, then the rest in forward order. K (Config::
// prefetch_syncs_in_backward, or chosen here from this iteration, rank 0's: Note [Choosing the
// syncs in backward]) is the one whose schedule, replayed on this iteration's measured times,
// gives the shortest iteration. When the link is the bottleneck that is none, and every sync
// overlaps the next forward (sending syncs in backward then would only push the forward's first
// sync further back: measured, 4 ms of idle link per iteration at link/compute 4).
//
// Note [Choosing on a settled iteration]
// The second iteration, which shows forward's order, is not yet a steady one: it runs on the
// buckets just rebuilt, its pages and the optimizer's state touched for the first time (16 x
// Linear(512, 512), world 2: 91 ms against 28 ms from the fourth on, its replay 152 ms). Its
// times made K look as if backward left the link idle: 14 of 17 syncs went into backward where
// none was best (ZeRO-2, link/compute 1: 31.2 ms against 28.6 ms). The interleave lag, chosen on
// the first iteration, fared the same: 4 runs of that case without prefetch chose lag 0 three
// times (40-41 ms an iteration) and lag 4 once (31 ms). So each automatic choice is made again,
// once, on the fifth iteration's times (kLagSettleIterations, kPrefetchSettleIterations), measured
// the same way (waits left out); the actors restart only if the choice changed. Prefetching, that
// iteration first waits for its syncs, as wait() without prefetch does: the choice's broadcast
// must not go out among them.
#include "runtime/rank/runtime_impl.hpp"
#include "runtime/overlap/overlap_state.hpp"

#include "runtime/plans/prefetch_model.hpp"

namespace shardflow {

void Runtime::Impl::establish_sync_order() {
  std::vector<std::uint32_t> order;
  std::vector<std::int64_t> asked;
  {
    std::lock_guard lock(overlap->prefetch.mu);
    overlap->prefetch.observing = false;
    order = overlap->prefetch.forward_order;
    asked = overlap->prefetch.asked_us;
  }
  const bool again = overlap->prefetch.active;
  if (again) complete_prefetched_pass();
  const std::size_t early = choose_early_syncs(order, asked);
  const std::size_t B = plan.buckets.size();
  order = complete_forward_order(std::move(order), B);
  order.push_back(std::uint32_t(early));  // rank 0's choice travels with its order
  control_collective(CollectiveKind::broadcast, order.data(), order.size(), "forward order");
  const std::size_t chosen = std::min<std::size_t>(order.back(), B);
  order.pop_back();
  auto sync_order = prefetch_sync_order(order, chosen);
  // Note [Choosing on a settled iteration]: only the automatic choice is made again.
  overlap->prefetch.recheck_after = !again && early_syncs_measured() ? iterations + kPrefetchSettleIterations - 1 : ~std::uint64_t{0};
  if (again && chosen == overlap->prefetch.early && sync_order == overlap->prefetch.sync_order) {
    log->info("forward prefetch: iteration {}'s steady times keep {} of {} parameter syncs in backward", iterations + 1, chosen, B);
    return;
  }
  overlap->prefetch.early = chosen;
  overlap->prefetch.sync_order = std::move(sync_order);
  log->info("forward prefetch: {} of {} parameter syncs interleaved with backward, {} overlap the next forward{}", chosen, B, B - chosen,
            again ? " (chosen again on steady times)" : "");
  overlap->prefetch.active = true;
  stop_actors();
  spawn_actors(iterations + 1);  // inside wait(): the actors start the next iteration
}

bool Runtime::Impl::early_syncs_measured() const {
  return cfg.zero.overlap == Overlap::interleaved && shard && shard->syncs() && cfg.zero.prefetch_syncs_in_backward < 0;
}

bool Runtime::Impl::wants_forward_observation() const {
  return !overlap->prefetch.observing && (!overlap->prefetch.active || overlap->prefetch.recheck_after == iterations);
}

void Runtime::Impl::start_observing_forward() {
  std::lock_guard lock(overlap->prefetch.mu);
  overlap->prefetch.observing = true;
  overlap->prefetch.seen.assign(plan.buckets.size(), 0);
  overlap->prefetch.forward_order.clear();
  overlap->prefetch.asked_us.clear();
}

void Runtime::Impl::note_forward_use(std::uint32_t b) {
  std::lock_guard lock(overlap->prefetch.mu);
  if (!overlap->prefetch.observing || overlap->prefetch.seen[b]) return;
  overlap->prefetch.seen[b] = 1;
  overlap->prefetch.forward_order.push_back(b);
  overlap->prefetch.asked_us.push_back(Timeline::now());
}

std::size_t Runtime::Impl::choose_early_syncs(const std::vector<std::uint32_t>& order, std::vector<std::int64_t> asked) const {
  const std::size_t B = plan.buckets.size();
  if (cfg.zero.overlap != Overlap::interleaved || !shard || !shard->syncs()) return 0;
  if (!early_syncs_measured()) return std::min<std::size_t>(std::size_t(cfg.zero.prefetch_syncs_in_backward), B);
  const auto open = timeline->stats().open_window();
  std::vector<double> bytes(B);
  for (std::size_t b = 0; b < B; ++b) bytes[b] = double(shard->shard_plan().buckets[b].padded) * dtype_size(shard->sync_dtype(b));
  if (open.sync_ms <= 0) return 0;
  // On the trainer's own clock: stage 2's backpressure held backward up while the link was the
  // bottleneck, which would make backward look as long as the link.
  auto& st = timeline->stats();
  auto ready = readiness->ready_times();
  for (auto& t : ready)
    if (t >= 0) t = st.unblocked(t);
  for (auto& t : asked) t = st.unblocked(t);
  auto times = observed_prefetch_times(order, asked, ready, bytes, open.reduce_ms, open.sync_ms, std::max<std::size_t>(1, overlap->lag.lag));
  times.grads_in_flight = bufs->pooled() ? caps.grads_in_flight : 0;  // Note [Backpressure in the replay]
  const auto choice = best_early_syncs(times);
  log->debug("forward prefetch: replayed iteration {:.3f} ms with {} syncs in backward ({:.3f} ms with none)", choice.iteration_ms,
             choice.early, steady_iteration_ms(times, 0));
  return choice.early;
}

bool Runtime::Impl::prefetching() const { return overlap->prefetch.active; }

bool Runtime::Impl::observing_forward() const { return overlap->prefetch.observing; }

const std::vector<std::uint32_t>& Runtime::Impl::sync_order() const { return overlap->prefetch.sync_order; }

}  // namespace shardflow
