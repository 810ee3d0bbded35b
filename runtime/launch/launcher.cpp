#include "runtime/launch/launcher.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <poll.h>
#include <sys/signalfd.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <memory>
#include <map>
#include <optional>
#include <random>

#include "kernels/cpu/blas.hpp"
#include "runtime/comm/shm_names.hpp"
#include "runtime/bootstrap/etcd_names.hpp"
#include "runtime/bootstrap/net_address.hpp"
#include "runtime/bootstrap/recovery_verdict.hpp"
#include "runtime/bootstrap/snapshot_env.hpp"
#include "runtime/launch/node_watch.hpp"
#include "runtime/launch/output_relay.hpp"
#include "runtime/launch/rank_process.hpp"
#include "runtime/launch/snapshot_memory.hpp"
#include "runtime/launch/snapshot_mirror.hpp"
#include "shardflow/errors.hpp"
#include "shardflow/store.hpp"

namespace shardflow::launch {
namespace {

using clock = std::chrono::steady_clock;

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

std::string random_token() {
  std::random_device rd;
  char buf[33];
  std::snprintf(buf, sizeof(buf), "%08x%08x%08x%08x", rd(), rd(), rd(), rd());
  return buf;
}

void say(const std::string& line) {
  const std::string s = "shardflow run: " + line + "\n";
  [[maybe_unused]] auto w = ::write(STDERR_FILENO, s.data(), s.size());
}

class Supervisor {
 public:
  Supervisor(const LaunchSpec& spec) : spec_(spec) {}

  int run() {
    validate(spec_);
    for (int k = 0; k < spec_.nnodes; ++k) members_.push_back(k);
    std::string token = spec_.token;
    if (token.empty()) token = random_token();
    const sigset_t old = take_signals();
    probe_blas();
    const bool one_node = spec_.nnodes == 1;
    socket_ = socket_choice();
    // Resolved before anything starts: a bad --iface is an error now, not in every rank later.
    const net::LocalAddress local = net::choose_local_address(socket_, spec_.master_addr, one_node);
    const int port = serve_store(token, one_node);
    if (!one_node)
      if (const auto stopped = join_nodes(local, port, token)) return *stopped;
    // Memory for the ranks' snapshots (Note [Snapshots in memory]); across nodes each host keeps
    // the copies of the node before it in the ring too (Note [Snapshots on the other host]).
    snapshot_memory_ = std::make_unique<SnapshotMemory>(::getpid());
    if (!one_node) offer_mirrored_memory(local.address, token);
    run_generations(port, token, old);
    return finish();
  }

 private:
  // Signals arrive through a descriptor, in the same poll loop as the ranks' output. Blocked
  // before the store's thread exists, so that it inherits the mask and never takes them. Returns
  // the mask as it was, for the ranks.
  sigset_t take_signals() {
    sigset_t mask, old;
    sigemptyset(&mask);
    for (int s : {SIGCHLD, SIGINT, SIGTERM, SIGHUP}) sigaddset(&mask, s);
    pthread_sigmask(SIG_BLOCK, &mask, &old);
    sigfd_ = signalfd(-1, &mask, SFD_CLOEXEC | SFD_NONBLOCK);
    if (sigfd_ < 0) throw Error("signalfd: " + std::string(std::strerror(errno)));
    // A peer that dies while this launcher writes to its socket (the snapshot copies' sendfile,
    // which takes no MSG_NOSIGNAL) must cost an EPIPE, not this launcher: SIGPIPE killed node 0's
    // launcher when node 1's host went mid-copy (bench/restart_time.py --lose host). The ranks get
    // the default back before they exec (rank_process.cpp).
    ::signal(SIGPIPE, SIG_IGN);
    return old;
  }

  // Note [OpenBLAS on CPUs it does not know]: a child of this command probes OpenBLAS (the
  // launcher itself loads no BLAS: Note [Launcher supervision]). Where OpenBLAS fell back to a
  // pre-AVX kernel, the child's choice reaches the ranks as OPENBLAS_CORETYPE, before their
  // torch or shardflow loads it; a kernel whose bits depend on the thread count is said once,
  // with the setting that fixes it.
  void probe_blas() {
    std::vector<std::pair<std::string, std::string>> blas_env;
    const auto probe = kernels::blas::probe_in_child("/proc/self/exe", "__blas-probe", &blas_env);
    for (const auto& [name, value] : blas_env) ::setenv(name.c_str(), value.c_str(), 1);
    if (probe.ran && !(probe.thread_invariant && probe.repeatable)) say(probe.line());
  }

  // Node 0 serves the store; returns the port the ranks reach it on. Where this node's launcher
  // and ranks reach the store: on node 0 the address it is bound to (loopback for a one-node job,
  // whatever --master-addr says), elsewhere the master address.
  int serve_store(const std::string& token, bool one_node) {
    int port = spec_.master_port;
    store_at_ = net::resolve_ipv4(spec_.master_addr);
    if (!spec_.etcd_endpoints.empty()) return port < 0 ? 29500 : port;  // nobody serves one: MASTER_PORT is torch's
    if (spec_.node_rank == 0) {
      StoreServerOptions so;
      so.host = net::store_bind_address(socket_, spec_.master_addr, one_node);
      so.port = std::uint16_t(port < 0 ? (one_node ? 0 : 29500) : port);
      so.token = token;
      store_ = std::make_unique<TcpStoreServer>(so);
      port = store_->port();
      store_at_ = so.host;
    }
    return port;
  }

  // The rendezvous of the nodes' launchers, and their watch from then on. An exit status when a
  // signal stopped it before any rank started.
  std::optional<int> join_nodes(const net::LocalAddress& local, int port, const std::string& token) {
    NodeWatchOptions wo;
    wo.nnodes = spec_.nnodes;
    wo.node_rank = spec_.node_rank;
    wo.nproc_per_node = spec_.nproc_per_node;
    wo.store.store_host = store_at_;
    wo.store.store_port = std::uint16_t(port);
    wo.store.token = token;
    wo.store.etcd_endpoints = spec_.etcd_endpoints;
    wo.store.etcd_root = etcd::root_for(spec_.rdzv_id);  // as the ranks derive it from SHARDFLOW_RUN_ID
    wo.local_address = local.address;
    wo.rdzv_timeout = spec_.rdzv_timeout;
    wo.heartbeat_interval = spec_.heartbeat_interval;
    wo.heartbeat_timeout = spec_.heartbeat_timeout;
    wo.min_nnodes = spec_.min_nnodes;
    wo.rejoin_timeout = spec_.rejoin_timeout;
    wo.heal_lost_nodes = in_place();  // Note [A lost host healed in place]
    wo.say = [](const std::string& line) { say(line); };
    say("node " + std::to_string(spec_.node_rank) + " of " + std::to_string(spec_.nnodes) + ": sockets on " + local.address + " (" +
        local.why + "), waiting for the other nodes at " + store_name(store_at_, port));
    try {
      watch_ = std::make_unique<NodeWatch>(wo, [this] { return interrupted_by_signal(); });
    } catch (const Error&) {
      if (!interrupted_) throw;
      say("stopped by SIG" + std::string(sigabbrev_np(interrupted_)) + " during the rendezvous; no rank was started");
      return 128 + interrupted_;
    }
    if (const int round = watch_->joined_round(); round > 0) {  // Note [A node joins live]
      restart_ = watch_->joined_at();
      members_ = watch_->members();
      round_no_ = learned_round_ = round;
      joined_live_ = true;
      say("node " + std::to_string(spec_.node_rank) + " joins the running job in round " + std::to_string(round) + ": " +
          std::to_string(members_.size()) + " node(s), world " + std::to_string(int(members_.size()) * spec_.nproc_per_node));
    } else if (const int g = watch_->joined_at(); g > 0) {  // Note [Rejoining]
      restart_ = g;
      members_ = watch_->members();
      say("node " + std::to_string(spec_.node_rank) + " rejoins the job at its restart " + std::to_string(g) + ": " +
          std::to_string(members_.size()) + " node(s), world " + std::to_string(int(members_.size()) * spec_.nproc_per_node));
    }
    watch_->start();
    return std::nullopt;
  }

