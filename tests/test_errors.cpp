// Bad input ends in a clear error naming the parameter, rank or bucket — never a hang, a crash or
// silently wrong numbers.
#include <doctest/doctest.h>

#include <atomic>

#include "examples/mlp/model.hpp"
#include "examples/mlp/train.hpp"
#include "support/forwarding_comm.hpp"
#include "support/helpers.hpp"

using namespace shardflow;
using namespace std::chrono_literals;

namespace {

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

struct TwoParams {
  std::vector<float> data = std::vector<float>(30);
  Param a, b;
  void add(Runtime& rt) {
    a = rt.register_param({"layers.0.weight", {2, 10}, DType::f32, Device::cpu(), data.data()});
    b = rt.register_param({"layers.0.bias", {10}, DType::f32, Device::cpu(), data.data() + 20});
  }
};

// A backend that loses one op without a word: the `lose`-th bucket op (counted from 0) is taken and
// never completed, nor failed, nor timed out. Every rank loses the same op, so the ops after it
// still pair up.
class LosingComm : public test::ForwardingComm {
 public:
  LosingComm(std::shared_ptr<Communicator> inner, int lose) : ForwardingComm(std::move(inner)), lose_(lose) {}
  void submit(CollectiveOp op, CollectiveDone done) override {
    if (op.tag.rfind("bucket", 0) == 0 && seen_++ == lose_) return;
    inner_->submit(std::move(op), std::move(done));
  }

 private:
  int lose_;
  std::atomic<int> seen_{0};
};

}  // namespace

TEST_CASE("the same parameter marked ready twice in one iteration") {
  auto world = InProcessWorld::create(1);
  Runtime rt(world->communicator(0));
  TwoParams m;
  m.add(rt);
  rt.grad_ready(m.a);
  try {
    rt.grad_ready(m.a);
    FAIL("no error");
  } catch (const UsageError& e) {
    CHECK(contains(e.what(), "'layers.0.weight' was marked ready twice in iteration 0 on rank 0"));
  }
}

TEST_CASE("unknown parameters: by name, a forged handle, another runtime's handle") {
  auto world = InProcessWorld::create(1);
  Runtime rt(world->communicator(0));
  TwoParams m;
  m.add(rt);
  try {
    rt.grad_ready("layers.9.weight");
    FAIL("no error");
  } catch (const UsageError& e) {
    CHECK(contains(e.what(), "unknown parameter 'layers.9.weight'"));
    CHECK(contains(e.what(), "layers.0.weight"));  // tells what is registered
  }
  Param forged = m.a;
  forged.index = 42;
  CHECK_THROWS_WITH_AS(rt.grad_ready(forged), doctest::Contains("unknown parameter handle #42"), UsageError);
  CHECK_THROWS_WITH_AS(rt.grad_ready(Param{}), doctest::Contains("never registered"), UsageError);

  auto other_world = InProcessWorld::create(1);
  Runtime other(other_world->communicator(0));
  TwoParams m2;
  m2.add(other);
  CHECK_THROWS_WITH_AS(rt.grad_ready(m2.a), doctest::Contains("belongs to another Runtime"), UsageError);
}

TEST_CASE("ranks registering different parameter lists: every rank refuses to train, naming the difference") {
  struct Case {
    const char* what;
    std::function<void(Runtime&, std::vector<float>&, int)> reg;
    const char* expect;
  };
  std::vector<Case> cases = {
      {"shape",
       [](Runtime& rt, std::vector<float>& d, int r) {
         rt.register_param({"layers.0.weight", {4, r == 2 ? 3 : 4}, DType::f32, Device::cpu(), d.data()});
       },
       "parameter #0: rank 0 registered 'layers.0.weight [4, 4] fp32', rank 2 registered 'layers.0.weight [4, 3] fp32'"},
      {"count",
       [](Runtime& rt, std::vector<float>& d, int r) {
         rt.register_param({"w", {4}, DType::f32, Device::cpu(), d.data()});
         if (r != 1) rt.register_param({"b", {4}, DType::f32, Device::cpu(), d.data() + 4});
       },
       "rank 0 registered 2 parameters, rank 1 registered 1; the first one only one of them has is #1 'b [4] fp32'"},
      {"name",
       [](Runtime& rt, std::vector<float>& d, int r) {
         rt.register_param({r == 1 ? "fc.weight" : "w", {4}, DType::f32, Device::cpu(), d.data()});
       },
       "rank 1 registered 'fc.weight [4] fp32'"},
  };
  for (auto& c : cases) {
    CAPTURE(c.what);
    auto world = InProcessWorld::create(3, 20s);
    std::vector<std::vector<float>> data(3, std::vector<float>(64));
    const auto t0 = std::chrono::steady_clock::now();
    auto errors = test::run_ranks(3, [&](int r) {
      Runtime rt(world->communicator(r));
      c.reg(rt, data[std::size_t(r)], r);
      rt.finalize();
    });
    CHECK(std::chrono::steady_clock::now() - t0 < 10s);
    for (int r = 0; r < 3; ++r) {
      CAPTURE(r);
      REQUIRE(test::is<MismatchError>(errors[std::size_t(r)]));
      CHECK(contains(test::message_of(errors[std::size_t(r)]), c.expect));
    }
  }
}

