#include "runtime/process/thread_priority.hpp"

#include <pthread.h>
#include <sched.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace shardflow {
namespace {
// The kernel's struct sched_attr (linux/sched/types.h clashes with glibc's sched.h).
struct SchedAttr {
  std::uint32_t size;
  std::uint32_t sched_policy;
  std::uint64_t sched_flags;
  std::int32_t sched_nice;
  std::uint32_t sched_priority;
  std::uint64_t sched_runtime, sched_deadline, sched_period;
};
}  // namespace

void runtime_thread_started(const char* name) {
  pthread_setname_np(pthread_self(), name);
  if (const char* off = std::getenv("SHARDFLOW_RUNTIME_THREAD_HINTS"); off && std::strcmp(off, "0") == 0) return;
  // A 100 us slice: the thread's virtual deadline comes early, so the scheduler runs it at
  // wake-up ahead of a trainer thread with the default 3 ms slice (Note [Runtime threads first]).
  SchedAttr attr{};
  attr.size = sizeof(attr);
  attr.sched_policy = SCHED_OTHER;
  attr.sched_runtime = 100 * 1000;  // ns
  const pid_t tid = pid_t(syscall(SYS_gettid));
  attr.sched_nice = -5;
  if (syscall(SYS_sched_setattr, tid, &attr, 0) != 0) {
    attr.sched_nice = 0;  // unprivileged: the slice alone
    (void)syscall(SYS_sched_setattr, tid, &attr, 0);
  }
}

}  // namespace shardflow
