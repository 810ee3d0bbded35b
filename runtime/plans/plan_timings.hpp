// A plan's iteration times from what was measured of the model and the link, for its bound
// (Note [The iteration's bound]): `shardflow plan --timings FILE`.
//
// The file (JSON):
//   {"link": {"gbytes_per_s": 0.117, "latency_us": 60},
//    "step_ms_per_mib": 0.4,                    // the optimizer's step per MiB of fp32 it updates
//    "params": {"fc0.weight": {"forward_ms": 0.9, "backward_ms": 1.7}, ...}}
// Each parameter's times are those of the layer it belongs to, given to one of the layer's
// parameters (a bias may have none: 0). Forward runs in registration order, backward in reverse;
// a bucket is needed by forward at its first registered parameter and ready when its last
// gradient is in. A collective costs what the simulated link charges for it (SimLink::cost, Note
// [Simulated link]: a ring); stage 0 reduces with an all-reduce and syncs nothing, stages 1 and 2
// reduce-scatter the gradients and all-gather the updated parameters.
#pragma once

#include <map>
#include <string>

#include "runtime/plans/iteration_bound.hpp"
#include "runtime/plans/run_plan.hpp"

namespace shardflow {

struct PlanTimings {
  struct Layer {
    double forward_ms = 0, backward_ms = 0;
  };
  std::map<std::string, Layer> params;  // by parameter name; a parameter not named takes no time
  double gbytes_per_s = 0;              // the link's rate (1e9 bytes a second)
  double latency_us = 0;                // per hop
  double step_ms_per_mib = 0;
};

// UsageError naming the path, or the field, that cannot be read.
PlanTimings read_plan_timings(const std::string& path);

// UsageError naming a parameter the timings name that the plan has not.
IterationTimes plan_iteration_times(const RunPlan& plan, const PlanTimings& timings);

}  // namespace shardflow
