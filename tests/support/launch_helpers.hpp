// What the multi-process suites share: the launcher and trainer binaries, a scratch directory, the
// small MLP job they all run, and free ports for stores the test itself points nodes at.
#pragma once

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "free_port.hpp"

namespace shardflow::test {

inline const std::string kLauncher = SHARDFLOW_LAUNCHER_PATH;
inline const std::string kTrainer = MLP_TRAIN_PATH;

inline std::string scratch(const std::string& suite, const std::string& name) {
  const auto dir = std::filesystem::temp_directory_path() / ("shardflow_" + suite + "_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  return (dir / name).string();
}

// The MLP flags every scenario shares: small, a few steps, AdamW (state that must be sharded right).
// Its buckets are pinned (no small last bucket either): the faults count collectives per step.
inline std::vector<std::string> mlp_args(int zero_stage) {
  return {"--sizes", "24,40,40,6", "--steps", "6", "--global-batch", "12", "--optimizer", "adamw", "--lr", "0.01",
          "--zero-stage", std::to_string(zero_stage), "--overlap", zero_stage ? "interleaved" : "none", "--first-bucket-mb",
          "0.004", "--bucket-mb", "0.004", "--last-bucket-mb", "0", "--quiet", "--timeout", "20"};
}

// Replaces the value that follows `flag` in `args`.
inline void set_flag(std::vector<std::string>& args, const std::string& flag, const std::string& value) {
  for (std::size_t i = 0; i + 1 < args.size(); ++i)
    if (args[i] == flag) {
      args[i + 1] = value;
      return;
    }
  args.push_back(flag);
  args.push_back(value);
}

inline std::map<std::string, std::string> no_launch_env() {
  // The test itself may run under a launcher: the children must not inherit its ranks.
  return {{"RANK", ""}, {"WORLD_SIZE", ""}, {"SLURM_PROCID", ""}, {"OMPI_COMM_WORLD_RANK", ""}};
}

// The MLP job over Gloo (a ZeRO-1 interleaved trainer), with `extra` flags appended.
inline std::vector<std::string> gloo_trainer(const std::vector<std::string>& extra) {
  auto args = mlp_args(1);
  args.insert(args.begin(), kTrainer);
  for (auto a : {"--backend", "gloo"}) args.push_back(a);
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

// The same job training until something stops it, printing a progress line per step ("3/1000000"):
// its own timeout is long, so that what stops it is what the scenario is about.
inline std::vector<std::string> endless_gloo_trainer() {
  auto args = gloo_trainer({"--log-every", "1"});
  set_flag(args, "--steps", "1000000");
  set_flag(args, "--timeout", "120");
  args.erase(std::find(args.begin(), args.end(), "--quiet"));
  return args;
}

// One BLAS thread per rank whatever the ranks per node: bits compared across layouts must not
// depend on how many ranks share a host.
inline std::map<std::string, std::string> one_blas_thread_env() {
  auto e = no_launch_env();
  e["OMP_NUM_THREADS"] = "1";
  return e;
}

}  // namespace shardflow::test
