// The libtorch client (shardflow/libtorch.hpp) as a trainer author uses it: a torch::nn::Module
// wrapped in one call, ranks as threads here (the example runs them as processes under the
// launcher: tests/libtorch/torch_digits_ddp.py).
// libtorch first: it brings glog, whose CHECK macros would replace doctest's.
#include "shardflow/libtorch.hpp"
#undef CHECK
#undef CHECK_EQ
#undef CHECK_NE
#undef CHECK_LT
#undef CHECK_LE
#undef CHECK_GT
#undef CHECK_GE

#include <doctest/doctest.h>

#include <unistd.h>

#include <filesystem>

#include "gpt/model.hpp"  // examples/gpt: the tied-embedding transformer gpt_train trains
#include "support/helpers.hpp"

using namespace shardflow;
using namespace std::chrono_literals;

namespace {

// With `norm`, a BatchNorm between the layers: its batch statistics are each rank's own (DDP's
// too, without SyncBatchNorm), so only the buffer scenario uses it.
struct TinyImpl : torch::nn::Module {
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::BatchNorm1d norm{nullptr};
  explicit TinyImpl(bool with_norm = false) {
    fc1 = register_module("fc1", torch::nn::Linear(6, 12));
    if (with_norm) norm = register_module("norm", torch::nn::BatchNorm1d(12));
    fc2 = register_module("fc2", torch::nn::Linear(12, 3));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = fc1(x);
    return fc2(torch::relu(norm ? norm(h) : h));
  }
};
TORCH_MODULE(Tiny);

// libtorch's generator is global: models and data are drawn on the test's thread, never on the
// ranks' threads at once. Rank r's model starts from seed r (apart: the constructor's broadcast
// must make them one model).
std::vector<Tiny> models(int world, bool with_norm = false) {
  std::vector<Tiny> out;
  for (int r = 0; r < world; ++r) {
    torch::manual_seed(r);
    out.emplace_back(with_norm);
  }
  return out;
}

// 8 rows per global batch; rank r of `world` takes its contiguous share of each.
struct Batches {
  std::vector<torch::Tensor> x, y;
  Batches(int steps) {
    torch::manual_seed(1000);
    for (int s = 0; s < steps; ++s) x.push_back(torch::randn({8, 6})), y.push_back(torch::randn({8, 3}));
  }
  std::pair<torch::Tensor, torch::Tensor> at(int step, int rank, int world) const {
    const int local = 8 / world;
    return {x[std::size_t(step)].narrow(0, rank * local, local), y[std::size_t(step)].narrow(0, rank * local, local)};
  }
};

using Setup = std::function<void(libtorch::Options&)>;

// Several small buckets, AdamW at 1e-2, a 30 s timeout: what every scenario trains with.
libtorch::Options small_buckets_adamw() {
  libtorch::Options o;
  o.config.timeouts.collective = 30s;
  o.config.buckets.first_cap_bytes = 64;  // several buckets
  o.config.buckets.cap_bytes = 256;
  o.optimizer = OptimizerConfig{};
  o.optimizer->kind = OptimizerConfig::Kind::adamw;
  o.optimizer->lr = 1e-2f;
  return o;
}

// `steps` steps at `world` ranks (threads); every rank starts from its own seed's weights (the
// constructor makes them rank 0's). Returns rank 0's parameters and buffers. `by_name`: the
// adapter gets the parameters as named tensors ("model." + each name) instead of the module.
std::map<std::string, torch::Tensor> train(int world, int steps, const Setup& setup = {}, bool by_name = false) {
  auto comms = InProcessWorld::create(world, 30s);
  auto nets = models(world);
  const Batches data(steps);
  std::map<std::string, torch::Tensor> out;
  test::require_all_ok(test::run_ranks(world, [&](int r) {
    auto& net = nets[std::size_t(r)];
    auto o = small_buckets_adamw();
    if (setup) setup(o);
    std::vector<libtorch::NamedTensor> named;
    if (by_name)
      for (auto& item : net->named_parameters()) named.emplace_back("model." + item.key(), item.value());
    auto ddp_ptr = by_name ? std::make_unique<libtorch::DataParallel>(named, std::vector<libtorch::NamedTensor>{}, comms->communicator(r), o)
                           : std::make_unique<libtorch::DataParallel>(*net, comms->communicator(r), o);
    auto& ddp = *ddp_ptr;
    if (by_name) CHECK_NOTHROW(ddp.runtime().param("model.fc1.weight"));
    for (int s = 0; s < steps; ++s) {
      ddp.zero_grad();
      auto [x, y] = data.at(s, r, world);
      if (o.config.zero.forward_prefetch) ddp.wait_for(*net);  // forward reads every parameter
      ddp.backward(torch::mse_loss(net->forward(x), y));
    }
    ddp.runtime().wait_all_params();
    if (r == 0)
      for (auto& item : net->named_parameters()) out[item.key()] = item.value().detach().clone();
  }));
  return out;
}

void check_close(const std::map<std::string, torch::Tensor>& got, const std::map<std::string, torch::Tensor>& want, double tol) {
  REQUIRE(got.size() == want.size());
  for (const auto& [name, t] : want) {
    CAPTURE(name);
    const double err = (got.at(name) - t).norm().item<double>() / std::max(1e-30, t.norm().item<double>());
    CHECK(err <= tol);
  }
}

}  // namespace