  // This node's ranks, generation after generation, until the job ends or no restart is wanted.
  void run_generations(int port, const std::string& token, const sigset_t& old) {
    std::vector<int> before = members_;  // the nodes of the generation before (a joiner's: the others)
    const bool joiner = restart_ > 0 || joined_live_;
    if (joiner) before.erase(std::remove(before.begin(), before.end(), spec_.node_rank), before.end());
    for (;;) {
      std::string started;
      // This node's place among the generation's nodes (Note [Shrinking the world]).
      const int node = int(std::find(members_.begin(), members_.end(), spec_.node_rank) - members_.begin());
      const int world = spec_.nproc_per_node * int(members_.size());
      generation_ = {node, world, port, token, old};
      point_mirror(before, restart_ > 0 || joined_live_);
      before = members_;
      if (std::exchange(joined_live_, false)) say_ready(round_no_);  // Note [A node joins live], step 3
      for (int l = 0; l < spec_.nproc_per_node; ++l) {
        auto& r = ranks_.emplace_back();
        r.local = l;
        r.global = node * spec_.nproc_per_node + l;
        spawn(r, node, world, port, token, old);
        started += (started.empty() ? "" : ", ") + ("rank " + std::to_string(r.global) + " (pid " + std::to_string(r.pid) + ")");
      }
      say("started " + started + "; world " + std::to_string(world) + ", store " + store_name(spec_.master_addr, port) +
          (spec_.node_rank == 0 && spec_.etcd_endpoints.empty() ? " (served here)" : "") +
          (restart_ ? "; restart " + std::to_string(restart_) + " of " + std::to_string(spec_.max_restarts) : ""));
      supervise();
      if (!restart_wanted()) return;
      next_generation();
    }
  }

  // "10.0.0.1:29500", or "etcd at h1:2379,h2:2379 (job ID)".
  std::string store_name(const std::string& host, int port) const {
    if (spec_.etcd_endpoints.empty()) return host + ":" + std::to_string(port);
    return "etcd at " + etcd::join_endpoints(spec_.etcd_endpoints) + " (job " + spec_.rdzv_id + ")";
  }

  // Flags first, then the environment (Note [Choosing the socket address]).
  net::SocketChoice socket_choice() const {
    if (!spec_.local_addr.empty()) return {spec_.local_addr, "", "--local-addr"};
    if (!spec_.iface.empty()) return {"", spec_.iface, "--iface"};
    return net::socket_choice_from_env();
  }

  // Note [Snapshots on the other host]: every node copies, or none keeps snapshots in memory (a
  // snapshot would be whole on no host, and the restart would fall back to an older one on disk).
  void offer_mirrored_memory(const std::string& address, const std::string& token) {
    std::string mine = "none";
    if (!snapshot_memory_->path().empty()) try {
        mirror_ = std::make_unique<SnapshotMirror>(snapshot_memory_->path(), address, token, [](const std::string& line) { say(line); });
        mine = mirror_->address();
      } catch (const Error& e) {
        say(e.what());
      }
    watch_->post("mirror/" + std::to_string(spec_.node_rank), mine);
    for (int k : members_) {  // a node that joins a running job: the nodes there now
      if (k == spec_.node_rank || !mirror_) continue;
      if (watch_->read("mirror/" + std::to_string(k)) != "none") continue;
      say("snapshots on disk only: " + watch_->label(k) + " has no memory to keep them in (a tmpfs /dev/shm) or could not listen "
          "for copies");
      mirror_.reset();
    }
    if (!mirror_) {
      if (mine == "none") say("snapshots on disk only: this node has no memory to keep them in (a tmpfs /dev/shm) or could not listen");
      snapshot_memory_.reset();
    }
  }

  // Each generation: the copies go to the next node of the ring (the generation's nodes in order);
  // alone, they stay here. Addresses are read afresh: a node that rejoined (Note [Rejoining]) has
  // a new one, and first gets this host's newest snapshot whole. With `fetch` (after a failure, or
  // in a lost host's round: Note [A lost host healed in place]) this host first fetches what it
  // lacks of its newest snapshot from the others (with more than two nodes at the snapshot's time
  // it holds only its own and its predecessor's files), so that it holds it whole. Both happen
  // before this node's ranks load it.
  void point_mirror(const std::vector<int>& before, bool fetch) {
    mirror_label_.clear();
    if (!mirror_) return;
    std::map<int, std::string> address;  // the other nodes' copy ports
    for (int k : members_) {
      if (k == spec_.node_rank) continue;
      try {
        if (auto a = watch_->read("mirror/" + std::to_string(k)); a != "none") address[k] = a;
      } catch (const Error& e) {
        say("snapshot copies: " + watch_->label(k) + " posted no address (" + e.what() + ")");
      }
    }
    const auto me = std::find(members_.begin(), members_.end(), spec_.node_rank);
    const int next = members_.size() >= 2 ? *(std::next(me) == members_.end() ? members_.begin() : std::next(me)) : -1;
    if (address.count(next)) mirror_label_ = watch_->label(next);
    if (fetch && !address.empty()) {  // with two from the start a no-op: each host holds every file
      std::vector<std::string> peers;
      for (const auto& [k, a] : address) peers.push_back(a);
      mirror_->assemble(peers);
    }
    const bool returned = next >= 0 && std::find(before.begin(), before.end(), next) == before.end();
    mirror_->send_to(mirror_label_.empty() ? "" : address[next], mirror_label_, returned);
    say_copies(!mirror_label_.empty());
    if (returned && !mirror_label_.empty() && !mirror_->wait_seeded(spec_.heartbeat_timeout + std::chrono::seconds(60)))
      say("snapshot copies: the newest snapshot did not reach " + mirror_label_ + " in time; its ranks may resume from disk");
  }

  // MASTER_PORT for the ranks, chosen once: on one node a port the kernel says is free now (the
  // store's own is ephemeral, and the one after it was seen taken by another process's connection);
  // across nodes the port after the store's, which every node derives alike (29500 -> 29501).
  int torch_port(int store_port) {
    if (torch_port_) return torch_port_;
    torch_port_ = store_port < 65535 ? store_port + 1 : store_port - 1;
    if (spec_.nnodes == 1) {
      const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
      sockaddr_in a{};
      a.sin_family = AF_INET;
      a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      socklen_t len = sizeof a;
      if (fd >= 0 && ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
          ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0)
        torch_port_ = ntohs(a.sin_port);
      if (fd >= 0) ::close(fd);
    }
    return torch_port_;
  }

  // Polled during the rendezvous, before any rank exists: Ctrl-C must not wait for the deadline.
  bool interrupted_by_signal() {
    signalfd_siginfo si{};
    while (::read(sigfd_, &si, sizeof(si)) == ssize_t(sizeof(si)))
      if (si.ssi_signo != SIGCHLD) interrupted_ = int(si.ssi_signo);
    return interrupted_ != 0;
  }

  void spawn(Rank& r, int node, int world, int port, const std::string& token, const sigset_t& old_mask) {
    const auto env = rank_environment(spec_, socket_, {r.global, r.local, world, store_at_, port, token, restart_, spec_.max_restarts,
                                                         snapshot_memory_ ? snapshot_memory_->path() : std::string(), mirror_label_,
                                                         node, torch_port(port), round_no_});
    const RankProcess p = start_rank_process(spec_.command, env, old_mask);
    r.pid = p.pid;
    r.running = true;
    r.out_fd = p.out_fd;
    r.err_fd = p.err_fd;
    const std::string prefix = spec_.prefix_output ? "[rank " + std::to_string(r.global) + "] " : "";
    r.out = std::make_unique<OutputRelay>(STDOUT_FILENO, prefix);
    r.err = std::make_unique<OutputRelay>(STDERR_FILENO, prefix);
  }

