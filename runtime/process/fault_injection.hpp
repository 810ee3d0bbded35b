// Test hook for the failure matrix (scripts/soak.py, `make soak`): SHARDFLOW_TEST_FAULT =
// PHASE:RANK:ACTION:N makes the process whose RANK (the launcher's variable) is RANK kill itself
// with SIGKILL (ACTION kill) or stop itself with SIGSTOP (ACTION stop, a hang), or kill its
// launcher and then itself (ACTION host: a host lost, launcher and ranks at once) the N-th time it
// reaches PHASE: registration (Runtime::finalize), backward (a grad_ready), collective (a bucket's
// reduction starting on the comm stream), sync (a parameter sync starting there), checkpoint (a
// window of a consolidated save's state stream). It says so on stderr first, so the soak driver
// knows when the fault happened. Unset (every real run): one getenv at first use, then a branch.
#pragma once

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

namespace shardflow::test_fault {

struct Spec {
  bool armed = false;
  std::string phase;
  bool stop = false;
  bool host = false;  // the parent (shardflow run) first
  long at = 1;
};

inline const Spec& spec() {
  static const Spec s = [] {
    Spec out;
    const char* v = std::getenv("SHARDFLOW_TEST_FAULT");
    const char* rank = std::getenv("RANK");
    if (!v || !*v) return out;
    char phase[32] = {}, action[8] = {};
    int r = -1;
    long n = 1;
    if (std::sscanf(v, "%31[a-z]:%d:%7[a-z]:%ld", phase, &r, action, &n) < 3) return out;
    out.armed = rank && std::atoi(rank) == r;
    out.phase = phase;
    out.stop = std::strcmp(action, "stop") == 0;
    out.host = std::strcmp(action, "host") == 0;
    out.at = n;
    return out;
  }();
  return s;
}

// Whether this process has a fault to inject (call sites that must first work out their phase
// ask, so that an unarmed run pays one branch).
inline bool armed() { return spec().armed; }

inline void reached(const char* phase) {
  static std::atomic<long> seen{0};
  const auto& s = spec();
  if (!s.armed || s.phase != phase || ++seen != s.at) return;
  std::fprintf(stderr, "shardflow test fault: rank %s %s at %s #%ld\n", std::getenv("RANK"),
               s.stop ? "stops" : s.host ? "takes its host down" : "dies", phase, s.at);
  std::fflush(stderr);
  if (s.host) ::kill(::getppid(), SIGKILL);
  ::raise(s.stop ? SIGSTOP : SIGKILL);
}

}  // namespace shardflow::test_fault
