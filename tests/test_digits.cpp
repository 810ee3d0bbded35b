// The demo's promise on real data: scikit-learn's handwritten digits (1,437 training images, 360
// held out, converted at build time), an MLP classifier with softmax cross-entropy trained
// data-parallel, scored on images it never saw.
#include <doctest/doctest.h>

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <string>

#include "examples/mlp/train.hpp"
#include "support/helpers.hpp"

using namespace shardflow;
using namespace std::chrono_literals;

namespace {

const std::string kDigits = SHARDFLOW_DIGITS;

// `make demo`'s settings (Makefile), at `world` ranks.
mlp::TrainOptions demo_run(int world, int steps) {
  mlp::TrainOptions o;
  o.data_path = kDigits;
  o.loss = mlp::Loss::cross_entropy;
  o.sizes = {64, 256, 256, 10};
  o.steps = steps;
  o.global_batch = 64;
  o.world_size = world;
  o.seed = 1;
  o.optimizer.kind = OptimizerConfig::Kind::adamw;
  o.optimizer.lr = 1e-3f;
  o.runtime.zero.stage = ZeroStage::optimizer_state;
  o.runtime.zero.overlap = Overlap::interleaved;
  o.runtime.timeouts.collective = 60s;
  return o;
}

bool have_digits() {
  if (kDigits.empty()) MESSAGE("skipped: this build has no digits file (python3-sklearn missing; `make deps` installs it)");
  return !kDigits.empty();
}

}  // namespace

TEST_CASE("digits, world 2, ZeRO-1: the demo's MLP beats a linear model on the 360 held-out images") {
  if (!have_digits()) return;
  const auto res = mlp::train(demo_run(2, 600));
  REQUIRE(res.heldout_accuracy.has_value());
  CHECK(res.heldout_rows == 360);
  MESSAGE("held-out accuracy " << 100.0 * *res.heldout_accuracy << "%, loss " << res.losses.front() << " -> " << res.losses.back());
  // scikit-learn's LogisticRegression (max_iter 2000) gets 96.1% of this split; chance is 10%.
  CHECK(*res.heldout_accuracy >= 0.965);
  CHECK(res.losses.back() < 0.1f * res.losses.front());
}

TEST_CASE("digits, world 2 (ZeRO-1, interleaved) ends with the same parameters as world 1 on the same global batches") {
  if (!have_digits()) return;
  const auto one = mlp::train(demo_run(1, 100));
  const auto two = mlp::train(demo_run(2, 100));
  REQUIRE(one.params.size() == two.params.size());
  for (const auto& [name, t] : one.params) {
    CAPTURE(name);
    CHECK(test::rel_error(two.params.at(name).to_f32(name), t.to_f32(name)) <= 1e-5);
  }
  CHECK(std::abs(*one.heldout_accuracy - *two.heldout_accuracy) <= 1.0 / 360);  // at most one image apart
}

TEST_CASE("digits: a data file with x_test but no y_test is refused naming the file and the missing tensor") {
  const auto dir = std::filesystem::temp_directory_path() / ("sf_digits_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const std::string path = (dir / "half.safetensors").string();
  TensorMap t;
  std::vector<float> x(4 * 64, 0.5f), y(4 * 10, 0.0f);
  t["x"] = Tensor::from_f32(x.data(), {4, 64});
  t["y"] = Tensor::from_f32(y.data(), {4, 10});
  t["x_test"] = Tensor::from_f32(x.data(), {4, 64});
  save_safetensors(path, t, {});
  auto o = demo_run(1, 1);
  o.data_path = path;
  try {
    mlp::train(o);
    FAIL("expected an error");
  } catch (const Error& e) {
    CHECK(std::string(e.what()).find(path) != std::string::npos);
    CHECK(std::string(e.what()).find("x_test but no y_test") != std::string::npos);
  }
  std::filesystem::remove_all(dir);
}
