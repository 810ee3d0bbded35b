#include "runtime/launch/node_watch.hpp"

#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <utility>

#include "runtime/bootstrap/etcd_names.hpp"
#include "runtime/bootstrap/recovery_verdict.hpp"
#include "shardflow/errors.hpp"
#include "shardflow/store.hpp"

namespace shardflow::launch {
namespace {

using clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

std::string seconds(milliseconds ms) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f s", double(ms.count()) / 1000.0);
  return buf;
}

std::string host_name() {
  char name[256] = {};
  ::gethostname(name, sizeof(name) - 1);
  return name;
}

// What a node posts at the rendezvous: "host addr nproc nnodes".
struct NodeInfo {
  std::string host, address;
  int nproc = 0, nnodes = 0;
  static NodeInfo parse(const std::string& s) {
    NodeInfo n;
    std::istringstream in(s);
    in >> n.host >> n.address >> n.nproc >> n.nnodes;
    return n;
  }
};

// A posted failure says what kind it is: a rank failed on a node still there, or a node was lost.
constexpr std::string_view kRankFailed = "rank|", kNodeLost = "lost|";
// What a heartbeat pass's own calls may take on a store that answers (a few per node, each a
// millisecond or so on etcd): beyond it, the gap between two beats is a stall (Note [A stall is
// nobody's silence]).
constexpr std::chrono::milliseconds kUsualPass{250};

// The nodes of the next generation in node 0's decision, "restart 0 2 3".
std::vector<int> decided_nodes(const std::string& decision) {
  std::vector<int> nodes;
  std::istringstream in(decision.substr(std::string_view("restart").size()));
  for (int k; in >> k;) nodes.push_back(k);
  return nodes;
}

std::pair<std::string, bool> parse_failure(const std::string& posted) {  // (words, a node was lost)
  if (posted.rfind(kNodeLost, 0) == 0) return {posted.substr(kNodeLost.size()), true};
  if (posted.rfind(kRankFailed, 0) == 0) return {posted.substr(kRankFailed.size()), false};
  return {posted, false};
}

}  // namespace

std::string NodeWatch::generation_key(const std::string& k) const {
  std::lock_guard lock(mu_);
  return key("g" + std::to_string(generation_) + "/" + k);
}

namespace {

milliseconds time_left(clock::time_point deadline) { return std::chrono::duration_cast<milliseconds>(deadline - clock::now()); }

void stop_if_interrupted(const std::function<bool()>& interrupted) {
  if (interrupted && interrupted()) throw Error("rendezvous: interrupted by a signal");
}

}  // namespace

std::unique_ptr<Store> NodeWatch::open_store(milliseconds timeout) const {
  StoreRendezvous where = o_.store;
  where.timeout = timeout;
  return shardflow::connect_store(where);
}

std::string NodeWatch::store_name() const { return (on_etcd() ? "the etcd store at " : "node 0's store at ") + store_where_; }

// Node 0's store may not be up yet: connect in short attempts, so that Ctrl-C is heard.
void NodeWatch::connect_store(clock::time_point deadline, const std::function<bool()>& interrupted, const std::string& how) {
  for (;;) {
    stop_if_interrupted(interrupted);
    try {
      main_ = open_store(std::clamp(time_left(deadline), milliseconds(1), milliseconds(1000)));
      break;
    } catch (const TimeoutError&) {
      if (time_left(deadline).count() <= 0)
        throw TimeoutError("rendezvous: " + store_name() + " accepted no connection within " + seconds(o_.rdzv_timeout) +
                           (on_etcd() ? ": is etcd running there?" : ": is node 0's launcher running? (" + how + ")"));
    } catch (const CommError& e) {
      throw CommError("rendezvous: " + store_name() + " refused this launcher (" + e.what() +
                      "): every node needs the same --token (or SHARDFLOW_STORE_TOKEN)");
    }
  }
  main_->set_timeout(o_.heartbeat_timeout);
}

