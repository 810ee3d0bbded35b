// bench_projection: a GPT-2-124M-shaped model (bench/gpt2_124m.params) at simulated worlds of 8 to
// 1024 ranks over two links, per overlap mode: iteration and exposed time. Two real ranks run
// (threads over the sim link) on the model scaled down by --scale (every tensor 1/scale of its
// elements, bucket caps likewise); the link charges every byte --scale times and the time of an
// N-rank ring (SimLink::sim_world, charge_factor), so its time is the full model's. Compute is a
// stated model: forward and backward per iteration (defaults 5 + 10 ms: 124M parameters x 8,192
// tokens per rank at about 400 TFLOP/s), shared out over the parameters by size.
#include <CLI/CLI.hpp>

#include <cmath>
#include <cstdio>

#include "examples/synthetic/trainer.hpp"
#include "shardflow/sim.hpp"

using namespace shardflow;
using namespace std::chrono;

int main(int argc, char** argv) {
  CLI::App app{"Projection: GPT-2-124M-shaped parameters at simulated worlds 8-1024, per overlap mode"};
  std::string params = SHARDFLOW_BENCH_DIR "/gpt2_124m.params";
  double scale = 64, forward_ms = 5, backward_ms = 10;
  std::vector<int> worlds{8, 64, 256, 1024};
  int iterations = 10, stage = 1;
  app.add_option("--params", params, "parameter list: 'name numel' per line")->capture_default_str();
  app.add_option("--scale", scale, "real buffers are 1/scale of the model; the link charges scale x")->capture_default_str();
  app.add_option("--forward-ms", forward_ms, "modelled forward time per iteration")->capture_default_str();
  app.add_option("--backward-ms", backward_ms, "modelled backward time per iteration")->capture_default_str();
  app.add_option("--worlds", worlds, "simulated worlds (comma separated)")->delimiter(',')->capture_default_str();
  app.add_option("--iterations", iterations, "iterations per point (median after the first five)")->capture_default_str();
  app.add_option("--stage", stage, "ZeRO stage")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  if (scale < 1) throw UsageError("--scale must be >= 1");

  synthetic::Options base;
  std::size_t full = 0;
  for (auto [name, n] : synthetic::load_param_list(params)) {
    full += n;
    base.params.emplace_back(name, std::max<std::size_t>(1, std::size_t(std::ceil(double(n) / scale))));
  }
  base.world = 2;
  base.iterations = std::max(iterations, 8);
  base.forward_total = duration_cast<microseconds>(duration<double, std::milli>(forward_ms));
  base.backward_total = duration_cast<microseconds>(duration<double, std::milli>(backward_ms));
  base.runtime.zero.stage = ZeroStage(stage);
  base.runtime.buckets.first_cap_bytes = std::size_t(double(1 << 20) / scale);
  base.runtime.buckets.cap_bytes = std::size_t(25.0 * double(1 << 20) / scale);
  base.runtime.timeouts.collective = seconds(120);
  base.optimizer.kind = OptimizerConfig::Kind::adamw;
  base.optimizer.lr = 1e-4f;

  struct Link {
    const char* name;
    double alpha_us, gbytes_per_s;
  };
  const Link links[] = {{"NVLink-like (3 us, 200 GB/s)", 3, 200}, {"100 Gb/s-like (20 us, 12.5 GB/s)", 20, 12.5}};
  struct Mode {
    const char* name;
    Overlap overlap;
    bool prefetch;
  };
  const Mode modes[] = {{"none", Overlap::none, false},
                        {"after_backward", Overlap::after_backward, false},
                        {"interleaved", Overlap::interleaved, false},
                        {"interleaved + prefetch", Overlap::interleaved, true}};
  std::printf("bench_projection: %zu parameters (%.1f MB fp32) in %zu tensors, ZeRO-%d, AdamW, compute %.1f + %.1f ms per iteration, "
              "real buffers 1/%.0f\n",
              full, double(full) * 4 / 1e6, base.params.size(), stage, forward_ms, backward_ms, scale);
  for (const auto& l : links) {
    std::printf("\n%s: iteration / exposed / link ms\n  %-24s", l.name, "world:");
    for (int w : worlds) std::printf("  %22d", w);
    std::printf("\n");
    for (const auto& m : modes) {
      std::printf("  %-24s", m.name);
      for (int w : worlds) {
        auto o = base;
        o.link = SimLink{l.alpha_us, l.gbytes_per_s, w, scale};
        o.runtime.zero.overlap = m.overlap;
        o.runtime.zero.forward_prefetch = m.prefetch;
        const auto res = synthetic::run(o);
        const auto& s = res.stats[0].median;
        std::printf("  %7.1f / %5.1f / %6.1f", s.iteration_ms, s.exposed_ms, s.link_ms);
        std::fflush(stdout);
      }
      std::printf("\n");
    }
  }
  std::printf("\nrank 0, medians after the first five iterations; exposed: the trainer held up by the runtime; link: the comm\n"
              "stream busy (the ring's latency term 2(N-1) alpha per bucket dominates at large N)\n");
  return 0;
}