  void signal_all(int sig) {
    for (auto& r : ranks_)
      if (r.running) ::kill(-r.pid, sig);
  }

  // Stops the job: SIGTERM now, SIGKILL once the grace period has passed.
  void begin_stop(int sig) {
    if (stop_deadline_) return;
    signal_all(sig);
    stop_deadline_ = clock::now() + spec_.kill_grace;
  }

  void reap() {
    std::vector<Rank*> lost;  // to recover in place once the loop is done: a replacement adds to ranks_
    for (;;) {
      int status = 0;
      // Stops too: a stopped rank hangs its peers until they time out, and the peer that times out
      // first is not the one to blame, so the verdict names the stopped rank as the likely cause.
      const pid_t pid = ::waitpid(-1, &status, WNOHANG | WUNTRACED | WCONTINUED);
      if (pid <= 0) break;
      for (auto& r : ranks_) {
        if (r.pid != pid) continue;
        if (WIFSTOPPED(status)) {
          r.stopped_by = WSTOPSIG(status);
          r.stopped_since = clock::now();
          say("rank " + std::to_string(r.global) + " (pid " + std::to_string(pid) + ") was stopped by SIG" +
              sigabbrev_np(r.stopped_by) + (in_place() ? "; it counts as lost if still stopped after --heartbeat-timeout"
                                                       : "; its peers wait for it until their timeout"));
          continue;
        }
        if (WIFCONTINUED(status)) {
          r.stopped_by = 0;
          r.stopped_since.reset();
          continue;
        }
        r.running = false;
        r.status = status;
        r.signal_ours = WIFSIGNALED(status) && stop_deadline_ &&
                        (WTERMSIG(status) == SIGTERM || (WTERMSIG(status) == SIGKILL && killed_));
        const bool failed = !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
        if (failed && can_recover_in_place()) {
          lost.push_back(&r);
          continue;
        }
        if (failed) rank_failed(r, "");
        // The rank's group may still hold children of its own; they go with it.
        if (stop_deadline_) ::kill(-pid, SIGKILL);
      }
    }
    if (!lost.empty()) recover_in_place(lost);
  }

  // A rank's failure that is not recovered in place ends the generation: every rank of every node
  // stops (and restarts, if restarts are left). `why_not`: why it was not recovered in place, if it could have been.
  void rank_failed(Rank& r, const std::string& why_not) {
    if (first_failure_ || interrupted_ || peer_failure_) return;
    if (round_) fail_round();  // lost while a round was open: the round did not heal the job
    first_failure_ = r.global;
    say("rank " + std::to_string(r.global) + " (pid " + std::to_string(r.pid) + ") " + describe_status(r.status) + why_not +
        "; stopping the other rank(s)");
    begin_stop(SIGTERM);
    if (watch_) {
      const std::string mine = "rank " + std::to_string(r.global) + " (local rank " + std::to_string(r.local) + ", pid " +
                               std::to_string(r.pid) + ") " + describe_status(r.status);
      const auto first = watch_->report_failure(mine);
      if (!first)
        store_lost_ = watch_->label(0) + "'s store is unreachable too: node 0 is likely down and this rank's failure its echo";
      else if (first->find(mine) == std::string::npos)
        peer_failure_ = *first;  // another node failed first: the likelier cause
    }
  }

  // ---- Note [Recovering in place] --------------------------------------------------------------
  // With --recovery in-place a lost rank (its process exited non-zero or died, or stayed stopped
  // for longer than --heartbeat-timeout) is not the end of the generation: its process starts
  // again in the generation's next round, the surviving ranks (which see their collectives fail)
  // are told so through the store ("g<k>/recovery/<round>": "in-place: ...", the new world and
  // each rank's new number) and join it there (rejoin_process_group, Runtime::recover). With
  // --recovery shrink nothing starts: the survivors are numbered afresh in their order and go on
  // at the smaller world (the output's "[rank N]" follows). The round is over once every rank made the round's
  // group ("g<k>/r<round>/joined" counts them). A rank lost while a round is still open, or a
  // round not over within --rdzv-timeout, ends the generation as without in-place recovery: every
  // rank stops, and the job restarts if restarts are left. Each round that heals counts as one
  // restart; one that does not is replaced by the restart it ends in.
  //
  // ---- Note [Rounds across nodes] ----------------------------------------------------------------
  // Across nodes the launcher of the node whose rank was lost runs the round; the other nodes'
  // launchers see nothing (their ranks keep running and rejoin through the shared store, and no
  // node failure is reported). Rounds are numbered in the store, not by each launcher: a launcher
  // claims round r by counting "g<k>/rounds" up to r, and holds it only if round r - 1 is over: every
  // rank of the world made its group ("g<k>/r<round>/joined", which the ranks count themselves, so
  // a loss right after a round may claim the next one before the holder's launcher polled). Two
  // nodes that lose a rank at once cannot both hold a round (the survivors would wait in one while
  // the other's lost rank never joins it): the one that does not hold it fails the generation as
  // without in-place recovery, and every rank of every node stops and restarts. The rounds over are
  // the generation's recoveries, every node's: --max-restarts bounds them all together. A
  // shrinking round renumbers every node's ranks: the other nodes' launchers learn it from the
  // round's verdict in the store (learn_rounds), for their output prefixes and their own next rounds.
  bool in_place() const { return spec_.recovery != "restart"; }

  bool can_recover_in_place() {
    return in_place() && !round_ && !first_failure_ && !peer_failure_ && !interrupted_ && !stop_deadline_ &&
           restart_ + recoveries() < spec_.max_restarts;
  }

  // In-place recoveries over the whole job, every node's (this node's open round included): each
  // counts as a restart. Across nodes the store says which of the generation's rounds are over;
  // unreachable, this node's own count stands in (the restart that follows cannot reach it either).
  int recoveries() {
    const bool healing = round_ && !round_->grow;  // Note [A node joins live]: taking a node in uses no restart
    int in_generation = rounds_healed_ + (healing ? 1 : 0);
    if (in_place() && spec_.nnodes > 1) {
      try {
        auto& st = recovery_store();
        const int claimed = int(st.add(round_key("rounds"), 0));
        int over = 0;
        for (int j = 1; j <= claimed; ++j)
          over += (healing && j == round_no_) || (!(round_ && j == round_no_) && !grew(st, j) && round_over(st, j));
        in_generation = over;
      } catch (const Error&) {
      }
    }
    recoveries_seen_ = recoveries_before_ + in_generation;
    return recoveries_seen_;
  }

  // Note [Rounds across nodes]: round j is over once every rank of its world joined it: the world
  // its word says (a shrink's is smaller than the one before, a growing round's larger), else the
  // world now.
  bool round_over(Store& st, int j) {
    if (j < 1) return true;
    int world = generation_.world;
    if (const auto key = recovery_verdict::key(restart_, j); st.check({key}))
      if (const auto v = recovery_verdict::parse(st.get(key))) world = v->world;
    return st.add(recovery_verdict::joined_key(restart_, j), 0) >= world;
  }

  // Round j took a node in (Note [A node joins live]).
  bool grew(Store& st, int j) { return st.check({recovery_verdict::grow_node_key(restart_, j)}); }

  // Note [Rounds across nodes]: the next round's number, or 0 when another node's round is still
  // open or the store cannot be reached, with why in `why_not`.
  int claim_round(std::string& why_not) {
    try {
      auto& st = recovery_store();
      const int r = int(st.add(round_key("rounds"), 1));
      if (round_over(st, r - 1)) return r;
      why_not = "; not recovered in place: round " + std::to_string(r - 1) + " of another node's recovery is still open";
    } catch (const Error& e) {
      why_not = "; not recovered in place: the store could not be reached (" + std::string(e.what()) + ")";
    }
    return 0;
  }

