// The launcher's supervisor of one node (`shardflow run`; launcher.hpp): the class and the files
// its parts live in. Internal to the launcher executable.
#pragma once

#include <signal.h>
#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <deque>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "runtime/bootstrap/net_address.hpp"
#include "runtime/bootstrap/recovery_verdict.hpp"
#include "runtime/launch/launch_spec.hpp"
#include "runtime/launch/node_watch.hpp"
#include "runtime/launch/output_relay.hpp"
#include "runtime/launch/snapshot_memory.hpp"
#include "runtime/launch/snapshot_mirror.hpp"
#include "shardflow/errors.hpp"
#include "shardflow/store.hpp"

namespace shardflow::launch {

struct Rank {
  int global = 0, local = 0;
  pid_t pid = -1;
  bool running = false;
  int status = 0;  // waitpid status once exited
  int stopped_by = 0;  // the signal that stopped it (SIGSTOP, SIGTSTP...), while it is stopped
  bool signal_ours = false;  // killed by the signal this launcher sent while stopping the job
  bool replaced = false;     // lost and recovered in place (started again, or left out of a shrunk world; Note [Recovering in place]): not in the verdict
  std::optional<std::chrono::steady_clock::time_point> stopped_since;  // while stopped by a signal
  int out_fd = -1, err_fd = -1;
  std::unique_ptr<OutputRelay> out, err;
};

// One line on the launcher's stderr, "shardflow run: " first.
void say(const std::string& line);

class Supervisor {
 public:
  explicit Supervisor(const LaunchSpec& spec) : spec_(spec) {}
  int run();

 private:
  using clock = std::chrono::steady_clock;

  // ---- launcher.cpp: the job from start to end: signals, the store, meeting the other nodes,
  // the generations and their restarts, and the verdict
  sigset_t take_signals();
  void probe_blas();
  int serve_store(const std::string& token, bool one_node);
  std::optional<int> join_nodes(const net::LocalAddress& local, int port, const std::string& token);
  void run_generations(int port, const std::string& token, const sigset_t& old);
  std::string store_name(const std::string& host, int port) const;
  net::SocketChoice socket_choice() const;
  void offer_mirrored_memory(const std::string& address, const std::string& token);
  void point_mirror(const std::vector<int>& before, bool fetch, bool index_only = false);
  std::map<int, std::string> mirror_addresses();  // the other members' copy ports
  void gather_newest(const std::map<int, std::string>& address);
  int torch_port(int store_port);
  bool restart_wanted();
  void next_generation();
  void remove_shared_memory();
  int finish();
  int verdict();
  std::string restarts_note() const;
  const Rank& blamed_rank() const;
  std::string blame() const;

  // ---- supervise.cpp: the ranks' processes: spawning, reaping, signals, the supervision loop
  bool interrupted_by_signal();
  void spawn(Rank& r, int node, int world, int port, const std::string& token, const sigset_t& old_mask);
  void signal_all(int sig);
  void begin_stop(int sig);
  void reap();
  void rank_failed(Rank& r, const std::string& why_not);
  void kill_long_stopped();
  void on_signal();
  void on_peer_failure();
  bool any_running() const;
  void supervise();

  // ---- rounds.cpp: rounds of in-place recovery: claiming, the verdict, renumbering, and
  // learning the other nodes' rounds
  bool in_place() const { return spec_.recovery != "restart"; }
  bool can_recover_in_place();
  int recoveries();
  bool round_over(Store& st, int j);
  // Round j took a node in (Note [A node joins live]).
  bool grew(Store& st, int j) { return st.check({recovery_verdict::grow_node_key(restart_, j)}); }
  int claim_round(std::string& why_not);
  Store& recovery_store();
  std::string round_key(const std::string& what) const;
  void renumber(const std::vector<int>& next, int world, int round);
  void learn_rounds();
  void recover_in_place(const std::vector<Rank*>& lost);
  bool all_ready(std::vector<int>& waiting, clock::time_point deadline, const std::string& missed);
  bool publish_verdict(const recovery_verdict::Verdict& v);
  void cannot_tell(const Error& e);
  void say_copies(bool on);
  // A file of the launcher's snapshot memory (snapshot_env's names); empty without that memory.
  std::filesystem::path memory_file(const char* name) const;
  bool take_memory_file(const char* name) const;  // removes it: whether it was there
  bool keeps_snapshots_in_memory() const;  // the ranks said so (snapshot_env::kInUse)
  bool joins_from_memory() const;          // ... and that a node taken in live gets its state from theirs (kJoinFromMemory)
  bool gathers_copies() const;
  bool round_refused();
  void check_held_word();
  void start_again(const std::vector<std::pair<int, int>>& again);
  void check_round();
  void check_round_at_end();
  std::int64_t joined_round();
  void round_over_here();
  void end_round(const std::string& why);
  void fail_round();

  // ---- lost_node_round.cpp: a whole node lost and healed in place (Note [A lost host healed in place])
  void recover_lost_node(int node, const std::string& what);
  void leave_out(int node);

