// The launcher's copies of snapshot files to the next host (runtime/launch/snapshot_mirror.hpp,
// Note [Snapshots on the other host]), two mirrors on loopback: what goes over, and what stops.
#include <doctest/doctest.h>

#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "runtime/launch/snapshot_mirror.hpp"

using shardflow::launch::SnapshotMirror;
using namespace std::chrono_literals;
namespace fs = std::filesystem;

namespace {

fs::path scratch(const std::string& name) {
  const auto dir = fs::temp_directory_path() / ("shardflow_mirror_" + std::to_string(::getpid()) + "_" + name);
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

// A shard file of `bytes` (sparse: its zeros cost the disk nothing, the socket all of them).
void shard_file(const fs::path& path, std::uintmax_t bytes) {
  fs::create_directories(path.parent_path());
  std::ofstream(path).put('x');
  fs::resize_file(path, bytes);
}

// What the mirrors say (a copy that failed), from their threads.
struct Said {
  std::mutex mu;
  std::vector<std::string> lines;
  std::function<void(const std::string&)> sink() {
    return [this](const std::string& line) {
      std::lock_guard lock(mu);
      lines.push_back(line);
    };
  }
  bool nothing() {
    std::lock_guard lock(mu);
    for (const auto& l : lines) MESSAGE(l);
    return lines.empty();
  }
};

template <class F>
bool within(std::chrono::milliseconds limit, F&& f) {
  const auto end = std::chrono::steady_clock::now() + limit;
  while (!f()) {
    if (std::chrono::steady_clock::now() > end) return false;
    std::this_thread::sleep_for(1ms);
  }
  return true;
}

}  // namespace

// Note [Snapshots of a timeline left behind]
TEST_CASE("snapshot copies: a file removed while it is on its way to the other host stops there (the other host keeps no part of "
          "it) without a failure said and the file after it goes over") {
  const auto a = scratch("a"), b = scratch("b");
  Said said;
  SnapshotMirror from(a.string(), "127.0.0.1", "token", said.sink()), to(b.string(), "127.0.0.1", "token", said.sink());
  const std::string stale = "step-6/ckpt-0a1b2c3d-rank0-of-2.safetensors", next = "step-8/ckpt-4e5f6a7b-rank0-of-2.safetensors";
  shard_file(a / stale, std::uintmax_t(1) << 30);  // long enough on loopback to be caught on its way
  from.send_to(to.address(), "node 1", SnapshotMirror::Seed::none);
  REQUIRE(within(20s, [&] { return fs::exists(b / (stale + ".part")); }));
  fs::remove(a / stale);  // a rank's first on this host dropped its snapshot (snapshots.cpp)
  shard_file(a / next, 4096);
  REQUIRE(within(20s, [&] { return fs::exists(b / next) && fs::exists(a / (next + ".mirrored")); }));
  CHECK_FALSE(fs::exists(b / stale));
  CHECK(within(5s, [&] { return !fs::exists(b / (stale + ".part")); }));
  CHECK_FALSE(fs::exists(a / (stale + ".mirrored")));
  CHECK(said.nothing());  // not "snapshot copies to node 1 failed (...); retrying"
  fs::remove_all(a);
  fs::remove_all(b);
}

// Note [No copies behind the newest complete snapshot]
TEST_CASE("snapshot copies: a file of a snapshot older than the newest complete one here (a prune took its marker first) is "
          "not sent and a newer snapshot's file is") {
  const auto a = scratch("older_a"), b = scratch("older_b");
  Said said;
  const std::string older = "step-10/ckpt-0a1b2c3d-rank0-of-2.safetensors", complete = "step-20/ckpt-1a2b3c4d-rank0-of-2.safetensors",
                    newer = "step-30/ckpt-2a3b4c5d-rank0-of-2.safetensors";
  shard_file(a / older, 4096);  // its marker already gone: a prune on its way through step-10
  shard_file(a / complete, 4096);
  std::ofstream(a / (complete + ".mirrored")).put('\n');
  std::ofstream(a / "step-20" / "index.json") << R"({"files": ["ckpt-1a2b3c4d-rank0-of-2.safetensors"]})";
  shard_file(a / newer, 4096);
  SnapshotMirror from(a.string(), "127.0.0.1", "token", said.sink()), to(b.string(), "127.0.0.1", "token", said.sink());
  from.send_to(to.address(), "node 1", SnapshotMirror::Seed::none);
  REQUIRE(within(20s, [&] { return fs::exists(b / newer) && fs::exists(a / (newer + ".mirrored")); }));
  std::this_thread::sleep_for(100ms);  // five more of the sender's looks
  CHECK_FALSE(fs::exists(b / "step-10"));
  CHECK_FALSE(fs::exists(a / (older + ".mirrored")));
  CHECK(said.nothing());
  fs::remove_all(a);
  fs::remove_all(b);
}