// Note [Rejoining]: a node left out at a restart may claim its rank again, once.
bool NodeWatch::claim_node_rank() {
  const std::string me = std::to_string(o_.node_rank);
  const bool taken = main_->add(key("claim/" + me), 1) > 1;
  const bool rejoining =
      taken && o_.min_nnodes > 0 && main_->check({key("left/" + me)}) && main_->add(key("rejoin-claim/" + me), 1) == 1;
  if (taken && !rejoining) {
    std::string holder = "another launcher";
    if (main_->check({key("node/" + me)})) holder = "host " + NodeInfo::parse(main_->get(key("node/" + me))).host;
    throw UsageError("rendezvous: node rank " + me + " is already taken by " + holder +
                     ": give each node's launcher its own --node-rank in [0, " + std::to_string(o_.nnodes) + ")");
  }
  main_->set(key("node/" + me), host_name() + " " + o_.local_address + " " + std::to_string(o_.nproc_per_node) + " " +
                                    std::to_string(o_.nnodes));
  return rejoining;
}

// Until every node's record is in the store, or node 0's verdict that one never came.
void NodeWatch::await_nodes(const std::vector<std::string>& keys, clock::time_point deadline, const std::function<bool()>& interrupted,
                            const std::string& how) {
  try {
    while (!main_->check(keys)) {
      stop_if_interrupted(interrupted);
      // Node 0's verdict, when its deadline passed first: the same words on every node.
      if (main_->check({key("rdzv_failed")})) throw TimeoutError(main_->get(key("rdzv_failed")));
      if (time_left(deadline).count() <= 0) {
        std::string missing;
        int count = 0;
        for (int k = 0; k < o_.nnodes; ++k)
          if (!main_->check({keys[std::size_t(k)]})) missing += (count++ ? ", " : "") + std::to_string(k);
        const std::string why = "rendezvous: node" + std::string(count > 1 ? "s " : " ") + missing + " of " +
                                std::to_string(o_.nnodes) + " never arrived at the store " + store_where_ + " within " +
                                seconds(o_.rdzv_timeout) + " (" + how + ")";
        if (o_.node_rank == 0) {
          main_->set(key("rdzv_failed"), why);
          std::this_thread::sleep_for(milliseconds(300));  // the store goes with this launcher: let them read it
        }
        throw TimeoutError(why);
      }
      std::this_thread::sleep_for(std::min(time_left(deadline), milliseconds(100)));
    }
  } catch (const TimeoutError&) {
    throw;
  } catch (const CommError& e) {
    throw CommError("rendezvous: " + store_name() + " went away while waiting for the other nodes (" + e.what() +
                    (on_etcd() ? ")" : "): node 0's launcher stopped or was stopped"));
  }
}

// Every node must describe the same job: a mismatch here would be a hang in the first collective.
// Every node finds a mismatch itself, from the same records; node 0's store must outlive the
// others' reading them, or a node that polls a little later hears only that the store went away
// (seen under load: the mismatch named on node 0 only).
void NodeWatch::check_same_job(const std::vector<std::string>& keys) {
  std::vector<NodeInfo> nodes;
  for (const auto& k : keys) nodes.push_back(NodeInfo::parse(main_->get(k)));
  for (int k = 0; k < o_.nnodes; ++k) {
    const auto& n = nodes[std::size_t(k)];
    labels_.push_back("node " + std::to_string(k) + " (host " + n.host + ", " + n.address + ")");
  }
  main_->add(key("rdzv_read"), 1);
  auto keep_store_until_read = [&] {
    if (o_.node_rank != 0) return;
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(3);
    while (main_->add(key("rdzv_read"), 0) < o_.nnodes && std::chrono::steady_clock::now() < until)
      std::this_thread::sleep_for(milliseconds(20));
  };
  for (int k = 0; k < o_.nnodes; ++k) {
    const auto& n = nodes[std::size_t(k)];
    if (n.nnodes == o_.nnodes && n.nproc == o_.nproc_per_node) continue;
    keep_store_until_read();
    throw UsageError("rendezvous: " + labels_[std::size_t(k)] + " was started with --nnodes " + std::to_string(n.nnodes) +
                     " --nproc-per-node " + std::to_string(n.nproc) + ", " + labels_[std::size_t(o_.node_rank)] + " with --nnodes " +
                     std::to_string(o_.nnodes) + " --nproc-per-node " + std::to_string(o_.nproc_per_node) +
                     ": every node must be started with the same values");
  }
}