TEST_CASE("libtorch: world 2 and 4, ZeRO 0/1/2, every overlap mode, ranks initialised apart -> world 1's parameters") {
  const auto want = train(1, 6);
  for (int world : {2, 4}) {
    for (auto stage : {ZeroStage::ddp, ZeroStage::optimizer_state, ZeroStage::gradients})
      for (auto overlap : {Overlap::none, Overlap::after_backward, Overlap::interleaved}) {
        CAPTURE(world);
        CAPTURE(int(stage));
        CAPTURE(int(overlap));
        check_close(train(world, 6, [&](libtorch::Options& o) {
                      o.config.zero.stage = stage;
                      o.config.zero.overlap = overlap;
                    }), want, 1e-5);
      }
  }
}

TEST_CASE("libtorch: each .grad() is its parameter's slot in the bucket, filled by autograd's in-place add") {
  auto comms = InProcessWorld::create(1, 30s);
  Tiny net = models(1)[0];
  libtorch::DataParallel ddp(*net, comms->communicator(0));
  auto [x, y] = Batches(1).at(0, 0, 1);
  for (int s = 0; s < 3; ++s) {  // the buckets are rebuilt after the first: the views follow
    ddp.zero_grad();
    for (auto& item : net->named_parameters()) {
      CAPTURE(item.key());
      CHECK(item.value().grad().data_ptr() == ddp.runtime().grad(ddp.runtime().param(item.key())));
    }
    auto ref = net->fc2->weight.grad().clone();
    ddp.backward(torch::mse_loss(net->forward(x), y));
    CHECK(net->fc2->weight.grad().data_ptr() == ddp.runtime().grad(ddp.runtime().param("fc2.weight")));
    CHECK(net->fc2->weight.grad().abs().sum().item<float>() > 0.0f);
  }
}

TEST_CASE("libtorch: a .grad() set to none behind the adapter's back is copied into the bucket once, and equal results") {
  const auto want = train(2, 4);
  const auto got = [] {
    auto comms = InProcessWorld::create(2, 30s);
    auto nets = models(2);
    const Batches data(4);
    std::map<std::string, torch::Tensor> out;
    test::require_all_ok(test::run_ranks(2, [&](int r) {
      auto& net = nets[std::size_t(r)];
      libtorch::Options o;
      o.config.buckets.first_cap_bytes = 64;
      o.config.buckets.cap_bytes = 256;
      o.optimizer = OptimizerConfig{};
      o.optimizer->kind = OptimizerConfig::Kind::adamw;
      o.optimizer->lr = 1e-2f;
      libtorch::DataParallel ddp(*net, comms->communicator(r), o);
      for (int s = 0; s < 4; ++s) {
        ddp.zero_grad();
        net->zero_grad(/*set_to_none=*/true);  // what torch::optim's zero_grad(true) would do
        auto [x, y] = data.at(s, r, 2);
        ddp.backward(torch::mse_loss(net->forward(x), y));
        for (auto& item : net->named_parameters())
          if (item.value().grad().data_ptr() != ddp.runtime().grad(ddp.runtime().param(item.key())))
            throw Error("the view of " + item.key() + " was not restored");
      }
      ddp.runtime().wait_all_params();
      if (r == 0)
        for (auto& item : net->named_parameters()) out[item.key()] = item.value().detach().clone();
    }));
    return out;
  }();
  check_close(got, want, 1e-6);
}

