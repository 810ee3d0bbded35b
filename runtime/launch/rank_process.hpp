// Starting one rank's process: the environment it is given on top of the launcher's, its own
// process group (a terminal's Ctrl-C reaches the launcher only), death with the launcher
// (PR_SET_PDEATHSIG), and its stdout/stderr as pipes the launcher relays.
#pragma once

#include <signal.h>
#include <sys/types.h>

#include <map>
#include <string>
#include <vector>

#include "runtime/bootstrap/net_address.hpp"
#include "runtime/launch/launch_spec.hpp"

namespace shardflow::launch {

struct RankProcess {
  pid_t pid = -1;
  int out_fd = -1, err_fd = -1;  // read ends
};

// `env` is added to (and overrides) the launcher's environment; `child_mask` is the signal mask
// the program starts with (the launcher's own blocks the signals it reads through a signalfd).
RankProcess start_rank_process(const std::vector<std::string>& command, const std::map<std::string, std::string>& env,
                               const sigset_t& child_mask);

// Who a rank is and where it finds the job's store.
struct RankIds {
  int global = 0, local = 0, world = 1;
  std::string store_host;
  int store_port = 0;
  std::string token;
  int restart = 0;  // the worker group's generation (Note [Restarting the worker group])
  int max_restarts = 0;
  std::string snapshot_memory;  // Note [Snapshots in memory]; empty: none offered
  std::string snapshot_mirror;  // Note [Snapshots on the other host]: the node holding the copies; empty: none
  int node = 0;                 // GROUP_RANK: this node's place in the generation (Note [Shrinking the world])
  int torch_port = 0;           // MASTER_PORT: for torch.distributed's own env:// store (0: store_port + 1)
  int recovery_round = 0;       // Note [Recovering in place]: the round of the generation this process starts in
};

// The torchrun-style environment of one rank (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, ...), the
// launcher's socket choice as the variables the rank reads, and a BLAS thread hint.
std::map<std::string, std::string> rank_environment(const LaunchSpec& spec, const net::SocketChoice& socket, const RankIds& ids);

// A waitpid status in words ("exited with status 3", "was killed by signal 9 (SIGKILL)"), and the
// launcher's exit code for it (a failure is never 0; a signal is 128 + its number, as shells do).
std::string describe_status(int status);
int exit_code_of(int status);

}  // namespace shardflow::launch