NodeWatch::NodeWatch(NodeWatchOptions o, const std::function<bool()>& interrupted) : o_(std::move(o)) {
  store_where_ = on_etcd() ? etcd::join_endpoints(o_.store.etcd_endpoints)
                           : o_.store.store_host + ":" + std::to_string(o_.store.store_port);
  const auto deadline = clock::now() + o_.rdzv_timeout;
  const std::string how = "start `shardflow run --nnodes " + std::to_string(o_.nnodes) + " --node-rank K --master-addr " + o_.store.store_host +
                          " --master-port " + std::to_string(o_.store.store_port) + " --token ...` on every node";
  connect_store(deadline, interrupted, how);
  const bool rejoining = claim_node_rank();
  std::vector<std::string> keys;
  for (int k = 0; k < o_.nnodes; ++k) keys.push_back(key("node/" + std::to_string(k)));
  await_nodes(keys, deadline, interrupted, how);
  check_same_job(keys);
  event_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (event_fd_ < 0) throw Error("eventfd: " + std::string(std::strerror(errno)));
  members_.clear();
  for (int k = 0; k < o_.nnodes; ++k) members_.push_back(k);
  if (rejoining) wait_to_rejoin(deadline, interrupted);
}

void NodeWatch::wait_to_rejoin(clock::time_point deadline, const std::function<bool()>& interrupted) {
  const std::string me = std::to_string(o_.node_rank);
  try {
    main_->remove(key("joined/" + me));
    main_->set(key("join/" + me), "1");
    if (o_.say)
      o_.say(label(o_.node_rank) + " was left out of this job: waiting (--rdzv-timeout " + seconds(o_.rdzv_timeout) + ") for " +
             (o_.heal_lost_nodes ? "the running ranks to take it in at their next snapshot in memory, or " : "") +
             "the next restart to take it back in");
    auto next_beat = clock::now();
    while (!main_->check({key("joined/" + me)})) {
      if (interrupted && interrupted()) throw Error("rejoining: interrupted by a signal");
      if (main_->check({key("exit/0")}))
        throw Error("rejoining: the job ended (" + label(0) + " finished) before a restart took " + label(o_.node_rank) + " back in");
      if (clock::now() >= deadline)
        throw TimeoutError("rejoining: no restart took " + label(o_.node_rank) + " back in within --rdzv-timeout " +
                           seconds(o_.rdzv_timeout) + " (the job restarts only after a failure)");
      if (clock::now() >= next_beat) {  // node 0 takes in only a node whose heartbeat moves
        main_->add(key("hb/" + me), 1);
        next_beat += o_.heartbeat_interval;
      }
      std::this_thread::sleep_for(milliseconds(50));
    }
    // "G" from a restart's decision; "G R" from round R of generation G (Note [A node joins live]),
    // "G R memory" where its ranks get their state from the running ranks' (Note [A join from memory]).
    std::istringstream joined(main_->get(key("joined/" + me)));
    joined >> joined_at_;
    if (joined >> joined_round_) {
      members_ = recovery_verdict::parse_nodes(main_->get(recovery_verdict::members_key(joined_at_, joined_round_)));
      std::string how;
      joined_from_memory_ = joined >> how && how == "memory";
    }
    else
      members_ = decided_nodes(main_->get(key("g" + std::to_string(joined_at_ - 1) + "/decision")));
  } catch (const CommError& e) {
    throw Error("rejoining: " + label(0) + "'s store went away (" + std::string(e.what()) + "): the job ended before a restart took " +
                label(o_.node_rank) + " back in");
  }
  generation_ = joined_at_;
}

std::vector<int> NodeWatch::asking_to_join() {
  std::vector<int> asking;
  for (int k = 0; k < o_.nnodes; ++k) {
    {
      std::lock_guard lock(mu_);
      if (member(k)) continue;
    }
    if (main_->check({key("join/" + std::to_string(k))})) asking.push_back(k);
  }
  return asking;
}

// Note [Rejoining]: the returning launcher learns where it joins; its earlier launcher's exit and
// copy address are not its own.
void NodeWatch::tell_joined(int node, const std::string& joined) {
  const std::string kk = std::to_string(node);
  for (const auto& stale : {"join/", "left/", "exit/", "mirror/", "rejoin-claim/"}) main_->remove(key(stale + kk));
  main_->set(key("joined/" + kk), joined);
}