  Store& recovery_store() {
    if (!recovery_store_) {
      StoreRendezvous where;
      where.store_host = store_at_;
      where.store_port = std::uint16_t(generation_.port);
      where.token = generation_.token;
      where.etcd_endpoints = spec_.etcd_endpoints;
      where.etcd_root = etcd::root_for(spec_.rdzv_id);
      where.timeout = std::chrono::seconds(10);
      recovery_store_ = connect_store(where);
    }
    return *recovery_store_;
  }

  std::string round_key(const std::string& what) const {
    return "g" + std::to_string(restart_) + "/" + what;
  }

  // Shrinking: this node's surviving ranks take their numbers in round `round`'s world (-1: lost),
  // their output prefix follows. One node: the local rank is the rank; across nodes a rank's local
  // rank (its LOCAL_RANK, its device) stays.
  void renumber(const std::vector<int>& next, int world, int round) {
    std::string moved;
    for (auto& r : ranks_) {
      // A rank that already finished went through the round too (learnt after the job's end).
      if (r.replaced || r.global >= int(next.size())) continue;
      const int n = next[std::size_t(r.global)];
      if (n < 0 || n == r.global) continue;
      moved += (moved.empty() ? "" : ", ") + std::to_string(r.global) + " -> " + std::to_string(n);
      if (spec_.prefix_output) {
        r.out->set_prefix("[rank " + std::to_string(n) + "] ");
        r.err->set_prefix("[rank " + std::to_string(n) + "] ");
      }
      r.global = n;
      if (spec_.nnodes == 1) r.local = n;
    }
    const bool grew = world > generation_.world;
    generation_.world = world;
    if (spec_.nnodes > 1 && !moved.empty())
      say("round " + std::to_string(round) + (grew ? " grew" : " shrank") + " the world to " + std::to_string(world) + ": this node's rank(s) " + moved);
  }

  // Note [Rounds across nodes]: another node's shrinking round renumbers this node's ranks too,
  // and a lost host's round takes that node out here first (Note [A lost host healed in place]);
  // polled while supervising (every 200 ms at most), and before this node claims a round of its own.
  void learn_rounds() {
    if (!in_place() || spec_.nnodes == 1 || round_ || store_silent_ || first_failure_ || peer_failure_ || stop_deadline_) return;
    try {
      auto& st = recovery_store();
      const int claimed = int(st.add(round_key("rounds"), 0));
      while (learned_round_ < claimed) {
        const int j = learned_round_ + 1;
        const std::string key = recovery_verdict::key(restart_, j);
        if (!st.check({key})) {  // claimed, its word not out yet (or a claim that failed: the generation ends)
          // Note [A node joins live], steps 1 and 3 on the other nodes.
          if (grew(st, j)) {
            if (grow_flag_round_ != j) {
              grow_flag_round_ = j;
              ask_regroup(true);
            }
            if (grown_in_round_ != j && st.check({recovery_verdict::members_key(restart_, j)})) {
              grown_in_round_ = j;
              ask_regroup(false);
              take_in(std::stoi(st.get(recovery_verdict::grow_node_key(restart_, j))), recovery_verdict::parse_nodes(st.get(recovery_verdict::members_key(restart_, j))));
              say_ready(j);
            }
            return;
          }
          // Note [A lost host healed in place], step 2: another node runs a lost host's round.
          if (left_out_in_round_ != j && st.check({recovery_verdict::lost_node_key(restart_, j)})) {
            left_out_in_round_ = j;
            const int node = std::stoi(st.get(recovery_verdict::lost_node_key(restart_, j)));
            if (node == spec_.node_rank) {  // found lost while it was silent (stopped, cut off): the others went on
              left_out_ = true;
              peer_failure_ = "this node was found lost by the others and left out of the job in round " + std::to_string(j) +
                              " (a launcher started again here is taken in again: Note [A node joins live])";
              say(*peer_failure_ + "; stopping this node's rank(s)");
              begin_stop(SIGTERM);
              return;
            }
            leave_out(node);
            st.set(recovery_verdict::ready_key(restart_, j, spec_.node_rank), "1");
          }
          return;
        }
        const auto v = recovery_verdict::parse(st.get(key));
        ++learned_round_;
        if (v) renumber(v->next, v->world, learned_round_);
      }
    } catch (const Error&) {
      // The store unreachable: the ranks' own rejoin fails too, and the generation ends. Not asked
      // again, so that a store whose host is gone does not hold the output's relay at every poll.
      store_silent_ = true;
    }
  }

  // ---- Note [A node joins live] ------------------------------------------------------------------
  // A node left out (its host lost and healed in place, or left out at a restart) whose launcher is
  // started again asks to join (Note [Rejoining]). Under --recovery in-place or shrink with --nnodes
  // MIN:MAX the running generation takes it in without a restart, at a step boundary, losing no
  // step: the survivors keep their processes, as when healing in place, and the world grows back.
  // The node that sees the request first runs a round of its own (node 0 with its TCP store; on
  // etcd the first to claim "grow/<node>"):
  // 1. It claims the round, posts the node it takes in, and tells the ranks through their hosts'
  //    memory (snapshot_env::kRegroup; the other nodes' launchers learn the round and do the same).
  // 2. Rank 0 reads it at the next snapshot into memory, and its word goes with the save's id to
  //    every rank: that snapshot completes at once, and each rank's iteration ends in the error an
  //    in-place trainer answers with recover(rejoin_process_group(...)), where it says it is there.
  // 3. Once every rank is, the node is told the round's nodes (launch/joined/<k>: "G R"), every
  //    node points its ring of copies anew (the node before the newcomer seeds its memory with that
  //    snapshot; with more than two nodes each fetches what its memory lacks), and says it is ready.
  // 4. The round's word goes out: every rank keeps its node's place, the newcomer's ranks take
  //    theirs (node by node, so two levels still pair up), and all of them load that snapshot.
  // It uses no restart. Not taken in live, the node waits for the next restart, as before, and the
  // launcher says why once: the ranks keep no snapshots in memory (snapshot_env::kInUse: none, or on
  // disk only: no step to go on from at once), or an earlier round shrank the world by ranks rather
  // than whole nodes. The ranks are waited for as long as the job runs; a node not ready within
  // --rdzv-timeout after that (the newcomer lost again) ends the generation as a failed round does.
  void look_for_joiners() {
    if (!in_place() || !spec_.min_nnodes || spec_.nnodes == 1 || !watch_ || round_ || store_silent_ || first_failure_ || peer_failure_ ||
        interrupted_ || stop_deadline_ || left_out_ || int(members_.size()) >= spec_.nnodes)
      return;
    std::vector<int> asking;
    try {
      asking = watch_->asking_to_join();
    } catch (const Error&) {
      return;  // the store: the heartbeats say what became of it
    }
    for (int k : asking) {
      std::string why_not;
      std::error_code ec;
      if (!snapshot_memory_ || snapshot_memory_->path().empty() ||
          !std::filesystem::exists(std::filesystem::path(snapshot_memory_->path()) / snapshot_env::kInUse, ec))
        why_not = "the ranks keep no snapshots in memory (none, or on disk only), so there is no step the job can go on from at once";
      else if (generation_.world != int(members_.size()) * spec_.nproc_per_node)
        why_not = "an earlier round of this generation shrank the world by ranks, not by whole nodes";
      if (!why_not.empty()) {
        if (std::find(refused_joins_.begin(), refused_joins_.end(), k) == refused_joins_.end()) {
          refused_joins_.push_back(k);
          say(watch_->label(k) + " asks to join; not taken in live: " + why_not + "; it joins at the next restart");
        }
        continue;
      }
      try {
        auto& st = recovery_store();
        if (!round_over(st, int(st.add(round_key("rounds"), 0)))) return;  // another node's round first: asked again later
        if (st.add(round_key("grow/" + std::to_string(k)), 1) != 1) continue;  // another node takes it in
      } catch (const Error&) {
        return;
      }
      learn_rounds();  // the world now, if another node's round changed it
      const int claimed = claim_round(why_not);
      if (!claimed) {
        say(watch_->label(k) + " asks to join; not taken in live" + why_not + "; it joins at the next restart");
        continue;
      }
      round_no_ = learned_round_ = claimed;
      const std::string what = watch_->label(k) + " asks to join";
      round_ = RecoveryRound{clock::now(), what, true};
      grow_round_ = GrowRound{k, what, members_, false, {}, clock::now() + spec_.rdzv_timeout};
      try {
        recovery_store().set(recovery_verdict::grow_node_key(restart_, round_no_), std::to_string(k));
      } catch (const Error& e) {
        cannot_tell(e);
        return;
      }
      ask_regroup(true);
      say(what + ": taking it in (round " + std::to_string(round_no_) + "): the ranks go on at world " +
          std::to_string(int(members_.size() + 1) * spec_.nproc_per_node) + " from their next snapshot in memory, which its ranks load");
      return;  // one node a round
    }
  }

