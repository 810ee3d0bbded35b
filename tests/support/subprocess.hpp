// Child processes for the multi-process scenarios: start one with extra environment, read its
// merged stdout/stderr, wait with a deadline (killing it if it overstays), and know how long it ran.
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace shardflow::test {

class Child {
 public:
  Child(std::vector<std::string> argv, std::map<std::string, std::string> env = {}) {
    std::vector<std::string> envs;
    for (char** e = environ; *e; ++e) {
      std::string kv = *e;
      if (!env.count(kv.substr(0, kv.find('=')))) envs.push_back(kv);
    }
    for (auto& [k, v] : env) envs.push_back(k + "=" + v);
    std::vector<char*> a, ev;
    for (auto& s : argv) a.push_back(s.data());
    a.push_back(nullptr);
    for (auto& s : envs) ev.push_back(s.data());
    ev.push_back(nullptr);
    int p[2];
    if (::pipe2(p, O_CLOEXEC) != 0) throw std::runtime_error("pipe");
    start_ = std::chrono::steady_clock::now();
    pid_ = ::fork();
    if (pid_ == 0) {
      ::dup2(p[1], 1);
      ::dup2(p[1], 2);
      ::execve(a[0], a.data(), ev.data());
      ::_exit(127);
    }
    ::close(p[1]);
    fd_ = p[0];
  }
  ~Child() {
    if (!status_) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
    if (fd_ >= 0) ::close(fd_);
  }
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;

  pid_t pid() const { return pid_; }
  const std::string& output() const { return out_; }
  bool says(const std::string& what) const { return out_.find(what) != std::string::npos; }

  // Reads output until it contains `needle` (true) or the deadline passes / output ends (false).
  bool read_until(const std::string& needle, std::chrono::milliseconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (out_.find(needle) == std::string::npos) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0 || !read_some(int(left.count()))) return out_.find(needle) != std::string::npos;
    }
    return true;
  }

  // The wait status, or nullopt if it is still running at the deadline (then it is killed).
  std::optional<int> wait(std::chrono::milliseconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (!status_) {
      int st = 0;
      if (::waitpid(pid_, &st, WNOHANG) == pid_) {
        status_ = st;
        elapsed_ = std::chrono::steady_clock::now() - start_;
        break;
      }
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) {
        ::kill(pid_, SIGKILL);
        ::waitpid(pid_, nullptr, 0);
        status_ = -1;
        while (read_some(100)) {
        }
        return std::nullopt;
      }
      read_some(int(std::min<long>(left.count(), 50)));
    }
    while (read_some(200)) {  // the rest of the output (grandchildren may hold the pipe a moment)
    }
    return status_;
  }
  double seconds() const { return std::chrono::duration<double>(elapsed_).count(); }
  double seconds_since_start() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  }

 private:
  bool read_some(int timeout_ms) {
    if (fd_ < 0) return false;
    pollfd p{fd_, POLLIN, 0};
    if (::poll(&p, 1, timeout_ms) <= 0) return status_.has_value() ? false : true;
    char buf[4096];
    const ssize_t n = ::read(fd_, buf, sizeof buf);
    if (n <= 0) {
      ::close(fd_);
      fd_ = -1;
      return false;
    }
    out_.append(buf, std::size_t(n));
    return true;
  }

  pid_t pid_ = -1;
  int fd_ = -1;
  std::string out_;
  std::optional<int> status_;
  std::chrono::steady_clock::time_point start_;
  std::chrono::steady_clock::duration elapsed_{};
};

inline bool exited_ok(const std::optional<int>& st) { return st && *st >= 0 && WIFEXITED(*st) && WEXITSTATUS(*st) == 0; }
inline bool failed(const std::optional<int>& st) { return st && *st >= 0 && !(WIFEXITED(*st) && WEXITSTATUS(*st) == 0); }

}  // namespace shardflow::test
