#include "runtime/launch/snapshot_memory.hpp"

#include <sys/stat.h>
#include <sys/vfs.h>

#include <cerrno>
#include <charconv>
#include <csignal>
#include <filesystem>

#include <linux/magic.h>

namespace shardflow::launch {

SnapshotMemory::SnapshotMemory(pid_t launcher) {
  const std::string root = "/dev/shm";
  struct statfs fs {};
  // Only memory will do: on a disk the "memory" copy would cost what the disk snapshots cost.
  if (::statfs(root.c_str(), &fs) != 0 || fs.f_type != TMPFS_MAGIC) return;
  const std::string prefix = "shardflow-snapshots-", dir = root + "/" + prefix + std::to_string(launcher);
  std::error_code ec;
  // A killed launcher cannot remove its memory (a lost host's launcher, a kill -9): the next one
  // on this host does, when that launcher's process is gone. One of this pid before us is gone too.
  for (const auto& e : std::filesystem::directory_iterator(root, ec)) {
    const auto name = e.path().filename().string();
    if (name.rfind(prefix, 0) != 0) continue;
    pid_t pid = 0;
    const char* end = name.data() + name.size();
    const auto [at, err] = std::from_chars(name.data() + prefix.size(), end, pid);
    if (err != std::errc() || at != end || pid <= 0) continue;
    if (pid == launcher || (::kill(pid, 0) != 0 && errno == ESRCH)) std::filesystem::remove_all(e.path(), ec);
  }
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
