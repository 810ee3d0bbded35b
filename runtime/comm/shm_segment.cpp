#include "runtime/comm/shm_segment.hpp"

#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "runtime/comm/shm_names.hpp"
#include "shardflow/errors.hpp"

namespace shardflow::shm {
namespace {

std::string errno_text() { return std::strerror(errno); }

}  // namespace

Segment::Segment(const std::string& name, bool create, std::size_t bytes) : name_(name) {
  if (create) bytes = std::max<std::size_t>(bytes, 64);
  const int fd = ::shm_open(name.c_str(), create ? (O_CREAT | O_EXCL | O_RDWR) : O_RDWR, 0600);
  if (fd < 0) throw CommError("shm: cannot " + std::string(create ? "create" : "open") + " shared memory '" + name + "': " + errno_text());
  if (create && ::ftruncate(fd, off_t(bytes)) != 0) {
    const auto why = errno_text();
    ::close(fd);
    ::shm_unlink(name.c_str());
    throw CommError("shm: cannot size '" + name + "' to " + std::to_string(bytes >> 20) + " MiB: " + why +
                    " (is /dev/shm large enough? ShmOptions::staging_bytes sets the per-rank share)");
  }
  struct stat st {};
  ::fstat(fd, &st);
  bytes_ = std::size_t(st.st_size);
  void* p = ::mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  if (p == MAP_FAILED) throw CommError("shm: cannot map '" + name + "': " + errno_text());
  base_ = static_cast<char*>(p);
}

Segment::~Segment() { ::munmap(base_, bytes_); }

void Segment::unlink() { ::shm_unlink(name_.c_str()); }

void futex_wait(std::atomic<std::uint32_t>* word, std::uint32_t expected, std::chrono::nanoseconds for_at_most) {
  timespec ts{};
  ts.tv_sec = time_t(for_at_most.count() / 1000000000);
  ts.tv_nsec = long(for_at_most.count() % 1000000000);
  syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}
void futex_wake_all(std::atomic<std::uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(word), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}

bool process_dead(std::int32_t pid) {
  if (pid <= 0) return false;
  if (::kill(pid, 0) == -1 && errno == ESRCH) return true;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(stat, line)) return false;
  const auto close = line.rfind(')');
  return close != std::string::npos && close + 2 < line.size() && line[close + 2] == 'Z';
}

std::string host_identity() {
  char name[256] = {};
  gethostname(name, sizeof(name) - 1);
  std::ifstream boot("/proc/sys/kernel/random/boot_id");
  std::string id;
  std::getline(boot, id);
  return std::string(name) + " (boot " + id + ")";
}

void sweep_stale_segments() {
  // Those of jobs whose rank 0 no longer runs.
  remove_segments_if([](long pid) { return ::kill(pid_t(pid), 0) == -1 && errno == ESRCH; });
}

namespace {
std::atomic<bool> hook_set{false};
std::function<void(int, BarrierPoint)>& hook_fn() {
  static std::function<void(int, BarrierPoint)> f;
  return f;
}
}  // namespace

void set_barrier_hook_for_tests(std::function<void(int rank, BarrierPoint at)> hook) {
  hook_set.store(false);
  hook_fn() = std::move(hook);
  hook_set.store(bool(hook_fn()));
}

void barrier_hook(int rank, BarrierPoint at) {
  if (hook_set.load(std::memory_order_acquire)) hook_fn()(rank, at);
}

}  // namespace shardflow::shm
