// Bring your own optimizer (Note [Step rules]): a StepRule runs on the shard in place of the
// built-in SGD / Adam, with its own state tensors, which migrate, reshard and ride in checkpoints.
#include <doctest/doctest.h>

#include <cmath>
#include <filesystem>
#include <unistd.h>

#include "examples/mlp/train.hpp"
#include "support/helpers.hpp"
#include "runtime/checkpoint/safetensors_stream.hpp"

using namespace shardflow;
namespace fs = std::filesystem;

namespace {

// AdamW written by a trainer: the same float arithmetic as torch's (and the built-in kernel's),
// under its own state names.
class MyAdamW final : public StepRule {
 public:
  std::string name() const override { return "my_adamw"; }
  std::vector<std::string> state_names() const override { return {"m", "v"}; }
  void update(const StepArgs& a) const override {
    const auto& h = a.hyper;
    const double bc1 = 1.0 - std::pow(double(h.beta1), double(a.step)), bc2 = 1.0 - std::pow(double(h.beta2), double(a.step));
    const float step_size = float(double(h.lr) / bc1), bc2_sqrt = float(std::sqrt(bc2));
    const float decay = float(1.0 - double(h.lr) * double(h.weight_decay));
    for (std::size_t i = 0; i < a.n; ++i) {
      const float param = a.param[i] * decay, g = a.grad[i];
      const float m = a.state[0][i] * h.beta1 + g * (1.0f - h.beta1);
      const float v = a.state[1][i] * h.beta2 + (1.0f - h.beta2) * g * g;
      a.state[0][i] = m;
      a.state[1][i] = v;
      a.param[i] = param - step_size * (m / (std::sqrt(v) / bc2_sqrt + h.eps));
    }
  }
};

// Lion (Chen et al., 2023): one state tensor, sign updates.
class Lion final : public StepRule {
 public:
  std::string name() const override { return "lion"; }
  std::vector<std::string> state_names() const override { return {"exp_avg"}; }
  void update(const StepArgs& a) const override {
    const auto& h = a.hyper;
    for (std::size_t i = 0; i < a.n; ++i) {
      const float c = h.beta1 * a.state[0][i] + (1.0f - h.beta1) * a.grad[i];
      a.param[i] = a.param[i] * (1.0f - h.lr * h.weight_decay) - h.lr * float((c > 0.0f) - (c < 0.0f));
      a.state[0][i] = h.beta2 * a.state[0][i] + (1.0f - h.beta2) * a.grad[i];
    }
  }
};

mlp::TrainOptions base(int stage, Partition partition) {
  mlp::TrainOptions o;
  o.sizes = {24, 40, 40, 6};
  o.global_batch = 32;
  o.world_size = 2;
  o.steps = 10;
  o.optimizer.kind = OptimizerConfig::Kind::adamw;
  o.optimizer.lr = 0.01f;
  o.optimizer.weight_decay = 0.05f;
  o.runtime.zero.stage = ZeroStage(stage);
  o.runtime.zero.partition = partition;
  o.runtime.zero.overlap = Overlap::interleaved;
  o.runtime.buckets.first_cap_bytes = o.runtime.buckets.cap_bytes = 4096;
  return o;
}

mlp::TrainOptions with_rule(mlp::TrainOptions o, std::shared_ptr<const StepRule> rule) {
  o.optimizer.kind = OptimizerConfig::Kind::custom;
  o.optimizer.rule = std::move(rule);
  return o;
}

}  // namespace

TEST_CASE("a trainer's AdamW as a step rule equals the built-in AdamW bit for bit: stages 1 and 2, flat and param partitions, and the trainer-side Optimizer at stage 0") {
  for (int stage : {0, 1, 2})
    for (auto partition : {Partition::flat, Partition::param}) {
      if (stage == 0 && partition != Partition::flat) continue;  // nothing is partitioned (refused)
      CAPTURE(stage);
      CAPTURE(partition_name(partition));
      auto o = base(stage, partition);
      o.optimizer_in_runtime = stage > 0;
      if (stage == 0) o.runtime.zero.overlap = Overlap::none;
      const auto builtin = mlp::train(o);
      const auto mine = mlp::train(with_rule(o, std::make_shared<MyAdamW>()));
      for (const auto& [name, t] : builtin.params) CHECK_MESSAGE(mine.params.at(name).data == t.data, name);
    }
}

TEST_CASE("a step rule's state survives a checkpoint under its own names: 5 steps, save, 5 more == 10 straight, bit for bit — Lion with one state tensor trains") {
  const auto dir = fs::temp_directory_path() / ("sf_rules_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  auto o = with_rule(base(2, Partition::flat), std::make_shared<MyAdamW>());
  const auto straight = mlp::train(o);
  auto first = o;
  first.steps = 5;
  first.checkpoint_dir = dir.string();
  mlp::train(first);
  const auto index = read_safetensors_index(mlp::checkpoint_file(dir.string()));
  CHECK(index.tensors.count("optim.layers.0.weight.m") == 1);
  CHECK(index.tensors.count("optim.layers.0.weight.v") == 1);
  CHECK(index.metadata.at("shardflow.param_groups").find("\"rule\":\"my_adamw\"") != std::string::npos);
  auto rest = o;
  rest.steps = 5;
  rest.resume_dir = dir.string();
  const auto resumed = mlp::train(rest);
  for (const auto& [name, t] : straight.params) CHECK_MESSAGE(resumed.params.at(name).data == t.data, name);
  fs::remove_all(dir);

  auto lion = with_rule(base(1, Partition::flat), std::make_shared<Lion>());
  lion.optimizer.lr = 0.001f;
  lion.optimizer.beta2 = 0.99f;
  lion.optimizer.weight_decay = 0.0f;
  lion.steps = 40;
  const auto r = mlp::train(lion);
  CHECK(r.losses.back() < 0.7f * r.losses.front());
}

TEST_CASE("step rules: none given, three state tensors, or another rule's state mid-run are errors naming it") {
  OptimizerConfig oc;
  oc.kind = OptimizerConfig::Kind::custom;
  CHECK_THROWS_WITH_AS(oc.validate(), doctest::Contains("needs a StepRule"), UsageError);
  struct Three final : StepRule {
    std::string name() const override { return "three"; }
    std::vector<std::string> state_names() const override { return {"a", "b", "c"}; }
    void update(const StepArgs&) const override {}
  };
  oc.rule = std::make_shared<Three>();
  CHECK_THROWS_WITH_AS(oc.validate(), doctest::Contains("step rule 'three' asks for 3 state tensors"), UsageError);
  auto w = InProcessWorld::create(1);
  Runtime rt(w->communicator(0));
  float x[4] = {};
  rt.register_param({"x", {4}, DType::f32, Device::cpu(), x});
  oc.rule = std::make_shared<MyAdamW>();
  rt.configure_optimizer(oc);
  auto lion = oc;
  lion.rule = std::make_shared<Lion>();
  CHECK_THROWS_WITH_AS(rt.set_hyperparameters(0, lion), doctest::Contains("keeps other state tensors"), UsageError);
}
