// Uneven inputs (Note [Uneven inputs], PyTorch's Join): ranks that run out of data join and shadow
// the others; each iteration averages over the ranks that contributed, so the run equals one
// process stepping on those averages, whatever the stage.
#include <doctest/doctest.h>

#include <chrono>
#include <vector>

#include "examples/mlp/train.hpp"
#include "support/helpers.hpp"
#include "support/per_param_optimizer.hpp"

using namespace shardflow;
using namespace std::chrono_literals;

namespace {

constexpr int kWorld = 3, kParams = 3;
constexpr std::int64_t kNumel = 24;
const int kBatches[kWorld] = {10, 9, 7};

float grad_at(int r, int it, int p, std::int64_t e) { return 0.01f * float((r * 5 + it * 3 + p * 7 + int(e)) % 13) - 0.06f; }
float init_at(int p, std::int64_t e) { return 0.2f + 0.01f * float(p) - 0.002f * float(e); }

// One synchronised iteration of rank r on its batch `it`.
void iterate(Runtime& rt, const std::vector<Param>& h, int r, int it) {
  rt.zero_grad();
  for (int p = kParams - 1; p >= 0; --p) {
    float* g = rt.grad_f32(h[std::size_t(p)]);
    for (std::int64_t e = 0; e < kNumel; ++e) g[e] = grad_at(r, it, p, e);
    rt.grad_ready(h[std::size_t(p)]);
  }
  rt.wait();
}

}  // namespace

TEST_CASE("join: ranks with 10, 9 and 7 batches, stages 0-2: every rank ends with the parameters of one process stepping on the average over the ranks that had a batch") {
  // The documented averaging: iteration k's gradient is the sum over the ranks with a k-th batch
  // divided by their number.
  std::vector<std::vector<float>> init(kParams);
  for (int p = 0; p < kParams; ++p)
    for (std::int64_t e = 0; e < kNumel; ++e) init[std::size_t(p)].push_back(init_at(p, e));
  test::PerParamOptimizer ref(test::adamw(0.01f, 0.05f), init);
  for (int it = 0; it < kBatches[0]; ++it) {
    int contributing = 0;
    for (int r = 0; r < kWorld; ++r) contributing += it < kBatches[r];
    for (int p = 0; p < kParams; ++p) {
      std::vector<float> g;
      for (std::int64_t e = 0; e < kNumel; ++e) {
        float sum = 0.0f;
        for (int r = 0; r < kWorld; ++r) sum += it < kBatches[r] ? grad_at(r, it, p, e) : 0.0f;
        g.push_back(sum * (1.0f / float(contributing)));
      }
      ref.step(std::size_t(p), g);
    }
  }
  for (int stage : {0, 1, 2}) {
    CAPTURE(stage);
    auto w = InProcessWorld::create(kWorld, 30s);
    Config cfg;
    cfg.join.uneven_inputs = true;
    cfg.zero.stage = ZeroStage(stage);
    cfg.zero.overlap = stage ? Overlap::interleaved : Overlap::none;
    cfg.buckets.first_cap_bytes = cfg.buckets.cap_bytes = kNumel * 4;
    std::vector<std::vector<float>> final(kWorld);
    std::vector<std::vector<int>> counts(kWorld);
    test::require_all_ok(test::run_ranks(kWorld, [&](int r) {
      std::vector<float> flat;
      for (const auto& p : init) flat.insert(flat.end(), p.begin(), p.end());
      Runtime rt(w->communicator(r), cfg);
      const auto h = test::register_flat(rt, flat.data(), kParams, kNumel);
      rt.configure_optimizer(test::adamw(0.01f, 0.05f));
      for (int it = 0; it < kBatches[r]; ++it) {
        iterate(rt, h, r, it);
        counts[std::size_t(r)].push_back(rt.training_ranks());
      }
      rt.join();  // out of data: shadow the others until everyone is
      rt.wait_all_params();
      final[std::size_t(r)] = flat;
    }));
    std::vector<float> want;
    for (const auto& p : ref.params()) want.insert(want.end(), p.begin(), p.end());
    for (int r = 0; r < kWorld; ++r) {
      CAPTURE(r);
      CHECK(final[std::size_t(r)] == want);
    }
    CHECK(counts[0] == std::vector<int>{3, 3, 3, 3, 3, 3, 3, 2, 2, 1});
  }
}

