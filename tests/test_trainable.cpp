// Frozen parameters and a trainable set that changes between iterations (Note [Changing the
// trainable set]): a frozen parameter is never reduced, stepped or synced and keeps no optimizer
// state; the state of parameters that stay trainable survives a refresh; one trained again starts
// afresh, as if just added to a torch.optim optimizer.
#include <doctest/doctest.h>

#include <chrono>
#include <filesystem>
#include <functional>
#include <unistd.h>
#include <vector>

#include "examples/mlp/train.hpp"
#include "support/helpers.hpp"
#include "support/per_param_optimizer.hpp"

using namespace shardflow;
using namespace std::chrono_literals;

namespace {

constexpr int kWorld = 2;
const std::vector<std::string> kNames = {"l0.weight", "l0.bias", "l1.weight", "l1.bias"};
const std::vector<std::int64_t> kSizes = {30, 6, 30, 6};

// Whether parameter p trains in iteration it: l0 is frozen for iterations 0-2, l1.bias for 3-5.
bool trains(int it, std::size_t p) {
  if (p < 2) return it >= 3;
  if (p == 3) return it < 3 || it >= 6;
  return true;
}

float grad_at(int r, int it, std::size_t p, std::int64_t e) { return 0.01f * float((r * 5 + it * 3 + int(p) * 7 + int(e)) % 13) - 0.05f; }
float init_at(std::size_t p, std::int64_t e) { return 0.2f * float(p + 1) - 0.004f * float(e); }

OptimizerConfig adamw() { return test::adamw(0.05f, 0.1f); }

std::vector<float> average_grad(int it, std::size_t p) {
  std::vector<float> g;
  for (std::int64_t e = 0; e < kSizes[p]; ++e) {
    float sum = 0.0f;
    for (int r = 0; r < kWorld; ++r) sum += grad_at(r, it, p, e);
    g.push_back(sum * (1.0f / float(kWorld)));
  }
  return g;
}

// The reference by hand: frozen parameters untouched, a newly frozen one forgets its state.
std::vector<std::vector<float>> reference(int iterations) {
  std::vector<std::vector<float>> init(kSizes.size());
  for (std::size_t p = 0; p < kSizes.size(); ++p)
    for (std::int64_t e = 0; e < kSizes[p]; ++e) init[p].push_back(init_at(p, e));
  test::PerParamOptimizer ref(adamw(), init);
  for (int it = 0; it < iterations; ++it)
    for (std::size_t p = 0; p < kSizes.size(); ++p) {
      if (it > 0 && trains(it - 1, p) && !trains(it, p)) ref.forget(p);
      if (trains(it, p)) ref.step(p, average_grad(it, p));
    }
  return ref.params();
}

// kWorld ranks as threads train the parameters in `registered` (all four, or a subset for a model
// that never had the others) for `iterations`; the trainable set follows trains() through
// set_requires_grad + refresh_trainable. Returns rank r's parameters after each iteration.
using History = std::vector<std::vector<std::vector<std::vector<float>>>>;  // [rank][iteration][param]
// `first`, `before` and `after`: a run that resumes at iteration `first` from what `before` loads,
// and saves with `after`; at world 1 the one rank reports the average of kWorld ranks' gradients.
using Hook = std::function<void(Runtime&)>;
History train(Config cfg, int iterations, const std::vector<std::size_t>& registered, int first = 0, const Hook& before = {},
              const Hook& after = {}, int world = kWorld) {
  auto w = InProcessWorld::create(world, 30s);
  cfg.buckets.first_cap_bytes = cfg.buckets.cap_bytes = 64;
  History out(static_cast<std::size_t>(world));
  test::require_all_ok(test::run_ranks(world, [&](int r) {
    std::vector<std::vector<float>> data(kSizes.size());
    Runtime rt(w->communicator(r), cfg);
    std::vector<Param> h(kSizes.size());
    for (auto p : registered) {
      for (std::int64_t e = 0; e < kSizes[p]; ++e) data[p].push_back(init_at(p, e));
      ParamSpec spec{kNames[p], {kSizes[p]}, DType::f32, Device::cpu(), data[p].data()};
      spec.requires_grad = trains(first, p);
      h[p] = rt.register_param(spec);
    }
    rt.configure_optimizer(adamw());
    if (before) before(rt);
    for (int it = first; it < first + iterations; ++it) {
      if (it > first) {
        bool changed = false;
        for (auto p : registered)
          if (trains(it, p) != trains(it - 1, p)) rt.set_requires_grad(h[p], trains(it, p)), changed = true;
        if (changed) rt.refresh_trainable();
      }
      rt.zero_grad();
      for (auto k = registered.size(); k-- > 0;) {
        const auto p = registered[k];
        if (!trains(it, p)) continue;
        float* g = rt.grad_f32(h[p]);
        const auto avg = average_grad(it, p);
        for (std::int64_t e = 0; e < kSizes[p]; ++e) g[e] = world == 1 ? avg[std::size_t(e)] : grad_at(r, it, p, e);
        rt.grad_ready(h[p]);
      }
      rt.wait();
      rt.wait_all_params();
      out[std::size_t(r)].push_back(data);
    }
    if (after) after(rt);
  }));
  return out;
}

Config at(int stage, Partition partition, bool prefetch = false) {
  Config cfg;
  cfg.zero.stage = ZeroStage(stage);
  cfg.zero.partition = partition;
  cfg.zero.overlap = Overlap::interleaved;
  cfg.zero.forward_prefetch = prefetch;
  return cfg;
}

}  // namespace

