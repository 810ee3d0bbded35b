// Where the shared-memory backend's segments live: /dev/shm/shardflow-<pid>-<random>[-r<rank>-<serial>],
// <pid> being the world's rank 0 (it names the world at rendezvous). The backend unlinks the world
// segment once every rank mapped it, and each buffer when freed; a job that dies leaves its buffers.
// Those are removed by the launcher when the job ends (it knows its ranks' pids), or, without one,
// by the next shm job's rank 0 (any whose pid no longer runs). Header-only: the launcher does not
// link the library.
#pragma once

#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

namespace shardflow::shm {

inline std::string segment_prefix(long pid) { return "shardflow-" + std::to_string(pid) + "-"; }

// Unlinks every shardflow segment whose pid `doomed(pid)` picks; returns how many.
template <class Pred>
int remove_segments_if(Pred doomed) {
  namespace fs = std::filesystem;
  std::error_code ec;
  int removed = 0;
  for (const auto& e : fs::directory_iterator("/dev/shm", ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("shardflow-", 0) != 0) continue;
    const long pid = std::atol(name.c_str() + 10);
    if (pid > 0 && doomed(pid) && ::shm_unlink(("/" + name).c_str()) == 0) ++removed;
  }
  return removed;
}

// A finished job's: the launcher knows its ranks' pids.
inline int remove_segments_of(const std::vector<long>& pids) {
  return remove_segments_if([&](long pid) { return std::find(pids.begin(), pids.end(), pid) != pids.end(); });
}

}  // namespace shardflow::shm