TEST_CASE("finishing backward with missing gradients (find_unused off): an error naming them, peers fail promptly") {
  auto world = InProcessWorld::create(2, 30s);
  std::vector<TwoParams> models(2);
  const auto t0 = std::chrono::steady_clock::now();
  auto errors = test::run_ranks(2, [&](int r) {
    Runtime rt(world->communicator(r));
    models[std::size_t(r)].add(rt);
    rt.grad_ready(models[std::size_t(r)].b);
    if (r == 1) rt.grad_ready(models[std::size_t(r)].a);
    rt.wait();
  });
  CHECK(std::chrono::steady_clock::now() - t0 < 10s);  // far below the 30 s timeout
  REQUIRE(test::is<UsageError>(errors[0]));
  const auto msg = test::message_of(errors[0]);
  CHECK(contains(msg, "1 parameter(s) got no gradient in iteration 0 on rank 0: layers.0.weight"));
  CHECK(contains(msg, "find_unused_parameters"));
  REQUIRE(errors[1]);  // rank 1 did nothing wrong, but its collective cannot complete
  CHECK(contains(test::message_of(errors[1]), "rank 0 aborted"));
}

TEST_CASE("a rank that stops taking part: the others fail within the timeout, naming the bucket and the rank") {
  auto world = InProcessWorld::create(3, 400ms);
  std::vector<TwoParams> models(3);
  const auto t0 = std::chrono::steady_clock::now();
  auto errors = test::run_ranks(3, [&](int r) {
    Config cfg;
    cfg.timeouts.collective = 400ms;
    Runtime rt(world->communicator(r), cfg);
    models[std::size_t(r)].add(rt);
    rt.finalize();
    if (r == 2) {
      std::this_thread::sleep_for(1500ms);  // stuck in its forward pass
      return;
    }
    rt.grad_ready(models[std::size_t(r)].b);
    rt.grad_ready(models[std::size_t(r)].a);
    rt.wait();
  });
  CHECK(std::chrono::steady_clock::now() - t0 < 5s);
  for (int r = 0; r < 2; ++r) {
    REQUIRE(errors[std::size_t(r)]);
    const auto msg = test::message_of(errors[std::size_t(r)]);
    CAPTURE(msg);
    CHECK(contains(msg, "bucket 0"));
    CHECK(contains(msg, "rank(s) 2"));
  }
  CHECK((test::is<TimeoutError>(errors[0]) || test::is<TimeoutError>(errors[1])));
}

TEST_CASE("a collective that never ends and a backend that never says so: wait() fails at the collective timeout + 5 s, naming the iteration and the bucket, after any number of waits answered") {
  // Note [One deadline in flight]: the one deadline message goes out with the first wait and falls
  // due while the sixth waits; it must be sent again for the sixth's own due, not end the watch.
  auto world = InProcessWorld::create(2, 300ms);
  std::vector<TwoParams> models(2);
  std::vector<std::chrono::steady_clock::time_point> began(2), failed(2);
  auto errors = test::run_ranks(2, [&](int r) {
    Config cfg;
    cfg.timeouts.collective = 300ms;
    Runtime rt(std::make_shared<LosingComm>(world->communicator(r), 5), cfg);
    models[std::size_t(r)].add(rt);
    rt.finalize();
    for (int it = 0;; ++it) {
      if (it == 5) began[std::size_t(r)] = std::chrono::steady_clock::now();
      rt.grad_ready(models[std::size_t(r)].b);
      rt.grad_ready(models[std::size_t(r)].a);
      try {
        rt.wait();
      } catch (...) {
        failed[std::size_t(r)] = std::chrono::steady_clock::now();
        throw;
      }
      REQUIRE(it < 5);
      std::this_thread::sleep_for(300ms);  // the sixth wait begins 1.5 s after the first
    }
  });
  for (int r = 0; r < 2; ++r) {
    REQUIRE(errors[std::size_t(r)]);
    const auto msg = test::message_of(errors[std::size_t(r)]);
    CAPTURE(msg);
    CHECK(test::is<TimeoutError>(errors[std::size_t(r)]));
    CHECK(contains(msg, "rank " + std::to_string(r) + ": iteration 5 did not complete within 300 ms; bucket(s) still pending: 0"));
    const auto waited = failed[std::size_t(r)] - began[std::size_t(r)];
    CHECK(waited >= 5200ms);  // its own due (300 ms + 5 s), not the first wait's
    CHECK(waited < 7500ms);
  }
}

