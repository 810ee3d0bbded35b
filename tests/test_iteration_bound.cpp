// The shortest iteration any schedule of a plan could reach (Note [The iteration's bound]):
// worked by hand on two buckets, never above what the runtime's own schedules reach in the replay
// of runtime/plans/prefetch_model (whatever the number of syncs in backward), and clear about
// times that do not fit.
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <future>
#include <random>
#include <stdexcept>

#include "runtime/plans/iteration_bound.hpp"
#include "runtime/plans/prefetch_model.hpp"

using namespace shardflow;

namespace {

// Layers back to front: bucket b holds layer L-1-b, so forward asks for L-1 first and backward
// fills bucket 0 first.
IterationTimes layers(std::size_t L, double forward_ms, double backward_ms, double reduce_ms, double sync_ms, double step_ms = 0) {
  IterationTimes t;
  for (std::size_t l = 0; l < L; ++l) {
    t.forward_order.push_back(std::uint32_t(L - 1 - l));
    t.forward_ms.push_back(forward_ms);
    t.gradient_ms.push_back(double(l + 1) * backward_ms);
    t.reduce_ms.push_back(reduce_ms);
    t.sync_ms.push_back(sync_ms);
    t.step_ms.push_back(step_ms);
  }
  return t;
}

// iteration_bound(t), or the test process ends with a failure if it has not returned in 10 s: a
// spinning bound must fail here, not hang the suite until ctest's timeout.
IterationBound bound_or_fail(const IterationTimes& t) {
  auto run = std::async(std::launch::async, [t] { return iteration_bound(t); });
  if (run.wait_for(std::chrono::seconds(10)) != std::future_status::ready) {
    FAIL_CHECK("iteration_bound did not return within 10 s: it spins");
    std::fflush(nullptr);
    std::_Exit(1);  // the spinning thread cannot be joined
  }
  return run.get();
}

// B buckets of times from 0 to 3 ms, forward needing them last bucket first. `held`: each sync
// takes seconds instead with chance 1 in `held` (one that spanned a trainer held between steps;
// 0: none); `steps`: each bucket's step up to 0.3 ms (else free).
IterationTimes random_times(std::mt19937& rng, std::size_t B, unsigned held, bool steps) {
  std::uniform_real_distribution<double> ms(0.0, 3.0);
  IterationTimes t;
  double g = 0;
  for (std::size_t b = 0; b < B; ++b) {
    t.forward_order.push_back(std::uint32_t(B - 1 - b));
    t.forward_ms.push_back(ms(rng));
    t.gradient_ms.push_back(g += ms(rng));
    t.reduce_ms.push_back(ms(rng));
    t.sync_ms.push_back(held && rng() % held == 0 ? 1e4 * ms(rng) : ms(rng));
    t.step_ms.push_back(steps ? ms(rng) / 10 : 0.0);
  }
  return t;
}

PrefetchTimes as_replay(const IterationTimes& t) {
  PrefetchTimes p;
  static_cast<IterationTimes&>(p) = t;
  p.lag = 1;
  return p;
}

}  // namespace

TEST_CASE("no link work: the bound is backward then forward") {
  const auto b = iteration_bound(layers(4, 1.0, 2.0, 0, 0));
  CHECK(b.compute_ms == doctest::Approx(12.0));
  CHECK(b.link_ms == 0);
  CHECK(b.iteration_ms == doctest::Approx(12.0));
  CHECK(b.binding == "compute");
}

TEST_CASE("two buckets, worked by hand: the first layers' chain of reduction, sync and forward sets 6 ms where compute needs 4") {
  // Gradients at 1 and 2 ms; each collective 1 ms; forward 1 ms per bucket. The best schedule:
  // R0 [1,2], R1 [2,3], S1 [3,4], forward of bucket 1 [4,5], S0 [4,5], forward of bucket 0 [5,6].
  const auto b = iteration_bound(layers(2, 1.0, 1.0, 1.0, 1.0));
  CHECK(b.compute_ms == doctest::Approx(4.0));
  CHECK(b.link_ms == doctest::Approx(4.0));
  CHECK(b.iteration_ms == doctest::Approx(6.0));
  CHECK(b.binding == "the link and the dependencies");
  // A step between reduction and sync lengthens that chain by its time.
  CHECK(iteration_bound(layers(2, 1.0, 1.0, 1.0, 1.0, 0.5)).iteration_ms == doctest::Approx(6.5));
}

