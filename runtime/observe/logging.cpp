#include "runtime/observe/logging.hpp"

#include <spdlog/sinks/stdout_color_sinks.h>

#include <cstdlib>
#include <mutex>
#include <string>

namespace shardflow {
namespace {

spdlog::level::level_enum level_from_env() {
  const char* v = std::getenv("SHARDFLOW_LOG_LEVEL");
  if (!v || !*v) return spdlog::level::warn;
  auto lvl = spdlog::level::from_str(v);
  // from_str answers "off" for words it does not know; a typo should not silence everything.
  if (lvl == spdlog::level::off && std::string(v) != "off") return spdlog::level::warn;
  return lvl;
}

}  // namespace

std::shared_ptr<spdlog::logger> rank_logger(int rank) {
  static std::mutex mu;
  std::lock_guard lock(mu);
  const std::string name = "rank " + std::to_string(rank);
  if (auto existing = spdlog::get(name)) return existing;
  // One stderr sink shared by all ranks of the process, so lines from threads never interleave.
  static auto sink = std::make_shared<spdlog::sinks::stderr_color_sink_mt>();
  auto logger = std::make_shared<spdlog::logger>(name, sink);
  logger->set_pattern("[%H:%M:%S.%e] [shardflow] [%n] [%^%l%$] %v");
  logger->set_level(level_from_env());
  spdlog::register_logger(logger);
  return logger;
}

}  // namespace shardflow
