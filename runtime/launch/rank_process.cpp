#include "runtime/launch/rank_process.hpp"

#include <fcntl.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

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
    ::execvpe(argv[0], argv.data(), envp.data());
    [[maybe_unused]] auto w = ::write(STDERR_FILENO, exec_failed.data(), exec_failed.size());
    ::_exit(127);
  }
  ::setpgid(pid, pid);  // also here: no race with the first kill(-pid)
  ::close(out[1]);
  ::close(err[1]);
  return {pid, out[0], err[0]};
}

}  // namespace shardflow::launch
