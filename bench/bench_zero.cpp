// bench_zero: MLP step time per ZeRO stage x overlap mode at world 2 (ranks as threads, in-process
// collectives), with rank 0's memory after the run (pooled stage-2 buffers at their peak), next to
// world 1 with the same global batch.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstdio>

#include "bench/step_stats.hpp"
#include "examples/mlp/train.hpp"

using namespace shardflow;

namespace {

struct Row {
  double median = 0, p90 = 0;
  MemoryReport mem;
};

Row run(const std::vector<int>& sizes, int world, int stage, Overlap overlap, Partition partition, int steps, int batch,
        double bucket_mb) {
  mlp::TrainOptions o;
  o.sizes = sizes;
  o.steps = steps;
  o.global_batch = batch;
  o.world_size = world;
  o.optimizer.kind = OptimizerConfig::Kind::adamw;
  o.optimizer.lr = 1e-3f;
  o.runtime.zero.stage = ZeroStage(stage);
  o.runtime.zero.overlap = overlap;
  o.runtime.zero.partition = partition;
  if (bucket_mb > 0) o.runtime.buckets.first_cap_bytes = o.runtime.buckets.cap_bytes = std::size_t(bucket_mb * 1048576.0);
  o.report_loss = false;
  auto res = mlp::train(o);
  const auto s = bench::step_stats(res.step_ms);
  return {s.median, s.p90, res.memory_end[0]};  // pooled buffers at their peak
}

std::string mib(std::size_t b) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f", double(b) / 1048576.0);
  return buf;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"ZeRO stage x overlap step time at world 2"};
  int steps = 60, batch = 64;
  double bucket_mb = 0;
  app.add_option("--steps", steps)->capture_default_str();
  app.add_option("--bucket-mb", bucket_mb, "first and later bucket cap in MiB (0: shardflow's defaults, 1 / 25)");
  app.add_option("--global-batch", batch)->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  const std::vector<std::pair<const char*, std::vector<int>>> models = {
      {"784,256,256,10", {784, 256, 256, 10}},
      {"8 x Linear(1024,1024)", {1024, 1024, 1024, 1024, 1024, 1024, 1024, 1024, 1024}},
  };
  std::printf("| model | world | stage | overlap | partition | step ms (median / p90) | rank 0 MiB after the run: params / grads (peak) / optimizer state / comm |\n");
  std::printf("|---|---|---|---|---|---|---|\n");
  for (const auto& [name, sizes] : models) {
    const int s = sizes.front() >= 1024 ? std::max(12, steps / 4) : steps;
    auto print = [&](int world, int stage, Overlap ov, Partition p) {
      const Row r = run(sizes, world, stage, ov, p, s, batch, bucket_mb);
      std::printf("| %s | %d | %d | %s | %s | %.3f / %.3f | %s / %s / %s / %s |\n", name, world, stage, overlap_name(ov),
                  stage ? partition_name(p) : "-", r.median, r.p90, mib(r.mem.params).c_str(), mib(r.mem.grads).c_str(),
                  mib(r.mem.optimizer_state).c_str(), mib(r.mem.comm_buffers).c_str());
      std::fflush(stdout);
    };
    print(1, 0, Overlap::none, Partition::flat);
    for (int stage : {0, 1, 2})
      for (auto ov : {Overlap::none, Overlap::after_backward, Overlap::interleaved}) print(2, stage, ov, Partition::flat);
  }
  return 0;
}
