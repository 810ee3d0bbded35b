// A trainer's own collectives (Runtime::collective): queued on the runtime's comm stream between
// two iterations' schedules, the same place on every rank whatever the timing, so a loss can be
// all-reduced every step without draining forward prefetch's syncs and without racing them.
#include <doctest/doctest.h>

#include <random>
#include <thread>

#include "support/helpers.hpp"

using namespace shardflow;
using namespace std::chrono_literals;

namespace {

bool starts_with(const std::string& s, const std::string& p) { return s.rfind(p, 0) == 0; }

}  // namespace

TEST_CASE("world 3, ZeRO-1 with forward prefetch, grads in random order: the loss all-reduce goes out after the "
          "iteration's last sync and before the next reduction, on every rank, and sums right") {
  const int n = 3, P = 6, numel = 256, iterations = 8;
  auto world = InProcessWorld::create(n, 30s);
  std::vector<std::vector<std::string>> logs(n);
  std::vector<std::vector<float>> losses(n);
  test::require_all_ok(test::run_ranks(n, [&](int r) {
    std::vector<float> params(std::size_t(P) * numel, 0.1f);
    const Config cfg = test::zero1_bucket_per_param(numel, /*forward_prefetch=*/true);
    Runtime rt(world->communicator(r), cfg);
    const auto h = test::register_flat(rt, params.data(), P, numel);
    OptimizerConfig adam;
    adam.kind = OptimizerConfig::Kind::adamw;
    rt.configure_optimizer(adam);
    std::mt19937 rng(unsigned(17 + r));
    float loss = 0;
    std::future<void> reduced;
    for (int it = 0; it < iterations; ++it) {
      rt.zero_grad();
      for (const auto& p : h) rt.wait_param(p);
      std::vector<Param> order(h.begin(), h.end());
      std::shuffle(order.begin(), order.end(), rng);
      for (const auto& p : order) {
        float* g = rt.grad_f32(p);
        for (int e = 0; e < numel; ++e) g[e] = 0.01f * float((e + int(p.index) + r) % 7);
        if (rng() % 3 == 0) std::this_thread::sleep_for(200us);
        rt.grad_ready(p);
      }
      rt.wait();
      if (reduced.valid()) {
        reduced.get();
        losses[std::size_t(r)].push_back(loss);
      }
      loss = float(r + it);  // sums to 3 it + 3
      reduced = rt.collective({CollectiveKind::allreduce, DType::f32, &loss, &loss, 1, 0, 1.0f, "loss"});
    }
    reduced.get();
    losses[std::size_t(r)].push_back(loss);
    rt.wait_all_params();
    logs[std::size_t(r)] = rt.collective_log();
  }));
  for (int r = 0; r < n; ++r) {
    CAPTURE(r);
    CHECK(logs[std::size_t(r)] == logs[0]);
    REQUIRE(losses[std::size_t(r)].size() == std::size_t(iterations));
    for (int it = 0; it < iterations; ++it) CHECK(losses[std::size_t(r)][std::size_t(it)] == float(3 * it + 3));
  }
  // Each loss all-reduce sits between an iteration's syncs and the next iteration's reductions
  // (the runtime's own between-iteration collectives, a rebuild's state migration or the forward
  // order's broadcast, may come between it and the last sync).
  const auto& log = logs[0];
  int placed = 0;
  for (std::size_t i = 0; i < log.size(); ++i) {
    if (!starts_with(log[i], "allreduce loss")) continue;
    CAPTURE(i);
    std::size_t prev = i;
    while (prev > 0 && log[prev - 1].find(" bucket ") == std::string::npos) --prev;
    REQUIRE(prev > 0);
    INFO(log[prev - 1]);
    CHECK(starts_with(log[prev - 1], "allgather sync bucket"));
    if (i + 1 < log.size()) CHECK(starts_with(log[i + 1], "reduce_scatter bucket"));
    ++placed;
  }
  CHECK(placed == iterations);
}

TEST_CASE("a trainer's collective during backward is refused, naming the call — at world 1 it simply runs") {
  auto world = InProcessWorld::create(2, 10s);
  const auto errors = test::run_ranks(2, [&](int r) {
    std::vector<float> params(64, 0.5f);
    Runtime rt(world->communicator(r), Config{});
    const auto h = test::register_flat(rt, params.data(), 2, 32);
    rt.zero_grad();
    rt.grad_f32(h[1]);
    rt.grad_ready(h[1]);
    float x = 1;
    try {
      rt.collective({CollectiveKind::allreduce, DType::f32, &x, &x, 1, 0, 1.0f, "metric"});
      FAIL("no error");
    } catch (const UsageError& e) {
      CHECK(std::string(e.what()).find("Runtime::collective ('metric')") != std::string::npos);
      CHECK(std::string(e.what()).find("between wait() and the next backward") != std::string::npos);
    }
    rt.grad_ready(h[0]);
    rt.wait();
  });
  test::require_all_ok(errors);

  auto one = InProcessWorld::create(1, 10s);
  std::vector<float> params(8, 0.5f);
  Runtime rt(one->communicator(0), Config{});
  test::register_flat(rt, params.data(), 1, 8);
  float x = 4;
  rt.collective({CollectiveKind::allreduce, DType::f32, &x, &x, 1, 0, 0.5f, "metric"}).get();
  CHECK(x == 2.0f);
}
