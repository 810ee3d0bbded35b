// Comm hooks (Note [Comm hooks]): PyTorch's allreduce, fp16/bf16 compression and PowerSGD, and a
// trainer's own hook in phases, each in its bucket's place in the schedule.
#include <doctest/doctest.h>

#include <chrono>
#include <numeric>
#include <vector>

#include "examples/mlp/train.hpp"
#include "support/helpers.hpp"

using namespace shardflow;
using namespace std::chrono_literals;

namespace {

mlp::TrainOptions mlp_at(int stage, const std::string& hook) {
  mlp::TrainOptions o;
  o.sizes = {64, 256, 256, 8};
  o.global_batch = 64;
  o.world_size = 2;
  o.steps = 60;
  o.optimizer.kind = OptimizerConfig::Kind::adamw;
  o.optimizer.lr = 0.003f;
  o.runtime.zero.stage = ZeroStage(stage);
  o.optimizer_in_runtime = stage > 0;
  o.comm_hook = hook;
  o.powersgd.rank = 2;
  o.powersgd.start_iter = 5;
  return o;
}

std::uint64_t allreduce_bytes(const mlp::TrainResult& r) {
  std::uint64_t total = 0;
  for (const auto& s : r.stats.steps) total += s.bytes[std::size_t(CollectiveKind::allreduce)];
  return total;
}

// A trainer's own hook: the bucket's two halves all-reduced one after the other, each phase's
// continuation starting the next, and the average taken locally at the end.
class HalvesHook final : public CommHook {
 public:
  std::string name() const override { return "halves"; }
  void reduce(const GradBucket& b, HookRun& run) override {
    auto* g = static_cast<float*>(b.data);
    const std::size_t half = b.numel / 2;
    run.allreduce(g, half, DType::f32);
    run.then([g, half, b](HookRun& next) {
      next.allreduce(g + half, b.numel - half, DType::f32);
      next.then([g, b](HookRun&) {
        for (std::size_t i = 0; i < b.numel; ++i) g[i] *= b.average;
      });
    });
  }
};

class ThrowingHook final : public CommHook {
 public:
  std::string name() const override { return "throwing"; }
  void reduce(const GradBucket& b, HookRun& run) override {
    run.allreduce(b.data, b.numel, b.dtype);
    run.then([](HookRun&) { throw std::runtime_error("the hook's continuation failed"); });
  }
};

}  // namespace

TEST_CASE("the allreduce hook is the runtime's own reduction, bit for bit, at stages 0 and 1") {
  for (int stage : {0, 1}) {
    CAPTURE(stage);
    const auto plain = mlp::train(mlp_at(stage, ""));
    const auto hooked = mlp::train(mlp_at(stage, "allreduce"));
    for (const auto& [name, t] : plain.params) CHECK_MESSAGE(hooked.params.at(name).data == t.data, name);
  }
}

TEST_CASE("fp16 and bf16 compression halve the bytes and the loss tracks fp32 within 5% — a 16-bit wire with the trainer's own optimizer is the bf16 hook") {
  const auto fp32 = mlp::train(mlp_at(0, ""));
  for (const char* hook : {"fp16", "bf16"}) {
    CAPTURE(hook);
    const auto r = mlp::train(mlp_at(0, hook));
    CHECK(std::abs(r.losses.back() - fp32.losses.back()) <= 0.05f * fp32.losses.back());
    CHECK(r.losses.back() < 0.2f * r.losses.front());
    CHECK(allreduce_bytes(r) * 2 <= allreduce_bytes(fp32) + 64 * r.stats.steps.size());  // the loss exchange stays fp32
  }
  auto wire = mlp_at(0, "");
  wire.runtime.precision.comm_dtype = DType::bf16;  // no runtime optimizer: before, an error
  const auto a = mlp::train(wire), b = mlp::train(mlp_at(0, "bf16"));
  for (const auto& [name, t] : a.params) CHECK_MESSAGE(b.params.at(name).data == t.data, name);
}

TEST_CASE("PowerSGD rank 2 after 5 plain iterations: at least 4x fewer bytes over the run, the loss within 1.5x of fp32's, and ZeRO-1 steps on it") {
  const auto fp32 = mlp::train(mlp_at(0, ""));
  for (int stage : {0, 1}) {
    CAPTURE(stage);
    const auto r = mlp::train(mlp_at(stage, "powersgd"));
    INFO("bytes " << allreduce_bytes(r) << " against " << allreduce_bytes(fp32) << "; loss " << r.losses.back() << " against " << fp32.losses.back());
    CHECK(allreduce_bytes(r) * 4 <= allreduce_bytes(fp32));
    CHECK(r.losses.back() <= 1.5f * fp32.losses.back());
    CHECK(r.losses.back() < 0.2f * r.losses.front());
  }
}

