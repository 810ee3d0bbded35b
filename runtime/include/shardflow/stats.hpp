// What a Runtime reports about itself: memory by purpose, and what each synchronised iteration cost
// and hid (Runtime::memory_report(), stats(), last_stats(); Note [Timeline]).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace shardflow {

// Bytes this rank holds, by purpose.
struct MemoryReport {
  std::size_t params = 0;           // the trainer's parameter storage
  std::size_t grads = 0;            // bucket buffers (+ reduced gradient shards in stage 2)
  std::size_t optimizer_state = 0;  // momentum / exp_avg / exp_avg_sq of the parameters this rank owns
  std::size_t comm_buffers = 0;     // buffers only communication needs (norm exchange)
  std::string str() const;
};

// What one synchronised iteration cost and how much of the communication hid behind compute
// (Runtime::stats()). An iteration runs from the end of one wait() to the end of the next.
struct IterationStats {
  std::uint64_t iteration = 0;
  double iteration_ms = 0;
  double compute_ms = 0;    // the trainer's own time: the iteration minus exposed_ms
  double link_ms = 0;       // time the rank's comm stream was busy with the runtime's collectives
  double hidden_ms = 0;     // link time while the trainer computed
  double exposed_ms = 0;    // time the trainer was held up by the runtime: wait(), wait_param(),
                            // backpressure in grad(): from the last grad_ready (or the end of
                            // forward, with prefetch) until it may go on
  double optimizer_ms = 0;  // the shard's steps (host time; on a GPU: enqueueing)
  std::size_t buckets = 0;
  std::size_t buckets_done_in_backward = 0;  // reduced, stepped and synced before backward ended
  std::array<std::uint64_t, 5> bytes{};      // bytes moved per CollectiveKind (allreduce, ...): the buffers
  // What this rank put on the link (wire_bytes in communicator.hpp: an all-reduce's buffer counts
  // 2 (N - 1) / N, a reduce-scatter's, all-gather's or broadcast's (N - 1) / N). ZeRO-1 and -2 with
  // the flat partition move what DDP moves.
  std::uint64_t wire_bytes = 0;
  // The shortest iteration any schedule could reach with this iteration's own times (Note [The
  // iteration's bound]): backward and each bucket's collectives as measured, forward split between
  // the buckets by their size, steps taken as free. iteration_ms / bound_ms is how far this run
  // is from the best order of its plan; 0 where it was not measured (no gradient, an accumulation,
  // a window of two passes' syncs: Note [A window of another schedule]). In the median: over the
  // iterations that have one.
  double bound_ms = 0;
  // iteration_ms / bound_ms (0 without a bound). In the median: the median of the iterations'
  // own ratios, the figure to hold against 1; the two medians above may come from different
  // iterations (a run whose iterations alternate between two lengths).
  double over_bound = 0;
};
struct RuntimeStats {
  std::vector<IterationStats> steps;  // the most recent iterations (up to 10,000)
  IterationStats median;              // each field's median over the steps after the first five
  // {"median": {"iteration_ms": ..., "exposed_ms": ..., ...}, "steps": [...]}
  std::string to_json() const;
};

// Where rank `rank` writes the trace of Config::trace.path: "{rank}" replaced; without it, when
// each rank is a process of its own (under a launcher), <stem>.rank<r>.json beside the path; else
// the path itself (ranks that are threads share it).
std::string trace_file_for(const std::string& trace_path, int rank, bool one_process_per_rank);

}  // namespace shardflow
