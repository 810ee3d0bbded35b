// What mlp_train and actor_trainer share: joining a launched job, and what they print (the
// header, a progress line per step, the summary).
#pragma once

#include <functional>
#include <string>

#include "examples/mlp/train.hpp"
#include "shardflow/launch.hpp"

namespace shardflow::mlp {

// --sizes, --loss, --optimizer and --zero-stage into `opt` (UsageError naming the flag).
void parse_model_flags(TrainOptions& opt, const std::string& sizes, const std::string& loss, const std::string& optimizer, int zero_stage);

// Under a launcher (env.launched()): the world size is the launcher's (--world-size, when given,
// must agree) and OpenBLAS takes the launcher's share of the cores. UsageErrors name the flag.
void adopt_launch(const LaunchEnv& env, TrainOptions& opt, bool world_size_given, const std::string& backend);
// Not under a launcher: --backend must be one that runs ranks as threads of this process.
void check_unlaunched_backend(const char* program, const std::string& backend);

// The progress line (on a terminal redrawn every step, in a log every `every`-th step and the last).
std::function<void(const StepReport&)> step_printer(const TrainOptions& opt, bool quiet, int every);

void print_header(const char* program, const std::string& sizes, const TrainOptions& opt, const std::string& where,
                  const std::string& optimizer, const std::string& overlap, const std::string& partition);

// `launched_rank`: this process's rank under a launcher (its memory line), -1 for ranks as threads.
void print_summary(const TrainResult& res, const TrainOptions& opt, int launched_rank, bool quiet);
// --stats-json: rank 0's Runtime::stats() as JSON, and a line saying where.
void write_stats_json(const TrainResult& res, const std::string& path);

}  // namespace shardflow::mlp
