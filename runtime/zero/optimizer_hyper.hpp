// OptimizerConfig as the kernels' hyper-parameters: the one mapping the CPU update
// (apply_update) and the CUDA one (cuda::launch_update) share.
#pragma once

#include "kernels/cpu/optim.hpp"
#include "shardflow/optimizer.hpp"

namespace shardflow {

kernels::SgdHyper sgd_hyper(const OptimizerConfig& h);
kernels::AdamHyper adam_hyper(const OptimizerConfig& h);  // AdamW: decoupled weight decay
// The kind as OptimizerConfig::parse_kind reads it (checkpoint metadata, error messages).
const char* kind_name(OptimizerConfig::Kind k);

}  // namespace shardflow
