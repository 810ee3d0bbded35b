// One process per rank: where a process learns its rank, and how it joins the others.
//
//   auto env  = shardflow::LaunchEnv::detect();        // shardflow run, torchrun, srun or mpirun
//   auto comm = shardflow::init_process_group(env, {"auto", std::chrono::minutes(10)});
//   shardflow::Runtime rt(comm, cfg);
//
// Note [Who runs the store]
// Rendezvous goes through the shardflow TCP store at MASTER_ADDR:MASTER_PORT. Under `shardflow
// run` the launcher of node 0 serves it (SHARDFLOW_STORE_HOSTED=1) with a fresh per-job token in
// SHARDFLOW_STORE_TOKEN. Under srun, mpirun or torchrun rank 0 serves it; the token is
// SHARDFLOW_STORE_TOKEN when set, else derived from the scheduler's job id. torchrun's own agent
// already listens on MASTER_PORT, so there the store takes MASTER_PORT + 1, or, where that lies in
// the kernel's ephemeral range (torchrun --standalone), a port below it derived from the run id
// (Note [The store beside torchrun's agent]). SHARDFLOW_STORE_PORT overrides the port in every case.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "shardflow/communicator.hpp"

namespace shardflow {

struct LaunchEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr = "127.0.0.1";
  std::uint16_t store_port = 0;   // where the store listens (Note [Who runs the store])
  bool store_hosted = false;      // a launcher serves the store; rank 0 must not
  std::string token;
  // The store on etcd instead (Note [A store no node owns]): SHARDFLOW_RDZV_BACKEND=etcd with
  // SHARDFLOW_RDZV_ENDPOINTS=host:port,... Nobody serves a store then. The job's keys live under
  // etcd_root: SHARDFLOW_ETCD_ROOT, else /shardflow/<run id>/, the run id from SHARDFLOW_RUN_ID,
  // TORCHELASTIC_RUN_ID or SLURM_JOB_ID (one of them is required: an etcd outlives jobs, and a job
  // must not read an earlier one's keys). The etcd user is SHARDFLOW_ETCD_USER (shardflow); its
  // password is the token.
  std::vector<std::string> etcd_endpoints;
  std::string etcd_user = "shardflow";
  std::string etcd_root;
  std::string source = "none";    // "shardflow run", "torchrun", "slurm", "openmpi" or "none"
  // Where this rank's sockets (the Gloo transport, a store rank 0 serves) bind and advertise
  // (Note [Choosing the socket address]): SHARDFLOW_SOCKET_ADDR; SHARDFLOW_SOCKET_IFNAME, else
  // GLOO_SOCKET_IFNAME; empty: loopback on one host, else the interface routing to master_addr.
  std::string socket_address;
  std::string socket_ifname;
  std::string socket_origin;      // the variable that set one of them, for error messages
  // Which start of the worker group this is: 0 the first, k after k restarts (SHARDFLOW_RESTART_COUNT
  // from `shardflow run --max-restarts`, TORCHELASTIC_RESTART_COUNT from torchrun). The store keys of
  // a generation are its own.
  int restart_count = 0;
  // Note [Recovering in place] (`shardflow run --recovery in-place`, SHARDFLOW_RECOVERY=in-place):
  // a lost rank's process starts again while the others keep theirs and join it in the
  // generation's next round (SHARDFLOW_RECOVERY_ROUND: the round this process started in).
  bool recover_in_place = false;
  int recovery_round = 0;
  // How long the launcher may take to give its word on a round (SHARDFLOW_RECOVERY_WAIT_MS): a node
  // lost is noticed only after its heartbeat timeout, which may be longer than the ranks' own
  // timeout. rejoin_process_group waits for the longer of the two.
  std::chrono::milliseconds recovery_word_wait{0};

  // Reads the environment of this process; `getenv` replaces ::getenv (tests). UsageError naming
  // the variable when a value is malformed or inconsistent (RANK >= WORLD_SIZE, ...).
  static LaunchEnv detect(const std::function<const char*(const char*)>& getenv = {});
  bool launched() const { return source != "none"; }
  bool single_host() const { return local_world_size == world_size; }
  std::string describe() const;
  // The address this rank's sockets bind and advertise (Note [Choosing the socket address]);
  // UsageError naming the interface or address when it is not usable here.
  std::string socket_bind_address() const;
};

struct ProcessGroupOptions {
  // "gloo", "shm", "nccl" (one GPU per process: cuda:LOCAL_RANK), "hierarchical" (shared memory
  // inside a host, Gloo between hosts: shardflow/hierarchical.hpp), or "auto": shm when every rank
  // is on this host, hierarchical on several hosts of several ranks each, else gloo. auto never
  // picks nccl: which device parameters live on is the trainer's choice, and a CPU-tensor job on a
  // GPU machine must keep working.
  std::string backend = "auto";
  std::chrono::milliseconds timeout = std::chrono::minutes(10);
};

// Joins the job's other ranks (a collective: every rank calls it, in the same order if more than
// once). Ranks that asked for different backends get a MismatchError naming both, before any
// backend rendezvous could hang. The returned communicator keeps the store alive.
std::shared_ptr<Communicator> init_process_group(const LaunchEnv& env, const ProcessGroupOptions& options = {});

// A survivor's way on after a peer was lost, under `shardflow run --recovery in-place` (Note
// [Recovering in place]): waits (at most options.timeout) for the launcher to say how the job goes
// on, and joins the generation's next round with the rank that replaces the lost one; the new
// communicator is for Runtime::recover(). A collective: every surviving rank calls it once per
// loss. CommError naming the launcher's verdict when it restarts every rank instead; UsageError
// outside `shardflow run --recovery in-place`. A node that joins the running job (Note [A node
// joins live], runtime/launch/grow_round.cpp) ends an iteration in the same CommError, at a snapshot every rank
// completed: the same call and recover() go on at the larger world from that step.
//
//   try { train_step(); }
//   catch (const shardflow::CommError&) { step = rt.recover(shardflow::rejoin_process_group(env, opts)); }
std::shared_ptr<Communicator> rejoin_process_group(const LaunchEnv& env, const ProcessGroupOptions& options = {});

}  // namespace shardflow
