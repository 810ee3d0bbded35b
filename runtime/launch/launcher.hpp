// `shardflow run`: starts this node's ranks with torchrun's environment and supervises them.
//
// Note [Launcher supervision]
// - Every rank is its own process group, so a terminal's Ctrl-C reaches the launcher only, and the
//   launcher decides: SIGINT/SIGTERM/SIGHUP are forwarded to every rank's group once; a second
//   one (or the grace period running out) sends SIGKILL.
// - When a rank exits non-zero or dies of a signal, the others are stopped (SIGTERM, then SIGKILL
//   after the grace period) and the launcher exits non-zero naming that rank and its status —
//   the first failure is the cause, later ones are consequences. With --recovery in-place only the
//   lost rank's process starts again and the others go on (Note [Recovering in place], rounds.cpp).
// - The ranks die with the launcher (PR_SET_PDEATHSIG), so a killed launcher leaves no orphans.
// - Node 0's launcher serves the rendezvous store for the whole job (Note [Who runs the store]).
// - Across nodes the launchers meet in that store before any rank starts, and stop each other's
//   ranks when one fails or vanishes (Note [Failures cross hosts], node_watch.hpp).
#pragma once

#include "runtime/launch/launch_spec.hpp"

namespace shardflow::launch {

// Runs the job; returns the launcher's exit status (0 when every rank exited 0).
int run(const LaunchSpec& spec);

}  // namespace shardflow::launch