TEST_CASE("libtorch: gradient_as_bucket_view off, forward prefetch, no_sync accumulation -> the same parameters") {
  const auto want = train(1, 6);
  check_close(train(2, 6, [](libtorch::Options& o) { o.config.buckets.gradient_as_bucket_view = false; }), want, 1e-5);
  check_close(train(2, 6, [](libtorch::Options& o) {
                o.config.zero.stage = ZeroStage::gradients;
                o.config.zero.forward_prefetch = true;
              }), want, 1e-5);
}

TEST_CASE("libtorch: forward prefetch, a forward that reads a parameter without wait_for() -> an error naming it, not last step's values") {
  auto comms = InProcessWorld::create(2, 30s);
  auto nets = models(2);
  const Batches data(1);
  std::vector<std::string> errors(2);
  test::run_ranks(2, [&](int r) {
    auto& net = nets[std::size_t(r)];
    libtorch::Options o;
    o.config.timeouts.collective = 5s;
    o.config.zero.stage = ZeroStage::optimizer_state;
    o.config.zero.forward_prefetch = true;
    o.optimizer = OptimizerConfig{};
    libtorch::DataParallel ddp(*net, comms->communicator(r), o);
    ddp.zero_grad();
    ddp.wait_for(*net->fc2);  // fc1 forgotten
    auto [x, y] = data.at(0, r, 2);
    try {
      ddp.backward(torch::mse_loss(net->forward(x), y));
    } catch (const UsageError& e) {
      errors[std::size_t(r)] = e.what();
    }
  });
  for (const auto& e : errors) {
    CAPTURE(e);
    CHECK(e.find("'fc1.") != std::string::npos);
    CHECK(e.find("wait_for()") != std::string::npos);
  }
}

TEST_CASE("libtorch: buffers (BatchNorm's running statistics) are rank 0's on every rank after each backward") {
  auto comms = InProcessWorld::create(2, 30s);
  std::vector<torch::Tensor> means(2);
  auto nets = models(2, /*with_norm=*/true);
  const Batches data(3);
  test::require_all_ok(test::run_ranks(2, [&](int r) {
    auto& net = nets[std::size_t(r)];
    libtorch::DataParallel ddp(*net, comms->communicator(r));
    for (int s = 0; s < 3; ++s) {
      ddp.zero_grad();
      auto [x, y] = data.at(s, r, 2);  // each rank's forward updates the statistics with its own rows
      ddp.backward(torch::mse_loss(net->forward(x), y));
    }
    means[std::size_t(r)] = net->norm->running_mean.clone();
  }));
  CHECK(torch::equal(means[0], means[1]));
  CHECK(means[0].abs().sum().item<float>() > 0.0f);
}

TEST_CASE("libtorch: frozen parameters stay as they are — bad parameters are refused naming them") {
  auto comms = InProcessWorld::create(1, 30s);
  {
    Tiny net = models(1)[0];
    net->fc1->weight.set_requires_grad(false);
    const auto before = net->fc1->weight.clone();
    libtorch::Options o;
    o.optimizer = OptimizerConfig{};
    libtorch::DataParallel ddp(*net, comms->communicator(0), o);
    ddp.zero_grad();
    const auto fc2_before = net->fc2->weight.clone();
    auto [x, y] = Batches(1).at(0, 0, 1);
    ddp.backward(torch::mse_loss(net->forward(x), y));
    CHECK(torch::equal(net->fc1->weight, before));
    CHECK_FALSE(torch::equal(net->fc2->weight, fc2_before));
  }
  struct Odd : torch::nn::Module {
    Odd(torch::Tensor t) { register_parameter("odd", std::move(t)); }
  };
  Odd transposed(torch::randn({3, 4}).t());
  CHECK_THROWS_WITH_AS(libtorch::DataParallel(transposed, comms->communicator(0)), doctest::Contains("'odd' is not contiguous"), UsageError);
  Odd doubles(torch::randn({3}, torch::kDouble));
  CHECK_THROWS_WITH_AS(libtorch::DataParallel(doubles, comms->communicator(0)), doctest::Contains("parameter 'odd' is Double"), UsageError);
}

