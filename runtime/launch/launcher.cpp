// `shardflow run` (launcher.hpp): the job of one node from start to end. The supervisor's other
// parts: supervise.cpp (the ranks' processes), rounds.cpp (in-place recovery), lost_node_round.cpp
// and grow_round.cpp (a node lost, a node taken in); supervisor.hpp lists them.
#include "runtime/launch/launcher.hpp"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <map>
#include <random>

#include "kernels/cpu/blas.hpp"
#include "runtime/bootstrap/etcd_names.hpp"
#include "runtime/bootstrap/snapshot_env.hpp"
#include "runtime/comm/shm_names.hpp"
#include "runtime/launch/rank_process.hpp"
#include "runtime/launch/supervisor.hpp"
#include "shardflow/errors.hpp"

namespace shardflow::launch {
namespace {

std::string random_token() {
  std::random_device rd;
  char buf[33];
  std::snprintf(buf, sizeof(buf), "%08x%08x%08x%08x", rd(), rd(), rd(), rd());
  return buf;
}

}  // namespace

void say(const std::string& line) {
  const std::string s = "shardflow run: " + line + "\n";
  [[maybe_unused]] auto w = ::write(STDERR_FILENO, s.data(), s.size());
}

int Supervisor::run() {
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

// Signals arrive through a descriptor, in the same poll loop as the ranks' output. Blocked
// before the store's thread exists, so that it inherits the mask and never takes them. Returns
// the mask as it was, for the ranks.
sigset_t Supervisor::take_signals() {
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
void Supervisor::probe_blas() {
  std::vector<std::pair<std::string, std::string>> blas_env;
  const auto probe = kernels::blas::probe_in_child("/proc/self/exe", "__blas-probe", &blas_env);
  for (const auto& [name, value] : blas_env) ::setenv(name.c_str(), value.c_str(), 1);
  if (probe.ran && !(probe.thread_invariant && probe.repeatable)) say(probe.line());
}

// Node 0 serves the store; returns the port the ranks reach it on. Where this node's launcher
// and ranks reach the store: on node 0 the address it is bound to (loopback for a one-node job,
// whatever --master-addr says), elsewhere the master address.
int Supervisor::serve_store(const std::string& token, bool one_node) {
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
std::optional<int> Supervisor::join_nodes(const net::LocalAddress& local, int port, const std::string& token) {
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
void Supervisor::run_generations(int port, const std::string& token, const sigset_t& old) {
  std::vector<int> before = members_;  // the nodes of the generation before (a joiner's: the others)
  const bool joiner = restart_ > 0 || joined_live_;
  if (joiner) before.erase(std::remove(before.begin(), before.end(), spec_.node_rank), before.end());
  for (;;) {
    std::string started;
    // This node's place among the generation's nodes (Note [Shrinking the world]).
    const int node = int(std::find(members_.begin(), members_.end(), spec_.node_rank) - members_.begin());
    const int world = spec_.nproc_per_node * int(members_.size());
    generation_ = {node, world, port, token, old};
    // A node taken in from memory fetches nothing: its ranks read no snapshot (Note [A join from memory]).
    const bool from_memory = joined_live_ && watch_->joined_from_memory();
    partial_copies_ |= from_memory;
    point_mirror(before, (restart_ > 0 || joined_live_) && !from_memory);
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
std::string Supervisor::store_name(const std::string& host, int port) const {
  if (spec_.etcd_endpoints.empty()) return host + ":" + std::to_string(port);
  return "etcd at " + etcd::join_endpoints(spec_.etcd_endpoints) + " (job " + spec_.rdzv_id + ")";
}

// Flags first, then the environment (Note [Choosing the socket address]).
net::SocketChoice Supervisor::socket_choice() const {
  if (!spec_.local_addr.empty()) return {spec_.local_addr, "", "--local-addr"};
  if (!spec_.iface.empty()) return {"", spec_.iface, "--iface"};
  return net::socket_choice_from_env();
}

// Note [Snapshots on the other host]: every node copies, or none keeps snapshots in memory (a
// snapshot would be whole on no host, and the restart would fall back to an older one on disk).
void Supervisor::offer_mirrored_memory(const std::string& address, const std::string& token) {
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
// before this node's ranks load it. With `index_only` (Note [A join from memory]) the node that
// rejoined gets only that snapshot's index: its ranks read none of it.
void Supervisor::point_mirror(const std::vector<int>& before, bool fetch, bool index_only) {
  mirror_label_.clear();
  if (!mirror_) return;
  const auto address = mirror_addresses();
  const auto me = std::find(members_.begin(), members_.end(), spec_.node_rank);
  const int next = members_.size() >= 2 ? *(std::next(me) == members_.end() ? members_.begin() : std::next(me)) : -1;
  if (address.count(next)) mirror_label_ = watch_->label(next);
  if (fetch) gather_newest(address);
  const bool returned = next >= 0 && std::find(before.begin(), before.end(), next) == before.end();
  using Seed = SnapshotMirror::Seed;
  mirror_->send_to(mirror_label_.empty() ? "" : address.at(next), mirror_label_, !returned ? Seed::none : index_only ? Seed::index : Seed::whole);
  say_copies(!mirror_label_.empty());
  if (returned && !mirror_label_.empty() && !mirror_->wait_seeded(spec_.heartbeat_timeout + std::chrono::seconds(60)))
    say("snapshot copies: the newest snapshot did not reach " + mirror_label_ + " in time; its ranks may resume from disk");
}

std::map<int, std::string> Supervisor::mirror_addresses() {
  std::map<int, std::string> address;
  for (int k : members_) {
    if (k == spec_.node_rank) continue;
    try {
      if (auto a = watch_->read("mirror/" + std::to_string(k)); a != "none") address[k] = a;
    } catch (const Error& e) {
      say("snapshot copies: " + watch_->label(k) + " posted no address (" + e.what() + ")");
    }
  }
  return address;
}

// This host's newest snapshot whole: what it lacks, fetched from the others. With two nodes from
// the start a no-op: each host holds every file.
void Supervisor::gather_newest(const std::map<int, std::string>& address) {
  if (!mirror_ || address.empty()) return;
  std::vector<std::string> peers;
  for (const auto& [k, a] : address) peers.push_back(a);
  mirror_->assemble(peers);
}

// MASTER_PORT for the ranks, chosen once: on one node a port the kernel says is free now (the
// store's own is ephemeral, and the one after it was seen taken by another process's connection);
// across nodes the port after the store's, which every node derives alike (29500 -> 29501).
int Supervisor::torch_port(int store_port) {
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
bool Supervisor::restart_wanted() {
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

void Supervisor::next_generation() {
  recoveries_before_ = recoveries_seen_;  // restart_wanted() counted them; this generation's keys are left behind
  rounds_healed_ = 0;
  refused_round_ = 0;
  take_memory_file(snapshot_env::kRefused);  // the generation before's (Note [A round that did not heal])
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
  held_word_.reset();
  grow_round_.reset();
  grown_in_round_ = grow_flag_round_ = 0;
  ask_regroup(false);  // a growing round another node ran, and failed before this node heard the end of it
}

// A rank that died (or was stopped) left its shared-memory buffers in /dev/shm: this job's are
// named after its ranks' pids (runtime/comm/shm_names.hpp).
void Supervisor::remove_shared_memory() {
  std::vector<long> pids;
  for (const auto& r : ranks_) pids.push_back(r.pid);
  shm::remove_segments_of(pids);
}

int Supervisor::finish() {
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

int Supervisor::verdict() {
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
std::string Supervisor::restarts_note() const {
  if (!spec_.max_restarts || interrupted_) return "";
  if (!not_restarted_.empty()) return "; not restarted: " + not_restarted_;
  return "; restarts used up (" + std::to_string(restart_ + recoveries_seen_) + " of " + std::to_string(spec_.max_restarts) + ")";
}

// Which rank failed and how, with the others' fate: the verdict's words, and a restart's.
const Rank& Supervisor::blamed_rank() const {
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

std::string Supervisor::blame() const {
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

int run(const LaunchSpec& spec) {
  Supervisor s(spec);
  return s.run();
}

}  // namespace shardflow::launch
