// How many parameter syncs forward prefetch sends during backward (Note [Choosing the syncs in
// backward]): the runtime replays its own schedule on one iteration's measured times. Scenarios on
// 4 layers, reduction 1 ms and sync 0.5 ms per bucket, worked by hand.
#include <doctest/doctest.h>

#include "runtime/plans/prefetch_model.hpp"
#include "runtime/plans/run_plan.hpp"

using namespace shardflow;

namespace {

// n layers; bucket b holds layer n-1-b (forward asks n-1, ..., 0).
PrefetchTimes layers(std::uint32_t n, double forward_ms, double backward_ms) {
  PrefetchTimes t;
  t.lag = 1;
  for (std::uint32_t l = 0; l < n; ++l) {
    t.forward_order.push_back(n - 1 - l);
    t.forward_ms.push_back(forward_ms);
    t.gradient_ms.push_back(double(l + 1) * backward_ms);
    t.reduce_ms.push_back(1.0);
    t.sync_ms.push_back(0.5);
  }
  return t;
}

PrefetchTimes four_layers(double forward_ms, double backward_ms) { return layers(4, forward_ms, backward_ms); }

}  // namespace

TEST_CASE("the sync order: the K buckets forward needs last go in bucket order, the rest follow in forward order") {
  CHECK(prefetch_sync_order({3, 2, 1, 0}, 2) == std::vector<std::uint32_t>{0, 1, 3, 2});
  CHECK(prefetch_sync_order({3, 2, 1, 0}, 0) == std::vector<std::uint32_t>{3, 2, 1, 0});
  CHECK(prefetch_sync_order({3, 2, 1, 0}, 4) == std::vector<std::uint32_t>{0, 1, 2, 3});
  CHECK(prefetch_sync_order({2, 3, 1, 0}, 1) == std::vector<std::uint32_t>{0, 2, 3, 1});
}

TEST_CASE("compute-bound backward: two syncs in backward — a third would queue before the sync forward needs first") {
  // Backward 3 ms per layer (the link idles 2 ms of every 3), forward 0.3 ms. With K = 2:
  // R0 R1 S0 R2 S1 | R3 S3 S2 after backward (12 ms): forward's layer 0 waits for R3 + S3 (13.5),
  // layer 1 for S2 (14.0), then 14.3, 14.6, 14.9. With K = 3, S2 goes before S3: layer 0 at 14.0,
  // done at 15.2. With none in backward every layer waits for its own sync: 15.3.
  const auto t = four_layers(0.3, 3.0);
  CHECK(steady_iteration_ms(t, 2) == doctest::Approx(14.9));
  CHECK(steady_iteration_ms(t, 3) == doctest::Approx(15.2));
  CHECK(steady_iteration_ms(t, 0) == doctest::Approx(15.3));
  const auto best = best_early_syncs(t);
  CHECK(best.early == 2);
  CHECK(best.iteration_ms == doctest::Approx(14.9));
}

TEST_CASE("link-bound backward (reductions take all of it): no sync in backward, each one there costs forward's tail") {
  // Backward 1 ms per layer = one reduction: the link is never idle in backward, and every sync
  // sent there delays the reductions behind it and the sync forward needs first.
  const auto t = four_layers(0.3, 1.0);
  const auto best = best_early_syncs(t);
  CHECK(best.early == 0);
  for (std::size_t k = 1; k <= 4; ++k) {
    INFO("K = " << k);
    CHECK(steady_iteration_ms(t, k) > best.iteration_ms + 0.2);
  }
}

TEST_CASE("equally good splits: the runtime takes the most syncs in backward (hops the model leaves out cost forward more)") {
  const auto t = four_layers(0.6, 1.6);
  CHECK(steady_iteration_ms(t, 0) == doctest::Approx(steady_iteration_ms(t, 2)));
  CHECK(best_early_syncs(t).early == 2);
}