  // Steps 2-4 on the node that runs the round, polled by supervise().
  void check_grow_round() {
    if (!grow_round_) return;
    auto& gr = *grow_round_;
    if (!gr.admitted) try {
        auto& st = recovery_store();
        // The ranks leave their iterations at their next snapshot in memory, however far off (no
        // deadline: giving up could strand a rank that already read the word; the job's end, or a
        // failure's restart, ends the round).
        if (st.add(recovery_verdict::parked_key(restart_, round_no_), 0) < generation_.world) return;
        std::vector<int> next = members_;
        next.push_back(gr.node);
        std::sort(next.begin(), next.end());
        st.set(recovery_verdict::members_key(restart_, round_no_), recovery_verdict::format_nodes(next));
        ask_regroup(false);
        take_in(gr.node, next, std::to_string(restart_) + " " + std::to_string(round_no_));
        gr.admitted = true;
        for (int k : members_)
          if (k != spec_.node_rank) gr.waiting.push_back(k);
        gr.deadline = clock::now() + spec_.rdzv_timeout;
      } catch (const Error& e) {
        cannot_tell(e);
        return;
      }
    if (!all_ready(gr.waiting, gr.deadline, "did not get the newest snapshot")) return;
    // Every rank keeps its node's place in the new order; the newcomer's ranks take theirs.
    recovery_verdict::Verdict v{gr.what + "; taken in", int(members_.size()) * spec_.nproc_per_node,
                                std::vector<int>(std::size_t(generation_.world))};
    for (int g = 0; g < generation_.world; ++g) {
      const int node = gr.before[std::size_t(g / spec_.nproc_per_node)];
      const int at = int(std::find(members_.begin(), members_.end(), node) - members_.begin());
      v.next[std::size_t(g)] = at * spec_.nproc_per_node + g % spec_.nproc_per_node;
    }
    grow_round_.reset();
    round_->timed_from = clock::now();
    if (publish_verdict(v)) renumber(v.next, v.world, round_no_);
  }

  // Step 3 on any node of the round: the newcomer is in this node's generation and its ring of copies.
  void take_in(int node, const std::vector<int>& next, const std::string& joined = "") {
    const std::vector<int> before = members_;
    watch_->admit(node, joined);
    members_ = next;
    point_mirror(before, true);
  }

  void say_ready(int round) {
    try {
      recovery_store().set(recovery_verdict::ready_key(restart_, round, spec_.node_rank), "1");
    } catch (const Error&) {
      // The node that runs the round names this node when its deadline passes.
    }
  }

  // Step 1: whether the ranks of this host leave their iteration at their next snapshot in memory.
  void ask_regroup(bool on) {
    if (!snapshot_memory_ || snapshot_memory_->path().empty()) return;
    const auto flag = std::filesystem::path(snapshot_memory_->path()) / snapshot_env::kRegroup;
    std::error_code ec;
    if (on) {
      std::ofstream(flag) << "the launcher takes a node into the job: go on in its next round\n";
    } else {
      std::filesystem::remove(flag, ec);
    }
  }

  void recover_in_place(const std::vector<Rank*>& lost) {
    // This node's survivors (across nodes the other nodes' ranks survive too).
    const bool none_alive = std::none_of(ranks_.begin(), ranks_.end(), [&](const Rank& r) {
      return r.running && !r.replaced && std::find(lost.begin(), lost.end(), &r) == lost.end();
    });
    // Across nodes a shrink keeps every node in the job: a node whose every rank was lost starts
    // them again instead (a node without ranks would leave, and with it the copies of the other
    // hosts' snapshots it holds, Note [Snapshots on the other host]).
    const bool emptied = spec_.nnodes > 1 && none_alive;
    const bool shrink = spec_.recovery == "shrink" && !emptied;
    std::string who, pids;
    for (const Rank* r : lost) {
      who += (who.empty() ? "" : "; ") + ("rank " + std::to_string(r->global) + " (pid " + std::to_string(r->pid) + ") " +
                                          describe_status(r->status));
      pids += (pids.empty() ? "" : ", ") + std::to_string(r->global);
    }
    if (none_alive && spec_.nnodes == 1) {  // nobody to go on: the generation ends as without in-place recovery
      first_failure_ = lost.front()->global;
      say(who + "; no rank is left to go on in place");
      begin_stop(SIGTERM);
      return;
    }
    learn_rounds();  // the ranks' numbers now, if another node shrank the world
    std::string why_not;
    const int claimed = claim_round(why_not);
    if (!claimed) {
      for (Rank* r : lost) {
        rank_failed(*r, why_not);
        ::kill(-r->pid, SIGKILL);  // what its process group still holds
      }
      return;
    }
    round_no_ = claimed;
    learned_round_ = claimed;
    round_ = RecoveryRound{clock::now(), who};
    const std::string round = "round " + std::to_string(round_no_) + ", " + std::to_string(restart_ + recoveries()) + " of " +
                              std::to_string(spec_.max_restarts) + " restarts";
    // Shrinking, the survivors (every node's) are numbered afresh in their order; replacing, every
    // rank keeps its number.
    std::vector<int> next(std::size_t(generation_.world));
    int world = 0;
    for (int g = 0; g < generation_.world; ++g) {
      const bool gone = std::any_of(lost.begin(), lost.end(), [&](const Rank* r) { return r->global == g; });
      next[std::size_t(g)] = shrink && gone ? -1 : shrink ? world++ : g;
    }
    if (!shrink) world = generation_.world;
    say(who + "; recovering in place (" + round + "): the other ranks keep running" +
        (shrink ? ", at world " + std::to_string(world) + " from now on"
                : ", rank(s) " + pids + " start again" +
                      (spec_.recovery == "shrink" ? " (a shrink would leave this node without a rank)" : "")));
    std::vector<long> dead;
    for (Rank* r : lost) {
      ::kill(-r->pid, SIGKILL);  // what its process group still holds
      r->replaced = true;
      dead.push_back(r->pid);
    }
    shm::remove_segments_of(dead);
    if (!publish_verdict({who + (shrink ? "; going on without it" : "; started again"), world, next})) return;
    if (shrink) {
      renumber(next, world, round_no_);
      return;
    }
    for (const Rank* r : lost) {
      auto& again = ranks_.emplace_back();
      again.global = r->global;
      again.local = r->local;
      spawn(again, generation_.node, generation_.world, generation_.port, generation_.token, generation_.mask);
      say("started rank " + std::to_string(again.global) + " (pid " + std::to_string(again.pid) + ") again in round " +
          std::to_string(round_no_));
    }
  }

