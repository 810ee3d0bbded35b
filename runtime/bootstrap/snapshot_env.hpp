// What `shardflow run` tells its ranks about the memory their snapshots may go to, and how the
// launcher tells a rank that its file has a copy on the other host (Note [Snapshots in memory],
// runtime/checkpoint/snapshots.cpp; Note [Snapshots on the other host], runtime/launch/
// snapshot_mirror.hpp). Both sides read these names from here.
#pragma once

#include <string_view>

namespace shardflow::snapshot_env {

// A tmpfs directory the launcher holds for the whole job; the ranks' snapshots go to <it>/step-<N>/.
constexpr const char* kMemory = "SHARDFLOW_SNAPSHOT_MEMORY";
// Set when the launcher copies this host's snapshot files to the other node's memory: that node's
// label ("node 1 (host b, 10.0.0.2)"), for messages.
constexpr const char* kMirror = "SHARDFLOW_SNAPSHOT_MIRROR";
// Created next to a rank's file once the other host holds the copy: "<file>.mirrored".
constexpr std::string_view kMirroredSuffix = ".mirrored";
// In the memory directory while the launcher copies nothing, although the ranks were started
// with kMirror: the job went on without the other host (Note [A lost host healed in place],
// runtime/launch/lost_node_round.cpp), and a rank waiting for its files' copies would wait in vain.
constexpr const char* kNoCopies = "no-copies";
// In the memory directory while the launcher takes a node into the running job (Note [A node
// joins live], runtime/launch/grow_round.cpp): rank 0 looks for it at each snapshot into memory, and
// when it is there every rank completes that snapshot and goes on in the launcher's next round,
// at the larger world, from it (Runtime::recover).
constexpr const char* kRegroup = "regroup";
// Written there by the ranks once they decided to keep their snapshots in it (resumed_step): only
// then can the launcher take a node in live (a trainer without snapshots, or with them on disk
// only, never reaches a snapshot in memory to leave its iteration at).
constexpr const char* kInUse = "snapshots-kept-here";
// Written there with it where a node taken in live gets its state from the running ranks' memory
// (Note [A join from memory], runtime/checkpoint/twin_restore.cpp): the node before it then sends
// it only the snapshot's index, not the snapshot (which its ranks would not read). Not written
// with Config::snapshot.trainer_state: such a join goes back to the snapshot, which the newcomer
// must then hold.
constexpr const char* kJoinFromMemory = "joins-from-memory";
// Written there by a rank whose recover() refused to go on in place (Note [A round that did not
// heal], runtime/launch/rounds.cpp): the round it joined healed nothing, so it does not count as
// a restart, and every rank starts again instead of another round.
constexpr const char* kRefused = "recovery-refused";

// A rank's file in a snapshot: what the launcher copies (ckpt-<id>-rank<r>-of-<w>.safetensors).
inline bool is_shard_file(std::string_view name) {
  constexpr std::string_view prefix = "ckpt-", suffix = ".safetensors";
  return name.size() > prefix.size() + suffix.size() && name.substr(0, prefix.size()) == prefix &&
         name.substr(name.size() - suffix.size()) == suffix && name.find('/') == std::string_view::npos;
}

}  // namespace shardflow::snapshot_env
