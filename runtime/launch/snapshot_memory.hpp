// The memory a job's snapshots go to on this host (Note [Snapshots in memory],
// runtime/checkpoint/snapshots.cpp): a tmpfs directory the launcher creates before the first
// generation of ranks, names to every rank in SHARDFLOW_SNAPSHOT_MEMORY, keeps across restarts and
// removes when the job ends, however it ends. A killed launcher leaves it (/dev/shm/shardflow-
// snapshots-<its pid>); the next launcher on the host removes every one whose launcher is gone.
#pragma once

#include <sys/types.h>

#include <string>

namespace shardflow::launch {

class SnapshotMemory {
 public:
  // Under /dev/shm; where that is no tmpfs (or cannot be written) nothing is offered and path()
  // is empty: the ranks' snapshots then go to disk only, and their runtime says so.
  explicit SnapshotMemory(pid_t launcher);
  ~SnapshotMemory();
  SnapshotMemory(const SnapshotMemory&) = delete;
  SnapshotMemory& operator=(const SnapshotMemory&) = delete;

  const std::string& path() const { return path_; }
  void remove();

 private:
  std::string path_;
};

}  // namespace shardflow::launch
