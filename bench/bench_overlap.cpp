// bench_overlap: how much of the link time each overlap mode hides, over a sweep of link time /
// compute time, on the simulated link with the synthetic trainer (compute sleeps, the link is a
// timer: the figures are the runtime's, not the machine's core sharing).
//
//   efficiency = (T_compute + T_comm - T_iteration) / min(T_compute, T_comm)
//
// T_comm: the link model's time for one iteration's collectives (every bucket's reduction and
// sync). T_compute: the same mode's iteration over an instant link (forward, backward, the
// optimizer steps and the runtime's own overhead). T_iteration: the median iteration over the
// simulated link. 1 = everything hidden, 0 = nothing.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "bench/overlap_bound.hpp"
#include "examples/synthetic/trainer.hpp"
#include "shardflow/sim.hpp"

using namespace shardflow;
using namespace std::chrono;

namespace {

struct Mode {
  std::string name;
  Overlap overlap;
  bool prefetch;
  int lag;  // -1: chosen by the runtime (the default)
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

double iteration_ms(synthetic::Options o) {
  const auto res = synthetic::run(o);
  return res.stats[0].median.iteration_ms;
}

// T_comm per iteration at bandwidth beta: a + b / beta.
double comm_ms(synthetic::Options o, double beta) {
  o.link.gbytes_per_s = beta;
  return double(o.layers) * double((synthetic::reduce_time(o) + synthetic::sync_time(o)).count()) / 1e6;
}

// The bandwidth at which T_comm is `target_ms` (0 when the latency alone is longer than asked).
double beta_for(const synthetic::Options& o, double target_ms) {
  const double a = comm_ms(o, 1e12), b = comm_ms(o, 1.0) - a;
  return target_ms > a ? b / (target_ms - a) : 0.0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Overlap efficiency per mode over a sweep of link time / compute time (sim link, sleeping compute)"};
  synthetic::Options base;
  base.layers = 16;
  base.numel = 65536;
  int fwd_us = 250, bwd_us = 500, world = 2;
  std::vector<double> ratios{0.25, 0.5, 1, 2, 4};
  std::vector<int> stages{1, 2};
  double latency_us = 10;
  std::string json_out, trace_dir;
  int reps = 3, prefetch_early = -1;
  std::size_t in_flight = Config{}.zero.max_buckets_in_flight;
  std::vector<std::string> only;
  app.add_option("--layers", base.layers, "layers = buckets")->capture_default_str();
  app.add_option("--numel", base.numel, "fp32 elements per layer")->capture_default_str();
  app.add_option("--forward-us", fwd_us, "forward time per layer")->capture_default_str();
  app.add_option("--backward-us", bwd_us, "backward time per layer")->capture_default_str();
  app.add_option("--iterations", base.iterations, "iterations per point (median after the first five)")->capture_default_str();
  app.add_option("--world", world, "ranks (threads)")->capture_default_str();
  app.add_option("--latency-us", latency_us, "link latency (alpha)")->capture_default_str();
  app.add_option("--ratios", ratios, "link time / compute time (comma separated)")->delimiter(',')->capture_default_str();
  app.add_option("--stages", stages, "ZeRO stages (comma separated)")->delimiter(',')->capture_default_str();
  app.add_option("--modes", only, "only these modes (comma separated: none, after_backward, interleaved, \"interleaved lag 1\", "
                 "\"interleaved + prefetch\")")->delimiter(',');
  app.add_option("--prefetch-syncs-in-backward", prefetch_early, "Config::zero.prefetch_syncs_in_backward (-1: chosen by the runtime)")
      ->capture_default_str();
  app.add_option("--max-buckets-in-flight", in_flight, "Config::zero.max_buckets_in_flight (stage 2's backpressure)")->capture_default_str();
  app.add_option("--reps", reps, "A B A B repetitions of each mode's baseline and ratios (medians)")->capture_default_str();
  app.add_option("--json", json_out, "write every point as JSON (bench/plot_overlap.py draws it)");
  app.add_option("--trace-dir", trace_dir, "write each point's Chrome trace there (stage<s>_<mode>_<ratio>.json)");
  CLI11_PARSE(app, argc, argv);
  if (!trace_dir.empty()) std::filesystem::create_directories(trace_dir);
  base.iterations = std::max(base.iterations, 8);
  base.world = world;
  base.forward_per_layer = microseconds(fwd_us);
  base.backward_per_layer = microseconds(bwd_us);
  base.optimizer.kind = OptimizerConfig::Kind::adamw;
  base.optimizer.lr = 1e-3f;
  base.runtime.timeouts.collective = seconds(60);

  const std::vector<Mode> modes{{"none", Overlap::none, false, -1},
                                {"after_backward", Overlap::after_backward, false, -1},
                                {"interleaved", Overlap::interleaved, false, -1},
                                {"interleaved lag 0", Overlap::interleaved, false, 0},
                                {"interleaved lag 1", Overlap::interleaved, false, 1},
                                {"interleaved + prefetch", Overlap::interleaved, true, -1}};
  std::printf("bench_overlap: world %d, %d layers x %.2f MiB, compute %.2f ms (forward %d us + backward %d us per layer), AdamW, "
              "latency %.0f us\n",
              world, base.layers, double(base.numel * 4) / 1048576.0, double(base.layers * (fwd_us + bwd_us)) / 1e3, fwd_us, bwd_us,
              latency_us);
  std::ostringstream js;
  js << "{\"world\": " << world << ", \"layers\": " << base.layers << ", \"bytes_per_layer\": " << base.numel * 4
     << ", \"points\": [";
  bool first = true;
  for (int stage : stages) {
    std::printf("\nstage %d     ratio:", stage);
    for (double r : ratios) std::printf("  %6.2f", r);
    std::printf("   (efficiency; T_iteration ms in brackets)\n");
    {
      // The yardstick (bench/overlap_bound.hpp): the best efficiency any runtime reaches on this
      // model with free hops and steps and the best split of syncs, at the same ratios.
      auto o = base;
      o.runtime.zero.stage = ZeroStage(stage);
      o.link.latency_us = latency_us;
      const double t_c = double(base.layers) * double(fwd_us + bwd_us) / 1e3;
      std::printf("  %-22s", "bound (free hops)");
      std::string ks;
      for (double r : ratios) {
        o.link.gbytes_per_s = beta_for(o, r * t_c);
        if (o.link.gbytes_per_s == 0.0) {
          std::printf("  %6s", "-");
          continue;
        }
        bench::BoundModel bm;
        bm.layers = std::size_t(base.layers);
        bm.forward_ms = fwd_us / 1e3;
        bm.backward_ms = bwd_us / 1e3;
        bm.reduce_ms = double(synthetic::reduce_time(o).count()) / 1e6;
        bm.sync_ms = double(synthetic::sync_time(o).count()) / 1e6;
        const auto best = best_early_syncs(bench::bound_times(bm));
        const double t_comm = comm_ms(o, o.link.gbytes_per_s);
        const double eff = (t_c + t_comm - best.iteration_ms) / std::min(t_c, t_comm);
        std::printf("  %6.3f", eff);
        ks += " " + std::to_string(best.early);
        js << (first ? "" : ",") << "\n  {\"stage\": " << stage << ", \"mode\": \"bound\", \"ratio\": " << r
           << ", \"t_compute_ms\": " << t_c << ", \"t_comm_ms\": " << t_comm << ", \"t_iteration_ms\": " << best.iteration_ms
           << ", \"syncs_in_backward\": " << best.early << ", \"efficiency\": " << eff << "}";
        first = false;
      }
      std::printf("   [best K:%s]\n", ks.c_str());
    }
    for (const auto& m : modes) {
      if (!only.empty() && std::find(only.begin(), only.end(), m.name) == only.end()) continue;
      auto o = base;
      o.runtime.zero.stage = ZeroStage(stage);
      o.runtime.zero.overlap = m.overlap;
      o.runtime.zero.forward_prefetch = m.prefetch;
      o.runtime.zero.interleave_lag = m.lag;
      if (stage == 2) o.runtime.zero.max_buckets_in_flight = in_flight;  // stage 2's alone: other stages refuse it
      if (m.prefetch) o.runtime.zero.prefetch_syncs_in_backward = prefetch_early;  // the others refuse it
      // A B A B: the instant-link baseline and every ratio, `reps` times over; medians.
      std::vector<double> computes;
      std::vector<std::vector<double>> iters_ms(ratios.size());
      std::vector<double> betas(ratios.size(), 0.0);
      for (int rep = 0; rep < reps; ++rep) {
        o.link = SimLink{0.0, 1e6, 0};  // instant
        o.runtime.trace.path.clear();
        computes.push_back(iteration_ms(o));
        o.link.latency_us = latency_us;
        const double t_compute_now = median(computes);
        for (std::size_t i = 0; i < ratios.size(); ++i) {
          if (rep == 0) {
            const double target = ratios[i] * t_compute_now;
            betas[i] = beta_for(o, target);  // 0: the latency alone is longer than asked
          }
          if (betas[i] == 0.0) continue;
          o.link.gbytes_per_s = betas[i];
          o.runtime.trace.path.clear();
          if (!trace_dir.empty() && rep == reps - 1) {
            std::string mode = m.name;
            for (auto& c : mode)
              if (c == ' ' || c == '+') c = '_';
            o.runtime.trace.path =
                trace_dir + "/stage" + std::to_string(stage) + "_" + mode + "_" + std::to_string(ratios[i]).substr(0, 4) + ".json";
          }
          iters_ms[i].push_back(iteration_ms(o));
        }
      }
      const double t_compute = median(computes);
      std::printf("  %-22s", m.name.c_str());
      std::string iters;
      for (std::size_t i = 0; i < ratios.size(); ++i) {
        if (betas[i] == 0.0) {
          std::printf("  %6s", "-");
          continue;
        }
        o.link.gbytes_per_s = betas[i];
        const double t_comm = comm_ms(o, betas[i]);
        const double t_iter = median(iters_ms[i]);
        const double eff = (t_compute + t_comm - t_iter) / std::min(t_compute, t_comm);
        std::printf("  %6.3f", eff);
        char buf[32];
        std::snprintf(buf, sizeof buf, " %.1f", t_iter);
        iters += buf;
        js << (first ? "" : ",") << "\n  {\"stage\": " << stage << ", \"mode\": \"" << m.name << "\", \"ratio\": " << ratios[i]
           << ", \"gbytes_per_s\": " << betas[i] << ", \"t_compute_ms\": " << t_compute << ", \"t_comm_ms\": " << t_comm
           << ", \"t_iteration_ms\": " << t_iter << ", \"efficiency\": " << eff << "}";
        first = false;
      }
      std::printf("   [T_compute %.1f;%s]\n", t_compute, iters.c_str());
      std::fflush(stdout);
    }
  }
  js << "\n]}\n";
  if (!json_out.empty()) {
    std::ofstream(json_out) << js.str();
    std::printf("\nwrote %s\n", json_out.c_str());
  }
  return 0;
}