void NodeWatch::admit(int node, const std::string& joined) {
  if (!joined.empty()) tell_joined(node, joined);
  peers_.readmit(node, clock::now());
  std::lock_guard lock(mu_);
  if (!member(node)) {
    members_.push_back(node);
    std::sort(members_.begin(), members_.end());
  }
}

std::vector<int> NodeWatch::members() const {
  std::lock_guard lock(mu_);
  return members_;
}

// Note [Rejoining]: the nodes not in `next` that asked to join and whose heartbeat moves (watched
// for two heartbeat intervals).
std::vector<int> NodeWatch::returning(const std::vector<int>& next) {
  std::vector<int> asking;
  std::vector<std::int64_t> beats;
  for (int k = 0; k < o_.nnodes; ++k)
    if (std::find(next.begin(), next.end(), k) == next.end() && main_->check({key("join/" + std::to_string(k))})) {
      asking.push_back(k);
      beats.push_back(main_->add(key("hb/" + std::to_string(k)), 0));
    }
  if (asking.empty()) return {};
  std::this_thread::sleep_for(std::max(2 * o_.heartbeat_interval, milliseconds(200)));
  std::vector<int> alive;
  for (std::size_t i = 0; i < asking.size(); ++i)
    if (main_->add(key("hb/" + std::to_string(asking[i])), 0) != beats[i]) alive.push_back(asking[i]);
  return alive;
}

NodeWatch::~NodeWatch() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  if (event_fd_ >= 0) ::close(event_fd_);
}

std::string NodeWatch::label(int node) const {
  return node >= 0 && std::size_t(node) < labels_.size() ? labels_[std::size_t(node)] : "node " + std::to_string(node);
}

void NodeWatch::start() {
  beat_ = open_store(o_.heartbeat_timeout);
  peers_.reset(o_.nnodes, clock::now());
  thread_ = std::thread([this] { heartbeat_loop(); });
}

std::optional<std::string> NodeWatch::peer_failure() const {
  std::lock_guard lock(mu_);
  return failure_;
}

// Note [A stall is nobody's silence]
// A peer is lost when its heartbeat count has not moved for the heartbeat timeout. But that
// silence is measured by this node, through the store: when the store holds every write up (an
// etcd election after its leader's host was cut off, a member that does not answer, this host's
// heartbeat thread not scheduled), the peers' beats stall exactly as this node's own do, and a
// healthy peer may look lost (one way to the three-host soak's one failure in 480: "no heartbeat
// for 3.4 s" at a 3 s timeout while that node ran). So the time this node's own beats were held
// up beyond their interval does not count against anyone: a truly lost peer is found that much
// later, never not.
void NodeWatch::heartbeat_loop() {
  const std::string me = std::to_string(o_.node_rank);
  std::unique_lock lock(mu_);
  std::optional<clock::time_point> landed;  // when this node's last beat landed
  while (!stopping_) {
    const bool known = failure_ || reported_;
    lock.unlock();
    try {
      beat_->add(key("hb/" + me), 1);
      // Note [A stall is nobody's silence]: beyond the interval and a pass's usual calls, the time
      // between two of this node's beats is time the store (or this host) held it up.
      const auto now = clock::now();
      if (landed) peers_.excuse(now - *landed - o_.heartbeat_interval - kUsualPass, now);
      landed = now;
      if (!known && beat_->add(generation_key("failures"), 0) > 0) {
        const auto [what, lost] = parse_failure(beat_->get(generation_key("failure/1")));
        peer_failed(what, false, nullptr, lost);
      }
      if (watches_peers()) watch_peers(*beat_, clock::now());
    } catch (const std::exception& e) {
      lock.lock();
      const bool done = stopping_;
      lock.unlock();
      // Node 0 serves the TCP store itself: a failing call there is no other node's fault. An etcd
      // this node cannot reach leaves it cut off: it stops its ranks (the others go on, if elastic).
      if (on_etcd() && !done) {
        cut_off_ = true;
        peer_failed(label(o_.node_rank) + " cannot reach " + store_name() + " (" + e.what() + "): it stops its ranks", false, nullptr,
                    false);
      }
      else if (o_.node_rank != 0 && !done)
        peer_failed(label(0) + " is unreachable: its store at " + store_where_ + " failed (" + e.what() +
                        "); its launcher was killed, or its host or the link is down",
                    false, nullptr, true);
      return;
    }
    lock.lock();
    cv_.wait_for(lock, o_.heartbeat_interval, [&] { return stopping_; });
  }
}

