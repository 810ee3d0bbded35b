#include "runtime/launch/rank_process.hpp"

#include <fcntl.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "runtime/bootstrap/etcd_names.hpp"
#include "runtime/bootstrap/snapshot_env.hpp"
#include "shardflow/errors.hpp"

namespace shardflow::launch {

RankProcess start_rank_process(const std::vector<std::string>& command, const std::map<std::string, std::string>& env,
                               const sigset_t& child_mask) {
  int out[2], err[2];
  if (::pipe2(out, O_CLOEXEC) != 0 || ::pipe2(err, O_CLOEXEC) != 0) throw Error("pipe: " + std::string(std::strerror(errno)));
  // Everything the child needs is built before fork: the store's thread runs in this process,
  // so between fork and exec the child may only make async-signal-safe calls (no malloc).
  std::vector<std::string> env_strings;
  for (char** e = environ; *e; ++e) {
    const std::string kv = *e;
    if (!env.count(kv.substr(0, kv.find('=')))) env_strings.push_back(kv);
  }
  for (const auto& [k, v] : env) env_strings.push_back(k + "=" + v);
  std::vector<char*> envp, argv;
  for (auto& kv : env_strings) envp.push_back(kv.data());
  envp.push_back(nullptr);
  for (const auto& a : command) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  const std::string exec_failed = "shardflow run: cannot execute '" + command[0] + "'\n";

  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) throw Error("fork: " + std::string(std::strerror(errno)));
  if (pid == 0) {
    ::setpgid(0, 0);
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(127);  // the launcher died before prctl took effect
    ::dup2(out[1], STDOUT_FILENO);
    ::dup2(err[1], STDERR_FILENO);
    ::sigprocmask(SIG_SETMASK, &child_mask, nullptr);
    ::signal(SIGPIPE, SIG_DFL);  // the launcher ignores it; an ignored signal would stay ignored across exec
    ::execvpe(argv[0], argv.data(), envp.data());
    [[maybe_unused]] auto w = ::write(STDERR_FILENO, exec_failed.data(), exec_failed.size());
    ::_exit(127);
  }
  ::setpgid(pid, pid);  // also here: no race with the first kill(-pid)
  ::close(out[1]);
  ::close(err[1]);
  return {pid, out[0], err[0]};
}

std::map<std::string, std::string> rank_environment(const LaunchSpec& spec, const net::SocketChoice& socket, const RankIds& ids) {
  std::map<std::string, std::string> env = {
      {"RANK", std::to_string(ids.global)},
      {"WORLD_SIZE", std::to_string(ids.world)},
      {"LOCAL_RANK", std::to_string(ids.local)},
      {"LOCAL_WORLD_SIZE", std::to_string(spec.nproc_per_node)},
      {"GROUP_RANK", std::to_string(ids.node)},
      {"MASTER_ADDR", ids.store_host},
      // Not the launcher's store: a port for torch.distributed's own env:// store, which rank 0 of
      // a script's init_process_group() serves (shardflow's ranks read SHARDFLOW_STORE_PORT).
      {"MASTER_PORT", std::to_string(ids.torch_port ? ids.torch_port : ids.store_port < 65535 ? ids.store_port + 1 : ids.store_port - 1)},
      {"SHARDFLOW_LAUNCHER", "1"},
      {"SHARDFLOW_STORE_HOSTED", "1"},
      {"SHARDFLOW_STORE_TOKEN", ids.token},
      {"SHARDFLOW_STORE_PORT", std::to_string(ids.store_port)},
      // torchrun's names too: a script written for torchrun's restarts reads these.
      {"SHARDFLOW_RESTART_COUNT", std::to_string(ids.restart)},
      {"TORCHELASTIC_RESTART_COUNT", std::to_string(ids.restart)},
      {"TORCHELASTIC_MAX_RESTARTS", std::to_string(ids.max_restarts)},
  };
  if (!spec.etcd_endpoints.empty()) {  // Note [A store no node owns]
    env["SHARDFLOW_RDZV_BACKEND"] = "etcd";
    env["SHARDFLOW_RDZV_ENDPOINTS"] = etcd::join_endpoints(spec.etcd_endpoints);
    env["SHARDFLOW_RUN_ID"] = spec.rdzv_id;
  }
  if (spec.recovery != "restart") {  // Note [Recovering in place]: the ranks' side is the same for in-place and shrink
    env["SHARDFLOW_RECOVERY"] = "in-place";
    env["SHARDFLOW_RECOVERY_ROUND"] = std::to_string(ids.recovery_round);
    // A lost node is noticed after its heartbeat timeout (and up to two beats' polling), a rank
    // stopped by SIGSTOP after the same: the survivors wait that long for the word, and some more.
    const auto word = spec.heartbeat_timeout + 2 * spec.heartbeat_interval + std::chrono::seconds(5);
    env["SHARDFLOW_RECOVERY_WAIT_MS"] = std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(word).count());
  }
  if (!ids.snapshot_memory.empty()) env[snapshot_env::kMemory] = ids.snapshot_memory;
  if (!ids.snapshot_mirror.empty()) env[snapshot_env::kMirror] = ids.snapshot_mirror;
  // The ranks bind where this launcher chose (flags reach them as the variables they read).
  if (socket.origin == "--local-addr") env["SHARDFLOW_SOCKET_ADDR"] = socket.address;
  if (socket.origin == "--iface") env["SHARDFLOW_SOCKET_IFNAME"] = socket.ifname;
  // NCCL's bootstrap reads its own variable; one the user set wins.
  const char* nccl_ifname = std::getenv("NCCL_SOCKET_IFNAME");
  if (!socket.ifname.empty() && !(nccl_ifname && *nccl_ifname)) env["NCCL_SOCKET_IFNAME"] = socket.ifname;
  // N ranks share the node's cores: without a hint every rank's BLAS would use all of them.
  if (!std::getenv("OMP_NUM_THREADS")) {
    const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
    env["OMP_NUM_THREADS"] = std::to_string(std::max(1u, cores / unsigned(spec.nproc_per_node)));
  }
  return env;
}

std::string describe_status(int status) {
  if (WIFEXITED(status)) return "exited with status " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    const int sig = WTERMSIG(status);
    const char* abbrev = sigabbrev_np(sig);
    return "was killed by signal " + std::to_string(sig) + (abbrev ? std::string(" (SIG") + abbrev + ")" : "");
  }
  return "stopped (status " + std::to_string(status) + ")";
}

int exit_code_of(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status) ? WEXITSTATUS(status) : 1;
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

}  // namespace shardflow::launch
