// PyTorch's static_graph (Note [Static graph]): re-entrant backward reports a gradient several
// times, and the parameters no rank uses are learnt once and fixed.
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <vector>

#include "support/helpers.hpp"
#include "support/per_param_optimizer.hpp"

using namespace shardflow;
using namespace std::chrono_literals;

namespace {

constexpr int kWorld = 2, kParams = 4, kIterations = 5;
constexpr std::int64_t kNumel = 32;

float grad_at(int r, int it, int p, std::int64_t e) { return 0.01f * float((r * 3 + it * 7 + p * 5 + int(e)) % 11) - 0.05f; }

struct Run {
  std::vector<std::vector<float>> params;  // per rank
  std::vector<std::string> log;            // rank 0's collectives
  std::vector<std::vector<std::string>> unused;  // rank 0, per iteration
};

// Parameter 1 is reported in two halves (re-entrant backward: each report adds its half);
// parameter 3 is never used on any rank. `reentrant` off: the same gradients, each reported once
// and parameter 3 left out with find_unused_parameters.
Run train(int stage, bool reentrant) {
  auto w = InProcessWorld::create(kWorld, 30s);
  Config cfg;
  cfg.zero.stage = ZeroStage(stage);
  cfg.zero.overlap = stage ? Overlap::interleaved : Overlap::none;
  cfg.buckets.first_cap_bytes = cfg.buckets.cap_bytes = kNumel * 4;
  (reentrant ? cfg.buckets.static_graph : cfg.buckets.find_unused_parameters) = true;
  Run out;
  out.params.resize(kWorld);
  test::require_all_ok(test::run_ranks(kWorld, [&](int r) {
    std::vector<float> flat(kParams * kNumel);
    for (std::size_t i = 0; i < flat.size(); ++i) flat[i] = 0.3f + 0.001f * float(i);
    Runtime rt(w->communicator(r), cfg);
    const auto h = test::register_flat(rt, flat.data(), kParams, kNumel);
    rt.configure_optimizer(test::adamw(0.01f, 0.1f));
    for (int it = 0; it < kIterations; ++it) {
      rt.zero_grad();
      for (int p = kParams - 1; p >= 0; --p) {
        if (p == 3) continue;
        float* g = rt.grad_f32(h[std::size_t(p)]);
        if (reentrant && p == 1) {
          for (std::int64_t e = 0; e < kNumel; ++e) g[e] += 0.5f * grad_at(r, it, p, e);
          rt.grad_ready(h[1]);
          g = rt.grad_f32(h[1]);
          for (std::int64_t e = 0; e < kNumel; ++e) g[e] += 0.5f * grad_at(r, it, p, e);
          rt.grad_ready(h[1]);
          continue;
        }
        for (std::int64_t e = 0; e < kNumel; ++e) g[e] += p == 1 ? 0.5f * grad_at(r, it, p, e) + 0.5f * grad_at(r, it, p, e) : grad_at(r, it, p, e);
        rt.grad_ready(h[std::size_t(p)]);
      }
      rt.wait();
      if (r == 0) {
        std::vector<std::string> none;
        for (const auto& p : rt.unused_parameters()) none.push_back("p" + std::to_string(p.index));
        out.unused.push_back(none);
      }
    }
    rt.wait_all_params();
    out.params[std::size_t(r)] = flat;
    if (r == 0) out.log = rt.collective_log();
  }));
  return out;
}

}  // namespace

TEST_CASE("static_graph, world 2, stages 0-2: a gradient reported in two halves by re-entrant backward equals it reported once, the unused parameter learnt in the first iteration and never exchanged again") {
  for (int stage : {0, 1, 2}) {
    CAPTURE(stage);
    const auto once = train(stage, false), twice = train(stage, true);
    for (int r = 0; r < kWorld; ++r) CHECK(twice.params[std::size_t(r)] == once.params[std::size_t(r)]);
    // p3 is never stepped: AdamW's weight decay would have moved it.
    for (std::int64_t e = 0; e < kNumel; ++e) CHECK(twice.params[0][std::size_t(3 * kNumel + e)] == 0.3f + 0.001f * float(3 * kNumel + e));
    for (const auto& u : twice.unused) CHECK(u == std::vector<std::string>{"p3"});
    auto exchanges = [](const std::vector<std::string>& log) {
      return std::count_if(log.begin(), log.end(), [](const std::string& l) { return l.find("used counts") != std::string::npos; });
    };
    CHECK(exchanges(once.log) == kIterations);  // find_unused_parameters: every iteration
    CHECK(exchanges(twice.log) == 1);           // static_graph: the first only
  }
}

TEST_CASE("static_graph: a gradient reported more or fewer times than in the first iteration is an error naming it") {
  for (int extra : {1, -1}) {
    CAPTURE(extra);
    auto w = InProcessWorld::create(1, 5s);
    Config cfg;
    cfg.buckets.static_graph = true;
    Runtime rt(w->communicator(0), cfg);
    float x[4] = {}, y[4] = {};
    const auto px = rt.register_param({"x", {4}, DType::f32, Device::cpu(), x});
    const auto py = rt.register_param({"y", {4}, DType::f32, Device::cpu(), y});
    auto pass = [&](int x_reports) {
      rt.zero_grad();
      rt.grad_ready(py);
      for (int k = 0; k < x_reports; ++k) rt.grad_ready(px);
      rt.wait();
    };
    pass(2);
    pass(2);
    if (extra > 0)
      CHECK_THROWS_WITH_AS(pass(3), doctest::Contains("parameter 'x' was reported 3 times in iteration 2 on rank 0, but 2 times in the first one"),
                           UsageError);
    else
      CHECK_THROWS_WITH_AS(pass(1), doctest::Contains("parameter 'x' was reported 1 of the 2 times the first iteration did"), UsageError);
  }
}
