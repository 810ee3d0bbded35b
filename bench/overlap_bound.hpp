// The best iteration any runtime could reach on bench_overlap's model, as a yardstick for the
// measured one: the same layers, compute times and link costs, but every hop, step and wake-up
// free (zero time), and the best choice of how many parameter syncs go in backward (K). It is the
// model the runtime itself replays to choose K (runtime/plans/prefetch_model.hpp, Note [Choosing
// the syncs in backward]), here with each sync right after its own reduction (lag 0: with a free
// step nothing is gained by waiting). What is left is what the dependencies themselves cost:
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

#include <cstddef>
#include <cstdint>

#include "runtime/plans/prefetch_model.hpp"

namespace shardflow::bench {

struct BoundModel {
  std::size_t layers = 16;
  double forward_ms = 0.25, backward_ms = 0.5;  // per layer
  double reduce_ms = 0.5, sync_ms = 0.25;       // per bucket (one layer per bucket)
};

// Bucket b holds layer L-1-b: forward needs the buckets back to front, backward fills them in order.
inline PrefetchTimes bound_times(const BoundModel& m) {
  PrefetchTimes t;
  t.lag = 0;
  for (std::size_t l = 0; l < m.layers; ++l) {
    t.forward_order.push_back(std::uint32_t(m.layers - 1 - l));
    t.forward_ms.push_back(m.forward_ms);
    t.gradient_ms.push_back(double(l + 1) * m.backward_ms);
    t.reduce_ms.push_back(m.reduce_ms);
    t.sync_ms.push_back(m.sync_ms);
  }
  return t;
}

}  // namespace shardflow::bench