TEST_CASE("join with the trainer's own optimizer: a joined rank stops stepping, and when all have joined every rank gets the parameters of the rank that joined last") {
  std::vector<float> init;
  for (int p = 0; p < kParams; ++p)
    for (std::int64_t e = 0; e < kNumel; ++e) init.push_back(init_at(p, e));
  auto want = init;
  for (int it = 0; it < kBatches[0]; ++it) {
    int contributing = 0;
    for (int r = 0; r < kWorld; ++r) contributing += it < kBatches[r];
    for (int p = 0; p < kParams; ++p)
      for (std::int64_t e = 0; e < kNumel; ++e) {
        float sum = 0.0f;
        for (int r = 0; r < kWorld; ++r) sum += it < kBatches[r] ? grad_at(r, it, p, e) : 0.0f;
        want[std::size_t(p * kNumel + e)] -= 0.1f * (sum * (1.0f / float(contributing)));
      }
  }
  auto w = InProcessWorld::create(kWorld, 30s);
  Config cfg;
  cfg.join.uneven_inputs = true;
  cfg.buckets.first_cap_bytes = cfg.buckets.cap_bytes = kNumel * 4;
  std::vector<std::vector<float>> final(kWorld);
  test::require_all_ok(test::run_ranks(kWorld, [&](int r) {
    auto flat = init;
    Runtime rt(w->communicator(r), cfg);
    const auto h = test::register_flat(rt, flat.data(), kParams, kNumel);
    for (int it = 0; it < kBatches[r]; ++it) {
      iterate(rt, h, r, it);
      for (int p = 0; p < kParams; ++p) {  // the trainer's own SGD step
        const float* g = rt.grad_f32(h[std::size_t(p)]);
        for (std::int64_t e = 0; e < kNumel; ++e) flat[std::size_t(p * kNumel + e)] -= 0.1f * g[e];
      }
    }
    rt.join();
    final[std::size_t(r)] = flat;
  }));
  for (int r = 0; r < kWorld; ++r) {
    CAPTURE(r);
    CHECK(final[std::size_t(r)] == want);
  }
}

TEST_CASE("join without uneven_inputs, or with forward prefetch, is an error that names the setting") {
  auto w = InProcessWorld::create(1, 5s);
  Runtime rt(w->communicator(0));
  float x[4] = {};
  rt.register_param({"x", {4}, DType::f32, Device::cpu(), x});
  CHECK_THROWS_WITH_AS(rt.join(), doctest::Contains("join.uneven_inputs = true"), UsageError);
  Config c;
  c.join.uneven_inputs = true;
  c.zero.forward_prefetch = true;
  CHECK_THROWS_WITH_AS(Runtime(w->communicator(0), c), doctest::Contains("does not work with Config::zero.forward_prefetch"), UsageError);
}

TEST_CASE("mlp_train --shard-data: 23 rows over 3 ranks in batches of 4 give 2, 2 and 1 batches — rank 2 joins early, the run ends, the split is reported") {
  mlp::TrainOptions o;
  o.sizes = {8, 16, 2};
  o.world_size = 3;
  o.global_batch = 12;
  o.data_rows = 23;
  o.steps = 100;
  o.shard_data = true;
  o.runtime.join.uneven_inputs = true;
  o.runtime.zero.stage = ZeroStage::optimizer_state;
  o.optimizer.kind = OptimizerConfig::Kind::adamw;
  const auto r = mlp::train(o);
  CHECK(r.data_split.find("rank 0 rows [0, 8) = 2 batches; rank 1 rows [8, 16) = 2 batches; rank 2 rows [16, 23) = 1 batches; 3 rows in partial batches dropped") !=
        std::string::npos);
  CHECK(r.step_ms.size() == 2);  // rank 0's steps: its shard's batches
  o.accumulate = 2;
  CHECK_THROWS_WITH_AS(mlp::train(o), doctest::Contains("--shard-data takes one micro-batch per step"), UsageError);
}
