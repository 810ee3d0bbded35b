// bench_overhead: the runtime's own cost per iteration. No compute, an instant link: 1,000
// parameters of 256 floats in 100 buckets, every gradient reported, wait(); the median iteration
// is what the runtime's bookkeeping and message hops cost (goal: <= 0.5 ms). Also given per bucket
// and per hop (a ZeRO-1 bucket makes 7 hops: grad_ready -> bucket actor -> comm stream ->
// backend -> bucket actor -> shard -> comm stream (sync) -> backend -> shard -> iteration; stage 0
// with the runtime's optimizer 4, plain DDP 4).
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <thread>

#include "runtime/comm/stream_worker.hpp"
#include "shardflow/shardflow.hpp"
#include "shardflow/sim.hpp"

using namespace shardflow;
using Clock = std::chrono::steady_clock;

namespace {

// An instant link with nobody on the other end: rank r of a world of n whose collectives complete
// at once on its comm stream without moving data. Two of these in one process are two independent
// ranks, so what is measured is one rank's runtime (bookkeeping, actors, hops, the shard's work on
// its pieces), not a backend's rendezvous with its peers.
class InstantComm final : public Communicator {
 public:
  InstantComm(int rank, int world) : rank_(rank), world_(world), stream_([](const CollectiveOp&) {}) {}
  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  std::string backend_name() const override { return "instant"; }
  bool supports(Device d) const override { return d.kind == Device::Kind::cpu; }
  void submit(CollectiveOp op, CollectiveDone done) override { stream_.push(std::move(op), std::move(done)); }
  void abort(const std::string&) override {}

