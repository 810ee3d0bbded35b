// The launchers of a multi-node job watching each other through node 0's store.
//
// Note [Failures cross hosts]
// A rank that dies takes down its own node's ranks (Note [Launcher supervision]); its peers on
// other hosts would sit in a collective until their timeout. So the launchers meet in the store:
// - Rendezvous: each launcher claims its node rank (a second claim is an error naming both hosts),
//   posts its host, address and rank count, and waits for every node until a deadline; a timeout
//   names the nodes that never arrived. Ranks start only after it, so a missing node costs no
//   half-started job.
// - Failures: the first launcher whose rank fails posts "failure/1" with the node, rank and status;
//   every launcher polls the failure counter once per heartbeat interval and stops its ranks,
//   naming the node and rank that failed.
// - Vanished nodes: every launcher bumps its heartbeat counter each interval. Node 0 (which
//   serves the store) declares a node lost when its counter stalls for the heartbeat timeout
//   (kill -9, host gone, link down) and posts that as the failure. The others notice node 0 itself
//   when a store call fails: at once if its host answers with a reset, after the heartbeat
//   timeout (the store calls' deadline) if the link is down.
// - The end: each launcher posts its exit code; node 0 keeps serving the store until every node
//   has posted one or is lost, so no node mistakes a finished job for a dead node 0.
// - Restarts (--max-restarts, Note [Restarting the worker group]): failures are posted per
//   generation of ranks (g<k>/failures). Once a generation failed and every node stopped its
//   ranks, each launcher posts whether it restarts (g<k>/next/<node>), and all restart only when
//   every node says yes within the heartbeat timeout + the kill grace + 5 s: one node that is
//   interrupted, out of restarts or lost keeps every node from starting ranks that would wait for
//   it. A lost node (no heartbeat, or node 0's store gone) is not restarted around: the job ends,
//   naming it (shrinking the world is not built).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace shardflow {
class TcpStoreClient;
}

namespace shardflow::launch {

struct NodeWatchOptions {
  int nnodes = 1;
  int node_rank = 0;
  int nproc_per_node = 1;
  std::string store_host;  // where this launcher reaches node 0's store
  std::uint16_t store_port = 0;
  std::string token;
  std::string local_address;  // this node's socket address, for the other nodes' messages
  std::chrono::milliseconds rdzv_timeout = std::chrono::seconds(600);
  std::chrono::milliseconds heartbeat_interval = std::chrono::seconds(1);
  std::chrono::milliseconds heartbeat_timeout = std::chrono::seconds(15);
};

class NodeWatch {
 public:
  // Rendezvous of the launchers; `interrupted` is polled while waiting (Ctrl-C during the wait).
  // UsageError / TimeoutError / CommError naming the nodes involved.
  NodeWatch(NodeWatchOptions options, const std::function<bool()>& interrupted);
  ~NodeWatch();
  NodeWatch(const NodeWatch&) = delete;
  NodeWatch& operator=(const NodeWatch&) = delete;

  // "node 1 (host h, 10.213.0.2)".
  std::string label(int node) const;
  // Starts heartbeats; event_fd() becomes readable once another node failed or was lost.
  void start();
  int event_fd() const { return event_fd_; }
  std::optional<std::string> peer_failure() const;
  // This node's rank failed: the other nodes stop theirs. Returns the job's first failure (this
  // one, or another node's that came first and is the likelier cause); nullopt when node 0's store
  // could not be reached (then this failure is likely the echo of node 0's).
  std::optional<std::string> report_failure(const std::string& what);
  // This node is done. On node 0, also waits until every other node posted its exit or was lost,
  // at most `limit` (the others need the store to read a failure). Returns what it learned of the
  // other nodes meanwhile ("node 1 (...) was lost"), empty when nothing went wrong there.
  std::string finish(int exit_code, std::chrono::milliseconds limit);

  // The failure this generation saw was a node lost (not a rank of a node still there).
  bool lost_a_node() const;
  // Posts this node's choice for the generation that just failed and, when it wants to restart,
  // waits (at most `limit`) for every node's: true when all restart. `why_not` says which node
  // did not, or did not answer.
  bool agree_to_restart(bool want, std::chrono::milliseconds limit, std::string& why_not);
  // The next generation of ranks: its failures are its own.
  void next_generation();

 private:
  void heartbeat_loop();
  void watch_peers(TcpStoreClient& store, std::chrono::steady_clock::time_point now);
  void peer_failed(const std::string& what, bool publish, TcpStoreClient* store, bool lost);
  std::string key(const std::string& k) const { return "launch/" + k; }
  std::string generation_key(const std::string& k) const;  // launch/g<generation>/k

  NodeWatchOptions o_;
  std::string store_where_;
  std::unique_ptr<TcpStoreClient> main_;  // this thread's calls
  std::unique_ptr<TcpStoreClient> beat_;  // the heartbeat thread's calls
  std::vector<std::string> labels_;
  int event_fd_ = -1;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  bool reported_ = false;                 // this node posted a failure: later ones are its echo
  std::optional<std::string> failure_;    // another node's failure, once seen
  std::string own_report_;                // what this node posted
  bool failure_lost_ = false;             // failure_ is a node lost, not a rank failed
  int generation_ = 0;
  std::vector<bool> exited_, lost_;       // node 0's view of the others
  std::vector<std::int64_t> last_beat_;
  std::vector<std::chrono::steady_clock::time_point> beat_seen_;
  std::thread thread_;
};

}  // namespace shardflow::launch