TEST_CASE("freeze half the model, train, unfreeze, train: frozen parameters bit-identical while frozen, the rest as a model that never had them, then every parameter as torch.optim would have it — stages 0-2, every partition") {
  const auto want = reference(8);
  for (int stage : {0, 1, 2})
    for (auto partition : {Partition::param, Partition::bucket, Partition::flat}) {
      if (stage == 0 && partition != Partition::flat) continue;  // nothing is partitioned (refused)
      CAPTURE(stage);
      CAPTURE(partition_name(partition));
      const auto cfg = at(stage, partition, stage == 1 && partition == Partition::flat);
      const auto got = train(cfg, 8, {0, 1, 2, 3});
      const auto half = train(cfg, 3, {2, 3});
      for (int r = 0; r < kWorld; ++r) {
        CAPTURE(r);
        const auto& mine = got[std::size_t(r)];
        for (int it = 0; it < 3; ++it)
          for (std::size_t p : {0, 1}) {
            std::vector<float> init;
            for (std::int64_t e = 0; e < kSizes[p]; ++e) init.push_back(init_at(p, e));
            CHECK(mine[std::size_t(it)][p] == init);  // frozen: not a bit moved
          }
        for (std::size_t p : {2, 3}) CHECK(mine[2][p] == half[std::size_t(r)][2][p]);
        CHECK(mine[5][3] == mine[2][3]);  // l1.bias frozen for iterations 3-5
        for (std::size_t p = 0; p < kSizes.size(); ++p) {
          CAPTURE(kNames[p]);
          CHECK(mine[7][p] == want[p]);
        }
      }
    }
}

TEST_CASE("a parameter trained again with fp32 masters (a bf16 wire) starts its master from its value, not from zero") {
  auto cfg = at(1, Partition::flat);
  cfg.precision.comm_dtype = DType::bf16;
  const auto got = train(cfg, 4, {0, 1, 2, 3});
  for (std::size_t p : {0, 1})
    for (std::int64_t e = 0; e < kSizes[p]; ++e) {
      const float before = got[0][2][p][std::size_t(e)], after = got[0][3][p][std::size_t(e)];
      CHECK(std::abs(after - before) < 0.1f);  // one Adam step of lr 0.05 (a zero master would land near 0)
      CHECK(after != before);
    }
  CHECK(got[1][3] == got[0][3]);
}

