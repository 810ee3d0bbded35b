// How far a bucket's sync trails its reduction in interleaved overlap when the runtime chooses
// (Note [Choosing the interleave lag]): lag 0 while the step chain fits between two buckets'
// gradients, else the least lag that keeps both the reductions and the link from waiting on it.
#include <doctest/doctest.h>

#include "runtime/plans/interleave_lag.hpp"

using namespace shardflow;

namespace {

// `buckets` buckets whose gradients come `interval_ms` apart.
std::vector<std::int64_t> gradients_every(double interval_ms, int buckets) {
  std::vector<std::int64_t> t;
  for (int b = 0; b < buckets; ++b) t.push_back(std::int64_t(1000000 + b * interval_ms * 1e3));
  return t;
}

}  // namespace

TEST_CASE("compute-bound backward: the reduction and the step chain fit between two buckets' gradients, lag 0") {
  // 3 ms of backward per bucket, 1 ms to reduce, 0.05 ms from the reduction to the sync's issue.
  CHECK(choose_interleave_lag(gradients_every(3.0, 8), 1.0, 0.5, std::vector<double>(8, 0.05)) == 0);
  // Just fits: reduction 0.9 + chain 0.05 + sync 0.05 = 1.0 ms.
  CHECK(choose_interleave_lag(gradients_every(1.0, 8), 0.9, 0.05, std::vector<double>(8, 0.05)) == 0);
  // Just does not: the next reduction would queue behind the sync, so one reduction goes first.
  CHECK(choose_interleave_lag(gradients_every(1.0, 8), 0.9, 0.05, std::vector<double>(8, 0.06)) == 1);
}

TEST_CASE("gradients faster than the chain: the lag covers the chain in gradient intervals") {
  // 10 us between buckets, 1 us reduction and sync, a 50 us chain: the reduction of b + lag + 1
  // must not come before b's sync is done, so (1 + 50 + 1) / 10 - 1 = 4.2 -> 5.
  CHECK(choose_interleave_lag(gradients_every(0.010, 100), 0.001, 0.001, std::vector<double>(100, 0.050)) == 5);
  // All at once (bench_overhead): the link is then the bottleneck with 100 x 2 us queued, more than
  // 64 trailing syncs of 1 us need (25 would cover the 50 us chain).
  CHECK(choose_interleave_lag(gradients_every(0.0, 100), 0.001, 0.001, std::vector<double>(100, 0.050)) == 64);
  CHECK(choose_interleave_lag(gradients_every(0.0, 100), 0.001, 0.001, std::vector<double>(100, 0.050), 8) == 8);  // the cap
}

TEST_CASE("link-bound: one reduction ahead keeps the link busy while a bucket steps") {
  // bench_overlap's stage 1 at link/compute 1: gradients every 0.5 ms, a 0.53 ms reduction and a
  // 0.26 ms sync, a 0.05 ms chain. Lag 0 idles the link 0.05 ms after every reduction; when the
  // last gradient comes the link has 16 x 0.79 - 15 x 0.5 - 0.53 = 4.61 ms queued, room for 17
  // syncs: every sync after the reductions costs nothing more.
  CHECK(choose_interleave_lag(gradients_every(0.5, 16), 0.53, 0.26, std::vector<double>(16, 0.05)) == 16);
  // Barely link-bound (backlog 8 x 0.51 - 7 x 0.5 - 0.3 = 0.28 ms, one 0.21 ms sync): 1.
  CHECK(choose_interleave_lag(gradients_every(0.5, 8), 0.3, 0.21, std::vector<double>(8, 0.05)) == 1);
  // A chain longer than a reduction and a sync (a large step on a fast link): gradients every
  // 0.5 ms, 0.4 + 0.2 ms on the link (backlog 4 x 0.6 - 3 x 0.5 - 0.4 = 0.5 ms: 1 sync), 1 ms
  // of chain: 1 / 0.6 -> 2.
  CHECK(choose_interleave_lag(gradients_every(0.5, 4), 0.4, 0.2, std::vector<double>(4, 1.0)) == 2);
  // The same chain with backward slow enough for it: lag 0.
  CHECK(choose_interleave_lag(gradients_every(5.0, 16), 1.0, 0.5, std::vector<double>(16, 2.0)) == 0);
  // Link-bound although the chain fits between gradients: the link would idle 0.05 ms per bucket
  // (backlog 4 x 0.6 - 3 x 0.5 - 0.3 = 0.6 ms, room for one 0.3 ms sync after the last reduction).
  CHECK(choose_interleave_lag(gradients_every(0.5, 4), 0.3, 0.3, std::vector<double>(4, 0.05)) == 1);
}

TEST_CASE("the median chain decides: one slow bucket (a preempted step) does not raise the lag") {
  std::vector<double> chain(16, 0.05);
  chain[3] = 4.0;
  CHECK(choose_interleave_lag(gradients_every(3.0, 16), 1.0, 0.5, chain) == 0);
}

TEST_CASE("too little measured to choose: lag 0, as configured before there was a choice") {
  CHECK(choose_interleave_lag({}, 1.0, 0.5, {}) == 0);
  CHECK(choose_interleave_lag({1000}, 1.0, 0.5, {0.05}) == 0);                       // one bucket
  CHECK(choose_interleave_lag(gradients_every(0.0, 4), 1.0, 0.5, {-1, -1, -1, -1}) == 0);  // no sync measured
  CHECK(choose_interleave_lag({-1, 1000, -1}, 1.0, 0.5, {0.05, 0.05, 0.05}) == 0);   // one known gradient
}