TEST_CASE("a trainer's own hook in three phases, world 3, gradients reported in a different order on each rank: the plain average") {
  const int world = 3;
  auto w = InProcessWorld::create(world, 30s);
  std::vector<std::vector<float>> grads(world);
  test::require_all_ok(test::run_ranks(world, [&](int r) {
    std::vector<float> flat(6 * 50, 0.0f);
    Config cfg;
    cfg.buckets.first_cap_bytes = cfg.buckets.cap_bytes = 400;  // 3 buckets of 2 parameters
    Runtime rt(w->communicator(r), cfg);
    rt.register_comm_hook(std::make_shared<HalvesHook>());
    const auto h = test::register_flat(rt, flat.data(), 6, 50);
    for (int it = 0; it < 3; ++it) {
      rt.zero_grad();
      std::vector<int> order(6);
      std::iota(order.begin(), order.end(), 0);
      std::rotate(order.begin(), order.begin() + r * 2, order.end());
      for (int k : order) {
        float* g = rt.grad_f32(h[std::size_t(k)]);
        for (int e = 0; e < 50; ++e) g[e] = float((r + 1) * (k * 50 + e + it));
        rt.grad_ready(h[std::size_t(k)]);
      }
      rt.wait();
    }
    for (int k = 0; k < 6; ++k) {
      const float* g = rt.grad_f32(h[std::size_t(k)]);
      grads[std::size_t(r)].insert(grads[std::size_t(r)].end(), g, g + 50);
    }
  }));
  for (int k = 0; k < 6; ++k)
    for (int e = 0; e < 50; ++e) CHECK(grads[0][std::size_t(k * 50 + e)] == float(k * 50 + e + 2) * 6.0f * (1.0f / 3.0f));
  CHECK(grads[1] == grads[0]);
  CHECK(grads[2] == grads[0]);
}

TEST_CASE("hooks: a continuation that throws fails the iteration naming the bucket — ZeRO-2, a 16-bit comm_dtype beside a hook, a second hook and a late one are errors") {
  {
    auto w = InProcessWorld::create(2, 10s);
    const auto errors = test::run_ranks(2, [&](int r) {
      float x[8] = {};
      Runtime rt(w->communicator(r));
      rt.register_comm_hook(std::make_shared<ThrowingHook>());
      const auto p = rt.register_param({"x", {8}, DType::f32, Device::cpu(), x});
      rt.zero_grad();
      rt.grad_ready(p);
      rt.wait();
    });
    for (const auto& e : errors) CHECK(test::message_of(e).find("the hook's continuation failed") != std::string::npos);
  }
  auto w = InProcessWorld::create(1, 5s);
  float x[8] = {};
  {
    Config cfg;
    cfg.zero.stage = ZeroStage::gradients;
    Runtime rt(w->communicator(0), cfg);
    rt.register_comm_hook(powersgd_hook());
    rt.register_param({"x", {8}, DType::f32, Device::cpu(), x});
    CHECK_THROWS_WITH_AS(rt.configure_optimizer(OptimizerConfig{}), doctest::Contains("ZeRO-2 with the flat partition reduce-scatters"), UsageError);
  }
  {
    Config cfg;
    cfg.precision.comm_dtype = DType::f16;
    Runtime rt(w->communicator(0), cfg);
    rt.register_comm_hook(bf16_compress_hook());
    rt.register_param({"x", {8}, DType::f32, Device::cpu(), x});
    CHECK_THROWS_WITH_AS(rt.finalize(), doctest::Contains("compressed twice"), UsageError);
  }
  Runtime rt(w->communicator(0));
  rt.register_comm_hook(allreduce_hook());
  CHECK_THROWS_WITH_AS(rt.register_comm_hook(fp16_compress_hook()), doctest::Contains("'allreduce' is registered already"), UsageError);
  rt.register_param({"x", {8}, DType::f32, Device::cpu(), x});
  rt.finalize();
  CHECK_THROWS_WITH_AS(rt.register_comm_hook(fp16_compress_hook()), doctest::Contains("before training starts"), UsageError);
  CHECK_THROWS_WITH_AS(make_comm_hook("topk"), doctest::Contains("not one of allreduce, fp16, bf16, powersgd"), UsageError);
}
