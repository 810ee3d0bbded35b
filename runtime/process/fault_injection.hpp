// Test hook for the failure matrix (scripts/soak.py, `make soak`): SHARDFLOW_TEST_FAULT =
// PHASE:RANK:ACTION:N makes the process whose RANK (the launcher's variable) is RANK kill itself
// with SIGKILL (ACTION kill) or stop itself with SIGSTOP (ACTION stop, a hang), or kill its
// launcher and then itself (ACTION host: a host lost, launcher and ranks at once), or says that its
// host is to be cut off and goes on (ACTION cut: the soak driver takes the host's link down on that
// line, and the rank pauses 0.5 s so that the cut lands in the phase named) the N-th time it
// reaches PHASE: registration (Runtime::finalize), backward (a grad_ready), collective (a bucket's
// reduction issued by the comm stream, once whatever the backend makes of it), sync (a parameter
// sync issued there), checkpoint (a window of a consolidated save's state stream), barrier (the
// shm backend's, between marking this rank arrived and counting it: Note [A rank dead inside the
// barrier]). It says so on stderr first, so the soak driver knows when the fault happened. Unset
// (every real run): one getenv at first use, then a branch.
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
  bool cut = false;   // nothing killed: the driver cuts the host's link
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
    out.cut = std::strcmp(action, "cut") == 0;
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
               s.stop ? "stops" : s.host ? "takes its host down" : s.cut ? "has its host cut off" : "dies", phase, s.at);
  std::fflush(stderr);
  if (s.cut) {
    ::usleep(500 * 1000);
    return;
  }
  if (s.host) ::kill(::getppid(), SIGKILL);
  ::raise(s.stop ? SIGSTOP : SIGKILL);
}

// A collective the runtime issues (actors/comm_stream_actor.cpp), counted once whatever the
// backend makes of it: two levels run each as several stages, which counted each stage once put
// the soak's fault steps earlier at two levels than on the flat ring.
inline void issuing(const std::string& tag) {
  if (!armed()) return;
  if (tag.rfind("bucket ", 0) == 0) reached("collective");
  if (tag.rfind("sync bucket", 0) == 0) reached("sync");
}

}  // namespace shardflow::test_fault