  // ---- grow_round.cpp: a node taken into a running generation (Note [A node joins live])
  void look_for_joiners();
  void check_grow_round();
  void take_in(int node, const std::vector<int>& next, bool from_memory, const std::string& joined = "");
  void say_ready(int round);
  void ask_regroup(bool on);

  const LaunchSpec& spec_;
  std::unique_ptr<TcpStoreServer> store_;
  net::SocketChoice socket_;
  std::string store_at_;
  std::unique_ptr<NodeWatch> watch_;  // across nodes only; destroyed before the store
  std::unique_ptr<SnapshotMemory> snapshot_memory_;
  std::unique_ptr<SnapshotMirror> mirror_;           // across nodes (Note [Snapshots on the other host])
  std::string mirror_label_;                         // this generation's: the next node of the ring, or empty when alone
  std::optional<std::string> peer_failure_;
  std::string store_lost_;
  std::string other_nodes_;  // what node 0 learned of the others while finishing
  std::deque<Rank> ranks_;  // a deque: a replacement is added while references to the others are held
  struct Generation {
    int node = 0, world = 1, port = 0;
    std::string token;
    sigset_t mask{};
  } generation_;  // how this generation's ranks were started: a replacement starts alike
  struct RecoveryRound {
    clock::time_point started;
    std::string lost;  // who was lost, for messages
    bool grow = false;  // Note [A node joins live]: nobody lost, a node taken in; no restart used
    // --rdzv-timeout counts from here: the loss; a growing round's word (the ranks' next snapshot
    // before it may be far off, and check_grow_round keeps its own deadline until then).
    clock::time_point timed_from = started;
    std::int64_t joined = 0;  // ranks that joined it, as of the last poll
  };
  std::optional<RecoveryRound> round_;  // the round of in-place recovery not yet over
  // A round run here whose word waits until every other node holds the newest snapshot whole:
  // a lost host's (Note [A lost host healed in place]), or a lost rank's across three or more
  // nodes (Note [Copies gathered before the word]).
  struct HeldWord {
    recovery_verdict::Verdict verdict;
    std::vector<int> waiting;  // the nodes not ready yet
    clock::time_point deadline;
    std::vector<std::pair<int, int>> again;  // ranks (global, local) of this node to start once the word is out
  };
  std::optional<HeldWord> held_word_;
  void hold_word(HeldWord held);
  struct GrowRound {  // Note [A node joins live]: run here, its word not out yet
    int node;
    std::string what;
    std::vector<int> before;   // the nodes before it
    bool from_memory;          // its ranks take their state from the running ranks' (joins_from_memory(), read once)
    bool admitted = false;     // every rank is in the round and the node was told to come
    std::vector<int> waiting;  // the nodes not ready yet, once admitted
    clock::time_point deadline;
  };
  std::optional<GrowRound> grow_round_;
  int grown_in_round_ = 0;        // the newest growing round this node applied (a learner)
  int grow_flag_round_ = 0;       // the newest growing round whose word this node passed to its ranks (a learner)
  std::vector<int> refused_joins_;  // nodes told once that they cannot join live
  bool joined_live_ = false;      // this launcher was taken into a running generation
  // A node was taken in from memory (Note [A join from memory]): its host may hold only the index
  // of the newest snapshot, so even at two nodes a lost rank's round gathers the copies first.
  bool partial_copies_ = false;
  int left_out_in_round_ = 0;  // the newest round whose lost node this node took out (a learner)
  int gathered_in_round_ = 0;  // the newest lost rank's round for which this node gathered the newest snapshot (a learner)
  bool left_out_ = false;      // this node was the one found lost: the others went on without it
  int round_no_ = 0;           // the round this node ran last in this generation (Note [Rounds across nodes])
  int learned_round_ = 0;      // the generation's rounds whose renumbering this node applied (Note [Rounds across nodes])
  clock::time_point learned_at_{};
  bool store_silent_ = false;  // learn_rounds() met an unreachable store: it asks no more
  int rounds_healed_ = 0;      // of them, over: this generation's count where the store cannot say
  int refused_round_ = 0;      // the newest round whose survivors refused to go on (Note [A round that did not heal])
  int recoveries_before_ = 0;  // in-place recoveries of the generations before, every node's
  int recoveries_seen_ = 0;    // recoveries() when last counted, for messages once the store may be gone
  std::unique_ptr<Store> recovery_store_;
  int sigfd_ = -1;
  int torch_port_ = 0;  // MASTER_PORT (torch_port)
  int interrupted_ = 0;
  bool killed_ = false;
  std::optional<int> first_failure_;
  int restart_ = 0;  // the worker group's generation (Note [Restarting the worker group])
  std::string not_restarted_;  // why a failure was not restarted although restarts were left
  std::vector<int> members_;   // this generation's nodes, by node rank at the start (Note [Shrinking the world])
  std::optional<clock::time_point> stop_deadline_;
};

}  // namespace shardflow::launch
