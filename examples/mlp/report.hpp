// What mlp_train and actor_trainer print: the header, a progress line per step, the summary.
#pragma once

#include <functional>
#include <string>

#include "examples/mlp/train.hpp"

namespace shardflow::mlp {

// The progress line (on a terminal redrawn every step, in a log every `every`-th step and the last).
std::function<void(const StepReport&)> step_printer(const TrainOptions& opt, bool quiet, int every);

void print_header(const char* program, const std::string& sizes, const TrainOptions& opt, const std::string& where,
                  const std::string& optimizer, const std::string& overlap, const std::string& partition);

// `launched_rank`: this process's rank under a launcher (its memory line), -1 for ranks as threads.
void print_summary(const TrainResult& res, const TrainOptions& opt, int launched_rank, bool quiet);

}  // namespace shardflow::mlp