  // ---- Note [A lost host healed in place] --------------------------------------------------------
  // With --recovery in-place or shrink and --nnodes MIN:MAX, a node found lost by its heartbeats
  // (its host gone, its link down, its launcher killed) need not end the generation: the ranks of
  // the nodes left keep their processes and go on at the smaller world in a round of their own, as
  // after a shrinking round (its word counts the lost node's ranks lost and numbers the others
  // afresh). Its ranks cannot start again anywhere, so --recovery in-place shrinks here too. The
  // lost node leaves the generation, marked left: a launcher started again there is taken in
  // again (Note [A node joins live]). The node that found it lost runs the round (node 0 with its
  // TCP store; on etcd, where every node watches every other, the first to claim "lost/<node>"):
  // 1. It claims the round and posts the lost node in it (recovery_verdict::lost_node_key).
  // 2. Every node left takes the lost node out of its ring of snapshot copies and fetches what its
  //    memory lacks of the newest snapshot from the others (a host holds its own and its
  //    predecessor's files: the lost node's are on its successor only), then says it is ready.
  //    With one node left it stops copying and tells its ranks (snapshot_env::kNoCopies), or each
  //    would wait its collective timeout for copies at every snapshot.
  // 3. Once every node left is ready, the round's word goes out: the survivors, waiting for it in
  //    rejoin_process_group, reload that snapshot from their own host's memory at the new world.
  // Elsewhere the generation fails as before, saying why: not elastic, too few nodes left, a world
  // an earlier round shrank (the lost node's ranks carry numbers this launcher did not give), a
  // round still open, no restart left, a node left not ready in time. Node 0's loss with its TCP
  // store is no such case: the store is gone with it.
  void recover_lost_node(int node, const std::string& what) {
    try {  // on etcd every node left finds it lost: one runs the round, the others learn it
      if (recovery_store().add(round_key("lost/" + std::to_string(node)), 1) != 1) return;
    } catch (const Error& e) {
      watch_->fail_lost(what + "; not recovered in place: the store could not be reached (" + e.what() + ")");
      return;
    }
    learn_rounds();  // the world now, if another node's round shrank it
    std::string why_not;
    const int left = int(members_.size()) - 1;
    if (!spec_.min_nnodes)
      why_not = "--nnodes is not elastic (MIN:MAX)";
    else if (left < spec_.min_nnodes)
      why_not = "only " + std::to_string(left) + " node(s) would be left, and --nnodes " + std::to_string(spec_.min_nnodes) + ":" +
                std::to_string(spec_.nnodes) + " needs at least " + std::to_string(spec_.min_nnodes);
    else if (generation_.world != int(members_.size()) * spec_.nproc_per_node)
      why_not = "an earlier round of this generation shrank the world";
    else if (round_)
      why_not = "round " + std::to_string(round_no_) + " of in-place recovery is still open";
    else if (!can_recover_in_place())
      why_not = restart_ + recoveries() >= spec_.max_restarts ? "no restart is left (--max-restarts " + std::to_string(spec_.max_restarts) + ")"
                                                              : "the job is stopping";
    const int claimed = why_not.empty() ? claim_round(why_not) : 0;
    if (!claimed) {
      watch_->fail_lost(what + (why_not.rfind("; ", 0) == 0 ? why_not : "; not recovered in place: " + why_not));
      return;
    }
    round_no_ = claimed;
    learned_round_ = claimed;
    round_ = RecoveryRound{clock::now(), what};
    const int index = int(std::find(members_.begin(), members_.end(), node) - members_.begin());
    LostNodeRound lr{what, std::vector<int>(std::size_t(generation_.world)), 0, {}, clock::now() + spec_.rdzv_timeout};
    for (int g = 0; g < generation_.world; ++g) lr.next[std::size_t(g)] = g / spec_.nproc_per_node == index ? -1 : lr.world++;
    say(what + "; recovering in place (round " + std::to_string(round_no_) + ", " + std::to_string(restart_ + recoveries()) + " of " +
        std::to_string(spec_.max_restarts) + " restarts): the ranks of the node(s) left keep running, at world " +
        std::to_string(lr.world) + " from now on, without it");
    try {
      recovery_store().set(recovery_verdict::lost_node_key(restart_, round_no_), std::to_string(node));
    } catch (const Error& e) {
      end_round("the store could not be reached (" + std::string(e.what()) + ")");
      return;
    }
    leave_out(node);
    for (int k : members_)
      if (k != spec_.node_rank) lr.waiting.push_back(k);
    lost_round_ = std::move(lr);
    check_lost_round();
  }

  // Note [A lost host healed in place], step 2 on any node left: the ring of copies without the
  // lost node, and the newest snapshot whole in this host's memory.
  void leave_out(int node) {
    const std::vector<int> before = members_;
    members_.erase(std::remove(members_.begin(), members_.end(), node), members_.end());
    watch_->drop_member(node);
    point_mirror(before, true);
  }

  // Step 3, polled by supervise() on the node that runs the round: the word goes out once every
  // node left fetched the newest snapshot (or the round fails, naming who did not).
  void check_lost_round() {
    if (!lost_round_) return;
    auto& lr = *lost_round_;
    if (!all_ready(lr.waiting, lr.deadline, "did not fetch the newest snapshot")) return;
    const auto verdict = recovery_verdict::Verdict{lr.what + "; going on without it", lr.world, lr.next};
    lost_round_.reset();
    if (publish_verdict(verdict)) renumber(verdict.next, verdict.world, round_no_);
  }

  // The nodes of this node's round that said they are ready (recovery_verdict::ready_key) leave
  // `waiting`. True once none is left; false while some are and `deadline` has not passed; past it
  // the round ends (and with it the struct `waiting` lives in), naming who `missed` it.
  bool all_ready(std::vector<int>& waiting, clock::time_point deadline, const std::string& missed) {
    try {
      auto& st = recovery_store();
      waiting.erase(std::remove_if(waiting.begin(), waiting.end(),
                                   [&](int k) { return st.check({recovery_verdict::ready_key(restart_, round_no_, k)}); }),
                    waiting.end());
    } catch (const Error& e) {
      cannot_tell(e);
      return false;
    }
    if (waiting.empty()) return true;
    if (clock::now() < deadline) return false;
    std::string who;
    for (int k : waiting) who += (who.empty() ? "" : ", ") + watch_->label(k);
    end_round(who + " " + missed + " within --rdzv-timeout");
    return false;
  }

  // The round's word for the surviving ranks (Note [Recovering in place]); false when the store
  // cannot take it: then the round has ended, and every rank restarts.
  bool publish_verdict(const recovery_verdict::Verdict& v) {
    try {
      recovery_store().set(recovery_verdict::key(restart_, round_no_), recovery_verdict::format(v));
      return true;
    } catch (const Error& e) {
      cannot_tell(e);
      return false;
    }
  }

  void cannot_tell(const Error& e) {
    say("cannot tell the surviving ranks through the store (" + std::string(e.what()) + "); restarting every rank instead");
    end_round("the store could not be reached");
  }

  // Whether this host's launcher copies its snapshot files now, for ranks started with a copy to
  // wait for (snapshot_env::kNoCopies).
  void say_copies(bool on) {
    if (!snapshot_memory_ || snapshot_memory_->path().empty()) return;
    const auto flag = std::filesystem::path(snapshot_memory_->path()) / snapshot_env::kNoCopies;
    std::error_code ec;
    if (on) {
      std::filesystem::remove(flag, ec);
    } else {
      std::ofstream(flag) << "the other host was lost: this launcher copies no snapshot files\n";
    }
  }

