// bench_ddp: MLP step time at world 1 and world 2 (ranks as threads, in-process collectives), the
// same global batch, so the difference is what data parallelism costs or saves on this machine.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstdio>

#include "examples/mlp/model.hpp"
#include "bench/step_stats.hpp"
#include "examples/mlp/train.hpp"

using namespace shardflow;

namespace {

struct Stat {
  double median, p90;
};

Stat run(const std::vector<int>& sizes, int world, int batch, int steps, OptimizerConfig::Kind kind) {
  mlp::TrainOptions o;
  o.sizes = sizes;
  o.steps = steps;
  o.global_batch = batch;
  o.world_size = world;
  o.optimizer.kind = kind;
  o.optimizer.lr = 1e-3f;
  o.report_loss = false;  // no extra scalar all-reduce: time what a trainer pays
  auto res = mlp::train(o);
  const auto s = bench::step_stats(res.step_ms);
  return {s.median, s.p90};
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"MLP step time, world 1 vs world 2"};
  int steps = 60, batch = 64;
  app.add_option("--steps", steps)->capture_default_str();
  app.add_option("--global-batch", batch)->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  const std::vector<std::pair<const char*, std::vector<int>>> models = {
      {"784,256,256,10", {784, 256, 256, 10}},
      {"4 x Linear(256,256)", {256, 256, 256, 256, 256}},
      {"8 x Linear(1024,1024)", {1024, 1024, 1024, 1024, 1024, 1024, 1024, 1024, 1024}},
  };
  std::printf("| model | optimizer | global batch | world 1 (ms, median / p90) | world 2 (ms, median / p90) | world 2 / world 1 |\n");
  std::printf("|---|---|---|---|---|---|\n");
  for (const auto& [name, sizes] : models) {
    for (auto kind : {OptimizerConfig::Kind::sgd, OptimizerConfig::Kind::adam}) {
      const int s = sizes.front() >= 1024 ? std::max(10, steps / 3) : steps;
      const Stat w1 = run(sizes, 1, batch, s, kind);
      const Stat w2 = run(sizes, 2, batch, s, kind);
      std::printf("| %s | %s | %d | %.3f / %.3f | %.3f / %.3f | %.2f |\n", name, kind == OptimizerConfig::Kind::sgd ? "sgd" : "adam",
                  batch, w1.median, w1.p90, w2.median, w2.p90, w2.median / w1.median);
      std::fflush(stdout);
    }
  }
  return 0;
}
