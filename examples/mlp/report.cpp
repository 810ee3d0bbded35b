#include "examples/mlp/report.hpp"

#include <sys/resource.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <algorithm>
#include <cstdlib>
#include <memory>

#include "kernels/cpu/linear.hpp"

namespace shardflow::mlp {

void parse_model_flags(TrainOptions& opt, const std::string& sizes, const std::string& loss, const std::string& optimizer, int zero_stage) {
  opt.sizes = parse_sizes(sizes);
  opt.loss = parse_loss(loss);
  opt.optimizer.kind = OptimizerConfig::parse_kind(optimizer);
  if (zero_stage < 0 || zero_stage > 2) throw UsageError("--zero-stage must be 0, 1 or 2, got " + std::to_string(zero_stage));
  opt.runtime.zero.stage = ZeroStage(zero_stage);
}

void adopt_launch(const LaunchEnv& env, TrainOptions& opt, bool world_size_given, const std::string& backend) {
  if (backend == "in-process")
    throw UsageError("--backend in-process runs the ranks as threads of one process; under a launcher use shm or gloo");
  if (world_size_given && opt.world_size != env.world_size)
    throw UsageError("--world-size " + std::to_string(opt.world_size) + " but the launcher started " + std::to_string(env.world_size) +
                     " rank(s)");
  opt.world_size = env.world_size;
  // The launcher shares the cores out (OMP_NUM_THREADS); OpenBLAS reads it at load time, but say
  // it once more in case another library set it first.
  if (const char* omp = std::getenv("OMP_NUM_THREADS")) kernels::set_blas_threads(std::max(1, std::atoi(omp)));
}

void check_unlaunched_backend(const char* program, const std::string& backend) {
  if (backend != "auto" && backend != "in-process")
    throw UsageError("--backend " + backend + " needs one process per rank: start " + program +
                     " with `shardflow run --nproc-per-node N --`");
}

std::function<void(const StepReport&)> step_printer(const TrainOptions& opt, bool quiet, int every) {
  const bool tty = isatty(STDOUT_FILENO);
  const int width = int(std::to_string(opt.steps).size());
  // Exponential moving average of the step time: samples/s and the ETA.
  auto smoothed_ms = std::make_shared<double>(0.0);
  return [=](const StepReport& r) {
    *smoothed_ms = r.step == 0 ? r.step_ms : 0.9 * *smoothed_ms + 0.1 * r.step_ms;
    const bool last = r.step + 1 == opt.steps;
    if (quiet || (!tty && !last && (r.step + 1) % every != 0)) return;
    const double sps = *smoothed_ms > 0 ? opt.global_batch * double(opt.accumulate) * 1000.0 / *smoothed_ms : 0;
    const double eta_s = *smoothed_ms * double(opt.steps - r.step - 1) / 1000.0;
    std::printf("%sstep %*d/%d  loss %.6f  %7.3f ms (exposed %6.3f ms)  %9.0f samples/s  ETA %6.1f s%s", tty ? "\r" : "", width,
                r.step + 1, opt.steps, r.loss, r.step_ms, r.stats.exposed_ms, sps, eta_s, tty ? "  " : "\n");
    std::fflush(stdout);
  };
}

void print_header(const char* program, const std::string& sizes, const TrainOptions& opt, const std::string& where,
                  const std::string& optimizer, const std::string& overlap, const std::string& partition) {
  std::printf("%s: sizes %s, world %d (%s), global batch %d x %d, %s lr %g, %s loss, %d steps, zero stage %d, overlap %s, partition %s\n",
              program, sizes.c_str(), opt.world_size, where.c_str(), opt.global_batch, opt.accumulate, optimizer.c_str(),
              double(opt.optimizer.lr), loss_name(opt.loss), opt.steps, int(opt.runtime.zero.stage), overlap.c_str(), partition.c_str());
}

void print_summary(const TrainResult& res, const TrainOptions& opt, int launched_rank, bool quiet) {
  if (isatty(STDOUT_FILENO) && !quiet) std::printf("\n");
  double total = 0;
  for (double ms : res.step_ms) total += ms;
  const double mean = res.step_ms.empty() ? 0 : total / double(res.step_ms.size());
  std::printf("done: %d steps, loss %.6f -> %.6f, mean step %.3f ms, %zu bucket(s)\n", res.step_ms.empty() ? opt.steps : int(res.step_ms.size()),
              res.losses.empty() ? 0.0 : double(res.losses.front()), res.losses.empty() ? 0.0 : double(res.losses.back()), mean,
              res.buckets.size());
  for (std::size_t r = 0; r < res.memory.size(); ++r)
    std::printf("  memory rank %zu: start %s | end %s\n", launched_rank >= 0 ? std::size_t(launched_rank) : r, res.memory[r].str().c_str(),
                res.memory_end[r].str().c_str());
  {
    rusage ru{};
    ::getrusage(RUSAGE_SELF, &ru);  // ru_maxrss: KiB on Linux
    std::printf("  peak resident memory of this process: %.1f MB\n", double(ru.ru_maxrss) * 1024 / 1e6);
  }
  for (const auto& b : res.buckets)
    std::printf("  bucket %u: %.2f MiB, %zu param(s): %s ... %s\n", b.index, double(b.bytes) / 1048576.0, b.params.size(),
                b.params.front().c_str(), b.params.back().c_str());
  if (res.heldout_accuracy)
    std::printf("held-out accuracy %.1f%% (%zu rows never trained on)\n", 100.0 * *res.heldout_accuracy, res.heldout_rows);
  if (opt.save_path) std::printf("saved %s\n", opt.save_path->c_str());
  const auto& m = res.stats.median;
  std::printf("runtime (rank 0, median): iteration %.3f ms, compute %.3f ms, exposed %.3f ms, link %.3f ms (hidden %.3f ms), "
              "optimizer %.3f ms, %zu/%zu bucket(s) done inside backward\n",
              m.iteration_ms, m.compute_ms, m.exposed_ms, m.link_ms, m.hidden_ms, m.optimizer_ms, m.buckets_done_in_backward, m.buckets);
}

void write_stats_json(const TrainResult& res, const std::string& path) {
  std::ofstream out(path);
  out << res.stats.to_json() << "\n";
  if (!out) throw Error("--stats-json '" + path + "': write failed");
  std::printf("stats %s\n", path.c_str());
}

}  // namespace shardflow::mlp
