// Where a process learns its rank: `shardflow run` and torchrun (RANK, WORLD_SIZE, LOCAL_RANK,
// LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), Slurm's srun (SLURM_PROCID, SLURM_NTASKS,
// SLURM_LOCALID, SLURM_NNODES, SLURM_TASKS_PER_NODE) and Open MPI's mpirun
// (OMPI_COMM_WORLD_RANK / SIZE / LOCAL_RANK / LOCAL_SIZE). The first family present wins, in that
// order: torchrun inside a Slurm allocation sets RANK and is what the user meant.
#include <algorithm>
#include <charconv>
#include <limits>
#include <cstdint>
#include <cstdlib>
#include <fstream>

#include "runtime/bootstrap/etcd_names.hpp"
#include "runtime/bootstrap/net_address.hpp"
#include "shardflow/errors.hpp"
#include "shardflow/launch.hpp"

namespace shardflow {
namespace {

class Env {
 public:
  explicit Env(const std::function<const char*(const char*)>& getenv) : getenv_(getenv) {}
  const char* raw(const char* name) const {
    const char* v = getenv_ ? getenv_(name) : std::getenv(name);
    return v && *v ? v : nullptr;
  }
  bool has(const char* name) const { return raw(name) != nullptr; }
  std::string str(const char* name, std::string fallback = {}) const {
    const char* v = raw(name);
    return v ? std::string(v) : fallback;
  }
  long integer(const char* name, long fallback, long min, long max) const {
    const char* v = raw(name);
    if (!v) return fallback;
    long out = 0;
    const std::string s(v);
    auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), out);
    if (ec != std::errc() || end != s.data() + s.size())
      throw UsageError("environment variable " + std::string(name) + "='" + s + "' is not an integer");
    if (out < min || out > max)
      throw UsageError("environment variable " + std::string(name) + "=" + s + " is outside [" + std::to_string(min) +
                       ", " + std::to_string(max) + "]");
    return out;
  }
  long required(const char* name, const char* because, long min, long max) const {
    if (!has(name)) throw UsageError("environment variable " + std::string(name) + " is not set (" + because + ")");
    return integer(name, 0, min, max);
  }

 private:
  const std::function<const char*(const char*)>& getenv_;
};

// "4(x2),3" -> 4: Slurm's tasks on the first node(s); only its relation to the world size matters.
int leading_count(const std::string& s) {
  int v = 0;
  std::from_chars(s.data(), s.data() + s.size(), v);
  return v;
}

constexpr long kMaxWorld = 1 << 20;

// Note [The store beside torchrun's agent]
// torchrun's agent listens on MASTER_PORT, so the store takes MASTER_PORT + 1: 29501 where users
// set 29500. torchrun --standalone picks MASTER_PORT from the kernel's ephemeral range itself, and
// in that range MASTER_PORT + 1 may be any process's outgoing connection at that moment (a suite
// failed with "Address already in use" beside parallel ones). There the store takes a port below
// the range instead, derived from the run id, which every rank of the job shares.
long first_ephemeral_port() {
  std::ifstream in("/proc/sys/net/ipv4/ip_local_port_range");
  long first = 32768;  // Linux's default
  in >> first;
  return first;
}

long store_port_beside_agent(long master_port, const std::string& run_id) {
  constexpr long kLow = 20000;
  const long first_ephemeral = first_ephemeral_port();
  if (master_port + 1 < first_ephemeral || run_id.empty() || first_ephemeral <= kLow + 1000) return master_port + 1;
  std::uint64_t h = 1469598103934665603ull;  // FNV-1a: the same in every rank, whatever its language
  for (const unsigned char c : run_id) h = (h ^ c) * 1099511628211ull;
  return kLow + long(h % std::uint64_t(first_ephemeral - kLow));
}

