// Starting one rank's process: the environment it is given on top of the launcher's, its own
// process group (a terminal's Ctrl-C reaches the launcher only), death with the launcher
// (PR_SET_PDEATHSIG), and its stdout/stderr as pipes the launcher relays.
#pragma once

#include <signal.h>
#include <sys/types.h>

#include <map>
#include <string>
#include <vector>

namespace shardflow::launch {

struct RankProcess {
  pid_t pid = -1;
  int out_fd = -1, err_fd = -1;  // read ends
};

// `env` is added to (and overrides) the launcher's environment; `child_mask` is the signal mask
// the program starts with (the launcher's own blocks the signals it reads through a signalfd).
RankProcess start_rank_process(const std::vector<std::string>& command, const std::map<std::string, std::string>& env,
                               const sigset_t& child_mask);

}  // namespace shardflow::launch
