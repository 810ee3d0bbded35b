// shardflow: the command-line entry point. One subcommand for now:
//
//   shardflow run --nproc-per-node N [--nnodes M --node-rank R --master-addr A --master-port P
//                 --token T] -- prog args...
#include <CLI/CLI.hpp>

#include <cstdio>
#include <cstdlib>

#include "runtime/launch/launcher.hpp"

int main(int argc, char** argv) {
  CLI::App app{"shardflow: data-parallel training runtime"};
  app.require_subcommand(1);
  auto* run = app.add_subcommand("run", "start this node's ranks with torchrun's environment and supervise them");
  shardflow::launch::LaunchSpec spec;
  double grace_s = 5;
  bool no_prefix = false;
  run->add_option("--nproc-per-node", spec.nproc_per_node, "ranks on this node")->capture_default_str();
  run->add_option("--nnodes", spec.nnodes, "nodes in the job")->capture_default_str();
  run->add_option("--node-rank", spec.node_rank, "this node's index")->capture_default_str();
  run->add_option("--master-addr", spec.master_addr, "address of node 0 (it serves the rendezvous store)")->capture_default_str();
  run->add_option("--master-port", spec.master_port, "store port (default: any free port on one node, 29500 across nodes)");
  run->add_option("--token", spec.token, "the job's store token (default: SHARDFLOW_STORE_TOKEN, else random on one node)");
  run->add_option("--kill-grace", grace_s, "seconds between SIGTERM and SIGKILL when stopping the ranks")->capture_default_str();
  run->add_flag("--no-prefix", no_prefix, "do not prefix output lines with the rank");
  run->add_option("command", spec.command, "the program and its arguments (after --)")->required();
  CLI11_PARSE(app, argc, argv);
  if (spec.token.empty())
    if (const char* t = std::getenv("SHARDFLOW_STORE_TOKEN")) spec.token = t;
  spec.prefix_output = !no_prefix;
  spec.kill_grace = std::chrono::milliseconds(long(grace_s * 1000));
  try {
    return shardflow::launch::run(spec);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "shardflow run: error: %s\n", e.what());
    return 2;
  }
}