TEST_CASE("libtorch GPT: the tied embedding is one parameter in one bucket, ready once, reduced once, its gradient both uses' sum") {
  // examples/gpt's transformer: wte is read at the start of forward and again by the head at its
  // end, so autograd adds two gradients into it, the last at the very end of backward. It must be
  // registered once, marked ready once (after both adds: the runtime refuses a second mark) and
  // reduced with its bucket once, and the averaged gradient must hold both uses.
  constexpr int world = 2, rows = 4, T = 8;
  gpt::GptConfig cfg;
  cfg.vocab = 11;
  cfg.context = T;
  cfg.layers = 1;
  cfg.d_model = 16;
  cfg.heads = 2;
  torch::manual_seed(4);
  std::vector<gpt::Gpt> nets;
  for (int r = 0; r < world; ++r) nets.emplace_back(cfg);  // rank 1's weights become rank 0's
  const auto x = torch::randint(cfg.vocab, {rows, T}, torch::kLong), y = torch::randint(cfg.vocab, {rows, T}, torch::kLong);
  auto loss_of = [&](gpt::Gpt& net, const torch::Tensor& xs, const torch::Tensor& ys) {
    return torch::nn::functional::cross_entropy(net->forward(xs).view({-1, cfg.vocab}), ys.view({-1}));
  };
  // The reference: one copy of the model on the whole batch (the mean of the two halves' losses).
  gpt::Gpt ref(cfg);
  {
    torch::NoGradGuard no_grad;
    auto src = nets[0]->named_parameters();
    for (auto& item : ref->named_parameters()) item.value().copy_(src[item.key()]);
  }
  loss_of(ref, x, y).backward();
  const auto want = ref->wte->weight.grad().clone();

  auto comms = InProcessWorld::create(world, 30s);
  std::vector<torch::Tensor> got(world);
  test::require_all_ok(test::run_ranks(world, [&](int r) {
    auto& net = nets[std::size_t(r)];
    libtorch::Options o;
    o.config.timeouts.collective = 30s;
    o.config.buckets.first_cap_bytes = 1024;  // several buckets
    o.config.buckets.cap_bytes = 4096;
    libtorch::DataParallel ddp(*net, comms->communicator(r), o);
    Runtime& rt = ddp.runtime();
    CHECK(rt.num_params() == net->named_parameters().size());
    int holding = 0;
    for (const auto& b : rt.buckets()) holding += int(std::count(b.params.begin(), b.params.end(), "wte.weight"));
    CHECK(holding == 1);
    for (int step = 0; step < 2; ++step) {  // the second after the buckets' rebuild in arrival order
      const auto before = rt.collective_log().size();
      ddp.zero_grad();
      ddp.backward(loss_of(net, x.narrow(0, r * rows / world, rows / world), y.narrow(0, r * rows / world, rows / world)));
      // One reduction per bucket, wte's bucket's among them once (the first iteration also
      // broadcasts the rebuilt order).
      const auto log = rt.collective_log();
      std::map<std::string, int> reduced;
      for (auto i = before; i < log.size(); ++i)
        if (log[i].rfind("allreduce bucket ", 0) == 0) ++reduced[log[i].substr(0, log[i].find(' ', 17))];
      const auto buckets = rt.buckets();
      CHECK(reduced.size() == buckets.size());
      for (const auto& b : buckets)
        if (std::count(b.params.begin(), b.params.end(), "wte.weight")) CHECK(reduced["allreduce bucket " + std::to_string(b.index)] == 1);
    }
    got[std::size_t(r)] = net->wte->weight.grad().clone();
  }));
  for (int r = 0; r < world; ++r) {
    CAPTURE(r);
    CHECK((got[std::size_t(r)] - want).norm().item<double>() <= 1e-5 * want.norm().item<double>());
  }
}

