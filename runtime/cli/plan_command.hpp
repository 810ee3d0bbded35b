// `shardflow plan`: a run's buckets, owners and per-rank memory from a parameter list, before
// renting the machines (runtime/plans/run_plan.hpp computes it, with the runtime's own code).
#pragma once

#include <CLI/CLI.hpp>

#include <functional>

namespace shardflow::cli {

// Adds the subcommand to `app`; the returned function runs it once parsed (exit status).
std::function<int()> add_plan_command(CLI::App& app);

}  // namespace shardflow::cli