  // Polled by supervise(): the round is over once every rank joined it; not over in time, the
  // generation ends (the survivors are stopped and, restarts left, every rank starts again).
  void check_round() {
    if (!round_ || grow_round_) return;
    std::int64_t joined = 0;
    try {
      joined = recovery_store().add(recovery_verdict::joined_key(restart_, round_no_), 0);
    } catch (const Error& e) {
      end_round(std::string("the store could not be read (") + e.what() + ")");
      return;
    }
    const double s = std::chrono::duration<double>(clock::now() - round_->started).count();
    if (joined >= generation_.world) {
      char took[32];
      std::snprintf(took, sizeof took, "%.2f", s);
      if (round_->grow) {
        say("grew in place: every rank joined round " + std::to_string(round_no_) + " at world " + std::to_string(generation_.world) + ", " +
            took + " s after " + round_->lost);
      } else {
        say("recovered in place: every rank joined round " + std::to_string(round_no_) + " " + took + " s after the loss");
        ++rounds_healed_;
      }
      round_.reset();
    } else if (clock::now() - round_->timed_from > spec_.rdzv_timeout) {
      end_round(std::to_string(joined) + " of " + std::to_string(generation_.world) + " ranks joined round " + std::to_string(round_no_) +
                " within --rdzv-timeout");
    }
  }

  // The round failed: the generation ends as a failure would end it without in-place recovery.
  void end_round(const std::string& why) {
    if (!first_failure_ && !interrupted_ && !peer_failure_) {
      peer_failure_ = "recovering in place failed: " + why + " (after " + round_->lost + ")";
      say(*peer_failure_ + "; stopping every rank");
      begin_stop(SIGTERM);
      if (watch_) watch_->report_failure(*peer_failure_);  // the other nodes' ranks wait in the round too
    }
    fail_round();
  }

  // A round that did not heal the job does not count as a restart: the restart it ends in does
  // (so that --max-restarts 1 still restarts every rank when, say, a trainer does not call recover).
  void fail_round() {
    round_.reset();
    lost_round_.reset();
    grow_round_.reset();
    ask_regroup(false);
  }

  // A rank stopped (SIGSTOP) for longer than --heartbeat-timeout counts as lost: killed, it is
  // recovered like any other (its peers would otherwise wait for it until their own timeout).
  void kill_long_stopped() {
    if (!in_place()) return;
    for (auto& r : ranks_)
      if (r.running && r.stopped_since && clock::now() - *r.stopped_since > spec_.heartbeat_timeout) {
        say("rank " + std::to_string(r.global) + " (pid " + std::to_string(r.pid) + ") has been stopped for longer than "
            "--heartbeat-timeout: killing it, it counts as lost");
        r.stopped_since.reset();
        ::kill(-r.pid, SIGKILL);
        ::kill(-r.pid, SIGCONT);
      }
  }

  void on_signal() {
    signalfd_siginfo si{};
    while (::read(sigfd_, &si, sizeof(si)) == ssize_t(sizeof(si))) {
      const int sig = int(si.ssi_signo);
      if (sig == SIGCHLD) {
        reap();
        continue;
      }
      if (interrupted_) {  // a second Ctrl-C: no more patience
        say("second " + std::string(sigabbrev_np(sig)) + ": killing every rank");
        signal_all(SIGKILL);
        continue;
      }
      interrupted_ = sig;
      say("got SIG" + std::string(sigabbrev_np(sig)) + ": forwarding it to every rank");
      signal_all(sig);
      stop_deadline_ = clock::now() + spec_.kill_grace;
    }
  }

  // Another node failed or vanished (Note [Failures cross hosts]): this node's ranks go too.
  void on_peer_failure() {
    std::uint64_t count;
    [[maybe_unused]] auto r = ::read(watch_->event_fd(), &count, sizeof count);
    for (const auto& [node, what] : watch_->take_lost()) recover_lost_node(node, what);
    if (peer_failure_ || first_failure_ || interrupted_) return;
    peer_failure_ = watch_->peer_failure();
    if (!peer_failure_) return;
    say(*peer_failure_ + "; stopping this node's rank(s)");
    begin_stop(SIGTERM);
  }

  bool any_running() const {
    for (const auto& r : ranks_)
      if (r.running) return true;
    return false;
  }

  void supervise() {
    // Non-blocking signal reads: on_signal drains every queued signal.
    ::fcntl(sigfd_, F_SETFL, ::fcntl(sigfd_, F_GETFL) | O_NONBLOCK);
    char buf[65536];
    std::optional<clock::time_point> drain_until;
    for (;;) {
      std::vector<pollfd> fds{{sigfd_, POLLIN, 0}, {watch_ ? watch_->event_fd() : -1, POLLIN, 0}};
      std::vector<std::pair<int*, OutputRelay*>> pipes;
      for (auto& r : ranks_) {
        for (auto [fd, relay] : {std::pair{&r.out_fd, r.out.get()}, std::pair{&r.err_fd, r.err.get()}})
          if (*fd >= 0) {
            fds.push_back({*fd, POLLIN, 0});
            pipes.emplace_back(fd, relay);
          }
      }
      const bool running = any_running();
      if (!running && pipes.empty()) {
        learn_rounds();  // a round its ranks went through in the last 200 ms: said all the same
        return;
      }
      if (!running && !drain_until) drain_until = clock::now() + std::chrono::seconds(2);
      if (drain_until && clock::now() >= *drain_until) break;  // a grandchild holds a pipe open: let it be
      int wait_ms = 200;
      if (stop_deadline_ && running) {
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(*stop_deadline_ - clock::now()).count();
        if (left <= 0) {
          if (!killed_) say("grace period over: killing the remaining rank(s)");
          killed_ = true;
          signal_all(SIGKILL);
        }
        wait_ms = int(std::clamp<long>(left, 10, 200));
      }
      const int n = ::poll(fds.data(), fds.size(), wait_ms);
      if (n < 0 && errno != EINTR) throw Error("poll: " + std::string(std::strerror(errno)));
      check_round();
      check_lost_round();
      check_grow_round();
      kill_long_stopped();
      if (clock::now() - learned_at_ > std::chrono::milliseconds(200)) {
        learned_at_ = clock::now();
        learn_rounds();
        look_for_joiners();
      }
      if (n <= 0) {
        reap();  // belt and braces: SIGCHLDs coalesce
        continue;
      }
      if (fds[0].revents) on_signal();
      if (fds[1].revents) on_peer_failure();
      for (std::size_t i = 2; i < fds.size(); ++i) {
        if (!fds[i].revents) continue;
        auto [fd, relay] = pipes[i - 2];
        const ssize_t got = ::read(*fd, buf, sizeof(buf));
        if (got > 0) {
          relay->feed(buf, std::size_t(got));
        } else if (got == 0 || (errno != EINTR && errno != EAGAIN)) {
          relay->flush();
          ::close(*fd);
          *fd = -1;
        }
      }
    }
    for (auto& r : ranks_) {
      r.out->flush();
      r.err->flush();
    }
  }

  // Note [Restarting the worker group]
  // With --max-restarts N a rank's failure (its exit non-zero, a signal, or a hang its peers'
  // timeouts turn into one) stops the other ranks as without it, and then, instead of ending the
  // job, starts every rank again: the same command and ranks, the same store, a new generation in
  // SHARDFLOW_RESTART_COUNT (and torchrun's TORCHELASTIC_RESTART_COUNT). The store outlives the
  // generations, so each generation's keys are its own: init_process_group puts the generation in
  // every key (g<k>/pg<n>/...), and no rank of generation k+1 reads an address of generation k.
  // Across nodes every node's launcher stops its ranks on the failure (Note [Failures cross
  // hosts]), and they restart together only when all of them choose to (NodeWatch::
  // agree_to_restart); a node lost, rather than a rank, ends the job. What the ranks resume from
  // is theirs to find (the runtime's snapshots, or the trainer's own checkpoint); a signal to the
  // launcher (Ctrl-C) ends the job rather than restarting it.
  bool restart_wanted() {
    if (!first_failure_ && !peer_failure_) return false;  // the job is done
    if (left_out_) {  // Note [A lost host healed in place]: the others went on without this node
      not_restarted_ = "this node was left out of the job";
      return false;
    }
    if (spec_.max_restarts == 0) return false;
    const bool lost = watch_ && watch_->lost_a_node();
    fail_round();  // the generation ends: a round still open did not heal it
    bool want = !interrupted_ && restart_ + recoveries() < spec_.max_restarts && (!lost || spec_.min_nnodes > 0);
    if (lost && !spec_.min_nnodes && !interrupted_) not_restarted_ = "a lost node is not restarted around without --nnodes MIN:MAX";
    if (!watch_) return want;
    std::string why_not;
    const auto next = watch_->decide_restart(want, spec_.heartbeat_timeout + spec_.kill_grace + std::chrono::seconds(5), why_not);
    if (!next) {
      if (want) {
        say("not restarting: " + why_not);
        not_restarted_ = why_not;
      }
      return false;
    }
    std::string gone, back;
    for (int k : members_)
      if (std::find(next->begin(), next->end(), k) == next->end()) gone += (gone.empty() ? "" : ", ") + watch_->label(k);
    for (int k : *next)
      if (std::find(members_.begin(), members_.end(), k) == members_.end()) back += (back.empty() ? "" : ", ") + watch_->label(k);
    const std::string size = std::to_string(next->size()) + " node(s), world " + std::to_string(int(next->size()) * spec_.nproc_per_node);
    if (!gone.empty()) say("going on without " + gone + " (lost for longer than --rejoin-timeout): " + size);
    if (!back.empty()) say("taking " + back + " back in, which asked to rejoin: " + size);
    members_ = *next;
    return true;
  }

