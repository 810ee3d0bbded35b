// `shardflow plan`: a run's buckets, owners and per-rank memory from a parameter list, before
// renting the machines (runtime/plans/run_plan.hpp computes it, with the runtime's own code).
// `shardflow doctor` takes the same flags to size what a job needs from /dev/shm.
#pragma once

#include <CLI/CLI.hpp>

#include <cstddef>
#include <functional>
#include <optional>
#include <string>

#include "runtime/plans/run_plan.hpp"

namespace shardflow::cli {

struct PlanArgs {
  std::string params;
  int world = 0;
  std::optional<double> first_cap_mb;  // unset: BucketConfig's default
  std::optional<double> last_cap_mb;   // unset: BucketConfig's default; 0: no small last bucket
  std::optional<double> cap_mb;        // unset: the default cap (25 MiB, shrunk for small models)
  std::optional<std::size_t> min_buckets;
  int stage = 0;
  std::string partition = "flat";
  std::string param_dtype;  // empty: each parameter's own
  std::string optimizer = "adam";
  float momentum = 0.0f;
  std::string comm_dtype = "fp32";
  std::size_t in_flight = 0;
  std::size_t fuse_syncs_bytes = PlanSettings{}.fuse_syncs_bytes;  // Note [Fused syncs]
  int hosts = 1;
  std::string backend = "auto";
  int redundancy = 1;     // Note [Mirrored shards]
  int twin_distance = 0;
};

// The model and run flags (--params, --world-size, the caps, ...) on `cmd`; `required`: whether
// --params and --world-size must be given.
void add_plan_options(CLI::App& cmd, PlanArgs& args, bool required);
// The plan those flags describe (UsageError naming the flag that is wrong).
RunPlan make_plan(const PlanArgs& args);

// Adds the subcommand to `app`; the returned function runs it once parsed (exit status).
std::function<int()> add_plan_command(CLI::App& app);

}  // namespace shardflow::cli
