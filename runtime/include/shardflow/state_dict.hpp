// The training state in memory (Runtime::state_dict(), load_state_dict(), shard_state_dict()).
#pragma once

#include <map>
#include <string>

#include "shardflow/safetensors.hpp"

namespace shardflow {

// The training state in parameter coordinates, as a consolidated checkpoint file holds it:
// parameters under their names, optimizer state as optim.<name>.exp_avg / exp_avg_sq /
// momentum_buffer / master (fp32), and the step count, stage, partition and param groups in the
// metadata (Note [Checkpoints]).
struct StateDict {
  TensorMap tensors;
  std::map<std::string, std::string> metadata;
};

}  // namespace shardflow
