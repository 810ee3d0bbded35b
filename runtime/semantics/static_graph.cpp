// Note [Static graph]
// PyTorch's static_graph promises that every iteration runs the same graph. shardflow uses the
// promise for two things. (1) Re-entrant backward (activation checkpointing) reports a gradient
// several times, each report adding to it; the first synchronised iteration holds every reduction
// until backward ends and counts the reports, and from then on a gradient's bucket gets it after
// that many reports (one more is an error naming the parameter). (2) The parameters no rank uses
// are found once, with find_unused_parameters' exchange in the first iteration (Note [Unused
// parameters]), and fixed: later iterations have no exchange (so ZeRO's syncs interleave again),
// the shard skips the fixed set, and each rank hands its never-reported parameters to their
// buckets as zeros as soon as a pass starts. The first iteration's buckets are rebuilt once as
// usual (Config::buckets.rebuild), from the order in which gradients were completed.
#include <algorithm>

#include "runtime/rank/runtime_impl.hpp"
#include "runtime/semantics/semantics_state.hpp"

namespace shardflow {

std::uint32_t Runtime::Impl::reports_allowed(std::uint32_t p) const {
  if (!cfg.buckets.static_graph) return 1;
  return semantics->graph.learnt ? semantics->graph.expected_reports[p] : 255;  // learning: counted, not yet limited
}

void Runtime::Impl::count_report(std::uint32_t p, std::uint32_t reports) {
  if (learning_graph()) semantics->graph.last_report[p].store(semantics->graph.report_seq.fetch_add(1, std::memory_order_relaxed), std::memory_order_relaxed);
  if (reports <= reports_allowed(p)) return;
  if (!cfg.buckets.static_graph)
    throw UsageError("parameter '" + name_of(p) + "' was marked ready twice in iteration " + std::to_string(iterations) + " on rank " +
                     std::to_string(rank) +
                     ". Report each gradient once per backward pass; a parameter used several times in forward is reported after its "
                     "gradient is complete (re-entrant backward reports it several times: set Config::buckets.static_graph).");
  throw UsageError("parameter '" + name_of(p) + "' was reported " + std::to_string(reports) + " times in iteration " + std::to_string(iterations) +
                   " on rank " + std::to_string(rank) + ", but " + std::to_string(semantics->graph.expected_reports[p]) +
                   " times in the first one: with Config::buckets.static_graph every iteration must run the same graph");
}

void Runtime::Impl::send_learnt_zeros() {
  if (!semantics->graph.learnt) return;
  for (std::uint32_t p = 0; p < registry.size(); ++p)
    if (registry.params()[p].requires_grad && semantics->graph.expected_reports[p] == 0 && !touched[p]) {
      order[order_pos.fetch_add(1)] = p;
      send_to_bucket(p, true);
    }
}

void Runtime::Impl::finish_learning_pass() {
  std::vector<std::uint32_t> reported;
  for (std::uint32_t p = 0; p < registry.size(); ++p)
    if (marked[p].load(std::memory_order_acquire)) reported.push_back(p);
  // The order gradients were completed in (their last report) is the order the rebuild follows.
  std::sort(reported.begin(), reported.end(), [&](auto a, auto b) { return semantics->graph.last_report[a].load() < semantics->graph.last_report[b].load(); });
  semantics->graph.expected_reports.assign(registry.size(), 0);
  for (auto p : reported) {
    semantics->graph.expected_reports[p] = std::uint8_t(marked[p].load());
    order[order_pos.fetch_add(1)] = p;
    send_to_bucket(p, false);
  }
}

bool Runtime::Impl::learnt_as_unused(std::uint32_t p, std::uint32_t reports) {
  if (!semantics->graph.learnt) return false;
  if (semantics->graph.expected_reports[p] == 0) return true;
  if (reports > 0 && reports < semantics->graph.expected_reports[p])
    fail(UsageError("finish_backward: parameter '" + name_of(p) + "' was reported " + std::to_string(reports) + " of the " +
                    std::to_string(semantics->graph.expected_reports[p]) + " times the first iteration did (Config::buckets.static_graph) in iteration " +
                    std::to_string(iterations) + " on rank " + std::to_string(rank)));
  return false;
}

void Runtime::Impl::fix_unused_in(Shard& next) {
  if (semantics->graph.learnt) next.set_fixed_skip(used_counts());
}

void Runtime::Impl::learn_graph() {
  semantics->graph.learnt = true;
  semantics->graph.last_report.reset();
  std::size_t fixed = 0;
  for (std::uint32_t p = 0; p < registry.size(); ++p) fixed += registry.params()[p].requires_grad && used_counts()[p] == 0.0f;
  log->info("static graph learnt: {} parameter(s) unused on every rank, fixed from now on", fixed);
}

bool Runtime::Impl::learning_graph() const { return cfg.buckets.static_graph && !semantics->graph.learnt; }

}  // namespace shardflow
