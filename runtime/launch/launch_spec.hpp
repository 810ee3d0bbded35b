// What `shardflow run` is asked to do (runtime/cli/main.cpp parses it from the command line), and
// its check: the job's shape, the store, the timeouts and the ways of healing.
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
  // The store on etcd (--rdzv-backend etcd --rdzv-endpoints H:P,...; Note [A store no node owns]):
  // no node serves one, and any node may be lost. rdzv_id (--rdzv-id) keeps this job's keys apart
  // from any other's in the same etcd; every node passes the same.
  std::vector<std::string> etcd_endpoints;
  std::string rdzv_id;
  // Where this node's sockets bind and advertise (Note [Choosing the socket address]); empty:
  // SHARDFLOW_SOCKET_ADDR / SHARDFLOW_SOCKET_IFNAME / GLOO_SOCKET_IFNAME, else the route to master_addr.
  std::string local_addr;
  std::string iface;
  // Across nodes (Note [Failures cross hosts]).
  std::chrono::milliseconds rdzv_timeout = std::chrono::seconds(600);
  std::chrono::milliseconds heartbeat_interval = std::chrono::seconds(1);
  std::chrono::milliseconds heartbeat_timeout = std::chrono::seconds(10);
  std::chrono::milliseconds kill_grace = std::chrono::seconds(5);
  bool prefix_output = true;
  // Note [Restarting the worker group]: when a rank fails, stop the others and start them all
  // again, up to this many times (torchrun's --max_restarts); across nodes all of them together.
  int max_restarts = 0;
  // Note [Recovering in place]: "restart" (the above), "in-place": only a lost rank's process
  // starts again and the survivors join it in the generation's next round (Runtime::recover), or
  // "shrink": no process starts, the survivors go on at once at the smaller world, numbered afresh.
  // Each such round that heals counts as one of max_restarts.
  std::string recovery = "restart";
  // Note [Shrinking the world]: --nnodes MIN:MAX. 0: not elastic (MIN = MAX = nnodes). A node lost
  // for longer than rejoin_timeout is left out of the next generation, while MIN nodes remain.
  int min_nnodes = 0;
  std::chrono::milliseconds rejoin_timeout = std::chrono::seconds(10);
  std::vector<std::string> command;
};

// Refuses a spec that cannot run, naming the flag (launch_spec.cpp).
void validate(const LaunchSpec& spec);

}  // namespace shardflow::launch
