// init_process_group: the store (served by rank 0 unless a launcher serves it), a backend
// agreement check over it, then the backend's own rendezvous.
#include <cstdlib>

#include <algorithm>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

#include "runtime/bootstrap/net_address.hpp"
#include "runtime/bootstrap/recovery_verdict.hpp"
#include "runtime/observe/logging.hpp"
#include "shardflow/errors.hpp"
#include "shardflow/gloo.hpp"
#include "shardflow/hierarchical.hpp"
#include "kernels/cuda/device.hpp"
#include "shardflow/launch.hpp"
#include "shardflow/nccl.hpp"
#include "shardflow/shm.hpp"
#include "shardflow/store.hpp"

namespace shardflow {
namespace {

// The backend's communicator, plus the store server it may still need (rank 0 serves peers that
// are slower to finish their rendezvous than rank 0 is).
class GroupComm final : public Communicator {
 public:
  GroupComm(std::unique_ptr<TcpStoreServer> server, std::shared_ptr<Communicator> inner)
      : server_(std::move(server)), inner_(std::move(inner)) {}
  int rank() const override { return inner_->rank(); }
  int world_size() const override { return inner_->world_size(); }
  std::string backend_name() const override { return inner_->backend_name(); }
  bool supports(Device d) const override { return inner_->supports(d); }
  bool shifts_by(int distance) const override { return inner_->shifts_by(distance); }
  bool shifts_unequal(bool in_host) const override { return inner_->shifts_unequal(in_host); }
  int in_host_ranks() const override { return inner_->in_host_ranks(); }
  std::shared_ptr<std::byte> allocate(std::size_t bytes) override { return inner_->allocate(bytes); }
  void submit(CollectiveOp op, CollectiveDone done) override { inner_->submit(std::move(op), std::move(done)); }
  void abort(const std::string& reason) override { inner_->abort(reason); }

