// `shardflow run`: starts this node's ranks with torchrun's environment and supervises them.
//
// Note [Launcher supervision]
// - Every rank is its own process group, so a terminal's Ctrl-C reaches the launcher only, and the
//   launcher decides: SIGINT/SIGTERM/SIGHUP are forwarded to every rank's group once; a second
//   one (or the grace period running out) sends SIGKILL.
// - When a rank exits non-zero or dies of a signal, the others are stopped (SIGTERM, then SIGKILL
//   after the grace period) and the launcher exits non-zero naming that rank and its status —
//   the first failure is the cause, later ones are consequences.
// - The ranks die with the launcher (PR_SET_PDEATHSIG), so a killed launcher leaves no orphans.
// - Node 0's launcher serves the rendezvous store for the whole job (Note [Who runs the store]).
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace shardflow::launch {

struct LaunchSpec {
  int nproc_per_node = 1;
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = -1;    // -1: any free port on one node, 29500 across nodes
  std::string token;       // empty: random on one node; required across nodes
  std::chrono::milliseconds kill_grace = std::chrono::seconds(5);
  bool prefix_output = true;
  std::vector<std::string> command;
};

// Runs the job; returns the launcher's exit status (0 when every rank exited 0).
int run(const LaunchSpec& spec);

}  // namespace shardflow::launch