TEST_CASE("DDP (no syncs): the last reduction and the step after it bound the iteration") {
  // Gradients at 1, 2, 3 ms, reductions 2 ms each from 1 ms on: the link ends at 7 ms at the
  // earliest, and forward (3 ms) follows the step of the bucket it needs first.
  const auto b = iteration_bound(layers(3, 1.0, 1.0, 2.0, 0.0));
  CHECK(b.iteration_ms >= 7.0 + 1.0);
  CHECK(b.iteration_ms >= b.compute_ms);
}

TEST_CASE("random plans: the bound never lies above the runtime's own schedules, whatever the syncs in backward, nor below compute or the link's work") {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 300; ++trial) {
    CAPTURE(trial);
    const std::size_t B = 1 + rng() % 12;
    IterationTimes t = random_times(rng, B, 0, false);
    std::shuffle(t.forward_order.begin(), t.forward_order.end(), rng);  // forward's order need not mirror backward's
    const auto bound = iteration_bound(t);
    CHECK(bound.iteration_ms >= bound.compute_ms - 1e-9);
    CHECK(bound.chain_ms >= bound.link_ms - 1e-9);
    const auto replay = as_replay(t);
    for (std::size_t k = 0; k <= B; ++k) {
      CAPTURE(k);
      CHECK(bound.iteration_ms <= steady_iteration_ms(replay, k) + 1e-6);
    }
  }
}

// Note [Progress in floating point] (iteration_bound.cpp)
TEST_CASE("a sync that spanned a trainer held between steps (58.5 s among milliseconds): the bound still comes back, and scales "
          "with the times") {
  IterationTimes t;
  t.gradient_ms = {15.799, 17.785, 32.036, 35.155, 37.423};
  t.reduce_ms = {0.487, 0.68, 1.085, 4.827, 2.181};
  t.sync_ms = {3.133, 1.505, 2.536, 1.929, 58507.411};
  t.step_ms.assign(5, 0.0);
  t.forward_order = {4, 3, 2, 1, 0};
  t.forward_ms = {1.094739524838013, 2.422882937365011, 0.544609071274298, 0.34132181425485963, 0.24444665226781853};
  const auto b = bound_or_fail(t);  // spun for good before the fix
  CHECK(b.chain_ms >= b.link_ms);
  CHECK(b.iteration_ms < b.compute_ms + b.link_ms + 1e-6);
  // Every time k-fold, the bound k-fold, at scales from microseconds to hours.
  std::mt19937 rng(11);
  for (int trial = 0; trial < 200; ++trial) {
    const IterationTimes u = random_times(rng, 2 + rng() % 10, 4, true);  // a sync in four held for seconds
    const double one = bound_or_fail(u).iteration_ms;
    for (const double k : {1e-3, 1e3, 1e6}) {
      CAPTURE(trial);
      CAPTURE(k);
      auto scaled = u;
      for (auto* v : {&scaled.forward_ms, &scaled.gradient_ms, &scaled.reduce_ms, &scaled.sync_ms, &scaled.step_ms})
        for (auto& x : *v) x *= k;
      CHECK(bound_or_fail(scaled).iteration_ms == doctest::Approx(one * k).epsilon(1e-9));
    }
  }
}

TEST_CASE("efficiency against the bound: 1 at the bound, 0 with nothing overlapped") {
  const auto b = iteration_bound(layers(2, 1.0, 1.0, 1.0, 1.0));
  CHECK(efficiency_against_bound(b.iteration_ms, b) == doctest::Approx(1.0));
  CHECK(efficiency_against_bound(b.compute_ms + b.link_ms, b) == doctest::Approx(0.0));
  CHECK(efficiency_against_bound(7.0, b) == doctest::Approx(0.5));
}

TEST_CASE("times that do not fit are refused, naming the field and the bucket") {
  auto t = layers(3, 1.0, 1.0, 1.0, 1.0);
  t.sync_ms.pop_back();
  CHECK_THROWS_WITH_AS(iteration_bound(t), doctest::Contains("sync_ms has 2 entries, gradient_ms 3"), std::invalid_argument);
  t = layers(3, 1.0, 1.0, 1.0, 1.0);
  t.step_ms[1] = -1;
  CHECK_THROWS_WITH_AS(iteration_bound(t), doctest::Contains("step_ms[1] = -1"), std::invalid_argument);
  t = layers(3, 1.0, 1.0, 1.0, 1.0);
  t.forward_order[2] = 2;  // bucket 2 twice, bucket 0 never
  CHECK_THROWS_WITH_AS(iteration_bound(t), doctest::Contains("forward_order must name every bucket once (bucket 2)"), std::invalid_argument);
}