void NodeWatch::watch_peers(Store& store, clock::time_point now) {
  for (int k = 0; k < o_.nnodes; ++k) {
    if (k == o_.node_rank) continue;
    {
      std::lock_guard lock(mu_);
      if (!member(k)) continue;
    }
    if (!peers_.watched(k)) continue;
    if (store.check({key("exit/" + std::to_string(k))})) {
      peers_.mark_exited(k);
      continue;
    }
    const auto silent = peers_.beat(k, store.add(key("hb/" + std::to_string(k)), 0), now);
    if (silent < o_.heartbeat_timeout) continue;
    peers_.mark_lost(k);
    const std::string what = label(k) + " lost: no heartbeat for " + seconds(silent) +
                             " (its launcher was killed, or its host or the link is down)";
    if (o_.heal_lost_nodes) {
      {
        std::lock_guard lock(mu_);
        if (failure_ || reported_) continue;  // the generation ends anyway
        lost_.emplace_back(k, what);
      }
      const std::uint64_t one = 1;
      [[maybe_unused]] auto w = ::write(event_fd_, &one, sizeof one);
      continue;
    }
    peer_failed(what, true, &store, true);
  }
}

std::vector<std::pair<int, std::string>> NodeWatch::take_lost() {
  std::lock_guard lock(mu_);
  return std::exchange(lost_, {});
}

void NodeWatch::fail_lost(const std::string& what) { peer_failed(what, true, main_.get(), true); }

void NodeWatch::drop_member(int node) {
  {
    std::lock_guard lock(mu_);
    members_.erase(std::remove(members_.begin(), members_.end(), node), members_.end());
  }
  try {
    main_->set(key("left/" + std::to_string(node)), "1");
  } catch (const std::exception&) {
  }
}

void NodeWatch::peer_failed(const std::string& what, bool publish, Store* store, bool lost) {
  {
    std::lock_guard lock(mu_);
    if (failure_ || reported_) return;  // the first failure is the cause; later ones are its echo
    failure_ = what;
    failure_lost_ = lost;
  }
  if (publish && store) {
    try {
      const auto n = store->add(generation_key("failures"), 1);
      store->set(generation_key("failure/" + std::to_string(n)), std::string(lost ? kNodeLost : kRankFailed) + what);
    } catch (const std::exception&) {
    }
  }
  const std::uint64_t one = 1;
  [[maybe_unused]] auto w = ::write(event_fd_, &one, sizeof one);
}

