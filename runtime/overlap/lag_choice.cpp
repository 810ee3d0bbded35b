// Choosing the interleave lag after the first iteration (Note [Choosing the interleave lag]).
#include "runtime/plans/interleave_lag.hpp"

#include "runtime/rank/runtime_impl.hpp"
#include "runtime/overlap/overlap_state.hpp"

namespace shardflow {

void Runtime::Impl::choose_interleave_lag() {
  const bool again = overlap->lag.chosen && overlap->lag.recheck_after == iterations;  // Note [Choosing on a settled iteration]
  if (overlap->lag.chosen && !again) return;
  overlap->lag.chosen = true;
  if (cfg.zero.overlap != Overlap::interleaved || !shard || !shard->syncs()) return;
  overlap->lag.recheck_after = again ? ~std::uint64_t{0} : iterations + kLagSettleIterations;
  if (again) complete_prefetched_pass();
  auto& st = timeline->stats();
  const auto open = st.open_window();
  const std::size_t B = plan.buckets.size();
  // On the trainer's own clock: stage 2's backpressure held backward up while the chain ran.
  auto ready = readiness->ready_times();
  for (auto& t : ready)
    if (t >= 0) t = st.unblocked(t);
  // Stage 2's pooled buckets: a sync further behind than the buckets in flight would hold the
  // reductions' buffers and the staging window back (measured at link/compute 1: 0.50 with the
  // backlog's lag 16 against 0.61 at lag 1).
  const std::size_t max_lag = bufs->pooled() ? std::max<std::size_t>(1, caps.grads_in_flight) : 64;
  std::uint32_t chosen = std::uint32_t(shardflow::choose_interleave_lag(ready, B ? open.reduce_ms / double(B) : 0,
                                                                        B ? open.sync_ms / double(B) : 0, open.step_chain_ms, max_lag));
  if (log->should_log(spdlog::level::debug)) {
    std::string chain, grads;
    for (const auto c : open.step_chain_ms) chain += " " + std::to_string(c);
    for (const auto t : ready) grads += " " + std::to_string(t);
    log->debug("interleave lag from: reduce {:.3f} ms, sync {:.3f} ms a bucket; step chains (ms){}; gradients (us){}", B ? open.reduce_ms / double(B) : 0,
               B ? open.sync_ms / double(B) : 0, chain, grads);
  }
  control_collective(CollectiveKind::broadcast, &chosen, 1, "interleave lag");  // rank 0's choice: every rank issues the same order
  log->info("interleaved overlap: each bucket's parameter sync goes after the reduction of the bucket {} later{}{}", chosen,
            chosen ? " (the step and its hops take longer than the gradients leave between reductions)" : "",
            again ? (chosen == overlap->lag.lag ? " (kept on steady times)" : " (chosen again on steady times)") : "");
  if (chosen == overlap->lag.lag) return;
  overlap->lag.lag = chosen;
  stop_actors();
  spawn_actors(iterations + 1);  // inside wait(): the actors start the next iteration
}

}  // namespace shardflow
