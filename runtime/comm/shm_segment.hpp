// The operating system's side of the shared-memory backend: POSIX shared-memory segments, the
// futex the shared barrier sleeps on, and whether a peer's process is still alive.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

namespace shardflow::shm {

// A mapped POSIX shared-memory segment: created (sized, O_EXCL, its pages reserved in /dev/shm) or
// opened; unmapped when destroyed, unlinked only when asked (the other ranks may still map it).
// `prefault`: every page mapped into this process now, in one call (Note [Shared pages reserved
// and prefaulted]), for a segment this process writes whole.
class Segment {
 public:
  Segment(const std::string& name, bool create, std::size_t bytes, bool prefault = false);
  ~Segment();
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;
  char* base() const { return base_; }
  std::size_t bytes() const { return bytes_; }
  void unlink();

 private:
  std::string name_;
  char* base_ = nullptr;
  std::size_t bytes_ = 0;
};

// Sleeps while *word == expected, at most `for_at_most` (shared futex: the waiters are processes).
void futex_wait(std::atomic<std::uint32_t>* word, std::uint32_t expected, std::chrono::nanoseconds for_at_most);
void futex_wake_all(std::atomic<std::uint32_t>* word);

// Gone, or a zombie nobody has reaped yet: either way it will never arrive.
bool process_dead(std::int32_t pid);

// This host's name and boot id: ranks that disagree are not on one host (and cannot share memory).
std::string host_identity();

// Tests only: the shm barrier calls `hook(rank, at)` between marking the rank arrived and counting
// it (counting), and between a rank taking its mark back and failing the barrier (leaving) (Note
// [Leaving the barrier]); an empty one removes it. Set it while no collective runs.
enum class BarrierPoint { counting, leaving };
void set_barrier_hook_for_tests(std::function<void(int rank, BarrierPoint at)> hook);
void barrier_hook(int rank, BarrierPoint at);  // the barrier's call: one atomic load when no hook is set

// Removes segments of earlier jobs whose owner process is gone (a job killed with SIGKILL cannot
// unlink its registered buffers). Names: shardflow-<pid of rank 0>-<random>[-r<rank>-<serial>].
void sweep_stale_segments();

}  // namespace shardflow::shm