// SHARDFLOW_RDZV_BACKEND: tcp (the default) or etcd, with its endpoints, user and key root.
template <class Bad>
void read_etcd(const Env& env, LaunchEnv& e, const Bad& bad) {
  const std::string backend = env.str("SHARDFLOW_RDZV_BACKEND", "tcp");
  if (backend == "tcp") {
    for (const char* v : {"SHARDFLOW_RDZV_ENDPOINTS", "SHARDFLOW_ETCD_USER", "SHARDFLOW_ETCD_ROOT"})
      if (env.has(v)) bad(std::string(v) + " is set but SHARDFLOW_RDZV_BACKEND is not etcd");
    return;
  }
  if (backend != "etcd") bad("SHARDFLOW_RDZV_BACKEND='" + backend + "': expected tcp or etcd");
  e.etcd_endpoints = etcd::split_endpoints(env.str("SHARDFLOW_RDZV_ENDPOINTS"));
  if (e.etcd_endpoints.empty()) bad("SHARDFLOW_RDZV_BACKEND=etcd needs SHARDFLOW_RDZV_ENDPOINTS=host:2379[,host:2379...]");
  e.etcd_user = env.str("SHARDFLOW_ETCD_USER", "shardflow");
  const std::string run = env.str("SHARDFLOW_RUN_ID", env.str("TORCHELASTIC_RUN_ID", env.str("SLURM_JOB_ID")));
  if (env.has("SHARDFLOW_ETCD_ROOT"))
    e.etcd_root = env.str("SHARDFLOW_ETCD_ROOT");
  else if (!run.empty())
    e.etcd_root = etcd::root_for(run);
  else
    bad("the etcd store needs a run id of its own (SHARDFLOW_RUN_ID, or SHARDFLOW_ETCD_ROOT): etcd keeps an earlier job's keys");
  if (e.etcd_root.back() != '/') e.etcd_root += '/';
}

}  // namespace