 private:
  const int rank_, world_;
  StreamWorker stream_;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// Median iteration (ms) of rank 0 after `warmup` iterations.
double run(int world, int stage, bool optimizer, Overlap overlap, int lag, int params, int per_bucket, int iterations,
           const std::string& backend, bool fuse) {
  const std::size_t numel = 256;
  auto w = backend == "sim" ? make_sim_world(world, SimLink{0.0, 1e6, 0}) : InProcessWorld::create(world);
  std::vector<std::shared_ptr<Communicator>> comms;
  for (int r = 0; r < world; ++r)
    comms.push_back(backend == "instant" ? std::make_shared<InstantComm>(r, world) : w->communicator(r));
  std::vector<double> ms;
  std::vector<std::thread> ranks;
  for (int r = 0; r < world; ++r)
    ranks.emplace_back([&, r] {
      Config cfg;
      cfg.zero.interleave_lag = lag;
      cfg.zero.stage = ZeroStage(stage);
      cfg.zero.overlap = overlap;
      if (!fuse) cfg.zero.fuse_syncs_bytes = 0;  // Note [Fused syncs]: every bucket syncs alone
      cfg.buckets.rebuild = false;
      cfg.buckets.first_cap_bytes = cfg.buckets.cap_bytes = numel * 4 * std::size_t(per_bucket);
      std::vector<float> p(std::size_t(params) * numel, 0.5f);
      Runtime rt(comms[std::size_t(r)], cfg);
      std::vector<Param> h;
      for (int i = 0; i < params; ++i)
        h.push_back(rt.register_param({"p" + std::to_string(i), {std::int64_t(numel)}, DType::f32, Device::cpu(), p.data() + std::size_t(i) * numel}));
      if (optimizer) {
        OptimizerConfig sgd;  // the cheapest step: what is measured is the runtime, not the optimizer
        sgd.lr = 0.0f;
        rt.configure_optimizer(sgd);
      }
      for (int it = 0; it < iterations; ++it) {
        const auto t0 = Clock::now();
        rt.zero_grad();
        for (int i = params; i-- > 0;) rt.grad_ready(h[std::size_t(i)]);
        rt.wait();
        if (r == 0) ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
      }
    });
  for (auto& t : ranks) t.join();
  ms.erase(ms.begin(), ms.begin() + std::min<std::ptrdiff_t>(10, std::ptrdiff_t(ms.size()) - 1));
  return median(ms);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"The runtime's own cost per iteration: no compute, an instant link, 1,000 parameters in 100 buckets"};
  int params = 1000, per_bucket = 10, iterations = 200, reps = 3;
  app.add_option("--params", params)->capture_default_str();
  app.add_option("--params-per-bucket", per_bucket)->capture_default_str();
  app.add_option("--iterations", iterations)->capture_default_str();
  app.add_option("--reps", reps, "repetitions of the whole table (A B A B), medians")->capture_default_str();
  std::string only;
  app.add_option("--only", only, "run only the rows whose name contains this text (a trailing $: ends with it), for profiling one configuration");
  CLI11_PARSE(app, argc, argv);
  const int buckets = (params + per_bucket - 1) / per_bucket;
  struct Row {
    const char* name;
    int world, stage;
    bool optimizer;
    Overlap overlap;
    int lag;  // -1: chosen by the runtime (the default)
    std::string backend;
    int hops;  // a bucket's, its sync alone
    bool fuse = true;  // Config::zero.fuse_syncs_bytes at its default, or 0
  };
  // "instant": the runtime alone (the goal's figure); "in-process" / "sim": with the in-process
  // backend's rendezvous between the two rank threads (about 40 us a collective on this machine).
  const std::vector<Row> rows{{"DDP, instant link", 2, 0, false, Overlap::none, -1, "instant", 4},
                              {"ZeRO-0 interleaved, instant link", 2, 0, true, Overlap::interleaved, -1, "instant", 4},
                              {"ZeRO-1 interleaved, instant link", 2, 1, true, Overlap::interleaved, -1, "instant", 7},
                              {"ZeRO-1 interleaved, instant link, syncs alone", 2, 1, true, Overlap::interleaved, -1, "instant", 7, false},
                              {"ZeRO-1 interleaved lag 0, instant link", 2, 1, true, Overlap::interleaved, 0, "instant", 7},
                              {"ZeRO-1 interleaved lag 1, instant link", 2, 1, true, Overlap::interleaved, 1, "instant", 7},
                              {"ZeRO-1 none, instant link", 2, 1, true, Overlap::none, -1, "instant", 7},
                              {"ZeRO-1 none, instant link, syncs alone", 2, 1, true, Overlap::none, -1, "instant", 7, false},
                              {"ZeRO-2 interleaved, instant link", 2, 2, true, Overlap::interleaved, -1, "instant", 7},
                              {"ZeRO-2 interleaved, instant link, syncs alone", 2, 2, true, Overlap::interleaved, -1, "instant", 7, false},
                              {"world 1, DDP, in-process", 1, 0, false, Overlap::none, -1, "in-process", 4},
                              {"world 2, DDP, in-process", 2, 0, false, Overlap::none, -1, "in-process", 4},
                              {"world 2, ZeRO-1 interleaved, in-process", 2, 1, true, Overlap::interleaved, -1, "in-process", 7},
                              {"world 2, ZeRO-1 interleaved, in-process, syncs alone", 2, 1, true, Overlap::interleaved, -1, "in-process", 7, false},
                              {"world 2, ZeRO-1 interleaved, sim (instant)", 2, 1, true, Overlap::interleaved, -1, "sim", 7}};
  std::vector<std::vector<double>> t(rows.size());
  // A trailing '$' anchors the text at the end of the name ("... instant link$": not its "syncs alone" row).
  auto chosen = [&](std::size_t i) {
    const std::string name = rows[i].name;
    if (!only.empty() && only.back() == '$')
      return name.size() >= only.size() - 1 && name.compare(name.size() - (only.size() - 1), only.size() - 1, only, 0, only.size() - 1) == 0;
    return only.empty() || name.find(only) != std::string::npos;
  };
  for (int rep = 0; rep < reps; ++rep)
    for (std::size_t i = 0; i < rows.size(); ++i)
      if (chosen(i)) t[i].push_back(run(rows[i].world, rows[i].stage, rows[i].optimizer, rows[i].overlap, rows[i].lag, params, per_bucket, iterations, rows[i].backend,
                               rows[i].fuse));
  std::printf("bench_overhead: %d params x 1 KiB in %d buckets, no compute, instant link, %d iterations x %d reps (medians)\n", params,
              buckets, iterations, reps);
  std::printf("  %-52s %12s %14s %16s\n", "", "ms / iter", "us / bucket", "us / bucket-hop");
  for (std::size_t i = 0; i < rows.size(); ++i) {
    if (!chosen(i)) continue;
    const double m = median(t[i]);
    std::printf("  %-52s %12.3f %14.2f %16.2f\n", rows[i].name, m, m * 1e3 / buckets, m * 1e3 / buckets / rows[i].hops);
  }
  return 0;
}
