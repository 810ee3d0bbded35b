// Hyper-parameters that change between iterations and groups added during training (Note
// [Changing hyper-parameters]), as torch.optim allows: a schedule of weight decay and betas, and
// add_param_group for parameters that were in group 0 by default.
#include <doctest/doctest.h>

#include <chrono>
#include <vector>

#include "support/helpers.hpp"
#include "support/per_param_optimizer.hpp"

using namespace shardflow;
using namespace std::chrono_literals;

namespace {

constexpr int kWorld = 2, kIterations = 6;
const std::vector<std::string> kNames = {"body", "head"};
const std::vector<std::int64_t> kSizes = {48, 12};

float grad_at(int r, int it, std::size_t p, std::int64_t e) { return 0.01f * float((r * 3 + it * 5 + int(p) * 11 + int(e)) % 17) - 0.08f; }
float init_at(std::size_t p, std::int64_t e) { return 0.3f - 0.1f * float(p) + 0.002f * float(e); }

OptimizerConfig base() { return test::adamw(0.02f, 0.05f); }
// From iteration 3 group 0 decays harder with other betas; from iteration 4 "head" has a group of
// its own at a tenth of the learning rate and no decay.
OptimizerConfig later() {
  auto h = base();
  h.weight_decay = 0.2f;
  h.beta1 = 0.8f;
  h.beta2 = 0.99f;
  return h;
}
OptimizerConfig head_group() {
  auto h = base();
  h.lr = 0.002f;
  h.weight_decay = 0.0f;
  return h;
}
const OptimizerConfig& rule(int it, std::size_t p) {
  static const OptimizerConfig b = base(), l = later(), g = head_group();
  if (p == 1 && it >= 4) return g;
  return it >= 3 ? l : b;
}

}  // namespace

TEST_CASE("weight decay and betas changed at iteration 3, a group added for the head at iteration 4: every step by the values in force, stages 1 and 2, with forward prefetch") {
  std::vector<std::vector<float>> init(2);
  for (std::size_t p = 0; p < 2; ++p)
    for (std::int64_t e = 0; e < kSizes[p]; ++e) init[p].push_back(init_at(p, e));
  test::PerParamOptimizer ref(base(), init);
  for (int it = 0; it < kIterations; ++it)
    for (std::size_t p = 0; p < 2; ++p) {
      std::vector<float> g;
      for (std::int64_t e = 0; e < kSizes[p]; ++e) g.push_back((grad_at(0, it, p, e) + grad_at(1, it, p, e)) * 0.5f);
      ref.step(p, g, &rule(it, p));
    }
  for (int stage : {1, 2}) {
    CAPTURE(stage);
    auto w = InProcessWorld::create(kWorld, 30s);
    Config cfg;
    cfg.zero.stage = ZeroStage(stage);
    cfg.zero.overlap = Overlap::interleaved;
    cfg.zero.forward_prefetch = true;
    cfg.buckets.first_cap_bytes = cfg.buckets.cap_bytes = 48;
    std::vector<std::vector<std::vector<float>>> got(kWorld);
    test::require_all_ok(test::run_ranks(kWorld, [&](int r) {
      auto data = init;
      Runtime rt(w->communicator(r), cfg);
      std::vector<Param> h;
      for (std::size_t p = 0; p < 2; ++p) h.push_back(rt.register_param({kNames[p], {kSizes[p]}, DType::f32, Device::cpu(), data[p].data()}));
      rt.configure_optimizer(std::vector<ParamGroup>{{{h[0]}, base()}});  // "head" joins group 0 by default
      for (int it = 0; it < kIterations; ++it) {
        if (it == 3) rt.set_hyperparameters(0, later());
        if (it == 4) CHECK(rt.add_param_group({{h[1]}, head_group()}) == 1);
        for (auto& p : h) rt.wait_param(p);
        rt.zero_grad();
        for (std::size_t p = 2; p-- > 0;) {
          float* g = rt.grad_f32(h[p]);
          for (std::int64_t e = 0; e < kSizes[p]; ++e) g[e] = grad_at(r, it, p, e);
          rt.grad_ready(h[p]);
        }
        rt.wait();
      }
      rt.wait_all_params();
      CHECK(rt.hyperparameters(1).lr == head_group().lr);
      got[std::size_t(r)] = data;
    }));
    for (int r = 0; r < kWorld; ++r)
      for (std::size_t p = 0; p < 2; ++p) {
        CAPTURE(r);
        CAPTURE(kNames[p]);
        CHECK(got[std::size_t(r)][p] == ref.params()[p]);
      }
  }
}

TEST_CASE("changes the state cannot follow are errors that say so: another kind, momentum where no group had it, a parameter already in a group") {
  auto w = InProcessWorld::create(1, 5s);
  Runtime rt(w->communicator(0));
  float a[8] = {}, b[8] = {};
  const auto pa = rt.register_param({"a", {8}, DType::f32, Device::cpu(), a});
  const auto pb = rt.register_param({"b", {8}, DType::f32, Device::cpu(), b});
  OptimizerConfig sgd;
  sgd.lr = 0.1f;
  rt.configure_optimizer(std::vector<ParamGroup>{{{pa}, sgd}});
  auto adam = sgd;
  adam.kind = OptimizerConfig::Kind::adam;
  CHECK_THROWS_WITH_AS(rt.set_hyperparameters(0, adam), doctest::Contains("the optimizer kind cannot change"), UsageError);
  auto momentum = sgd;
  momentum.momentum = 0.9f;
  CHECK_THROWS_WITH_AS(rt.set_hyperparameters(0, momentum), doctest::Contains("SGD momentum added where no group had it"), UsageError);
  CHECK_THROWS_WITH_AS(rt.add_param_group({{pa}, sgd}), doctest::Contains("parameter 'a' is already in group 0"), UsageError);
  CHECK(rt.add_param_group({{pb}, sgd}) == 1);
  CHECK_THROWS_WITH_AS(rt.set_hyperparameters(2, sgd), doctest::Contains("group 2 does not exist"), UsageError);
}