TEST_CASE("libtorch: a model given as named tensors (dotted names, as a Python nn.Module's named_parameters() gives them) trains bit for bit as the same module does, known by those names") {
  const int world = 2, steps = 6;
  const auto want = train(world, steps);  // through the torch::nn::Module constructor
  check_close(train(world, steps, {}, /*by_name=*/true), want, 0.0);
  // An undefined tensor is refused, naming it.
  auto one = InProcessWorld::create(1, 30s);
  CHECK_THROWS_WITH_AS(libtorch::DataParallel({{"model.w", torch::Tensor()}}, {}, one->communicator(0)),
                       doctest::Contains("parameter 'model.w' is an undefined tensor"), UsageError);
}

// Note [Recovering in place], for a module: every rank loses the job's first communicator after
// its 8th backward (the reductions under way, after_backward() never called) and goes on over a
// second one, as `shardflow run --recovery in-place` has it do. The .grad() views must move to the
// new runtime's buckets (autograd adding into the old ones would write freed memory: ASan's
// suite watches) and the run must end where an uninterrupted one ends, bit for bit.
TEST_CASE("libtorch: world 3, ZeRO 0/1/2 and forward prefetch: every rank loses its communicator after the 8th backward and recovers onto a new one "
          "-> step 6's snapshot reloaded, .grad() views the new buckets, and the parameters end bit for bit where an uninterrupted run ends") {
  constexpr int N = 3, kSteps = 10, kLost = 7;
  auto run = [&](int stage, bool prefetch, bool lose) {
    const auto snaps = std::filesystem::temp_directory_path() /
                       ("shardflow_libtorch_recover_" + std::to_string(::getpid()) + "_" + std::to_string(stage) + (lose ? "_lost" : "_ref"));
    std::filesystem::remove_all(snaps);
    auto first = InProcessWorld::create(N, 30s), second = InProcessWorld::create(N, 30s);
    auto nets = models(N);
    const Batches data(kSteps);
    std::map<std::string, torch::Tensor> out;
    std::vector<std::uint64_t> resumed(N, 0);
    test::require_all_ok(test::run_ranks(N, [&](int r) {
      auto& net = nets[std::size_t(r)];
      auto o = small_buckets_adamw();
      o.config.zero.stage = ZeroStage(stage);
      o.config.zero.forward_prefetch = prefetch;
      o.config.snapshot.dir = snaps.string();
      o.config.snapshot.every = 1;
      libtorch::DataParallel ddp(*net, first->communicator(r), o);
      bool lost = !lose;
      for (int s = int(ddp.runtime().resumed_step()); s < kSteps; ++s) {
        try {
          ddp.zero_grad();
          auto [x, y] = data.at(s, r, N);
          if (prefetch) ddp.wait_for(*net);
          ddp.before_backward();
          torch::mse_loss(net->forward(x), y).backward();
          if (!lost && s == kLost) {
            lost = true;
            throw CommError("rank " + std::to_string(r) + ": the test loses the job's communicator after backward " + std::to_string(s + 1));
          }
          ddp.after_backward();
        } catch (const CommError&) {
          if (!lose) throw;
          resumed[std::size_t(r)] = ddp.recover(second->communicator(r));
          s = int(resumed[std::size_t(r)]) - 1;
          // Every .grad() already views its slot in the new runtime's buckets (stage 2 binds none;
          // with prefetch before_backward() binds them).
          for (auto& item : net->named_parameters()) {
            CAPTURE(item.key());
            if (stage == 2 || prefetch) CHECK(!item.value().grad().defined());
            else CHECK(item.value().grad().data_ptr() == ddp.runtime().grad(ddp.runtime().param(item.key())));
          }
        }
      }
      ddp.runtime().wait_all_params();
      if (r == 0)
        for (auto& item : net->named_parameters()) out[item.key()] = item.value().detach().clone();
    }));
    if (lose)
      for (int r = 0; r < N; ++r) CHECK(resumed[std::size_t(r)] == kLost - 1);  // step 7's snapshot completes at the end of step 8: never
    std::filesystem::remove_all(snaps);
    return out;
  };
  for (const auto& [stage, prefetch] : {std::pair{0, false}, std::pair{1, false}, std::pair{2, false}, std::pair{1, true}}) {
    CAPTURE(stage);
    CAPTURE(prefetch);
    const auto want = run(stage, prefetch, false), got = run(stage, prefetch, true);
    REQUIRE(got.size() == want.size());
    for (const auto& [name, t] : want) {
      CAPTURE(name);
      CHECK(torch::equal(got.at(name), t));
    }
  }
}
