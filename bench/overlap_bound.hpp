// The best iteration any runtime could reach on bench_overlap's model, as a yardstick for the
// measured one: the same layers, compute times and link costs, but every hop, step and wake-up
// free (zero time), and the best choice of how many parameter syncs go in backward (K). What is
// left is what the dependencies themselves cost:
//   - a bucket's reduction cannot start before backward produced its gradient;
//   - its sync cannot start before its reduction ended (the step in between is free here);
//   - forward's layer l cannot start before its sync ended;
//   - one collective at a time on the link, in schedule order: bucket b's reduction, then (b < K)
//     its sync, for b in backward order; then the other syncs in the order forward needs them
//     (the runtime's interleaved + prefetch schedule, Note [Forward prefetch]).
// So the link idles at least while the last layer's forward and the first layer's backward run
// (nothing is left to sync, nothing is reduced yet), and wherever the syncs that may go in
// backward cannot fill backward's spare link time. An efficiency above this bound is impossible
// for these proportions with whole-bucket collectives.
#pragma once

#include <algorithm>
#include <cstddef>
#include <vector>

namespace shardflow::bench {

struct BoundModel {
  std::size_t layers = 16;
  double forward_ms = 0.25, backward_ms = 0.5;  // per layer
  double reduce_ms = 0.5, sync_ms = 0.25;       // per bucket (one layer per bucket)
};

// Steady-state iteration (ms) of the schedule with K syncs in backward.
inline double ideal_iteration_ms(const BoundModel& m, std::size_t K) {
  const std::size_t L = m.layers;
  // Bucket b holds layer L-1-b (buckets in backward order).
  std::vector<double> avail(L, 0.0), grad(L), reduced(L), synced(L);
  double t = 0, link = 0, start = 0, last_start = 0;
  const int iterations = 40, counted = 10;
  double sum = 0;
  for (int it = 0; it < iterations; ++it) {
    last_start = start;
    start = t;
    if (it >= iterations - counted) sum += start - last_start;
    for (std::size_t l = 0; l < L; ++l) t = std::max(t, avail[l]) + m.forward_ms;
    for (std::size_t b = 0; b < L; ++b) grad[b] = t += m.backward_ms;
    for (std::size_t b = 0; b < L; ++b) {
      link = reduced[b] = std::max(link, grad[b]) + m.reduce_ms;
      if (b < K) link = synced[b] = link + m.sync_ms;
    }
    for (std::size_t l = 0; l + K < L; ++l) {  // the late syncs, in forward order (layer l = bucket L-1-l)
      const std::size_t b = L - 1 - l;
      link = synced[b] = std::max(link, reduced[b]) + m.sync_ms;
    }
    for (std::size_t b = 0; b < L; ++b) avail[L - 1 - b] = synced[b];
  }
  return sum / counted;
}

struct Bound {
  double iteration_ms;
  std::size_t syncs_in_backward;
};

inline Bound best_iteration(const BoundModel& m) {
  Bound best{ideal_iteration_ms(m, 0), 0};
  for (std::size_t k = 1; k <= m.layers; ++k)
    if (const double t = ideal_iteration_ms(m, k); t < best.iteration_ms) best = {t, k};
  return best;
}

}  // namespace shardflow::bench
