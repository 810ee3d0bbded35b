// A trainer whose forward and backward take a set time without using a core (they sleep), over the
// simulated link: how much communication the runtime hides is then a property of the runtime
// alone, not of how the machine's cores are shared. Each layer is one parameter in a bucket of its
// own; backward reports the layers last to first. The overlap tests and bench_overlap drive it.
#pragma once

#include <chrono>
#include <cstddef>
#include <string>
#include <vector>

#include "shardflow/shardflow.hpp"
#include "shardflow/sim.hpp"

namespace shardflow::synthetic {

struct Options {
  int world = 2;
  int layers = 4;
  std::size_t numel = 65536;  // fp32 elements per layer (= per bucket)
  std::chrono::microseconds forward_per_layer{500};
  std::chrono::microseconds backward_per_layer{2000};
  int iterations = 12;
  Config runtime;  // stage, overlap, prefetch, clipping, trace; bucket caps and rebuild are set here
  OptimizerConfig optimizer;
  SimLink link;
  // A model of its own instead of `layers` x `numel`: parameters in forward order (name, numel),
  // bucketed by runtime's caps; forward and backward take forward_total / backward_total, shared
  // out in proportion to each parameter's size (a transformer's FLOPs follow its parameters).
  std::vector<std::pair<std::string, std::size_t>> params;
  std::chrono::microseconds forward_total{0}, backward_total{0};
  // After every wait(), a loss all-reduce of the trainer's own (Runtime::collective), read after
  // the next wait(), as a trainer that logs every step does.
  bool log_loss = false;
  // The last rank's first backward: each layer this much later, as a rank that starts late (its
  // peers' first reductions wait for it on the link).
  std::chrono::microseconds first_backward_late{0};
};

// Parameters from a text file: one "name numel" per line, '#' comments (bench/gpt2_124m.params).
std::vector<std::pair<std::string, std::size_t>> load_param_list(const std::string& path);

struct Result {
  std::vector<RuntimeStats> stats;           // per rank
  std::vector<std::vector<float>> params;    // per rank, every layer end to end
};

Result run(Options opt);

// The model's time on the link for one bucket's reduction and for its sync (stage >= 1, flat).
std::chrono::nanoseconds reduce_time(const Options& opt);
std::chrono::nanoseconds sync_time(const Options& opt);

}  // namespace shardflow::synthetic
