// Forward prefetch when forward's order is not backward's reversed: the buckets are rebuilt from the
// order gradients arrived in (here shuffled), so the K buckets forward needs last, whose syncs go
// out during backward, can be any K (Note [An early sync after its own reduction]). Every K must
// end where the run without prefetch ends, bit for bit, and never stop: a sync placed before its own
// bucket's reduction waited for it for ever.
#include <doctest/doctest.h>

#include <fstream>
#include <random>

#include <nlohmann/json.hpp>
#include <unistd.h>

#include "support/helpers.hpp"

using namespace shardflow;
using namespace std::chrono_literals;

namespace {

// World 2, ZeRO-1 interleaved, 6 parameters of a bucket each; backward hands the gradients over in
// one shuffled order (every rank the same, every iteration), forward asks in registration order.
std::vector<std::vector<float>> train(bool prefetch, int early, int lag, int iterations = 6, const std::string& trace = "") {
  const int n = 2, P = 6, numel = 64;
  auto world = InProcessWorld::create(n, 20s);
  std::vector<std::vector<float>> out(n);
  test::require_all_ok(test::run_ranks(n, [&](int r) {
    std::vector<float> params(std::size_t(P) * numel, 0.25f);
    Config cfg = test::zero1_bucket_per_param(numel, prefetch);
    cfg.zero.prefetch_syncs_in_backward = early;
    cfg.zero.interleave_lag = lag;  // fixed: the measured one is past the last bucket on an idle machine
    cfg.timeouts.collective = 20s;  // a stopped schedule fails the test instead of hanging it
    cfg.trace.path = trace;
    Runtime rt(world->communicator(r), cfg);
    const auto h = test::register_flat(rt, params.data(), P, numel);
    OptimizerConfig adam;
    adam.kind = OptimizerConfig::Kind::adamw;
    rt.configure_optimizer(adam);
    std::vector<Param> backward(h.begin(), h.end());
    std::shuffle(backward.begin(), backward.end(), std::mt19937(5));
    for (int it = 0; it < iterations; ++it) {
      rt.zero_grad();
      for (const auto& p : h) rt.wait_param(p);
      for (const auto& p : backward) {
        float* g = rt.grad_f32(p);
        for (int e = 0; e < numel; ++e) g[e] = 0.01f * float((e + 3 * int(p.index) + r + it) % 11) - 0.04f;
        rt.grad_ready(p);
      }
      rt.wait();
    }
    rt.wait_all_params();
    out[std::size_t(r)] = params;
  }));
  return out;
}

}  // namespace

TEST_CASE("forward prefetch, world 2, buckets rebuilt from a shuffled backward: every K of syncs in backward, lag 0 and 1, ends where no prefetch ends, bit for bit") {
  const auto reference = train(false, -1, 1);
  CHECK(reference[0] == reference[1]);
  for (int lag : {0, 1})
    for (int early = 0; early <= 6; ++early) {
      CAPTURE(lag);
      CAPTURE(early);
      const auto got = train(true, early, lag);
      CHECK(got[0] == reference[0]);
      CHECK(got[1] == reference[1]);
    }
}

namespace {

// The iterations at whose end rank 0 chose the sync order ("forward order for prefetch" spans).
std::vector<std::int64_t> order_choices(const std::string& path) {
  std::ifstream in(path);
  REQUIRE(in.good());
  const auto j = nlohmann::json::parse(in);
  std::vector<std::int64_t> at;
  for (const auto& e : j.at("traceEvents"))
    if (e.value("name", "") == "forward order for prefetch" && e.value("pid", -1) == 0) at.push_back(e.at("args").at("iteration").get<std::int64_t>());
  return at;
}

}  // namespace

TEST_CASE("forward prefetch, automatic K: chosen on the second iteration, chosen again once on the settled fifth, and the run ends bit for bit where no prefetch ends") {
  // Note [Choosing on a settled iteration]. The actors restart only if K changed, which on an idle
  // machine it may or may not: either way every rank must issue the same schedule from then on.
  const int iterations = 9;
  const auto reference = train(false, -1, 1, iterations);
  const std::string automatic = "/tmp/shardflow_prefetch_auto_" + std::to_string(::getpid()) + ".json";
  const auto got = train(true, -1, 1, iterations, automatic);
  CHECK(got[0] == reference[0]);
  CHECK(got[1] == reference[1]);
  CHECK(order_choices(automatic) == std::vector<std::int64_t>{1, 4});
  std::remove(automatic.c_str());
}

TEST_CASE("forward prefetch, a K the Config fixed: chosen on the second iteration only, and the run ends bit for bit where no prefetch ends") {
  const int iterations = 9;
  const auto reference = train(false, -1, 1, iterations);
  const std::string fixed = "/tmp/shardflow_prefetch_fixed_" + std::to_string(::getpid()) + ".json";
  const auto kept = train(true, 3, 1, iterations, fixed);
  CHECK(kept[0] == reference[0]);
  CHECK(order_choices(fixed) == std::vector<std::int64_t>{1});
  std::remove(fixed.c_str());
}