  void next_generation() {
    recoveries_before_ = recoveries_seen_;  // restart_wanted() counted them; this generation's keys are left behind
    rounds_healed_ = 0;
    say((first_failure_ ? blame() : *peer_failure_) + "; restarting every rank (" + std::to_string(restart_ + recoveries_seen_ + 1) + " of " +
        std::to_string(spec_.max_restarts) + " restarts)");
    remove_shared_memory();
    ranks_.clear();
    first_failure_.reset();
    peer_failure_.reset();
    stop_deadline_.reset();
    killed_ = false;
    store_lost_.clear();
    if (watch_) watch_->next_generation();
    ++restart_;
    round_no_ = 0;  // a generation's keys are its own, its rounds too
    learned_round_ = 0;
    left_out_in_round_ = 0;
    round_.reset();
    lost_round_.reset();
    grow_round_.reset();
    grown_in_round_ = grow_flag_round_ = 0;
    ask_regroup(false);  // a growing round another node ran, and failed before this node heard the end of it
  }

  // A rank that died (or was stopped) left its shared-memory buffers in /dev/shm: this job's are
  // named after its ranks' pids (runtime/comm/shm_names.hpp).
  void remove_shared_memory() {
    std::vector<long> pids;
    for (const auto& r : ranks_) pids.push_back(r.pid);
    shm::remove_segments_of(pids);
  }

  int finish() {
    remove_shared_memory();
    mirror_.reset();  // before the memory it writes into goes
    if (snapshot_memory_) snapshot_memory_->remove();
    if (watch_) {
      // Node 0 keeps the store up until the others have read the outcome (or are gone).
      const bool failing = peer_failure_ || first_failure_ || interrupted_;
      const auto limit = !failing ? std::chrono::milliseconds(std::chrono::hours(24 * 365))
                                  : spec_.heartbeat_timeout + spec_.kill_grace + std::chrono::seconds(2);
      other_nodes_ = watch_->finish(failing ? 1 : 0, limit);
    }
    const int code = verdict();
    if (code == 0 && !other_nodes_.empty()) {
      say("FAILED: this node's ranks succeeded, but " + other_nodes_);
      return 1;
    }
    return code;
  }

  int verdict() {
    if (peer_failure_) {
      say("FAILED: " + *peer_failure_ + "; this node's rank(s) were stopped" + restarts_note());
      return 1;
    }
    if (interrupted_) {
      say("stopped by SIG" + std::string(sigabbrev_np(interrupted_)));
      return 128 + interrupted_;
    }
    if (!first_failure_) return 0;
    say("FAILED: " + blame() + restarts_note());
    return exit_code_of(blamed_rank().status);
  }

  // Why the job ends after a failure although it could restart.
  std::string restarts_note() const {
    if (!spec_.max_restarts || interrupted_) return "";
    if (!not_restarted_.empty()) return "; not restarted: " + not_restarted_;
    return "; restarts used up (" + std::to_string(restart_ + recoveries_seen_) + " of " + std::to_string(spec_.max_restarts) + ")";
  }

  // Which rank failed and how, with the others' fate: the verdict's words, and a restart's.
  const Rank& blamed_rank() const {
    // The first rank to fail is usually the cause. But a rank killed by a signal nobody here sent
    // (kill -9, the OOM killer) often dies a moment before a peer notices the closed connection
    // and exits first: then the killed rank is the one to name.
    int blamed = *first_failure_;
    for (const auto& r : ranks_)
      if (!r.replaced && r.global != *first_failure_ && !r.running && WIFSIGNALED(r.status) && !r.signal_ours) {
        blamed = r.global;
        break;
      }
    for (const auto& r : ranks_)
      if (!r.replaced && r.global == blamed) return r;
    return ranks_.front();
  }

  std::string blame() const {
    const Rank* failed = &blamed_rank();
    const int blamed = failed->global;
    std::string others, stopped;
    for (const auto& r : ranks_) {
      if (r.replaced) continue;  // recovered in place: the supervisor said so then
      if (r.global != blamed)
        others += "; rank " + std::to_string(r.global) + " " + describe_status(r.status);
      if (r.stopped_by && r.global != blamed)
        stopped += "; rank " + std::to_string(r.global) + " (pid " + std::to_string(r.pid) + ") had been stopped by SIG" +
                   sigabbrev_np(r.stopped_by) + ": likely the cause";
    }
    others += stopped;
    return "rank " + std::to_string(failed->global) + " (local rank " + std::to_string(failed->local) + ", pid " +
           std::to_string(failed->pid) + ") " + describe_status(failed->status) + others + (store_lost_.empty() ? "" : "; " + store_lost_) +
           (other_nodes_.empty() ? "" : "; " + other_nodes_ + ": likely the cause");
  }

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
  };
  std::optional<RecoveryRound> round_;  // the round of in-place recovery not yet over
  struct LostNodeRound {  // Note [A lost host healed in place]: run here, its word not out yet
    std::string what;
    std::vector<int> next;  // the word's numbers
    int world;
    std::vector<int> waiting;  // the nodes left not ready yet
    clock::time_point deadline;
  };
  std::optional<LostNodeRound> lost_round_;
  struct GrowRound {  // Note [A node joins live]: run here, its word not out yet
    int node;
    std::string what;
    std::vector<int> before;   // the nodes before it
    bool admitted = false;     // every rank is in the round and the node was told to come
    std::vector<int> waiting;  // the nodes not ready yet, once admitted
    clock::time_point deadline;
  };
  std::optional<GrowRound> grow_round_;
  int grown_in_round_ = 0;        // the newest growing round this node applied (a learner)
  int grow_flag_round_ = 0;       // the newest growing round whose word this node passed to its ranks (a learner)
  std::vector<int> refused_joins_;  // nodes told once that they cannot join live
  bool joined_live_ = false;      // this launcher was taken into a running generation
  int left_out_in_round_ = 0;  // the newest round whose lost node this node took out (a learner)
  bool left_out_ = false;      // this node was the one found lost: the others went on without it
  int round_no_ = 0;           // the round this node ran last in this generation (Note [Rounds across nodes])
  int learned_round_ = 0;      // the generation's rounds whose renumbering this node applied (Note [Rounds across nodes])
  clock::time_point learned_at_{};
  bool store_silent_ = false;  // learn_rounds() met an unreachable store: it asks no more
  int rounds_healed_ = 0;      // of them, over: this generation's count where the store cannot say
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

}  // namespace

int run(const LaunchSpec& spec) {
  Supervisor s(spec);
  return s.run();
}

}  // namespace shardflow::launch
