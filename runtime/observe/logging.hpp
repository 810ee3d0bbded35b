// Rank-tagged logging. Every line says which rank wrote it; the level comes from
// SHARDFLOW_LOG_LEVEL (trace, debug, info, warn, error, off; default warn).
#pragma once

#include <spdlog/spdlog.h>

#include <memory>

namespace shardflow {

std::shared_ptr<spdlog::logger> rank_logger(int rank);

}  // namespace shardflow