 private:
  std::unique_ptr<TcpStoreServer> server_;
  std::shared_ptr<Communicator> inner_;  // destroyed first: its threads may still use the store
};

// Groups made in this process, per generation and round (Note [Recovering in place]): a rank that
// replaces a lost one makes its first group of a round where the survivors make their second.
std::mutex groups_mu;
int groups_round = -1, groups_in_round = 0;
int latest_round = 0;  // the newest round this process joined
// This process's rank and world in the newest round (a shrinking round numbers the survivors afresh).
std::optional<std::pair<int, int>> current_place;

std::string group_prefix(const LaunchEnv& env, int round) {
  std::lock_guard lock(groups_mu);
  if (round != groups_round) groups_round = round, groups_in_round = 0;
  latest_round = std::max(latest_round, round);
  current_place = std::pair{env.rank, env.world_size};
  // Round 0's keys are as they were before rounds existed: g<k>/pg<n>/.
  return "g" + std::to_string(env.restart_count) + "/" + (round ? "r" + std::to_string(round) + "/" : "") + "pg" +
         std::to_string(groups_in_round++) + "/";
}

}  // namespace

namespace {

// The backend `o` asks for, with auto resolved. Note [Two-level collectives]: several hosts of
// several ranks each, numbered host by host, talk through shared memory inside a host and Gloo
// between hosts; auto picks it there.
std::string choose_backend(const LaunchEnv& env, const ProcessGroupOptions& o) {
  if (o.backend != "auto" && o.backend != "gloo" && o.backend != "shm" && o.backend != "nccl" && o.backend != "hierarchical")
    throw UsageError("init_process_group: backend '" + o.backend + "' is not one of auto, gloo, shm, nccl, hierarchical");
  const int L = env.local_world_size;
  const bool two_levels = L > 1 && !env.single_host() && env.world_size % L == 0 && env.rank % L == env.local_rank;
  if (o.backend == "hierarchical" && !two_levels)
    throw UsageError("init_process_group: backend 'hierarchical' needs several hosts with the same number of ranks each, numbered "
                     "host by host; rank " + std::to_string(env.rank) + " is local rank " + std::to_string(env.local_rank) + " of " +
                     std::to_string(L) + " in a world of " + std::to_string(env.world_size));
  return o.backend != "auto" ? o.backend : env.single_host() ? "shm" : two_levels ? "hierarchical" : "gloo";
}

// Rank 0 serves the rendezvous store unless the launcher does; `store_host` is where it listens.
std::unique_ptr<TcpStoreServer> serve_store(const LaunchEnv& env, std::string& store_host) {
  store_host = env.master_addr;
  if (env.store_hosted || env.rank != 0 || !env.etcd_endpoints.empty()) return nullptr;
  StoreServerOptions so;
  so.host = net::store_bind_address({env.socket_address, env.socket_ifname, env.socket_origin}, env.master_addr, env.single_host());
  so.port = env.store_port;
  so.token = env.token;
  std::unique_ptr<TcpStoreServer> server;
  try {
    server = std::make_unique<TcpStoreServer>(so);
  } catch (const Error& e) {
    throw CommError("rank 0 cannot serve the rendezvous store: " + std::string(e.what()) +
                    " (another job on this port? set MASTER_PORT or SHARDFLOW_STORE_PORT)");
  }
  store_host = so.host;
  return server;
}

// Every rank asked for the same backend and world, and auto chose alike (hosts with different
// numbers of ranks would choose differently): MismatchError naming both otherwise.
void agree_on_backend(const LaunchEnv& env, const ProcessGroupOptions& o, const std::string& backend, const StoreRendezvous& where,
                      const std::string& prefix) {
  const auto client = connect_store(where);
  PrefixStore store(*client, prefix);
  store.set("backend/" + std::to_string(env.rank), o.backend + " (" + backend + ") " + std::to_string(env.world_size));
  const std::string mine = store.get("backend/" + std::to_string(env.rank));
  const std::string root = store.get("backend/0");
  if (root != mine)
    throw MismatchError("rank " + std::to_string(env.rank) + " asked for backend (chosen) world '" + mine + "' but rank 0 for '" + root +
                        "': every rank must pass the same backend and world size (and with auto, every host run as many ranks)");
}

// Two levels: shared memory inside this host (and its own segment for the all-gathers: Note
// [Lanes]), Gloo between the hosts' same local ranks.
std::shared_ptr<Communicator> make_two_levels(const LaunchEnv& env, const StoreRendezvous& where, const std::string& prefix) {
  const int L = env.local_world_size, host = env.rank / L;
  ShmOptions inside;
  static_cast<StoreRendezvous&>(inside) = where;
  inside.rank = env.local_rank;
  inside.world_size = L;
  inside.key_prefix = prefix + "hierarchical/host" + std::to_string(host) + "/";
  GlooOptions between;
  static_cast<StoreRendezvous&>(between) = where;
  between.rank = host;
  between.world_size = env.world_size / L;
  between.key_prefix = prefix + "hierarchical/local" + std::to_string(env.local_rank) + "/";
  between.hostname = env.socket_bind_address();  // Note [Choosing the socket address]
  auto local = make_shm_communicator(inside);
  inside.key_prefix += "after/";
  auto local_after = make_shm_communicator(inside);
  return make_hierarchical(std::move(local), make_gloo_communicator(between), std::move(local_after));
}

std::shared_ptr<Communicator> make_backend(const std::string& backend, const LaunchEnv& env, const StoreRendezvous& where,
                                           const std::string& prefix) {
  if (backend == "nccl") {
    // NCCL's bootstrap picks its own interface; the one chosen for shardflow is its default too.
    if (!env.socket_ifname.empty()) ::setenv("NCCL_SOCKET_IFNAME", env.socket_ifname.c_str(), /*overwrite=*/0);
    NcclOptions no;
    static_cast<StoreRendezvous&>(no) = where;
    const int devices = cuda::device_count();
    no.device = devices > 0 ? env.local_rank % devices : 0;  // one GPU per process on each node
    return make_nccl_communicator(no);
  }
  if (backend == "hierarchical") return make_two_levels(env, where, prefix);
  if (backend == "shm") {
    ShmOptions so;
    static_cast<StoreRendezvous&>(so) = where;
    return make_shm_communicator(so);
  }
  GlooOptions go;
  static_cast<StoreRendezvous&>(go) = where;
  go.hostname = env.socket_bind_address();  // Note [Choosing the socket address]
  return make_gloo_communicator(go);
}

}  // namespace

namespace {

StoreRendezvous store_of(const LaunchEnv& env, const std::string& store_host, std::chrono::milliseconds timeout) {
  StoreRendezvous where;
  where.rank = env.rank;
  where.world_size = env.world_size;
  where.store_host = store_host;
  where.store_port = env.store_port;
  where.etcd_endpoints = env.etcd_endpoints;
  where.etcd_user = env.etcd_user;
  where.etcd_root = env.etcd_root;
  where.token = env.token;
  where.timeout = timeout;
  return where;
}

std::shared_ptr<Communicator> make_group(const LaunchEnv& env, const ProcessGroupOptions& o, int round) {
  const std::string backend = choose_backend(env, o);
  if (o.timeout.count() <= 0) throw UsageError("init_process_group: timeout must be positive");
  std::string store_host;
  auto server = serve_store(env, store_host);
  // The store outlives a restarted worker group: each generation's keys are its own (Note
  // [Restarting the worker group]), and each round's within it (Note [Recovering in place]).
  const std::string prefix = group_prefix(env, round);
  StoreRendezvous where = store_of(env, store_host, o.timeout);
  agree_on_backend(env, o, backend, where, prefix);
  where.key_prefix = prefix + backend + "/";
  auto group = std::make_shared<GroupComm>(std::move(server), make_backend(backend, env, where, prefix));
  if (round > 0) {  // the launcher counts the ranks that made the round's group: the recovery is over once all have
    const auto client = connect_store(where);
    client->add(recovery_verdict::joined_key(env.restart_count, round), 1);
  }
  return group;
}

}  // namespace

std::shared_ptr<Communicator> init_process_group(const LaunchEnv& env, const ProcessGroupOptions& o) {
  return make_group(env, o, env.recovery_round);
}

namespace {

// Note [A lost host healed in place] (runtime/launch/lost_node_round.cpp): a round that leaves out whole
// hosts of the world as launched (numbered host by host) keeps it so, numbered afresh: the hosts
// left run as many ranks each, and two levels still pair their local ranks up.
bool whole_hosts_left_out(const LaunchEnv& env, const std::vector<int>& next, int world_before) {
  const int L = env.local_world_size;
  if (L < 1 || world_before != env.world_size || int(next.size()) != env.world_size || env.world_size % L != 0) return false;
  for (auto host = next.begin(); host != next.end(); host += L) {
    const auto lost = std::count_if(host, host + L, [](int n) { return n < 0; });
    if (lost != 0 && lost != L) return false;
  }
  return true;
}

}  // namespace

std::shared_ptr<Communicator> rejoin_process_group(const LaunchEnv& env, const ProcessGroupOptions& o) {
  if (!env.recover_in_place)
    throw UsageError("rejoin_process_group on rank " + std::to_string(env.rank) + ": the job was not started with `shardflow run "
                     "--recovery in-place` (SHARDFLOW_RECOVERY is not in-place), so no launcher starts the lost rank again for the "
                     "survivors to join; let the launcher restart every rank (--max-restarts) instead");
  if (o.timeout.count() <= 0) throw UsageError("rejoin_process_group: timeout must be positive");
  // This process's rank now: after a shrinking round it is no longer the one it was launched as,
  // and the errors below name the rank the job's output shows.
  int round, before, world_before;
  {
    std::lock_guard lock(groups_mu);
    round = std::max(latest_round, env.recovery_round) + 1;
    before = current_place ? current_place->first : env.rank;
    world_before = current_place ? current_place->second : env.world_size;
  }
  // The launcher's word for this round: "in-place: ..." once it started the lost rank's process
  // again, "restart: ..." when it stops every rank instead.
  const std::string key = recovery_verdict::key(env.restart_count, round);
  std::string text;
  try {
    const auto client = connect_store(store_of(env, env.master_addr, std::max(o.timeout, env.recovery_word_wait)));
    // Note [A node joins live]: a growing round's launcher waits for every rank to be here, its
    // snapshot complete, before the new node fetches it.
    client->add(recovery_verdict::parked_key(env.restart_count, round), 1);
    text = client->get(key);
  } catch (const Error& e) {
    throw CommError("rejoin_process_group on rank " + std::to_string(before) + ": no word from the launcher on round " +
                    std::to_string(round) + " of the job's recovery (" + e.what() + ")");
  }
  if (text.rfind("in-place", 0) != 0)
    throw CommError("rejoin_process_group on rank " + std::to_string(before) + ": the launcher does not recover in place this time: " +
                    text);
  const auto verdict = recovery_verdict::parse(text);
  if (!verdict)
    throw CommError("rejoin_process_group: the launcher's word on round " + std::to_string(round) + " is malformed: " + text);
  const auto& next = verdict->next;
  if (before >= int(next.size()))
    throw CommError("rejoin_process_group: the launcher's word on round " + std::to_string(round) + " does not place rank " +
                    std::to_string(before) + ": " + text);
  if (next[std::size_t(before)] < 0)
    throw CommError("rejoin_process_group: rank " + std::to_string(before) + " was counted lost in round " + std::to_string(round) +
                    " and left out: " + verdict->why);
  LaunchEnv placed = env;
  placed.rank = next[std::size_t(before)];
  placed.world_size = verdict->world;
  if (env.single_host()) {
    placed.local_rank = placed.rank, placed.local_world_size = verdict->world;
  } else if (verdict->world < int(next.size()) && choose_backend(placed, o) == "hierarchical" &&
             !whole_hosts_left_out(env, next, world_before)) {
    // A shrink across nodes leaves the lost rank's host with fewer ranks than the others, which
    // two levels (shm inside a host, Gloo between the hosts' same local ranks) cannot pair up.
    throw UsageError("rejoin_process_group on rank " + std::to_string(before) + ": round " + std::to_string(round) +
                     " shrinks the world across nodes, which leaves the hosts with different numbers of ranks, and backend '" +
                     o.backend + "' chose two levels, which need as many on every host; use --recovery in-place across nodes, "
                     "or backend gloo");
  } else if (o.backend == "auto" && choose_backend(placed, o) == "gloo") {
    LaunchEnv was = env;
    was.rank = before, was.world_size = world_before;
    if (choose_backend(was, o) == "hierarchical")
      // Not silent: the job goes on slower between hosts (every rank's traffic on the flat ring).
      rank_logger(placed.rank)->warn("round {} shrinks the world to {} across nodes, which leaves the hosts with different numbers "
                                     "of ranks: backend 'auto' reduces over flat Gloo from here on instead of two levels (the same "
                                     "mean, summed in another order; slower between hosts)", round, verdict->world);
  }
  return make_group(placed, o, round);
}

}  // namespace shardflow
