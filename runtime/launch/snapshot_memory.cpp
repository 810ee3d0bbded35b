#include "runtime/launch/snapshot_memory.hpp"

#include <sys/stat.h>
#include <sys/vfs.h>

#include <filesystem>

#include <linux/magic.h>

namespace shardflow::launch {

SnapshotMemory::SnapshotMemory(pid_t launcher) {
  const std::string root = "/dev/shm";
  struct statfs fs {};
  // Only memory will do: on a disk the "memory" copy would cost what the disk snapshots cost.
  if (::statfs(root.c_str(), &fs) != 0 || fs.f_type != TMPFS_MAGIC) return;
  const std::string dir = root + "/shardflow-snapshots-" + std::to_string(launcher);
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);  // a launcher of this pid before us was killed: its leftovers
  if (::mkdir(dir.c_str(), 0700) == 0) path_ = dir;
}

SnapshotMemory::~SnapshotMemory() { remove(); }

void SnapshotMemory::remove() {
  if (path_.empty()) return;
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
  path_.clear();
}

}  // namespace shardflow::launch