TEST_CASE("frozen parameters: asking for their gradient, reporting one, or refreshing to different sets on different ranks is an error naming them") {
  auto w = InProcessWorld::create(1, 5s);
  Runtime rt(w->communicator(0));
  float a[4] = {}, b[4] = {};
  ParamSpec frozen{"embed", {4}, DType::f32, Device::cpu(), a};
  frozen.requires_grad = false;
  const auto pf = rt.register_param(frozen);
  rt.register_param({"head", {4}, DType::f32, Device::cpu(), b});
  CHECK_THROWS_WITH_AS(rt.grad(pf), doctest::Contains("grad: parameter 'embed' is frozen"), UsageError);
  CHECK_THROWS_WITH_AS(rt.grad_ready(pf), doctest::Contains("grad_ready: parameter 'embed' is frozen"), UsageError);
  CHECK_NOTHROW(rt.wait_param(pf));

  auto w2 = InProcessWorld::create(2, 10s);
  const auto errors = test::run_ranks(2, [&](int r) {
    float x[4] = {}, y[4] = {};
    Runtime rt2(w2->communicator(r));
    const auto px = rt2.register_param({"x", {4}, DType::f32, Device::cpu(), x});
    rt2.register_param({"y", {4}, DType::f32, Device::cpu(), y});
    rt2.finalize();
    if (r == 1) rt2.set_requires_grad(px, false);
    rt2.refresh_trainable();
  });
  for (const auto& e : errors) CHECK(test::message_of(e).find("refresh_trainable: ranks registered different parameters: parameter #0") != std::string::npos);
}

TEST_CASE("checkpoints of a partly frozen model: saved at world 2 while l0 is frozen (consolidated and sharded), resumed at world 1 and at world 2 stage 2, l0 then trained from fresh state: as if never interrupted") {
  namespace fs = std::filesystem;
  const auto dir = fs::temp_directory_path() / ("sf_trainable_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const auto file = (dir / "c.safetensors").string(), sharded = (dir / "sharded").string();
  train(at(1, Partition::param), 3, {0, 1, 2, 3}, 0, {}, [&](Runtime& rt) {
    rt.save_checkpoint(file);
    rt.save_sharded_checkpoint(sharded);
  });
  const auto want = reference(8);
  for (const auto& from : {file, sharded})
    for (int world : {1, 2}) {
      CAPTURE(from);
      CAPTURE(world);
      const auto got = train(at(2, Partition::flat), 5, {0, 1, 2, 3}, 3, [&](Runtime& rt) { rt.load_checkpoint(from); }, {}, world);
      for (std::size_t p = 0; p < kSizes.size(); ++p) {
        CAPTURE(kNames[p]);
        CHECK(got[0][4][p] == want[p]);
      }
    }
  fs::remove_all(dir);
}

TEST_CASE("mlp_train --freeze layers.0.weight,layers.0.bias at world 2, ZeRO-2, AdamW: the first layer stays as initialised, the rest trains and the loss falls") {
  mlp::TrainOptions o;
  o.sizes = {24, 40, 6};
  o.global_batch = 32;
  o.world_size = 2;
  o.optimizer.kind = OptimizerConfig::Kind::adamw;
  o.optimizer.lr = 0.01f;
  o.runtime.zero.stage = ZeroStage::gradients;
  o.steps = 0;
  const auto init = mlp::train(o).params;
  o.steps = 30;
  o.freeze = {"layers.0.weight", "layers.0.bias"};
  const auto r = mlp::train(o);
  CHECK(r.params.at("layers.0.weight").data == init.at("layers.0.weight").data);
  CHECK(r.params.at("layers.0.bias").data == init.at("layers.0.bias").data);
  CHECK(r.params.at("layers.1.weight").data != init.at("layers.1.weight").data);
  CHECK(r.losses.back() < 0.9f * r.losses.front());
  o.freeze = {"layers.9.bias"};
  CHECK_THROWS_WITH_AS(mlp::train(o), doctest::Contains("--freeze: the model has no parameter 'layers.9.bias'"), UsageError);
}
