// bench_zero: MLP step time per ZeRO stage x overlap mode at world 2 (ranks as threads, in-process
// collectives), with rank 0's memory after the run (pooled stage-2 buffers at their peak), next to
// world 1 with the same global batch.
// --memory: per-rank model-state memory against the ZeRO formula at worlds 2 and 4, stages 0-2, the
// three partitions (Note [Memory at the ZeRO formula]), and the process's peak resident memory
// measured by the OS against the formula for all its ranks plus the data set and activations: each
// configuration runs in a child process of its own (the peak never goes down within one).
#include <CLI/CLI.hpp>

#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

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

// One memory configuration, run where it is called (a child process of its own): rank 0's
// model-state memory and the process's peak resident memory, against their formulas.
nlohmann::json memory_point(const std::vector<int>& sizes, int world, int stage, Partition partition, int batch) {
  mlp::TrainOptions o;
  o.sizes = sizes;
  o.steps = 3;  // the first iteration rebuilds the buckets: its state migration is in the peak
  o.global_batch = batch;
  o.world_size = world;
  o.optimizer.kind = OptimizerConfig::Kind::adamw;
  o.optimizer.lr = 1e-3f;
  o.runtime.zero.stage = ZeroStage(stage);
  o.runtime.zero.overlap = Overlap::interleaved;
  o.runtime.zero.partition = partition;
  o.report_loss = false;
  const auto res = mlp::train(o);
  rusage ru{};
  ::getrusage(RUSAGE_SELF, &ru);
  double psi = 0, acts = 0;
  for (std::size_t i = 0; i + 1 < sizes.size(); ++i) psi += double(sizes[i]) * sizes[i + 1] + sizes[i + 1];
  for (int s : sizes) acts += double(batch / world) * s * 4 * 2;  // each layer's output and its gradient
  const double N = world;
  const double formula = 4 * psi + (stage == 2 ? 4 * psi / N : 4 * psi) + (stage >= 1 ? 8 * psi / N : 8 * psi);
  const std::size_t rows = std::max<std::size_t>(16 * std::size_t(batch), 4096);
  const double data = double(rows) * (sizes.front() + sizes.back()) * 4;
  const auto& m = res.memory_end[0];
  const double state = double(m.params + m.grads + m.optimizer_state + m.comm_buffers);
  // Stage 2 may hold two buckets in flight beside its 1/N gradient shard (the default cap, 25 MiB).
  const double in_flight = stage == 2 ? 2.0 * double(Config{}.buckets.cap_bytes) : 0.0;
  const double rss = double(ru.ru_maxrss) * 1024, rss_formula = world * (formula + acts) + data;
  return {{"world", world},
          {"stage", stage},
          {"partition", stage ? partition_name(partition) : "-"},
          {"params", m.params},
          {"grads", m.grads},
          {"optimizer_state", m.optimizer_state},
          {"comm", m.comm_buffers},
          {"formula", formula},
          {"state_over_formula", state / formula},
          {"state_over_formula_in_flight", state / (formula + in_flight)},
          {"peak_rss", rss},
          {"rss_formula", rss_formula},
          {"rss_over_formula", rss / rss_formula},
          {"rss_over_formula_in_flight", rss / (rss_formula + world * in_flight)}};
}

// Runs this program again with --memory-point and reads its one line of JSON.
nlohmann::json memory_child(const char* self, int world, int stage, Partition partition, int batch) {
  char tmp[] = "/tmp/bench_zero_XXXXXX";
  const int fd = ::mkstemp(tmp);
  if (fd < 0) throw std::runtime_error("mkstemp failed");
  const std::string point = std::to_string(world) + "," + std::to_string(stage) + "," + partition_name(partition);
  const std::string b = std::to_string(batch);
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::dup2(fd, 1);
    ::execl(self, self, "--memory-point", point.c_str(), "--global-batch", b.c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  ::close(fd);
  int status = 0;
  ::waitpid(pid, &status, 0);
  std::ifstream in(tmp);
  std::stringstream text;
  text << in.rdbuf();
  std::remove(tmp);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) throw std::runtime_error("bench_zero --memory-point " + point + " failed");
  return nlohmann::json::parse(text.str());
}

std::string mb(double b) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f", b / 1e6);
  return buf;
}

const std::vector<int> kMemoryModel = {1024, 1024, 1024, 1024, 1024, 1024, 1024, 1024, 1024};  // 8 x Linear(1024,1024)

int memory_table(const char* self, int batch, const std::string& json_path) {
  std::printf("8 x Linear(1024,1024), AdamW, global batch %d, ranks as threads of one process, 3 steps\n", batch);
  std::printf("| world | stage | partition | rank 0 MB: params / grads / state / comm | formula MB | state / formula "
              "(+ 2 buckets) | peak RSS MB | RSS formula MB | RSS / formula (+ 2 buckets) |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|\n");
  nlohmann::json all = nlohmann::json::array();
  for (int world : {1, 2, 4})
    for (int stage : {0, 1, 2})
      for (auto p : {Partition::flat, Partition::param, Partition::bucket}) {
        if ((stage == 0 && p != Partition::flat) || (world == 1 && stage > 0)) continue;  // nothing is partitioned
        const auto j = memory_child(self, world, stage, p, batch);
        std::printf("| %d | %d | %s | %s / %s / %s / %s | %s | %.3f (%.3f) | %s | %s | %.3f (%.3f) |\n", world, stage,
                    j["partition"].get<std::string>().c_str(), mb(j["params"]).c_str(), mb(j["grads"]).c_str(),
                    mb(j["optimizer_state"]).c_str(), mb(j["comm"]).c_str(), mb(j["formula"]).c_str(),
                    j["state_over_formula"].get<double>(), j["state_over_formula_in_flight"].get<double>(), mb(j["peak_rss"]).c_str(),
                    mb(j["rss_formula"]).c_str(), j["rss_over_formula"].get<double>(), j["rss_over_formula_in_flight"].get<double>());
        std::fflush(stdout);
        all.push_back(j);
      }
  if (!json_path.empty()) std::ofstream(json_path) << all.dump(1) << "\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"ZeRO stage x overlap step time at world 2"};
  int steps = 60, batch = 64;
  double bucket_mb = 0;
  app.add_option("--steps", steps)->capture_default_str();
  app.add_option("--bucket-mb", bucket_mb, "first and later bucket cap in MiB (0: shardflow's defaults, 1 / 25)");
  app.add_option("--global-batch", batch)->capture_default_str();
  bool memory = false;
  std::string json_path, point;
  app.add_flag("--memory", memory, "model-state memory and peak RSS against the ZeRO formula (worlds 2, 4; stages 0-2; partitions)");
  app.add_option("--json", json_path, "with --memory: every point as JSON (bench/plot_zero_memory.py draws it)");
  app.add_option("--memory-point", point, "world,stage,partition: one --memory configuration, as JSON (run by --memory)");
  CLI11_PARSE(app, argc, argv);
  if (!point.empty()) {
    int world = 0, stage = 0;
    char part[16] = {};
    if (std::sscanf(point.c_str(), "%d,%d,%15s", &world, &stage, part) != 3) {
      std::fprintf(stderr, "--memory-point: expected world,stage,partition, got '%s'\n", point.c_str());
      return 2;
    }
    Partition p = Partition::flat;
    for (auto q : {Partition::flat, Partition::param, Partition::bucket})
      if (std::string(partition_name(q)) == part) p = q;
    std::printf("%s\n", memory_point(kMemoryModel, world, stage, p, batch).dump().c_str());
    return 0;
  }
  if (memory) return memory_table(argv[0], batch, json_path);
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