TEST_CASE("misuse of the iteration protocol") {
  auto world = InProcessWorld::create(1);
  Runtime rt(world->communicator(0));
  TwoParams m;
  m.add(rt);
  rt.grad_ready(m.a);
  rt.grad_ready(m.b);
  rt.finish_backward();
  CHECK_THROWS_WITH_AS(rt.grad_ready(m.a), doctest::Contains("after finish_backward(): call wait()"), UsageError);
  CHECK_THROWS_WITH_AS(rt.zero_grad(), doctest::Contains("call wait() first"), UsageError);
  rt.wait();
  CHECK_THROWS_WITH_AS(rt.register_param({"late", {1}, DType::f32, Device::cpu(), m.data.data()}),
                       doctest::Contains("registration is closed"), UsageError);
  CHECK(rt.iteration() == 1);
}

TEST_CASE("registration refuses unusable parameters, naming them") {
  auto world = InProcessWorld::create(1);
  Runtime rt(world->communicator(0));
  std::vector<float> d(8), g(8);
  rt.register_param({"w", {8}, DType::f32, Device::cpu(), d.data()});
  CHECK_THROWS_WITH_AS(rt.register_param({"w", {8}, DType::f32, Device::cpu(), d.data()}),
                       doctest::Contains("'w' is registered twice"), UsageError);
  CHECK_THROWS_WITH_AS(rt.register_param({"x", {8}, DType::f32, Device::cpu(), nullptr}),
                       doctest::Contains("'x' has no data pointer"), UsageError);
  CHECK_THROWS_WITH_AS(rt.register_param({"y", {8}, DType::f32, Device::cpu(), d.data(), g.data()}),
                       doctest::Contains("gradient_as_bucket_view is on"), UsageError);
  CHECK_THROWS_WITH_AS(rt.register_param({"z", {8}, DType::f32, Device::cuda(0), d.data()}),
                       doctest::Contains("'z' lives on cuda:0"), UsageError);
  CHECK_THROWS_WITH_AS(rt.register_param({"n", {-1, 2}, DType::f32, Device::cpu(), d.data()}),
                       doctest::Contains("negative dimension"), UsageError);
  CHECK_THROWS_AS(rt.register_param({"", {1}, DType::f32, Device::cpu(), d.data()}), UsageError);
}

TEST_CASE("nothing registered, nonsense config") {
  auto world = InProcessWorld::create(1);
  {
    Runtime rt(world->communicator(0));
    CHECK_THROWS_WITH_AS(rt.finalize(), doctest::Contains("no parameters registered"), UsageError);
  }
  Config c;
  c.buckets.first_cap_bytes = 0;
  CHECK_THROWS_WITH_AS(Runtime(world->communicator(0), c), doctest::Contains("buckets.first_cap_bytes"), UsageError);
  CHECK_THROWS_AS(Runtime(nullptr), UsageError);
}

TEST_CASE("settings that need the runtime's optimizer, without one: an error at the first backward naming the setting as the user spells it") {
  auto world = InProcessWorld::create(1);
  struct Case {
    const char* field;
    void (*set)(Config&);
  };
  const Case cases[] = {
      {"zero.stage", [](Config& c) { c.zero.stage = ZeroStage::optimizer_state; }},
      {"zero.overlap", [](Config& c) { c.zero.overlap = Overlap::interleaved; }},
      {"zero.clip_grad_norm", [](Config& c) { c.zero.clip_grad_norm = 1.0f; }},
      {"zero.forward_prefetch", [](Config& c) { c.zero.forward_prefetch = true; }},
  };
  for (const auto& k : cases) {
    CAPTURE(k.field);
    for (bool cli : {false, true}) {
      Config c;
      k.set(c);
      if (cli) c.setting_names[k.field] = std::string("--") + k.field;
      Runtime rt(world->communicator(0), c);
      TwoParams m;
      m.add(rt);
      rt.zero_grad();
      const std::string name = cli ? std::string("--") + k.field : std::string("Config::") + k.field;
      CHECK_THROWS_WITH_AS(rt.grad_ready(m.b), doctest::Contains((name + " = ").c_str()), UsageError);
      CHECK_THROWS_WITH_AS(rt.finish_backward(), doctest::Contains("configure_optimizer"), UsageError);
    }
  }
  // With the optimizer configured the same settings train.
  Config c;
  c.zero.stage = ZeroStage::optimizer_state;
  c.zero.overlap = Overlap::interleaved;
  Runtime rt(world->communicator(0), c);
  TwoParams m;
  m.add(rt);
  rt.configure_optimizer(OptimizerConfig{});
  rt.zero_grad();
  rt.grad_ready(m.b);
  rt.grad_ready(m.a);
  CHECK_NOTHROW(rt.wait());
}

TEST_CASE("mlp trainer: a batch that does not split evenly, a bad data file") {
  mlp::TrainOptions o;
  o.sizes = {4, 3};
  o.global_batch = 10;
  o.world_size = 3;
  CHECK_THROWS_WITH_AS(mlp::train(o), doctest::Contains(doctest::Contains("--global-batch 10 is not divisible by the world size 3")), UsageError);
  o.world_size = 2;
  o.data_path = "no-such-file.safetensors";
  CHECK_THROWS_WITH_AS(mlp::train(o), doctest::Contains("no-such-file.safetensors"), Error);
  CHECK_THROWS_AS(mlp::parse_sizes("784,abc,10"), UsageError);
}
