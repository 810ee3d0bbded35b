#include "runtime/cli/plan_command.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>

#include "runtime/plans/iteration_bound.hpp"
#include "runtime/plans/param_list.hpp"
#include "runtime/plans/plan_timings.hpp"
#include "runtime/plans/run_plan.hpp"
#include "shardflow/errors.hpp"

namespace shardflow::cli {
namespace {

std::size_t mb_to_bytes(double mb, const char* flag) {
  if (!(mb > 0.0) || !std::isfinite(mb)) throw UsageError(std::string(flag) + " must be a positive number of MiB, got " + std::to_string(mb));
  return std::size_t(std::llround(mb * 1048576.0));
}

// The plan's output with its bound (Note [The iteration's bound]) added.
std::string with_bound(std::string out, const RunPlan& plan, const PlanTimings& timings, bool json) {
  const auto b = iteration_bound(plan_iteration_times(plan, timings));
  if (json) {
    auto j = nlohmann::json::parse(out);
    j["bound"] = {{"iteration_ms", b.iteration_ms}, {"compute_ms", b.compute_ms}, {"link_ms", b.link_ms}, {"chain_ms", b.chain_ms},
                  {"binding", b.binding}};
    return j.dump(2) + "\n";
  }
  char line[512];
  std::snprintf(line, sizeof line,
                "iteration bound: %.3f ms (set by %s): compute %.3f ms (backward + forward), link %.3f ms (every reduction "
                "and sync), best overlap efficiency %.2f\n",
                b.iteration_ms, b.binding.c_str(), b.compute_ms, b.link_ms,
                std::min(b.compute_ms, b.link_ms) > 0 ? (b.compute_ms + b.link_ms - b.iteration_ms) / std::min(b.compute_ms, b.link_ms) : 1.0);
  return out + line;
}

}  // namespace

RunPlan make_plan(const PlanArgs& a) {
  if (a.world < 1) throw UsageError("--world-size must be >= 1, got " + std::to_string(a.world));
  if (a.stage < 0 || a.stage > 2) throw UsageError("--zero-stage must be 0, 1 or 2, got " + std::to_string(a.stage));
  if (a.in_flight == 1) throw UsageError("--max-buckets-in-flight must be 0 (the default) or >= 2");
  PlanSettings s;
  s.world = a.world;
  s.stage = ZeroStage(a.stage);
  s.partition = parse_partition(a.partition);
  if (a.first_cap_mb) s.first_cap_bytes = mb_to_bytes(*a.first_cap_mb, "--first-bucket-cap-mb");
  if (a.cap_mb) s.cap_bytes = mb_to_bytes(*a.cap_mb, "--bucket-cap-mb");
  if (a.last_cap_mb) s.last_cap_bytes = *a.last_cap_mb == 0.0 ? 0 : mb_to_bytes(*a.last_cap_mb, "--last-bucket-cap-mb");
  s.min_buckets = a.min_buckets;
  s.max_buckets_in_flight = a.in_flight;
  s.fuse_syncs_bytes = a.fuse_syncs_bytes;
  s.comm_dtype = parse_dtype(a.comm_dtype);
  if (a.hosts < 1 || a.world % a.hosts != 0)
    throw UsageError("--hosts " + std::to_string(a.hosts) + " must divide --world-size " + std::to_string(a.world) +
                     " (every host runs as many ranks)");
  if (a.backend != "auto" && a.backend != "gloo" && a.backend != "hierarchical")
    throw UsageError("--backend must be auto, gloo or hierarchical, got '" + a.backend + "'");
  s.hosts = a.hosts;
  s.two_levels = a.backend != "gloo";
  s.redundancy = a.redundancy;
  s.twin_distance = a.twin_distance;  // auto: two levels on several hosts of several ranks, as init_process_group picks
  if (a.optimizer == "sgd")
    s.state_slots = a.momentum != 0.0f ? 1 : 0;
  else if (a.optimizer == "adam" || a.optimizer == "adamw")
    s.state_slots = 2;
  else
    throw UsageError("--optimizer must be sgd, adam or adamw, got '" + a.optimizer + "'");
  auto params = read_param_list(a.params);
  if (!a.param_dtype.empty()) {
    const DType d = parse_dtype(a.param_dtype);
    for (auto& p : params) p.dtype = d;
  }
  auto plan = make_run_plan(std::move(params), s);
  check_in_flight_honoured(plan.caps, a.in_flight, a.stage, "--max-buckets-in-flight");
  return plan;
}

void add_plan_options(CLI::App& cmd, PlanArgs& args, bool required) {
  auto* params = cmd.add_option("--params", args.params,
                                "the model's parameters in registration order: a JSON list [{\"name\", \"shape\", \"dtype\"}, ...] or a "
                                ".safetensors file (its header)");
  auto* world = cmd.add_option("--world-size", args.world, "data-parallel ranks");
  if (required) params->required(), world->required();
  cmd.add_option("--first-bucket-cap-mb", args.first_cap_mb, "first bucket cap, MiB (default 1)");
  cmd.add_option("--last-bucket-cap-mb", args.last_cap_mb,
                 "the last gradients' bucket (the layers forward needs first), MiB (default 1; 0: none, PyTorch's layout)");
  cmd.add_option("--bucket-cap-mb", args.cap_mb,
                 "bucket cap, MiB, used as given (default: 25, shrunk so that a small model gets --min-buckets buckets)");
  cmd.add_option("--min-buckets", args.min_buckets,
                 "shrink the cap so that the model gets at least this many buckets (default with the default cap: 4, or "
                 "16 at ZeRO stage 1 or 2 over more than one rank; none with --bucket-cap-mb; 0: never)")
      ->check(CLI::Range(0, 1 << 20));
  cmd.add_option("--zero-stage", args.stage, "0, 1 or 2")->capture_default_str();
  cmd.add_option("--partition", args.partition, "param | bucket | flat")->capture_default_str();
  cmd.add_option("--param-dtype", args.param_dtype, "f32 | bf16 | f16 for every parameter (default: as listed)");
  cmd.add_option("--optimizer", args.optimizer, "sgd | adam | adamw")->capture_default_str();
  cmd.add_option("--momentum", args.momentum, "SGD momentum (non-zero: one state word per element)")->capture_default_str();
  cmd.add_option("--comm-dtype", args.comm_dtype, "fp32 | bf16 | fp16: what fp32 gradients travel as")->capture_default_str();
  cmd.add_option("--max-buckets-in-flight", args.in_flight, "stage 2's gradient buckets in flight (0: the memory budget's)")
      ->capture_default_str();
  cmd.add_option("--fuse-syncs-bytes", args.fuse_syncs_bytes,
                 "stages 1-2, flat: consecutive parameter syncs fused into one all-gather up to this many bytes, their buffer in the "
                 "comm buffers (0: none)")
      ->capture_default_str();
  cmd.add_option("--hosts", args.hosts, "hosts the ranks span (as many ranks each): shows what crosses the network per step")
      ->capture_default_str();
  cmd.add_option("--backend", args.backend, "auto | gloo | hierarchical: between hosts, the flat ring or two levels (auto: two levels)")
      ->capture_default_str();
  cmd.add_option("--redundancy", args.redundancy,
                 "2: each rank keeps a twin of another rank's shard (Config::zero.redundancy): what it costs in memory and bytes")
      ->capture_default_str();
  cmd.add_option("--twin-distance", args.twin_distance, "the twin's rank distance (0: a host's ranks with --hosts > 1, else 1)")
      ->capture_default_str();
}

std::function<int()> add_plan_command(CLI::App& app) {
  struct State {
    PlanArgs args;
    bool json = false;
    std::string timings;
  };
  auto st = std::make_shared<State>();
  auto* plan = app.add_subcommand("plan", "show a run's buckets, owners and per-rank memory before running it");
  add_plan_options(*plan, st->args, true);
  plan->add_flag("--json", st->json, "machine-readable: {\"buckets\": [...], \"ranks\": [...]}");
  plan->add_option("--timings", st->timings,
                   "measured times (JSON: the link's rate and latency, each parameter's layer's forward and backward ms, the "
                   "step's ms per MiB): adds the shortest iteration any schedule of this plan could reach");
  return [plan, st]() -> int {
    if (!plan->parsed()) return -1;
    try {
      const RunPlan p = make_plan(st->args);
      std::string out = st->json ? p.to_json() : p.describe();
      if (!st->timings.empty()) out = with_bound(std::move(out), p, read_plan_timings(st->timings), st->json);
      std::fwrite(out.data(), 1, out.size(), stdout);
      return 0;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "shardflow plan: error: %s\n", e.what());
      return 2;
    }
  };
}

}  // namespace shardflow::cli
