// The trainers' snapshot flags, one definition for all of them (Note [Snapshots],
// runtime/checkpoint/snapshots.cpp): --snapshot-dir, --snapshot-every, --snapshot-disk-every and
// --no-snapshot-memory set Config::snapshot, and errors about those settings name these flags.
#pragma once

#include <CLI/CLI.hpp>

#include "shardflow/config.hpp"

namespace examples {

struct SnapshotFlags {
  bool no_memory = false;

  void add(CLI::App& app, shardflow::SnapshotConfig& s) {
    app.add_option("--snapshot-dir", s.dir,
                   "the runtime's own snapshots (sharded, in the background) go to DIR/step-<N>; a restarted job "
                   "(shardflow run --max-restarts) resumes from the newest complete one, and under --recovery in-place | shrink "
                   "the survivors go back to it in their processes; --steps counts from the start");
    app.add_option("--snapshot-every", s.every, "with --snapshot-dir: a snapshot every K steps")->capture_default_str();
    app.add_option("--snapshot-disk-every", s.disk_every,
                   "under shardflow run on one node snapshots go to memory the launcher holds, and every N steps to --snapshot-dir "
                   "(0: 10 x --snapshot-every)")
        ->capture_default_str();
    app.add_flag("--no-snapshot-memory", no_memory, "every snapshot to --snapshot-dir, none to the launcher's memory");
  }

  // Mirrored shards (Note [Mirrored shards]): recovery from memory with no step rolled back.
  void add_twins(CLI::App& app, int& redundancy, int& twin_distance) {
    app.add_option("--redundancy", redundancy,
                   "ZeRO 1-2: 2 keeps a twin of each rank's optimizer shard on another rank (another node's, under a launcher), so "
                   "that a lost rank's survivors go on from memory after the last finished step (needs --snapshot-dir)")
        ->capture_default_str();
    app.add_option("--twin-distance", twin_distance,
                   "--redundancy 2: a shard's twin lives this many ranks on (0: the ranks of one node when there are several nodes, else 1)")
        ->capture_default_str();
  }

  // After parsing.
  void apply(shardflow::Config& cfg) const {
    cfg.snapshot.memory = !no_memory;
    cfg.setting_names["zero.redundancy"] = "--redundancy";
    cfg.setting_names["zero.twin_distance"] = "--twin-distance";
    for (const auto& [setting, flag] : {std::pair{"snapshot.dir", "--snapshot-dir"}, std::pair{"snapshot.every", "--snapshot-every"},
                                        std::pair{"snapshot.disk_every", "--snapshot-disk-every"},
                                        std::pair{"snapshot.memory", "--no-snapshot-memory"}})
      cfg.setting_names[setting] = flag;
  }
};

}  // namespace examples