std::optional<std::string> NodeWatch::report_failure(const std::string& what) {
  {
    std::lock_guard lock(mu_);
    if (failure_) return failure_;  // stopping already, because of another node
    reported_ = true;
    own_report_ = label(o_.node_rank) + ": " + what;
  }
  try {
    const auto n = main_->add(generation_key("failures"), 1);
    main_->set(generation_key("failure/" + std::to_string(n)), std::string(kRankFailed) + own_report_);
    // Another node got there first (its rank died, ours saw the connection go): that is the cause.
    if (n == 1) return own_report_;
    const auto [first, lost] = parse_failure(main_->get(generation_key("failure/1")));
    std::lock_guard lock(mu_);
    failure_lost_ = lost;
    return first;
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

std::string NodeWatch::finish(int exit_code, milliseconds limit) {
  std::vector<std::string> notes;
  // The failures other nodes posted that this node has not said yet: whichever node's report
  // came first, the output names every node and rank that failed.
  auto collect_failures = [&] {
    try {
      const auto n = main_->add(generation_key("failures"), 0);
      for (std::int64_t i = 1; i <= n; ++i) {
        const auto msg = parse_failure(main_->get(generation_key("failure/" + std::to_string(i)))).first;
        std::lock_guard lock(mu_);
        if (msg != own_report_ && msg != failure_.value_or("")) notes.push_back(msg);
      }
    } catch (const std::exception&) {
    }
  };
  if (cut_off_) return "";  // the heartbeat's word said it; the store cannot be asked (cut_off_)
  if (o_.node_rank != 0) collect_failures();
  try {
    main_->set(key("exit/" + std::to_string(o_.node_rank)), std::to_string(exit_code));
  } catch (const std::exception& e) {
    std::lock_guard lock(mu_);
    const bool said = failure_ && failure_->find(label(0)) != std::string::npos;
    if (o_.node_rank != 0 && !said) notes.push_back(label(0) + "'s store is unreachable (" + std::string(e.what()) + ")");
  }
  if (o_.node_rank == 0 && thread_.joinable()) {
    // Left out at a restart (Note [Shrinking the world]): said then; not waited for.
    const std::vector<int> members = this->members();
    peers_.wait_settled(members, limit);
    const auto failure = peer_failure();
    for (int k : members) {
      if (k == 0) continue;
      if (failure && failure->find(label(k)) != std::string::npos) continue;  // said already
      if (peers_.lost(k)) notes.push_back(label(k) + " was lost (no heartbeat)");
      else if (!peers_.exited(k)) notes.push_back(label(k) + " had not finished");
    }
    collect_failures();
  }
  std::string out;
  for (const auto& n : notes) out += (out.empty() ? "" : "; ") + n;
  return out;
}

bool NodeWatch::lost_a_node() const {
  std::lock_guard lock(mu_);
  return failure_lost_;
}

bool NodeWatch::member(int node) const {
  return std::find(members_.begin(), members_.end(), node) != members_.end();
}

// Note [No node decides alone]
// With the TCP store node 0 decides every restart: it serves the store, so the job ends with it
// anyway. With the store on etcd node 0 may be the node that was lost, so the decider is the
// lowest node of the generation that this node's own watch of the heartbeats does not hold lost:
// node 0 while it beats, else node 1, and so on. Two launchers may see the heartbeats a moment
// apart and both think themselves lowest; the claim (an add on the generation's "decider"
// counter, which etcd applies once) lets exactly one decide, and every other node waits for the
// decision it posts, as before.
std::optional<bool> NodeWatch::claim_decision() {
  if (!on_etcd()) return o_.node_rank == 0 ? std::optional<bool>(true) : std::nullopt;
  std::vector<int> members;
  {
    std::lock_guard lock(mu_);
    members = members_;
  }
  for (int k : members) {
    if (k == o_.node_rank) break;
    if (!peers_.lost(k)) return std::nullopt;  // a lower node still beats: it decides
  }
  return main_->add(generation_key("decider"), 1) == 1;  // false: another node claimed first
}

std::string NodeWatch::decide(milliseconds limit) {
  auto posted = [&](int k) -> std::optional<std::string> {
    const auto key_k = generation_key("next/" + std::to_string(k));
    if (!main_->check({key_k})) return std::nullopt;
    return main_->get(key_k);
  };
  std::vector<int> members;
  {
    std::lock_guard lock(mu_);
    members = members_;
  }
  // Every node of this generation says, or is found lost by its heartbeats.
  const auto deadline = clock::now() + limit;
  std::vector<int> lost;
  for (;;) {
    std::string silent;
    lost.clear();
    for (int k : members) {
      const auto said = posted(k);
      if (said && *said != "restart") return "stop " + label(k) + " does not restart (interrupted or out of restarts)";
      if (said) continue;
      if (peers_.lost(k)) lost.push_back(k);
      else silent += (silent.empty() ? "" : ", ") + label(k);
    }
    if (silent.empty()) break;
    if (clock::now() >= deadline) return "stop " + silent + " did not say within " + seconds(limit) + " whether it restarts";
    std::this_thread::sleep_for(milliseconds(50));
  }
  if (!lost.empty()) {
    if (!o_.min_nnodes) return "stop " + label(lost.front()) + " was lost (no heartbeat), and --nnodes is not elastic (MIN:MAX)";
    // A lost node has --rejoin-timeout to come back and say it restarts.
    const auto rejoin_until = clock::now() + o_.rejoin_timeout;
    for (;;) {
      lost.erase(std::remove_if(lost.begin(), lost.end(), [&](int k) { return posted(k) == std::optional<std::string>("restart"); }),
                 lost.end());
      if (lost.empty() || clock::now() >= rejoin_until) break;
      std::this_thread::sleep_for(milliseconds(100));
    }
  }
  std::vector<int> next;
  for (int k : members)
    if (std::find(lost.begin(), lost.end(), k) == lost.end()) next.push_back(k);
  if (int(next.size()) < std::max(1, o_.min_nnodes))
    return "stop only " + std::to_string(next.size()) + " node(s) left, and --nnodes " + std::to_string(o_.min_nnodes) + ":" +
           std::to_string(o_.nnodes) + " needs at least " + std::to_string(o_.min_nnodes);
  for (int k : lost) main_->set(key("left/" + std::to_string(k)), "1");  // may come back (Note [Rejoining])
  if (o_.min_nnodes) {
    const int next_generation = [&] {
      std::lock_guard lock(mu_);
      return generation_ + 1;
    }();
    for (int k : returning(next)) {
      peers_.rejoining(k);  // watched afresh once the decision is taken (decide_restart)
      tell_joined(k, std::to_string(next_generation));
      next.push_back(k);
    }
    std::sort(next.begin(), next.end());
  }
  std::string decision = "restart";
  for (int k : next) decision += " " + std::to_string(k);
  return decision;
}

std::optional<std::vector<int>> NodeWatch::decide_restart(bool want, milliseconds limit, std::string& why_not) {
  const auto wait_limit = limit + (o_.min_nnodes ? o_.rejoin_timeout : milliseconds(0)) + std::chrono::seconds(5);
  std::string decision;
  if (cut_off_) {
    why_not = store_name() + " is unreachable from this node (cut off)";
    return std::nullopt;
  }
  try {
    main_->set(generation_key("next/" + std::to_string(o_.node_rank)), want ? "restart" : "stop");
    const auto deadline = clock::now() + wait_limit;
    for (bool may_claim = true;;) {
      if (main_->check({generation_key("decision")})) {
        decision = main_->get(generation_key("decision"));
        break;
      }
      const auto claim = may_claim ? claim_decision() : std::nullopt;
      if (claim) may_claim = false;
      if (claim == true) {
        if (on_etcd() && o_.say) o_.say(label(o_.node_rank) + " decides this restart (the lowest node whose heartbeat moves)");
        decision = want ? decide(limit) : "stop " + label(o_.node_rank) + " does not restart (interrupted or out of restarts)";
        main_->set(generation_key("decision"), decision);
        break;
      }
      if (clock::now() >= deadline) {
        why_not = (on_etcd() ? std::string("no node") : label(0)) + " decided within " + seconds(wait_limit);
        return std::nullopt;
      }
      std::this_thread::sleep_for(milliseconds(50));
    }
  } catch (const std::exception& e) {
    why_not = store_name() + " is unreachable (" + std::string(e.what()) + ")";
    return std::nullopt;
  }
  if (decision.rfind("restart", 0) != 0) {
    why_not = decision.substr(decision.find(' ') + 1);
    return std::nullopt;
  }
  const std::vector<int> next = decided_nodes(decision);
  if (std::find(next.begin(), next.end(), o_.node_rank) == next.end()) {
    why_not = "this node was left out of the next generation: lost for longer than --rejoin-timeout (the others go on without it)";
    return std::nullopt;
  }
  if (!want) {
    why_not = "this node does not restart";
    return std::nullopt;
  }
  for (int k : next) peers_.readmit(k, clock::now());  // a lost node that came back: watched afresh
  std::lock_guard lock(mu_);
  members_ = next;
  return next;
}

void NodeWatch::next_generation() {
  std::lock_guard lock(mu_);
  ++generation_;
  failure_.reset();
  failure_lost_ = false;
  lost_.clear();
  reported_ = false;
  own_report_.clear();
  std::uint64_t count;
  [[maybe_unused]] auto r = ::read(event_fd_, &count, sizeof count);  // the last generation's news
}

void NodeWatch::post(const std::string& k, const std::string& value) { main_->set(key(k), value); }

std::string NodeWatch::read(const std::string& k) { return main_->get(key(k)); }

}  // namespace shardflow::launch
