// The raw-buffer API for llm.c-style engines (Note [Flat buffers]): one flat parameter buffer, one
// flat gradient buffer, a table, readiness by offset range; the same results as the per-parameter
// API, bit for bit.
#include <doctest/doctest.h>

#include <chrono>
#include <vector>

#include "support/helpers.hpp"

using namespace shardflow;
using namespace std::chrono_literals;

namespace {

// Two layers, as an engine lays them out: h0.w [6, 8], h0.b [6], h1.w [3, 6], h1.b [3].
const std::vector<FlatEntry> kTable = {{"h0.w", {6, 8}, 0}, {"h0.b", {6}, 48}, {"h1.w", {3, 6}, 54}, {"h1.b", {3}, 72}};
constexpr std::size_t kTotal = 75;
constexpr int kIterations = 4;

float grad_at(int r, int it, std::size_t e) { return 0.01f * float((r * 7 + it * 3 + int(e)) % 17) - 0.08f; }
float init_at(std::size_t e) { return 0.1f - 0.002f * float(e); }

// Each rank's final parameters, through the per-parameter API (flat = false) or the flat one.
std::vector<std::vector<float>> train(int world, int stage, bool flat) {
  auto w = InProcessWorld::create(world, 30s);
  Config cfg;
  cfg.zero.stage = ZeroStage(stage);
  cfg.buckets.first_cap_bytes = cfg.buckets.cap_bytes = 100;
  if (flat) cfg.buckets.gradient_as_bucket_view = false;  // the engine's own gradient buffer
  std::vector<std::vector<float>> out(static_cast<std::size_t>(world));
  test::require_all_ok(test::run_ranks(world, [&](int r) {
    std::vector<float> params(kTotal), grads(kTotal, 0.0f);
    for (std::size_t e = 0; e < kTotal; ++e) params[e] = init_at(e);
    Runtime rt(w->communicator(r), cfg);
    std::vector<Param> h;
    if (flat) {
      h = rt.register_flat({params.data(), grads.data(), kTotal, DType::f32, Device::cpu(), kTable});
    } else {
      for (const auto& e : kTable) h.push_back(rt.register_param({e.name, e.shape, DType::f32, Device::cpu(), params.data() + e.offset}));
    }
    if (stage > 0) rt.configure_optimizer(OptimizerConfig{OptimizerConfig::Kind::adamw, 0.01f});
    for (int it = 0; it < kIterations; ++it) {
      rt.zero_grad();
      if (flat) {  // backward, a layer at a time, last layer first
        std::fill(grads.begin(), grads.end(), 0.0f);
        for (std::size_t e = 54; e < kTotal; ++e) grads[e] = grad_at(r, it, e);
        rt.grads_ready(54, kTotal - 54);
        for (std::size_t e = 0; e < 54; ++e) grads[e] = grad_at(r, it, e);
        rt.grads_ready(0, 54);
      } else {
        for (std::size_t k = kTable.size(); k-- > 0;) {
          float* g = rt.grad_f32(h[k]);
          for (std::int64_t i = 0; i < numel(kTable[k].shape); ++i) g[i] = grad_at(r, it, kTable[k].offset + std::size_t(i));
          rt.grad_ready(h[k]);
        }
      }
      rt.wait();
      if (stage == 0)  // the engine's own SGD over its flat buffers
        for (std::size_t k = 0; k < kTable.size(); ++k) {
          const float* g = flat ? grads.data() + kTable[k].offset : rt.grad_f32(h[k]);
          for (std::int64_t i = 0; i < numel(kTable[k].shape); ++i) params[kTable[k].offset + std::size_t(i)] -= 0.1f * g[i];
        }
    }
    rt.wait_all_params();
    out[std::size_t(r)] = params;
  }));
  return out;
}

}  // namespace

TEST_CASE("one flat parameter buffer, one flat gradient buffer, readiness a layer at a time: the per-parameter API's results bit for bit, worlds 1-3, the engine's own SGD and ZeRO-1 AdamW") {
  for (int world : {1, 2, 3})
    for (int stage : {0, 1}) {
      CAPTURE(world);
      CAPTURE(stage);
      CHECK(train(world, stage, true) == train(world, stage, false));
    }
}

TEST_CASE("flat buffers: overlapping or oversized entries, a range that cuts a parameter, and a gradient buffer beside bucket views are errors naming them") {
  auto w = InProcessWorld::create(1, 5s);
  std::vector<float> p(kTotal), g(kTotal);
  {
    Runtime rt(w->communicator(0));
    CHECK_THROWS_WITH_AS(rt.register_flat({p.data(), g.data(), kTotal, DType::f32, Device::cpu(), kTable}),
                         doctest::Contains("gradient_as_bucket_view is on"), UsageError);
    auto overlapping = kTable;
    overlapping[1].offset = 40;
    CHECK_THROWS_WITH_AS(rt.register_flat({p.data(), nullptr, kTotal, DType::f32, Device::cpu(), overlapping}),
                         doctest::Contains("'h0.b' at element 40 overlaps 'h0.w'"), UsageError);
    CHECK_THROWS_WITH_AS(rt.register_flat({p.data(), nullptr, 70, DType::f32, Device::cpu(), kTable}),
                         doctest::Contains("'h1.w' ends at element 72, past the buffer's 70"), UsageError);
  }
  Runtime rt(w->communicator(0));
  rt.register_flat({p.data(), nullptr, kTotal, DType::f32, Device::cpu(), kTable});
  rt.zero_grad();
  CHECK_THROWS_WITH_AS(rt.grads_ready(50, 25), doctest::Contains("cut parameter 'h0.b' ([48, 54))"), UsageError);
}
