// The launchers of a multi-node job watching each other through the job's store: node 0's (TCP),
// or etcd's (Note [A store no node owns], Note [No node decides alone]).
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
//   generation of ranks (g<k>/failures). Once a generation failed and a node stopped its ranks,
//   its launcher posts whether it restarts (g<k>/next/<node>). Node 0 decides for all: once every
//   node of the generation has posted or been declared lost (heartbeats), it posts g<k>/decision,
//   "restart" and the nodes of the next generation, or "stop" and why; the others wait for it.
//   One node that is interrupted or out of restarts stops every node, so that no rank waits for a
//   peer that will never start. A lost node stops the job too, unless it is elastic (Note
//   [Shrinking the world]). Node 0 serves the TCP store: its loss always ends such a job. With the
//   store on etcd every node watches every other and any node may decide (Note [No node decides
//   alone], node_watch.cpp), so node 0 may be lost like any other.
//
// Note [Shrinking the world]
// With --nnodes MIN:MAX (and --max-restarts) a node lost during a generation is waited for
// --rejoin-timeout more: a launcher that comes back (a link that healed, a stopped process
// continued) and posts its choice in time is in the next generation again. Otherwise the next
// generation is the nodes left, if at least MIN: they keep their order and are numbered afresh
// (node ranks 0..n-1, RANK and WORLD_SIZE from them), and the ranks resume from the newest
// snapshot at the smaller world (load_checkpoint reshards N to M), from memory: the lost node's
// files have copies on the next node of the ring (Note [Snapshots on the other host]). A left-out launcher that is still running learns it from the decision and
// ends, naming why.
//
// Note [Rejoining]
// A node left out may come back: its launcher, started again with the same --node-rank (and the
// job's flags), finds its claim taken and the node marked left (launch/left/<k>), asks to join
// (launch/join/<k>) and waits, beating its heartbeat, up to --rdzv-timeout. Node 0 takes it in at
// the next restart (a failure of the smaller world): when it decides, a node that asked and whose
// heartbeat still moves is in the next generation again, in node-rank order, and learns the
// generation it starts at (launch/joined/<k>). The world grows back (the snapshot resharded M to
// N); the launcher of the node before it in the ring first copies its newest snapshot into the
// returning node's memory (Note [Snapshots on the other host]), so that the restart resumes from memory. A job that
// ends first ends the wait with an error naming it; so does a second launcher for the same node.
// Under --recovery in-place or shrink the running generation takes it in without a restart, at its
// ranks' next snapshot in memory (Note [A node joins live], grow_round.cpp): launch/joined/<k> then
// says "G R", the generation and the round that took it in.
#pragma once

#include <atomic>
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

#include "runtime/launch/peer_table.hpp"

#include "shardflow/store.hpp"

namespace shardflow::launch {

struct NodeWatchOptions {
  int nnodes = 1;
  int node_rank = 0;
  int nproc_per_node = 1;
  // Where this launcher reaches the job's store: node 0's TCP store (store_host:store_port, the
  // token its HELLO), or etcd (etcd_endpoints under etcd_root, the token its password: Note [No
  // node decides alone]). Its timeout is set per client.
  StoreRendezvous store;
  std::string local_address;  // this node's socket address, for the other nodes' messages
  std::chrono::milliseconds rdzv_timeout = std::chrono::seconds(600);
  std::chrono::milliseconds heartbeat_interval = std::chrono::seconds(1);
  std::chrono::milliseconds heartbeat_timeout = std::chrono::seconds(15);
  int min_nnodes = 0;  // Note [Shrinking the world]; 0: not elastic
  std::chrono::milliseconds rejoin_timeout = std::chrono::seconds(10);
  std::function<void(const std::string&)> say;  // the launcher's messages (a node waiting to rejoin says so)
  // Note [A lost host healed in place]: a node found lost is handed to the launcher (take_lost)
  // instead of failing the generation at once.
  bool heal_lost_nodes = false;
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
  // Whether the heartbeat found the store on etcd unreachable (this node cut off).
  bool cut_off() const { return cut_off_; }
  // Note [A lost host healed in place] (with heal_lost_nodes): the nodes found lost since the last
  // call, each with what was seen, not yet a failure. The launcher either heals the job without
  // one (drop_member) or fails the generation with it (fail_lost, as without healing).
  std::vector<std::pair<int, std::string>> take_lost();
  void fail_lost(const std::string& what);
  // The node leaves this generation: no longer watched or waited for, and marked left, so that a
  // launcher started again there may rejoin (Note [Rejoining], Note [A node joins live]).
  void drop_member(int node);
  // Posts this node's choice for the generation that just failed and waits (at most `limit`, plus
  // the rejoin timeout when elastic) for node 0's decision: the nodes of the next generation (by
  // their node rank at the start), or nullopt with `why_not` when the job stops.
  std::optional<std::vector<int>> decide_restart(bool want, std::chrono::milliseconds limit, std::string& why_not);
  // The next generation of ranks: its failures are its own.
  void next_generation();
  // A value for the other launchers (launch/<k>), and another node's, waited for up to the
  // heartbeat timeout (TimeoutError naming the key).
  void post(const std::string& k, const std::string& value);
  std::string read(const std::string& k);
  // Note [Rejoining]: the generation this launcher joined the job at (0 for one there from the
  // start), and the nodes of that generation.
  int joined_at() const { return joined_at_; }
  std::vector<int> members() const;
  // Note [A node joins live] (grow_round.cpp): the round of the running generation that took this
  // launcher in (0: a restart did, or it was there from the start).
  int joined_round() const { return joined_round_; }
  // ... and its ranks get their state from the running ranks' memory (Note [A join from memory]).
  bool joined_from_memory() const { return joined_from_memory_; }
  // The nodes outside this generation that asked to join (Note [Rejoining]).
  std::vector<int> asking_to_join();
  // The node is in this generation from now on, watched afresh. With `joined` (the launcher that
  // takes it in): its earlier launcher's keys go and it learns where it joins (launch/joined/<k>).
  void admit(int node, const std::string& joined = "");