TEST_CASE("observed times: forward's segments from its requests, backward's from the gradients, the gap split in proportion") {
  // Forward asks for buckets 3, 2, 1, 0 at 0, 250, 500, 750 us; the gradients of buckets 0..3 come
  // in at 1500, 2000, 2500, 3000 us. Forward segments are 250 us, backward's steps 500 us, so the
  // 750 us from the last request to the first gradient are 250 of forward and 500 of backward.
  const auto t = observed_prefetch_times({3, 2, 1, 0}, {0, 250, 500, 750}, {1500, 2000, 2500, 3000}, {1, 1, 2, 0}, 4.0, 2.0, 1);
  CHECK(t.forward_order == std::vector<std::uint32_t>{3, 2, 1, 0});
  for (double f : t.forward_ms) CHECK(f == doctest::Approx(0.25));
  const double gradient[] = {0.5, 1.0, 1.5, 2.0}, reduce[] = {1.0, 1.0, 2.0, 0.0}, sync[] = {0.5, 0.5, 1.0, 0.0};  // links split by bytes
  for (std::size_t b = 0; b < 4; ++b) {
    INFO("bucket " << b);
    CHECK(t.gradient_ms[b] == doctest::Approx(gradient[b]));
    CHECK(t.reduce_ms[b] == doctest::Approx(reduce[b]));
    CHECK(t.sync_ms[b] == doctest::Approx(sync[b]));
  }
  CHECK(t.lag == 1);
}

TEST_CASE("observed times: buckets forward never asked for join back to front with no forward time") {
  const auto t = observed_prefetch_times({3, 1}, {0, 400}, {1000, 1100, 1200, 1300}, {1, 1, 1, 1}, 4.0, 2.0, 1);
  CHECK(t.forward_order == std::vector<std::uint32_t>{3, 1, 2, 0});
  CHECK(t.forward_ms[0] == doctest::Approx(0.4));
  CHECK(t.forward_ms[2] == 0.0);
  CHECK(t.forward_ms[3] == 0.0);
  CHECK(best_early_syncs(t).early <= 4);
}

TEST_CASE("stage 2's buffers in flight: a sync in backward holds a reduction and, through it, backward itself") {
  // 8 layers, backward 1.2 ms per layer against a 1 ms reduction, two gradient buffers in flight.
  // Without the limit, two syncs in backward are as good as none (15.9 ms) and the runtime would
  // take them. With it, bucket b's backward waits for the reduction of b - 2, and each sync sent
  // in backward pushes the reductions behind it, hence the backward behind those, forward's start
  // and every sync after it: two syncs in backward then cost 0.4 ms, and none is chosen.
  auto t = layers(8, 0.6, 1.2);
  CHECK(best_early_syncs(t).early == 2);
  CHECK(steady_iteration_ms(t, 2) == doctest::Approx(15.9));
  t.grads_in_flight = 2;
  CHECK(steady_iteration_ms(t, 2) == doctest::Approx(16.3));
  const auto best = best_early_syncs(t);
  CHECK(best.early == 0);
  CHECK(best.iteration_ms == doctest::Approx(15.9));
  // With no sync in backward the buffers wait for nothing the link did not: same iteration.
  CHECK(steady_iteration_ms(t, 0) == doctest::Approx(steady_iteration_ms(layers(8, 0.6, 1.2), 0)));
}

TEST_CASE("stage 2's buffers in flight, refilled: a trainer that had to wait goes on when a quarter of them are free, and "
          "writes that many buckets without waiting again") {
  // 10 buckets, 8 gradient buffers (a refill of 2: Note [Backpressure in refills]). Buckets 0-7
  // are written at 0.1 ms steps, faster than the 1 ms reductions; bucket 8 finds every buffer held
  // at 0.8 ms and waits for two reductions (R0 at 1.1, R1 at 2.1), not one: the trainer's clock
  // is 1.3 ms late from there. Bucket 9 then takes the second freed buffer without a wait, and
  // its gradient, 19 ms of backward later (at 20.0 on backward's own clock), comes at 21.3; its
  // reduction ends the iteration at 22.3 (no syncs' time, no forward). Woken at each release, it
  // would have waited twice, 0.3 ms for R0 at bucket 8 and 0.9 for R1 at bucket 9: 1.2 ms late
  // (22.2).
  PrefetchTimes t;
  for (std::uint32_t b = 0; b < 10; ++b) {
    t.forward_order.push_back(9 - b);
    t.forward_ms.push_back(0.0);
    t.gradient_ms.push_back(b == 9 ? 20.0 : 0.1 * double(b + 1));
    t.reduce_ms.push_back(1.0);
    t.sync_ms.push_back(0.0);
  }
  t.grads_in_flight = 8;
  CHECK(steady_iteration_ms(t, 0) == doctest::Approx(22.3));
  // Two buffers refill one at a time (the default's few large buckets): bucket 2 waits for R0
  // (1.1) alone, bucket 3 for R1 (2.1), ..., bucket 9 for R7 (8.1), its gradient 20.0 - 0.9 later.
  t.grads_in_flight = 2;
  CHECK(backpressure_refill(2) == 1);
  CHECK(steady_iteration_ms(t, 0) == doctest::Approx(8.1 + 19.1 + 1.0));
}
