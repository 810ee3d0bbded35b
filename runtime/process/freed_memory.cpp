#include "runtime/process/freed_memory.hpp"

#include <cstdlib>
#include <cstring>
#include <mutex>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include "shardflow/errors.hpp"

namespace shardflow {
namespace {
constexpr int kMmapThreshold = 32 << 20;  // glibc's own ceiling for it: blocks below come from the heap
constexpr int kTrimThreshold = 0x7fffffff;  // mallopt takes an int: 2 GiB of free top stays
}  // namespace

FreedMemoryChoice choose_freed_memory(bool configured, const char* switch_env, const char* glibc_tunables,
                                      const char* mmap_threshold_env, const char* trim_threshold_env) {
  if (switch_env && std::strcmp(switch_env, "0") != 0 && std::strcmp(switch_env, "1") != 0)
    throw UsageError("SHARDFLOW_KEEP_FREED_MEMORY must be 0 (leave malloc as it is) or 1 (keep freed memory for reuse), got '" +
                     std::string(switch_env) + "'");
  if (switch_env && std::strcmp(switch_env, "0") == 0) return {false, "SHARDFLOW_KEEP_FREED_MEMORY=0"};
  if (!configured) return {false, "Config::keep_freed_memory = false"};
  const std::string tunables = glibc_tunables ? glibc_tunables : "";
  for (const char* own : {"glibc.malloc.mmap_threshold", "glibc.malloc.trim_threshold"})
    if (tunables.find(own) != std::string::npos) return {false, std::string("GLIBC_TUNABLES sets ") + own};
  if (mmap_threshold_env) return {false, "MALLOC_MMAP_THRESHOLD_ is set"};
  if (trim_threshold_env) return {false, "MALLOC_TRIM_THRESHOLD_ is set"};
#if defined(__GLIBC__)
  return {true, "glibc malloc's mmap threshold 32 MiB, trim threshold 2 GiB"};
#else
  return {false, "not glibc's malloc"};
#endif
}

FreedMemoryChoice choose_freed_memory_from_env(bool configured) {
  return choose_freed_memory(configured, std::getenv("SHARDFLOW_KEEP_FREED_MEMORY"), std::getenv("GLIBC_TUNABLES"),
                             std::getenv("MALLOC_MMAP_THRESHOLD_"), std::getenv("MALLOC_TRIM_THRESHOLD_"));
}

const FreedMemoryChoice& keep_freed_memory(bool configured) {
  static FreedMemoryChoice choice;
  static bool first_configured = true;
  static std::once_flag once;
  std::call_once(once, [&] {
    first_configured = configured;
    choice = choose_freed_memory_from_env(configured);
#if defined(__GLIBC__)
    // Each setting fixes its value (glibc stops raising the mmap threshold on its own).
    if (choice.keep && (mallopt(M_MMAP_THRESHOLD, kMmapThreshold) != 1 || mallopt(M_TRIM_THRESHOLD, kTrimThreshold) != 1))
      choice = {false, "glibc's mallopt refused the thresholds"};
#endif
  });
  // malloc's settings are the process's: a later Runtime cannot have its own, and must not
  // believe it has.
  if (configured != first_configured)
    throw UsageError(std::string("Config::keep_freed_memory = ") + (configured ? "true" : "false") +
                     " cannot be honoured: it is process-wide, and this process's first Runtime asked for " +
                     (first_configured ? "true" : "false") + " (freed memory " + (choice.keep ? "kept for reuse" : "left to malloc") +
                     ": " + choice.why + ")");
  return choice;
}

}  // namespace shardflow