LaunchEnv LaunchEnv::detect(const std::function<const char*(const char*)>& getenv) {
  const Env env(getenv);
  LaunchEnv e;
  // Read first: they matter to a single process too (a store it serves, a Gloo group it makes).
  const auto socket = net::socket_choice_from_env(getenv);
  e.socket_address = socket.address;
  e.socket_ifname = socket.ifname;
  e.socket_origin = socket.origin;
  long port = 29500;  // torchrun's default
  if (env.has("RANK") || env.has("WORLD_SIZE")) {
    e.source = env.has("SHARDFLOW_LAUNCHER") ? "shardflow run" : "torchrun";
    e.world_size = int(env.required("WORLD_SIZE", "RANK is set", 1, kMaxWorld));
    e.rank = int(env.required("RANK", "WORLD_SIZE is set", 0, kMaxWorld));
    e.local_rank = int(env.integer("LOCAL_RANK", e.rank, 0, kMaxWorld));
    e.local_world_size = int(env.integer("LOCAL_WORLD_SIZE", e.world_size, 1, kMaxWorld));
    port = env.integer("MASTER_PORT", port, 1, 65535);
    // torchrun's agent serves its own store on MASTER_PORT (Note [Who runs the store], Note [The
    // store beside torchrun's agent]).
    if (e.source == "torchrun") port = store_port_beside_agent(port, env.str("TORCHELASTIC_RUN_ID", ""));
    e.token = env.str("SHARDFLOW_STORE_TOKEN", "torchrun-" + env.str("TORCHELASTIC_RUN_ID", std::to_string(port)));
  } else if (env.has("OMPI_COMM_WORLD_RANK")) {
    e.source = "openmpi";
    e.world_size = int(env.required("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK is set", 1, kMaxWorld));
    e.rank = int(env.integer("OMPI_COMM_WORLD_RANK", 0, 0, kMaxWorld));
    e.local_rank = int(env.integer("OMPI_COMM_WORLD_LOCAL_RANK", 0, 0, kMaxWorld));
    e.local_world_size = int(env.integer("OMPI_COMM_WORLD_LOCAL_SIZE", 1, 1, kMaxWorld));
    port = env.integer("MASTER_PORT", port, 1, 65535);
    e.token = env.str("SHARDFLOW_STORE_TOKEN", "ompi-" + env.str("PMIX_NAMESPACE", env.str("OMPI_MCA_ess_base_jobid", "job")));
  } else if (env.has("SLURM_PROCID")) {
    e.source = "slurm";
    e.world_size = int(env.required("SLURM_NTASKS", "SLURM_PROCID is set", 1, kMaxWorld));
    e.rank = int(env.integer("SLURM_PROCID", 0, 0, kMaxWorld));
    e.local_rank = int(env.integer("SLURM_LOCALID", 0, 0, kMaxWorld));
    const long nodes = env.integer("SLURM_NNODES", 1, 1, kMaxWorld);
    e.local_world_size = nodes == 1 ? e.world_size : std::max(1, leading_count(env.str("SLURM_TASKS_PER_NODE", "1")));
    // Jobs that share a node must not share a port: spread them by job id unless told.
    const long job = env.integer("SLURM_JOB_ID", 0, 0, std::numeric_limits<long>::max());
    port = env.integer("MASTER_PORT", 20000 + job % 20000, 1, 65535);
    e.token = env.str("SHARDFLOW_STORE_TOKEN", "slurm-" + std::to_string(job) + "-" + env.str("SLURM_STEP_ID", "0"));
  } else {
    return e;  // a single process: world 1
  }
  auto bad = [&](const std::string& why) { throw UsageError("launch environment (" + e.source + "): " + why); };
  if (e.rank >= e.world_size)
    bad("rank " + std::to_string(e.rank) + " is not below the world size " + std::to_string(e.world_size));
  if (e.local_world_size > e.world_size)
    bad("local world size " + std::to_string(e.local_world_size) + " exceeds the world size " + std::to_string(e.world_size));
  if (e.local_rank >= e.local_world_size)
    bad("local rank " + std::to_string(e.local_rank) + " is not below the local world size " + std::to_string(e.local_world_size));
  e.store_hosted = env.str("SHARDFLOW_STORE_HOSTED") == "1";
  if (e.store_hosted && !env.has("SHARDFLOW_STORE_TOKEN"))
    bad("SHARDFLOW_STORE_HOSTED=1 but SHARDFLOW_STORE_TOKEN is not set: start the job with `shardflow run`");
  e.store_port = std::uint16_t(env.integer("SHARDFLOW_STORE_PORT", port, 1, 65535));
  read_etcd(env, e, bad);
  // Note [Restarting the worker group]: shardflow run's generation, else torchrun's.
  e.restart_count = int(env.integer(env.has("SHARDFLOW_RESTART_COUNT") ? "SHARDFLOW_RESTART_COUNT" : "TORCHELASTIC_RESTART_COUNT", 0, 0,
                                    1 << 20));
  // Note [Recovering in place]: the launcher's choice and which round of this generation a rank
  // started in (a replacement starts in a later one than the ranks it joins).
  if (env.has("SHARDFLOW_RECOVERY")) {
    const std::string r = env.str("SHARDFLOW_RECOVERY");
    if (r != "in-place" && r != "restart") bad("SHARDFLOW_RECOVERY is '" + r + "', not in-place or restart");
    e.recover_in_place = r == "in-place";
  }
  e.recovery_round = int(env.integer("SHARDFLOW_RECOVERY_ROUND", 0, 0, 1 << 20));
  if (e.recovery_round > 0 && !e.recover_in_place) bad("SHARDFLOW_RECOVERY_ROUND is set without SHARDFLOW_RECOVERY=in-place");
  e.recovery_word_wait = std::chrono::milliseconds(env.integer("SHARDFLOW_RECOVERY_WAIT_MS", 0, 0, 24L * 3600 * 1000));
  if (env.has("MASTER_ADDR"))
    e.master_addr = env.str("MASTER_ADDR");
  else if (!e.single_host())
    bad("MASTER_ADDR is not set, and the ranks span several hosts: set it to the address of rank 0's host");
  return e;
}

std::string LaunchEnv::describe() const {
  std::string store = "store " + master_addr + ":" + std::to_string(store_port) + (store_hosted ? " served by the launcher" : " served by rank 0");
  if (!etcd_endpoints.empty()) {
    store = "store on etcd at " + etcd::join_endpoints(etcd_endpoints) + " under " + etcd_root;
  }
  return "rank " + std::to_string(rank) + " of " + std::to_string(world_size) + " (local " + std::to_string(local_rank) +
         " of " + std::to_string(local_world_size) + ", from " + source + "; " + store + ")";
}

std::string LaunchEnv::socket_bind_address() const {
  return net::choose_local_address({socket_address, socket_ifname, socket_origin}, master_addr, single_host()).address;
}

}  // namespace shardflow