 private:
  void heartbeat_loop();
  void watch_peers(Store& store, std::chrono::steady_clock::time_point now);
  void peer_failed(const std::string& what, bool publish, Store* store, bool lost);
  // Note [No node decides alone]: with the store on etcd every node watches every other, and the
  // decider of a restart is the lowest node of the generation that is not lost, by claim.
  bool on_etcd() const { return !o_.store.etcd_endpoints.empty(); }
  bool watches_peers() const { return on_etcd() || o_.node_rank == 0; }
  std::optional<bool> claim_decision();  // nullopt: not this node's turn (yet); false: another node claimed
  std::unique_ptr<Store> open_store(std::chrono::milliseconds timeout) const;
  std::string store_name() const;  // "node 0's store at H:P" or "the etcd store at H:P,..."
  std::string decide(std::chrono::milliseconds limit);  // node 0: the decision it posts
  void wait_to_rejoin(std::chrono::steady_clock::time_point deadline, const std::function<bool()>& interrupted);
  // The rendezvous, in the constructor's order (`how` says how to start every node, for errors).
  void connect_store(std::chrono::steady_clock::time_point deadline, const std::function<bool()>& interrupted, const std::string& how);
  bool claim_node_rank();  // true: this node rejoins (Note [Rejoining])
  void await_nodes(const std::vector<std::string>& keys, std::chrono::steady_clock::time_point deadline,
                   const std::function<bool()>& interrupted, const std::string& how);
  void check_same_job(const std::vector<std::string>& keys);
  std::vector<int> returning(const std::vector<int>& next);  // node 0: left-out nodes asking to join, alive
  void tell_joined(int node, const std::string& joined);      // launch/joined/<node>, its stale keys gone
  bool member(int node) const;
  std::string key(const std::string& k) const { return "launch/" + k; }
  std::string generation_key(const std::string& k) const;  // launch/g<generation>/k

  NodeWatchOptions o_;
  std::string store_where_;
  std::unique_ptr<Store> main_;  // this thread's calls
  std::unique_ptr<Store> beat_;  // the heartbeat thread's calls
  std::vector<std::string> labels_;
  int event_fd_ = -1;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  bool reported_ = false;                 // this node posted a failure: later ones are its echo
  // The heartbeat found the store on etcd unreachable: this node is cut off. Its restart's word
  // and its exit code are not asked of the store then: each call would spend its whole timeout
  // (the soak's cut host took 37 s to exit, 27 of them on such calls).
  std::atomic<bool> cut_off_{false};
  std::optional<std::string> failure_;    // another node's failure, once seen
  std::string own_report_;                // what this node posted
  bool failure_lost_ = false;             // failure_ is a node lost, not a rank failed
  std::vector<int> members_;              // the nodes of this generation, by node rank at the start
  std::vector<std::pair<int, std::string>> lost_;  // found lost, for the launcher to heal (take_lost)
  int generation_ = 0;
  int joined_at_ = 0;
  int joined_round_ = 0;
  bool joined_from_memory_ = false;
  PeerTable peers_;                       // node 0's view of the others (Note [One owner for the peers' state])
  std::thread thread_;
};

}  // namespace shardflow::launch
