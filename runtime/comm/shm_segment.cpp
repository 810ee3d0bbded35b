#include "runtime/comm/shm_segment.hpp"

#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
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

// Note [Shared pages reserved and prefaulted]
// Two things about a segment's pages, both learned the hard way.
// - Reserved at creation. ftruncate only sets a tmpfs file's size; its pages are taken from
//   /dev/shm when first written. A /dev/shm too small for the job (Docker's default is 64 MiB)
//   then killed every rank with SIGBUS in the middle of its first backward, a crash that names
//   nothing. posix_fallocate takes the pages at creation instead, so a segment that does not fit
//   fails there, as a CommError naming it, what it needs and what /dev/shm has free.
// - Prefaulted where this process writes it whole. Reserving a page does not map it: each
//   process still faults every 4 KiB page into its own page table on first touch. On the project's
//   virtual machine that costs 2.8-4.1 ms a MiB (a shared page cannot be a transparent huge page
//   while /sys/kernel/mm/transparent_hugepage/shmem_enabled is `never`, the common default), and
//   a rank's buckets over two levels are all of its gradients: the first step of a job, and of
//   every round after an in-place recovery, paid it on every rank at once (1.36-1.76 s against a
//   0.68 s step at 2 hosts x 2 ranks with 64 MiB). MADV_POPULATE_WRITE maps the whole range in
//   one call, 1.5-2.2 ms a MiB there (bench/RESULTS.md, "Shared pages reserved and prefaulted").
//   Only the owner's buffers are prefaulted: the owner writes every byte of its buckets each
//   step, while a peer touches only the slices its collectives read (2/N of each at N ranks on
//   one host), so mapping a peer's whole segment would cost more than it saves. A kernel without
//   the advice (before 5.14) faults the pages in as before.
namespace {

#ifndef MADV_POPULATE_WRITE
constexpr int MADV_POPULATE_WRITE = 23;  // Linux 5.14; older headers lack the name
#endif

std::string mib_text(std::size_t bytes) { return std::to_string((bytes + (1u << 20) - 1) >> 20) + " MiB"; }

std::string shm_room() {
  struct statvfs vfs {};
  if (::statvfs("/dev/shm", &vfs) != 0) return "/dev/shm's free space unknown";
  return mib_text(std::size_t(vfs.f_bavail) * vfs.f_frsize) + " free of " + mib_text(std::size_t(vfs.f_blocks) * vfs.f_frsize) + " in /dev/shm";
}

[[noreturn]] void throw_no_room(const std::string& name, std::size_t bytes, const std::string& why) {
  throw CommError("shm: /dev/shm cannot hold '" + name + "' (" + mib_text(bytes) + ", " + shm_room() + "): " + why +
                  ". Give /dev/shm more room (mount -o remount,size=... /dev/shm; Docker: --shm-size; Kubernetes: an "
                  "emptyDir of medium Memory), lower ShmOptions::staging_bytes, or use --backend gloo; `shardflow doctor` "
                  "with the job's flags says what it needs");
}

}  // namespace

Segment::Segment(const std::string& name, bool create, std::size_t bytes, bool prefault) : name_(name) {
  if (create) bytes = std::max<std::size_t>(bytes, 64);
  const int fd = ::shm_open(name.c_str(), create ? (O_CREAT | O_EXCL | O_RDWR) : O_RDWR, 0600);
  if (fd < 0) throw CommError("shm: cannot " + std::string(create ? "create" : "open") + " shared memory '" + name + "': " + errno_text());
  if (create) {
    const auto fail = [&](const std::string& why) {
      ::close(fd);
      ::shm_unlink(name.c_str());
      throw_no_room(name, bytes, why);
    };
    if (::ftruncate(fd, off_t(bytes)) != 0) fail(errno_text());
    // Note [Shared pages reserved and prefaulted]: a full /dev/shm fails here, not as SIGBUS later.
    if (const int err = ::posix_fallocate(fd, 0, off_t(bytes)); err != 0) fail(std::strerror(err));
  }
  struct stat st {};
  ::fstat(fd, &st);
  bytes_ = std::size_t(st.st_size);
  void* p = ::mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  if (p == MAP_FAILED) throw CommError("shm: cannot map '" + name + "': " + errno_text());
  base_ = static_cast<char*>(p);
  // Advice: EINVAL (a kernel without it) leaves the pages to fault in on first touch, as before.
  if (prefault && ::madvise(base_, bytes_, MADV_POPULATE_WRITE) != 0 && errno != EINVAL) {
    const auto why = errno_text();
    ::munmap(base_, bytes_);
    if (create) ::shm_unlink(name.c_str());
    throw_no_room(name, bytes_, "mapping its pages failed: " + why);
  }
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
