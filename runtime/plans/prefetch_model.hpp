// How many parameter syncs go out during backward with forward prefetch (Note [Forward prefetch]):
// chosen by playing the runtime's own collective schedule over one iteration's measured times.
//
// Note [Choosing the syncs in backward]
// A sync sent in backward uses link time backward leaves idle between reductions, but it also
// leaves the link idle at the end of the next forward: the layers forward needs last have nothing
// left to wait for, while the syncs forward needs first still queue behind it. Counting only
// backward's spare link time (the first rule) sent 1-2 syncs in backward at link/compute 1 where
// none was best (bench_overlap stage 1: 0.87 against 0.90 with none). So the runtime replays its
// schedule (collective_order, the same function the comm stream issues from) on the times it
// measured in the iteration that observed forward's order: each forward segment, each bucket's
// gradient, each collective's link time. One collective at a time on the link; a reduction waits
// for its gradient, a sync for its reduction (the step is taken as free), forward's segment for
// its bucket's sync. The steady-state iteration of each K decides; among ties the larger K
// (fewer syncs left for forward to wait on when hops cost what the model leaves out).
// bench/overlap_bound.hpp plays the same model with free hops as the benchmark's yardstick.
//
// Note [Backpressure in the replay]
// Stage 2 holds a few gradient buffers at once (BucketCaps::grads_in_flight); backward waits for a
// free one. The measured gradient times leave those waits out (the trainer's own clock), so the
// replay puts them back for each K: bucket b's backward starts no earlier than the reduction of
// b - grads_in_flight ends, and where it waits, it waits for as many as the refill frees (Note
// [Backpressure in refills]). A sync sent in backward delays the reductions behind it and so, at
// stage 2, backward itself; without this the replay saw only the link's idle time between
// reductions and sent 9 of 17 syncs into backward where none was best.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "runtime/plans/iteration_bound.hpp"

namespace shardflow {

// The times of the iteration's bound (runtime/plans/iteration_bound.hpp), played in the runtime's
// own schedule; the replay takes the steps as free (step_ms is not read).
struct PrefetchTimes : IterationTimes {
  std::size_t lag = 1;  // an early sync goes out after the reduction of bucket b + lag
  // Stage 2's gradient buffers in flight (0: no limit): backward writes bucket b only once the
  // reduction of bucket b - grads_in_flight has freed its buffer (Note [Backpressure in the replay]).
  std::size_t grads_in_flight = 0;
};

// `order` (buckets forward asked for, first ask first) with the buckets it never asked for after
// them, back to front (forward's usual direction): every bucket once.
std::vector<std::uint32_t> complete_forward_order(std::vector<std::uint32_t> order, std::size_t buckets);

// The syncs' order with `early` of them in backward: those forward needs last, in bucket order,
// then the others in forward order.
std::vector<std::uint32_t> prefetch_sync_order(const std::vector<std::uint32_t>& forward_order, std::size_t early);

// Steady-state iteration (ms) of the schedule with `early` syncs in backward.
double steady_iteration_ms(const PrefetchTimes& t, std::size_t early);

struct PrefetchChoice {
  std::size_t early = 0;
  double iteration_ms = 0;
};
PrefetchChoice best_early_syncs(const PrefetchTimes& t);

// One observed iteration as the model's times. `asked_us[i]`: when forward first needed
// forward_order[i] (the trainer's wait_param); `gradient_us[b]`: when bucket b's last gradient came
// in; the link times are split between buckets by `link_weight` (their bytes). What lies between
// forward's last request and the first gradient (the last segment's forward, the loss, the first
// bucket's backward) is split between forward and backward in the proportion of the other
// segments. Buckets forward never asked for join the order back to front with no forward time.
PrefetchTimes observed_prefetch_times(std::vector<std::uint32_t> forward_order, const std::vector<std::int64_t>& asked_us,
                                      const std::vector<std::int64_t>& gradient_us, const std::vector<double>& link_weight,
                                      double reduce_ms, double sync_ms, std::size_t lag);

}  // namespace shardflow
